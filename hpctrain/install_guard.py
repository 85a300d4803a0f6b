"""What `make install` runs inside the virtualenv it made: hpctrain and its requirements, with torch handled apart
so that pip never replaces the torch the venv sees and never downloads one nobody asked for.

    .venv/bin/python -m hpctrain.install_guard --torch-spec 'torch==2.13.0' [--asked] [--torchao-spec SPEC]
                                               [REQUIREMENT ...]

REQUIREMENT: more to install beside hpctrain's own (the Makefile passes the mpich wheel where no MPI is found).
--asked: TORCH_SPEC was named by the user (make install TORCH_SPEC=...), not the Makefile's default.
--torchao-spec: torchao (the `fp8` extra's float8 layers), installed only beside the torch release TORCH_SPEC pins
(the tests run fp8's layers on it, emulated on the CPU): a torchao release is built for one torch release, so beside
a site's torch it is left to `pip install 'hpctrain[fp8]'` with the torchao matching it.

1. torch, as the venv's python sees it (a venv made with --system-site-packages also sees the site's packages, and
   PYTHONPATH, which `module load` often sets, comes before every site directory):
   - a torch at or above the floor (`torch>=X` in setup.cfg's install_requires): kept, nothing is installed;
   - an older one: refused, naming both versions, where it comes from and the fix; nothing is installed;
   - none, in a plain venv: TORCH_SPEC is installed (the Makefile pins the CPU wheel the tests run on);
   - none, in a venv made to see the site's packages: refused unless --asked. That venv was made to use the
     site's torch (a `module load` was probably forgotten), and the torch pip would fetch instead is PyPI's CUDA
     build, several GB in the venv and in pip's cache in $HOME.
2. hpctrain's other requirements (install_requires without torch, the extras `test` and `hf`) and REQUIREMENT,
   with torch held at the version pip sees installed (a constraint), in case one of them asks for torch.
3. hpctrain itself, editable, with --no-deps: pip never resolves hpctrain's own `torch>=X`. Left to pip, that
   requirement upgrades an older site torch (a CUDA download from PyPI), and fetches a torch whose package
   metadata pip cannot see (a torch built from source, put on PYTHONPATH) although it imports.

Standard library only: it runs before anything else is installed. Exit status 2 on a refusal.
"""
from __future__ import annotations

import argparse
import configparser
import importlib.metadata
import importlib.util
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXTRAS = ("test", "hf")


def requirements(setup_cfg: Path = ROOT / "setup.cfg") -> tuple[str, list[str]]:
    """(torch's floor, every other requirement) from setup.cfg: install_requires and the extras make installs."""
    cfg = configparser.ConfigParser()
    cfg.read(setup_cfg)
    lines = cfg["options"]["install_requires"].split("\n")
    for extra in EXTRAS:
        lines += cfg["options.extras_require"][extra].split("\n")
    reqs = [line.strip() for line in lines if line.strip()]
    floors = [m.group(1) for r in reqs if (m := re.fullmatch(r"torch\s*>=\s*([0-9.]+)", r))]
    assert len(floors) == 1, f"setup.cfg names torch as 'torch>=X' once in install_requires: {reqs}"
    return floors[0], [r for r in reqs if not re.match(r"torch\b", r)]


def release(version: str) -> tuple[int, ...]:
    """The numeric release of a version string, without trailing zeros: '2.4.0a0+git1a2b' -> (2, 4), '2.10' ->
    (2, 10). A pre-release of the floor counts as the floor: its API is what the floor names."""
    m = re.match(r"\d+(\.\d+)*", version)
    parts = [int(p) for p in m.group(0).split(".")] if m else [0]
    while len(parts) > 1 and parts[-1] == 0:
        parts.pop()
    return tuple(parts)


def sees_system_site_packages() -> bool:
    """Whether this venv was made with --system-site-packages (pyvenv.cfg's include-system-site-packages)."""
    cfg = Path(sys.prefix) / "pyvenv.cfg"
    if sys.prefix == sys.base_prefix or not cfg.is_file():
        return True  # not a venv: every site package is seen
    text = cfg.read_text()
    return re.search(r"^include-system-site-packages\s*=\s*true\s*$", text, re.M | re.I) is not None


def on_pythonpath(path: str) -> bool:
    return any(entry and Path(path).resolve().is_relative_to(Path(entry).resolve())
               for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep))


def probe_torch() -> tuple[str, str] | None:
    """(version, directory) of the torch this python imports, or None when it sees none. Imported in a child
    process: a site torch whose libraries are missing may crash its importer."""
    if importlib.util.find_spec("torch") is None:
        return None
    out = subprocess.run([sys.executable, "-c", "import os, torch; print(torch.__version__); "
                          "print(os.path.dirname(torch.__file__))"], capture_output=True, text=True)
    if out.returncode != 0:
        where = importlib.util.find_spec("torch").origin
        raise SystemExit(f"install: a torch is visible ({where}) but does not import:\n{out.stderr.strip()[-2000:]}\n"
                         f"Fix the environment it comes from (the site's module, PYTHONPATH), then rerun make install.")
    version, directory = out.stdout.strip().splitlines()[-2:]
    return version, directory


def refusal_old(version: str, directory: str, floor: str, spec: str) -> str:
    origin = "on PYTHONPATH" if on_pythonpath(directory) else (
        "the site's" if not directory.startswith(sys.prefix) else "inside this venv")
    fixes = [f"load a torch >= {floor} (e.g. a newer `module load pytorch/...`) and rerun `make install`"]
    if origin == "on PYTHONPATH":
        fixes.append("or leave it off PYTHONPATH (`module unload` it) and remake the venv without the site's "
                     f"packages: `rm -rf {sys.prefix} && make install` (installs {spec}, the CPU wheel)")
    else:
        fixes.append(f"or remake the venv without the site's packages: `rm -rf {sys.prefix} && make install` "
                     f"(installs {spec}, the CPU wheel)")
    return (f"install: the venv sees torch {version} ({origin}, {directory}), older than hpctrain's floor "
            f"torch>={floor} (setup.cfg). Nothing was installed: pip would replace it with a torch from PyPI (a CUDA "
            f"build of several GB that your site did not build).\nFix: " + "; ".join(fixes) + ".")


def refusal_none(floor: str, spec: str) -> str:
    return (f"install: this venv was made to use the site's packages (VENV_FLAGS=--system-site-packages) but sees "
            f"no torch, and hpctrain needs torch>={floor}. Nothing was installed: pip would fetch PyPI's torch (a CUDA "
            f"build of several GB) instead of the site's.\nFix: load the site's torch (e.g. `module load pytorch`) "
            f"and rerun `make install`; or install one on purpose: `make install TORCH_SPEC='{spec}'`.")


def beside(spec: str, torch_spec: str, version: str) -> list[str]:
    """[spec] when the torch found is the release torch_spec pins ('torch==2.13.0' and torch 2.13.0+cpu), else []."""
    m = re.fullmatch(r"torch\s*==\s*([0-9][0-9.]*)", torch_spec.strip())
    return [spec] if spec and m and release(m.group(1)) == release(version) else []


def pip(*args: str) -> None:
    cmd = [sys.executable, "-m", "pip", "install", "-q", *args]
    print("install: " + " ".join(cmd[2:]), flush=True)
    subprocess.run(cmd, check=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--torch-spec", required=True, help="what to install when the venv sees no torch")
    ap.add_argument("--asked", action="store_true", help="TORCH_SPEC was named by the user")
    ap.add_argument("--torchao-spec", default="", help="torchao, installed only beside the torch TORCH_SPEC pins")
    ap.add_argument("extra", nargs="*", help="more requirements (e.g. mpich)")
    args = ap.parse_args(argv)
    floor, reqs = requirements()

    found = probe_torch()
    if found is None:
        if sees_system_site_packages() and not args.asked:
            print(refusal_none(floor, args.torch_spec), file=sys.stderr)
            return 2
        pip(args.torch_spec)
        found = probe_torch()
        assert found is not None, f"{args.torch_spec} installed but torch does not import"
    version, directory = found
    if release(version) < release(floor):
        print(refusal_old(version, directory, floor, args.torch_spec), file=sys.stderr)
        return 2
    print(f"install: torch {version} from {directory} (kept; hpctrain needs torch>={floor})", flush=True)

    try:  # the version pip sees installed, when it sees one: the other requirements may not replace it
        pin = f"torch=={importlib.metadata.version('torch')}\n"
    except importlib.metadata.PackageNotFoundError:
        pin = ""
    with tempfile.TemporaryDirectory() as tmp:
        constraint = Path(tmp) / "torch.txt"
        constraint.write_text(pin)
        pip("-c", str(constraint), *reqs, *args.extra, *beside(args.torchao_spec, args.torch_spec, version))
    pip("--no-deps", "-e", str(ROOT))
    return 0


if __name__ == "__main__":
    sys.exit(main())
