"""What a question gets to run with: the settings, the shared run cache, progress bars, the output folder."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from .measure import RunCache
from .progress import Progress
from .settings import BenchSettings


@dataclass
class BenchContext:
    settings: BenchSettings
    out_dir: Path
    command: str = "vtoken bench sim"
    stream: TextIO = field(default_factory=lambda: sys.stderr)
    cache: RunCache = field(default_factory=RunCache)

    def progress(self, label: str, total: int) -> Progress:
        return Progress(label, total, self.stream)
