"""A dependency-free progress bar on stderr: one line, redrawn in place on a terminal,
a line per 10 % otherwise (so logs stay short)."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    def __init__(self, label: str, total: int, stream: TextIO | None = None, width: int = 28) -> None:
        assert total >= 0, f"progress total must be >= 0, got {total}"
        self.label, self.total, self.width = label, total, width
        self.stream = stream if stream is not None else sys.stderr
        self.done = 0
        self.started = time.monotonic()
        self._tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._last_decile = -1

    def advance(self, note: str = "", n: int = 1) -> None:
        self.done = min(self.total, self.done + n)
        frac = self.done / self.total if self.total else 1.0
        if self._tty:
            filled = int(frac * self.width)
            bar = "#" * filled + "." * (self.width - filled)
            self.stream.write(f"\r{self.label} [{bar}] {self.done}/{self.total} "
                              f"{time.monotonic() - self.started:6.1f}s {note[:40]:<40}")
            self.stream.flush()
        elif int(frac * 10) > self._last_decile:
            self._last_decile = int(frac * 10)
            self.stream.write(f"{self.label} {self.done}/{self.total} ({frac:.0%}) "
                              f"{time.monotonic() - self.started:.1f}s {note}\n")
            self.stream.flush()

    def close(self) -> float:
        """Finish the line; returns the elapsed seconds."""
        elapsed = time.monotonic() - self.started
        if self._tty:
            self.stream.write("\n")
        self.stream.write(f"{self.label} done in {elapsed:.1f}s\n")
        self.stream.flush()
        return elapsed
