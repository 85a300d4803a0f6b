"""The sections of the run configuration, one dataclass per TOML table ([job], [parallel], [model], [train],
[data], [checkpoint]); each validates its values when it is built. Loading, --set and the whole Config are in
hpctrain/config/load.py; callers import all of it from hpctrain.config.
"""
from __future__ import annotations

import math
import os
import re
import sys
from dataclasses import dataclass, field

from hpctrain.config.checks import check, check_fields, one_of, positive


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
    name: str = "hpctrain"  # the Slurm job's name and its run directory's prefix: letters, digits, "_", ".", "-"
    # each run gets a fresh directory below this; default: $SCRATCH/hpctrain where $SCRATCH is set, else "runs" below
    # the current directory (default_run_root), resolved into the run's config.toml
    run_root: str = field(default_factory=default_run_root)
    executor: str = "auto"  # auto (Slurm when reachable, else local) | slurm | local
    nodes: int = 1  # Slurm nodes (--nodes)
    tasks_per_node: int = 1  # ranks per node: one per GPU
    gpus_per_node: int = 0  # 0 for a CPU job, else tasks_per_node
    cpus_per_task: int = 1  # CPUs per rank, passed to sbatch and to srun; each rank's threads keep to them
    mem_gb: float = 0.0  # per node; 0: the site default, or with exclusive all of the node's (--mem=0)
    time_min: int = 60  # the job's time limit in minutes (--time)
    partition: str = ""  # --partition; "": the site's default one (either is checked at submit: exists, fits)
    account: str = ""  # --account; "": none sent
    qos: str = ""  # --qos; "": none sent
    constraint: str = ""  # --constraint (node features); "": none sent
    wckey: str = ""  # empty: no --wckey line (submitit's default "submitit" is refused where wckeys are enforced)
    exclusive: bool = False  # --exclusive: whole nodes
    signal_delay_s: int = 120  # USR2 arrives this long before the time limit
    sbatch_extra: list[str] = field(default_factory=list)  # e.g. ["--mail-type=END", "--reservation=x"]
    setup: list[str] = field(default_factory=list)  # shell lines before srun, e.g. "module load cuda"
    # srun --mpi plugin, checked at submit against the site's `srun --mpi=list`: pmi2 for MPICH/Intel MPI, pmix for
    # Open MPI 5 (which has no PMI2: under pmi2 each task would be rank 0 of 1); "none": no MPI, as in the GPU
    # examples (with parallel.rendezvous = "slurm"); "": the site's MpiDefault
    mpi: str = "pmi2"
    # more srun options, after ours (docs/cluster.md lists those), e.g. "--cpu-bind=none"; never --mpi: job.mpi
    srun_args: list[str] = field(default_factory=list)
    wait_timeout_s: int = 120  # how long --wait waits for results after the job left the queue
    # hardware profile the planner checks the layout against before submission (hpctrain plan --gpu: a100-40g,
    # a100-80g, h100-sxm, h100-pcie, h100-96g-500w, h200, b200, mi250x, mi300x), and the doctor's datasheet
    # checks: datasheet figures; "": none (a CPU has no datasheet: calibrate it, job.hw_profile)
    gpu: str = ""
    # a calibrated hardware profile (a JSON file `hpctrain plan --calibrate -o FILE` wrote on the machine the job
    # runs on); when set the planner uses it instead of job.gpu. A CPU job is planned only with one (no datasheet)
    hw_profile: str = ""
    # `hpctrain doctor`'s checks on training's own groups, after the mesh and before the model; under Slurm a job
    # with a failed node is requeued without it (hpctrain/doctor/measure.py preflight)
    preflight: bool = False
    # the preflight's margin: a GEMM, bandwidth or storage rate fails below (1 - margin) x its peers' median, as
    # `hpctrain doctor --margin` and `--storage-margin` (a site sets it for its own nodes); 0: the doctor's defaults
    # (0.2 on GPUs, 0.6 on CPUs; storage 0.5)
    preflight_margin: float = 0.0
    # requeues of a Slurm job without its bad nodes, at most this many per run, the preflight's (job.preflight: the
    # failed nodes) and a hang's (the nodes of ranks that left no hang dump) counted together; the job resumes from
    # its last checkpoint (hpctrain/job/requeue.py, history in RUN_DIR/requeues.jsonl); 0: such a job just ends
    node_requeues: int = 2
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
        positive("job", self, "gpus_per_node", "mem_gb", "signal_delay_s", "wait_timeout_s", "node_requeues",
                 "nofile", allow_zero=True)
        check(self.preflight_margin == 0 or 0 < self.preflight_margin < 1,
               f"job.preflight_margin = {self.preflight_margin} must be 0 (the doctor's defaults) or between 0 and 1")
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


# parallel.offload = "optimizer" moves gradients down and weights up in buckets of this many bytes of fp32 masters
# (train.optim.HostAdamW's pipeline; the planner's timing of it): 16M parameters, ~2 ms of PCIe Gen4 per bucket, long
# enough to hide the queueing cost, short enough that the exposed first and last bucket stay small
HOST_BUCKET_BYTES = 64 << 20
PP_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "looped_bfs", "interleaved_zero_bubble", "zbv")


@dataclass
class ParallelConfig:
    """[parallel]: the (pp, dp, tp) layout, tp innermost, and how ranks connect."""
    pp: int = 1  # pipeline stages (across nodes)
    dp: int = -1  # data-parallel replicas; -1: whatever is left of the world after pp * cp * tp
    tp: int = 1  # must fit inside one node
    cp: int = 1  # context parallel: ranks that split every sequence (ring attention), next to tp
    # HSDP (zero_stage 2 or 3): dp's ranks form this many replicas, each sharding the model over dp x cp / dp_replicate
    # neighbouring ranks (inside a node or a few); gradients are reduce-scattered in the shard group, then all-reduced
    # across the replicas (the only traffic that crosses them). 1: plain FSDP over all of dp. Must divide dp
    dp_replicate: int = 1
    backend: str = "auto"  # auto (nccl with CUDA, else gloo) | nccl | gloo
    timeout_s: int = 600  # collective and rendezvous timeout
    # the hang watchdog (hpctrain/hang/watchdog.py): no progress within a step's phase for this long dumps every live
    # rank's stacks and flight recorder into RUN_DIR/hang/ and ends the job; 0: off; -1: half of timeout_s, at
    # most 300 s. Must be shorter than timeout_s, so it speaks before the collective timeout (which names nobody)
    hang_timeout_s: int = -1
    # the watchdog's limit for the long phases: start-up (model build, resume) to the end of the first step
    # (compile, lazy NCCL set-up), checkpoint saves and evaluations; 0: as hang_timeout_s
    startup_timeout_s: int = 1200
    flight_recorder: int = 2000  # collectives each rank remembers (torch's flight recorder) for hang dumps; 0: off
    rendezvous: str = "auto"  # auto | mpi | slurm | submitit | torchrun | single
    # where rank 0's store listens (bound to it only); empty: parallel.interface's address, else 127.0.0.1 on one
    # host, else the host name's address unless it is loopback
    master_addr: str = ""
    interface: str = ""  # e.g. "ib0": rank 0 publishes its address; NCCL_SOCKET_IFNAME, GLOO_SOCKET_IFNAME unless set
    connect_timeout_s: int = 60  # ranks stop dialling rank 0's store after this, naming it (timeout_s: collectives)
    zero_stage: int = 0  # 0 DDP, 1 + optimizer state sharded, 2 + gradients (FSDP2), 3 + parameters (FSDP2)
    # none | optimizer: AdamW's state and fp32 masters in host memory, the step on the host's cores (not with
    # zero_stage 1) | all: FSDP's shards, gradients and AdamW state there too (CPUOffloadPolicy; zero_stage 2 or 3)
    offload: str = "none"
    # ZeRO-2/3: blocks whose parameters FSDP gathers ahead of the one running, in forward and in backward (1: FSDP's
    # own prefetch of the next block; k > 1 gathers k ahead: k - 1 more gathered blocks held, more time to hide
    # each all-gather behind compute)
    fsdp_prefetch: int = 1
    # DDP (zero_stage 0/1 without tp or pp): MiB of gradients per all-reduce bucket. Smaller buckets start reducing
    # earlier in backward and leave less exposed after it, at more collectives; the buckets are the gradients
    # (gradient_as_bucket_view): no memory of their own
    ddp_bucket_mb: int = 25
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
        positive("parallel", self, "pp", "tp", "cp", "dp_replicate", "timeout_s", "connect_timeout_s",
                 "pp_virtual_stages", "fsdp_prefetch", "ddp_bucket_mb")
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
        one_of("parallel", "offload", self.offload, ("none", "optimizer", "all"))
        check(self.offload != "all" or self.zero_stage in (2, 3), f"parallel.offload = {self.offload!r} moves "
              f"FSDP's shards to host memory: it needs parallel.zero_stage = 2 or 3 (got {self.zero_stage})")
        check(self.offload != "optimizer" or self.zero_stage != 1, "parallel.offload = 'optimizer' with "
              "parallel.zero_stage = 1: ZeRO-1 shards AdamW's state over dp on the GPUs; offload it with "
              "zero_stage 0 (DDP), 2 or 3")
        check(self.dp == -1 or self.dp >= 1, f"parallel.dp = {self.dp} must be >= 1, or -1 for auto")
        check(self.dp_replicate == 1 or self.zero_stage in (2, 3), f"parallel.dp_replicate = {self.dp_replicate} "
              f"replicates FSDP's shards (HSDP): it needs parallel.zero_stage = 2 or 3 (got {self.zero_stage})")
        check(self.dp == -1 or self.dp % self.dp_replicate == 0, f"parallel.dp_replicate = {self.dp_replicate} "
              f"does not divide parallel.dp = {self.dp}: HSDP splits the data-parallel ranks into equal replicas")
        one_of("parallel", "backend", self.backend, ("auto", "nccl", "gloo"))
        one_of("parallel", "rendezvous", self.rendezvous,
                ("auto", "mpi", "slurm", "submitit", "torchrun", "single"))


@dataclass
class ModelConfig:
    """[model]: a Llama-style decoder. With train.init_from = "hf:DIR" every key left out comes from the
    directory's config.json, and a key given must agree with it."""
    vocab_size: int = 256  # token ids must lie below it; padded to a multiple of lcm(64, tp) when it does not split
    dim: int = 128  # the model width
    n_layers: int = 2  # transformer blocks
    n_heads: int = 4  # attention heads; must divide dim
    n_kv_heads: int = 0  # 0: same as n_heads (no grouped-query attention)
    ffn_dim: int = 0  # 0: about 8/3 * dim rounded up to a multiple of 64 (swiglu), 4 * dim (gelu)
    mlp: str = "swiglu"  # swiglu (Llama: gate, up and down matrices) | gelu (GPT: two matrices, tanh GeLU)
    fused_projections: bool = False  # q, k, v (and gate, up) as one matmul each: Megatron's shapes; same weights
    max_seq_len: int = 256  # longest sequence the rotary tables cover; data.seq_len must not exceed it
    tie_embeddings: bool = False  # the output layer shares the embedding's weights (pp > 1: a synchronised copy)
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
        one_of("model", "mlp", self.mlp, ("swiglu", "gelu"))
        check(self.rope_theta > 0 and self.norm_eps > 0,
               f"model.rope_theta = {self.rope_theta}, model.norm_eps = {self.norm_eps} must be > 0")


@dataclass
class TrainConfig:
    """[train]: the optimisation loop."""
    steps: int = 100  # optimizer steps of the run
    micro_batch_size: int = 8  # sequences per rank per micro-step
    global_batch_size: int = 0  # if set: sequences per optimizer step; micro_batch_size = it / (dp * grad_accum)
    grad_accum: int = 1  # micro-batches per optimizer step (with pp > 1: the micro-batches each step pipelines)
    lr: float = 3e-4  # peak learning rate, after warmup_steps, then a cosine
    scale_lr_with_batch: int = 0  # if set: lr is for this global batch and scales linearly with the real one
    warmup_steps: int = 10  # the learning rate rises linearly to lr over these steps
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio at the last step
    weight_decay: float = 0.1  # not applied to norms, biases or other 1-D parameters
    beta1: float = 0.9  # AdamW
    beta2: float = 0.95  # AdamW
    grad_clip: float = 1.0  # on the global norm across all shards; 0 disables
    seed: int = 0  # the init, the data order and synthetic data all follow it
    # fp32 | bf16 | fp16 (compute dtype; master weights and optimizer stay fp32) | fp8: bf16 with the blocks' linear
    # layers' matmuls in float8 (torchao, `pip install hpctrain[fp8]`; GPUs with float8 matmuls: H100, H200, B200)
    precision: str = "fp32"
    fp8_scaling: str = "rowwise"  # with precision = "fp8": rowwise | tensorwise (torchao's recipes)
    # with precision = "fp8", fp8_scaling = "tensorwise" and ZeRO-2/3: FSDP gathers the blocks' linear weights in
    # float8 (1 byte a weight where bf16 takes 2; their scales from one small all-reduce after each optimizer step),
    # as torchtitan offers; the weights, gradients and checkpoints stay fp32
    fp8_all_gather: bool = False
    reduce_dtype: str = "fp32"  # gradient reduction dtype: fp32 | bf16
    loss_scale: float = 65536.0  # initial dynamic loss scale for fp16
    # this many consecutive non-finite steps (loss or gradients nan or inf, each skipped) stop the run with an
    # error naming the step, and none of them is checkpointed. Above what fp16 skips while its loss scale comes
    # down at start-up: at most log2(train.loss_scale) steps, 16 from 65536 (checked below)
    max_nonfinite_steps: int = 50
    ac: str = "none"  # activation checkpointing: none | full | every | selective | op (hpctrain/parallel/recompute.py)
    ac_every: int = 2  # with ac = "every": checkpoint blocks 0, k, 2k, ...
    # torch.compile each transformer block (regional compilation: one graph serves every block), after tensor
    # parallel and recompute, before FSDP; the first step and the first evaluation compile (the watchdog's long limit)
    compile: bool = False
    log_every: int = 10  # steps between logged steps (progress line, straggler report); the first and last too
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
    # straggler report: at log steps a rank whose compute time (its step less the time it waited for others)
    # exceeds the median rank's by more than this fraction is named, with its host
    straggler_margin: float = 0.2

    @property
    def compute(self) -> str:
        """The compute dtype's name outside float8 matmuls: bf16 for fp8, else precision."""
        return "bf16" if self.precision == "fp8" else self.precision

    def __post_init__(self) -> None:
        check_fields("train", self)
        positive("train", self, "micro_batch_size", "grad_accum", "log_every", "ac_every", "eval_batches")
        positive("train", self, "eval_every", "steps", "global_batch_size", "warmup_steps", "scale_lr_with_batch",
                  "weight_decay", "grad_clip", "peak_tflops", "prefetch", allow_zero=True)
        check(self.lr > 0, f"train.lr = {self.lr} must be > 0")
        check(0 <= self.min_lr_ratio <= 1, f"train.min_lr_ratio = {self.min_lr_ratio} must be within [0, 1]")
        check(0 <= self.beta1 < 1 and 0 <= self.beta2 < 1,
               f"train.beta1 = {self.beta1}, train.beta2 = {self.beta2} must be within [0, 1)")
        check(self.straggler_margin > 0, f"train.straggler_margin = {self.straggler_margin} must be > 0")
        check(self.loss_scale > 0, f"train.loss_scale = {self.loss_scale} must be > 0")
        positive("train", self, "max_nonfinite_steps")
        startup = math.ceil(math.log2(max(self.loss_scale, 1.0)))  # halvings that bring the scale down to 1
        check(self.precision != "fp16" or self.max_nonfinite_steps > startup,
               f"train.max_nonfinite_steps = {self.max_nonfinite_steps} would stop a healthy fp16 run: from "
               f"train.loss_scale = {self.loss_scale} the scale halves on each of up to {startup} skipped steps at "
               f"start-up; give more than {startup}")
        one_of("train", "precision", self.precision, ("fp32", "bf16", "fp16", "fp8"))
        one_of("train", "fp8_scaling", self.fp8_scaling, ("rowwise", "tensorwise"))
        check(not self.fp8_all_gather or (self.precision, self.fp8_scaling) == ("fp8", "tensorwise"),
              f"train.fp8_all_gather = true needs train.precision = 'fp8' with train.fp8_scaling = 'tensorwise' "
              f"(torchao gathers float8 weights with one scale a tensor), not precision = {self.precision!r}, "
              f"fp8_scaling = {self.fp8_scaling!r}")
        one_of("train", "reduce_dtype", self.reduce_dtype, ("fp32", "bf16"))
        one_of("train", "ac", self.ac, ("none", "full", "every", "selective", "op"))
        check(len(self.profile_steps) in (0, 2) and (not self.profile_steps or
                                                      0 <= self.profile_steps[0] <= self.profile_steps[1]),
               f"train.profile_steps = {self.profile_steps} must be [] or [first, last] with first <= last")
        check(self.init_from == "" or (self.init_from.startswith("hf:") and len(self.init_from) > 3),
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
    seq_len: int = 128  # tokens per sample

    def __post_init__(self) -> None:
        check_fields("data", self)
        one_of("data", "source", self.source, ("synthetic", "bin", "hdf5"))
        positive("data", self, "seq_len")
        check(not (self.path and self.paths), f"data.path = {self.path!r} and data.paths = {self.paths}: give "
               f"one file as data.path or several as data.paths, not both")
        check(self.source == "synthetic" or self.path != "" or self.paths != [],
               f"data.source = {self.source!r} needs data.path (or data.paths)")
        check(not self.weights or len(self.weights) == len(self.paths), f"data.weights = {self.weights} needs one "
               f"weight per entry of data.paths ({len(self.paths)} entries)")
        check(all(w > 0 for w in self.weights), f"data.weights = {self.weights}: every weight must be > 0")
        # a subnormal weight has lost its digits, and a share that underflows reads a weighted file never
        small = [w for w in self.weights if w < sys.float_info.min]
        if small:
            raise ValueError(f"data.weights = {self.weights}: {small[0]!r} is below the smallest normal float "
                             f"({sys.float_info.min:.3g}), where floats lose their digits: scale every weight up alike")
        lost = [w for w, share in zip(self.weights, self.shares if self.weights else []) if share < sys.float_info.min]
        if lost:
            raise ValueError(f"data.weights = {self.weights}: {lost[0]!r} is so small beside the largest weight that "
                             f"its share of the samples underflows: the file would never be read")
        check(len(set(self.paths)) == len(self.paths), f"data.paths = {self.paths} names a file twice: give it "
               f"a larger weight instead")

    @property
    def files(self) -> list[str]:
        """The training token files: data.paths, or [data.path]; [] for synthetic data."""
        return list(self.paths) or ([self.path] if self.path else [])

    @property
    def shares(self) -> list[float]:
        """Each training file's share of the samples, summing to 1 (equal shares when data.weights is [])."""
        weights = self.weights or [1.0] * len(self.files)
        top = max(weights)
        scaled = [w / top for w in weights]  # in (0, 1]: their sum cannot overflow (1e308 + 1e308 is inf)
        total = math.fsum(scaled)
        return [w / total for w in scaled]


@dataclass
class CheckpointConfig:
    """[checkpoint]: sharded HDF5 checkpoints."""
    dir: str = ""  # empty: <run dir>/checkpoints
    every_steps: int = 0  # 0: only on preemption, on demand (touch <run dir>/SAVE_NOW) and at the end
    keep: int = 2  # committed checkpoints kept, newest by commit order; at least 2
    async_save: bool = False  # training goes on while shards are written (at most one save in flight)
    verify: str = "full"  # checksums checked at load: full | sampled (1 in 8 datasets) | none
    stripe_count: int = 0  # Lustre: lfs setstripe -c on each checkpoint directory (0: leave alone, -1: all OSTs)
    stripe_size_mb: int = 4  # Lustre: lfs setstripe -S, with stripe_count
    at_end: bool = True  # save once more after the last step
    chunk_mb: float = 0.0  # 0: contiguous HDF5 datasets (one write, one read each); > 0: chunks up to this size
    # the rate (GB/s) the whole job reads and writes checkpoints at; conservative. The hang watchdog gives a save or
    # a resume parallel.startup_timeout_s plus the checkpoint's size at this rate, counted from the last dataset
    # read or written, so a slow but progressing save or resume is never called a hang
    storage_gbps: float = 0.5

    def __post_init__(self) -> None:
        check_fields("checkpoint", self)
        positive("checkpoint", self, "every_steps", allow_zero=True)
        positive("checkpoint", self, "stripe_size_mb")
        check(self.chunk_mb >= 0, f"checkpoint.chunk_mb = {self.chunk_mb} must be >= 0 (0: contiguous datasets)")
        one_of("checkpoint", "verify", self.verify, ("full", "sampled", "none"))
        check(self.stripe_count >= -1, f"checkpoint.stripe_count = {self.stripe_count} must be >= -1")
        check(self.keep >= 2, f"checkpoint.keep = {self.keep} must be >= 2 so one committed checkpoint survives")
        check(math.isfinite(self.storage_gbps) and self.storage_gbps > 0,
              f"checkpoint.storage_gbps = {self.storage_gbps} must be a rate above 0 GB/s")
