"""The [job], [parallel] and [model] sections of the run configuration, and the checks every section uses.
hpctrain.config holds the rest and builds the whole Config from TOML; import the sections from there. Imports
nothing of hpctrain.
"""
from __future__ import annotations

import dataclasses
import math
import os
import re
from dataclasses import dataclass, field


def check(ok: bool, msg: str) -> None:
    if not ok:
        raise ValueError(msg)


def one_of(section: str, key: str, value: str, allowed: tuple[str, ...]) -> None:
    check(value in allowed, f"{section}.{key} = {value!r} is not one of {', '.join(allowed)}")


def check_fields(section: str, obj: object, one_line: bool = False) -> None:
    """Checks every str and float of a section, list entries too, whatever the key: strings must encode as UTF-8
    (config.toml is written in it and every rank reads it back), floats must be finite, and with one_line strings
    hold no CR, LF or NUL ([job] strings become #SBATCH lines and shell lines of the job script, one line each)."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        for i, v in enumerate(value) if isinstance(value, list) else [(None, value)]:
            where = f"{section}.{f.name}" + ("" if i is None else f"[{i}]")
            if isinstance(v, float):
                check(math.isfinite(v), f"{where} = {v!r} must be a finite number")
            elif isinstance(v, str):
                try:
                    v.encode("utf-8")
                except UnicodeEncodeError as e:  # a lone surrogate: argv bytes that were not UTF-8
                    raise ValueError(f"{where} = {v!r} is not UTF-8 text: {e.reason} at character {e.start}") from None
                check(not (one_line and re.search(r"[\r\n\0]", v)),
                       f"{where} = {v!r} holds a line break or NUL: each [job] value must stay on one line of the "
                       f"job script")


def positive(section: str, obj: object, *keys: str, allow_zero: bool = False) -> None:
    for key in keys:
        value = getattr(obj, key)
        low = 0 if allow_zero else 1
        check(value >= low, f"{section}.{key} = {value!r} must be >= {low}")


def default_run_root() -> str:
    """job.run_root when the config names none: $SCRATCH/hpctrain where the site sets $SCRATCH (a large file system
    for job output, unlike the NFS home a clone usually sits in), else "runs" below the current directory. Resolved
    when the config is built, so the run's config.toml names the directory every rank uses."""
    scratch = os.environ.get("SCRATCH", "")
    return os.path.join(scratch, "hpctrain") if scratch else "runs"


# Far past any machine, yet small enough that the per-rank tables of a dry run (node of each rank, rank map)
# fit in memory: 10^10 ranks made `submit --dry-run` allocate until killed.
MAX_WORLD_SIZE = 1 << 20


@dataclass
class JobConfig:
    """[job]: what Slurm is asked for, and where runs go."""
    name: str = "hpctrain"
    run_root: str = field(default_factory=default_run_root)  # each run gets a fresh directory below this
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
    # `hpctrain doctor`'s checks on training's own groups, after the mesh and before the model; under Slurm a job
    # with a failed node is requeued without it (hpctrain/doctor.py preflight)
    preflight: bool = False
    # after a hang, the first rank to see it requeues the Slurm job without the nodes of ranks that left no hang dump
    # (stopped, dead, stuck in the kernel), at most this many times per run; it resumes from its last checkpoint
    # (hpctrain/hangrequeue.py); 0: a hung job just ends
    hang_requeues: int = 1
    # the compute nodes' hard limit on open files (their `ulimit -Hn`): each rank raises its soft limit to the hard
    # one at start, and the dry run refuses a layout whose rank 0 would need more (hpctrain/planner/fds.py); 0: the
    # submitting host's hard limit, assumed to be the compute nodes' too
    nofile: int = 0

    def __post_init__(self) -> None:
        check_fields("job", self, one_line=True)
        check(re.fullmatch(r"[A-Za-z0-9_.-]+", self.name) is not None,
               f"job.name = {self.name!r} may only hold letters, digits, '_', '.', '-'")
        one_of("job", "executor", self.executor, ("auto", "slurm", "local"))
        positive("job", self, "nodes", "tasks_per_node", "cpus_per_task", "time_min")
        positive("job", self, "gpus_per_node", "mem_gb", "signal_delay_s", "wait_timeout_s", "hang_requeues",
                 "nofile", allow_zero=True)
        ranks = self.nodes * self.tasks_per_node
        check(ranks <= MAX_WORLD_SIZE, f"job.nodes = {self.nodes} x job.tasks_per_node = {self.tasks_per_node} = "
               f"{ranks} ranks, more than the {MAX_WORLD_SIZE} hpctrain plans for")
        check(self.gpus_per_node in (0, self.tasks_per_node),
               f"job.gpus_per_node = {self.gpus_per_node} must be 0 (CPU) or equal job.tasks_per_node = "
               f"{self.tasks_per_node}: hpctrain runs one rank per GPU")
        check(self.signal_delay_s < self.time_min * 60,
               f"job.signal_delay_s = {self.signal_delay_s} must be shorter than job.time_min = {self.time_min} min")
        for line in self.sbatch_extra:
            check(re.fullmatch(r"--[a-z][a-z0-9-]*(=.*)?", line) is not None,
                   f"job.sbatch_extra entry {line!r} must look like '--option' or '--option=value'")
        check(re.fullmatch(r"[a-z0-9_]*", self.mpi) is not None,
               f"job.mpi = {self.mpi!r} must be an srun MPI plugin name (`srun --mpi=list`), e.g. 'pmi2' or 'pmix'")
        for arg in self.srun_args:
            name, eq, value = arg.partition("=")
            check(name != "--mpi", f"job.srun_args entry {arg!r}: set job.mpi = {value or 'NAME'!r} instead "
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
    # the hang watchdog (hpctrain/watchdog.py): no progress within a step's phase for this long dumps every live
    # rank's stacks and flight recorder into RUN_DIR/hang/ and ends the job; 0: off; -1: half of timeout_s, at
    # most 300 s. Must be shorter than timeout_s, so it speaks before the collective timeout (which names nobody)
    hang_timeout_s: int = -1
    # the watchdog's limit for the long phases: start-up (model build, resume) to the end of the first step
    # (compile, lazy NCCL set-up), checkpoint saves and evaluations; 0: as hang_timeout_s
    startup_timeout_s: int = 1200
    flight_recorder: int = 2000  # collectives each rank remembers (torch's flight recorder) for hang dumps; 0: off
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

    @property
    def hang_limits_s(self) -> tuple[float, float] | None:
        """(step, long) limits of the hang watchdog in seconds, None when it is off."""
        step = self.hang_timeout_s if self.hang_timeout_s >= 0 else min(300, self.timeout_s / 2)
        if step == 0:
            return None
        return step, float(self.startup_timeout_s or step)

    def __post_init__(self) -> None:
        check_fields("parallel", self)
        positive("parallel", self, "pp", "tp", "timeout_s", "connect_timeout_s", "pp_virtual_stages")
        positive("parallel", self, "startup_timeout_s", "flight_recorder", allow_zero=True)
        check(self.hang_timeout_s >= -1, f"parallel.hang_timeout_s = {self.hang_timeout_s} must be >= 0 (0: off), "
               f"or -1 for half of parallel.timeout_s")
        check(self.hang_timeout_s < self.timeout_s, f"parallel.hang_timeout_s = {self.hang_timeout_s} must be "
               f"shorter than parallel.timeout_s = {self.timeout_s}: the watchdog must see a hang before the "
               f"collective timeout ends the ranks without a word on who stopped")
        check(self.startup_timeout_s == 0 or self.startup_timeout_s >= self.hang_timeout_s,
               f"parallel.startup_timeout_s = {self.startup_timeout_s} must be 0 or at least parallel.hang_timeout_s"
               f" = {self.hang_timeout_s}")
        check(re.fullmatch(r"[A-Za-z0-9_.:@-]{0,15}", self.interface) is not None, f"parallel.interface = "
               f"{self.interface!r} must be one network interface name (`ip -br addr` lists them), e.g. 'ib0'")
        one_of("parallel", "pp_schedule", self.pp_schedule, PP_SCHEDULES)
        multi = self.pp_schedule not in ("gpipe", "1f1b")
        if self.pp > 1 and not multi:
            check(self.pp_virtual_stages == 1, f"parallel.pp_virtual_stages = {self.pp_virtual_stages} needs an "
                   f"interleaved schedule; parallel.pp_schedule = {self.pp_schedule!r} runs one stage per rank")
        if self.pp > 1 and multi:
            check(self.pp_virtual_stages >= 2, f"parallel.pp_schedule = {self.pp_schedule!r} runs several stages "
                   f"per rank: set parallel.pp_virtual_stages >= 2 (got {self.pp_virtual_stages})")
        if self.pp > 1 and self.pp_schedule == "zbv":
            check(self.pp_virtual_stages == 2, f"parallel.pp_schedule = 'zbv' needs exactly 2 virtual stages per "
                   f"rank (got parallel.pp_virtual_stages = {self.pp_virtual_stages})")
        if self.pp_layers:
            stages = self.pp * self.pp_virtual_stages
            check(len(self.pp_layers) == stages, f"parallel.pp_layers = {self.pp_layers} has {len(self.pp_layers)} "
                   f"entries; pp ({self.pp}) x pp_virtual_stages ({self.pp_virtual_stages}) = {stages} stages")
            check(all(n >= 0 for n in self.pp_layers), f"parallel.pp_layers = {self.pp_layers}: counts must be >= 0")
        check(self.zero_stage in (0, 1, 2, 3), f"parallel.zero_stage = {self.zero_stage} must be 0, 1, 2 or 3")
        check(self.dp == -1 or self.dp >= 1, f"parallel.dp = {self.dp} must be >= 1, or -1 for auto")
        one_of("parallel", "backend", self.backend, ("auto", "nccl", "gloo"))
        one_of("parallel", "rendezvous", self.rendezvous,
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
        check_fields("model", self)
        positive("model", self, "vocab_size", "dim", "n_layers", "n_heads", "max_seq_len")
        positive("model", self, "n_kv_heads", "ffn_dim", allow_zero=True)
        check(self.dim % self.n_heads == 0,
               f"model.dim = {self.dim} is not divisible by model.n_heads = {self.n_heads}")
        kv = self.n_kv_heads or self.n_heads
        check(self.n_heads % kv == 0,
               f"model.n_heads = {self.n_heads} is not divisible by model.n_kv_heads = {kv}")
        check(self.rope_theta > 0 and self.norm_eps > 0,
               f"model.rope_theta = {self.rope_theta}, model.norm_eps = {self.norm_eps} must be > 0")
