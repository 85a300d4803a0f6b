"""Tokens for training: the resumable loader over the sources [data] names (hpctrain.data.sources opens them), the
validation loader and the job-start check of token ids.

    source = open_source(cfg.data, cfg.model.vocab_size)  # synthetic data: seed= picks another stream
    loader = TokenLoader(source, cfg.data.seq_len, cfg.train.micro_batch_size, dp_rank, dp_size, cfg.train.seed)
    x, y = loader.next_batch()  # (micro_batch_size, seq_len) int64 each, y = x shifted by one
    loader = PrefetchLoader(loader, depth=2, pin_memory=True)   # the same batches, read ahead by a thread

The loader's position is global (samples consumed by all dp ranks together), so a checkpoint taken with one dp
size resumes exactly with another. The loaders know nothing of torch.distributed: ranks come in as ints.

No pass over the token ids on the login node (sources.check_before_submission reads records only), and one at
job start at most:

    check_ids_at_start(cfg, group, run_dir, heartbeat)  # every rank, before open_sources

Submission reads what `data build` recorded beside each file (tokenfiles); a file without a record (or with one
for another file) is named, with when it will be checked. At job start each such file is scanned by one rank
(spread over nodes), the result cached and sent to every rank (host objects over `group`: gloo in CPU and in
"cpu:gloo,cuda:nccl" jobs), while the others wait in short rounds that log progress and move their heartbeat.
Reading token files (ArraySource, HDF5Source, their records and id-scan cache) lives in hpctrain.data.tokenfiles;
writing them in hpctrain.data.build (byte level) and hpctrain.data.tokenize (a tokenizer's).
"""
from __future__ import annotations

import logging
import os
import queue
import socket
import threading
import time
import weakref
from typing import Any, Iterable

import numpy as np
import torch
import torch.distributed as dist

from hpctrain.config import Config, DataConfig
from hpctrain.data import tokenfiles
from hpctrain.data.blend import BlendedSamples, BlendLoader
from hpctrain.data.build import EOS, VOCAB_SIZE, decode, encode  # noqa: F401  (the byte tokenizer, kept here)
from hpctrain.data.sources import VAL_SEED_OFFSET, open_file, open_source, open_sources, size_text, val_paths
from hpctrain.data.tokenfiles import TokenSource
from hpctrain.hang.heartbeat import Heartbeat

log = logging.getLogger(__name__)

def make_loader(cfg: DataConfig, sources: list[TokenSource], micro_batch_size: int, dp_rank: int, dp_size: int,
                seed: int) -> "TokenLoader | BlendLoader":
    """The training loader over open_sources' result: a TokenLoader for one source, a BlendLoader for data.paths."""
    if cfg.paths:
        return BlendLoader(sources, cfg.shares, cfg.seq_len, micro_batch_size, dp_rank, dp_size, seed)
    return TokenLoader(sources[0], cfg.seq_len, micro_batch_size, dp_rank, dp_size, seed)


def train_loader(config: Config, vocab_size: int, micro_batch_size: int, dp_rank: int, dp_size: int,
                 pin_memory: bool = False) -> "TokenLoader | BlendLoader | PrefetchLoader":
    """A training run's loader: its sources opened (open_sources), the loader over them (make_loader) and, with
    train.prefetch, read ahead by a thread (PrefetchLoader). Runs after check_ids_at_start."""
    sources = open_sources(config.data, vocab_size, seed=config.train.seed)
    loader = make_loader(config.data, sources, micro_batch_size, dp_rank, dp_size, config.train.seed)
    return PrefetchLoader(loader, config.train.prefetch, pin_memory) if config.train.prefetch else loader


def open_val_source(cfg: DataConfig, vocab_size: int, seed: int = 0) -> TokenSource:
    """The validation split train.eval_every evaluates: val_paths' files, several blended in order with
    data.weights (BlendedSamples); for synthetic data the same generator on another seed. Checked as open_sources
    checks."""
    if cfg.source == "synthetic":
        return open_source(cfg, vocab_size, seed + VAL_SEED_OFFSET)
    opened = open_sources(cfg, vocab_size, seed, files=val_paths(cfg))
    return opened[0] if len(opened) == 1 else BlendedSamples(opened, cfg.shares, cfg.seq_len)


def _file_view(cfg: DataConfig, path: str, run_dir: str | os.PathLike | None) -> tuple[Any, TokenSource | None]:
    """One rank's view of a token file at job start, for its peers: (size, sample, dtype, max_id or None), or the
    error opening it gives."""
    try:
        src = open_file(cfg, path, f"data file {path!r}", scan=False, run_dir=run_dir)
    except ValueError as e:
        return str(e), None
    key = src.identity
    return (key["size"], key["sample"], key["dtype"], src.max_id), src


def _scan_order(hosts: list[str]) -> list[int]:
    """Ranks in the order files are handed out to be scanned: the first rank of every host, then the second...,
    so that several files are read by several nodes."""
    seen: dict[str, int] = {}
    place = []
    for rank, host in enumerate(hosts):
        place.append((seen.get(host, 0), rank))
        seen[host] = seen.get(host, 0) + 1
    return [rank for _, rank in sorted(place)]


def check_ids_at_start(config: Config, group: Any, run_dir: str | os.PathLike | None,
                       heartbeat: Heartbeat | None = None, round_s: float | None = None) -> None:
    """Every rank, collectively, before it opens its sources: the token files (and their validation split when
    train.eval_every) whose ids no record proves are each scanned by one rank, the ranks taken host by host
    (_scan_order), and the result cached (beside the file, else the user's cache directory, else RUN_DIR/ids/) and
    kept in every rank's process (tokenfiles.remember), so open_sources and the evaluator then scan nothing. Nobody
    waits long in one collective: the scanning ranks scan for round_s (10 s, or a quarter of the shortest of
    parallel.timeout_s and the watchdog's limits), then every rank gathers where the scans are, logs it (rank 0) and
    moves its heartbeat ("startup" with the progress as detail), round after round. A file that differs between
    ranks (size, first and last MiB or dtype), that some ranks cannot open, or whose scan fails is a ValueError on
    every rank; ids past the vocabulary are then refused by open_sources on every rank alike. `group`: the
    default group, or None outside torch.distributed (one process, which scans itself)."""
    cfg, p = config.data, config.parallel
    if cfg.source == "synthetic":
        return
    if round_s is None:
        round_s = min(10.0, min(p.timeout_s, *(p.hang_limits_s or ())) / 4)
    files = list(cfg.files)
    if config.train.eval_every:
        try:
            files += val_paths(cfg)
        except ValueError:
            pass  # open_val_source says so on every rank
    files = list(dict.fromkeys(files))
    on = group is not None and dist.is_initialized()
    rank, world = (dist.get_rank(group), dist.get_world_size(group)) if on else (0, 1)

    def gather(obj: Any) -> list[Any]:
        out: list[Any] = [None] * world
        if on:
            dist.all_gather_object(out, obj, group=group)
        else:
            out[0] = obj
        return out

    opened = [_file_view(cfg, path, run_dir) for path in files]
    hosts, views = zip(*gather((socket.gethostname(), [view for view, _ in opened])))
    todo, ranges = [], {}
    for i, path in enumerate(files):
        column = [v[i] for v in views]
        failed = [r for r, v in enumerate(column) if isinstance(v, str)]
        if failed and len(failed) < world:
            ok = next(r for r in range(world) if r not in failed)
            raise ValueError(f"rank {failed[0]} ({hosts[failed[0]]}): {column[failed[0]]}; rank {ok} "
                             f"({hosts[ok]}) opens it: every rank must see the same data")
        if failed:
            continue  # every rank fails alike in open_sources
        for r, v in enumerate(column):
            if v[:3] != column[0][:3]:
                raise ValueError(f"{path}: rank {r} ({hosts[r]}) reads {v[0]} bytes of {v[2]} (first and last MiB "
                                 f"hashed {v[1][:12]}), rank 0 ({hosts[0]}) {column[0][0]} bytes of {column[0][2]} "
                                 f"({column[0][1][:12]}): every rank must read the same file")
        known = next((v[3] for v in column if v[3] is not None), None)
        if known is None:
            todo.append(i)
        else:
            ranges[i] = (0, known)  # a known range was checked to have no negative id
    order = _scan_order(list(hosts))
    scanner = {i: order[j % world] for j, i in enumerate(todo)}
    if todo and rank == 0:
        for i in todo:
            log.info("%s: %s; rank %d (%s) checks its %s of token ids now, once for every rank", files[i],
                     opened[i][1].unchecked, scanner[i], hosts[scanner[i]],
                     size_text(opened[i][1].identity["size"]))
    scans = {i: tokenfiles._scan_ids(opened[i][1]) for i in todo if scanner[i] == rank}
    state: dict[int, list[Any]] = {i: [0, 0, -1, None] for i in scans}  # tokens read, low, high, error
    finished: set[int] = set()
    t0 = time.monotonic()
    while todo:
        deadline = time.monotonic() + round_s
        for i, it in scans.items():
            while i not in finished:  # a slice of each file at least, then until the round's end
                try:
                    step = next(it, None)
                except (ValueError, OSError) as e:
                    state[i][3] = f"{type(e).__name__}: {e}" if isinstance(e, OSError) else str(e)
                    finished.add(i)
                    break
                if step is not None:
                    state[i][:3] = step
                if step is None or step[0] == opened[i][1].num_tokens:
                    finished.add(i)
                    src = opened[i][1]
                    entry = src.identity | {"min_id": state[i][1], "max_id": state[i][2]}
                    where = tokenfiles.write_cache(src.path, entry, run_dir)
                    log.info("%s: token ids checked in %.1f s (largest %d), result kept in %s", files[i],
                             time.monotonic() - t0, state[i][2], where or "no writable place")
                elif time.monotonic() >= deadline:
                    break
        reports: dict[int, Any] = {}
        for report in gather({i: (state[i], i in finished) for i in scans}):
            reports.update(report)
        for i in todo:
            (done, low, high, error), end = reports[i]
            if error is not None:
                raise ValueError(f"checking the token ids of {files[i]} on rank {scanner[i]}: {error}")
            if end:
                ranges[i] = (low, high)
        read = sum(reports[i][0][0] * np.dtype(opened[i][1].identity["dtype"]).itemsize for i in todo)
        total = sum(opened[i][1].identity["size"] for i in todo)
        left = sum(i not in ranges for i in todo)
        detail = f"token ids: {size_text(read)} of {size_text(total)} checked, {left} of {len(todo)} files left"
        if heartbeat is not None:
            heartbeat.enter("startup", detail)  # progress: the watchdog's clock starts again
        if rank == 0:
            log.info("%s (%.0f s)", detail, time.monotonic() - t0)
        if not left:
            break
    for i, (low, high) in ranges.items():
        src = opened[i][1]
        if src is not None and src.max_id is None:
            tokenfiles.remember(src.path, src.identity | {"min_id": low, "max_id": high})


# --- loader -----------------------------------------------------------------------------------------------

class TokenLoader:
    """Shuffled, non-overlapping samples of seq_len + 1 tokens, sharded over data-parallel ranks.

    Each next_batch() consumes one global micro-batch: the next micro_batch_size * dp_size samples of the
    epoch's permutation, of which dp rank r takes the slice [r * B:(r + 1) * B]. Hence dp ranks' batches
    concatenated equal one process with B * dp_size, and k batches of B equal one of k * B (within an epoch).
    An epoch ends when fewer than a global micro-batch of samples remain; the rest are left for that epoch.
    """

    def __init__(self, source: TokenSource, seq_len: int, micro_batch_size: int, dp_rank: int, dp_size: int,
                 seed: int) -> None:
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank = {dp_rank} must be in [0, dp_size = {dp_size})")
        if seq_len < 1 or micro_batch_size < 1:
            raise ValueError(f"seq_len = {seq_len} and micro_batch_size = {micro_batch_size} must be >= 1")
        self.source, self.seq_len, self.micro_batch_size = source, seq_len, micro_batch_size
        self.dp_rank, self.dp_size, self.seed = dp_rank, dp_size, seed
        self.num_samples = (len(source) - 1) // seq_len  # sample i ends at token i * seq_len + seq_len
        self.global_batch = micro_batch_size * dp_size
        if self.num_samples < self.global_batch:
            raise ValueError(f"{len(source)} tokens make {self.num_samples} samples of seq_len + 1 = {seq_len + 1}, "
                             f"fewer than one global micro-batch of micro_batch_size * dp_size = "
                             f"{micro_batch_size} * {dp_size} = {self.global_batch}")
        self.epoch, self.sample_index, self.samples_seen = 0, 0, 0
        self._perm_key, self._perm = (-1, -1), np.zeros(0, dtype=np.int64)

    @property
    def tokens_per_global_micro_batch(self) -> int:
        """Predicted tokens per next_batch() over all dp ranks."""
        return self.global_batch * self.seq_len

    def _permutation(self) -> np.ndarray:
        if self._perm_key != (self.seed, self.epoch):  # load_state_dict may change either
            rng = np.random.default_rng([self.seed, self.epoch])
            self._perm_key, self._perm = (self.seed, self.epoch), rng.permutation(self.num_samples)
        return self._perm

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.sample_index + self.global_batch > self.num_samples:
            self.epoch, self.sample_index = self.epoch + 1, 0
        lo = self.sample_index + self.dp_rank * self.micro_batch_size
        indices = self._permutation()[lo:lo + self.micro_batch_size]
        self.sample_index += self.global_batch
        self.samples_seen += self.global_batch
        rows = np.stack([self.source.read(int(i) * self.seq_len, self.seq_len + 1) for i in indices])
        bad = rows[(rows < 0) | (rows >= self.source.vocab_size)]
        if bad.size:  # open_source checked the whole file, but a file rewritten since can hold anything
            raise ValueError(f"{self.source.name!r} holds token id {int(bad[0])} outside vocab_size "
                             f"{self.source.vocab_size}, checked when it was opened: was the file changed since?")
        tokens = torch.from_numpy(rows)  # (B, seq_len + 1) int64
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "sample_index": self.sample_index, "seed": self.seed,
                "samples_seen": self.samples_seen}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continues where the saved loader stopped, with its seed; the dp size may differ from the saver's."""
        if "drawn" in state:  # a run on data.paths resumed with data.path: a KeyError would not say so
            raise ValueError(f"loader state drawn = {state['drawn']!r:.80} was saved by a blend of data.paths: "
                             f"resume it with the same data.paths, not data.path")
        if not 0 <= int(state["sample_index"]) <= self.num_samples:
            raise ValueError(f"loader state sample_index = {state['sample_index']} is outside this dataset's "
                             f"{self.num_samples} samples: was it saved for another dataset or seq_len?")
        self.epoch, self.sample_index = int(state["epoch"]), int(state["sample_index"])
        self.seed, self.samples_seen = int(state["seed"]), int(state["samples_seen"])

    def close(self) -> None:
        """Nothing to end (PrefetchLoader has a thread to stop)."""


class EvalLoader:
    """The same `num_batches` global micro-batches of a source at every evaluation: samples 0, 1, 2, ... in order
    (no shuffle, no epochs), dp rank r taking rows [r * B:(r + 1) * B] of each, as TokenLoader shards. A source
    too short for num_batches gives as many whole global micro-batches as it holds (`num_batches` says how many),
    and none at all is an error naming it."""

    def __init__(self, source: TokenSource, seq_len: int, micro_batch_size: int, dp_rank: int, dp_size: int,
                 num_batches: int) -> None:
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank = {dp_rank} must be in [0, dp_size = {dp_size})")
        self.source, self.seq_len, self.micro_batch_size, self.dp_rank = source, seq_len, micro_batch_size, dp_rank
        self.global_batch = micro_batch_size * dp_size
        fit = (len(source) - 1) // seq_len // self.global_batch
        if fit < 1:
            raise ValueError(f"validation data {source.name!r} holds {len(source)} tokens, fewer than one global "
                             f"micro-batch of {self.global_batch} samples of seq_len + 1 = {seq_len + 1}")
        self.num_batches = min(num_batches, fit)

    def batches(self) -> Iterable[tuple[torch.Tensor, torch.Tensor]]:
        for k in range(self.num_batches):
            first = k * self.global_batch + self.dp_rank * self.micro_batch_size
            rows = np.stack([self.source.read(i * self.seq_len, self.seq_len + 1)
                             for i in range(first, first + self.micro_batch_size)])
            tokens = torch.from_numpy(rows)
            yield tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


class PrefetchLoader:
    """A TokenLoader read ahead by one background thread: up to `depth` batches wait in a bounded queue, in the
    synchronous loader's order, in pinned host memory with `pin_memory` (CUDA jobs: their copies to the device can
    then be asynchronous). Its state is the position after the batches consumed, never after those prefetched:
    state_dict() after k next_batch() calls equals the synchronous loader's after k, so a checkpoint resumes at the
    same batch whichever loader saved or loads it.

        loader = PrefetchLoader(TokenLoader(...), depth=2, pin_memory=device.type == "cuda")
        x, y = loader.next_batch()     # the thread starts at the first call
        loader.close()                 # ends the thread and rewinds the inner loader to the consumed position

    The thread also ends when the PrefetchLoader is garbage collected, or at interpreter exit. An error in the
    thread (a file changed under it) is raised by the next_batch() that would have returned that batch.
    """

    def __init__(self, loader: TokenLoader, depth: int = 2, pin_memory: bool = False) -> None:
        if depth < 1:
            raise ValueError(f"prefetch depth = {depth} must be >= 1 (0: use the TokenLoader itself)")
        self.loader, self.depth, self.pin_memory = loader, depth, pin_memory
        self._state = loader.state_dict()  # after the last consumed batch
        self._worker: threading.Thread | None = None

    def _start(self) -> None:
        self._queue: queue.Queue = queue.Queue(maxsize=self.depth)
        stop = threading.Event()
        # the thread holds the inner loader, never self: a dropped PrefetchLoader is collected and its thread ended
        self._worker = threading.Thread(target=_prefetch, args=(self.loader, self._queue, stop, self.pin_memory),
                                        name="hpctrain-prefetch", daemon=True)
        self._worker.start()
        self._finalizer = weakref.finalize(self, _stop_prefetch, self._worker, self._queue, stop)

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._worker is None:
            self._start()
        item = self._queue.get()
        if isinstance(item, BaseException):
            self.close()
            raise item
        x, y, self._state = item
        return x, y

    def state_dict(self) -> dict[str, int]:
        return dict(self._state)

    def load_state_dict(self, state: dict[str, int]) -> None:
        """As TokenLoader's; batches read ahead for the old position are dropped."""
        self.close()
        self.loader.load_state_dict(state)
        self._state = self.loader.state_dict()

    def close(self) -> bool:
        """Ends the thread (idempotent) and rewinds the inner loader to the consumed position, so next_batch()
        carries on from there; False if the thread did not end within 10 s (stuck in a read; it is a daemon)."""
        if self._worker is None:
            return True
        worker, self._worker = self._worker, None
        self._finalizer()
        self.loader.load_state_dict(self._state)
        return not worker.is_alive()


def _prefetch(loader: TokenLoader, out: queue.Queue, stop: threading.Event, pin_memory: bool) -> None:
    """The read-ahead thread: batches with the loader's state after each, until stopped; an error is passed on."""
    try:
        while not stop.is_set():
            x, y = loader.next_batch()
            if pin_memory:
                x, y = x.pin_memory(), y.pin_memory()
            out.put((x, y, loader.state_dict()))  # blocks while `depth` batches wait
    except BaseException as e:  # raised again in the consumer's thread
        out.put(e)


def _stop_prefetch(worker: threading.Thread, out: queue.Queue, stop: threading.Event, limit_s: float = 10.0) -> None:
    """Stops a read-ahead thread: drained, its pending put has room, and it sees `stop` before reading again."""
    stop.set()
    deadline = time.monotonic() + limit_s
    while worker.is_alive() and time.monotonic() < deadline:
        try:
            while True:
                out.get_nowait()
        except queue.Empty:
            pass
        worker.join(timeout=0.01)
