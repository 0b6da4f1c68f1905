"""A torch-owned paged latent KV cache in MAX's MLA layout.

Storage
-------
``blocks [num_blocks, 1, num_layers, page_size, 1, head_dim]`` holds one
latent row (``kv_lora_rank`` latent values then ``qk_rope_head_dim`` rope
values, 576 for DeepSeek-V3) per token, per layer. With
``cache_format="fp8_ds_mla"`` (bfloat16 only) the blocks are ``uint8`` and a
row is 656 bytes (``kv_lora_rank`` e4m3 values, one float32 scale per 128 of
them, ``qk_rope_head_dim`` bfloat16 values; :mod:`pymla.cache_format`): rows
written to it are quantized by that module's rule, rows read from it
(:meth:`PagedLatentCache.rows`) are their exact bfloat16 values. Request ``b``'s token at
position ``p`` of layer ``l`` lives in
``blocks[lookup_table[b, p // page_size], 0, l, p % page_size, 0, :]``.

A cache made with a ``shard`` (:class:`pymla.CacheShard`, context-parallel
decode) holds only that shard's positions: position ``p`` of a request, when
the shard owns it, lives at local slot ``s = shard.local_count(p)``, in
page ``s // page_size`` of the request's pages. Every method still speaks
in sequence positions (rows for all positions go in; those of other shards
are dropped), so ranks given the same rows and generators hold disjoint
pieces of one cache.

``cache_lengths[b]`` counts the tokens of request ``b`` that earlier steps
completed. A decode step first writes its new tokens' rows at positions
``cache_lengths[b] ..`` (:meth:`PagedLatentCache.append`, once per layer),
runs the op on every layer, then calls :meth:`PagedLatentCache.advance`.

The batch of an op call is the cache's requests in order: request ``b`` is
row ``b`` of ``lookup_table`` and of ``cache_lengths``. Indices are stable:
:meth:`PagedLatentCache.release` empties a finished request in place (its
pages go back to the pool) rather than removing it.

Step bookkeeping
----------------
The op rotates and normalizes a layer's new rows in place, so each layer's
rows may be used by one op call per step. The cache records, per (request,
layer), whether :meth:`~PagedLatentCache.append` wrote the new rows raw this
step and whether an op call already rotated them
(:meth:`~PagedLatentCache.new_rows_state`); :meth:`~PagedLatentCache.advance`
clears it. :meth:`pymla.DecodePlan.run` and :func:`pymla.mla_decode_branch_fp8`
refuse (:class:`pymla.StaleCacheRowsError`) a layer whose rows are not raw.

Refusals
--------
Every method checks its arguments and the pool's capacity before it changes
anything: a refused call raises (TypeError for a wrong type or dtype,
ValueError for a wrong value or too few free pages) and leaves the blocks,
the tables, the pending counts, the free pages and the step bookkeeping as
they were.
"""

from __future__ import annotations

import torch

from . import host_memory
from .args import ACTIVATION_DTYPES
from .cache_format import (
    FP8_DS_MLA,
    FP8_STORAGE,
    FP8_VALUE_DTYPE,
    SCALE_BLOCK,
    dequantize_rows,
    parse_cache_format,
    row_width,
    write_rows,
)
from .options import as_bool, as_device, as_int
from .shard import CacheShard
from .validate import as_tensor
from .value_checks import UNUSED_PAGE

__all__ = ["UNUSED_PAGE", "PagedLatentCache"]


def _at_least(name: str, value: object, minimum: int) -> int:
    """An int argument >= ``minimum`` (not a bool, not a float)."""
    value = as_int(name, value)
    if value < minimum:
        raise ValueError(f"{name}: expected an int >= {minimum}, got {value}")
    return value


def _generator(generator: object) -> torch.Generator | None:
    """None or a CPU torch.Generator (the rows are drawn on the CPU)."""
    if generator is None:
        return None
    if not isinstance(generator, torch.Generator):
        raise TypeError(
            f"generator: expected a torch.Generator or None, got {type(generator).__name__}"
        )
    if generator.device.type != "cpu":
        raise ValueError(
            f"generator: expected a CPU torch.Generator, got one on {generator.device}"
        )
    return generator


class PagedLatentCache:
    """Paged latent cache whose tensors torch owns and the op updates in place.

    Args:
        num_blocks: pages in the pool (an int >= 1).
        page_size: tokens per page (any int >= 1).
        num_layers: layers stored per page (an int >= 1).
        dtype: element type: torch.bfloat16, torch.float16 or torch.float32 (the op's q dtype).
        cache_format: ``"dtype"`` (rows of ``dtype`` values) or ``"fp8_ds_mla"``
            (656-byte fp8 rows, ``dtype`` bfloat16 and ``kv_lora_rank`` a
            multiple of 128; :mod:`pymla.cache_format`).
        kv_lora_rank: latent width of a row (512 for DeepSeek-V3; an int >= 1).
        qk_rope_head_dim: rope width of a row (64 for DeepSeek-V3; an even int >= 2).
        device: where the tensors live (a torch.device or its name).
        shuffle_pages: hand out pages in a random order (as a long-running
            server would have them), from ``generator``.
        generator: a CPU torch.Generator for ``shuffle_pages``, or None.
        shard: the positions this cache holds (a :class:`pymla.CacheShard`;
            None: all of them).

    Raises:
        TypeError, ValueError: ``"<arg>: expected <what>, got <actual>"``.
    """

    def __init__(
        self,
        *,
        num_blocks: int,
        page_size: int,
        num_layers: int = 1,
        dtype: torch.dtype = torch.bfloat16,
        kv_lora_rank: int = 512,
        qk_rope_head_dim: int = 64,
        device: torch.device | str = "cpu",
        shuffle_pages: bool = False,
        generator: torch.Generator | None = None,
        shard: CacheShard | None = None,
        cache_format: str = "dtype",
    ) -> None:
        if shard is None:
            shard = CacheShard()
        if not isinstance(shard, CacheShard):
            raise TypeError(
                f"shard: expected a pymla.CacheShard or None, got {type(shard).__name__}"
            )
        self.shard = shard
        num_blocks = _at_least("num_blocks", num_blocks, 1)
        self.page_size = _at_least("page_size", page_size, 1)
        self.num_layers = _at_least("num_layers", num_layers, 1)
        self.kv_lora_rank = _at_least("kv_lora_rank", kv_lora_rank, 1)
        self.qk_rope_head_dim = _at_least("qk_rope_head_dim", qk_rope_head_dim, 2)
        if self.qk_rope_head_dim % 2:
            raise ValueError(
                f"qk_rope_head_dim: expected an even int (RoPE rotates pairs), got {qk_rope_head_dim}"
            )
        if not isinstance(dtype, torch.dtype) or dtype not in ACTIVATION_DTYPES:
            expected = ", ".join(str(d) for d in ACTIVATION_DTYPES)
            got = dtype if isinstance(dtype, torch.dtype) else type(dtype).__name__
            raise TypeError(f"dtype: expected one of {expected}, got {got}")
        self.cache_format = parse_cache_format(cache_format)
        if self.cache_format == FP8_DS_MLA:
            if dtype != FP8_VALUE_DTYPE:
                raise TypeError(
                    f"dtype: expected {FP8_VALUE_DTYPE} with cache_format 'fp8_ds_mla' (its rows "
                    f"read back as bfloat16 values), got {dtype}"
                )
            if self.kv_lora_rank % SCALE_BLOCK:
                raise ValueError(
                    f"kv_lora_rank: expected a multiple of {SCALE_BLOCK} with cache_format "
                    f"'fp8_ds_mla' (one float32 scale per {SCALE_BLOCK} latent values), got "
                    f"{self.kv_lora_rank}"
                )
        device = as_device("device", device)
        shuffle_pages = as_bool("shuffle_pages", shuffle_pages)
        generator = _generator(generator)
        self.head_dim = self.kv_lora_rank + self.qk_rope_head_dim
        self._dtype = dtype
        width = row_width(self.cache_format, self.kv_lora_rank, self.qk_rope_head_dim)
        storage = FP8_STORAGE if self.cache_format == FP8_DS_MLA else dtype
        self.blocks = host_memory.zeros(
            num_blocks, 1, num_layers, page_size, 1, width, dtype=storage, device=device
        )
        self.device = self.blocks.device
        order = (
            torch.randperm(num_blocks, generator=generator).tolist()
            if shuffle_pages
            else list(range(num_blocks))
        )
        self._free_pages = order[::-1]  # pop() hands out order[0] first
        self._pages: list[list[int]] = []
        self._lengths: list[int] = []
        self._pending: list[int] = []
        # Step bookkeeping, per layer: the requests whose new rows (n >= 1) append() wrote raw
        # since the last advance(), and those of them no op call has rotated yet (a subset).
        # DecodePlan tests a run's requests against one of these sets and updates _unrotated.
        self._appended: list[set[int]] = [set() for _ in range(self.num_layers)]
        self._unrotated: list[set[int]] = [set() for _ in range(self.num_layers)]
        self.cache_lengths = torch.zeros(0, dtype=torch.uint32, device=self.device)
        self.lookup_table = torch.zeros(0, 1, dtype=torch.uint32, device=self.device)

    # ------------------------------------------------------------------ requests
    @property
    def num_requests(self) -> int:
        return len(self._lengths)

    @property
    def num_free_pages(self) -> int:
        """Pages of the pool no request owns."""
        return len(self._free_pages)

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the rows' values and of the op that uses the cache (bfloat16 for fp8 rows)."""
        return self._dtype

    def _request(self, request: object) -> int:
        request = as_int("request", request)
        if not 0 <= request < self.num_requests:
            raise ValueError(f"request: expected 0 <= request < {self.num_requests}, got {request}")
        return request

    def _layer(self, layer: object) -> int:
        layer = as_int("layer", layer)
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer: expected 0 <= layer < {self.num_layers}, got {layer}")
        return layer

    def _rows(self, rows: object) -> torch.Tensor:
        """``rows [n, head_dim]`` of a floating dtype, converted to the cache's dtype and device."""
        as_tensor("rows", rows)
        if not rows.dtype.is_floating_point:
            raise TypeError(f"rows: expected a floating-point dtype, got {rows.dtype}")
        if rows.dim() != 2 or rows.shape[1] != self.head_dim:
            raise ValueError(f"rows: expected shape [n, {self.head_dim}], got {tuple(rows.shape)}")
        return rows.to(device=self.device, dtype=self.dtype)

    def _check_pending(self, request: int, n: int, name: str) -> None:
        """A step's layers all bring the same number of new tokens."""
        pending = self._pending[request]
        if pending not in (0, n):
            raise ValueError(
                f"{name}: expected {pending} tokens (request {request} already has {pending} "
                f"pending tokens this step), got {n}"
            )

    def _pages_to_take(self, request: int, total_tokens: int) -> int:
        """Pages ``request`` must take to hold ``total_tokens``; refuses if the pool has too few."""
        held = self.shard.local_count(total_tokens)
        needed = -(-held // self.page_size) - len(self._pages[request])
        if needed > len(self._free_pages):
            whose = "" if self.shard.whole else f" ({held} of them in this shard)"
            raise ValueError(
                f"request {request}: needs {needed} more page{'s' if needed != 1 else ''} of "
                f"{self.page_size} tokens for {total_tokens} tokens{whose}, {len(self._free_pages)} "
                f"free (num_blocks={self.blocks.shape[0]})"
            )
        return max(needed, 0)

    def _take_pages(self, request: int, count: int) -> None:
        """Gives ``request`` ``count`` free pages (checked by :meth:`_pages_to_take`)."""
        if count:
            self._pages[request].extend(self._free_pages.pop() for _ in range(count))
            self._sync_tables()

    def add_request(self) -> int:
        """Adds an empty request at the end of the batch; returns its index."""
        self._pages.append([])
        self._lengths.append(0)
        self._pending.append(0)
        self._sync_tables()
        return self.num_requests - 1

    def release(self, request: int) -> None:
        """Ends a finished request: its pages go back to the pool, it stays as an empty request.

        The request keeps its index (the other requests keep theirs: the batch
        is the cache's requests in order) with length 0, nothing pending and no
        pages; :meth:`fill` or :meth:`append` can start a new sequence in it.
        Refused for a request with pending tokens: a step that appended or
        reserved its rows is under way (its plan reads those pages); call
        :meth:`advance` first. A plan made before the release is stale: plan again.
        """
        request = self._request(request)
        if self._pending[request]:
            raise ValueError(
                f"request {request}: expected no pending tokens to release it (a step is under "
                f"way: call advance() first), got {self._pending[request]}"
            )
        self._free_pages.extend(reversed(self._pages[request]))  # its first page is next out
        self._pages[request] = []
        self._lengths[request] = 0  # not in the step bookkeeping: it holds pending requests only
        self._sync_tables()

    def length(self, request: int) -> int:
        """Tokens of ``request`` completed by earlier steps (its cache length)."""
        return self._lengths[self._request(request)]

    def pending(self, request: int) -> int:
        """New tokens of ``request`` appended or reserved this step, not yet advanced."""
        return self._pending[self._request(request)]

    def new_rows_state(self, request: int, layer: int) -> str:
        """What the cache holds of ``request``'s new rows in ``layer`` this step.

        ``"raw"``: :meth:`append` wrote them and no op call has run the layer
        since; ``"rotated"``: appended, then an op call rotated and normalized
        them in place; ``"none"``: nothing appended since the last
        :meth:`advance` (rows reserved for ``new_rows`` included).
        """
        request, layer = self._request(request), self._layer(layer)
        if request in self._unrotated[layer]:
            return "raw"
        return "rotated" if request in self._appended[layer] else "none"

    def append(self, request: int, layer: int, rows: torch.Tensor) -> None:
        """Writes the new tokens' latent rows of one layer after the request's cached tokens.

        ``rows [n, head_dim]`` (any floating dtype, converted to the cache's)
        land at positions ``length(request) .. + n - 1``; the request takes
        the pages they need from the pool. Every layer of a step must append
        the same number of rows; the op then rotates and normalizes them in
        place, once (see the module's step bookkeeping). Appending a layer
        again in the same step overwrites its rows and makes them raw again.
        Call :meth:`advance` when the step is done.
        """
        request, layer = self._request(request), self._layer(layer)
        rows = self._rows(rows)
        n = rows.shape[0]
        self._check_pending(request, n, "rows")
        start = self._lengths[request]
        self._take_pages(request, self._pages_to_take(request, start + n))
        self._pending[request] = n
        self._write(request, layer, start, rows)
        if n:  # no rows, nothing to rotate: a later reserve() must not find them "raw"
            self._appended[layer].add(request)
            self._unrotated[layer].add(request)

    def reserve(self, request: int, n: int) -> None:
        """Makes room for ``n`` new tokens of ``request`` without writing their rows.

        For steps whose rows reach the op as ``new_rows`` (the op writes them
        into these slots, so running a layer again with them is harmless);
        they count as pending until :meth:`advance`.
        """
        request = self._request(request)
        n = _at_least("n", n, 0)
        self._check_pending(request, n, "n")
        self._take_pages(request, self._pages_to_take(request, self._lengths[request] + n))
        self._pending[request] = n

    def write(self, request: int, layer: int, start: int, rows: torch.Tensor) -> None:
        """Writes ``rows`` at positions ``start ..`` of pages the request already owns.

        A plain write: it takes no pages and changes no bookkeeping (a step's
        new rows go through :meth:`append`).
        """
        request, layer = self._request(request), self._layer(layer)
        start = _at_least("start", start, 0)
        rows = self._rows(rows)
        capacity = len(self._pages[request]) * self.page_size
        if self.shard.local_count(start + rows.shape[0]) > capacity:
            raise ValueError(
                f"start: expected start + {rows.shape[0]} rows <= {capacity} (the "
                f"{len(self._pages[request])} pages of {self.page_size} tokens request {request} "
                f"owns), got {start} + {rows.shape[0]} = {start + rows.shape[0]}"
            )
        self._write(request, layer, start, rows)

    def _write(self, request: int, layer: int, start: int, rows: torch.Tensor) -> None:
        """``write`` on checked arguments (rows already in the cache's dtype and device).

        ``rows`` are those of positions ``start ..``; the shard's own land in the cache.
        """
        page_ids, slots, owned = self._slots(request, start, start + rows.shape[0])
        if not self.shard.whole:
            rows = rows[owned.to(rows.device)]
        write_rows(self.blocks, (page_ids, 0, layer, slots, 0), rows, self.kv_lora_rank)

    def _slots(
        self, request: int, start: int, stop: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(block, row in block) of the shard's positions in ``start .. stop - 1``, on the device.

        Also which of the positions ``start .. stop - 1`` the shard holds (a bool mask).
        """
        pos = torch.arange(start, stop)
        owned = self.shard.owns(pos)
        slot = self.shard.local_count(pos[owned])
        page_ids = torch.tensor(self._pages[request], dtype=torch.long)[slot // self.page_size]
        return page_ids.to(self.device), (slot % self.page_size).to(self.device), owned

    def rows(
        self, request: int, layer: int, start: int = 0, stop: int | None = None
    ) -> torch.Tensor:
        """A copy of the request's rows at positions ``start .. stop - 1`` (default: all written).

        ``[n, kv_lora_rank + qk_rope_head_dim]`` in :attr:`dtype`: for an
        ``fp8_ds_mla`` cache the rows' exact bfloat16 values (e4m3 times the
        scale; :meth:`stored_rows` has their bytes).
        ``0 <= start <= stop <= length(request) + pending(request)``. A
        shard's cache returns the rows of the positions it holds, in order.
        """
        stored = self.stored_rows(request, layer, start, stop)
        if self.cache_format == FP8_DS_MLA:
            return dequantize_rows(stored, self.kv_lora_rank).to(self.dtype)
        return stored

    def stored_rows(
        self, request: int, layer: int, start: int = 0, stop: int | None = None
    ) -> torch.Tensor:
        """As :meth:`rows`, but as stored: ``[n, blocks.shape[-1]]``, the 656 bytes of fp8 rows."""
        request, layer = self._request(request), self._layer(layer)
        written = self._lengths[request] + self._pending[request]
        start = as_int("start", start)
        stop = written if stop is None else as_int("stop", stop)
        for name, value, low in (("start", start, 0), ("stop", stop, start)):
            if not low <= value <= written:
                raise ValueError(
                    f"{name}: expected {low} <= {name} <= {written} (request {request}'s cached + "
                    f"pending tokens), got {value}"
                )
        page_ids, slots, _ = self._slots(request, start, stop)
        return self.blocks[page_ids, 0, layer, slots, 0, :]

    def advance(self) -> None:
        """Ends a step: every request's pending tokens join its cached tokens.

        Also clears the step bookkeeping: the next step's rows are appended afresh.
        """
        for b, n in enumerate(self._pending):
            self._lengths[b] += n
            self._pending[b] = 0
        for layer_sets in (self._appended, self._unrotated):
            for requests in layer_sets:
                requests.clear()
        self._sync_tables()

    def fill(self, request: int, num_tokens: int, generator: torch.Generator | None = None) -> None:
        """Gives ``request`` ``num_tokens`` completed tokens of random rows in every layer.

        Between steps only: refused for a request with pending tokens.
        """
        request = self._request(request)
        num_tokens = _at_least("num_tokens", num_tokens, 0)
        generator = _generator(generator)
        if self._pending[request]:
            raise ValueError(
                f"request {request}: expected no pending tokens to fill it (fill adds completed "
                f"tokens: call advance() first), got {self._pending[request]}"
            )
        start = self._lengths[request]
        count = self._pages_to_take(request, start + num_tokens)
        layers = [
            torch.randn(num_tokens, self.head_dim, generator=generator)
            for _ in range(self.num_layers)
        ]
        self._take_pages(request, count)
        for layer, rows in enumerate(layers):
            self._write(request, layer, start, rows.to(device=self.device, dtype=self.dtype))
        self._lengths[request] += num_tokens
        self._sync_tables()

    # ------------------------------------------------------------------ tensors
    def _sync_tables(self) -> None:
        width = max([1] + [len(p) for p in self._pages])
        table = torch.full((self.num_requests, width), UNUSED_PAGE, dtype=torch.int64)
        for b, pages in enumerate(self._pages):
            table[b, : len(pages)] = torch.tensor(pages, dtype=torch.int64)
        self.lookup_table = table.to(torch.uint32).to(self.device)
        self.cache_lengths = (
            torch.tensor(self._lengths, dtype=torch.int64).to(torch.uint32).to(self.device)
        )

    def to(self, device: str | torch.device) -> PagedLatentCache:
        """Moves the cache's tensors to ``device``; returns the cache (like ``nn.Module.to``)."""
        blocks = self.blocks.to(as_device("device", device))
        self.blocks, self.device = blocks, blocks.device
        self._sync_tables()
        return self

    def pages_of(self, request: int) -> list[int]:
        """The block indices request ``request`` owns, in position order."""
        return list(self._pages[self._request(request)])
