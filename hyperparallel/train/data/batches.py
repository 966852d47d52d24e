"""Which rows every rank trains on at every step: a pure function of the step, on any layout.

`SequenceOrder` shuffles the rows afresh each epoch with a keyed permutation computed index by
index (a Feistel network over the next power of four, cycle-walking into range): position p's
row is known without a table of the epoch's order, so memory does not grow with the corpus and a
run resumes exactly by starting at position step x global_batch.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

_MASK64 = (1 << 64) - 1
_ROUNDS = 4


def _mix(value: int) -> int:
    """splitmix64's finalizer: a bijective, well-spread hash of a 64-bit integer."""
    value = (value ^ (value >> 30)) * 0xBF58476D1CE4E5B9 & _MASK64
    value = (value ^ (value >> 27)) * 0x94D049BB133111EB & _MASK64
    return value ^ (value >> 31)


class KeyedPermutation:
    """A bijection of range(n), from a 64-bit key."""

    def __init__(self, n: int, key: int):
        self.n = n
        self.half_bits = max(1, (max(n - 1, 1).bit_length() + 1) // 2)
        self.half_mask = (1 << self.half_bits) - 1
        self.round_keys = [_mix(key + r + 1) for r in range(_ROUNDS)]

    def _feistel(self, x: int) -> int:
        left, right = x >> self.half_bits, x & self.half_mask
        for k in self.round_keys:
            left, right = right, left ^ (_mix(right ^ k) & self.half_mask)
        return (left << self.half_bits) | right

    def __call__(self, i: int) -> int:
        x = self._feistel(i)
        while x >= self.n:  # (the domain is < 4n: a few steps on average)
            x = self._feistel(x)
        return x


class SequenceOrder:
    """The row at every global position: a fresh permutation per epoch, from (seed, epoch)."""

    def __init__(self, num_sequences: int, seed: int):
        self.n = num_sequences
        self.seed = seed
        self._epoch, self._perm = -1, None

    def index(self, position: int) -> int:
        epoch = position // self.n
        if epoch != self._epoch:
            key = int.from_bytes(hashlib.blake2b(f"{self.seed}/{epoch}".encode(), digest_size=8).digest(), "little")
            self._epoch, self._perm = epoch, KeyedPermutation(self.n, key)
        return self._perm(position % self.n)


class InOrder:
    """Positions in corpus order, wrapping around: the validation set, the same on any layout."""

    def __init__(self, num_sequences: int):
        self.n = num_sequences

    def index(self, position: int) -> int:
        return position % self.n


class Rows(Protocol):
    def __len__(self) -> int: ...

    def row(self, i: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """(ids, labels, position ids or None) of row i, each [seq_len]."""
        ...


@dataclass(frozen=True)
class MicroBatch:
    ids: torch.Tensor  # [B, seq_len]
    labels: torch.Tensor  # [B, seq_len], -100 where the loss does not count
    positions: torch.Tensor | None  # [B, seq_len] restarting at each document (document masks), or None


@dataclass
class Batches:
    """The micro-batches of one rank (a data-parallel replica), read row by row when asked."""

    rows: Rows
    order: SequenceOrder | InOrder
    global_batch: int
    micro_batch: int
    rank: int
    world_size: int

    def micro_batches(self, step: int):
        """The micro-batches this rank trains on at optimizer step `step` (0-based)."""
        start = step * self.global_batch
        per_round = self.micro_batch * self.world_size
        for first in range(start, start + self.global_batch, per_round):
            lo = first + self.rank * self.micro_batch
            rows = [self.rows.row(self.order.index(p)) for p in range(lo, lo + self.micro_batch)]
            ids, labels, positions = zip(*rows, strict=True)
            yield MicroBatch(torch.from_numpy(np.stack(ids)), torch.from_numpy(np.stack(labels)),
                             None if positions[0] is None else torch.from_numpy(np.stack(positions)))

    @property
    def sequences_per_epoch(self) -> int:
        return len(self.rows)
