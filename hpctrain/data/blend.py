"""Several token files mixed by their shares (data.paths, data.weights): the training loader and the validation
samples of a blend.

    loader = BlendLoader(sources, cfg.data.shares, seq_len, micro_batch, dp_rank, dp_size, seed)  # as TokenLoader
    val = BlendedSamples(val_sources, cfg.data.shares, seq_len)  # a TokenSource of whole samples, for EvalLoader

Which file each global sample comes from is blend_order's deterministic rule (the file most behind its share),
so the mix depends on nothing but how many samples each file has given: the whole loader state. No
torch.distributed: ranks come in as ints.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from hpctrain.data.tokenfiles import TokenSource


def blend_order(shares: list[float], drawn: list[int], count: int) -> list[int]:
    """The files the next `count` samples of a blend come from, given how many each has given (`drawn`, updated
    in place): each sample from the file most behind its share, share * (samples so far + 1) - drawn, ties to the
    first. Every prefix of the sequence is within one sample of each share, and it depends on nothing but the
    counts: not on dp size, rank or seed."""
    out = []
    total = sum(drawn)
    for _ in range(count):
        total += 1
        i = max(range(len(shares)), key=lambda k: (shares[k] * total - drawn[k], -k))
        drawn[i] += 1
        out.append(i)
    return out


class BlendLoader:
    """TokenLoader's contract over several token files mixed by their shares (data.paths, data.weights).

    Global sample g comes from the file blend_order picks; within each file, samples are taken in a permutation
    of that file's own epoch (seeded by (seed, file, epoch)), so a small file starts its next epoch while a large
    one is still in its first. Dp rank r takes rows [r * B:(r + 1) * B] of each global micro-batch, as
    TokenLoader does. The state is the seed and how many samples each file has given: it resumes exactly, with
    any dp size."""

    def __init__(self, sources: list[TokenSource], shares: list[float], seq_len: int, micro_batch_size: int,
                 dp_rank: int, dp_size: int, seed: int) -> None:
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank = {dp_rank} must be in [0, dp_size = {dp_size})")
        if len(sources) != len(shares) or not sources:
            raise ValueError(f"{len(sources)} sources but {len(shares)} shares")
        self.sources, self.shares, self.seq_len = sources, list(shares), seq_len
        self.micro_batch_size, self.dp_rank, self.dp_size, self.seed = micro_batch_size, dp_rank, dp_size, seed
        self.num_samples = [(len(s) - 1) // seq_len for s in sources]
        self.global_batch = micro_batch_size * dp_size
        self.drawn = [0] * len(sources)
        self._perms: dict[tuple[int, int], np.ndarray] = {}

    @property
    def samples_seen(self) -> int:
        return sum(self.drawn)

    @property
    def tokens_per_global_micro_batch(self) -> int:
        return self.global_batch * self.seq_len

    def _sample(self, file: int, k: int) -> int:
        """The sample of `file` its k-th draw reads: position k mod n of the permutation of epoch k // n."""
        n = self.num_samples[file]
        key = (file, k // n)
        if key not in self._perms:
            if len(self._perms) > 4 * len(self.sources):
                self._perms.clear()
            self._perms[key] = np.random.default_rng([self.seed, file, k // n]).permutation(n)
        return int(self._perms[key][k % n])

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        before = list(self.drawn)
        order = blend_order(self.shares, self.drawn, self.global_batch)
        counts = list(before)
        picks = []
        for file in order:
            picks.append((file, counts[file]))
            counts[file] += 1
        mine = picks[self.dp_rank * self.micro_batch_size:(self.dp_rank + 1) * self.micro_batch_size]
        rows = np.stack([self.sources[f].read(self._sample(f, k) * self.seq_len, self.seq_len + 1)
                         for f, k in mine])
        for (f, _), row in zip(mine, rows):
            bad = row[(row < 0) | (row >= self.sources[f].vocab_size)]
            if bad.size:
                raise ValueError(f"{self.sources[f].name!r} holds token id {int(bad[0])} outside vocab_size "
                                 f"{self.sources[f].vocab_size}, checked when it was opened: was it changed since?")
        tokens = torch.from_numpy(rows)
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    def _names(self) -> list[str]:
        return [Path(s.name).name for s in self.sources]

    def state_dict(self) -> dict[str, Any]:
        """The seed, the samples each file has given, and the files' names (a resume with the files of data.paths
        reordered or swapped would otherwise go on silently with the wrong counts)."""
        return {"seed": self.seed, "drawn": list(self.drawn), "samples_seen": self.samples_seen,
                "files": self._names()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        drawn = state.get("drawn")
        if drawn is None:
            raise ValueError("the loader state was saved by a single data.path loader, not a blend: resume with "
                             "the same data.path, or start the blend as a new run")
        if not isinstance(drawn, list) or len(drawn) != len(self.sources) or not all(
                type(d) is int and d >= 0 for d in drawn):
            raise ValueError(f"blend loader state drawn = {drawn!r:.80} does not fit the {len(self.sources)} files "
                             f"of data.paths: was it saved for another blend?")
        files = state.get("files", self._names())
        if files != self._names():
            raise ValueError(f"the checkpoint's blend read the files {files}, this run's data.paths are "
                             f"{self._names()}: keep the same files in the same order to resume")
        self.seed, self.drawn = int(state["seed"]), list(drawn)
        self._perms.clear()

    def close(self) -> None:
        """Nothing to end (PrefetchLoader has a thread to stop)."""


class BlendedSamples(TokenSource):
    """Validation samples of several files in a fixed blended order (blend_order, no shuffle, no repeats): sample
    i is the next unread sample of the file blend_order names. Read only whole samples (EvalLoader does). Holds as
    many samples as the blend takes before its first file runs out."""

    def __init__(self, sources: list[TokenSource], shares: list[float], seq_len: int) -> None:
        self.sources, self.shares, self.seq_len = sources, shares, seq_len
        self.name = " + ".join(s.name for s in sources)
        self.vocab_size = max(s.vocab_size for s in sources)
        self.max_id = max(s.max_id for s in sources)
        sizes = [(len(s) - 1) // seq_len for s in sources]
        drawn = [0] * len(sources)
        self._picks: list[tuple[int, int]] = []
        while True:  # the sample sequence up to the first file's end
            (f,) = blend_order(shares, drawn, 1)
            if drawn[f] > sizes[f]:
                break
            self._picks.append((f, drawn[f] - 1))
        self.num_tokens = len(self._picks) * seq_len + 1

    def read(self, start: int, count: int) -> np.ndarray:
        if start % self.seq_len or count != self.seq_len + 1:
            raise ValueError(f"blended validation data reads whole samples, not tokens [{start}, {start + count})")
        f, k = self._picks[start // self.seq_len]
        return self.sources[f].read(k * self.seq_len, count)
