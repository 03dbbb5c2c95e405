"""Imports flow one way (docs/architecture.md), read from the import graph of every module of the distribution.

    vtoken.core  <-  vtoken.core.reference  <-  vtoken.core.sim, vtoken.spec, vtoken.integration.bench
    vtoken.core  <-  vtoken.core.sim, vtoken.spec
    vtoken.core  <-  vtoken.integration.device  <-  vtoken.integration.vllm  <-  vtoken.integration.bench
    vtoken.core  <-  vtoken.integration.fastpath  <-  vtoken.integration.vllm, vtoken.integration.bench
    vtoken.fuzz may import any of them; nothing imports vtoken.fuzz

Every import counts, also one inside a function (the lazy imports of torch- and vLLM-facing code are still
dependencies). The scan is ``ast`` over the files, so a module need not be importable to be checked. The one
import against the arrows, vtoken.core's of its oracles (vtoken.core.reference), is allowed here because it is
inside an opt-in self-check; tests/test_layout.py refuses one at module level.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_DIRS = {"core": "vtoken.core", "spec": "vtoken.spec", "integration": "vtoken.integration",
                "fuzz": "vtoken.fuzz"}
# layer -> the layers it may import (besides itself); most specific first
MAY_IMPORT = {
    "vtoken.core.sim": {"vtoken.core", "vtoken.core.reference"},
    "vtoken.core.reference": {"vtoken.core"},  # the oracles (core/reference/__init__.py)
    # NOTE: only inside a function, for an opt-in self-check: tests/test_layout.py refuses a module-level import
    "vtoken.core": {"vtoken.core.reference"},
    "vtoken.spec": {"vtoken.core", "vtoken.core.reference", "vtoken.core.sim"},
    "vtoken.integration.device": {"vtoken.core"},
    "vtoken.integration.fastpath": {"vtoken.core"},  # the compiled fast path: the core's errors, plans, checks
    "vtoken.integration.vllm": {"vtoken.core", "vtoken.integration.device", "vtoken.integration.fastpath"},
    "vtoken.integration.bench": {"vtoken.core", "vtoken.core.reference", "vtoken.core.sim",
                                 "vtoken.integration.device", "vtoken.integration.fastpath", "vtoken.integration.vllm"},
    "vtoken.integration": set(),
    "vtoken.fuzz": {"vtoken.core", "vtoken.core.reference", "vtoken.core.sim", "vtoken.spec",
                    "vtoken.integration.device", "vtoken.integration.fastpath", "vtoken.integration.vllm",
                    "vtoken.integration.bench"},
}


def layer(module: str) -> str | None:
    for name in MAY_IMPORT:
        if module == name or module.startswith(name + "."):
            return name
    return None


def module_name(rel: Path) -> tuple[str, bool]:
    """(dotted module, is a package ``__init__``) of a file relative to the repository root."""
    parts = list(rel.with_suffix("").parts)
    dotted = PACKAGE_DIRS[parts[0]].split(".") + parts[1:]
    is_package = dotted[-1] == "__init__"
    return ".".join(dotted[:-1] if is_package else dotted), is_package


def imported(source: str, module: str, is_package: bool) -> list[str]:
    """Every vtoken module ``source`` imports (absolute names; ``from X import y`` counts X and X.y)."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            out += [target] + [f"{target}.{a.name}" for a in node.names]
    return [m for m in out if m.split(".")[0] == "vtoken"]


def violations(sources: dict[Path, str]) -> list[str]:
    """``path: layer imports target`` for every import the rule forbids."""
    bad = []
    for rel, source in sorted(sources.items()):
        module, is_package = module_name(rel)
        mine = layer(module)
        assert mine is not None, f"{rel}: module {module} is in no layer"
        for target in imported(source, module, is_package):
            theirs = layer(target)
            if theirs is not None and theirs != mine and theirs not in MAY_IMPORT[mine]:
                bad.append(f"{rel}: {mine} imports {target}")
    return sorted(set(bad))


def tree() -> dict[Path, str]:
    return {p.relative_to(ROOT): p.read_text() for d in PACKAGE_DIRS for p in (ROOT / d).rglob("*.py")
            if "models" not in p.relative_to(ROOT).parts and "__pycache__" not in p.parts}


def test_imports_flow_one_way():
    sources = tree()
    assert len(sources) > 90  # every package was found
    assert violations(sources) == []


def test_the_rule_names_a_planted_violation():
    sources = tree()
    sources[Path("core/runtime.py")] += "\ndef _lazy():\n    from vtoken.core.sim import simulator\n"
    sources[Path("integration/device/verify.py")] += "\nfrom ..vllm import settings\n"
    sources[Path("integration/bench/stats.py")] += "\nimport vtoken.fuzz.machine\n"
    sources[Path("spec/cli.py")] += "\nfrom vtoken.integration.device import kv_cache\n"
    sources[Path("core/reference/views.py")] += "\nfrom ..sim import simulator\n"
    sources[Path("integration/vllm/settings.py")] += "\nfrom vtoken.core.reference import invariants\n"
    sources[Path("integration/fastpath/layout.py")] += "\nfrom ..device import kv_cache\n"
    sources[Path("core/checks.py")] += "\nfrom vtoken.integration.fastpath import kernels\n"
    assert violations(sources) == [
        "core/checks.py: vtoken.core imports vtoken.integration.fastpath",
        "core/checks.py: vtoken.core imports vtoken.integration.fastpath.kernels",
        "core/reference/views.py: vtoken.core.reference imports vtoken.core.sim",
        "core/reference/views.py: vtoken.core.reference imports vtoken.core.sim.simulator",
        "core/runtime.py: vtoken.core imports vtoken.core.sim",
        "core/runtime.py: vtoken.core imports vtoken.core.sim.simulator",
        "integration/bench/stats.py: vtoken.integration.bench imports vtoken.fuzz.machine",
        "integration/device/verify.py: vtoken.integration.device imports vtoken.integration.vllm",
        "integration/device/verify.py: vtoken.integration.device imports vtoken.integration.vllm.settings",
        "integration/fastpath/layout.py: vtoken.integration.fastpath imports vtoken.integration.device",
        "integration/fastpath/layout.py: vtoken.integration.fastpath imports vtoken.integration.device.kv_cache",
        "integration/vllm/settings.py: vtoken.integration.vllm imports vtoken.core.reference",
        "integration/vllm/settings.py: vtoken.integration.vllm imports vtoken.core.reference.invariants",
        "spec/cli.py: vtoken.spec imports vtoken.integration.device",
        "spec/cli.py: vtoken.spec imports vtoken.integration.device.kv_cache",
    ]


def test_relative_imports_resolve_as_python_resolves_them():
    assert imported("from ..device.kv_cache import PagedKVCache", "vtoken.integration.vllm.kv_bridge", False) \
        == ["vtoken.integration.device.kv_cache", "vtoken.integration.device.kv_cache.PagedKVCache"]
    assert imported("from . import errors", "vtoken.core", True) == ["vtoken.core", "vtoken.core.errors"]
    assert imported("from .. import checks", "vtoken.core.sim.demo", False) == ["vtoken.core", "vtoken.core.checks"]
    assert imported("import os, vtoken.core.plan", "vtoken.spec.cli", False) == ["vtoken.core.plan"]
