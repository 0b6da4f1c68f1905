"""Plan once per decode step, run once per layer.

    weights = [pymla.LayerWeights(w_uk, w_uk_scale, w_uv, w_uv_scale, gamma) for ...]  # once
    step = pymla.plan(cache, input_row_offsets, freqs_cis, pymla.DecodeOptions(scale=s))
    for layer in range(num_layers):
        out = step.run(q[layer], layer, weights[layer])
    cache.advance()

:func:`plan` checks every value the kernel indexes with, once per step
(offsets, cache lengths, lookup table, positions against freqs_cis and the
pages, the rows appended to a :class:`~pymla.PagedLatentCache`), and wraps
the step's tensors for MAX once, into the kernel's argument list (the checks: :mod:`pymla.step_checks`;
the list: :func:`pymla.buffers.step_template`). :class:`LayerWeights` checks and wraps one layer's weights once.
:meth:`DecodePlan.run` checks only the shapes, dtypes and devices of what it is
given, puts q, out (and the optional tensors) and the weights' buffers into a
copy of that list, and launches: no device-to-host copy, no host
synchronization (see :mod:`pymla.runtime`). The one-shot
:func:`pymla.mla_decode_branch_fp8` and the torch op's body launch through a
plan too (:meth:`DecodePlan._launch`, which under ``torch.compile`` calls the
torch op instead).

The plan holds the step's tensors, not copies: a serving loop that keeps
them at fixed addresses and updates them in place can re-plan (to check the
new values) and replay a CUDA graph captured from ``run`` calls.
"""

from __future__ import annotations

import torch

from . import bridge, runtime, value_checks
from . import validate as v
from .args import ALL_STEPS, STEP_6_ONLY, KVCacheTensors, call_torch_op
from .buffers import run_buffers, step_template
from .cache import PagedLatentCache
from .cache_format import format_of, kv_lora_rank_of, value_dtype
from .options import DecodeOptions, as_int
from .step_checks import cache_tensors as cache_tensors  # re-exported: pymla.plan.cache_tensors
from .step_checks import check_step
from .weights import LayerWeights, dim_or_zero


class DecodePlan:
    """One decode step's checked metadata and MAX buffers; :meth:`run` once per layer.

    Made by :func:`plan`. A plan of a :class:`~pymla.PagedLatentCache` made
    with value checks tracks the cache's new rows per layer (see :meth:`run`).
    """

    def __init__(
        self,
        kv: KVCacheTensors,
        input_row_offsets: torch.Tensor,
        freqs_cis: torch.Tensor,
        options: DecodeOptions,
        *,
        num_tokens: int,
        new_rows: bool,
        _op_check_values: bool = False,
        _cache: PagedLatentCache | None = None,
        _new_requests: frozenset[int] = frozenset(),
        _rerun_layers: bool = False,
        _launch_now: bool = False,
    ) -> None:
        self.kv = kv
        self.input_row_offsets = input_row_offsets
        self.freqs_cis = freqs_cis
        self.options = options
        self.num_tokens = num_tokens
        self.needs_new_rows = new_rows
        self.dtype = value_dtype(kv.blocks)  # the op's (bfloat16 for fp8_ds_mla rows)
        self.cache_dtype = kv.blocks.dtype
        self.cache_format = format_of(kv.blocks)  # "dtype" or "fp8_ds_mla" (uint8 blocks)
        self.device = kv.blocks.device
        self.rope_dim = dim_or_zero(freqs_cis, 1)
        self.kv_lora_rank = (
            kv_lora_rank_of(kv.blocks, self.rope_dim) or 0 if kv.blocks.dim() == 6 else 0
        )
        self.num_layers = dim_or_zero(kv.blocks, 2)
        # The torch op's check_values when this plan is traced by torch.compile: False for
        # plan() (it checked, or was told not to); the one-shot call's when it made the plan.
        self._op_check_values = _op_check_values
        self._compat = (self.dtype, self.device, self.kv_lora_rank)
        self.model = None  # compiled on the first run with tokens
        self._launch_fn = None  # runtime.launcher(model, device), made with the model
        self._template: list | None = None  # ARGS-ordered buffers, the step's filled in
        self._dl_device = bridge.dlpack_device(self.device)
        # Made for one launch right away (the one-shot call, the torch op's body): the step's
        # tensors are wrapped without DLPack's stream ordering (buffers.max_buffers).
        self._launch_now = _launch_now
        self._kv_span: tuple[int, int] | None = None  # kv_blocks' bytes, read on the first run
        # Stale-row tracking (plan() of a PagedLatentCache with check_values): the requests
        # with new tokens must be in the cache's per-layer set run() tests (appended raw, and
        # with rerun_layers=False not rotated yet); each launch marks them rotated.
        self._tracked = _cache
        self._new_requests = _new_requests
        self._rows_unrotated = None if _cache is None else _cache._unrotated
        self._rows_tested = self._rows_unrotated
        if _rerun_layers and _cache is not None:
            self._rows_tested = _cache._appended
        if not torch.compiler.is_compiling():  # traced by torch.compile: wrapped when run eagerly
            self._prepare()

    def _prepare(self) -> list:
        """The kernel's argument list with the step's buffers in place (made once)."""
        self._template = step_template(
            self.input_row_offsets, self.freqs_cis, self.kv, self.options, self.dtype, self.device,
            self._dl_device if self._launch_now else None,
        )  # fmt: skip
        return self._template

    # ------------------------------------------------------------------ run

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
        """The op on one layer: ``out [T, H, v_head_dim]`` (``out`` when given).

        ``attention_out [T, H, kv_lora_rank]`` (the cache's dtype) receives
        step 5's result, ``lse [T, H]`` (float32) the natural log-sum-exp of
        each row's scaled scores (mask and score mod applied); a row that
        sees no key (possible only on a shard of the cache) gets ``-inf`` and
        a zero attention output. Checks shapes, dtypes and devices only; the step's values were checked
        by :func:`plan`. A plan of a :class:`~pymla.PagedLatentCache` made with
        ``check_values`` also refuses (:class:`pymla.StaleCacheRowsError`,
        before anything runs) a layer whose new rows are not raw in the cache:
        never appended for this layer, or rotated by an earlier run of it in
        this step (unless the plan was made with ``rerun_layers=True``). A run
        that returns marks the layer's rows rotated. A run given ``new_rows``
        is never refused (the op writes those rows into the slots itself, so
        repeating it is harmless) and marks the layer rotated too. Not tracked
        at all: plans of the cache's bare tensors (they carry no bookkeeping)
        or made with ``check_values=False``, and runs traced by
        ``torch.compile`` (Python runs only while tracing, so the compiled
        graph's replays are never checked).
        """
        return self._run(q, layer, weights, out, attention_out, new_rows, lse, project=True)

    def attend(
        self,
        q: torch.Tensor,
        layer: int,
        weights: LayerWeights,
        attention_out: torch.Tensor | None = None,
        lse: torch.Tensor | None = None,
        new_rows: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Steps 1 to 5 on one layer: ``(attention_out [T, H, kv_lora_rank], lse [T, H])``.

        The op without step 6, for a rank of context-parallel decode
        (:mod:`pymla.distributed`), which merges the ranks' partial results
        with their LSE (:func:`pymla.merge_attention_states`) and projects the
        merged one. Checks and tracking as :meth:`run`'s.
        """
        tokens, heads = self.num_tokens, getattr(weights, "num_heads", 0)
        if attention_out is None:
            attention_out = torch.empty(
                (tokens, heads, self.kv_lora_rank), dtype=self.dtype, device=self.device
            )
        if lse is None:
            lse = torch.empty((tokens, heads), dtype=torch.float32, device=self.device)
        self._run(q, layer, weights, None, attention_out, new_rows, lse, project=False)
        return attention_out, lse

    def project(
        self,
        attention: torch.Tensor,
        q: torch.Tensor,
        layer: int,
        weights: LayerWeights,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Step 6 alone: ``out [T, H, v_head_dim] = rnd(fp8mm(attention, w_uv))``.

        ``attention [T, H, kv_lora_rank]`` (the cache's dtype) is an
        attention output (a context-parallel rank's merged one); ``q`` the
        step's (its shape sizes the call; its values are not read). Reads
        nothing of the cache and changes nothing of it (no row tracking).
        """
        if type(weights) is not LayerWeights or weights._compat != self._compat:
            self._check_weights(weights)
        tokens, heads = self.num_tokens, weights.num_heads
        self._check_call("q", q, (tokens, heads, weights.nope_dim + self.rope_dim))
        self._check_call("attention", attention, (tokens, heads, self.kv_lora_rank))
        shape = (tokens, heads, weights.v_head_dim)
        if out is None:
            out = torch.empty(shape, dtype=self.dtype, device=self.device)
        else:
            self._check_call("out", out, shape)
            if v.spans_overlap(v.byte_span(out), v.byte_span(attention)):
                raise ValueError(
                    "out: expected memory of its own (the op writes it), got a tensor "
                    "overlapping attention"
                )
        layer = self._layer(layer)
        self._launch(q, layer, weights, out, attention, None, None, first_step=STEP_6_ONLY)
        return out

    def _layer(self, layer: object) -> int:
        """``layer`` checked against the cache's layers."""
        if not (type(layer) is int and 0 <= layer < self.num_layers):
            layer = as_int("layer_idx", layer)
            if not 0 <= layer < self.num_layers:
                raise ValueError(
                    f"layer_idx: expected 0 <= layer_idx < {self.num_layers} (kv_blocks' num_layers), got {layer}"
                )
        return layer

    def _run(self, q, layer, weights, out, attention_out, new_rows, lse, *, project):
        if type(weights) is not LayerWeights or weights._compat != self._compat:
            self._check_weights(weights)
        tokens, heads = self.num_tokens, weights.num_heads
        self._check_call("q", q, (tokens, heads, weights.nope_dim + self.rope_dim))
        layer = self._layer(layer)
        shape = (tokens, heads, weights.v_head_dim)
        if not project:
            out_span = None
        elif out is None:
            out = torch.empty(shape, dtype=self.dtype, device=self.device)
            out_span = None  # fresh memory: overlaps nothing
        else:
            self._check_call("out", out, shape)
            out_span = v.byte_span(out)
        if attention_out is not None:
            self._check_call("attention_out", attention_out, (tokens, heads, self.kv_lora_rank))
        if lse is not None:
            self._check_call("lse", lse, (tokens, heads), torch.float32)
        if new_rows is not None:
            self._check_call("new_rows", new_rows, (tokens, self.kv_lora_rank + self.rope_dim))
        elif self.needs_new_rows:
            raise ValueError(
                "new_rows: expected a tensor (the plan was made with new_rows=True), got None"
            )
        if out_span is not None or attention_out is not None or lse is not None:
            self._check_written(q, out_span, attention_out, new_rows, lse)
        self._launch(q, layer, weights, out, attention_out, new_rows, lse)
        return out

    def _check_written(self, q, out_span, attention_out, new_rows, lse=None) -> None:
        """The tensors the op writes share no memory with what it reads or writes otherwise."""
        if self._kv_span is None:
            self._kv_span = v.byte_span(self.kv.blocks)
        reads = [("q", v.byte_span(q)), ("kv_blocks", self._kv_span)]
        if new_rows is not None:
            reads.insert(1, ("new_rows", v.byte_span(new_rows)))
        written = [("out", out_span)]
        if attention_out is not None:
            written.append(("attention_out", v.byte_span(attention_out)))
        if lse is not None:
            written.append(("lse", v.byte_span(lse)))
        for name, span in written:
            if span is None:
                continue
            for other, other_span in reads:
                if v.spans_overlap(span, other_span):
                    raise ValueError(
                        f"{name}: expected memory of its own (the op writes it), got a tensor overlapping {other}"
                    )
        for i, (name, span) in enumerate(written):
            for other, other_span in written[i + 1 :]:
                if span is not None and v.spans_overlap(span, other_span):
                    raise ValueError(
                        f"{name}: expected memory of its own (the op writes it), got a tensor "
                        f"overlapping {other}"
                    )

    def _check_call(
        self, name: str, t: object, shape: tuple[int, ...], dtype: torch.dtype | None = None
    ) -> None:
        dtype = self.dtype if dtype is None else dtype
        if not (
            type(t) is torch.Tensor
            and t.dtype == dtype
            and t.device == self.device
            and t.shape == shape
            and t.is_contiguous()
        ):
            v.as_tensor(name, t)
            v.check_tensor(
                name,
                t,
                rank=len(shape),
                dtypes=(dtype,),
                device=self.device,
                dtype_note=" (the cache's dtype)" if dtype == self.dtype else "",
            )
            v.check_shape(name, t, shape, "from the plan and the weights")

    def _check_weights(self, weights: LayerWeights) -> None:
        if not isinstance(weights, LayerWeights):
            raise TypeError(f"weights: expected a pymla.LayerWeights, got {type(weights).__name__}")
        for what, got, expected in (
            ("dtype", weights.dtype, self.dtype),
            ("device", weights.device, self.device),
            ("kv_lora_rank", weights.kv_lora_rank, self.kv_lora_rank),
        ):
            if got != expected:
                raise ValueError(f"weights: expected {what} {expected} (the cache's), got {got}")

    def _launch(
        self, q, layer, weights, out, attention_out, new_rows, lse=None, first_step=ALL_STEPS
    ) -> None:
        """The op on checked arguments: the torch op when traced by torch.compile, else MAX directly.

        The one path of every call: :meth:`run`, :meth:`attend`, :meth:`project`
        and the one-shot :func:`pymla.mla_decode_branch_fp8` (and the torch
        op's own body) end here. ``first_step`` 6: step 6 alone on
        ``attention_out`` (the cache neither read nor tracked).
        """
        if torch.compiler.is_compiling():  # no stale-row tracking: see run()
            call_torch_op(
                out=out,
                attention_out=attention_out,
                q=q,
                new_rows=new_rows,
                lse=lse,
                first_step=first_step,
                input_row_offsets=self.input_row_offsets,
                freqs_cis=self.freqs_cis,
                kv=self.kv,
                layer_idx=layer,
                options=self.options,
                granularity=weights.granularity,
                weights=weights.tensors,
                check_values=self._op_check_values,
            )
            return
        project_only = first_step == STEP_6_ONLY
        cache = None if project_only else self._tracked
        if cache is not None and new_rows is None:
            tested = self._rows_tested[layer]
            if not self._new_requests <= tested:
                stale = min(self._new_requests - tested)
                raise value_checks.stale_rows_error(cache, self.input_row_offsets, stale, layer)
        if self.num_tokens:
            launch = self._launch_fn
            if launch is None:
                launch = self._make_launcher()
            launch(self.buffers(q, layer, weights, out, attention_out, new_rows, lse, first_step))
        if cache is not None:  # launched: the layer's new rows are rotated now
            self._rows_unrotated[layer].difference_update(self._new_requests)
        # The tensors the op writes: their version counters move as the torch op's would.
        if out is not None:
            increment_version(out)
        if project_only:  # attention_out was read
            return
        increment_version(self.kv.blocks)
        if attention_out is not None:
            increment_version(attention_out)
        if lse is not None:
            increment_version(lse)

    def _make_launcher(self):
        if self.model is None:
            self.model = runtime.model_for(self.dtype, self.device, self.cache_dtype)
        self._launch_fn = runtime.launcher(self.model, self.device)
        return self._launch_fn

    def buffers(
        self,
        q,
        layer,
        weights,
        out,
        attention_out=None,
        new_rows=None,
        lse=None,
        first_step=ALL_STEPS,
    ) -> list:
        """The kernel's arguments as MAX buffers, in :data:`pymla.args.ARGS` order (no checks)."""
        template = self._template
        if template is None:
            template = self._prepare()
        indexed = weights._indexed
        if indexed is None:
            indexed = weights._prepare()
        return run_buffers(
            template,
            self._dl_device,
            indexed,
            q,
            layer,
            out,
            attention_out,
            new_rows,
            lse,
            first_step,
        )


increment_version = torch.autograd.graph.increment_version


def plan(
    cache: PagedLatentCache | KVCacheTensors,
    input_row_offsets: torch.Tensor,
    freqs_cis: torch.Tensor,
    options: DecodeOptions,
    *,
    new_rows: bool = False,
    check_values: bool = True,
    num_tokens: int | None = None,
    rerun_layers: bool = False,
) -> DecodePlan:
    """Checks one decode step's metadata and prepares it for :meth:`DecodePlan.run`.

    Args:
        cache: a :class:`pymla.PagedLatentCache` or its three tensors.
        input_row_offsets: uint32 ``[B + 1]``: request ``b`` owns rows
            ``input_row_offsets[b] .. input_row_offsets[b + 1] - 1`` of each layer's q.
        freqs_cis: ``[max_seq_len, qk_rope_head_dim]`` RoPE table in the cache's dtype.
        options: a :class:`DecodeOptions`.
        new_rows: each run() will pass the new tokens' raw rows as ``new_rows``
            (instead of their having been appended to the cache).
        check_values: check the values the kernel indexes with (copies the
            metadata to the host on a GPU). With a ``PagedLatentCache`` also
            checks that every request with new tokens has rows appended or
            reserved, and makes each run check that the rows of its layer are
            raw: appended for that layer and not yet rotated by an earlier run
            in this step (:class:`pymla.StaleCacheRowsError` otherwise; see
            :meth:`DecodePlan.run`). Without it, or with the cache's three
            tensors (which carry no bookkeeping), nothing of this is tracked.
        num_tokens: the step's token count (``input_row_offsets[-1]``); without
            it and without the value checks the plan reads it from the offsets.
        rerun_layers: for benchmarks and tests that run one layer again and
            again in a step: runs skip the "already rotated" check (the rows
            must still have been appended for the layer). Each rerun rotates
            and normalizes the layer's new rows in the cache once more, so the
            cache (and the output, which reads those rows) is no longer what
            one run per layer gives. Not for serving.

    Raises:
        TypeError, ValueError: as :func:`pymla.mla_decode_branch_fp8`.
    """
    kv, num_tokens, tracking = check_step(
        cache,
        input_row_offsets,
        freqs_cis,
        options,
        new_rows=new_rows,
        check_values=check_values,
        num_tokens=num_tokens,
        rerun_layers=rerun_layers,
    )
    return DecodePlan(
        kv,
        input_row_offsets,
        freqs_cis,
        options,
        num_tokens=num_tokens,
        new_rows=new_rows,
        **tracking,
    )
