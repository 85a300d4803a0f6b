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
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path

from hpctrain.config import hf as hfconfig
from hpctrain.config.checks import check
from hpctrain.config.sections import (
    CheckpointConfig,
    DataConfig,
    JobConfig,
    ModelConfig,
    ParallelConfig,
    TrainConfig,
)


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
        p = self.parallel
        check(t.precision != "fp8" or self.job.gpus_per_node > 0, "train.precision = 'fp8' needs GPUs with float8 "
              "matmuls (H100, H200, B200) but job.gpus_per_node = 0: a CPU has none; train in bf16 or fp32")
        check(not t.fp8_all_gather or p.zero_stage in (2, 3), f"train.fp8_all_gather = true with "
              f"parallel.zero_stage = {p.zero_stage}: only FSDP (ZeRO-2 or 3) gathers weights; use 2 or 3, or "
              f"leave it false")
        # torch 2.13's zero-bubble schedules split each stage's backward into input and weight parts, which a
        # compiled module's one backward graph cannot give (ScheduleZBVZeroBubble raises on an OptimizedModule)
        check(not (t.compile and p.pp > 1 and p.pp_schedule in ("zbv", "interleaved_zero_bubble")),
              f"train.compile = true with parallel.pp_schedule = {p.pp_schedule!r}: torch's zero-bubble schedules "
              f"split each block's backward, which a compiled block cannot; use interleaved_1f1b, or eager blocks")
        if p.cp > 1:  # each rank holds an early and a late chunk of every sequence (causal load balance)
            check(self.data.seq_len % (2 * p.cp) == 0, f"data.seq_len = {self.data.seq_len} must be divisible by "
                  f"2 x parallel.cp = {2 * p.cp}: each context-parallel rank holds two equal chunks of every sequence")
            local = self.data.seq_len // p.cp
            check(not p.sequence_parallel or local % p.tp == 0, f"data.seq_len / parallel.cp = {local} must be "
                  f"divisible by parallel.tp = {p.tp} with parallel.sequence_parallel: each rank's share of a "
                  f"sequence is split again over tp")
            gpus = p.backend == "nccl" or (p.backend == "auto" and self.job.gpus_per_node > 0)
            check(not gpus or self.train.precision != "fp32", f"parallel.cp = {p.cp} with "
                  f"train.precision = 'fp32' on GPUs: the ring attention runs the flash kernel, which has no fp32 "
                  f"form on GPUs; train in bf16 (the CPU's kernel takes fp32)")

    @property
    def world_size(self) -> int:
        return self.job.nodes * self.job.tasks_per_node


_HINTS = typing.get_type_hints(Config)
SECTIONS: dict[str, type] = {f.name: _HINTS[f.name] for f in dataclasses.fields(Config)}


# keys that were renamed: a config that still names one is refused with the new name and why, never read as another
RENAMED = {
    "job.hang_requeues": "job.node_requeues (one limit for the preflight's and a hang's requeues without bad nodes, "
                         "counted together)",
}


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
            if f"{name}.{key}" in RENAMED:
                raise ValueError(f"{name}.{key} = {value!r}: the key is now {RENAMED[f'{name}.{key}']}")
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
