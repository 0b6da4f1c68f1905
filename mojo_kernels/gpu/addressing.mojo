"""Device helpers shared by the GPU kernels: where a block's rows and keys are, and their masks."""

from ..spec import SCORE_MOD_ALIBI_POS, MaskSpec, alibi_slope
from ..common import U32Ptr


def find_request(offsets: Pointer[UInt32, MutUntrackedOrigin, address_space=_], num_requests: Int, t: Int) -> Int:
    """The request owning query row `t`: the largest `b` with `offsets[b] <= t`.

    Requests without new tokens share their offset with the next one and are
    never returned (`offsets[num_requests]` is the token count, above `t`).
    """
    var lo = 0
    var hi = num_requests
    while hi - lo > 1:
        var mid = (lo + hi) // 2
        if Int(offsets.unsafe_load(mid)) <= t:
            lo = mid
        else:
            hi = mid
    return lo


def slot_start(offsets: U32Ptr, b: Int, num_heads: Int, rows_per_block: Int) -> Int:
    """First attention slot (block) of request `b`.

    Request `b`'s rows `[o[b] H, o[b+1] H)` need `ceil(n_b H / rows_per_block)`
    blocks, never more than
    `floor(o[b+1] H / rows_per_block) - floor(o[b] H / rows_per_block) + 1`, so
    slots `[slot_start(b), slot_start(b + 1))` are enough; in all there are
    `floor(T H / rows_per_block) + B` slots (`attention_slots`).
    """
    return (Int(offsets.unsafe_load(b)) * num_heads) // rows_per_block + b


def attention_slots(num_tokens: Int, num_heads: Int, num_requests: Int, rows_per_block: Int) -> Int:
    """Grid size along x of an attention kernel (host side)."""
    return (num_tokens * num_heads) // rows_per_block + num_requests


def find_slot_request(offsets: U32Ptr, num_requests: Int, num_heads: Int, rows_per_block: Int, slot: Int) -> Int:
    """The largest `b` with `slot_start(b) <= slot` (strictly increasing in `b`)."""
    var lo = 0
    var hi = num_requests
    while hi - lo > 1:
        var mid = (lo + hi) // 2
        if slot_start(offsets, mid, num_heads, rows_per_block) <= slot:
            lo = mid
        else:
            hi = mid
    return lo


def row_attention_meta(
    row: Int, num_heads: Int, cache_length: Int, first_row: Int, visible: Int, mask: MaskSpec, score_mod: Int
) -> Tuple[Int, Int, Int, Float32]:
    """Key range `[lo, hi)`, sequence position and ALiBi slope of attention row `row = t * H + h`.

    `first_row` is the request's first query row (`input_row_offsets[b]`),
    `cache_length` its cached tokens; the same mask and slope code as the CPU path.
    """
    var t = row // num_heads
    var position = cache_length + t - first_row
    var span = mask.key_range(position, visible)
    var slope = alibi_slope(row % num_heads, num_heads) if score_mod == SCORE_MOD_ALIBI_POS else Float32(0)
    return (span[0], span[1], position, slope)


# Elementwise kernels: one block of ELEMENTWISE_THREADS per token.
comptime ELEMENTWISE_THREADS = 128
