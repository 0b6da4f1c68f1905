"""The checks that read tensor values: what the kernel indexes with, and the cache's new rows.

On a GPU each reads its tensors to the host (a device-to-host copy and a
synchronization), which is why a trusted serving loop may skip them
(``check_values=False``); the type, shape, dtype and device checks of
:mod:`pymla.validate` always run. Errors are in the form of that module
(``"<arg>: expected <what>, got <actual>"``); nothing here writes to a tensor.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:  # pymla.cache imports pymla.validate, which imports this module
    from .cache import PagedLatentCache

UNUSED_PAGE = 0xFFFFFFFF
"""The lookup-table entry of a page a request does not own (:mod:`pymla.cache` writes it)."""


def _span(t: torch.Tensor) -> tuple[int, int] | None:
    """A contiguous tensor's byte range, or None when it holds nothing."""
    nbytes = t.nbytes
    if nbytes == 0:
        return None
    start = t.data_ptr()
    return start, start + nbytes


def _check_no_overlap(written: dict[str, torch.Tensor], inputs: dict[str, torch.Tensor]) -> None:
    """The tensors the op writes (out, the cache blocks, attention_out) share memory with no other argument."""
    merged = [(other, t, _span(t)) for other, t in {**inputs, **written}.items()]
    spans = {other: theirs for other, _, theirs in merged}
    for name, target in written.items():
        mine = spans[name]
        if mine is None:
            continue
        for other, t, theirs in merged:
            if (
                theirs is not None
                and mine[0] < theirs[1]
                and theirs[0] < mine[1]
                and other != name
                and t is not target
                and t.device == target.device  # addresses compare on one device only
            ):
                raise ValueError(
                    f"{name}: expected memory of its own (the op writes it), got a tensor "
                    f"overlapping {other}"
                )


def _as_numpy(t: torch.Tensor) -> np.ndarray:
    """A small integer tensor as an int64 NumPy array on the host.

    The value checks run in NumPy: torch's own small ops would wake its
    OpenMP pool, whose spinning threads then compete with the kernel's.
    """
    if t.is_cpu and not t.requires_grad:
        return t.numpy().astype(np.int64)  # a third of the cost of torch's cast on a few values
    return t.to(torch.int64).cpu().numpy()


def _host_values(t: torch.Tensor) -> np.ndarray:
    """A tensor's values as a NumPy array on the host (no copy of a CPU tensor)."""
    if t.is_cpu and not t.requires_grad:
        return t.numpy()
    return t.detach().cpu().numpy()


def _first(mask: np.ndarray, value: bool = True) -> int | None:
    """The flat index of the first element of a boolean array equal to ``value``, None when none is.

    ``argmax`` (``argmin``) stops at the first True (False), at a sixth of the cost of
    ``any()`` (``all()``) on a few values.
    """
    if mask.size == 0:
        return None
    first = int(mask.argmax() if value else mask.argmin())
    return first if mask.flat[first] == value else None


def check_finite_scales(w_uk_scale: torch.Tensor, w_uv_scale: torch.Tensor) -> None:
    """Every weight scale is finite."""
    for name, scales in (("w_uk_scale", w_uk_scale), ("w_uv_scale", w_uv_scale)):
        values = _host_values(scales)
        bad = _first(np.isfinite(values), False)
        if bad is not None:
            index = tuple(int(v) for v in np.unravel_index(bad, values.shape))
            raise ValueError(
                f"{name}: expected finite scales, got {values[index]} at {list(index)}"
            )


def check_positions(
    input_row_offsets: torch.Tensor,
    cache_lengths: torch.Tensor,
    lookup_table: torch.Tensor,
    *,
    num_tokens: int | None,
    max_seq_len: int,
    num_blocks: int,
    page_size: int,
    shard=None,
) -> np.ndarray:
    """The values the kernel indexes with: offsets, positions, pages; returns the offsets.

    ``num_tokens`` None takes the offsets' last value as the token count (a
    plan's). ``shard`` (a :class:`pymla.CacheShard`; None: the whole cache):
    the pages hold only the shard's positions.
    """
    offsets = _as_numpy(input_row_offsets)
    first, last = int(offsets[0]), int(offsets[-1])
    if first != 0:
        raise ValueError(f"input_row_offsets: expected to start at 0, got {first}")
    steps = offsets[1:] - offsets[:-1]  # new tokens per request
    b = _first(steps < 0)
    if b is not None:
        raise ValueError(
            f"input_row_offsets: expected non-decreasing values, got {int(offsets[b])} then "
            f"{int(offsets[b + 1])} at request {b}"
        )
    if num_tokens is None:
        num_tokens = last
    if last != num_tokens:
        raise ValueError(
            f"input_row_offsets: expected to end at tot_seq_len = {num_tokens} (q's dim 0), "
            f"got {last}"
        )
    if steps.size == 0:
        return offsets
    lengths = _as_numpy(cache_lengths)
    ends = lengths + steps  # one past each request's last position
    worst = int(ends.argmax())
    end = int(ends[worst])
    if end > max_seq_len:
        raise ValueError(
            f"cache_lengths: expected cached + new tokens <= {max_seq_len} (freqs_cis' rows), got "
            f"{int(lengths[worst])} + {int(steps[worst])} = {end} for request {worst}"
        )
    sharded = shard is not None and not shard.whole
    held = np.asarray(shard.local_count(ends)) if sharded else ends  # ends: int64 already
    pages_needed = (held + (page_size - 1)) // page_size
    capacity = lookup_table.shape[1]
    b = int(pages_needed.argmax())
    pages = int(pages_needed[b])
    whose = f" ({int(held[b])} of them in shard {shard.rank})" if sharded else ""
    if pages > capacity:
        raise ValueError(
            f"lookup_table: expected >= {pages} pages per request (request {b} has "
            f"{int(lengths[b])} cached + {int(steps[b])} new tokens{whose} in pages of {page_size}), "
            f"got shape {tuple(lookup_table.shape)} (were its new rows appended to the cache?)"
        )
    table = _as_numpy(lookup_table)
    used = np.arange(capacity) < pages_needed[:, None]  # [request, page]
    # One test for both errors of a used entry: the marker or not a block (>= num_blocks). The
    # marker is the largest uint32, so both are the entries >= min(num_blocks, marker).
    if _first(used & (table >= min(num_blocks, UNUSED_PAGE))) is not None:
        _refuse_used_entries(table, used, lengths, steps, num_blocks, page_size, whose)
    if last > 1:  # fewer than two new tokens cannot share a row
        _check_distinct_new_rows(offsets, lengths, table, page_size, shard)
    return offsets


def _refuse_used_entries(
    table: np.ndarray,
    used: np.ndarray,
    lengths: np.ndarray,
    steps: np.ndarray,
    num_blocks: int,
    page_size: int,
    whose: str,
) -> None:
    """The error of a lookup-table entry a request uses: the unused-page marker, or not a block."""
    unowned = used & (table == UNUSED_PAGE)
    if unowned.any():
        b, p = (int(v) for v in np.argwhere(unowned)[0])
        raise ValueError(
            f"lookup_table: expected a page at [{b}, {p}] (request {b} has {int(lengths[b])} "
            f"cached + {int(steps[b])} new tokens{whose} in pages of {page_size}), got the unused-page "
            f"marker {UNUSED_PAGE:#x}: the request owns only {p} pages "
            "(were its new rows appended to the cache?)"
        )
    outside = used & (table >= num_blocks)
    if outside.any():
        b, p = (int(v) for v in np.argwhere(outside)[0])
        raise ValueError(
            f"lookup_table: expected entries < {num_blocks} (kv_blocks' num_blocks), "
            f"got {int(table[b, p])} at [{b}, {p}]"
        )


def _check_distinct_new_rows(
    offsets: np.ndarray, lengths: np.ndarray, table: np.ndarray, page_size: int, shard=None
) -> None:
    """Every new token's cache row belongs to it alone (the op rewrites those rows in place).

    With a ``shard``, the rows of the new tokens it holds, at their local slots.
    """
    steps = offsets[1:] - offsets[:-1]
    request = np.repeat(np.arange(steps.size), steps)
    position = lengths[request] + np.arange(request.size) - offsets[:-1][request]
    slot = position
    if shard is not None and not shard.whole:
        held = np.asarray(shard.owns(position), dtype=bool)
        request, position = request[held], position[held]
        slot = np.asarray(shard.local_count(position))
    if request.size < 2:
        return
    block = table[request, slot // page_size]
    row = block * page_size + slot % page_size
    ordered = np.sort(row)
    if _first(ordered[1:] == ordered[:-1]) is None:
        return  # the common case, at a fifth of np.unique's cost; the error below names the pair
    _, inverse, counts = np.unique(row, return_inverse=True, return_counts=True)
    shared = counts[inverse.reshape(-1)] > 1
    if shared.any():
        first = int(np.argmax(shared))
        second = int(np.flatnonzero(shared & (row == row[first]))[1])
        raise ValueError(
            f"lookup_table: expected a cache row of its own for each new token, got request "
            f"{int(request[first])} position {int(position[first])} and request "
            f"{int(request[second])} position {int(position[second])} both in block "
            f"{int(block[first])} row {int(slot[first]) % page_size}"
        )


class StaleCacheRowsError(ValueError):
    """The cache does not hold the raw rows of a request's new tokens in the layer run.

    The op rotates and normalizes the new rows in place, so it would work on
    whatever the cache holds at the new positions: stale rows of an earlier
    step, rows never written for this layer, or rows an earlier run of this
    layer in the same step already rotated (a second rotation is silently
    wrong). Append the rows (:meth:`pymla.PagedLatentCache.append`, once per
    layer and step), or pass them as ``new_rows`` (and reserve their slots
    with :meth:`~pymla.PagedLatentCache.reserve`).
    """


def check_pending_rows(
    cache: PagedLatentCache, offsets: np.ndarray, *, new_rows_given: bool
) -> frozenset[int]:
    """Each request's new tokens are the rows appended (or reserved) since its last advance().

    Returns the requests with new tokens, which each run then checks per
    layer (:func:`stale_rows_error`).
    """
    steps = offsets[1:] - offsets[:-1]
    for b in range(min(cache.num_requests, steps.size)):
        new, pending = int(steps[b]), cache.pending(b)
        if pending and new != pending:
            raise ValueError(
                f"input_row_offsets: expected {pending} new token{'s' if pending != 1 else ''} "
                f"for request {b} (the rows appended to the cache since its last advance()), "
                f"got {new}"
            )
        if new and not pending and not new_rows_given:
            raise StaleCacheRowsError(
                f"cache: request {b} has {new} new token{'s' if new != 1 else ''} but no rows "
                "appended since its last advance() (call cache.append(...) for this step, or "
                "pass new_rows= with slots from cache.reserve(...))"
            )
    return frozenset(steps.nonzero()[0].tolist())


def stale_rows_error(
    cache: PagedLatentCache, offsets: torch.Tensor, request: int, layer: int
) -> StaleCacheRowsError:
    """Why a run of ``layer`` may not use ``request``'s new rows (see ``new_rows_state``).

    ``offsets``: the run's ``input_row_offsets`` (read on this error path only).
    """
    if cache.new_rows_state(request, layer) == "rotated":
        return StaleCacheRowsError(
            f"cache: request {request}'s new rows of layer {layer} were already rotated by an "
            "earlier run in this step (another run would rotate them again); append them again "
            f"(cache.append({request}, {layer}, rows)) to redo the layer, or pass "
            "rerun_layers=True to repeat it on purpose"
        )
    start, stop = _as_numpy(offsets[request : request + 2])
    n = int(stop - start)
    return StaleCacheRowsError(
        f"cache: request {request} has {n} new token{'s' if n != 1 else ''} but no rows "
        f"appended for layer {layer} since its last advance() (call "
        f"cache.append({request}, {layer}, rows) before running layer {layer}, or pass new_rows=)"
    )
