"""`make install` over a site torch: the Makefile's real install recipe (hpctrain/install_guard.py) run into a
throwaway venv made with --system-site-packages, the "site" a directory on PYTHONPATH holding a stub `torch` package
(as a `module load` provides one), with pip pointed at no index and no local wheels so that nothing can be
downloaded.

    .venv/bin/python -m pytest -q tests/multiproc/test_install_guard.py
"""
from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from faults import record

from helpers.launch import REPO

pytestmark = pytest.mark.faults


def stub_torch(site: Path, version: str, metadata: bool) -> None:
    """A `torch` that imports and says its version; with metadata, pip sees it installed (a dist-info)."""
    (site / "torch").mkdir(parents=True)
    (site / "torch" / "__init__.py").write_text(f"__version__ = {version!r}\n")
    if metadata:
        info = site / f"torch-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: torch\nVersion: {version}\n")


def deps_site(tmp: Path) -> Path:
    """hpctrain's other requirements, already installed (the test venv's, torch and hpctrain left out): pip finds
    them satisfied and needs no index."""
    out = tmp / "deps"
    out.mkdir()
    for entry in Path(sysconfig.get_paths()["purelib"]).iterdir():
        low = entry.name.lower()
        # torch itself left out; torchao kept (make installs TORCHAO_SPEC beside a torch of the pinned release)
        torch = low in ("torch", "torchgen", "functorch") or low.startswith("torch-")
        if not torch and not low.startswith(("hpctrain", "__editable__")) and not low.endswith(".pth"):
            (out / entry.name).symlink_to(entry)
    return out


def install(tmp: Path, pythonpath: list[Path], *make_args: str) -> tuple[subprocess.CompletedProcess, Path]:
    """`make install` into a fresh venv under tmp that sees the system's packages; returns the result and the venv's
    own site-packages."""
    venv = tmp / "venv"
    # --without-pip: the base interpreter's pip is seen through the system site packages (and it is seconds faster)
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", "--system-site-packages", str(venv)], check=True)
    (tmp / "no-wheels").mkdir()
    # PIP_NO_BUILD_ISOLATION=0 (pip's inverted spelling of --no-build-isolation): hpctrain's editable build uses the
    # setuptools present instead of fetching one
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(map(str, pythonpath)), PIP_NO_INDEX="1",
               PIP_FIND_LINKS=str(tmp / "no-wheels"), PIP_CONFIG_FILE=os.devnull, PIP_NO_BUILD_ISOLATION="0")
    env.pop("TORCH_SPEC", None)
    out = subprocess.run(["make", "-s", "install", f"VENV={venv}", *make_args], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=300)
    own = next((venv / "lib").glob("python3*/site-packages"))
    return out, own


def test_site_torch_below_the_floor_is_refused_before_pip(tmp_path: Path) -> None:
    site = tmp_path / "site"
    stub_torch(site, "2.4.0", metadata=True)
    out, own = install(tmp_path, [site])
    assert out.returncode != 0, out.stdout
    msg = out.stderr
    assert "torch 2.4.0" in msg and "torch>=2.9" in msg and "on PYTHONPATH" in msg, msg
    assert "module load" in msg and "make install" in msg, msg  # the fix
    assert "pip install" not in out.stdout, out.stdout  # nothing was asked of pip
    assert not list(own.glob("torch*")), list(own.iterdir())
    record("make install VENV_FLAGS=--system-site-packages over a site torch 2.4.0 (below the 2.9 floor), no index",
           "stops before pip, naming torch 2.4.0, torch>=2.9, where it comes from and the fix; nothing installed",
           tier="multi-process")


def test_no_site_torch_is_refused_unless_asked(tmp_path: Path) -> None:
    out, own = install(tmp_path, [])
    assert out.returncode != 0
    assert "sees no torch" in out.stderr and "module load" in out.stderr and "TORCH_SPEC=" in out.stderr, out.stderr
    assert "pip install" not in out.stdout, out.stdout
    assert not list(own.glob("torch*"))
    # named on the command line, the spec is installed: pip is asked for it (and finds none here, offline)
    asked, own = install(tmp_path / "asked", [], "TORCH_SPEC=torch==2.13.0")
    assert "sees no torch" not in asked.stderr, asked.stderr
    assert "pip install -q torch==2.13.0" in asked.stdout, asked.stdout
    record("make install VENV_FLAGS=--system-site-packages with no torch visible (a forgotten module load)",
           "stops before pip with the fix; pip is asked for torch only when TORCH_SPEC is named", tier="multi-process")


def test_site_torch_at_the_floor_is_kept_even_without_package_metadata(tmp_path: Path) -> None:
    """A site torch 2.13 without a dist-info (built from source, on PYTHONPATH): pip cannot see it, so before the
    guard `pip install -e .` resolved hpctrain's torch>=2.9 from the index (PyPI's CUDA torch on a cluster)."""
    site = tmp_path / "site"
    stub_torch(site, "2.13.0", metadata=False)
    out, own = install(tmp_path, [site, deps_site(tmp_path)])
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"torch 2.13.0 from {site / 'torch'} (kept" in out.stdout, out.stdout
    assert not list(own.glob("torch*")), list(own.iterdir())  # the venv holds no torch of its own
    venv_python = own.parents[2] / "bin" / "python"
    where = subprocess.run([str(venv_python), "-c", "import importlib.metadata as m; print(m.version('hpctrain'))"],
                           capture_output=True, text=True, cwd="/")
    assert where.returncode == 0, where.stderr  # hpctrain itself is installed
    record("make install over a site torch 2.13 that pip cannot see (no dist-info), no index",
           "the site torch is kept: install succeeds offline, the venv holds no torch", tier="multi-process")
