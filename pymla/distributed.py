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
   dtype) and its LSE (``[T, H]`` float32) with the other ranks, the two
   packed in one byte buffer;
3. merges the partials in float32 with their LSE
   (:func:`merge_attention_states`), rounds the result to the dtype (the
   spec's ``raw``) and runs step 6 once on the merged result: the op with
   ``first_step`` 6 (:meth:`pymla.DecodePlan.project`).

Two exchanges (``ContextParallel(exchange=...)``), every rank ending with
the whole output ``[T, H, Dv]``; bytes each rank receives per layer, ``b``
the dtype's size (:meth:`ContextParallelPlan.bytes_received`):

* ``"all_gather"``: every rank gathers every partial, merges all heads and
  projects all heads: ``(N - 1) T H (R b + 4)``; DeepSeek-V3 (H = 128,
  R = 512, bf16): 131,584 bytes per token per other rank.
* ``"all_to_all"`` (TensorRT-LLM Helix's pattern): one ``all_to_all`` sends
  each rank the partials of its ``H / N`` heads; it merges and projects
  those (step 6 split over the ranks), and an ``all_gather`` of the outputs
  follows: ``(N - 1) T (H / N) (R b + 4 + Dv b)``; DeepSeek-V3 over 2 ranks,
  82,176 bytes per token. Needs ``H`` a multiple of ``N``.

The partials cross in the cache's dtype: for bfloat16 and float16 each is
rounded once before the merge (one rounding more than the one-process op;
:mod:`pymla.parity` derives the bound). The code is the same for gloo (CPU
tensors) and NCCL (CUDA tensors); with NCCL, keep NVLink multicast off in
NCCL, torch's symmetric memory and NVSHMEM (:data:`NVLINK_MULTICAST_OFF`,
which :func:`nccl_environment` sets, also for processes spawned after it).

**Tensor parallel over heads** (:class:`TensorParallelHeads`): rank ``r``
of ``N`` takes heads ``[r H / N, (r + 1) H / N)``: its slice of q, w_uk,
w_uv and their scales, and a whole cache of its own (every rank writes the
same new rows); the outputs are gathered along the heads. ALiBi's slopes
depend on the global head index, which the op does not take: refused.
"""

from __future__ import annotations

import dataclasses
import math
import os
import weakref
from collections.abc import MutableMapping

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
    "NVLINK_MULTICAST_OFF",
    "merge_attention_states",
    "nccl_environment",
]


NVLINK_MULTICAST_OFF = {
    "NCCL_NVLS_ENABLE": "0",  # NCCL's NVLink SHARP (multicast) collectives
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",  # torch's symmetric memory
    "NVSHMEM_DISABLE_NVLS": "1",  # NVSHMEM
}
"""The environment variables that keep NVLink multicast off, and their values."""


def nccl_environment(env: MutableMapping[str, str] | None = None) -> MutableMapping[str, str]:
    """Sets each variable of :data:`NVLINK_MULTICAST_OFF` in ``env`` unless set; returns ``env``.

    ``env``: ``os.environ`` (the default: call before NCCL starts; processes
    spawned afterwards inherit it) or the environment of a process to start
    (``subprocess.Popen(env=nccl_environment(dict(os.environ)))``). A
    variable already set keeps its value.
    """
    env = os.environ if env is None else env
    for name, value in NVLINK_MULTICAST_OFF.items():
        env.setdefault(name, value)
    return env


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


def _head_slice(rank: int, world_size: int, num_heads: int) -> slice:
    """Rank ``rank``'s heads of ``num_heads`` (a multiple of ``world_size``)."""
    per_rank = num_heads // world_size
    return slice(rank * per_rank, (rank + 1) * per_rank)


def _head_weights(weights: LayerWeights, heads: slice) -> LayerWeights:
    """``heads`` of one layer's weights: w_uk, w_uv and their scales (heads first)."""
    t = weights.tensors
    return LayerWeights(
        t["w_uk"][heads].contiguous(),
        t["w_uk_scale"][heads].contiguous(),
        t["w_uv"][heads].contiguous(),
        t["w_uv_scale"][heads].contiguous(),
        t["kv_norm_gamma"],
        weights.granularity,
    )


def _group_size(group) -> tuple[int, int]:
    if not dist.is_initialized():
        raise ValueError("group: expected an initialized torch.distributed process group, got none")
    return dist.get_rank(group), dist.get_world_size(group)


class ContextParallel:
    """This rank's place in a context-parallel decode group: its shard of every request's cache.

    Args:
        group: the ``torch.distributed`` process group (None: the default group).
        interleave: positions per run dealt to a rank (:class:`pymla.CacheShard`).
        exchange: ``"all_gather"`` or ``"all_to_all"`` (module docstring).
    """

    EXCHANGES = ("all_gather", "all_to_all")

    def __init__(self, group=None, *, interleave: int = 1, exchange: str = "all_gather") -> None:
        if exchange not in self.EXCHANGES:
            raise ValueError(f"exchange: expected one of {self.EXCHANGES}, got {exchange!r}")
        self.group = group
        self.exchange = exchange
        self.rank, self.world_size = _group_size(group)
        self.shard = CacheShard(self.rank, self.world_size, as_int("interleave", interleave))
        # all_to_all: this rank's heads of each layer's weights, sliced once per LayerWeights.
        self._head_weights: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

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
            options = dataclasses.replace(options, shard=self.shard)
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

    def bytes_received(self, num_heads: int, v_head_dim: int = 128) -> int:
        """Bytes each rank receives per layer (module docstring): ``(N - 1) T H (R b + 4)``
        with ``"all_gather"``, ``(N - 1) T (H / N) (R b + 4 + Dv b)`` with ``"all_to_all"``."""
        s = self.step
        n = self.context.world_size
        b = s.dtype.itemsize
        if self.context.exchange == "all_to_all":
            per_rank = s.num_tokens * (num_heads // n) * (s.kv_lora_rank * b + 4 + v_head_dim * b)
        else:
            per_rank = s.num_tokens * num_heads * (s.kv_lora_rank * b + 4)
        return (n - 1) * per_rank

    def attend(
        self, q: torch.Tensor, layer: int, weights: LayerWeights, new_rows=None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Steps 1 to 5 over every rank's keys: the merged ``(attention [T, H, R] float32, lse)``.

        ``new_rows``: all new tokens' raw rows (each rank writes those it
        holds). Gathers every partial whatever the group's exchange.
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

        Step 6 runs once, on the merged attention output rounded to the
        cache's dtype (the spec's ``raw``): on every rank for all heads with
        ``"all_gather"``, then ``attention_out`` (the cache's dtype) and
        ``lse`` (float32 ``[T, H]``) may receive the merged attention output
        and LSE; with ``"all_to_all"`` each rank projects its heads (no
        ``attention_out`` or ``lse`` there). ``new_rows``: all new tokens'
        raw rows (each rank writes those it holds).
        """
        if self.context.exchange == "all_to_all":
            if attention_out is not None or lse is not None:
                raise ValueError(
                    "attention_out, lse: expected None with exchange 'all_to_all' (each rank "
                    "merges only its heads), got a tensor"
                )
            return self._run_heads(q, layer, weights, out, new_rows)
        merged, merged_lse = self.attend(q, layer, weights, new_rows=new_rows)
        raw = merged.to(self.step.dtype)
        if attention_out is not None:
            attention_out.copy_(raw)
        if lse is not None:
            lse.copy_(merged_lse)
        return self.step.project(raw, q, layer, weights, out)

    def _run_heads(self, q, layer, weights, out, new_rows) -> torch.Tensor:
        """``run`` with ``"all_to_all"``: merge and project this rank's heads, gather the outputs."""
        context = self.context
        n, heads = context.world_size, weights.num_heads
        if heads % n:
            raise ValueError(
                f"weights: expected num_heads a multiple of the group's size {n} for exchange "
                f"'all_to_all', got {heads}"
            )
        mine = _head_slice(context.rank, n, heads)
        partial, lse = self.step.attend(q, layer, weights, new_rows=new_rows)
        outputs, lses = self._all_to_all(partial, lse)
        merged, _ = merge_attention_states(outputs, lses)
        head_weights = context._head_weights.get(weights)
        if head_weights is None:
            head_weights = context._head_weights[weights] = _head_weights(weights, mine)
        projected = self.step.project(
            merged.to(partial.dtype), q[:, mine].contiguous(), layer, head_weights
        )
        pieces = [torch.empty_like(projected) for _ in range(n)]
        dist.all_gather(pieces, projected, group=context.group)
        result = torch.cat(pieces, dim=1)
        if out is None:
            return result
        out.copy_(result)
        return out

    def _all_to_all(self, partial: torch.Tensor, lse: torch.Tensor):
        """The partials and LSEs of this rank's heads from every rank: one packed ``all_to_all``."""
        n = self.context.world_size
        t, h, r = partial.shape
        per = h // n
        # Destination d gets heads [d per, (d + 1) per): its partial rows, then its LSEs, as bytes.
        out_bytes = t * per * r * partial.element_size()
        packets = [
            torch.cat(
                [
                    partial[:, d * per : (d + 1) * per].contiguous().view(-1).view(torch.uint8),
                    lse[:, d * per : (d + 1) * per].contiguous().view(-1).view(torch.uint8),
                ]
            )
            for d in range(n)
        ]
        sent = torch.cat(packets)
        received = torch.empty_like(sent)
        dist.all_to_all_single(received, sent, group=self.context.group)
        pieces = received.view(n, -1)
        outputs = [p[:out_bytes].view(partial.dtype).view(t, per, r) for p in pieces]
        lses = [p[out_bytes:].view(torch.float32).view(t, per) for p in pieces]
        return outputs, lses

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
        self.heads = _head_slice(self.rank, self.world_size, num_heads)

    def check_options(self, options: DecodeOptions) -> None:
        """ALiBi is refused: its slopes depend on the global head index, which the op does not take."""
        if options.score_mod == ScoreMod.ALIBI_POS and self.world_size > 1:
            raise ValueError(
                "options: expected score_mod 'no_pos' with tensor-parallel heads (ALiBi's slopes "
                "depend on the global head index), got 'alibi_pos'"
            )

    def weights(self, weights: LayerWeights) -> LayerWeights:
        """This rank's slice of one layer's weights: w_uk, w_uv and their scales (heads first)."""
        return _head_weights(weights, self.heads)

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
