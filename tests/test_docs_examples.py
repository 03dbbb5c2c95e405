"""Every code block of README.md and docs/*.md runs, or is checked, here (issue #44).

* ```python blocks run, each in a fresh namespace with the repository root as working directory; a
  failure names the block (``README.md:63``) and its traceback the markdown line.
* ```sh / ```bash / ```console blocks are checked without running them, one test per command:
  ``vtoken ...`` parses with the real CLI parser (``build_parser()``; ``--help`` is fine), a ``vtoken serve``
  line's ``--additional-config`` passes vtoken's settings check; ``python X.py`` names an existing script (and
  only flags the script declares, where it declares its own with argparse); ``python -m M`` names an
  importable module (and parses with ``M._parser()``/``M.build_parser()`` for vtoken's own modules);
  ``make T`` names a Makefile target; ``pytest``/``python -m pytest`` name existing paths. Comments,
  ``\\`` continuations, ``FOO=1`` prefixes, ``nohup``, redirections and ``&&``/``|``/``;`` are handled.
  Any other command kind must lead with a word in ``OTHER_COMMANDS`` (one test), so a new kind is a decision.
* ```text blocks (diagrams, traces, output) are not checked; an untagged fence is an error: tag it.

A block that cannot run (a model, a GPU, a server) is marked on the line before its fence with
``<!-- not run: the reason -->``; it is then skipped with that reason, which ``-ra`` lists. Keep them rare.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib
import importlib.util
import io
import json
import re
import shlex
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

PYTHON_LANGS = {"python", "py"}
SHELL_LANGS = {"sh", "bash", "console"}
TEXT_LANGS = {"text"}
#: leading words of the shell commands that are not checked (everything but vtoken, python, pytest, make):
#: adding one here is the decision that docs may show that kind of command unchecked
OTHER_COMMANDS = {"cd", "mutmut", "pip", "git", "curl"}

VTOKEN = {"vtoken", ".venv/bin/vtoken"}
PYTHON = {"python", "python3", ".venv/bin/python", ".venv/bin/python3"}
PYTEST = {"pytest", ".venv/bin/pytest"}
WRAPPERS = {"nohup", "time", "env", "exec"}
OPERATORS = {"&&", "||", "|", ";", "&"}
REDIRECT = re.compile(r"(\d*|&)(>>?|<)(?P<dup>&?)(?P<target>.*)")  # `> f`, `2>&1`, `>f`, `&>f`
NOT_RUN = re.compile(r"^\s*<!--\s*not run:\s*(?P<reason>.*?)\s*-->\s*$")
FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})(?P<info>.*)$")


# ---- reading the markdown --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # the opening fence's line (1-based); the body starts on the next line
    lang: str
    body: tuple[str, ...]
    skip: str | None  # the reason of a `<!-- not run: ... -->` on the line before the fence
    closed: bool = True

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def read_blocks(path: Path) -> list[Block]:
    lines = path.read_text(encoding="utf-8").split("\n")
    blocks, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence = len(m["indent"]), m["fence"]
        skip = NOT_RUN.match(lines[i - 1]) if i else None
        body, j = [], i + 1
        while j < len(lines):
            c = FENCE.match(lines[j])
            if c and c["fence"][0] == fence[0] and len(c["fence"]) >= len(fence) and not c["info"].strip():
                break
            body.append(lines[j][indent:] if lines[j][:indent].strip() == "" else lines[j].lstrip())
            j += 1
        info = m["info"].strip().split()
        blocks.append(Block(path, i + 1, info[0].lower() if info else "", tuple(body),
                            skip["reason"] if skip else None, closed=j < len(lines)))
        i = j + 1
    return blocks


BLOCKS = [b for p in DOCS for b in read_blocks(p)]
PYTHON_BLOCKS = [b for b in BLOCKS if b.lang in PYTHON_LANGS]
SHELL_BLOCKS = [b for b in BLOCKS if b.lang in SHELL_LANGS]


@dataclass(frozen=True)
class Command:
    block: Block
    line: int
    text: str  # as written (continuations joined)
    argv: tuple[str, ...]  # env prefixes, wrappers and redirections removed
    error: str | None = None  # the line does not split as the shell would

    @property
    def where(self) -> str:
        return f"{self.block.path.relative_to(ROOT)}:{self.line}"


def read_commands(block: Block) -> list[Command]:
    """The block's commands: one logical line at a time (``\\`` joins lines), split at ``&&``, ``||``, ``|``,
    ``;``, ``&``. In a ```console block only ``$ `` lines are commands (the rest is output)."""
    out, k, body = [], 0, block.body
    while k < len(body):
        line_no, text = block.line + 1 + k, body[k]
        k += 1
        if block.lang == "console":
            if not text.startswith("$ "):
                continue
            text = text[2:]
        while text.rstrip().endswith("\\") and k < len(body):
            text = text.rstrip()[:-1] + " " + body[k].strip()
            k += 1
        try:
            words = shlex.split(text, comments=True)
        except ValueError as e:
            out.append(Command(block, line_no, text, (), f"does not split as sh would: {e}"))
            continue
        cmd: list[str] = []
        for w in [*words, ";"]:
            if w in OPERATORS:
                if cmd:
                    out.append(Command(block, line_no, text, tuple(_bare(cmd))))
                cmd = []
            else:
                cmd.append(w)
    return [c for c in out if c.argv or c.error]


def _bare(words: list[str]) -> list[str]:
    """Without redirections (and their targets), ``FOO=1`` prefixes and wrappers (``nohup``, ``time``)."""
    argv, skip_next = [], False
    for w in words:
        if skip_next:
            skip_next = False
        elif m := REDIRECT.fullmatch(w):
            skip_next = not m["dup"] and not m["target"]  # `>` alone: its target is the next word
        else:
            argv.append(w)
    while argv and (re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", argv[0]) or argv[0] in WRAPPERS):
        argv.pop(0)
    return argv


COMMANDS = [c for b in SHELL_BLOCKS for c in read_commands(b)]


def kind(argv: tuple[str, ...]) -> str:
    head = argv[0]
    if head in VTOKEN:
        return "vtoken"
    if head in PYTHON:
        if argv[1:3] == ("-m", "pytest"):
            return "pytest"
        return "python"
    if head in PYTEST:
        return "pytest"
    if head == "make":
        return "make"
    return "other"


CHECKED = [c for c in COMMANDS if c.error or kind(c.argv) != "other"]


# ---- the checks ---------------------------------------------------------------------------------------------
@cache
def vtoken_parser() -> tuple[argparse.ArgumentParser, frozenset[str]]:
    from vtoken.core.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    unavailable = frozenset(a.dest for a in sub._choices_actions if str(a.help).startswith("(unavailable"))
    return parser, unavailable


def parse(parser: argparse.ArgumentParser, args: list[str], where: str) -> argparse.Namespace | None:
    """parse_args, failing with argparse's message; ``--help`` (exit 0) returns None."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            return parser.parse_args(args)
        except SystemExit as e:
            code = e.code
    if code not in (0, None):
        pytest.fail(f"{where}: {shlex.join(args)!r} does not parse: {err.getvalue().strip()}")
    return None


def check_vtoken(cmd: Command) -> None:
    parser, unavailable = vtoken_parser()
    args = list(cmd.argv[1:])
    if args and args[0] in unavailable:
        pytest.fail(f"{cmd.where}: `vtoken {args[0]}` is unavailable in this install (its register failed to import)")
    ns = parse(parser, args, cmd.where)
    if ns is not None and getattr(ns, "command", None) == "serve":
        check_serve_config(cmd, ns.vllm_args)


def check_serve_config(cmd: Command, argv: list[str]) -> None:
    """vLLM's own parser is too slow to build here (~10-30 s); vtoken's part of it, the settings, is checked."""
    from vtoken.integration.vllm.settings import VTokenSettings

    for i, a in enumerate(argv):
        value = (argv[i + 1] if a == "--additional-config" and i + 1 < len(argv)
                 else a.split("=", 1)[1] if a.startswith("--additional-config=") else None)
        if value is None:
            continue
        try:
            VTokenSettings.from_additional_config(json.loads(value))
        except Exception as e:  # noqa: BLE001  (JSON or settings: either is a broken example)
            pytest.fail(f"{cmd.where}: --additional-config {value!r}: {type(e).__name__}: {e}")


PYTEST_VALUED = {"-k", "-m", "-p", "-c", "-o", "-n", "-W", "--rootdir", "--maxfail", "--durations", "--basetemp",
                 "--deselect", "--ignore", "--junitxml", "--tb"}


def check_pytest(cmd: Command) -> None:
    args = list(cmd.argv[3:] if cmd.argv[0] in PYTHON else cmd.argv[1:])
    paths, skip = [], False
    for a in args:
        if skip:
            skip = False
        elif a.startswith("-"):
            skip = a in PYTEST_VALUED
        else:
            paths.append(a.split("::")[0])
    missing = [p for p in paths if not (ROOT / p).exists()]
    assert not missing, f"{cmd.where}: pytest paths that do not exist: {missing}"


def check_python(cmd: Command) -> None:
    args = list(cmd.argv[1:])
    if args[:1] == ["-m"] and len(args) > 1:
        check_module(cmd, args[1], args[2:])
    elif args and args[0].endswith(".py"):
        check_script(cmd, args[0], args[1:])
    else:
        pytest.fail(f"{cmd.where}: a python command that is neither `python X.py` nor `python -m M`: "
                    f"{cmd.text!r} (teach tests/test_docs_examples.py to check it)")


def check_module(cmd: Command, module: str, args: list[str]) -> None:
    try:
        found = importlib.util.find_spec(module)
    except ModuleNotFoundError:
        found = None
    assert found is not None, f"{cmd.where}: `python -m {module}`: no such module"
    if module.split(".")[0] == "vtoken":  # ours: cheap to import, and a parser function is the cheap route
        mod = importlib.import_module(module)
        make = getattr(mod, "build_parser", None) or getattr(mod, "_parser", None)
        if callable(make):
            parse(make(), args, cmd.where)


@cache
def declared_flags(script: Path) -> frozenset[str] | None:
    """The option strings the script's own add_argument calls declare (None: it declares none)."""
    flags = set()
    for node in ast.walk(ast.parse(script.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument":
            flags |= {a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)
                      and a.value.startswith("-")}
    return frozenset(flags) or None


def check_script(cmd: Command, script: str, args: list[str]) -> None:
    path = ROOT / script
    assert path.is_file(), f"{cmd.where}: `{cmd.argv[0]} {script}`: no such file"
    flags = declared_flags(path)
    if flags is None:
        return
    given = [a.split("=", 1)[0] for a in args if a.startswith("--") and a != "--"]
    unknown = [f for f in given if f not in flags and len([d for d in flags if d.startswith(f)]) != 1]
    assert not unknown, f"{cmd.where}: {script} declares no {unknown} (it declares {sorted(flags)})"


@cache
def make_targets() -> frozenset[str]:
    targets = set()
    for line in (ROOT / "Makefile").read_text(encoding="utf-8").splitlines():
        m = re.match(r"^([A-Za-z0-9_.$()/ -]+?)\s*::?(?!=)", line)
        if m and not line.startswith("\t"):
            targets |= set(m[1].split())
    return frozenset(targets)


def check_make(cmd: Command) -> None:
    goals = [a for a in cmd.argv[1:] if not a.startswith("-") and "=" not in a]
    missing = [g for g in goals if g not in make_targets()]
    assert not missing, f"{cmd.where}: no Makefile target {missing}"


CHECKS = {"vtoken": check_vtoken, "pytest": check_pytest, "python": check_python, "make": check_make}


# ---- the tests ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("block", PYTHON_BLOCKS, ids=[b.where for b in PYTHON_BLOCKS])
def test_python_block_runs(block: Block, monkeypatch: pytest.MonkeyPatch) -> None:
    if block.skip:
        pytest.skip(f"{block.where}: not run: {block.skip}")
    monkeypatch.chdir(ROOT)
    code = "\n" * block.line + "\n".join(block.body)  # the traceback's line numbers are the markdown's
    exec(compile(code, str(block.path), "exec"), {"__name__": "__main__"})


@pytest.mark.parametrize("cmd", CHECKED, ids=[c.where for c in CHECKED])
def test_shell_command_is_valid(cmd: Command) -> None:
    if cmd.block.skip:
        pytest.skip(f"{cmd.where}: not checked: {cmd.block.skip}")
    assert cmd.error is None, f"{cmd.where}: {cmd.text!r} {cmd.error}"
    CHECKS[kind(cmd.argv)](cmd)


def test_other_commands_are_known_kinds() -> None:
    found = {}
    for c in COMMANDS:
        if not c.error and kind(c.argv) == "other":
            found.setdefault(c.argv[0], c.where)
    new = {w: where for w, where in found.items() if w not in OTHER_COMMANDS}
    assert not new, (f"commands of a kind nobody checks: {new}; check them here, or add the leading word to "
                     f"OTHER_COMMANDS")


def test_vtoken_subcommands_all_load() -> None:
    """A subcommand whose entry point fails to import parses anything (cli._unavailable): that would hide errors."""
    assert not vtoken_parser()[1]


@pytest.mark.parametrize("block", BLOCKS, ids=[b.where for b in BLOCKS])
def test_fence_is_tagged_and_closed(block: Block) -> None:
    assert block.closed, f"{block.where}: the fence is never closed"
    known = PYTHON_LANGS | SHELL_LANGS | TEXT_LANGS
    assert block.lang in known, (f"{block.where}: fence tagged {block.lang!r}: tag it python (runs), sh/bash/console "
                                 f"(checked) or text (not checked)")


def test_not_run_markers_sit_on_a_fence() -> None:
    stray = []
    for path in DOCS:
        lines = path.read_text(encoding="utf-8").split("\n")
        for i, line in enumerate(lines):
            if NOT_RUN.match(line) and not (i + 1 < len(lines) and FENCE.match(lines[i + 1])):
                stray.append(f"{path.relative_to(ROOT)}:{i + 1}")
            elif NOT_RUN.match(line) and not NOT_RUN.match(line)["reason"]:
                stray.append(f"{path.relative_to(ROOT)}:{i + 1} (no reason)")
    assert not stray, f"`<!-- not run: reason -->` must give a reason and sit on the line before a fence: {stray}"


def test_every_doc_is_read() -> None:
    """The collection above found the blocks it should (a broken fence regex would find none)."""
    assert {p.name for p in DOCS} >= {"README.md", "architecture.md", "spec.md", "device.md"}
    assert PYTHON_BLOCKS and COMMANDS
    assert any(b.path.name == "README.md" and b.lang == "python" for b in PYTHON_BLOCKS)
