"""Checkpoint lifecycle: one directory per step, written under a temporary name and committed atomically (rename,
then a COMMITTED marker written last, carrying the commit order and the checksums of the JSON files); only
committed checkpoints count; the newest K by commit order are kept; at most one asynchronous save in flight; one
job writes a checkpoint directory at a time (lock.py); a load verifies everything before it touches live state.

    mgr = CheckpointManager(cfg.checkpoint, run_dir, rank)          # collective: rank 0 takes the directory lock
    mgr.save(step, {"model": ..., "optimizer": ...}, extra_json={...}, provenance={...})
    step, extra, state = mgr.load_latest(make_state)  # None when nothing is committed; NoUsableCheckpoint when
    mgr.wait(); mgr.close()                            # checkpoints exist and none loads (never a silent restart)

`state` maps names to torch.distributed.checkpoint Stateful objects or tensors; DCP plans the shards, the HDF5
storage (hdf5_storage.py) writes one file per rank. `extra_json` is small control state (step, scheduler, data
position) kept as JSON beside the shards: nothing in a checkpoint is ever unpickled.

A save that finds the file system full or the quota spent (ENOSPC or EDQUOT, at any point: the directory, a shard,
the index, the attached files, the marker) is abandoned on every rank and raised as NoSpace naming which: what it
wrote is removed, and a committed copy of the same step that it was replacing is put back. The caller decides
whether the job goes on (checkpointer.py: a periodic save is skipped, a final one fails the job).
"""
from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import shutil
import subprocess
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

from hpctrain import hostprobe
from hpctrain.checkpoint.hdf5_storage import INDEX, CheckpointCorrupt, HDF5Reader, HDF5Writer
from hpctrain.checkpoint.layout import (
    EXTRA,
    MARKER,
    MARKER_VERSION,
    UNUSABLE,
    file_crc,
    marker_seq,
    parse_name,
    read_committed,
    shard_bytes,
    step_name,
    verify_data,
)
from hpctrain.checkpoint.planners import TouchLoadPlanner
from hpctrain.config import CheckpointConfig
from hpctrain.fsutil import fsync_path, write_atomic

log = logging.getLogger(__name__)

__all__ = ["MARKER", "EXTRA", "CheckpointManager", "committed", "step_name", "NoSpace", "NoUsableCheckpoint",
           "PartialLoad"]


class NoSpace(OSError):
    """The file system cannot hold the next checkpoint (full, or the quota spent): earlier checkpoints are untouched."""


# The errors of a file system that takes no more bytes from us, and what to do about each.
FULL = {errno.ENOSPC: ("no space left on {root}", "free space there or put checkpoint.dir on a larger file system"),
        errno.EDQUOT: ("disk quota exceeded on {root}", "ask for more quota or put checkpoint.dir on scratch")}


def full_error(e: BaseException) -> OSError | None:
    """The ENOSPC or EDQUOT error in e: e itself, what caused it, or one rank's failure inside DCP's
    CheckpointException (a BaseException gathering every rank's error, errno kept); None when there is none."""
    todo, seen = [e], set()
    while todo:
        x = todo.pop()
        if x is None or id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, OSError) and x.errno in FULL:
            return x
        if isinstance(x, CheckpointException):
            todo.extend(failure[0] for failure in x.failures.values())
        todo.extend((x.__cause__, x.__context__))
    return None


def no_room(code: int, root: Path, what: str, detail: str = "") -> str:
    """The message of NoSpace: which limit (full disk or quota) on which directory, what to do, what stays."""
    where, fix = FULL[code]
    detail = f" ({detail})" if detail else ""
    return f"{what}: {where.format(root=root)}{detail}; {fix}. Earlier checkpoints are untouched"


class NoUsableCheckpoint(RuntimeError):
    """Committed checkpoints exist but none loads: the job stops instead of starting again from scratch."""


class PartialLoad(RuntimeError):
    """A load failed after data had reached live tensors: falling back would train on a mix of two states."""


def committed(root: Path) -> list[tuple[int, Path]]:
    """(step, path) of every committed checkpoint (a step directory with a marker file) under root, oldest commit
    first: by the marker's seq, then step; checkpoints whose marker is unreadable sort first (they never load)."""
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        parsed = parse_name(p.name)
        if parsed and not parsed[1] and (p / MARKER).is_file():
            seq = marker_seq(p)
            found.append((-1 if seq is None else seq, parsed[0], p))
    return [(step, p) for _, step, p in sorted(found)]


def _committed_dir(path: Path) -> bool:
    """A real step directory (not a link) holding its commit marker."""
    return not path.is_symlink() and (path / MARKER).is_file()


def _write_json(path: Path, obj: Any) -> None:
    write_atomic(path, json.dumps(obj, indent=1))


def stripe(directory: Path, count: int, size_mb: int) -> bool:
    """Lustre striping of a new directory (files inherit it) when `lfs` exists; False elsewhere."""
    if count == 0 or shutil.which("lfs") is None:
        return False
    out = subprocess.run(["lfs", "setstripe", "-c", str(count), "-S", f"{size_mb}M", str(directory)],
                         capture_output=True, text=True)
    if out.returncode:
        log.warning("lfs setstripe on %s failed: %s", directory, out.stderr.strip())
    return out.returncode == 0


def state_bytes(state: dict[str, Any]) -> int:
    """Bytes this rank will write: local shards of every tensor in the (nested) state dict."""
    total = 0

    def walk(x: Any) -> None:
        nonlocal total
        if isinstance(x, torch.Tensor):
            local = x.to_local() if hasattr(x, "to_local") else x
            total += local.numel() * local.element_size()
        elif isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)
        elif hasattr(x, "state_dict"):
            walk(x.state_dict())

    walk(state)
    return total


def _agree(rank: int, fn) -> Any:
    """Runs fn on rank 0 and hands its result, or its error message, to every rank (no rank waits on a dead one).
    Rank 0 raises fn's own error; the others one of its kind (NoSpace, OSError, else RuntimeError) with its text."""
    box: list[Any] = [None, None]
    error = None
    if rank == 0:
        try:
            box[0] = fn()
        except Exception as e:  # noqa: BLE001 -- whatever it is, every rank must hear of it
            box[1], error = (type(e).__name__, str(e)), e
    if dist.is_initialized():
        dist.broadcast_object_list(box, src=0)
    if error is not None:
        raise error
    if box[1]:
        kind, msg = box[1]
        raise (NoSpace if kind == "NoSpace" else RuntimeError if kind != "OSError" else OSError)(msg)
    return box[0]


def _any_rank(flag: bool) -> bool:
    """True on every rank when any rank's flag is set (collective)."""
    t = torch.tensor([float(flag)])
    if dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def _gather(obj: Any) -> list[Any]:
    if not dist.is_initialized():
        return [obj]
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, obj)
    return every


class CheckpointManager:
    def __init__(self, ccfg: CheckpointConfig, run_dir: Path, rank: int, writer: bool = True,
                 progress: Callable[..., Any] = lambda nbytes, total=None: None) -> None:
        """writer=False reads another run's checkpoints: no lock, no clean-up, no saves. progress(nbytes,
        total=None) is told the whole job's bytes when a save or load begins (total) and every dataset's bytes
        as they are written, checked or read (the rank's heartbeat, Heartbeat.advance)."""
        self.cfg = ccfg
        self.progress = progress
        self.root = Path(ccfg.dir) if ccfg.dir else Path(run_dir) / "checkpoints"
        self.rank = rank
        self.lock = None
        self.pending: tuple[int, Future, dict, dict] | None = None  # async save in flight
        self.attach: dict[str, Path] = {}  # {name: source}: files rank 0 copies into every checkpoint it commits
        self.async_group = None
        self.stager = None
        if not writer:
            return
        self.lock = _agree(rank, self._take_directory)
        # asynchronous saves run their collectives in a background thread: on a group of their own, or they
        # would interleave with training's collectives on the default group (a deadlock on gloo); gloo serves host
        # and CUDA tensors alike, and DCP only moves objects and flags on it (the shards are staged on the host)
        self.async_group = dist.new_group(backend="gloo") if ccfg.async_save and dist.is_initialized() else None
        # one stager for the whole run keeps its host buffers: the copy that stalls training goes into memory
        # already allocated instead of allocating the whole state again at every save (benchmarks/async_stall.py
        # measures both, staging_what_if); safe since one save is in flight
        if ccfg.async_save:
            self.stager = _run_stager()

    def _take_directory(self):
        """Rank 0: the directory lock, then what killed saves left. A .partial directory goes (never committed). A
        .old directory is the committed copy of a step that a re-save was replacing: it goes once the replacement
        is committed; otherwise it is put back, and a replacement that never got its marker (a crash between the
        rename and the marker) goes instead. Links are never followed: a linked .partial or .old is only unlinked."""
        from hpctrain.checkpoint.lock import acquire
        lock = acquire(self.root)
        for p in sorted(self.root.iterdir()):
            parsed = parse_name(p.name)
            if parsed is None or parsed[1] not in (".partial", ".old"):
                continue
            final = self.root / step_name(parsed[0])
            if p.is_symlink():  # not a directory a save of ours makes: never delete through it
                p.unlink()
                log.warning("removed the link %s (checkpoint saves never make links)", p)
            elif parsed[1] == ".partial" or _committed_dir(final):
                shutil.rmtree(p)
                log.info("removed %s, left by a save that never completed", p)
            else:
                if final.is_symlink():
                    final.unlink()
                elif final.exists():  # the replacement, renamed into place but never committed
                    shutil.rmtree(final)
                    log.warning("removed %s: a save replacing it stopped before its commit marker", final)
                os.replace(p, final)
                fsync_path(self.root)
                log.warning("restored %s from %s: the save that was replacing it never committed", final, p.name)
        return lock

    def close(self) -> None:
        """Gives the directory back. A save still in flight is abandoned, never committed: call wait() first to
        finish it (not on an error path, where its commit barrier could wait on a rank that is gone)."""
        if self.lock is not None:
            self.lock.release()
            self.lock = None
        if self.stager is not None and self.pending is None:
            self.stager.close()
            self.stager = None

    # -- saving -------------------------------------------------------------------------------------------
    def _partial(self, step: int) -> Path:
        """Where a save of `step` is written until its commit renames it."""
        return self.root / f"{step_name(step)}.partial"

    def _prepare(self, step: int, need_bytes: int) -> Path:
        """Rank 0 makes a clean temporary directory, checks free space, stripes it; everyone waits."""
        tmp = self._partial(step)

        def make() -> None:
            with self._full_is_no_space(step):
                self.root.mkdir(parents=True, exist_ok=True)
                if tmp.exists():  # left by a save that was killed: never committed, safe to drop
                    shutil.rmtree(tmp)
                free = shutil.disk_usage(self.root).free
                if need_bytes > free:
                    raise NoSpace(f"checkpoint of step {step} needs about {need_bytes / 1e9:.2f} GB but "
                                  f"{self.root} has {free / 1e9:.2f} GB free; previous checkpoints are untouched")
                # free space says nothing of a quota, which on a shared file system binds first; lfs answers cheaply
                quota = hostprobe.quota_left(self.root)
                if quota is not None and need_bytes > quota[0]:
                    raise NoSpace(no_room(errno.EDQUOT, self.root, f"checkpoint of step {step} needs about "
                                          f"{need_bytes / 1e9:.2f} GB but {quota[1]} leaves {quota[0] / 1e9:.2f} GB"))
                tmp.mkdir()
                stripe(tmp, self.cfg.stripe_count, self.cfg.stripe_size_mb)
        _agree(self.rank, make)
        return tmp

    @contextlib.contextmanager
    def _full_is_no_space(self, step: int):
        """ENOSPC or EDQUOT (on this rank, or any rank inside DCP) raised as NoSpace naming the limit."""
        try:
            yield
        except NoSpace:
            raise
        except (Exception, CheckpointException) as e:  # noqa: BLE001 -- only the full file system is ours
            full = full_error(e)
            if full is None:
                raise
            detail = " ".join(str(full).split())[:300]
            if os.strerror(full.errno) not in detail:
                detail = f"{os.strerror(full.errno)}: {detail}"
            raise NoSpace(no_room(full.errno, self.root, f"checkpoint of step {step} abandoned", detail)) from e

    @contextlib.contextmanager
    def _abandoned_if_full(self, step: int):
        """Collective, around the parts of a save that fail on every rank at once (DCP's, and rank 0's handed on by
        _agree): a save that finds no room is abandoned, then raised as NoSpace; other errors go on untouched (a
        killed save's leftovers are cleared at the next start)."""
        try:
            with self._full_is_no_space(step):
                yield
        except NoSpace:
            self._abandon(step)
            raise

    def _abandon(self, step: int) -> None:
        """Rank 0 removes what a failed save of `step` left, so that it holds no space and cannot be taken for a
        checkpoint: its .partial directory, or, where the commit had renamed it into place but its marker was not
        written, that directory, putting back the committed copy it was replacing (.old). Everyone waits."""
        tmp, final = self._partial(step), self.root / step_name(step)
        old = final.with_name(final.name + ".old")

        def tidy() -> None:
            try:
                for p in (tmp, old if _committed_dir(final) else final):
                    if p.is_symlink():
                        p.unlink()
                    elif p.exists():
                        shutil.rmtree(p)
                if not _committed_dir(final) and old.is_dir() and not old.is_symlink():
                    os.replace(old, final)
                    log.warning("restored %s: the save replacing it was abandoned", final)
                if self.root.is_dir():
                    fsync_path(self.root)
            except OSError as e:  # the next start clears whatever is left, as after a killed save
                log.warning("could not clear the abandoned save of step %d in %s: %s", step, self.root, e)
        _agree(self.rank, tidy)

    def _need_bytes(self, state: dict[str, Any]) -> int:
        mine = torch.tensor([state_bytes(state)], dtype=torch.float64)
        if dist.is_initialized():
            dist.all_reduce(mine)
        return int(mine.item() * 1.05) + (1 << 20)  # HDF5 headers and the index

    def save(self, step: int, state: dict[str, Any], extra_json: dict, provenance: dict,
             asynchronous: bool = False) -> None:
        """Saves and commits `step`; with asynchronous=True returns once the shards are staged in memory.
        NoSpace (on every rank, the save abandoned) when the file system is full or the quota spent."""
        assert self.lock is not None, "a read-only CheckpointManager does not save"
        self.wait()  # at most one save in flight
        need = self._need_bytes(state)
        self.progress(0, total=need)
        tmp = self._prepare(step, need)
        writer = HDF5Writer(tmp, checksum=True, chunk_bytes=int(self.cfg.chunk_mb * (1 << 20)),
                            progress=self.progress)
        with self._abandoned_if_full(step):
            if asynchronous:
                if _closed(self.stager):
                    self.stager = _run_stager()
                fut = dcp.async_save(state, storage_writer=writer, process_group=self.async_group,
                                     async_stager=self.stager)
                self.pending = (step, fut, extra_json, provenance)
                return
            dcp.save(state, storage_writer=writer)
        self._commit(step, tmp, extra_json, provenance)

    def unfinished(self) -> bool:
        """True while this rank's asynchronous save is still writing."""
        return self.pending is not None and not self.pending[1].done()

    def wait(self) -> None:
        """Finishes and commits the save in flight, if any. NoSpace as save()."""
        if self.pending is None:
            return
        step, fut, extra, prov = self.pending
        self.pending = None
        with self._abandoned_if_full(step):  # DCP's error is every rank's: the write ran collectives on async_group
            fut.result()
        self._commit(step, self._partial(step), extra, prov)

    def _commit(self, step: int, tmp: Path, extra_json: dict, provenance: dict) -> None:
        """Rank 0 commits once every rank's shards are on disk; its error reaches every rank (NoSpace abandons)."""
        if dist.is_initialized():
            dist.barrier()  # every rank's shards are on disk

        def commit() -> None:
            with self._full_is_no_space(step):
                self._commit_files(step, tmp, extra_json, provenance)
        with self._abandoned_if_full(step):
            _agree(self.rank, commit)  # its broadcast is also the barrier after the commit

    def _commit_files(self, step: int, tmp: Path, extra_json: dict, provenance: dict) -> None:
        """Rank 0: the attached files and train state into tmp, tmp renamed into place, its marker last."""
        for name, source in self.attach.items():  # small files that travel with every checkpoint (tokenizer)
            shutil.copyfile(source, tmp / name)
        _write_json(tmp / EXTRA, extra_json)
        seq = 1 + max((s for s in map(marker_seq, self.root.iterdir()) if s is not None), default=0)
        marker = {"step": step, "seq": seq, "marker_version": MARKER_VERSION,
                  "files": {name: file_crc(tmp / name) for name in (EXTRA, INDEX)}} | provenance
        final = self.root / step_name(step)
        old = final.with_name(final.name + ".old")
        if _committed_dir(final):  # an older save of this step (a resumed run repeating it): kept until this
            if old.exists():      # commits; a .old beside a committed step is an earlier replaced copy
                shutil.rmtree(old)
            os.replace(final, old)
        elif final.is_symlink():
            final.unlink()
        elif final.exists():  # never committed (a crash before its marker): the good copy, if any, is .old
            shutil.rmtree(final)
        os.replace(tmp, final)
        _write_json(final / MARKER, marker)  # written last: the commit point (durable, with its entry)
        fsync_path(self.root)  # the renames
        if old.exists():
            shutil.rmtree(old)
        log.info("checkpoint step %d committed in %s", step, final)
        self._prune(final)

    def _prune(self, just_committed: Path) -> None:
        """Keeps the newest `keep` checkpoints by commit order and the one just committed; removes only
        checkpoints whose marker reads (an unreadable one is for a person to look at, not for us to delete)."""
        done = [(s, p) for s, p in committed(self.root) if marker_seq(p) is not None]
        for step, path in done[:-self.cfg.keep]:
            if path != just_committed:
                shutil.rmtree(path, ignore_errors=True)
                log.info("removed checkpoint step %d (keep %d)", step, self.cfg.keep)

    # -- loading ------------------------------------------------------------------------------------------
    def load(self, path: Path, make_state) -> tuple[dict, dict]:
        """Loads one committed checkpoint into the state make_state(train_state) builds. Collective. Everything
        is checked first on every rank (marker, checksums, index, every dataset, the train state's schema inside
        make_state); CheckpointCorrupt, naming each rank's problem, leaves the live state untouched. A failure
        after data reached live tensors raises PartialLoad."""
        path = Path(path)
        world = dist.get_world_size() if dist.is_initialized() else 1
        why, extra, state = None, {}, {}
        try:
            if not (path / MARKER).is_file():
                raise CheckpointCorrupt(path, None, f"not a committed checkpoint (no {MARKER} marker)")
            _, extra = read_committed(path)
            self.progress(0, total=shard_bytes(path))  # the files' sizes on disk: no number read from them
            state = make_state(extra)  # raises ValueError for a train state of the wrong shape
            problems = verify_data(path, self.cfg.verify, share=(self.rank % world, world),
                                   progress=self.progress).problems
            if problems:
                why = "; ".join(problems[:3]) + (f" (and {len(problems) - 3} more)" if len(problems) > 3 else "")
        except (CheckpointCorrupt, ValueError, TypeError, KeyError, OSError) as e:
            why = str(e)
        refused = [f"rank {r}: {w}" for r, w in enumerate(_gather(why)) if w]
        if refused:
            raise CheckpointCorrupt(path, None, "; ".join(refused[:4]))
        planner = TouchLoadPlanner()
        try:
            dcp.load(state, storage_reader=HDF5Reader(path, verify=self.cfg.verify, progress=self.progress),
                     planner=planner)
        except (Exception, CheckpointException) as e:  # every rank raises: DCP gathers each rank's errors
            if _any_rank(planner.touched):
                raise PartialLoad(f"loading {path} failed after its data reached the model and optimizer ({e}); "
                                  f"not falling back to an older checkpoint on a half-loaded state: restart the "
                                  f"job to retry") from e
            raise CheckpointCorrupt(path, None, f"{type(e).__name__}: {e}") from e
        return extra, state

    def load_latest(self, make_state) -> tuple[int, dict, dict] | None:
        """The newest committed checkpoint (by commit order) that loads on every rank. Refused ones newer than
        it are set aside (renamed *.unusable, never deleted) so they can no longer shadow it or be pruned in its
        place. None when nothing is committed; NoUsableCheckpoint, listing each and why, when none loads."""
        refused: list[tuple[Path, str]] = []
        for step, path in reversed(committed(self.root)):
            try:
                extra, state = self.load(path, make_state)
            except CheckpointCorrupt as e:
                refused.append((path, e.reason))
                log.warning("checkpoint %s is unusable (%s); trying the previous one", path, e.reason)
                continue
            if self.lock is not None:
                _agree(self.rank, lambda: [self._set_aside(p, why) for p, why in refused])
            return step, extra, state
        if refused:
            lines = "\n".join(f"  {p}: {why}" for p, why in refused)
            raise NoUsableCheckpoint(
                f"{len(refused)} committed checkpoint(s) in {self.root} and none loads:\n{lines}\nNothing was "
                f"changed. To start from scratch anyway, move them away or set checkpoint.dir to a new directory.")
        return None

    def _set_aside(self, path: Path, why: str) -> Path:
        n, dest = 1, path.with_name(path.name + ".unusable")
        while os.path.lexists(dest):
            n += 1
            dest = path.with_name(f"{path.name}.unusable-{n}")
        os.replace(path, dest)
        if not dest.is_symlink():  # the note never goes through a link to wherever it points
            (dest / UNUSABLE).write_text(f"refused when loading: {why}\n")
        fsync_path(self.root)
        log.warning("set %s aside as %s", path.name, dest.name)
        return dest


def _run_stager():
    """The async saves' stager, kept for the whole run where torch allows: its host buffers are reused, so the copy
    that stalls training goes into memory already allocated (benchmarks/async_stall.py, staging_what_if)."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    cuda = torch.cuda.is_available()
    return DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=False, use_async_staging=False,
                                        use_non_blocking_copy=cuda))


def _closed(stager) -> bool:
    """Whether `stager` closed itself. torch 2.11's DefaultStager closes its state-dict stager after every staging,
    emptying its copy table and buffers: the run's second async save then failed with "KeyError: <class 'type'>"
    (seen on an H100 with torch 2.11; 2.13 keeps it open). Such a stager is replaced before the next save."""
    table = getattr(getattr(stager, "_state_dict_stager", None), "_deepcopy_dispatch", None)
    return table is not None and not table
