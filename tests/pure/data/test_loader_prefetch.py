"""Pure tier for the prefetching loader: the same batches as the synchronous TokenLoader, in the same order; a
state that describes the batches consumed, not those read ahead, so a checkpoint resumes at the same batch; the
thread ends on close, on garbage collection and after an error, which reaches the consumer. Training with
train.prefetch = 2 against 0: tests/multiproc/data/test_loader_prefetch_training.py.

    .venv/bin/python -m pytest tests/pure/data/test_loader_prefetch.py -q
"""
from __future__ import annotations

import gc
import json
import time

import numpy as np
import pytest
import torch

from hpctrain.data.loader import PrefetchLoader, TokenLoader
from hpctrain.data.sources import SyntheticSource


def sync_loader(dp_rank: int = 0, dp_size: int = 1, micro_batch_size: int = 2, source=None) -> TokenLoader:
    source = source or SyntheticSource(256, seed=1, num_tokens=16 * 40 + 1)  # 40 samples of 16 + 1
    return TokenLoader(source, 16, micro_batch_size, dp_rank, dp_size, seed=0)


def take(loader, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [loader.next_batch() for _ in range(n)]


def same(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(x1, x2) and torch.equal(y1, y2) for (x1, y1), (x2, y2) in zip(a, b))


def read_ahead(loader: PrefetchLoader) -> None:
    """Waits until the thread has filled its queue (and so is blocked, `depth` batches ahead)."""
    deadline = time.monotonic() + 10
    while not loader._queue.full():
        assert time.monotonic() < deadline, "the read-ahead thread did not fill its queue"
        time.sleep(0.001)




@pytest.mark.parametrize("depth", [1, 2, 5])
def test_same_batches_in_the_same_order_across_epochs(depth) -> None:
    # dp rank 1 of 2, 25 batches: 2.5 epochs of 40 samples in global batches of 4
    want = take(sync_loader(1, 2), 25)
    ld = PrefetchLoader(sync_loader(1, 2), depth=depth)
    assert same(take(ld, 25), want)
    assert ld.close()


def test_state_is_the_consumed_position_not_the_prefetched_one() -> None:
    ref, ld = sync_loader(), PrefetchLoader(sync_loader(), depth=3)
    assert ld.state_dict() == ref.state_dict()  # before the first batch
    for k in range(1, 12):  # crosses the epoch boundary at 10 batches
        take(ref, 1)
        take(ld, 1)
        read_ahead(ld)
        assert ld.loader.samples_seen >= ref.samples_seen + 3 * 2  # three batches read ahead (or four) ...
        assert ld.state_dict() == ref.state_dict(), k  # ... and none of them counted
    assert ld.close()


@pytest.mark.parametrize("saver, loader_kind", [("prefetch", "prefetch"), ("prefetch", "sync"), ("sync", "prefetch")])
def test_resume_gives_the_uninterrupted_batches(saver, loader_kind) -> None:
    reference = take(sync_loader(), 19)
    first = PrefetchLoader(sync_loader(), depth=4) if saver == "prefetch" else sync_loader()
    take(first, 7)
    if saver == "prefetch":
        read_ahead(first)
    state = json.loads(json.dumps(first.state_dict()))
    assert state == {"epoch": 0, "sample_index": 14, "seed": 0, "samples_seen": 14}
    resumed = PrefetchLoader(sync_loader(), depth=2) if loader_kind == "prefetch" else sync_loader()
    resumed.load_state_dict(state)
    assert same(take(resumed, 12), reference[7:])
    # loading into a running loader drops its read-ahead and starts over from the state given
    resumed.load_state_dict(state)
    assert same(take(resumed, 3), reference[7:10])
    first.close(), resumed.close()


def test_close_ends_a_blocked_thread_and_loses_no_batch() -> None:
    want = take(sync_loader(), 10)
    ld = PrefetchLoader(sync_loader(), depth=2)
    got = take(ld, 3)
    read_ahead(ld)  # the thread is blocked in put() on a full queue
    worker = ld._worker
    t0 = time.monotonic()
    assert ld.close() and not worker.is_alive() and time.monotonic() - t0 < 1
    assert ld.close()  # idempotent
    assert ld.loader.state_dict() == ld.state_dict()  # the inner loader is rewound to the consumed position
    got += take(ld, 7)  # a new thread carries on from there
    assert same(got, want)
    assert ld.close()


def test_a_dropped_loader_ends_its_thread() -> None:
    ld = PrefetchLoader(sync_loader(), depth=2)
    take(ld, 1)
    read_ahead(ld)
    worker = ld._worker
    del ld
    gc.collect()
    worker.join(timeout=5)
    assert not worker.is_alive()


class BreaksAt(SyntheticSource):
    """Synthetic tokens whose reads fail from the `at`-th on (a file changed under the loader)."""

    def __init__(self, at: int) -> None:
        super().__init__(256, seed=1, num_tokens=16 * 40 + 1)
        self.reads, self.at = 0, at

    def read(self, start: int, count: int) -> np.ndarray:
        self.reads += 1
        if self.reads > self.at:
            raise ValueError("token file changed")
        return super().read(start, count)


def test_an_error_in_the_thread_reaches_the_consumer_at_its_batch() -> None:
    ld = PrefetchLoader(sync_loader(source=BreaksAt(at=2 * 3)), depth=2)  # 2 samples a batch: batch 4 fails
    take(ld, 3)
    state = ld.state_dict()
    with pytest.raises(ValueError, match="token file changed"):
        ld.next_batch()
    assert ld._worker is None and ld.state_dict() == state == ld.loader.state_dict()


# --- in the trainer ---------------------------------------------------------------------------------------------



