"""Pure tests of launcher detection and identity in hpctrain.job.rendezvous, from plain dicts standing in for the
environment: no MPI, no torch.distributed.

    .venv/bin/python -m pytest tests/pure/job/test_rendezvous_env.py -q
"""
from __future__ import annotations

import os
import socket
import stat

import pytest
from faults import record

from hpctrain.job.rendezvous import Identity, detect_launcher, identity_from_env, identity_from_node_names

SLURM = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_NODEID": "2",
         "SLURM_NNODES": "4", "SLURM_JOB_ID": "4242"}
SUBMITIT = {"SUBMITIT_LOCAL_GLOBALID": "3", "SUBMITIT_LOCAL_NTASKS": "4", "SUBMITIT_LOCAL_LOCALID": "3",
            "SUBMITIT_LOCAL_NODEID": "0", "SUBMITIT_LOCAL_JOB_NUM_NODES": "1", "SUBMITIT_LOCAL_JOB_ID": "777"}
TORCHRUN = {"RANK": "6", "WORLD_SIZE": "8", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "4",
            "TORCHELASTIC_RUN_ID": "abc", "MASTER_ADDR": "n1", "MASTER_PORT": "29500"}


@pytest.fixture(autouse=True)
def fixed_node_name(monkeypatch):
    monkeypatch.setenv("SLURMD_NODENAME", "n7")


# --- detect_launcher --------------------------------------------------------------------------------------

@pytest.mark.parametrize("env, expected", [
    ({}, "single"),
    ({"HOME": "/home/x", "PATH": "/bin"}, "single"),
    (SLURM, "slurm"),
    (SUBMITIT, "submitit"),
    (TORCHRUN, "torchrun"),
    ({"TORCHELASTIC_RUN_ID": "x"}, "torchrun"),
    (SLURM | {"PMI_RANK": "5"}, "mpi"),            # srun --mpi=pmi2 sets both: MPI wins
    (SLURM | {"PMIX_RANK": "5"}, "mpi"),
    ({"OMPI_COMM_WORLD_RANK": "0"}, "mpi"),
    ({"MV2_COMM_WORLD_RANK": "0"}, "mpi"),
    (SLURM | TORCHRUN, "torchrun"),                # srun torchrun: the workers are torchrun's
    (SLURM | SUBMITIT, "submitit"),                # local executor inside an allocation
    (SLURM | TORCHRUN | {"PMIX_RANK": "0"}, "torchrun"),  # srun torchrun where the site's MpiDefault is pmix
    (SLURM | TORCHRUN | {"PMI_RANK": "0"}, "torchrun"),   # ... or pmi2
    (TORCHRUN | {"PMI_RANK": "0"}, "torchrun"),           # mpiexec torchrun
])
def test_detect_launcher(env, expected):
    assert detect_launcher(env) == expected


# --- identity_from_env ------------------------------------------------------------------------------------

def test_identity_from_slurm_env():
    ident = identity_from_env("slurm", SLURM)
    assert ident == Identity(rank=5, world_size=8, local_rank=1, node_index=2, node_name="n7", num_nodes=4,
                             launcher="slurm", job_id="4242", host=socket.gethostname())


def test_identity_from_submitit_env():
    ident = identity_from_env("submitit", SUBMITIT)
    assert (ident.rank, ident.world_size, ident.local_rank, ident.node_index, ident.num_nodes) == (3, 4, 3, 0, 1)
    assert (ident.launcher, ident.job_id, ident.node_name) == ("submitit", "777", "n7")


def test_identity_from_torchrun_env_derives_nodes():
    ident = identity_from_env("torchrun", TORCHRUN)
    # 8 ranks, 4 per node: 2 nodes, rank 6 on the second
    assert (ident.rank, ident.world_size, ident.local_rank, ident.num_nodes, ident.node_index) == (6, 8, 2, 2, 1)
    assert (ident.launcher, ident.job_id) == ("torchrun", "abc")


def test_identity_from_torchrun_env_prefers_group_rank():
    ident = identity_from_env("torchrun", TORCHRUN | {"GROUP_RANK": "0"})
    assert ident.node_index == 0


def test_torchrun_under_srun_takes_slurm_job_id():
    env = {k: v for k, v in TORCHRUN.items() if k != "TORCHELASTIC_RUN_ID"} | {"SLURM_JOB_ID": "99"}
    assert identity_from_env("torchrun", env).job_id == "99"


@pytest.mark.parametrize("launcher, env, missing", [
    ("slurm", SLURM, "SLURM_LOCALID"),
    ("slurm", SLURM, "SLURM_NNODES"),
    ("submitit", SUBMITIT, "SUBMITIT_LOCAL_NTASKS"),
    ("torchrun", TORCHRUN, "LOCAL_WORLD_SIZE"),
    ("torchrun", TORCHRUN, "RANK"),
])
def test_missing_variable_is_named(launcher, env, missing):
    env = {k: v for k, v in env.items() if k != missing}
    with pytest.raises(ValueError) as info:
        identity_from_env(launcher, env)
    assert missing in str(info.value) and launcher in str(info.value)


def test_job_id_is_optional():
    env = {k: v for k, v in SLURM.items() if k != "SLURM_JOB_ID"}
    assert identity_from_env("slurm", env).job_id.startswith("pid")


# --- identity_from_node_names (the MPI path) ---------------------------------------------------------------

def test_identity_from_block_node_names():
    names = ["n1", "n1", "n2", "n2"]
    idents = [identity_from_node_names(r, names, "mpi", "j1") for r in range(4)]
    assert [i.node_index for i in idents] == [0, 0, 1, 1]
    assert [i.local_rank for i in idents] == [0, 1, 0, 1]
    assert [i.node_name for i in idents] == names
    assert all((i.world_size, i.num_nodes, i.launcher, i.job_id) == (4, 2, "mpi", "j1") for i in idents)
    assert [i.rank for i in idents] == [0, 1, 2, 3]


def test_identity_from_interleaved_node_names():
    names = ["b", "a", "b", "a", "c"]  # node index by first appearance, not alphabetical
    idents = [identity_from_node_names(r, names, "mpi", "j") for r in range(len(names))]
    assert [i.node_index for i in idents] == [0, 1, 0, 1, 2]
    assert [i.local_rank for i in idents] == [0, 0, 1, 1, 0]
    assert {i.num_nodes for i in idents} == {3}


def test_identity_from_alternating_node_names():
    names = ["a", "b", "a", "b"]
    idents = [identity_from_node_names(r, names, "mpi", "j") for r in range(4)]
    assert [(i.node_index, i.local_rank) for i in idents] == [(0, 0), (1, 0), (0, 1), (1, 1)]


def test_stray_master_port_is_not_torchrun():
    # job scripts often export MASTER_PORT: without torchrun's own variables the real launcher still wins
    assert detect_launcher({"SLURM_PROCID": "0", "MASTER_PORT": "29500"}) == "slurm"
    assert detect_launcher({"SUBMITIT_LOCAL_JOB_ID": "1", "MASTER_PORT": "29500"}) == "submitit"
    full = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "h", "MASTER_PORT": "1"}
    assert detect_launcher(full) == "torchrun"


def test_non_numeric_variable_is_named():
    env = {"SLURM_PROCID": "zero", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0", "SLURM_NODEID": "0",
           "SLURM_NNODES": "1"}
    with pytest.raises(ValueError, match="SLURM_PROCID = 'zero' is not an integer"):
        identity_from_env("slurm", env)


# --- the address file (launchers without MPI) ---------------------------------------------------------------

def test_address_file_is_private_from_creation(tmp_path):
    """Created 0600 even under umask 0 (os.open with the mode, not a chmod after), and readable by the others."""
    from hpctrain.job import rendezvous

    info = {"addr": "127.0.0.1", "port": 4242, "host": "h", "secret": "0" * 32}
    ranks = [Identity(r, 2, r, 0, "n", 1, "slurm", "77", "h") for r in range(2)]
    old = os.umask(0)
    try:
        assert rendezvous._publish(ranks[0], info, tmp_path, 5) == info
    finally:
        os.umask(old)
    (path,) = tmp_path.glob("rendezvous-*")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert rendezvous._publish(ranks[1], None, tmp_path, 5) == info


# --- MPI world against the launcher's count (identify() under MPI) ----------------------------------------------
# Environments as measured on the local cluster (Slurm 22.05, MPICH 5): srun --mpi=pmi2 exports PMI_JOBID
# "<job>.<step>"; mpiexec inside `salloc -N2 -n4` starts its proxies as a Slurm step of 2 tasks, so its 4 ranks
# see SLURM_NTASKS=2 beside Hydra's PMI_SIZE=4.

SRUN_PMI2 = {"SLURM_JOB_ID": "93", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "2", "SLURM_PROCID": "1", "PMI_RANK": "1",
             "PMI_SIZE": "2", "PMI_JOBID": "93.0", "PMI_FD": "11"}
SRUN_NONE = {"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "2", "SLURM_PROCID": "0"}
SRUN_PMIX = {"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "8", "PMIX_RANK": "3",
             "PMIX_NAMESPACE": "slurm.pmix.7.0"}
HYDRA_IN_SLURM = {"SLURM_JOB_ID": "100", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "2", "SLURM_PROCID": "0",
                  "PMI_RANK": "1", "PMI_SIZE": "4", "PMI_FD": "6", "PMI_HOSTNAME": "n1", "MPI_LOCALNRANKS": "2"}
MPIRUN_IN_SLURM = {"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "2", "OMPI_COMM_WORLD_RANK": "0",
                   "OMPI_COMM_WORLD_SIZE": "8", "PMIX_RANK": "0", "PMIX_NAMESPACE": "prterun-n1-1234@1"}
HYDRA = {"PMI_RANK": "0", "PMI_SIZE": "4", "PMI_FD": "5"}
FIX = ['job.mpi = "pmix"', "srun --mpi=list", 'parallel.rendezvous = "slurm"']


@pytest.mark.parametrize("env, mpi_size, said", [
    (SRUN_PMI2, 2, None),
    (SRUN_PMI2, 1, ["PMI_SIZE = 2", "SLURM_NTASKS = 2"]),       # Open MPI 5 under srun --mpi=pmi2: singletons
    (SRUN_NONE, 2, None),                                      # parallel.rendezvous = "mpi" under srun
    (SRUN_NONE, 1, ["SLURM_NTASKS = 2"]),                      # ... with --mpi=none: singletons
    (SRUN_PMIX, 8, None),
    (SRUN_PMIX, 1, ["SLURM_NTASKS = 8"]),
    (HYDRA_IN_SLURM, 4, None),                                 # mpiexec's count rules, not its proxies' step
    (HYDRA_IN_SLURM, 1, ["PMI_SIZE = 4"]),
    (MPIRUN_IN_SLURM, 8, None),
    (MPIRUN_IN_SLURM, 1, ["OMPI_COMM_WORLD_SIZE = 8"]),
    (HYDRA, 4, None),
    ({}, 1, None),                                             # no launcher at all: a singleton is the job
    (HYDRA | {"PMI_SIZE": "1", "SLURM_NTASKS": "2"}, 1, None),  # mpiexec -n 1 inside an allocation of 2 tasks
], ids=["pmi2", "pmi2_singletons", "none", "none_singletons", "pmix", "pmix_singleton", "hydra_in_slurm",
        "hydra_broken", "mpirun_in_slurm", "mpirun_broken", "hydra", "nothing", "mpiexec_n1_in_allocation"])
def test_mpi_world_against_launcher(env, mpi_size, said):
    from hpctrain.job.rendezvous import check_mpi_world

    if said is None:
        check_mpi_world(mpi_size, env)
        return
    with pytest.raises(ValueError) as info:
        check_mpi_world(mpi_size, env)
    msg = str(info.value)
    for fragment in [f"{mpi_size} rank"] + said + FIX:
        assert fragment in msg, (fragment, msg)
    if "SLURM_NTASKS" not in " ".join(said):
        assert "SLURM_NTASKS" not in msg


# --- device selection (bind_device): mocked GPU count, no GPU needed -------------------------------------------

NODE_OF_8 = {"SLURM_NTASKS": "8", "SLURM_NODEID": "1", "SLURM_NNODES": "2", "SLURM_JOB_ID": "9"}
TORCHRUN_4 = {"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4", "TORCHELASTIC_RUN_ID": "r", "MASTER_ADDR": "n1",
              "MASTER_PORT": "29500"}


@pytest.mark.parametrize("env, gpus_on_node, expected", [
    # srun with one GPU per task (--gpus-per-task=1 or --gpu-bind): the task sees only its own, as device 0
    (NODE_OF_8 | {"SLURM_PROCID": "7", "SLURM_LOCALID": "3", "CUDA_VISIBLE_DEVICES": "3"}, 4, 0),
    (NODE_OF_8 | {"SLURM_PROCID": "7", "SLURM_LOCALID": "3", "CUDA_VISIBLE_DEVICES": "0"}, 4, 0),  # cgroup-renamed
    (NODE_OF_8 | {"SLURM_PROCID": "5", "SLURM_LOCALID": "1", "CUDA_VISIBLE_DEVICES": "GPU-5e1f"}, 4, 0),  # by UUID
    # srun with every GPU of the node visible to every task (--gpus-per-node): the local rank's
    (NODE_OF_8 | {"SLURM_PROCID": "7", "SLURM_LOCALID": "3", "CUDA_VISIBLE_DEVICES": "0,1,2,3"}, 4, 3),
    (NODE_OF_8 | {"SLURM_PROCID": "6", "SLURM_LOCALID": "2"}, 4, 2),  # no CUDA_VISIBLE_DEVICES at all
    # --gpu-bind=closest, two tasks per socket: each pair shares its socket's two GPUs
    (NODE_OF_8 | {"SLURM_PROCID": "7", "SLURM_LOCALID": "3", "CUDA_VISIBLE_DEVICES": "2,3"}, 4, 1),
    (NODE_OF_8 | {"SLURM_PROCID": "6", "SLURM_LOCALID": "2", "CUDA_VISIBLE_DEVICES": "2,3"}, 4, 0),
    # srun torchrun: one srun task per node (SLURM_LOCALID 0) runs 4 workers; LOCAL_RANK is the worker's
    (NODE_OF_8 | TORCHRUN_4 | {"SLURM_PROCID": "1", "SLURM_LOCALID": "0", "RANK": "6", "LOCAL_RANK": "2",
                               "CUDA_VISIBLE_DEVICES": "0,1,2,3"}, 4, 2),
    (TORCHRUN_4 | {"RANK": "5", "LOCAL_RANK": "1"}, 8, 1),  # torchrun alone, more GPUs than workers
], ids=["per_task", "per_task_cgroup", "per_task_uuid", "all_visible", "all_unset", "closest_second",
        "closest_first", "srun_torchrun", "torchrun"])
def test_bind_device(env, gpus_on_node, expected, monkeypatch):
    import torch

    from hpctrain.job import rendezvous

    visible = env.get("CUDA_VISIBLE_DEVICES")
    count = len(visible.split(",")) if visible is not None else gpus_on_node  # what CUDA would count
    chosen = []
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    ident = identity_from_env(detect_launcher(env), env)
    assert rendezvous.bind_device(ident, "nccl") == torch.device("cuda", expected)
    assert chosen == [torch.device("cuda", expected)]  # and made current before NCCL starts


@pytest.mark.parametrize("visible, expected", [("0,1,2,3", [0, 1, 2, 3, 0, 1, 2, 3]), ("5", [0] * 8)])
def test_bind_device_under_mpi(visible, expected, monkeypatch):
    """srun --mpi=pmi2, 2 nodes x 4 tasks: the local rank comes from the gathered node names."""
    import torch

    from hpctrain.job import rendezvous

    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(visible.split(",")))
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: None)
    names = ["n1"] * 4 + ["n2"] * 4
    got = [rendezvous.bind_device(identity_from_node_names(r, names, "mpi", "j"), "nccl").index for r in range(8)]
    assert got == expected


def test_bind_device_cpu_backends(monkeypatch):
    import torch

    from hpctrain.job import rendezvous

    monkeypatch.setattr(torch.cuda, "set_device", lambda d: pytest.fail("set_device under gloo"))
    assert rendezvous.bind_device(identity_from_env("slurm", SLURM), "gloo") == torch.device("cpu")


@pytest.mark.faults
@pytest.mark.parametrize("text", ['{"addr": "127.0.0.1", "port": "4242", "secret": "s"}', "[" * 100000, "x" * 70000,
                                  '{"addr": "\\ud800", "port": 1, "secret": "s"}', "LINK"])
def test_damaged_address_file_is_a_clean_error(tmp_path, text):
    """A rank that reads a damaged, huge, deeply nested or linked address file gets a ValueError naming it."""
    from faults import record

    from hpctrain.job import rendezvous

    ident = Identity(1, 2, 1, 0, "n", 1, "slurm", "77", "h")
    path = rendezvous._rendezvous_file(ident, tmp_path)
    if text == "LINK":
        (tmp_path / "elsewhere.json").write_text('{"addr": "127.0.0.1", "port": 4242, "secret": "s"}')
        path.symlink_to(tmp_path / "elsewhere.json")
    else:
        path.write_text(text)
    with pytest.raises(ValueError, match="rendezvous-slurm-77"):
        rendezvous._publish(ident, None, tmp_path, 5)
    record("rendezvous address file damaged (wrong types, 100k-deep nesting, 70 KB, lone surrogate, a symlink)",
           "every reading rank raises a ValueError naming the file; no traceback from json", tier="pure")


# --- issue 26: srun torchrun on a PMI site, the mpich wheel's network module -------------------------------

@pytest.mark.faults
def test_srun_torchrun_workers_that_inherit_pmi_are_torchrun_ranks():
    """`srun torchrun` where the site's MpiDefault is pmix: each worker inherits its srun task's PMIx variables.
    Taken for MPI ranks, 4 workers of a task would all start MPI as the same PMIx rank."""
    env = SLURM | TORCHRUN | {"PMIX_RANK": "5", "PMIX_NAMESPACE": "slurm.pmix.4242.0"}
    ident = identity_from_env(detect_launcher(env), env)
    assert (ident.launcher, ident.rank, ident.world_size, ident.local_rank) == ("torchrun", 6, 8, 2)
    record("srun torchrun workers that inherit the srun task's PMIx (or PMI2) variables",
           "identified as torchrun's ranks (RANK/WORLD_SIZE), not as MPI ranks", tier="pure")


def test_mpi_environment_only_for_the_mpich_wheel_and_only_unset():
    from hpctrain.job.rendezvous import mpi_environment, mpich_wheel_libmpi
    assert mpich_wheel_libmpi({}) is not None, "the test venv has the mpich wheel (make install)"
    assert mpi_environment({}) == {"MPIR_CVAR_CH4_NETMOD": "ofi"}
    assert mpi_environment({"MPIR_CVAR_CH4_NETMOD": "ucx"}) == {}  # the user's choice
    assert mpi_environment({"MPI4PY_LIBMPI": "/opt/site/lib/libmpi.so"}) == {}  # a site MPI: it may lack OFI
