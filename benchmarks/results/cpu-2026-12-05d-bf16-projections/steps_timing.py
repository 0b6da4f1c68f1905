import os, time, torch, pymla
from pymla.tools.scenario import make_case
heads = int(os.environ.get("HEADS", "128")); ctx = int(os.environ.get("CTX", "4095")); B = int(os.environ.get("B", "1"))
case = make_case(7, num_heads=heads, page_size=64, cache_lengths=(ctx,)*B, new_tokens=(1,)*B, num_layers=1, layer_idx=0, freqs="rope", extra_rows=1)
w = case.weights
weights = pymla.LayerWeights(w["w_uk"], w["w_uk_scale"], w["w_uv"], w["w_uv_scale"], case.kv_norm_gamma, case.options["scale_granularity"])
opts = pymla.DecodeOptions(**{k: v for k, v in case.options.items() if k != "scale_granularity"})
step = pymla.plan(case.cache, case.input_row_offsets, case.freqs_cis, opts, rerun_layers=True)
q = case.q
att, lse = step.attend(q, 0, weights)
out = torch.empty(q.shape[0], heads, 128, dtype=q.dtype)
def t(f, n=20):
    for _ in range(3): f()
    ts = []
    for _ in range(n):
        t0 = time.perf_counter(); f(); ts.append(time.perf_counter() - t0)
    ts.sort(); return round(1e3 * ts[len(ts)//2], 3)
print("heads", heads, "B", B, "ctx", ctx)
print("run (1-6)", t(lambda: step.run(q, 0, weights, out=out)))
print("attend (1-5)", t(lambda: step.attend(q, 0, weights, attention_out=att, lse=lse)))
print("project (6)", t(lambda: step.project(att, q, 0, weights, out=out)))
