"""The runtime a user runs is small and visible, and its oracles stand apart from it (issue #44).

The runtime is ``core/*.py`` and ``core/policies/*.py``. Not in it: ``core/reference/`` (the oracles: invariant
checkers, CrossHair's predicates, the recounts of the maintained views, the reference compact planner) and
``core/sim/`` (the simulator). Two rules, read from the source:

* size: at most 3,500 lines of code in the runtime, and as many in ``integration/bench/*.py``; a line of code
  holds a token that is not a comment and not part of a module, class or function docstring (blank lines do
  not count either);
* direction: no runtime module imports ``vtoken.core.reference`` when it is imported (core/reference/__init__.py
  states the rule; an opt-in self-check may import an oracle inside a function). tests/test_import_rule.py
  checks the package graph, lazy imports included.
"""

from __future__ import annotations

import ast
import io
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUNTIME_BUDGET = 3500
BENCH_BUDGET = 3500
REFERENCE = "vtoken.core.reference"


def runtime_modules() -> list[Path]:
    return sorted([*(ROOT / "core").glob("*.py"), *(ROOT / "core" / "policies").glob("*.py")])


def code_lines(source: str) -> int:
    """Lines holding a token other than a comment, outside the module's, classes' and functions' docstrings."""
    tree = ast.parse(source)
    docstrings: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            first = node.body[0] if node.body else None
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                docstrings.update(range(first.lineno, first.end_lineno + 1))
    layout = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER}
    lines: set[int] = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type not in layout:
            lines.update(n for n in range(tok.start[0], tok.end[0] + 1) if n not in docstrings)
    return len(lines)


def counts(paths: list[Path]) -> dict[str, int]:
    return {str(p.relative_to(ROOT)): code_lines(p.read_text()) for p in paths}


def table(per_file: dict[str, int]) -> str:
    return "\n".join(f"{n:6d} {path}" for path, n in sorted(per_file.items())) + f"\n{sum(per_file.values()):6d} total"


def test_code_lines_leave_out_docstrings_comments_and_blank_lines():
    source = '''"""Module docstring,
over two lines."""

import os  # a comment


class A:
    """Class docstring."""

    x = ("a string that is no docstring"
         "and spans two lines")

    def f(self):
        """Function docstring."""
        # a comment alone
        return os.sep
'''
    assert code_lines(source) == 6  # import, class, x (two lines), def, return


def test_the_runtime_is_at_most_3500_lines_of_code():
    per_file = counts(runtime_modules())
    assert "core/runtime.py" in per_file and "core/policies/h2o.py" in per_file
    assert not any(p.startswith(("core/reference/", "core/sim/")) for p in per_file)
    assert sum(per_file.values()) <= RUNTIME_BUDGET, f"the runtime is over {RUNTIME_BUDGET} lines of code:\n" \
                                                     + table(per_file)


def test_the_bench_is_at_most_3500_lines_of_code():
    per_file = counts(sorted((ROOT / "integration" / "bench").glob("*.py")))
    assert len(per_file) > 10
    assert sum(per_file.values()) <= BENCH_BUDGET, f"integration/bench is over {BENCH_BUDGET} lines of code:\n" \
                                                   + table(per_file)


# ---- the import direction ------------------------------------------------------------------------------------
def module_level_imports(source: str, package: str) -> list[tuple[int, str]]:
    """(line, absolute module) of every import run when the module is imported: at its top level, in a class body,
    under an ``if`` or a ``try``; not one inside a function. ``package``: the module's package, for relative
    imports (``from .reference import x`` counts ``<package>.reference`` and ``<package>.reference.x``)."""
    found: list[tuple[int, str]] = []

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                continue
            if isinstance(child, ast.Import):
                found.extend((child.lineno, a.name) for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = package.split(".")[: len(package.split(".")) - child.level + 1] if child.level else []
                target = ".".join(base + ([child.module] if child.module else []))
                found.extend([(child.lineno, target)] + [(child.lineno, f"{target}.{a.name}") for a in child.names])
            visit(child)

    visit(ast.parse(source))
    return found


def reference_imports(sources: dict[str, str]) -> list[str]:
    """``path:line imports module`` for every module-level import of the oracles by a runtime module."""
    bad = []
    for path, source in sorted(sources.items()):
        package = "vtoken.core.policies" if path.startswith("core/policies/") else "vtoken.core"
        for line, module in module_level_imports(source, package):
            if module == REFERENCE or module.startswith(REFERENCE + "."):
                bad.append(f"{path}:{line} imports {module}")
    return bad


def runtime_sources() -> dict[str, str]:
    return {str(p.relative_to(ROOT)): p.read_text() for p in runtime_modules()}


def test_no_runtime_module_imports_the_oracles_when_it_is_imported():
    assert reference_imports(runtime_sources()) == []


def test_the_direction_rule_names_a_planted_import_and_allows_a_lazy_one():
    sources = runtime_sources()
    sources["core/runtime.py"] += "\nfrom .reference import invariants\n"
    sources["core/compact.py"] += "\ntry:\n    import vtoken.core.reference.views\nexcept ImportError:\n    pass\n"
    sources["core/policies/h2o.py"] += "\nclass X:\n    from ..reference.contracts import _position\n"
    sources["core/plan.py"] += "\ndef lazy():\n    from .reference import compact\n"
    n = {p: s.count("\n") for p, s in sources.items()}
    assert reference_imports(sources) == [
        f"core/compact.py:{n['core/compact.py'] - 2} imports vtoken.core.reference.views",
        f"core/policies/h2o.py:{n['core/policies/h2o.py']} imports vtoken.core.reference.contracts",
        f"core/policies/h2o.py:{n['core/policies/h2o.py']} imports vtoken.core.reference.contracts._position",
        f"core/runtime.py:{n['core/runtime.py']} imports vtoken.core.reference",
        f"core/runtime.py:{n['core/runtime.py']} imports vtoken.core.reference.invariants",
    ]
