"""Typed run configuration: one dataclass per TOML section, validated on load.

    cfg = load_config("slurm/examples/tiny-cpu.toml", ["parallel.tp=2", "job.nodes=2"])

Every value is checked when the config is built, so a typo or an impossible value fails on the login node,
before anything is submitted. `dump_toml(cfg)` writes the resolved config that goes into each run directory.
This module imports neither torch nor mpi4py.
"""
from __future__ import annotations

import dataclasses
import difflib
import json
import math
import re
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path

from hpctrain import hfconfig


def _check(ok: bool, msg: str) -> None:
    if not ok:
        raise ValueError(msg)


def _one_of(section: str, key: str, value: str, allowed: tuple[str, ...]) -> None:
    _check(value in allowed, f"{section}.{key} = {value!r} is not one of {', '.join(allowed)}")


def _check_fields(section: str, obj: object, one_line: bool = False) -> None:
    """Checks every str and float of a section, list entries too, whatever the key: strings must encode as UTF-8
    (config.toml is written in it and every rank reads it back), floats must be finite, and with one_line strings
    hold no CR, LF or NUL ([job] strings become #SBATCH lines and shell lines of the job script, one line each)."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        for i, v in enumerate(value) if isinstance(value, list) else [(None, value)]:
            where = f"{section}.{f.name}" + ("" if i is None else f"[{i}]")
            if isinstance(v, float):
                _check(math.isfinite(v), f"{where} = {v!r} must be a finite number")
            elif isinstance(v, str):
                try:
                    v.encode("utf-8")
                except UnicodeEncodeError as e:  # a lone surrogate: argv bytes that were not UTF-8
                    raise ValueError(f"{where} = {v!r} is not UTF-8 text: {e.reason} at character {e.start}") from None
                _check(not (one_line and re.search(r"[\r\n\0]", v)),
                       f"{where} = {v!r} holds a line break or NUL: each [job] value must stay on one line of the "
                       f"job script")


def _positive(section: str, obj: object, *keys: str, allow_zero: bool = False) -> None:
    for key in keys:
        value = getattr(obj, key)
        low = 0 if allow_zero else 1
        _check(value >= low, f"{section}.{key} = {value!r} must be >= {low}")


# Far past any machine, yet small enough that the per-rank tables of a dry run (node of each rank, rank map)
# fit in memory: 10^10 ranks made `submit --dry-run` allocate until killed.
MAX_WORLD_SIZE = 1 << 20


@dataclass
class JobConfig:
    """[job]: what Slurm is asked for, and where runs go."""
    name: str = "hpctrain"
    run_root: str = "runs"  # each run gets a fresh directory below this
    executor: str = "auto"  # auto (Slurm when reachable, else local) | slurm | local
    nodes: int = 1
    tasks_per_node: int = 1  # ranks per node: one per GPU
    gpus_per_node: int = 0
    cpus_per_task: int = 1
    mem_gb: float = 0.0  # per node; 0: the site default, or with exclusive all of the node's (--mem=0)
    time_min: int = 60
    partition: str = ""
    account: str = ""
    qos: str = ""
    constraint: str = ""
    wckey: str = ""  # empty: no --wckey line (submitit's default "submitit" is refused where wckeys are enforced)
    exclusive: bool = False
    signal_delay_s: int = 120  # USR2 arrives this long before the time limit
    sbatch_extra: list[str] = field(default_factory=list)  # e.g. ["--mail-type=END", "--reservation=x"]
    setup: list[str] = field(default_factory=list)  # shell lines before srun, e.g. "module load cuda"
    # srun --mpi plugin, checked at submit against the site's `srun --mpi=list`: pmi2 for MPICH/Intel MPI, pmix for
    # Open MPI 5 (which has no PMI2: under pmi2 each task would be rank 0 of 1); "": the site's MpiDefault
    mpi: str = "pmi2"
    srun_args: list[str] = field(default_factory=list)  # more srun options, after ours, e.g. "--cpu-bind=none"
    wait_timeout_s: int = 120  # how long --wait waits for results after the job left the queue
    # hardware profile the planner checks the layout against before submission (hpctrain plan --gpu: a100-40g,
    # a100-80g, h100-sxm, h100-pcie, h200, b200, mi250x, mi300x, cpu); "": cpu when gpus_per_node = 0, else none
    gpu: str = ""

    def __post_init__(self) -> None:
        _check_fields("job", self, one_line=True)
        _check(re.fullmatch(r"[A-Za-z0-9_.-]+", self.name) is not None,
               f"job.name = {self.name!r} may only hold letters, digits, '_', '.', '-'")
        _one_of("job", "executor", self.executor, ("auto", "slurm", "local"))
        _positive("job", self, "nodes", "tasks_per_node", "cpus_per_task", "time_min")
        _positive("job", self, "gpus_per_node", "mem_gb", "signal_delay_s", "wait_timeout_s", allow_zero=True)
        ranks = self.nodes * self.tasks_per_node
        _check(ranks <= MAX_WORLD_SIZE, f"job.nodes = {self.nodes} x job.tasks_per_node = {self.tasks_per_node} = "
               f"{ranks} ranks, more than the {MAX_WORLD_SIZE} hpctrain plans for")
        _check(self.gpus_per_node in (0, self.tasks_per_node),
               f"job.gpus_per_node = {self.gpus_per_node} must be 0 (CPU) or equal job.tasks_per_node = "
               f"{self.tasks_per_node}: hpctrain runs one rank per GPU")
        _check(self.signal_delay_s < self.time_min * 60,
               f"job.signal_delay_s = {self.signal_delay_s} must be shorter than job.time_min = {self.time_min} min")
        for line in self.sbatch_extra:
            _check(re.fullmatch(r"--[a-z][a-z0-9-]*(=.*)?", line) is not None,
                   f"job.sbatch_extra entry {line!r} must look like '--option' or '--option=value'")
        _check(re.fullmatch(r"[a-z0-9_]*", self.mpi) is not None,
               f"job.mpi = {self.mpi!r} must be an srun MPI plugin name (`srun --mpi=list`), e.g. 'pmi2' or 'pmix'")
        for arg in self.srun_args:
            name, eq, value = arg.partition("=")
            _check(name != "--mpi", f"job.srun_args entry {arg!r}: set job.mpi = {value or 'NAME'!r} instead "
                   f"(one place for the MPI plugin, checked against the site's `srun --mpi=list` at submit)")

    def sbatch_extra_dict(self) -> dict[str, str | bool]:
        """sbatch_extra as submitit's additional_parameters ({"mail-type": "END"})."""
        out: dict[str, str | bool] = {}
        for line in self.sbatch_extra:
            key, eq, value = line[2:].partition("=")
            out[key] = value if eq else True
        return out


PP_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "looped_bfs", "interleaved_zero_bubble", "zbv")


@dataclass
class ParallelConfig:
    """[parallel]: the (pp, dp, tp) layout, tp innermost, and how ranks connect."""
    pp: int = 1
    dp: int = -1  # -1: whatever is left of the world after pp * tp
    tp: int = 1  # must fit inside one node
    backend: str = "auto"  # auto (nccl with CUDA, else gloo) | nccl | gloo
    timeout_s: int = 600  # collective and rendezvous timeout
    rendezvous: str = "auto"  # auto | mpi | slurm | submitit | torchrun | single
    master_addr: str = ""  # where rank 0's store listens (bound to it only); empty: parallel.interface's address,
    #                        else 127.0.0.1 on one host, else the host name's address unless it is loopback
    interface: str = ""  # e.g. "ib0": rank 0 publishes its address; NCCL_SOCKET_IFNAME, GLOO_SOCKET_IFNAME unless set
    connect_timeout_s: int = 60  # ranks stop dialling rank 0's store after this, naming it (timeout_s: collectives)
    zero_stage: int = 0  # 0 DDP, 1 + optimizer state sharded, 2 + gradients (FSDP2), 3 + parameters (FSDP2)
    sequence_parallel: bool = False  # shard norms and residuals along the sequence inside the tp group
    loss_parallel: bool = True  # keep logits vocab-sharded into the cross-entropy (tp > 1)
    # pipeline (pp > 1): train.grad_accum is the number of micro-batches each step pipelines
    pp_schedule: str = "1f1b"  # gpipe | 1f1b | interleaved_1f1b | looped_bfs | interleaved_zero_bubble | zbv
    pp_virtual_stages: int = 1  # model chunks per pp rank: 1 for gpipe/1f1b, >= 2 interleaved, 2 for zbv
    pp_layers: list[int] = field(default_factory=list)  # blocks per stage (pp * virtual entries); [] balanced

    def __post_init__(self) -> None:
        _check_fields("parallel", self)
        _positive("parallel", self, "pp", "tp", "timeout_s", "connect_timeout_s", "pp_virtual_stages")
        _check(re.fullmatch(r"[A-Za-z0-9_.:@-]{0,15}", self.interface) is not None, f"parallel.interface = "
               f"{self.interface!r} must be one network interface name (`ip -br addr` lists them), e.g. 'ib0'")
        _one_of("parallel", "pp_schedule", self.pp_schedule, PP_SCHEDULES)
        multi = self.pp_schedule not in ("gpipe", "1f1b")
        if self.pp > 1 and not multi:
            _check(self.pp_virtual_stages == 1, f"parallel.pp_virtual_stages = {self.pp_virtual_stages} needs an "
                   f"interleaved schedule; parallel.pp_schedule = {self.pp_schedule!r} runs one stage per rank")
        if self.pp > 1 and multi:
            _check(self.pp_virtual_stages >= 2, f"parallel.pp_schedule = {self.pp_schedule!r} runs several stages "
                   f"per rank: set parallel.pp_virtual_stages >= 2 (got {self.pp_virtual_stages})")
        if self.pp > 1 and self.pp_schedule == "zbv":
            _check(self.pp_virtual_stages == 2, f"parallel.pp_schedule = 'zbv' needs exactly 2 virtual stages per "
                   f"rank (got parallel.pp_virtual_stages = {self.pp_virtual_stages})")
        if self.pp_layers:
            stages = self.pp * self.pp_virtual_stages
            _check(len(self.pp_layers) == stages, f"parallel.pp_layers = {self.pp_layers} has {len(self.pp_layers)} "
                   f"entries; pp ({self.pp}) x pp_virtual_stages ({self.pp_virtual_stages}) = {stages} stages")
            _check(all(n >= 0 for n in self.pp_layers), f"parallel.pp_layers = {self.pp_layers}: counts must be >= 0")
        _check(self.zero_stage in (0, 1, 2, 3), f"parallel.zero_stage = {self.zero_stage} must be 0, 1, 2 or 3")
        _check(self.dp == -1 or self.dp >= 1, f"parallel.dp = {self.dp} must be >= 1, or -1 for auto")
        _one_of("parallel", "backend", self.backend, ("auto", "nccl", "gloo"))
        _one_of("parallel", "rendezvous", self.rendezvous,
                ("auto", "mpi", "slurm", "submitit", "torchrun", "single"))


@dataclass
class ModelConfig:
    """[model]: a Llama-style decoder."""
    vocab_size: int = 256
    dim: int = 128
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 0  # 0: same as n_heads (no grouped-query attention)
    ffn_dim: int = 0  # 0: about 8/3 * dim, rounded up to a multiple of 64
    max_seq_len: int = 256
    tie_embeddings: bool = False
    rope_theta: float = 10000.0  # RoPE base; train.init_from = "hf:PATH" takes it (and the sizes) from config.json
    norm_eps: float = 1e-5  # RMSNorm epsilon

    def __post_init__(self) -> None:
        _check_fields("model", self)
        _positive("model", self, "vocab_size", "dim", "n_layers", "n_heads", "max_seq_len")
        _positive("model", self, "n_kv_heads", "ffn_dim", allow_zero=True)
        _check(self.dim % self.n_heads == 0,
               f"model.dim = {self.dim} is not divisible by model.n_heads = {self.n_heads}")
        kv = self.n_kv_heads or self.n_heads
        _check(self.n_heads % kv == 0,
               f"model.n_heads = {self.n_heads} is not divisible by model.n_kv_heads = {kv}")
        _check(self.rope_theta > 0 and self.norm_eps > 0,
               f"model.rope_theta = {self.rope_theta}, model.norm_eps = {self.norm_eps} must be > 0")


@dataclass
class TrainConfig:
    """[train]: the optimisation loop."""
    steps: int = 100
    micro_batch_size: int = 8  # sequences per rank per micro-step
    global_batch_size: int = 0  # if set: sequences per optimizer step; micro_batch_size = it / (dp * grad_accum)
    grad_accum: int = 1
    lr: float = 3e-4
    scale_lr_with_batch: int = 0  # if set: lr is for this global batch and scales linearly with the real one
    warmup_steps: int = 10
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio at the last step
    weight_decay: float = 0.1  # not applied to norms, biases or other 1-D parameters
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0  # on the global norm across all shards; 0 disables
    seed: int = 0
    precision: str = "fp32"  # fp32 | bf16 | fp16 (compute dtype; master weights and optimizer stay fp32)
    reduce_dtype: str = "fp32"  # gradient reduction dtype: fp32 | bf16
    loss_scale: float = 65536.0  # initial dynamic loss scale for fp16
    ac: str = "none"  # activation checkpointing: none | full | every
    ac_every: int = 2  # with ac = "every": checkpoint blocks 0, k, 2k, ...
    log_every: int = 10
    profile_steps: list[int] = field(default_factory=list)  # [first, last] steps traced by torch.profiler
    peak_tflops: float = 0.0  # per-rank peak for MFU; 0: a recognised GPU's datasheet figure, else the GEMM probe's
    tf32: bool = True  # CUDA only: fp32 matmuls and convolutions on TF32 tensor cores (10-bit mantissa inputs)
    prefetch: int = 2  # batches a background thread prepares ahead (pinned on CUDA); 0: load in the step
    resume: str = "auto"  # auto: newest committed checkpoint of the run, if any | none | a checkpoint directory
    # "hf:PATH": start from a Hugging Face Llama directory's weights (unless resuming from our own checkpoint);
    # [model] keys left out are taken from its config.json, keys given must agree with it. "": the seeded init
    init_from: str = ""
    eval_every: int = 0  # validation loss every this many steps, and after the last; 0: never
    eval_batches: int = 8  # global micro-batches of the validation split per evaluation, the same ones each time

    def __post_init__(self) -> None:
        _check_fields("train", self)
        _positive("train", self, "micro_batch_size", "grad_accum", "log_every", "ac_every", "eval_batches")
        _positive("train", self, "eval_every", "steps", "global_batch_size", "warmup_steps", "scale_lr_with_batch",
                  "weight_decay", "grad_clip", "peak_tflops", "prefetch", allow_zero=True)
        _check(self.lr > 0, f"train.lr = {self.lr} must be > 0")
        _check(0 <= self.min_lr_ratio <= 1, f"train.min_lr_ratio = {self.min_lr_ratio} must be within [0, 1]")
        _check(0 <= self.beta1 < 1 and 0 <= self.beta2 < 1,
               f"train.beta1 = {self.beta1}, train.beta2 = {self.beta2} must be within [0, 1)")
        _check(self.loss_scale > 0, f"train.loss_scale = {self.loss_scale} must be > 0")
        _one_of("train", "precision", self.precision, ("fp32", "bf16", "fp16"))
        _one_of("train", "reduce_dtype", self.reduce_dtype, ("fp32", "bf16"))
        _one_of("train", "ac", self.ac, ("none", "full", "every"))
        _check(len(self.profile_steps) in (0, 2) and (not self.profile_steps or
                                                      0 <= self.profile_steps[0] <= self.profile_steps[1]),
               f"train.profile_steps = {self.profile_steps} must be [] or [first, last] with first <= last")
        _check(self.init_from == "" or (self.init_from.startswith("hf:") and len(self.init_from) > 3),
               f"train.init_from = {self.init_from!r} must be '' or 'hf:PATH' (a Hugging Face Llama directory)")


@dataclass
class DataConfig:
    """[data]: where tokens come from."""
    source: str = "synthetic"  # synthetic | bin | hdf5
    path: str = ""  # one token file; or data.paths for a blend
    paths: list[str] = field(default_factory=list)  # several token files mixed by data.weights
    weights: list[float] = field(default_factory=list)  # one per entry of data.paths, > 0; []: equal shares
    # validation split for train.eval_every; "": beside each training file, its "<stem>.val<suffix>" (what
    # `hpctrain data build --val-fraction` writes), blended with the same weights; synthetic data: another seed
    val_path: str = ""
    seq_len: int = 128

    def __post_init__(self) -> None:
        _check_fields("data", self)
        _one_of("data", "source", self.source, ("synthetic", "bin", "hdf5"))
        _positive("data", self, "seq_len")
        _check(not (self.path and self.paths), f"data.path = {self.path!r} and data.paths = {self.paths}: give "
               f"one file as data.path or several as data.paths, not both")
        _check(self.source == "synthetic" or self.path != "" or self.paths != [],
               f"data.source = {self.source!r} needs data.path (or data.paths)")
        _check(not self.weights or len(self.weights) == len(self.paths), f"data.weights = {self.weights} needs one "
               f"weight per entry of data.paths ({len(self.paths)} entries)")
        _check(all(w > 0 for w in self.weights), f"data.weights = {self.weights}: every weight must be > 0")
        _check(len(set(self.paths)) == len(self.paths), f"data.paths = {self.paths} names a file twice: give it "
               f"a larger weight instead")

    @property
    def files(self) -> list[str]:
        """The training token files: data.paths, or [data.path]; [] for synthetic data."""
        return list(self.paths) or ([self.path] if self.path else [])

    @property
    def shares(self) -> list[float]:
        """Each training file's share of the samples, summing to 1 (equal shares when data.weights is [])."""
        weights = self.weights or [1.0] * len(self.files)
        return [w / sum(weights) for w in weights]


@dataclass
class CheckpointConfig:
    """[checkpoint]: sharded HDF5 checkpoints."""
    dir: str = ""  # empty: <run dir>/checkpoints
    every_steps: int = 0  # 0: only on preemption, on demand (touch <run dir>/SAVE_NOW) and at the end
    keep: int = 2
    async_save: bool = False  # training goes on while shards are written (at most one save in flight)
    verify: str = "full"  # checksums checked at load: full | sampled (1 in 8 datasets) | none
    stripe_count: int = 0  # Lustre: lfs setstripe -c on each checkpoint directory (0: leave alone, -1: all OSTs)
    stripe_size_mb: int = 4
    at_end: bool = True  # save once more after the last step
    chunk_mb: float = 0.0  # 0: contiguous HDF5 datasets (one write, one read each); > 0: chunks up to this size

    def __post_init__(self) -> None:
        _check_fields("checkpoint", self)
        _positive("checkpoint", self, "every_steps", allow_zero=True)
        _positive("checkpoint", self, "stripe_size_mb")
        _check(self.chunk_mb >= 0, f"checkpoint.chunk_mb = {self.chunk_mb} must be >= 0 (0: contiguous datasets)")
        _one_of("checkpoint", "verify", self.verify, ("full", "sampled", "none"))
        _check(self.stripe_count >= -1, f"checkpoint.stripe_count = {self.stripe_count} must be >= -1")
        _check(self.keep >= 2, f"checkpoint.keep = {self.keep} must be >= 2 so one committed checkpoint survives")


@dataclass
class Config:
    job: JobConfig = field(default_factory=JobConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)

    def __post_init__(self) -> None:
        _check(self.parallel.backend != "nccl" or self.job.gpus_per_node > 0,
               f"parallel.backend = 'nccl' needs GPUs but job.gpus_per_node = {self.job.gpus_per_node}")
        t = self.train
        _check(not (self.parallel.pp > 1 and t.eval_every and t.eval_batches % t.grad_accum),
               f"train.eval_batches = {t.eval_batches} must be a multiple of train.grad_accum = {t.grad_accum} with "
               f"parallel.pp = {self.parallel.pp}: a pipelined evaluation runs the schedule's micro-batches")
        _check(self.data.seq_len <= self.model.max_seq_len,
               f"data.seq_len = {self.data.seq_len} exceeds model.max_seq_len = {self.model.max_seq_len}")

    @property
    def world_size(self) -> int:
        return self.job.nodes * self.job.tasks_per_node


_HINTS = typing.get_type_hints(Config)
SECTIONS: dict[str, type] = {f.name: _HINTS[f.name] for f in dataclasses.fields(Config)}


def _suggest(word: str, valid: typing.Iterable[str]) -> str:
    valid = sorted(valid)
    close = difflib.get_close_matches(word, valid, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"{hint}; valid: {', '.join(valid)}"


def _coerce(where: str, value: object, kind: object) -> object:
    """Checks one TOML value against a field type; ints are accepted for float fields."""
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        try:
            return float(value)
        except OverflowError:
            raise ValueError(f"{where} = {value} must be a finite number") from None
    if kind in (int, float, str, bool):
        if type(value) is not kind:
            raise ValueError(f"{where} = {value!r} must be {kind.__name__}, not {type(value).__name__}")
        return value
    if typing.get_origin(kind) is list:
        (item,) = typing.get_args(kind)
        if not isinstance(value, list):
            raise ValueError(f"{where} = {value!r} must be a list of {item.__name__}")
        return [_coerce(f"{where}[{i}]", v, item) for i, v in enumerate(value)]
    raise AssertionError(f"unsupported field type {kind} for {where}")


def _parse_override(text: str) -> tuple[str, str, object]:
    """'section.key=value' -> (section, key, value); value parsed as TOML, else taken as a string."""
    lhs, eq, rhs = text.partition("=")
    section, dot, key = lhs.strip().partition(".")
    if not eq or not dot or not key:
        raise ValueError(f"--set {text!r} must look like section.key=value")
    try:
        value = tomllib.loads(f"v = {rhs.strip()}")["v"]
    except ValueError:  # TOMLDecodeError, or an integer past Python's 4300-digit limit
        value = rhs.strip()
    return section, key.strip(), value


def from_dict(raw: dict[str, typing.Any]) -> Config:
    """Builds and validates a Config from nested dicts ({"job": {"nodes": 2}, ...})."""
    sections = {}
    raw = dict(raw)
    if isinstance(raw.get("train"), dict) and isinstance(raw["train"].get("init_from"), str):
        raw.setdefault("model", {})  # an HF directory gives the sizes even with no [model] section
    for name, table in raw.items():
        if name not in SECTIONS:
            raise ValueError(f"unknown section [{name}]{_suggest(name, SECTIONS)}")
        if not isinstance(table, dict):
            raise ValueError(f"[{name}] must be a table of key = value, not {table!r}")
        cls = SECTIONS[name]
        hints = typing.get_type_hints(cls)
        kwargs = {}
        if name == "model":  # train.init_from = "hf:PATH": the directory's config.json fills in and checks [model]
            init_from = raw.get("train", {}).get("init_from", "") if isinstance(raw.get("train"), dict) else ""
            table = hfconfig.model_table(init_from, table) if isinstance(init_from, str) else table
        for key, value in table.items():
            if key not in hints:
                raise ValueError(f"unknown key {name}.{key}{_suggest(key, hints)}")
            kwargs[key] = _coerce(f"{name}.{key}", value, hints[key])
        sections[name] = cls(**kwargs)
    return Config(**sections)


def load_config(path: str | Path | None, overrides: typing.Sequence[str] = ()) -> Config:
    """Reads a TOML file (or starts from defaults when path is None), applies overrides, validates."""
    raw: dict[str, typing.Any] = {}
    if path is not None:
        path = Path(path)
        try:
            data = path.read_bytes()
        except OSError as e:
            raise ValueError(f"cannot read config file {str(path)!r}: {e.strerror or e}") from None
        try:
            text = data.decode("utf-8")  # TOML is UTF-8 whatever the locale says
        except UnicodeDecodeError as e:
            line = data.count(b"\n", 0, e.start) + 1
            raise ValueError(f"config file {str(path)!r} is not UTF-8 text: byte {data[e.start]:#04x} at line "
                             f"{line}") from None
        try:
            raw = tomllib.loads(text)
        except ValueError as e:  # TOMLDecodeError (its message gives line and column), or a 4300-digit integer
            raise ValueError(f"config file {str(path)!r} is not valid TOML: {e}") from None
    for text in overrides:
        section, key, value = _parse_override(text)
        if section not in SECTIONS:
            raise ValueError(f"--set {text!r}: unknown section [{section}]{_suggest(section, SECTIONS)}")
        raw.setdefault(section, {})[key] = value
    return from_dict(raw)


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # JSON escapes (newline, quote, \uXXXX) are valid in TOML basic strings
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise AssertionError(f"cannot write {value!r} as TOML")


def dump_toml(cfg: Config) -> str:
    """The resolved config as TOML text that load_config reads back to an equal Config."""
    lines = []
    for name in SECTIONS:
        lines.append(f"[{name}]")
        for key, value in dataclasses.asdict(getattr(cfg, name)).items():
            lines.append(f"{key} = {_toml_value(value)}")
        lines.append("")
    return "\n".join(lines)


def to_dict(cfg: Config) -> dict[str, dict[str, typing.Any]]:
    return dataclasses.asdict(cfg)
