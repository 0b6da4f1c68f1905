"""Which positions of each request a rank's cache holds: context-parallel decode's shard.

A request's positions are dealt to ``count`` ranks in runs of ``interleave``
positions: position ``p`` belongs to rank ``(p // interleave) % count`` and
sits in that rank's cache at local slot ``local_count(p)`` (the rank's
positions below ``p``). ``interleave = 1`` deals single tokens (vLLM's
``cp_kv_cache_interleave_size = 1``); ``interleave = page_size`` deals
pages; an ``interleave`` of at least ``ceil(max_seq_len / count)`` gives
each rank one contiguous run (rank ``r`` holds ``[r I, (r + 1) I)``). The
kernel's twin is ``CacheShard`` in ``mojo_kernels/paged_cache.mojo``; the
parity tests of shards (``tests/test_op_parity.py``) hold them to each other.

``cache_lengths`` and positions stay global (RoPE, masks and ALiBi see the
sequence positions); only the cache's pages and slots are local.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .options import INT32_MAX, as_int

__all__ = ["CacheShard"]


@dataclass(frozen=True)
class CacheShard:
    """Rank ``rank`` of ``count``, positions dealt in runs of ``interleave``; checked when made.

    ``CacheShard()`` is the whole cache (one rank holds every position, slot = position).
    """

    rank: int = 0
    count: int = 1
    interleave: int = 1

    def __post_init__(self) -> None:
        count = as_int("num_shards", self.count)
        rank = as_int("shard_rank", self.rank)
        interleave = as_int("shard_interleave", self.interleave)
        if not 1 <= count <= INT32_MAX:
            raise ValueError(f"num_shards: expected 1 <= num_shards < 2**31, got {count}")
        if not 0 <= rank < count:
            raise ValueError(
                f"shard_rank: expected 0 <= shard_rank < num_shards {count}, got {rank}"
            )
        if not 1 <= interleave <= INT32_MAX // count:
            raise ValueError(
                f"shard_interleave: expected 1 <= shard_interleave <= {INT32_MAX // count} "
                f"(num_shards * shard_interleave < 2**31), got {interleave}"
            )
        for name, value in (("rank", rank), ("count", count), ("interleave", interleave)):
            object.__setattr__(self, name, value)

    @property
    def whole(self) -> bool:
        """Whether this is the whole cache (one rank)."""
        return self.count == 1

    def owner(self, position):
        """The rank holding ``position`` (an int or an integer tensor)."""
        return (position // self.interleave) % self.count

    def owns(self, position):
        """Whether this rank holds ``position`` (an int or an integer tensor)."""
        return self.owner(position) == self.rank

    def local_count(self, n):
        """How many of positions ``0 .. n - 1`` this rank holds (an int, integer tensor or array).

        Also the local slot of position ``n`` when this rank holds it.
        """
        if self.count == 1:
            return n
        cycle = self.count * self.interleave
        rest = n % cycle - self.rank * self.interleave
        if isinstance(rest, torch.Tensor):
            rest = rest.clamp(0, self.interleave)
        elif isinstance(rest, np.ndarray):
            rest = np.clip(rest, 0, self.interleave)
        else:
            rest = min(max(rest, 0), self.interleave)
        return (n // cycle) * self.interleave + rest

    def position(self, slot):
        """The sequence position of local slot ``slot`` (an int or an integer tensor)."""
        if self.count == 1:
            return slot
        i = self.interleave
        return (slot // i) * self.count * i + self.rank * i + slot % i

    def positions(self, stop: int, start: int = 0) -> torch.Tensor:
        """This rank's positions in ``[start, stop)``, ascending (int64)."""
        pos = torch.arange(start, stop)
        return pos[self.owns(pos)]

    def scalars(self) -> dict[str, int]:
        """The kernel's scalar inputs of this shard."""
        return {
            "shard_rank": self.rank,
            "num_shards": self.count,
            "shard_interleave": self.interleave,
        }


WHOLE_CACHE = CacheShard()
"""The whole cache, ``CacheShard()`` (immutable: every :class:`pymla.DecodeOptions` without a
shard shares it)."""
