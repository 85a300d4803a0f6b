"""Fault campaign, inputs through the `hpctrain` command in its own process: hostile or broken configs and run
roots end with exit 2 and a message on stderr that names the key or file, never a traceback, and nothing is
submitted. The same inputs refused at load are tests/pure/config/test_faults_inputs.py's.

    .venv/bin/python -m pytest tests/multiproc/cli/test_faults_cli.py -q
"""
from __future__ import annotations

import os
import resource

import pytest
from faults import record

from helpers.launch import EXAMPLE, hpctrain

pytestmark = pytest.mark.faults


def clean_cli_error(out, *fragments) -> None:
    """A user error through the CLI: exit 2, every fragment on stderr, no traceback."""
    assert out.returncode == 2, out.stdout + out.stderr
    assert "Traceback" not in out.stderr and "Error: " in out.stderr, out.stderr
    for fragment in fragments:
        assert fragment in out.stderr, f"{fragment!r} not in {out.stderr!r}"


def limited_memory() -> None:
    """Runs in the child before exec: a regression that allocates per rank fails fast instead of swapping."""
    resource.setrlimit(resource.RLIMIT_AS, (8 << 30, 8 << 30))


def test_cli_refuses_non_utf8_argv():
    out = hpctrain("submit", str(EXAMPLE), "--dry-run", "--set", os.fsdecode(b"data.path=/x/\xff.bin"))
    clean_cli_error(out, "data.path", "UTF-8")
    record("non-UTF-8 bytes in a --set value", "exit 2 naming the key, no traceback", tier="cli")


def test_cli_absurd_world_size_fails_fast_and_16k_ranks_dry_run():
    out = hpctrain("submit", str(EXAMPLE), "--dry-run", "--set", "job.nodes=10000000000", timeout=60,
                   preexec_fn=limited_memory)
    clean_cli_error(out, "job.nodes = 10000000000", "1048576")
    # 2048 nodes x 8: pp=16 x dp=128 x tp=8 keeps the printed rank map (one line per rank) small; rank 0 of 16k
    # ranks holds about 33k open files (planner/fds.py): nodes with a hard limit of 2^20, as many sites set
    out = hpctrain("submit", str(EXAMPLE), "--dry-run", *sum((["--set", kv] for kv in [
        "job.nodes=2048", "job.tasks_per_node=8", "parallel.tp=8", "parallel.pp=16", "model.n_layers=16",
        "model.n_heads=8", "train.grad_accum=16", "train.micro_batch_size=1", "job.nofile=1048576"]), []),
        timeout=120, preexec_fn=limited_memory)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "#SBATCH --nodes=2048" in out.stdout and "#SBATCH --ntasks-per-node=8" in out.stdout
    assert "layout pp=16 dp=128 tp=8: 16384 ranks" in out.stdout
    record("hpctrain submit --dry-run with job.nodes = 10^10", "exit 2 naming both numbers; 2048 x 8 still dry-runs",
           tier="cli")


@pytest.mark.parametrize("content", [b"[job]\nnodes = 2\n[train\n", b"[job]\nname = 'caf\xe9'\n"],
                         ids=["invalid-toml", "latin1"])
def test_cli_bad_config_file_is_a_clean_error(tmp_path, content):
    path = tmp_path / "bad.toml"
    path.write_bytes(content)
    out = hpctrain("submit", str(path), "--dry-run", timeout=60)
    clean_cli_error(out, str(path), "line")
    record("hpctrain submit bad.toml --dry-run (invalid TOML, non-UTF-8 bytes)",
           "exit 2 naming the file and line, no traceback", tier="cli")


def test_cli_run_root_under_a_file_is_a_clean_error(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("x")
    out = hpctrain("submit", str(EXAMPLE), "--set", f"job.run_root={afile}/runs", "--set", "job.executor=local",
                   "--set", "train.steps=0", "--set", "data.source=synthetic", timeout=60)
    clean_cli_error(out, "job.run_root", str(afile), "is a file")
    assert "submitted" not in out.stdout
    record("hpctrain submit with job.run_root under a file", "exit 2 naming run_root, nothing submitted",
           tier="cli")
