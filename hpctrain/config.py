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
import sys
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path

from hpctrain import hfconfig
from hpctrain.sections import (
    JobConfig,
    ModelConfig,
    ParallelConfig,
    check,
    check_fields,
    one_of,
    positive,
)


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
    # this many consecutive non-finite steps (loss or gradients nan or inf, each skipped) stop the run with an
    # error naming the step, and none of them is checkpointed. Above what fp16 skips while its loss scale comes
    # down at start-up: at most log2(train.loss_scale) steps, 16 from 65536 (checked below)
    max_nonfinite_steps: int = 50
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
    # straggler report: at log steps a rank whose compute time (its step less the time it waited for others)
    # exceeds the median rank's by more than this fraction is named, with its host
    straggler_margin: float = 0.2

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
        one_of("train", "precision", self.precision, ("fp32", "bf16", "fp16"))
        one_of("train", "reduce_dtype", self.reduce_dtype, ("fp32", "bf16"))
        one_of("train", "ac", self.ac, ("none", "full", "every"))
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
    seq_len: int = 128

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
    keep: int = 2
    async_save: bool = False  # training goes on while shards are written (at most one save in flight)
    verify: str = "full"  # checksums checked at load: full | sampled (1 in 8 datasets) | none
    stripe_count: int = 0  # Lustre: lfs setstripe -c on each checkpoint directory (0: leave alone, -1: all OSTs)
    stripe_size_mb: int = 4
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


@dataclass
class Config:
    job: JobConfig = field(default_factory=JobConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)

    def __post_init__(self) -> None:
        check(self.parallel.backend != "nccl" or self.job.gpus_per_node > 0,
               f"parallel.backend = 'nccl' needs GPUs but job.gpus_per_node = {self.job.gpus_per_node}")
        t = self.train
        check(not (self.parallel.pp > 1 and t.eval_every and t.eval_batches % t.grad_accum),
               f"train.eval_batches = {t.eval_batches} must be a multiple of train.grad_accum = {t.grad_accum} with "
               f"parallel.pp = {self.parallel.pp}: a pipelined evaluation runs the schedule's micro-batches")
        check(self.data.seq_len <= self.model.max_seq_len,
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
    except (ValueError, RecursionError):  # TOMLDecodeError, an integer past 4300 digits, arrays nested too deep
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


MAX_CONFIG_BYTES = 1 << 20  # a config file (and the config.toml of a run directory) is a few KB


def load_config(path: str | Path | None, overrides: typing.Sequence[str] = ()) -> Config:
    """Reads a TOML file (or starts from defaults when path is None), applies overrides, validates."""
    raw: dict[str, typing.Any] = {}
    if path is not None:
        path = Path(path)
        try:
            size = path.stat().st_size
            if size > MAX_CONFIG_BYTES:
                raise ValueError(f"config file {str(path)!r} is {size} bytes: a config is a few KB (at most "
                                 f"{MAX_CONFIG_BYTES})")
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
        except RecursionError:  # tomllib parses nested arrays and tables recursively
            raise ValueError(f"config file {str(path)!r} nests arrays or tables too deeply") from None
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
