"""Seeded benchmark inputs in closed form, so that a rank checks any collective's result with memory O(chunk),
whatever the world size and the message size.

Element i of group member j (0 <= j < n) holds

    x(j, i) = lo_i + (a_i + b_i * j) mod m_i

where the hash of (seed, i) picks the element's kind (lo_i, m_i, a_i, b_i) from a short list, b_i a unit modulo
m_i. As j runs over the members, element i cycles through the m_i integers lo_i .. lo_i + m_i - 1: residue
r < m_i is held by the (n - 1 - r) // m_i + 1 members r, r + m_i, ... The reduction over the members (sum, prod,
min, max, avg) of an element of each kind is thus a fold over at most 4 values with known multiplicities,
tabulated once per kind: checking an element is one hash and one table lookup, and any one member's input
(gathers, scatters, broadcast, sendrecv) is a formula of (j, i): no rank ever builds another rank's buffer.

Reducing collectives draw from data_range: small integers (m_i <= 4) whose reduction over n members is exact in
the element type; lo_i and m_i vary per element so that reduced results differ from element to element (a result
written to the wrong place is caught). The others hold (h_i + b_i * j) mod m, h_i the element's hash, b_i odd and
m the largest power of two exact in the type (at most 2**24): members of a group up to m hold different values at
every element, so a chunk from the wrong peer cannot look right.

    pat = Pattern(seed=0, dtype=torch.float32, op="sum", nranks=128)
    pat.fill(send, member=5, chunk=1 << 16)        # member 5's input, chunk by chunk
    want = pat.reduced(torch.arange(4096))         # float64 sum over the 128 members of elements 0..4095
"""
from __future__ import annotations

import math

import torch

# Largest integer each type holds exactly (for ints one below the maximum, which serves as the sentinel).
_EXACT = {torch.float32: 2**24, torch.float64: 2**53, torch.float16: 2**11, torch.bfloat16: 2**8}
_M32 = 0xFFFFFFFF
_WIDE_MAX = 2**24  # float32's exact range: plenty of distinct values


def exact_limit(dtype: torch.dtype) -> int:
    return _EXACT[dtype] if dtype.is_floating_point else torch.iinfo(dtype).max - 1


def data_range(dtype: torch.dtype, op: str, nranks: int) -> tuple[int, int]:
    """[lo, hi) of the inputs, so the reduced result of nranks inputs stays exact in dtype (partial results of
    these non-negative inputs are no larger than the final one, in any order of reduction)."""
    limit = exact_limit(dtype)
    if op == "prod":  # {1, 2}: products are powers of two, exact while 2**nranks fits; else all ones
        return (1, 3) if 2**nranks <= limit else (1, 2)
    if op in ("sum", "avg"):
        return 0, min(4, limit // nranks + 1)
    return 0, 4


def sentinel(dtype: torch.dtype) -> int:
    """A value no input or result takes: results are >= 0, and ints stay below their maximum."""
    return torch.iinfo(dtype).max if not dtype.is_floating_point and not dtype.is_signed else -1


def _mix(x):
    """32-bit integer hash (T. Mueller's), for Python ints or int64 tensors in [0, 2**32); no product exceeds
    2**59, so int64 never wraps and every device computes the same bits. Modifies a tensor argument."""
    for _ in range(2):
        x ^= x >> 16
        x *= 0x45D9F3B
        x &= _M32
    x ^= x >> 16
    return x


class Pattern:
    """The inputs of one group of `nranks` members for one collective: `op` is the reduction, None for a
    collective that only moves data."""

    def __init__(self, seed: int, dtype: torch.dtype, op: str | None, nranks: int) -> None:
        self.dtype, self.op, self.n = dtype, op, nranks
        self.salt = _mix(seed % 2**32 ^ 0x9E3779B9)
        if op is None:
            self.width = 1 << (min(exact_limit(dtype), _WIDE_MAX).bit_length() - 1)
            return
        lo, hi = data_range(dtype, op, nranks)
        kinds = [(low, m, a, b) for m in range(1, hi - lo + 1) for low in range(lo, hi - m + 1) for a in range(m)
                 for b in range(1, max(m, 2)) if math.gcd(b, m) == 1]  # lo_i + m_i <= hi; b_i a unit mod m_i
        self.kinds = torch.tensor(kinds)  # (kinds, 4)
        self.kind_reduced = torch.tensor([self._reduce(*k) for k in kinds], dtype=torch.float64)  # (kinds,)

    def _reduce(self, lo: int, m: int, a: int, b: int) -> float:
        """The reduction over the n members of an element of one kind, in exact integers."""
        n = self.n
        held = [(lo + (a + b * r) % m, (n - 1 - r) // m + 1) for r in range(min(m, n))]  # (value, members)
        if self.op == "prod":
            return float(math.prod(v**c for v, c in held))
        if self.op in ("min", "max"):
            return float((min if self.op == "min" else max)(v for v, _ in held))
        total = sum(v * c for v, c in held)
        return total / n if self.op == "avg" else float(total)

    def _hash(self, i: torch.Tensor) -> torch.Tensor:
        """32-bit hash of (seed, i) for int64 indices i (up to 2**63)."""
        return _mix((i & _M32) ^ ((i >> 32) * 0x9E3779B1 & _M32) ^ self.salt)

    def kind(self, i: torch.Tensor) -> torch.Tensor:
        """Row of self.kinds, (lo_i, m_i, a_i, b_i), of the elements at indices i (reducing collectives)."""
        return self._hash(i) % len(self.kinds)

    def values(self, member, i: torch.Tensor) -> torch.Tensor:
        """x(member, i) as int64; `member` is an int, or for data movement an int64 tensor broadcasting with i."""
        if self.op is None:
            h = self._hash(i)
            return (h + ((h >> 7) | 1) * member) & (self.width - 1)
        lo, m, a, b = self.kinds.unbind(1)
        return (lo + (a + b * member) % m).to(i.device)[self.kind(i)]  # each kind's value, looked up

    def reduced(self, i: torch.Tensor) -> torch.Tensor:
        """The reduction over all n members of the elements at indices i, float64 (exact but for avg)."""
        return self.kind_reduced.to(i.device)[self.kind(i)]

    def fill(self, buf: torch.Tensor, member: int, chunk: int) -> None:
        """Writes member's input into the contiguous buffer, `chunk` elements at a time, on buf's device."""
        flat = buf.view(-1)
        for start in range(0, flat.numel(), chunk):
            stop = min(start + chunk, flat.numel())
            flat[start:stop].copy_(self.values(member, torch.arange(start, stop, device=buf.device)))


def make_data(member: int, numel: int, dtype: torch.dtype, op: str | None, seed: int,
              nranks: int = 1) -> torch.Tensor:
    """One member's whole input in dtype (tests and small references)."""
    return Pattern(seed, dtype, op, nranks).values(member, torch.arange(numel)).to(dtype)


def reduce_inputs(inputs: list[torch.Tensor], op: str) -> torch.Tensor:
    """Brute-force reference in float64 over materialised inputs (exact for the small integers above): what the
    check computed before the closed form, kept for tests to compare against."""
    x = torch.stack([t.double() for t in inputs])
    if op == "sum":
        return x.sum(0)
    if op == "prod":
        return x.prod(0)
    if op == "min":
        return x.min(0).values
    if op == "max":
        return x.max(0).values
    return x.sum(0) / len(inputs)  # avg
