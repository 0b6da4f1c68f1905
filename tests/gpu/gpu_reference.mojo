# The CPU reference of tests/gpu/gpu_smoke.mojo: plain loops on a `Case` (the docstring of pymla/reference.py).

from std.math import exp, log, sqrt

from gpu_case import FP8_MAX, Case, QuantWeights, ceil_div, extent, fp8_value, round_to


def cpu_fp8mm(
    a: List[Float32], groups: Int, m_rows: Int, k_cols: Int, w: QuantWeights, gm: Int, gk: Int
) -> List[Float32]:
    """`out[g, m, n]` of pymla.quant.fp8_batched_matmul for `a [G, M, K]` (float64 sums)."""
    var bm = extent(gm, m_rows)
    var bk = extent(gk, k_cols)
    var mb_count = ceil_div(m_rows, bm)
    var kb_count = ceil_div(k_cols, bk)
    var aq = List[Float32](length=groups * m_rows * k_cols, fill=0)
    var sa = List[Float32](length=groups * mb_count * kb_count, fill=0)
    for g in range(groups):
        for mb in range(mb_count):
            for kb in range(kb_count):
                var amax = Float32(0)
                for m in range(mb * bm, min((mb + 1) * bm, m_rows)):
                    for k in range(kb * bk, min((kb + 1) * bk, k_cols)):
                        amax = max(amax, abs(a[(g * m_rows + m) * k_cols + k]))
                var s = amax / FP8_MAX if amax > 0 else Float32(1)
                sa[(g * mb_count + mb) * kb_count + kb] = s
                for m in range(mb * bm, min((mb + 1) * bm, m_rows)):
                    for k in range(kb * bk, min((kb + 1) * bk, k_cols)):
                        var x = min(max(a[(g * m_rows + m) * k_cols + k] / s, -FP8_MAX), FP8_MAX)
                        aq[(g * m_rows + m) * k_cols + k] = fp8_value(x)
    var out = List[Float32](length=groups * m_rows * w.n, fill=0)
    for g in range(groups):
        for m in range(m_rows):
            for n in range(w.n):
                var acc = Float64(0)
                for kb in range(kb_count):
                    var part = Float64(0)
                    for k in range(kb * bk, min((kb + 1) * bk, k_cols)):
                        part += Float64(aq[(g * m_rows + m) * k_cols + k]) * Float64(w.values[(g * w.n + n) * k_cols + k])
                    acc += part * Float64(sa[(g * mb_count + m // bm) * kb_count + kb]) * Float64(w.scale(g, n, kb))
                out[(g * m_rows + m) * w.n + n] = Float32(acc)
    return out^


def key_range(kind: Int, window: Int, p: Int, visible: Int) -> Tuple[Int, Int]:
    if kind == 0:
        return (0, visible)
    if kind == 2:
        return (max(0, p - window + 1), p + 1)
    if kind == 3:
        return ((p // window) * window, p + 1)
    return (0, p + 1)


def alibi(h: Int, heads: Int) -> Float64:
    var n = 1
    while n * 2 <= heads:
        n *= 2
    if h < n:
        return Float64(2.0) ** (-8.0 * Float64(h + 1) / Float64(n))
    return Float64(2.0) ** (-8.0 * Float64(2 * (h - n) + 1) / Float64(2 * n))


def cpu_cache_rows[dtype: DType](tc: Case) -> List[Float32]:
    """Steps 1 and 2 on a copy of the blocks."""
    var out = tc.blocks.copy()
    for t in range(tc.num_tokens):
        var pos = tc.position(t)
        var off = tc.row_offset(tc.request_of(t), pos)
        var ss = Float64(0)
        for i in range(tc.rank):
            ss += Float64(tc.blocks[off + i]) * Float64(tc.blocks[off + i])
        var inv = Float32(1.0 / sqrt(ss / Float64(tc.rank) + Float64(tc.epsilon)))
        for i in range(tc.rank):
            out[off + i] = round_to[dtype](tc.blocks[off + i] * inv * tc.gamma[i])
        for j in range(tc.rope // 2):
            var x0 = tc.blocks[off + tc.rank + 2 * j]
            var x1 = tc.blocks[off + tc.rank + 2 * j + 1]
            var c = tc.freqs[pos * tc.rope + 2 * j]
            var s = tc.freqs[pos * tc.rope + 2 * j + 1]
            out[off + tc.rank + 2 * j] = round_to[dtype](x0 * c - x1 * s)
            out[off + tc.rank + 2 * j + 1] = round_to[dtype](x0 * s + x1 * c)
    return out^


def cpu_q_full[dtype: DType](tc: Case) -> List[Float32]:
    """Steps 1, 3 and 4."""
    var heads = tc.heads
    var tokens = tc.num_tokens
    var qs = tc.nope + tc.rope
    var a = List[Float32](length=heads * tokens * tc.nope, fill=0)
    for h in range(heads):
        for t in range(tokens):
            for k in range(tc.nope):
                a[(h * tokens + t) * tc.nope + k] = tc.q[(t * heads + h) * qs + k]
    var proj = cpu_fp8mm(a, heads, tokens, tc.nope, tc.w_uk, tc.gm, tc.gk)
    var out = List[Float32](length=tokens * heads * tc.key_dim, fill=0)
    for t in range(tokens):
        var pos = tc.position(t)
        for h in range(heads):
            var dst = (t * heads + h) * tc.key_dim
            for n in range(tc.rank):
                out[dst + n] = round_to[dtype](proj[(h * tokens + t) * tc.rank + n])
            for j in range(tc.rope // 2):
                var x0 = tc.q[(t * heads + h) * qs + tc.nope + 2 * j]
                var x1 = tc.q[(t * heads + h) * qs + tc.nope + 2 * j + 1]
                var c = tc.freqs[pos * tc.rope + 2 * j]
                var s = tc.freqs[pos * tc.rope + 2 * j + 1]
                out[dst + tc.rank + 2 * j] = round_to[dtype](x0 * c - x1 * s)
                out[dst + tc.rank + 2 * j + 1] = round_to[dtype](x0 * s + x1 * c)
    return out^


def cpu_attention[dtype: DType](tc: Case, q_full: List[Float32], blocks: List[Float32]) -> List[Float32]:
    """Step 5, in float64 with the op's rounding points (P and raw rounded to dtype), from any q_full and cache blocks."""
    var lse = List[Float32]()
    return cpu_attention_lse[dtype](tc, q_full, blocks, lse)


def cpu_attention_lse[
    dtype: DType
](tc: Case, q_full: List[Float32], blocks: List[Float32], mut lse: List[Float32]) -> List[Float32]:
    """`cpu_attention`, and each row's natural log-sum-exp of its scores into `lse [T H]` (float64 math)."""
    var heads = tc.heads
    var raw = List[Float32](length=tc.num_tokens * heads * tc.rank, fill=0)
    lse = List[Float32](length=tc.num_tokens * heads, fill=0)
    var scores = List[Float64]()
    var acc = List[Float64](length=tc.rank, fill=0)
    for t in range(tc.num_tokens):
        var b = tc.request_of(t)
        var p = tc.position(t)
        var visible = Int(tc.lengths[b]) + Int(tc.offsets[b + 1]) - Int(tc.offsets[b])
        var r = key_range(tc.mask_kind, tc.window, p, visible)
        for h in range(heads):
            var qrow = (t * heads + h) * tc.key_dim
            var slope = alibi(h, heads) if tc.score_mod == 1 else Float64(0)
            scores.clear()
            var top = Float64(-1e300)
            for j in range(r[0], r[1]):
                var off = tc.row_offset(b, j)
                var s = Float64(0)
                for i in range(tc.key_dim):
                    s += Float64(q_full[qrow + i]) * Float64(blocks[off + i])
                s = s * Float64(tc.scale) - slope * Float64(p - j)
                scores.append(s)
                top = max(top, s)
            var total = Float64(0)
            for i in range(tc.rank):
                acc[i] = 0
            for j in range(r[0], r[1]):
                var e = exp(scores[j - r[0]] - top)
                total += e
                var e_rounded = Float64(round_to[dtype](Float32(e)))
                var off = tc.row_offset(b, j)
                for i in range(tc.rank):
                    acc[i] += e_rounded * Float64(blocks[off + i])
            for i in range(tc.rank):
                raw[(t * heads + h) * tc.rank + i] = round_to[dtype](Float32(acc[i] / total))
            lse[t * heads + h] = Float32(top + log(total))
    return raw^


def cpu_output(tc: Case, raw: List[Float32]) -> List[Float32]:
    """Step 6 from any raw [T, H, R]."""
    var heads = tc.heads
    var tokens = tc.num_tokens
    var a = List[Float32](length=heads * tokens * tc.rank, fill=0)
    for h in range(heads):
        for t in range(tokens):
            for k in range(tc.rank):
                a[(h * tokens + t) * tc.rank + k] = raw[(t * heads + h) * tc.rank + k]
    var proj = cpu_fp8mm(a, heads, tokens, tc.rank, tc.w_uv, tc.gm, tc.gk)
    var out = List[Float32](length=tokens * heads * tc.v_dim, fill=0)
    for t in range(tokens):
        for h in range(heads):
            for n in range(tc.v_dim):
                out[(t * heads + h) * tc.v_dim + n] = proj[(h * tokens + t) * tc.v_dim + n]
    return out^
