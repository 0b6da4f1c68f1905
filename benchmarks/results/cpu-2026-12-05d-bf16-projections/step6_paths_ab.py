import os, time, torch, pymla
from pymla.tools.scenario import make_case
heads = int(os.environ.get("HEADS", "128")); B = int(os.environ.get("B", "1"))
case = make_case(7, num_heads=heads, page_size=64, cache_lengths=(255,)*B, new_tokens=(1,)*B, num_layers=1, layer_idx=0, freqs="rope", extra_rows=1)
w = case.weights
weights = pymla.LayerWeights(w["w_uk"], w["w_uk_scale"], w["w_uv"], w["w_uv_scale"], case.kv_norm_gamma, case.options["scale_granularity"])
opts = pymla.DecodeOptions(**{k: v for k, v in case.options.items() if k != "scale_granularity"})
step = pymla.plan(case.cache, case.input_row_offsets, case.freqs_cis, opts, rerun_layers=True)
q = case.q
att, lse = step.attend(q, 0, weights)
out = torch.empty(q.shape[0], heads, 128, dtype=q.dtype)
def t(f, n=30):
    for _ in range(3): f()
    ts = []
    for _ in range(n):
        t0 = time.perf_counter(); f(); ts.append(time.perf_counter() - t0)
    ts.sort(); return round(1e3 * ts[len(ts)//2], 3)
res = {"f32": [], "avx512bf16": []}
outs = {}
for r in range(4):
    for p in res:
        os.environ["PYMLA_CPU_PATH"] = p
        res[p].append(t(lambda: step.project(att, q, 0, weights, out=out)))
        outs[p] = out.clone()
print("heads", heads, "B", B, "step 6 alone ms:", res, "max|diff|", (outs["f32"].float() - outs["avx512bf16"].float()).abs().max().item())
