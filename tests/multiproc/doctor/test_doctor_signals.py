"""Signals to the `hpctrain` command in its own process (one rank, alone), and the doctor's storage probe:

    .venv/bin/python -m pytest -q tests/multiproc/doctor/test_doctor_signals.py

- a signal during the command line's imports, a rank's first ~0.1 s (tests/workers/early_signal stands in for
  click and signals its own process at the first `import click`), through `python -m hpctrain.cli` and through the
  console script setup.cfg declares: `train` takes it as a preemption (no step trained, exit 0); any other command
  ends before it does anything, exit 128 + the signal's number;
- SIGTERM or SIGINT to `doctor --here` during its storage probe ends it within seconds, exit 128 + the signal, and
  leaves no probe file; SIGKILL leaves none either;
- a --storage-mb above the cap: exit 2 naming the value, nothing run. The process runs under a 64 MiB file size
  limit, so that a regression fails here instead of filling the disk.
"""
from __future__ import annotations

import configparser
import json
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from faults import record

from helpers.launch import EXAMPLE, REPO, WORKERS, env_with_venv
from hpctrain.hostprobe import MAX_STORAGE_MB

pytestmark = pytest.mark.faults

ALONE = ["parallel.tp=1", "job.nodes=1", "job.tasks_per_node=1"]
TRAIN = ["data.source=synthetic", "model.n_layers=1", "model.dim=64", "train.steps=5", "checkpoint.at_end=false"]


def sets(*values: str) -> list[str]:
    return [a for v in values for a in ("--set", v)]


def console_script(tmp_path: Path) -> list[str]:
    """The `hpctrain` console script as setup.cfg declares it, written as pip writes it (the venv's copy is only as
    new as the last `make install`)."""
    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    (entry,) = [line for line in cfg["options.entry_points"]["console_scripts"].splitlines()
                if line.startswith("hpctrain")]
    module, func = entry.split("=")[1].strip().split(":")
    script = tmp_path / "hpctrain"
    script.write_text(f"import sys\nfrom {module} import {func}\nsys.exit({func}())\n")
    return [sys.executable, str(script)]


def limited_files() -> None:
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 20, 64 << 20))


@pytest.mark.parametrize("how, command, sig", [("module", "doctor", "SIGTERM"), ("script", "ckpt", "SIGUSR2"),
                                               ("module", "train", "SIGUSR2"), ("script", "train", "SIGTERM")])
def test_signal_during_the_imports(tmp_path, how, command, sig) -> None:
    root = tmp_path / "runs"
    argv = [sys.executable, "-m", "hpctrain.cli"] if how == "module" else console_script(tmp_path)
    if command == "ckpt":
        args = ["ckpt", "ls", str(tmp_path)]
    else:
        args = [command, str(EXAMPLE), *sets(*ALONE, f"job.run_root={root}", *(TRAIN * (command == "train")))]
        args += ["--here"] * (command == "doctor")
    env = env_with_venv() | {"PYTHONPATH": str(WORKERS / "early_signal"), "HPCTRAIN_TEST_SIGNAL": sig}
    out = subprocess.run(argv + args, capture_output=True, text=True, timeout=300, env=env, cwd=REPO,
                         stdin=subprocess.DEVNULL, preexec_fn=limited_files)
    said = out.stdout[-3000:] + out.stderr[-3000:]
    assert out.returncode >= 0, f"died of signal {-out.returncode} during the imports:\n{said}"
    assert f"received {sig}" in out.stderr, said  # the stand-in's signal did come
    assert "Traceback" not in said
    if command == "train":
        assert out.returncode == 0, said
        (run,) = root.iterdir()
        train = json.loads((run / "summary.json").read_text())["train"]
        assert train["preempted"] and train["steps"] == 0, train
        record("USR2 or TERM in a rank's first ~0.1 s, during the CLI's imports (`train`; python -m hpctrain.cli "
               "and the console script)", "kept as a preemption: no step trained, exit 0", tier="unit")
    else:
        assert out.returncode == 128 + signal.Signals[sig], said
        assert not root.exists()  # ended before it made a run directory
        record("USR2 or TERM in a process's first ~0.1 s, during the CLI's imports (doctor, ckpt ls; python -m "
               "hpctrain.cli.main and the console script)", "ends before the command runs, exit 128 + the signal, no "
               "traceback", tier="unit")


def _probe_open(pid: int, directory: Path) -> bool:
    """The process holds a file in `directory` open: the storage probe's (unnamed, unlinked or not, /proc names it
    under the directory: `.../#123 (deleted)` for an O_TMPFILE)."""
    try:
        fds = list(Path(f"/proc/{pid}/fd").iterdir())
    except OSError:
        return False
    for fd in fds:
        try:
            if os.readlink(fd).startswith(f"{directory}/"):
                return True
        except OSError:
            continue
    return False


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT", "SIGKILL"])
def test_signal_during_the_storage_probe(tmp_path, sig) -> None:
    ckpt, root = tmp_path / "ckpt", tmp_path / "runs"
    ckpt.mkdir()
    cmd = [sys.executable, "-m", "hpctrain.cli", "doctor", str(EXAMPLE), "--here", "--storage-mb", "48",
           *sets(*ALONE, f"job.run_root={root}", f"checkpoint.dir={ckpt}")]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env_with_venv(),
                            cwd=REPO, stdin=subprocess.DEVNULL, preexec_fn=limited_files)
    try:
        deadline = time.time() + 120
        while not _probe_open(proc.pid, ckpt) and proc.poll() is None and time.time() < deadline:
            time.sleep(0.001)
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        t0 = time.time()
        os.kill(proc.pid, signal.Signals[sig])
        output = proc.communicate(timeout=60)[0]
        gone = time.time() - t0
    finally:
        proc.kill()
    assert os.listdir(ckpt) == [], os.listdir(ckpt)
    if sig == "SIGKILL":
        assert proc.returncode == -signal.SIGKILL
        record("SIGKILL to `hpctrain doctor` during its storage probe", "no probe file left", tier="unit")
        return
    assert proc.returncode == 128 + signal.Signals[sig], output[-3000:]
    assert "Traceback" not in output and gone < 20, (gone, output[-3000:])
    (run,) = root.iterdir()
    assert not (run / "doctor.json").exists()  # ended, not finished
    record(f"{sig} to `hpctrain doctor` during its storage probe", f"ends within 20 s, exit "
           f"{128 + signal.Signals[sig]}, no traceback, no probe file left", gone, tier="unit")


def test_storage_mb_above_the_cap_is_refused(tmp_path) -> None:
    root = tmp_path / "runs"
    huge = str(1 << 40)
    cmd = [sys.executable, "-m", "hpctrain.cli", "doctor", str(EXAMPLE), "--here", "--storage-mb", huge,
           *sets(*ALONE, f"job.run_root={root}", f"checkpoint.dir={tmp_path}")]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env_with_venv(), cwd=REPO,
                         stdin=subprocess.DEVNULL, preexec_fn=limited_files)
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    assert f"'--storage-mb': {huge} is not in the range 1<=x<={MAX_STORAGE_MB}" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr and sorted(os.listdir(tmp_path)) == []
    record(f"hpctrain doctor --storage-mb {huge} (a probe that would fill the disk)",
           f"exit 2 naming the value and the cap ({MAX_STORAGE_MB} MiB) before anything runs or is written",
           tier="cli")
