"""The ``vtoken`` command. Subcommands come from the ``vtoken.commands`` entry-point group.

Each layer registers its own subcommand (core: ``demo``; later ``fuzz``,
``spec``, ``bench``), so this module imports nothing above core.
"""

from __future__ import annotations

import argparse
import sys
from importlib.metadata import entry_points
from typing import Sequence


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vtoken", description="Token-level KV-cache virtualization for PagedAttention.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for ep in sorted(entry_points(group="vtoken.commands"), key=lambda e: e.name):
        ep.load()(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "run", None):
        parser.print_help()
        return 2
    return int(args.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
