"""The dry run of `hpctrain data build` on a large raw file reads none of its ids (the CLI in a child process; the
ids themselves: tests/pure/data/test_data_ids.py).

    PATH=$PWD/.venv/bin:$PATH .venv/bin/python -m pytest -q tests/multiproc/data/test_data_ids_dry_run.py
"""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from faults import record

from helpers.launch import EXAMPLE, REPO, WORKERS

pytestmark = pytest.mark.faults


def test_dry_run_of_a_large_raw_file_reads_none_of_its_ids(tmp_path) -> None:
    """A 2 GiB raw file (sparse: quick to make) holding id 300, past the example's vocabulary of 256, in its
    middle: the dry run cannot see it, and its peak resident size stays far below the file (the old scan mapped
    and read every id: 2.3 GB resident here, 8.6 GB for an 8 GB file on the cluster)."""
    path = tmp_path / "big.bin"
    with open(path, "wb") as f:
        f.truncate(2 << 30)
        f.seek(1 << 30)
        f.write(np.array([300], dtype="<u2").tobytes())
    result = tmp_path / "peak.json"
    res = subprocess.run([sys.executable, str(WORKERS / "peak_rss.py"), str(result), "1200", "120", sys.executable,
                          "-m", "hpctrain.cli", "submit", str(EXAMPLE), "--dry-run", "--set", f"data.path={path}",
                          "--set", f"job.run_root={tmp_path / 'runs'}"], capture_output=True, text=True, cwd=REPO,
                         timeout=180)
    got = json.loads(result.read_text())
    out = res.stdout + res.stderr
    assert got["rc"] == 0 and not got["killed"], out
    assert f"{path}: no record of its ids from data build; one rank checks its 2.1 GB of token ids at job start" \
        in out, out
    assert "warning:" not in out and "ids up to" not in out
    assert got["peak_mb"] < 600, got  # the dry run of the bundled data: ~240 MB here
    assert not (tmp_path / "big.bin.ids.json").exists()
    record("submit --dry-run on a 2 GiB raw token file without a record, holding id 300 past the vocabulary",
           "exit 0 naming the file and its 2.1 GB checked at job start; no id read (the bad one unseen, no id "
           "cache), peak resident under 600 MB", tier="cli")
