"""What :func:`pymla.plan` checks once per decode step, before it makes a :class:`~pymla.DecodePlan`.

The step's metadata tensors (ranks, dtypes, devices, the shapes they must
agree on), the cache's shard, and with the value checks the values the
kernel indexes with (:mod:`pymla.value_checks`, called through the module)
and the stale-row tracking of a :class:`~pymla.PagedLatentCache`.
"""

from __future__ import annotations

import torch

from . import validate as v
from . import value_checks
from .args import BY_NAME, KVCacheTensors
from .cache import PagedLatentCache
from .cache_format import FP8_STORAGE, fp8_kv_lora_rank
from .options import DecodeOptions, as_bool


def cache_tensors(cache: PagedLatentCache | KVCacheTensors | tuple) -> KVCacheTensors:
    """The (blocks, cache_lengths, lookup_table) of a cache object or triple."""
    if isinstance(cache, PagedLatentCache):
        return KVCacheTensors(cache.blocks, cache.cache_lengths, cache.lookup_table)
    if isinstance(cache, tuple) and len(cache) == 3:
        if not all(isinstance(t, torch.Tensor) for t in cache):
            types = ", ".join(type(t).__name__ for t in cache)
            raise TypeError(
                f"cache: expected a (blocks, cache_lengths, lookup_table) tuple of tensors, got ({types})"
            )
        return KVCacheTensors(*cache)
    raise TypeError(
        f"cache: expected a PagedLatentCache or a (blocks, cache_lengths, lookup_table) tuple, got {type(cache).__name__}"
    )


def check_step(
    cache: PagedLatentCache | KVCacheTensors,
    input_row_offsets: torch.Tensor,
    freqs_cis: torch.Tensor,
    options: DecodeOptions,
    *,
    new_rows: bool,
    check_values: bool,
    num_tokens: int | None,
    rerun_layers: bool,
) -> tuple[KVCacheTensors, int, dict]:
    """:func:`pymla.plan`'s checks (its arguments); returns the cache's tensors, the step's
    token count and the :class:`~pymla.DecodePlan` keywords of the stale-row tracking."""
    kv = cache_tensors(cache)
    if not isinstance(options, DecodeOptions):
        raise TypeError(f"options: expected a pymla.DecodeOptions, got {type(options).__name__}")
    if isinstance(cache, PagedLatentCache) and cache.shard != options.shard:
        raise ValueError(
            f"options: expected the cache's shard {cache.shard} (a PagedLatentCache holds the "
            f"positions of one shard), got shard {options.shard}"
        )
    as_bool("rerun_layers", rerun_layers)
    tracking = {}  # the stale-row tracking of a PagedLatentCache, set up with the value checks
    tensors = {
        "input_row_offsets": input_row_offsets,
        "freqs_cis": freqs_cis,
        "kv_blocks": kv.blocks,
        "cache_lengths": kv.cache_lengths,
        "lookup_table": kv.lookup_table,
    }
    for name, t in tensors.items():
        arg = BY_NAME[name]
        note = " (fp8_ds_mla rows)" if name == "kv_blocks" else ""
        v.check_tensor(name, t, rank=arg.rank, dtypes=arg.torch_dtypes(), dtype_note=note)
    device = v._agree_attr("device", tensors, ValueError)
    v.check_shard_device(options.shard, options.score_mod, device)
    fp8_cache = kv.blocks.dtype == FP8_STORAGE  # rows in the fp8_ds_mla format
    if fp8_cache:
        v.check_cache_format(kv.blocks, freqs_cis.dtype)
    else:
        v._agree_attr("dtype", {"freqs_cis": freqs_cis, "kv_blocks": kv.blocks}, TypeError)
    rope_dim = freqs_cis.shape[1]
    if rope_dim < 2 or rope_dim % 2:
        raise ValueError(
            f"freqs_cis: expected an even qk_rope_head_dim >= 2 in dim 1, got {rope_dim} "
            f"(shape {tuple(freqs_cis.shape)})"
        )
    v.check_shape(
        "kv_blocks",
        kv.blocks,
        (None, 1, None, None, 1, None),
        "[num_blocks, 1, num_layers, page_size, 1, kv_lora_rank + qk_rope_head_dim]",
    )
    if fp8_cache:
        fp8_rank = fp8_kv_lora_rank(kv.blocks.shape[5], rope_dim)
        if fp8_rank is None:
            raise ValueError(
                f"kv_blocks: expected fp8_ds_mla rows of kv_lora_rank + kv_lora_rank / 32 + 2 * "
                f"qk_rope_head_dim {rope_dim} bytes, kv_lora_rank a multiple of 128, in dim 5, "
                f"got {kv.blocks.shape[5]}"
            )
        v.check_fp8_gpu_sizes(fp8_rank, rope_dim, device)
    if kv.blocks.shape[5] <= rope_dim:
        raise ValueError(
            f"kv_blocks: expected kv_lora_rank + qk_rope_head_dim {rope_dim} > {rope_dim} in dim 5, "
            f"got {kv.blocks.shape[5]}"
        )
    v._at_least("kv_blocks", kv.blocks, 3, "page_size")
    num_requests = v._agree_size(
        "num_requests",
        [
            v._Size("input_row_offsets", input_row_offsets, 0, 1, "{} + 1"),
            v._Size("cache_lengths", kv.cache_lengths, 0),
            v._Size("lookup_table", kv.lookup_table, 0),
        ],
    )
    if num_requests < 0:
        raise ValueError(
            "input_row_offsets: expected shape [num_requests + 1] (at least [0]), got an empty tensor"
        )
    if check_values:
        value_checks._check_no_overlap({"kv_blocks": kv.blocks}, tensors)
        offsets = value_checks.check_positions(
            input_row_offsets,
            kv.cache_lengths,
            kv.lookup_table,
            num_tokens=None,
            max_seq_len=freqs_cis.shape[0],
            num_blocks=kv.blocks.shape[0],
            page_size=kv.blocks.shape[3],
            shard=options.shard,
        )
        if isinstance(cache, PagedLatentCache):
            tracking = dict(
                _cache=cache,
                _new_requests=value_checks.check_pending_rows(
                    cache, offsets, new_rows_given=new_rows
                ),
                _rerun_layers=rerun_layers,
            )
        if num_tokens is not None and num_tokens != int(offsets[-1]):
            raise ValueError(
                f"num_tokens: expected input_row_offsets[-1] = {int(offsets[-1])}, got {num_tokens}"
            )
        num_tokens = int(offsets[-1])
    elif num_tokens is None:
        num_tokens = int(input_row_offsets[-1])  # a device-to-host copy on a GPU
    return kv, num_tokens, tracking
