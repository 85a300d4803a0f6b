"""Pure tests of hpctrain.config: defaults, the bundled examples, --set overrides, error messages that name
the offending key and value, and the dump_toml -> load_config round trip.

    .venv/bin/python -m pytest tests/pure/config/test_config.py -q
"""
from __future__ import annotations

from pathlib import Path

import pytest

from helpers.launch import REPO
from hpctrain.config import Config, JobConfig, dump_toml, load_config

EXAMPLES = REPO / "slurm" / "examples"
TINY = EXAMPLES / "tiny-cpu.toml"
GPU = EXAMPLES / "gpu-4x8.toml"


def refused(overrides, *fragments, path=None) -> str:
    """load_config must raise ValueError whose message holds every fragment; returns the message."""
    with pytest.raises(ValueError) as info:
        load_config(path, overrides)
    msg = str(info.value)
    for fragment in fragments:
        assert fragment in msg, f"{fragment!r} not in {msg!r}"
    return msg


def reload(cfg: Config, tmp_path: Path) -> Config:
    path = tmp_path / "config.toml"
    path.write_text(dump_toml(cfg))
    return load_config(path)


# --- building ---------------------------------------------------------------------------------------------

def test_defaults_build():
    cfg = load_config(None)
    assert cfg == Config()
    assert cfg.world_size == 1
    assert (cfg.parallel.pp, cfg.parallel.dp, cfg.parallel.tp) == (1, -1, 1)
    assert cfg.job.mpi == "pmi2" and cfg.job.srun_args == []
    assert cfg.job.sbatch_extra == [] and cfg.job.setup == [] and cfg.job.wckey == ""


def test_tiny_cpu_example_loads():
    cfg = load_config(TINY)
    assert (cfg.job.name, cfg.job.nodes, cfg.job.tasks_per_node, cfg.world_size) == ("tiny-cpu", 2, 2, 4)
    assert (cfg.parallel.pp, cfg.parallel.dp, cfg.parallel.tp) == (1, -1, 2)
    assert cfg.job.gpus_per_node == 0 and cfg.job.partition == ""
    assert (cfg.model.dim, cfg.data.seq_len, cfg.model.max_seq_len) == (128, 128, 128)
    assert cfg.train.lr == pytest.approx(2e-3)


def test_gpu_example_loads():
    cfg = load_config(GPU)
    assert cfg.world_size == 32
    assert (cfg.job.nodes, cfg.job.tasks_per_node, cfg.job.gpus_per_node) == (4, 8, 8)
    assert (cfg.parallel.pp, cfg.parallel.dp, cfg.parallel.tp) == (2, 2, 8)
    assert cfg.job.exclusive is True
    assert cfg.job.sbatch_extra == ["--mail-type=END,FAIL", "--requeue"]
    # identity from Slurm, no MPI started; hpctrain adds GPU jobs' CPU binding (launch.GPU_SRUN_ARGS)
    assert cfg.job.mpi == "none" and cfg.parallel.rendezvous == "slurm" and cfg.job.srun_args == []
    assert cfg.job.setup[0].startswith("export NCCL_IB_HCA=")
    # mem_gb = 0 is written as an int in the file; float fields take ints and store floats
    assert isinstance(cfg.job.mem_gb, float) and cfg.job.mem_gb == 0.0
    assert (cfg.model.n_heads, cfg.model.n_kv_heads, cfg.train.precision) == (32, 8, "bf16")
    assert cfg.checkpoint.keep == 3


# --- --set overrides --------------------------------------------------------------------------------------

def test_overrides_apply_with_toml_types():
    cfg = load_config(TINY, [
        "job.nodes=4",                                  # int
        "train.lr=1",                                   # int into a float field
        "job.exclusive=true",                           # bool
        "job.partition=debug-a100",                     # string without quotes
        'job.account="proj"',                           # string with quotes
        "job.setup=['module load x', \"export A=1\"]",  # list of str
        " parallel.tp = 1 ",                            # blanks around both sides
    ])
    assert cfg.job.nodes == 4 and cfg.world_size == 8
    assert isinstance(cfg.train.lr, float) and cfg.train.lr == 1.0
    assert cfg.job.exclusive is True
    assert cfg.job.partition == "debug-a100"
    assert cfg.job.account == "proj"
    assert cfg.job.setup == ["module load x", "export A=1"]
    assert cfg.parallel.tp == 1
    assert cfg.model.dim == 128  # untouched keys keep the file's value


def test_later_override_wins_and_paths_need_no_quotes():
    cfg = load_config(None, ["job.nodes=3", "job.nodes=5", "data.source=bin", "data.path=/scratch/tok.bin"])
    assert cfg.job.nodes == 5
    assert cfg.data.path == "/scratch/tok.bin"


def test_override_can_fix_a_file_value():
    cfg = load_config(GPU, ["parallel.tp=4", "parallel.dp=4"])
    assert (cfg.parallel.pp, cfg.parallel.dp, cfg.parallel.tp) == (2, 4, 4)


# --- errors name the key and the value --------------------------------------------------------------------

@pytest.mark.parametrize("override, fragments", [
    # wrong type
    ("job.nodes=two", ["job.nodes", "'two'", "int"]),
    ("job.exclusive=1", ["job.exclusive", "1", "bool"]),
    ("train.lr=fast", ["train.lr", "'fast'", "float"]),
    ("train.lr=true", ["train.lr", "True", "float"]),
    ("job.setup=module load cuda", ["job.setup", "'module load cuda'", "list"]),
    ("job.srun_args=['--mpi=pmi2', 3]", ["job.srun_args[1]", "3", "str"]),
    # out of range or not one of the choices
    ("job.nodes=0", ["job.nodes = 0", ">= 1"]),
    ("job.tasks_per_node=-1", ["job.tasks_per_node = -1"]),
    ("parallel.tp=0", ["parallel.tp = 0"]),
    ("parallel.pp=0", ["parallel.pp = 0"]),
    ("parallel.dp=0", ["parallel.dp = 0", "-1"]),
    ("parallel.dp=-2", ["parallel.dp = -2", "-1"]),
    ("job.executor=pbs", ["job.executor", "'pbs'", "slurm"]),
    ("job.preflight_margin=1.0", ["job.preflight_margin = 1.0", "between 0 and 1"]),
    ("model.mlp=relu", ["model.mlp", "'relu'", "gelu"]),
    ("parallel.backend=mpi", ["parallel.backend", "'mpi'", "gloo"]),
    ("parallel.backend=nccl", ["parallel.backend = 'nccl'", "job.gpus_per_node = 0"]),
    ("train.precision=fp8", ["train.precision", "'fp8'", "bf16"]),
    ("train.lr=0", ["train.lr = 0"]),
    ("checkpoint.keep=1", ["checkpoint.keep = 1", ">= 2"]),
    ("job.signal_delay_s=3600", ["job.signal_delay_s = 3600", "job.time_min = 60"]),
    ("job.gpus_per_node=2", ["job.gpus_per_node = 2", "job.tasks_per_node = 1"]),
    ("job.sbatch_extra=['mail-type=END']", ["'mail-type=END'", "--option"]),
    ("job.sbatch_extra=['-N 2']", ["'-N 2'"]),
    ("model.dim=130", ["model.dim = 130", "model.n_heads = 4"]),
    ("model.n_kv_heads=3", ["model.n_heads = 4", "model.n_kv_heads = 3"]),
    ("data.seq_len=512", ["data.seq_len = 512", "model.max_seq_len = 256"]),
    ("data.source=bin", ["data.source = 'bin'", "data.path"]),
    ("job.name=my job", ["job.name = 'my job'"]),
    ("job.name=a/b", ["job.name = 'a/b'"]),
    # the MPI plugin has one place, job.mpi, which submit checks against the site's `srun --mpi=list`
    ("job.srun_args=['--mpi=pmix']", ["job.srun_args", "'--mpi=pmix'", "job.mpi = 'pmix'"]),
    ("job.srun_args=['--mpi', 'pmix']", ["job.srun_args", "'--mpi'", "job.mpi"]),
    ("job.mpi='pmi 2'", ["job.mpi = 'pmi 2'"]),
])
def test_bad_value_is_refused_with_key_and_value(override, fragments):
    refused([override], *fragments)


@pytest.mark.parametrize("schedule", ["zbv", "interleaved_zero_bubble"])
def test_compiled_blocks_refuse_the_zero_bubble_schedules(schedule):
    """Found by compiling every layout of the equivalence suite: torch's ZBV schedule raises on compiled stage
    modules (it splits each block's backward); refused at config load, before any GPU time."""
    pp = ["parallel.pp=2", f"parallel.pp_schedule={schedule}", "parallel.pp_virtual_stages=2", "model.n_layers=4",
          "train.grad_accum=4"]
    refused(pp + ["train.compile=true"], "train.compile = true", f"{schedule!r}", "interleaved_1f1b")
    load_config(None, pp)  # eager: accepted
    load_config(None, pp[:1] + ["parallel.pp_schedule=interleaved_1f1b"] + pp[2:] + ["train.compile=true"])


def test_signal_delay_boundary():
    assert load_config(None, ["job.time_min=1", "job.signal_delay_s=59"]).job.signal_delay_s == 59
    refused(["job.time_min=1", "job.signal_delay_s=60"], "job.signal_delay_s = 60", "job.time_min = 1")


def test_gpus_per_node_equal_to_tasks_is_accepted():
    cfg = load_config(None, ["job.tasks_per_node=4", "job.gpus_per_node=4"])
    assert cfg.job.gpus_per_node == 4


def test_unknown_section_suggests_the_close_one():
    refused(["jobs.nodes=2"], "[jobs]", "did you mean 'job'", "parallel")


def test_unknown_section_in_file(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[paralel]\ntp = 2\n")
    refused([], "[paralel]", "did you mean 'parallel'", path=path)


def test_misspelt_key_lists_valid_keys_and_suggests():
    msg = refused(["job.node=2"], "job.node", "did you mean 'nodes'")
    valid = msg.split("valid:")[1]
    for key in ("nodes", "tasks_per_node", "gpus_per_node", "sbatch_extra", "wait_timeout_s"):
        assert key in valid


def test_key_at_top_level_is_refused(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("job = 3\n")
    refused([], "[job]", "table", path=path)


@pytest.mark.parametrize("override", ["job.nodes", "nodes=2", "job.=2", "=2", ""])
def test_malformed_set_is_refused(override):
    refused([override], f"--set {override!r}", "section.key=value")


def test_missing_file_names_the_path(tmp_path):
    path = tmp_path / "nope.toml"
    refused([], str(path), "cannot read", path=path)


def test_invalid_toml_names_the_path(tmp_path):
    path = tmp_path / "broken.toml"
    path.write_text("[job\nnodes = 2\n")
    refused([], str(path), "not valid TOML", path=path)


# --- round trip -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("path", [None, TINY, GPU], ids=["defaults", "tiny-cpu", "gpu-4x8"])
def test_dump_then_load_gives_an_equal_config(path, tmp_path):
    cfg = load_config(path)
    back = reload(cfg, tmp_path)
    assert back == cfg
    assert dump_toml(back) == dump_toml(cfg)


def test_round_trip_with_quotes_backslashes_and_lists(tmp_path):
    cfg = load_config(None, [
        r"""job.setup=['echo "hi there"', 'C:\dir\sub', "it's", '\\share\x', '']""",
        r"""data.path='/data/a "b" \c.h5'""",
        "data.source=hdf5",
        """job.sbatch_extra=['--comment="a b"', '--requeue']""",
        "job.srun_args=[]",
        "job.mem_gb=1.5",
        "train.lr=1e-10",
    ])
    assert cfg.job.setup[1] == "C:\\dir\\sub" and cfg.data.path.endswith('"b" \\c.h5')
    assert reload(cfg, tmp_path) == cfg


def test_round_trip_with_newline_in_a_string(tmp_path):
    # outside [job] (whose strings must stay on one line of the job script) a newline is kept and escaped
    cfg = load_config(None, [r'data.path="/data/a\nb.h5"', "data.source=hdf5"])
    assert cfg.data.path == "/data/a\nb.h5"
    assert reload(cfg, tmp_path) == cfg


def test_dump_has_every_section():
    text = dump_toml(Config())
    for section in ("[job]", "[parallel]", "[model]", "[train]", "[data]", "[checkpoint]"):
        assert section in text


# --- sbatch_extra_dict ------------------------------------------------------------------------------------

def test_sbatch_extra_dict():
    job = JobConfig(sbatch_extra=["--mail-type=END,FAIL", "--requeue", "--comment=a=b", "--reservation="])
    assert job.sbatch_extra_dict() == {"mail-type": "END,FAIL", "requeue": True, "comment": "a=b",
                                       "reservation": ""}
    assert JobConfig().sbatch_extra_dict() == {}


def test_run_root_defaults_to_scratch(monkeypatch, tmp_path):
    # where the site sets $SCRATCH, runs go there, not into the clone (often an NFS home with a small quota)
    monkeypatch.setenv("SCRATCH", "/scratch/u1")
    cfg = load_config(None)
    assert cfg.job.run_root == "/scratch/u1/hpctrain"
    assert load_config(None, ["job.run_root=elsewhere"]).job.run_root == "elsewhere"
    # resolved once, when the config is built: the run's config.toml names it, whatever a rank's $SCRATCH says
    assert 'run_root = "/scratch/u1/hpctrain"' in dump_toml(cfg)
    monkeypatch.setenv("SCRATCH", "/scratch/other")
    assert reload(cfg, tmp_path).job.run_root == "/scratch/u1/hpctrain"
    for unset in (lambda: monkeypatch.delenv("SCRATCH"), lambda: monkeypatch.setenv("SCRATCH", "")):
        unset()
        assert load_config(None).job.run_root == JobConfig().run_root == "runs"


def test_a_renamed_key_is_refused_with_its_new_name(tmp_path):
    """job.hang_requeues became job.node_requeues (one limit for the preflight's and a hang's requeues): a config
    that still names it is refused, naming the value and the new key, from a file and from --set alike."""
    cfg = tmp_path / "c.toml"
    cfg.write_text("[job]\nhang_requeues = 3\n")
    for args in [(cfg, ()), (None, ["job.hang_requeues=3"])]:
        with pytest.raises(ValueError, match=r"job.hang_requeues = 3: the key is now job.node_requeues"):
            load_config(*args)
    assert load_config(None, ["job.node_requeues=3"]).job.node_requeues == 3
    assert load_config(None).job.node_requeues == 2
