"""Both directions: the op's run() after a torch mm, and a torch mm after the op's run()."""
import os, statistics, time, torch
from pymla.plan import plan
from pymla.tools.scenario import make_case
case = make_case(7, num_heads=16, page_size=64, cache_lengths=(4095,)*8, new_tokens=(1,)*8, num_layers=1, layer_idx=0, freqs="rope", extra_rows=1)
step = plan(case.cache, case.input_row_offsets, case.freqs_cis, case.decode_options(), check_values=False, rerun_layers=True)
w = case.layer_weights()
a = torch.randn(1024, 1024); b = torch.randn(1024, 1024)
def timed(fn, before):
    ts = []
    for _ in range(30):
        if before: before()
        t0 = time.perf_counter(); fn(); ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3
op = lambda: step.run(case.q, 0, w)
mm = lambda: a @ b
op(); mm()
pol = os.environ.get('OMP_WAIT_POLICY', 'unset')
for r in range(3):
    print(f"OMP_WAIT_POLICY={pol}: run() alone {timed(op, None):.2f} ms, after a torch mm {timed(op, mm):.2f} ms; "
          f"torch mm alone {timed(mm, None):.2f} ms, after run() {timed(mm, op):.2f} ms", flush=True)
