"""Random MLA decode inputs on a paged cache: shared by the demo, the benchmark and the tests.

:func:`make_case` draws every input from a seed (no zeros, random pages), in
the DeepSeek-V3 layout by default: kv_lora_rank 512, qk_nope 128, qk_rope 64,
v_head_dim 128, fp8 e4m3 weights with 128x128 block scales.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..cache import PagedLatentCache
from ..cache_format import stored
from ..options import DecodeOptions
from ..plan import LayerWeights
from ..quant import ScaleGranularity, make_mla_weights
from ..reference import (
    KVCacheTensors,
    Stages,
    default_scale,
    mla_decode_branch_fp8_stages,
    rope_freqs_cis,
)
from ..shard import CacheShard


@dataclass
class Case:
    """All inputs of one op call, plus a snapshot of the cache before it."""

    q: torch.Tensor
    input_row_offsets: torch.Tensor
    freqs_cis: torch.Tensor
    kv_norm_gamma: torch.Tensor
    cache: PagedLatentCache
    layer_idx: int
    weights: dict[str, torch.Tensor]
    options: dict = field(default_factory=dict)

    def args(self, cache=None, layer_idx: int | None = None) -> tuple:
        w = self.weights
        return (
            self.q,
            self.input_row_offsets,
            self.freqs_cis,
            self.kv_norm_gamma,
            self.cache if cache is None else cache,
            self.layer_idx if layer_idx is None else layer_idx,
            w["w_uk"],
            w["w_uk_scale"],
            w["w_uv"],
            w["w_uv_scale"],
        )

    def cache_tensors(self) -> KVCacheTensors:
        return KVCacheTensors(self.cache.blocks, self.cache.cache_lengths, self.cache.lookup_table)

    def layer_weights(self) -> LayerWeights:
        """The case's weights as one :class:`pymla.LayerWeights` (checked and wrapped once)."""
        w = self.weights
        return LayerWeights(
            w["w_uk"], w["w_uk_scale"], w["w_uv"], w["w_uv_scale"], self.kv_norm_gamma,
            self.options["scale_granularity"],
        )  # fmt: skip

    def decode_options(self) -> DecodeOptions:
        """The case's options (all but the weights' scale granularity) as :class:`pymla.DecodeOptions`."""
        return DecodeOptions(**{k: v for k, v in self.options.items() if k != "scale_granularity"})

    def to(self, device: str | torch.device) -> Case:
        """Moves every tensor (and the cache) to ``device``, in place; returns self."""
        device = torch.device(device)
        for name in ("q", "input_row_offsets", "freqs_cis", "kv_norm_gamma"):
            setattr(self, name, getattr(self, name).to(device))
        self.weights = {k: v.to(device) for k, v in self.weights.items()}
        self.cache.to(device)
        return self

    def new_rows_mask(self) -> torch.Tensor:
        """True at the cache rows ``[num_blocks, 1, num_layers, page_size, 1]`` the op updates.

        On a shard's cache: the rows of the new positions the shard holds, at their slots.
        """
        touched = torch.zeros(self.cache.blocks.shape[:-1], dtype=torch.bool)
        page_size = self.cache.page_size
        shard = self.cache.shard
        for b, pos in self.new_positions():
            if not shard.owns(pos):
                continue
            slot = shard.local_count(pos)
            page = self.cache.pages_of(b)[slot // page_size]
            touched[page, 0, self.layer_idx, slot % page_size, 0] = True
        return touched

    def take_new_rows(self, seed: int) -> torch.Tensor:
        """The new tokens' raw rows ``[T, R + Dr]``, as the op's ``new_rows`` input.

        Their cache slots are overwritten with other random values, so only a
        kernel that stores ``new_rows`` gets them right. The whole cache only.
        """
        if not self.cache.shard.whole:
            raise ValueError("take_new_rows: expected a case on the whole cache, got a shard")
        mask = self.new_rows_mask()
        cache = self.cache
        rows = torch.cat(
            [cache.rows(b, self.layer_idx, pos, pos + 1) for b, pos in self.new_positions()]
            + [torch.empty(0, cache.head_dim, dtype=cache.dtype, device=cache.device)]
        )
        g = torch.Generator().manual_seed(seed)
        noise = torch.randn(int(mask.sum()), cache.head_dim, generator=g)
        cache.blocks[mask] = stored(noise, cache.blocks, cache.kv_lora_rank)
        return rows.clone()

    def new_positions(self) -> list[tuple[int, int]]:
        """(request, position) of every new token."""
        offsets = self.input_row_offsets.tolist()
        return [
            (b, self.cache.length(b) + i)
            for b in range(len(offsets) - 1)
            for i in range(offsets[b + 1] - offsets[b])
        ]


def make_case(
    seed: int,
    *,
    dtype: torch.dtype = torch.bfloat16,
    num_heads: int = 16,
    page_size: int = 16,
    cache_lengths: tuple[int, ...] = (5, 40, 0),
    new_tokens: tuple[int, ...] = (1, 2, 3),
    num_layers: int = 2,
    layer_idx: int = 1,
    granularity: ScaleGranularity | str = "blockwise",
    mask: str = "causal",
    score_mod: str = "no_pos",
    local_window_size: int = 0,
    kv_lora_rank: int = 512,
    nope_dim: int = 128,
    rope_dim: int = 64,
    v_head_dim: int = 128,
    extra_rows: int = 7,
    freqs: str = "random",
    shard: CacheShard | None = None,
    cache_format: str = "dtype",
) -> Case:
    """A fresh random case: every value is drawn from ``seed``, none is zero.

    ``freqs="random"`` draws a random rotation per position and pair;
    ``freqs="rope"`` uses the standard RoPE table (theta 10000). ``shard``:
    the case's cache holds that shard's positions (context-parallel decode);
    every value drawn is the same as without it, so the shards of a seed
    split the whole cache of that seed (same pool size, page order and
    rows), and ``options`` carries the shard. ``cache_format``: the cache's
    (:mod:`pymla.cache_format`; ``"fp8_ds_mla"`` with bfloat16).
    """
    g = torch.Generator().manual_seed(seed)
    granularity = ScaleGranularity.parse(granularity)
    total = sum(c + n for c, n in zip(cache_lengths, new_tokens, strict=True))
    num_blocks = total // page_size + 2 * len(cache_lengths) + 4
    cache = PagedLatentCache(
        num_blocks=num_blocks,
        page_size=page_size,
        num_layers=num_layers,
        dtype=dtype,
        kv_lora_rank=kv_lora_rank,
        qk_rope_head_dim=rope_dim,
        shuffle_pages=True,
        generator=g,
        shard=shard,
        cache_format=cache_format,
    )
    # Every slot of the pool holds random data, so a read or write of a wrong row shows.
    noise = torch.randn((*cache.blocks.shape[:-1], cache.head_dim), generator=g)
    cache.blocks.copy_(stored(noise, cache.blocks, kv_lora_rank))
    for length in cache_lengths:
        b = cache.add_request()
        cache.fill(b, length, generator=g)
    for b, n in enumerate(new_tokens):
        for layer in range(num_layers):
            rows = torch.randn(n, kv_lora_rank + rope_dim, generator=g) * 2 + 0.5
            cache.append(b, layer, rows)
    num_tokens = sum(new_tokens)
    offsets = torch.tensor([0, *torch.tensor(new_tokens).cumsum(0).tolist()], dtype=torch.int64)
    max_seq_len = max(c + n for c, n in zip(cache_lengths, new_tokens, strict=True)) + extra_rows
    if freqs == "rope":
        freqs_cis = rope_freqs_cis(max_seq_len, rope_dim)
    else:
        angles = torch.rand(max_seq_len, rope_dim // 2, generator=g) * 6.3
        freqs_cis = torch.stack([angles.cos(), angles.sin()], dim=-1).reshape(max_seq_len, rope_dim)
    weights = make_mla_weights(
        num_heads, kv_lora_rank, nope_dim, v_head_dim, granularity, generator=g
    )
    return Case(
        q=(torch.randn(num_tokens, num_heads, nope_dim + rope_dim, generator=g) * 1.5).to(dtype),
        input_row_offsets=offsets.to(torch.uint32),
        freqs_cis=freqs_cis.to(dtype),
        kv_norm_gamma=(1 + 0.25 * torch.randn(kv_lora_rank, generator=g)).to(dtype),
        cache=cache,
        layer_idx=layer_idx,
        weights=weights,
        options=dict(
            scale=default_scale(nope_dim, rope_dim) * (1 + 0.2 * torch.rand(1, generator=g).item()),
            epsilon=1e-6,
            scale_granularity=granularity,
            mask=mask,
            score_mod=score_mod,
            local_window_size=local_window_size,
            **({} if shard is None else {"shard": shard}),
        ),
    )


def reference_stages(
    case: Case, new_rows: torch.Tensor | None = None, **changes
) -> tuple[Stages, torch.Tensor]:
    """The reference's stages and its cache blocks after the call (the case is untouched).

    ``changes`` override options (tests use them to check that a wrong
    option is caught).
    """
    kv = KVCacheTensors(
        case.cache.blocks.clone(), case.cache.cache_lengths, case.cache.lookup_table
    )
    options = {**case.options, **changes}
    stages = mla_decode_branch_fp8_stages(*case.args(cache=kv), **options, new_rows=new_rows)
    return stages, kv.blocks


def run_reference(case: Case) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference output and the reference's cache blocks after the call (the case is untouched)."""
    stages, blocks = reference_stages(case)
    return stages.out, blocks
