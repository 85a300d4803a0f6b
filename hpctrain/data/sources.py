"""Token sources as [data] names them (one file, a blend's files, the synthetic stream), opened and checked against
the model; and the same checks on the login node before submission, reading no token id. No torch here: `hpctrain
submit` imports this module, not the loader.

    sources = open_sources(cfg.data, vocab_size, seed=cfg.train.seed)    # every rank, after check_ids_at_start
    lines = check_before_submission(cfg.data, vocab_size, with_val, hf_sha)  # submit, --dry-run: records only

Reading token files (ArraySource, HDF5Source, their records and id-scan cache) lives in hpctrain.data.tokenfiles; the
loaders over these sources in hpctrain.data.loader and hpctrain.data.blend.
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from hpctrain.config import DataConfig
from hpctrain.data.build import EOS
from hpctrain.data.tokenfiles import ArraySource, HDF5Source, TokenSource, check_records, val_file


class SyntheticSource(TokenSource):
    """Endless-looking learnable text with no file: documents of 32-256 tokens separated by EOS.

    Each document counts up from a random start by a step in {1, 2, 3}, wrapping within ids 1..vocab_size-1
    (so it never emits EOS inside a document): after two tokens the rest is predictable, and a tiny model's
    loss falls well below log(vocab_size). The stream is cut into chunks, each generated from its own
    RNG seeded by (seed, chunk index), so any slice is reproducible without generating what comes before it;
    a chunk ends with EOS, cutting its last document short.
    """
    CHUNK = 4096  # tokens: a short slice generates little beyond itself; numpy's per-call cost is spread
    MIN_DOC, MAX_DOC = 32, 256

    def __init__(self, vocab_size: int, seed: int, num_tokens: int = 2 ** 22) -> None:
        if vocab_size < 2:
            raise ValueError(f"synthetic data needs vocab_size >= 2 (EOS plus one token), got {vocab_size}")
        self.vocab_size, self.seed, self.num_tokens = vocab_size, seed, num_tokens
        self.name, self.max_id = "synthetic data", vocab_size - 1

    def _chunk(self, index: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, index])
        num_docs = self.CHUNK // (self.MIN_DOC + 1) + 1  # enough documents to fill a chunk even if all are short
        lengths = rng.integers(self.MIN_DOC, self.MAX_DOC + 1, size=num_docs)
        starts = rng.integers(0, self.vocab_size - 1, size=num_docs)
        steps = rng.integers(1, 4, size=num_docs)
        ends = np.cumsum(lengths + 1)  # each document is followed by one EOS
        pos = np.arange(self.CHUNK)
        doc = np.searchsorted(ends, pos, side="right")
        offset = pos - (ends[doc] - lengths[doc] - 1)
        body = 1 + (starts[doc] + steps[doc] * offset) % (self.vocab_size - 1)
        tokens = np.where(offset == lengths[doc], EOS, body).astype(np.int64)
        tokens[-1] = EOS  # the document cut by the chunk boundary ends here, like any other
        return tokens

    def read(self, start: int, count: int) -> np.ndarray:
        stop = min(start + count, self.num_tokens)
        if stop <= start:
            return np.zeros(0, dtype=np.int64)
        first, last = start // self.CHUNK, (stop - 1) // self.CHUNK
        joined = np.concatenate([self._chunk(i) for i in range(first, last + 1)])
        return joined[start - first * self.CHUNK:stop - first * self.CHUNK]


def open_file(cfg: DataConfig, path_text: str, key: str, scan: bool = True,
               run_dir: str | os.PathLike | None = None) -> TokenSource:
    path = Path(path_text)
    if not path.is_file():
        raise ValueError(f"{key} = {path_text!r} does not exist")
    is_hdf5 = path.suffix in (".h5", ".hdf5")
    if is_hdf5 != (cfg.source == "hdf5"):
        raise ValueError(f"{key} = {path_text!r} does not fit data.source = {cfg.source!r} "
                         f"(hdf5 reads .h5/.hdf5, bin reads .bin/.npy)")
    try:
        return (HDF5Source if is_hdf5 else ArraySource)(path, scan=scan, run_dir=run_dir)
    except OSError as e:
        raise ValueError(f"{key} = {path_text!r} cannot be read as {cfg.source}: {e}") from None


def _check_source(source: TokenSource, name: str, vocab_size: int, seq_len: int) -> TokenSource:
    """The source against the model; its ids only when known (max_id None: left for the job's start)."""
    if source.max_id is not None and source.max_id >= vocab_size:
        raise ValueError(f"{name} holds token ids up to {source.max_id} but model.vocab_size = {vocab_size}: "
                         f"every id must be < vocab_size")
    if source.vocab_size > vocab_size:
        raise ValueError(f"{name} records vocab_size {source.vocab_size} (ids up to {source.max_id}) but "
                         f"model.vocab_size = {vocab_size}: the model must embed every id of its tokenizer")
    if len(source) < seq_len + 1:
        raise ValueError(f"{name} holds {len(source)} tokens, fewer than one sequence of "
                         f"data.seq_len + 1 = {seq_len + 1}")
    return source


def open_sources(cfg: DataConfig, vocab_size: int, seed: int = 0, hf_tokenizer_sha256: str | None = None,
                 files: list[str] | None = None, scan: bool = True) -> list[TokenSource]:
    """Every token source [data] describes (data.paths, or data.path, or the synthetic stream), each checked
    against the model (ids fit its vocab, one sequence fits) and all against one another (one tokenizer, and the
    HF directory's when given: tokenfiles.check_records). `files` replaces the configured ones (validation).
    scan=False reads no token id: a file no record describes comes back with max_id None, its ids unchecked."""
    if cfg.source == "synthetic":
        return [_check_source(SyntheticSource(vocab_size, seed), "synthetic data", vocab_size, cfg.seq_len)]
    keys = ([f"data.paths[{i}]" for i in range(len(cfg.paths))] if cfg.paths else ["data.path"]) \
        if files is None else [f"validation file {i}" for i in range(len(files))]
    sources = []
    for key, path in zip(keys, cfg.files if files is None else files):
        sources.append(_check_source(open_file(cfg, path, key, scan), f"{key} = {path!r}", vocab_size,
                                     cfg.seq_len))
    check_records(sources, vocab_size, hf_tokenizer_sha256)
    return sources


def open_source(cfg: DataConfig, vocab_size: int, seed: int = 0) -> TokenSource:
    """The one token source of data.path (or the synthetic stream); open_sources for a blend."""
    if cfg.paths:
        raise ValueError(f"data.paths = {cfg.paths} is a blend: open it with open_sources")
    return open_sources(cfg, vocab_size, seed)[0]


VAL_SEED_OFFSET = 1_000_003  # synthetic validation data: a stream no training seed of a run draws


def val_paths(cfg: DataConfig) -> list[str]:
    """The validation files of a file-backed [data]: data.val_path when set, else "<stem>.val<suffix>" beside
    data.path or each of data.paths; a missing one is a ValueError saying how to make it."""
    files = [cfg.val_path] if cfg.val_path else [val_file(p) for p in cfg.files]
    for path in files:
        if not Path(path).is_file():
            raise ValueError(f"validation split {path!r} does not exist: set data.val_path, or build the data with "
                             f"`hpctrain data build --val-fraction`, or set train.eval_every = 0")
    return files


def size_text(num_bytes: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6)):
        if num_bytes >= scale / 10:
            return f"{num_bytes / scale:.1f} {unit}"
    return f"{num_bytes / 1e3:.1f} kB"


def check_before_submission(cfg: DataConfig, vocab_size: int, with_val: bool,
                            hf_tokenizer_sha256: str | None = None) -> list[str]:
    """What open_sources (and open_val_source, with_val) check, on the login node, reading no token id: the
    files, their sidecars, shapes and tokenizer records, and each file's ids where a record proves them (data
    build's, or an earlier job's check). ValueError as open_sources. Returns a line for each file whose ids are
    left for the job's start (check_ids_at_start)."""
    sources = open_sources(cfg, vocab_size, hf_tokenizer_sha256=hf_tokenizer_sha256, scan=False)
    if with_val and cfg.source != "synthetic":
        sources += open_sources(cfg, vocab_size, files=val_paths(cfg), scan=False)
    lines = {}
    for s in sources:
        if s.max_id is None:
            lines[s.name] = (f"{s.name}: {s.unchecked}; one rank checks its {size_text(s.path.stat().st_size)} of "
                             f"token ids at job start")
    return list(lines.values())
