"""The timings of this folder, one layer through a plan (medians after 3 warm-up calls).

    HEADS=128 B=1 CTX=4095 python timing.py steps   # run (steps 1-6), attend (1-5), project (6)
    HEADS=128 B=1 python timing.py paths            # step 6 alone, PYMLA_CPU_PATH f32 / avx512bf16
                                                    # alternated in this process, 4 rounds
"""

import os
import sys

import torch

import pymla
from pymla.tools.scenario import make_case
from pymla.tools.timing import time_call

mode = sys.argv[1]
heads, batch = int(os.environ.get("HEADS", "128")), int(os.environ.get("B", "1"))
ctx = int(os.environ.get("CTX", "4095" if mode == "steps" else "255"))
case = make_case(
    7, num_heads=heads, page_size=64, cache_lengths=(ctx,) * batch, new_tokens=(1,) * batch,
    num_layers=1, layer_idx=0, freqs="rope", extra_rows=1,
)  # fmt: skip
weights = case.layer_weights()
step = pymla.plan(
    case.cache, case.input_row_offsets, case.freqs_cis, case.decode_options(), rerun_layers=True
)
q = case.q
att, lse = step.attend(q, 0, weights)
out = torch.empty(q.shape[0], heads, 128, dtype=q.dtype)


def median_ms(f, n):
    return round(1e3 * time_call(f, warmup=3, repeat=n), 3)


def project():
    step.project(att, q, 0, weights, out=out)


if mode == "steps":
    print("heads", heads, "B", batch, "ctx", ctx)
    print("run (1-6)", median_ms(lambda: step.run(q, 0, weights, out=out), 20))
    print("attend (1-5)", median_ms(lambda: step.attend(q, 0, weights, attention_out=att, lse=lse), 20))
    print("project (6)", median_ms(project, 20))
else:
    res, outs = {"f32": [], "avx512bf16": []}, {}
    for _ in range(4):
        for p in res:
            os.environ["PYMLA_CPU_PATH"] = p
            res[p].append(median_ms(project, 30))
            outs[p] = out.clone()
    diff = (outs["f32"].float() - outs["avx512bf16"].float()).abs().max().item()
    print("heads", heads, "B", batch, "step 6 alone ms:", res, "max|diff|", diff)
