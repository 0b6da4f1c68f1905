"""The best plain-torch formulation of the op we know, the benchmark's baseline.

Unlike :mod:`pymla.reference` (written for clarity, float32, a loop per
token), this is written for speed the way one would in a torch model: the
fp8 weights are dequantized once to the activation dtype, the projections
are batched einsums in that dtype, the paged keys of every request are
gathered with one indexing op into a padded batch, and attention is either
two batched matmuls or torch's fused ``scaled_dot_product_attention``
(whichever is faster is used). Query tokens per request must be equal.
Tensors may live on any one device (index math runs there too).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..quant import ScaleGranularity, dequantize_fp8
from ..reference import KVCacheTensors, alibi_slopes, rope_interleaved


class PlainTorchDecode:
    """Callable doing the op's six steps with plain torch ops, weights prepared once."""

    def __init__(
        self,
        w_uk: torch.Tensor,
        w_uk_scale: torch.Tensor,
        w_uv: torch.Tensor,
        w_uv_scale: torch.Tensor,
        *,
        dtype: torch.dtype,
        scale: float,
        epsilon: float = 1e-6,
        scale_granularity: ScaleGranularity = ScaleGranularity(1, 128, 128),  # noqa: B008
        score_mod: str = "no_pos",
        attention: str = "matmul",
    ) -> None:
        g = ScaleGranularity.parse(scale_granularity)
        self.w_uk = dequantize_fp8(w_uk, w_uk_scale, g.n, g.k).to(dtype)  # [H, R, Dn]
        self.w_uv = dequantize_fp8(w_uv, w_uv_scale, g.n, g.k).to(dtype)  # [H, Dv, R]
        self.scale, self.epsilon, self.dtype = scale, epsilon, dtype
        self.slopes = (
            alibi_slopes(w_uk.shape[0]).to(w_uk.device) if score_mod == "alibi_pos" else None
        )
        if attention not in ("matmul", "sdpa"):
            raise ValueError(f"attention: expected 'matmul' or 'sdpa', got {attention!r}")
        self.attention = attention

    def __call__(
        self,
        q: torch.Tensor,
        input_row_offsets: torch.Tensor,
        freqs_cis: torch.Tensor,
        kv_norm_gamma: torch.Tensor,
        cache: KVCacheTensors,
        layer_idx: int,
    ) -> torch.Tensor:
        blocks, lengths, table = cache
        num_tokens, num_heads, _ = q.shape
        num_requests = input_row_offsets.shape[0] - 1
        per_request = num_tokens // num_requests
        rank = self.w_uk.shape[1]
        nope = self.w_uk.shape[2]
        page_size = blocks.shape[3]
        dev = q.device
        lengths, table = lengths.to(torch.int64), table.to(torch.int64)

        # Steps 1-2: the new rows, rotated and normalized in place.
        new_pos = lengths[:, None] + torch.arange(per_request, device=dev)[None, :]  # [B, n]
        rows_idx = (table.gather(1, new_pos // page_size), new_pos % page_size)
        rows = blocks[rows_idx[0], 0, layer_idx, rows_idx[1], 0].float()  # [B, n, R + Dr]
        latent = rows[..., :rank]
        latent = (
            latent
            * torch.rsqrt(latent.square().mean(-1, keepdim=True) + self.epsilon)
            * kv_norm_gamma.float()
        )
        rope = rope_interleaved(rows[..., rank:], freqs_cis[new_pos].float())
        blocks[rows_idx[0], 0, layer_idx, rows_idx[1], 0] = torch.cat([latent, rope], -1).to(
            blocks.dtype
        )

        # Steps 1, 3, 4 on q.
        qb = q.view(num_requests, per_request, num_heads, -1)
        q_rope = rope_interleaved(
            qb[..., nope:].float(), freqs_cis[new_pos].float()[:, :, None, :]
        ).to(self.dtype)
        q_nope = torch.einsum("bthk,hrk->bthr", qb[..., :nope], self.w_uk)
        q_full = torch.cat([q_nope, q_rope], -1)  # [B, n, H, R + Dr]

        # Step 5: gather every request's keys into a padded batch, then attend.
        visible = lengths + per_request
        longest = int(visible.max())
        pos = torch.arange(longest, device=dev)
        pages = table.gather(
            1, (pos // page_size)[None, :].expand(num_requests, -1).clamp(max=table.shape[1] - 1)
        )
        keys = blocks[
            pages.clamp(min=0, max=blocks.shape[0] - 1), 0, layer_idx, (pos % page_size)[None, :], 0
        ]
        qpos = new_pos[:, :, None]  # [B, n, 1]
        allowed = pos[None, None, :] <= qpos  # causal, within the visible keys
        bias = torch.zeros(num_requests, per_request, longest, device=dev).masked_fill(
            ~allowed, -math.inf
        )
        q_rows = q_full.reshape(num_requests, per_request * num_heads, -1)  # rows (t, h)
        bias = bias.repeat_interleave(num_heads, dim=1)
        if self.slopes is not None:
            dist = (qpos - pos[None, None, :]).float().repeat_interleave(num_heads, dim=1)
            bias = bias - self.slopes.repeat(per_request)[None, :, None] * dist
        if self.attention == "sdpa":
            raw = F.scaled_dot_product_attention(
                q_rows[:, None],
                keys[:, None],
                keys[:, None, :, :rank],
                attn_mask=bias[:, None].to(self.dtype),
                scale=self.scale,
            )[:, 0]
        else:
            scores = (
                torch.baddbmm(bias, q_rows.float(), keys.float().transpose(1, 2), alpha=self.scale)
                if self.dtype == torch.float32
                else torch.bmm(q_rows, keys.transpose(1, 2)).float() * self.scale + bias
            )
            raw = torch.bmm(torch.softmax(scores, -1).to(self.dtype), keys[..., :rank])
        raw = raw.view(num_requests, per_request, num_heads, rank)

        # Step 6.
        out = torch.einsum("bthr,hvr->bthv", raw.to(self.dtype), self.w_uv)
        return out.reshape(num_tokens, num_heads, -1)
