"""Pure tests of what `hpctrain submit` would hand to Slurm: the rendered sbatch scripts of the GPU examples
against golden files (tests/golden/), the submitit parameters, and the CLI's --dry-run / topo / error paths.
Nothing is submitted.

    .venv/bin/python -m pytest tests/pure/job/test_sbatch.py -q
    # rewrite tests/golden/*.sbatch
    HPCTRAIN_UPDATE_GOLDEN=1 .venv/bin/python -m pytest tests/pure/job/test_sbatch.py -q

Read the diff of a rewritten golden file before committing it: it is the script Slurm will run.
"""
from __future__ import annotations

import difflib
import os
import re
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner
from faults import record

from helpers.launch import REPO
from hpctrain.cli.main import main
from hpctrain.config import load_config
from hpctrain.job import launch

EXAMPLES = REPO / "slurm" / "examples"
TINY = EXAMPLES / "tiny-cpu.toml"
GPU = EXAMPLES / "gpu-4x8.toml"
LLAMA = EXAMPLES / "llama-70b.toml"
GOLDEN_DIR = REPO / "tests" / "golden"
# Absolute on purpose: submitit makes the log paths absolute against the working directory, so a relative
# folder would put the checkout's location into the golden file. The CLI passes an absolute folder too.
FOLDER = "/RUNDIR/submitit"
IB_HCA = "export NCCL_IB_HCA='=mlx5_0,mlx5_1,mlx5_2,mlx5_3,mlx5_4,mlx5_5,mlx5_6,mlx5_7'"  # the examples' HCAs


def script(example: Path) -> str:
    return launch.render_sbatch(load_config(example), FOLDER, python="python3")


def gpu_script() -> str:
    return script(GPU)


@pytest.mark.parametrize("example", [GPU, LLAMA], ids=lambda p: p.stem)
def test_sbatch_matches_golden(example):
    text = script(example)
    golden_path = GOLDEN_DIR / f"{example.stem}.sbatch"
    if os.environ.get("HPCTRAIN_UPDATE_GOLDEN") == "1":
        GOLDEN_DIR.mkdir(exist_ok=True)
        golden_path.write_text(text)
        pytest.skip(f"rewrote {golden_path}")
    golden = golden_path.read_text()
    diff = "".join(difflib.unified_diff(golden.splitlines(True), text.splitlines(True), "golden", "rendered"))
    assert text == golden, f"rendered sbatch differs (HPCTRAIN_UPDATE_GOLDEN=1 rewrites it):\n{diff}"


def test_llama_sbatch_content():
    """The 128-GPU example line by line: whole nodes with all their memory, no wckey, and the srun line whole."""
    lines = script(LLAMA).splitlines()
    directives = [line for line in lines if line.startswith("#SBATCH ")]
    for expected in ("--nodes=16", "--ntasks-per-node=8", "--gpus-per-node=8", "--cpus-per-task=12", "--exclusive",
                     "--mem=0", "--signal=USR2@600", "--time=2880", "--requeue", "--job-name=llama-70b"):
        assert f"#SBATCH {expected}" in directives, expected
    assert not any("wckey" in d for d in directives)
    (srun,) = [line for line in lines if line.startswith("srun ")]
    assert srun == ("srun --unbuffered --output /RUNDIR/submitit/%j_%t_log.out --error /RUNDIR/submitit/%j_%t_log.err "
                    "--kill-on-bad-exit=1 --cpus-per-task=12 --mpi=none --cpu-bind=cores --distribution=block:block "
                    "python3 -u -m hpctrain.entry -u -m submitit.core._submit /RUNDIR/submitit")


def test_gpu_sbatch_content():
    """The same script checked line by line, so a wrongly regenerated golden file still gets caught."""
    lines = gpu_script().splitlines()
    directives = [line for line in lines if line.startswith("#SBATCH ")]
    for expected in ("--nodes=4", "--ntasks-per-node=8", "--gpus-per-node=8", "--cpus-per-task=12",
                     "--partition=gpu", "--account=myproject", "--qos=normal", "--constraint=a100_80g",
                     "--exclusive", "--signal=USR2@300", "--time=1440", "--job-name=llama-8b",
                     "--mail-type=END,FAIL", "--requeue", f"--output={FOLDER}/%j_0_log.out"):
        assert f"#SBATCH {expected}" in directives, expected
    assert "#SBATCH --mem=0" in directives  # exclusive with mem_gb = 0: all of each node's memory
    srun = [i for i, line in enumerate(lines) if line.startswith("srun ")]
    assert len(srun) == 1
    line = lines[srun[0]]
    # one failed task ends the others at once (user srun_args come after, so they may override it)
    assert "--kill-on-bad-exit=1 --cpus-per-task=12 --mpi=none --cpu-bind=cores --distribution=block:block python3 " \
        "-u -m hpctrain.entry -u -m submitit.core._submit /RUNDIR/submitit" in line
    setup = [lines.index(s) for s in (*launch.GPU_SETUP, IB_HCA, "export OMP_NUM_THREADS=8")]
    assert setup == sorted(setup)
    assert lines.index(directives[-1]) < setup[0] and setup[-1] < srun[0]


def test_slurm_parameters_for_gpu_example():
    assert launch.slurm_parameters(load_config(GPU)) == {
        "job_name": "llama-8b", "nodes": 4, "ntasks_per_node": 8, "cpus_per_task": 12, "time": 1440,
        "signal_delay_s": 300, "srun_args": ["--kill-on-bad-exit=1", "--cpus-per-task=12", "--mpi=none",
                                               "--cpu-bind=cores", "--distribution=block:block"],
        "setup": ["export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}", IB_HCA,
                  "export OMP_NUM_THREADS=8"],
        "stderr_to_stdout": False, "wckey": None, "partition": "gpu", "account": "myproject", "qos": "normal",
        "constraint": "a100_80g", "gpus_per_node": 8, "exclusive": True, "mem": "0",
        "additional_parameters": {"mail-type": "END,FAIL", "requeue": True},
    }


def test_slurm_parameters_omit_empty_optional_fields():
    params = launch.slurm_parameters(load_config(TINY))
    assert set(params) == {"job_name", "nodes", "ntasks_per_node", "cpus_per_task", "time", "signal_delay_s",
                           "srun_args", "setup", "stderr_to_stdout", "wckey", "additional_parameters"}
    assert params["wckey"] is None  # None, not "": submitit would write --wckey=submitit or --wckey=''
    assert params["additional_parameters"] == {"requeue": True}  # preemption requeues the job
    assert (params["nodes"], params["ntasks_per_node"], params["time"]) == (2, 2, 20)
    text = launch.render_sbatch(load_config(TINY), FOLDER, python="python3")
    for option in ("--partition", "--account", "--qos", "--constraint", "--gpus", "--exclusive", "--mem"):
        assert f"#SBATCH {option}" not in text
    assert "#SBATCH --requeue" in text


# --- the CLI ----------------------------------------------------------------------------------------------

def invoke(*args: str):
    return CliRunner().invoke(main, [str(a) for a in args])


def test_dry_run_prints_script_and_map_and_creates_nothing(tmp_path):
    run_root = tmp_path / "runs"
    res = invoke("submit", GPU, "--dry-run", "--set", f"job.run_root={run_root}")
    assert res.exit_code == 0, res.output
    out = res.output
    assert "layout pp=2 dp=2 tp=8 on 4 node(s) x 8 rank(s)" in out
    assert "pipeline: 1f1b, 2 stages over pp=2 ranks, 16 micro-batches per step" in out
    assert "pp rank 0: stage 0 blocks 0-15 + embedding" in out
    assert "pp rank 1: stage 1 blocks 16-31 + norm, output" in out
    row31 = next(line for line in out.splitlines() if line.startswith("31 "))
    assert row31.split() == ["31", "node3", "7", "1", "1", "7", "[24,25,26,27,28,29,30,31]", "[23,31]",
                             "[15,31]"]
    assert "#!/bin/bash" in out and "#SBATCH --nodes=4" in out and "#SBATCH --signal=USR2@300" in out
    assert f"{run_root}/<run dir>/submitit" in out
    assert "nothing submitted" in out
    assert not run_root.exists()
    assert list(tmp_path.iterdir()) == []


def test_dry_run_refuses_tp_wider_than_a_node():
    # dp = -1 so the product fits (2 * 1 * 16 = 32) and the per-node check is what refuses it
    res = invoke("submit", GPU, "--dry-run", "--set", "parallel.tp=16", "--set", "parallel.dp=-1")
    assert res.exit_code == 2
    assert "tp(16)" in res.output and "8 ranks per node" in res.output
    assert "#SBATCH" not in res.output


def test_dry_run_refuses_wrong_product():
    # the example fixes dp = 2, so tp = 16 alone breaks pp * dp * tp = world size first
    res = invoke("submit", GPU, "--dry-run", "--set", "parallel.tp=16")
    assert res.exit_code == 2
    assert "tp(16)" in res.output and "= 64" in res.output and "world size 32" in res.output


def test_topo_prints_the_map():
    res = invoke("topo", TINY)
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    assert "pp=1 dp=2 tp=2" in lines[0] and "2 node(s) x 2 rank(s)" in lines[0]
    assert lines[2 + 3].split() == ["3", "node1", "1", "0", "1", "1", "[2,3]", "[1,3]", "[3]"]
    assert len(lines) == 2 + 4


def test_unknown_key_exits_2():
    res = invoke("topo", TINY, "--set", "job.nodez=2")
    assert res.exit_code == 2
    assert "job.nodez" in res.output and "did you mean 'nodes'" in res.output


def test_missing_config_file_exits_2(tmp_path):
    res = invoke("submit", tmp_path / "absent.toml", "--dry-run")
    assert res.exit_code == 2
    assert "absent.toml" in res.output


# --- issue 12: what real sites refuse or mis-run ----------------------------------------------------------

def test_no_wckey_unless_configured():
    # submitit 1.5 writes --wckey=submitit by default, and --wckey='' for wckey=""; sites that enforce wckeys
    # reject both. No line at all unless job.wckey is set.
    for cfg in (load_config(TINY), load_config(GPU)):
        text = launch.render_sbatch(cfg, FOLDER, python="python3")
        assert "--wckey" not in text, text
    text = launch.render_sbatch(load_config(TINY, ["job.wckey=proj_a"]), FOLDER, python="python3")
    assert "#SBATCH --wckey=proj_a" in text.splitlines()


def srun_line(cfg) -> str:
    (line,) = [x for x in launch.render_sbatch(cfg, FOLDER, python="python3").splitlines() if x.startswith("srun ")]
    return line


def test_srun_gets_cpus_per_task():
    # Slurm 22.05-23.02: srun does not inherit --cpus-per-task from sbatch, so each task would get one CPU
    assert " --cpus-per-task=12 " in srun_line(load_config(GPU))
    assert " --cpus-per-task=3 " in srun_line(load_config(TINY, ["job.cpus_per_task=3"]))


@pytest.mark.parametrize("overrides, mem", [
    ([], None),                                            # shared nodes, no mem_gb: the site's default
    (["job.exclusive=true"], "0"),                         # whole nodes: all of their memory, not the default share
    (["job.exclusive=true", "job.mem_gb=64"], "64GB"),     # an explicit size wins
    (["job.mem_gb=1.5"], "1536MB"),                       # sbatch refuses --mem=1.5GB: whole units only
])
def test_mem_rendered(overrides, mem):
    cfg = load_config(TINY, overrides)
    assert launch.slurm_parameters(cfg).get("mem") == mem
    lines = launch.render_sbatch(cfg, FOLDER, python="python3").splitlines()
    assert [x for x in lines if x.startswith("#SBATCH --mem")] == ([f"#SBATCH --mem={mem}"] if mem else [])


@pytest.mark.parametrize("example", sorted(EXAMPLES.glob("*.toml")), ids=lambda p: p.stem)
def test_examples_name_ib_hcas_exactly(example):
    """NCCL_IB_HCA=mlx5 is a prefix match: it takes storage and Ethernet ports too (and mlx5_1 takes mlx5_10).
    Every GPU example names its HCAs exactly ('=' list) or excludes some exactly ('^=' list)."""
    cfg = load_config(example)
    values = [line.split("=", 1)[1].strip("'\"") for line in cfg.job.setup if line.startswith("export NCCL_IB_HCA=")]
    if cfg.job.gpus_per_node:
        assert values, f"{example.name}: no NCCL_IB_HCA (NCCL would take every IB device)"
    for value in values:
        assert value.startswith(("=", "^=")), f"{example.name}: NCCL_IB_HCA={value} is a prefix match"


# --- issue 26: launch defaults and GPU job scripts that work on any site ----------------------------------

def setup_lines(cfg) -> list[str]:
    lines = launch.render_sbatch(cfg, FOLDER, python="python3").splitlines()
    return lines[lines.index("# setup") + 1:lines.index("# command")]


# an srun task where the site's MpiDefault is pmix (Open MPI sites): srun hands every task PMIx variables
SRUN_TASK_PMIX_SITE = {"SLURM_PROCID": "9", "SLURM_NTASKS": "32", "SLURM_LOCALID": "1", "SLURM_NODEID": "1",
                       "SLURM_NNODES": "4", "SLURM_JOB_ID": "77", "SLURM_STEP_ID": "0", "PMIX_RANK": "9",
                       "PMIX_NAMESPACE": "slurm.pmix.77.0"}


@pytest.mark.faults
@pytest.mark.parametrize("example", [GPU, LLAMA], ids=lambda p: p.stem)
def test_gpu_examples_take_identity_from_slurm_and_start_no_mpi(example, monkeypatch):
    from hpctrain.job import rendezvous
    cfg = load_config(example)
    assert "--mpi=none" in srun_line(cfg).split()  # srun starts no PMI server: nothing for a site MPI to match
    for var in [v for v in os.environ if v.startswith(("SLURM_", "PMI", "OMPI_", "MV2_", "TORCHELASTIC_"))]:
        monkeypatch.delenv(var)
    for var, value in SRUN_TASK_PMIX_SITE.items():
        monkeypatch.setenv(var, value)

    def no_mpi():
        raise AssertionError("MPI was started")
    monkeypatch.setattr(rendezvous, "_mpi_comm", no_mpi)
    ident = rendezvous.identify(cfg.parallel.rendezvous)
    assert (ident.launcher, ident.rank, ident.world_size, ident.local_rank, ident.node_index) == ("slurm", 9, 32, 1, 1)
    record(f"the {example.stem} example's task on a site whose srun hands out PMIx variables (MpiDefault=pmix)",
           "identity from Slurm's variables (rank 9 of 32), MPI never started; srun gets --mpi=none", tier="pure")


@pytest.mark.parametrize("example", sorted(EXAMPLES.glob("*.toml")), ids=lambda p: p.stem)
def test_examples_load_no_nccl_module_and_set_no_mpi_netmod(example):
    """torch brings its own libnccl: an NCCL module's older one on LD_LIBRARY_PATH would be loaded ahead of it.
    The mpich wheel's network module is hpctrain's to set (rendezvous.mpi_environment), not a setup line's."""
    for line in load_config(example).job.setup:
        assert not re.search(r"\bmodule\s+(load|add)\b.*\bnccl", line, re.I), f"{example.name}: {line}"
        assert "MPIR_CVAR_CH4_NETMOD" not in line, f"{example.name}: {line}"


def test_gpu_jobs_bind_each_task_to_its_cores():
    words = srun_line(load_config(GPU)).split()
    assert "--cpu-bind=cores" in words and "--distribution=block:block" in words and "--cpu-bind=none" not in words
    assert words.index("--cpus-per-task=12") < words.index("--cpu-bind=cores")
    tiny = srun_line(load_config(TINY)).split()  # CPU jobs: as before (the local cluster has no task/affinity)
    assert not [w for w in tiny if w.startswith(("--cpu-bind", "--distribution"))]
    # job.srun_args come after ours: srun takes the last of a repeated option, so a site can override them
    words = srun_line(load_config(GPU, ['job.srun_args=["--cpu-bind=map_ldom:3,1,7,5"]'])).split()
    assert words.index("--cpu-bind=cores") < words.index("--cpu-bind=map_ldom:3,1,7,5")


def alloc_conf(cfg, submitted: str | None) -> str:
    """PYTORCH_CUDA_ALLOC_CONF after bash runs the job script's setup lines, given the submission's value."""
    env = {k: v for k, v in os.environ.items() if k != "PYTORCH_CUDA_ALLOC_CONF"}
    if submitted is not None:
        env["PYTORCH_CUDA_ALLOC_CONF"] = submitted
    script = "\n".join([*setup_lines(cfg), 'printf %s "${PYTORCH_CUDA_ALLOC_CONF-<unset>}"'])
    out = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_gpu_jobs_use_expandable_segments_unless_set():
    gpu = load_config(GPU)
    assert alloc_conf(gpu, None) == "expandable_segments:True"
    assert alloc_conf(gpu, "garbage_collection_threshold:0.8") == "garbage_collection_threshold:0.8"
    own = load_config(GPU, ['job.setup=["export PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync"]'])
    assert alloc_conf(own, None) == "backend:cudaMallocAsync"
    assert alloc_conf(load_config(TINY), None) == "<unset>"  # CPU jobs: no CUDA allocator to configure
