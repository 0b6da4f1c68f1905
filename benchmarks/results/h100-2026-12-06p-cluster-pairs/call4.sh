#!/usr/bin/env bash
# Session 21, call 4: the merge with fewer blocks and fewer round trips (.devbin-mg, branch gpu-merge-latency):
# gpu_smoke, then the whole op alternated with main's build.
set -u
mkdir -p $OUT
export LD_LIBRARY_PATH=$PWD/.devbin-mg/lib
timeout 260 .devbin-mg/smoke > $OUT/smoke_mg.log 2>&1; echo "smoke exit $?"
grep -cE "^ +PASS" $OUT/smoke_mg.log; grep -E "FAIL|ALL PASS" $OUT/smoke_mg.log | head; tail -2 $OUT/smoke_mg.log | cut -c1-200
timeout $((570 - SECONDS)) bash scripts/device_kernel_profile.sh ab .devbin-m .devbin-mg 8:16:8191:20:plan-only 8:128:8191:20:plan-only 64:128:8191:10:plan-only 64:128:8191:10:plan-only:one-long 64:16:8191:10:plan-only 2>&1 | tail -6
