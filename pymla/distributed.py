"""Multi-rank decode over ``torch.distributed``: context parallel (DCP) and tensor parallel heads.

**Context-parallel decode** (:class:`ContextParallel`): a request's latent
cache is split over the ranks of a process group, position ``p`` on rank
``(p // interleave) % N`` (:class:`pymla.CacheShard`; ``interleave = 1``
deals tokens, ``page_size`` pages, ``>= ceil(max_seq_len / N)`` one
contiguous run per rank). Per layer, every rank

1. runs steps 1 to 5 of the op on its keys for all heads
   (:meth:`pymla.DecodePlan.attend`): the new token's row is written only by
   the rank that holds its position, at its local slot; RoPE, masks and
   ALiBi use global positions;
2. exchanges its partial attention output (``[T, H, R]``, the cache's
   dtype) and its LSE (``[T, H]`` float32) with the other ranks: one
   ``all_gather`` of the two packed in one byte buffer;
3. merges the partials in float32 with their LSE
   (:func:`merge_attention_states`), rounds the result to the dtype (the
   spec's ``raw``) and runs step 6 once, on the merged result: the op with
   ``first_step`` 6 (:meth:`pymla.DecodePlan.project`).

Every rank ends with the whole output ``[T, H, Dv]``. Bytes each rank
receives per layer: ``(N - 1) T H (R b + 4)`` with ``b`` the dtype's size
(:meth:`ContextParallelPlan.bytes_received`); DeepSeek-V3 (H = 128,
R = 512, bf16): 131,584 bytes per token per layer per other rank.

The partials cross in the cache's dtype: for bfloat16 and float16 each is
rounded once before the merge (one rounding more than the one-process op;
:mod:`pymla.parity` derives the bound). The code is the same for gloo (CPU
tensors) and NCCL (CUDA tensors); with NCCL, keep NVLink multicast off
(``NCCL_NVLS_ENABLE=0``, which :func:`nccl_environment` sets, also for
spawned processes).

**Tensor parallel over heads** (:class:`TensorParallelHeads`): rank ``r``
of ``N`` takes heads ``[r H / N, (r + 1) H / N)``: its slice of q, w_uk,
w_uv and their scales, and a whole cache of its own (every rank writes the
same new rows); the outputs are gathered along the heads. ALiBi's slopes
depend on the global head index, which the op does not take: refused.
"""

from __future__ import annotations

import math
import os

import torch
import torch.distributed as dist

from .args import ScoreMod
from .cache import PagedLatentCache
from .options import DecodeOptions, as_int
from .plan import DecodePlan, LayerWeights, plan
from .shard import CacheShard

__all__ = [
    "ContextParallel",
    "ContextParallelPlan",
    "TensorParallelHeads",
    "merge_attention_states",
    "nccl_environment",
]


def nccl_environment() -> None:
    """Sets ``NCCL_NVLS_ENABLE=0`` (NVLink multicast off) unless set: call before NCCL starts.

    Environment variables reach processes spawned afterwards too.
    """
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")


def merge_attention_states(
    outputs: list[torch.Tensor] | tuple[torch.Tensor, ...] | torch.Tensor,
    lses: list[torch.Tensor] | tuple[torch.Tensor, ...] | torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merges partial attention results over disjoint key sets: ``(out, lse)``, float32.

    ``outputs[r] [T, H, R]`` (any floating dtype) and ``lses[r] [T, H]``
    (float32) are the attention output and natural log-sum-exp of piece
    ``r`` of the keys (sequences, or tensors stacked on dim 0). With
    ``M = max_r lse_r``: ``out = sum_r exp(lse_r - M) out_r / sum_r exp(lse_r - M)``
    and ``lse = M + log(sum_r exp(lse_r - M))``, in float32. A piece with
    ``lse = -inf`` (it held none of the row's keys) weighs 0; a row that no
    piece saw gets ``out = 0`` and ``lse = -inf``. The result is the
    attention over the union of the keys, up to float32 rounding and the
    rounding of each ``out_r`` given in a narrower dtype.
    """
    out = outputs if isinstance(outputs, torch.Tensor) else torch.stack(list(outputs))
    lse = lses if isinstance(lses, torch.Tensor) else torch.stack(list(lses))
    if out.dim() != 4 or lse.dim() != 3 or out.shape[:3] != lse.shape:
        raise ValueError(
            f"outputs, lses: expected pieces [T, H, R] and [T, H], got {tuple(out.shape)} and "
            f"{tuple(lse.shape)} (stacked)"
        )
    lse = lse.to(torch.float32)
    top = lse.amax(dim=0)  # [T, H]
    seen = torch.isfinite(top)
    shift = torch.where(seen, top, torch.zeros_like(top))
    w = torch.exp(lse - shift)  # exp(-inf) = 0 for a piece without keys
    total = w.sum(dim=0)
    safe = torch.where(seen, total, torch.ones_like(total))
    merged = (w[..., None] * out.to(torch.float32)).sum(dim=0) / safe[..., None]
    merged_lse = torch.where(seen, shift + safe.log(), torch.full_like(top, -math.inf))
    return merged, merged_lse


def _group_size(group) -> tuple[int, int]:
    if not dist.is_initialized():
        raise ValueError("group: expected an initialized torch.distributed process group, got none")
    return dist.get_rank(group), dist.get_world_size(group)


class ContextParallel:
    """This rank's place in a context-parallel decode group: its shard of every request's cache.

    Args:
        group: the ``torch.distributed`` process group (None: the default group).
        interleave: positions per run dealt to a rank (:class:`pymla.CacheShard`).
    """

    def __init__(self, group=None, *, interleave: int = 1) -> None:
        self.group = group
        self.rank, self.world_size = _group_size(group)
        self.shard = CacheShard(self.rank, self.world_size, as_int("interleave", interleave))

    def make_cache(self, **kwargs) -> PagedLatentCache:
        """A :class:`pymla.PagedLatentCache` of this rank's shard (``kwargs``: its arguments)."""
        return PagedLatentCache(shard=self.shard, **kwargs)

    def options(self, **kwargs) -> DecodeOptions:
        """:class:`pymla.DecodeOptions` with this rank's shard."""
        return DecodeOptions(shard=self.shard, **kwargs)

    def plan(
        self,
        cache: PagedLatentCache,
        input_row_offsets: torch.Tensor,
        freqs_cis: torch.Tensor,
        options: DecodeOptions,
        **kwargs,
    ) -> ContextParallelPlan:
        """:func:`pymla.plan` of this rank's shard of the step (``kwargs``: its keywords).

        ``options`` may omit the shard (it is set to this rank's); ``cache``
        is this rank's shard (:meth:`make_cache`), or its three tensors.
        """
        if options.shard.whole and not self.shard.whole:
            options = DecodeOptions(
                scale=options.scale,
                epsilon=options.epsilon,
                mask=options.mask,
                score_mod=options.score_mod,
                local_window_size=options.local_window_size,
                shard=self.shard,
            )
        if options.shard != self.shard:
            raise ValueError(
                f"options: expected this rank's shard {self.shard}, got {options.shard}"
            )
        step = plan(cache, input_row_offsets, freqs_cis, options, **kwargs)
        return ContextParallelPlan(self, step)


class ContextParallelPlan:
    """One decode step of one rank of a :class:`ContextParallel` group; :meth:`run` per layer.

    Every rank of the group must call :meth:`run` (or :meth:`attend`) for
    the same layers in the same order: each is a collective.
    """

    def __init__(self, context: ContextParallel, step: DecodePlan) -> None:
        self.context = context
        self.step = step

    def bytes_received(self, num_heads: int) -> int:
        """Bytes each rank receives per layer: ``(N - 1) T H (R b + 4)``."""
        s = self.step
        per_rank = s.num_tokens * num_heads * (s.kv_lora_rank * s.dtype.itemsize + 4)
        return (self.context.world_size - 1) * per_rank

    def attend(
        self, q: torch.Tensor, layer: int, weights: LayerWeights, new_rows=None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Steps 1 to 5 over every rank's keys: the merged ``(attention [T, H, R] float32, lse)``.

        ``new_rows``: all new tokens' raw rows (each rank writes those it holds).
        """
        partial, lse = self.step.attend(q, layer, weights, new_rows=new_rows)
        outputs, lses = self._all_gather(partial, lse)
        return merge_attention_states(outputs, lses)

    def run(
        self,
        q: torch.Tensor,
        layer: int,
        weights: LayerWeights,
        out: torch.Tensor | None = None,
        attention_out: torch.Tensor | None = None,
        new_rows: torch.Tensor | None = None,
        lse: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The op on one layer over every rank's keys: ``out [T, H, v_head_dim]`` on every rank.

        Step 6 runs once per rank, on the merged attention output rounded to
        the cache's dtype (the spec's ``raw``), which ``attention_out`` (the
        cache's dtype) receives when given; ``lse`` (float32 ``[T, H]``) the
        merged LSE. ``new_rows``: all new tokens' raw rows (each rank writes
        those it holds).
        """
        merged, merged_lse = self.attend(q, layer, weights, new_rows=new_rows)
        raw = merged.to(self.step.dtype)
        if attention_out is not None:
            attention_out.copy_(raw)
        if lse is not None:
            lse.copy_(merged_lse)
        return self.step.project(raw, q, layer, weights, out)

    def _all_gather(self, partial: torch.Tensor, lse: torch.Tensor):
        """Every rank's ``(partial, lse)``: one all_gather of both packed as bytes."""
        n = self.context.world_size
        if n == 1:
            return [partial], [lse]
        head = partial.numel() * partial.element_size()
        packed = torch.cat(
            [partial.reshape(-1).view(torch.uint8), lse.reshape(-1).view(torch.uint8)]
        )
        pieces = [torch.empty_like(packed) for _ in range(n)]
        dist.all_gather(pieces, packed, group=self.context.group)
        outputs = [p[:head].view(partial.dtype).view(partial.shape) for p in pieces]
        lses = [p[head:].view(torch.float32).view(lse.shape) for p in pieces]
        return outputs, lses


class TensorParallelHeads:
    """This rank's heads in a tensor-parallel group: ``[r H / N, (r + 1) H / N)``.

    Args:
        num_heads: the model's heads ``H`` (a multiple of the group's size ``N``).
        group: the ``torch.distributed`` process group (None: the default group).
    """

    def __init__(self, num_heads: int, group=None) -> None:
        self.group = group
        self.rank, self.world_size = _group_size(group)
        num_heads = as_int("num_heads", num_heads)
        if num_heads < 1 or num_heads % self.world_size:
            raise ValueError(
                f"num_heads: expected a positive multiple of the group's size {self.world_size}, "
                f"got {num_heads}"
            )
        self.num_heads = num_heads
        per_rank = num_heads // self.world_size
        self.heads = slice(self.rank * per_rank, (self.rank + 1) * per_rank)

    def check_options(self, options: DecodeOptions) -> None:
        """ALiBi is refused: its slopes depend on the global head index, which the op does not take."""
        if options.score_mod == ScoreMod.ALIBI_POS and self.world_size > 1:
            raise ValueError(
                "options: expected score_mod 'no_pos' with tensor-parallel heads (ALiBi's slopes "
                "depend on the global head index), got 'alibi_pos'"
            )

    def weights(self, weights: LayerWeights) -> LayerWeights:
        """This rank's slice of one layer's weights: w_uk, w_uv and their scales (heads first)."""
        t = weights.tensors
        h = self.heads
        return LayerWeights(
            t["w_uk"][h].contiguous(),
            t["w_uk_scale"][h].contiguous(),
            t["w_uv"][h].contiguous(),
            t["w_uv_scale"][h].contiguous(),
            t["kv_norm_gamma"],
            weights.granularity,
        )

    def q(self, q: torch.Tensor) -> torch.Tensor:
        """This rank's heads of ``q [T, H, D]``."""
        return q[:, self.heads].contiguous()

    def gather(self, out: torch.Tensor) -> torch.Tensor:
        """Every rank's heads of the output, concatenated: ``[T, H, Dv]`` on every rank."""
        if self.world_size == 1:
            return out
        pieces = [torch.empty_like(out) for _ in range(self.world_size)]
        dist.all_gather(pieces, out.contiguous(), group=self.group)
        return torch.cat(pieces, dim=1)

    def bytes_received(self, num_tokens: int, v_head_dim: int, dtype: torch.dtype) -> int:
        """Bytes each rank receives per layer gathering the outputs: ``(N - 1) T (H / N) Dv b``."""
        per_rank = num_tokens * (self.num_heads // self.world_size) * v_head_dim * dtype.itemsize
        return (self.world_size - 1) * per_rank
