"""Launch sanity on the local Slurm 22.05 cluster, no mocks: job.mpi is checked against the site's own
`srun --mpi=list` (which offers none, pmi2, pmix, cray_shasta and pmix_v4, not pmix_v3) before sbatch, and a
listed plugin that srun cannot load is warned about. The list's parsing is tests/pure/job/test_launch_sanity.py's.

    # slurm/cluster.sh up
    PATH=$PWD/.venv/bin:$PATH .venv/bin/python -m pytest -q tests/cluster/job/test_launch_slurm.py
"""
from __future__ import annotations

import pytest
from faults import record

from helpers.launch import EXAMPLE
from hpctrain.config import load_config
from hpctrain.job import launch


@pytest.mark.slurm
@pytest.mark.faults
def test_plugin_missing_from_the_site_is_refused_before_sbatch(slurm_cluster):
    assert "pmi2" in launch.mpi_plugins()  # what the local cluster offers (measured: see the docstring above)
    launch.check_cluster(load_config(EXAMPLE))  # job.mpi = "pmi2": accepted
    with pytest.raises(ValueError) as info:
        launch.check_cluster(load_config(EXAMPLE, ["job.mpi=pmix_v3"]))
    msg = str(info.value)
    assert "job.mpi = 'pmix_v3'" in msg and "srun --mpi=list" in msg
    assert "pmi2" in msg and "pmix_v4" in msg  # the site's list, so the user can pick
    record("job.mpi names an srun MPI plugin the site lacks (pmix_v3 on a pmix_v4 site)",
           "refused before sbatch with the site's `srun --mpi=list` in the message", tier="slurm")


@pytest.mark.slurm
def test_listed_plugin_that_srun_cannot_load_warns(slurm_cluster):
    # measured here: pmix is listed, but `srun --mpi=pmix` fails with "pmi/pmix: can not load PMIx library"
    notes = []
    launch.check_cluster(load_config(EXAMPLE, ["job.mpi=pmix"]), notes.append)
    assert len(notes) == 1 and "job.mpi = 'pmix' is listed" in notes[0] and "can not load PMIx library" in notes[0]
    notes.clear()
    launch.check_cluster(load_config(EXAMPLE), notes.append)
    assert notes == []


@pytest.mark.slurm
def test_offload_beyond_the_nodes_memory_is_refused(slurm_cluster):
    """parallel.offload without job.mem_gb: the host memory the planner predicts per node is checked against the
    partition's nodes (sinfo's RealMemory) before sbatch."""
    cfg = load_config(EXAMPLE, ["parallel.zero_stage=3", "parallel.offload=all"])
    node_mb = launch.partitions()[next(n for n, p in launch.partitions().items() if p["default"])]["mem_mb"]
    assert node_mb and node_mb > 0
    launch.check_cluster(cfg, host_gib=node_mb / 1024 / 2)  # half a node: accepted
    with pytest.raises(ValueError, match="GiB of host memory per node predicted for the offloaded states, but the "
                                         "nodes of partition"):
        launch.check_cluster(cfg, host_gib=node_mb / 1024 * 2)
    launch.check_cluster(load_config(EXAMPLE, ["parallel.zero_stage=3", "parallel.offload=all", "job.mem_gb=1"]),
                         host_gib=node_mb / 1024 * 2)  # job.mem_gb given: the planner checked against it
