#!/usr/bin/env bash
# Session 21, call 2: the cluster-pair build (.devbin-mc): smoke, then the whole op with the op's plan
# (paired at 128 heads) against the same plan unpaired, alternated in one process; main's build beside.
set -u
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
mkdir -p $OUT
export LD_LIBRARY_PATH=$PWD/.devbin-mc/lib
timeout 240 .devbin-mc/smoke > $OUT/smoke_mc.log 2>&1; echo "smoke exit $?"
grep -E "FAIL|ALL PASS|checks" $OUT/smoke_mc.log | head -20; tail -3 $OUT/smoke_mc.log
timeout 200 .devbin-mc/bench bench 64:128:8191:10 8:128:8191:20 128:128:32767:3 > $OUT/bench_mc.log 2>&1; echo "bench exit $?"
grep -E "copy|best of 2" $OUT/bench_mc.log
timeout $((570 - SECONDS)) bash scripts/device_kernel_profile.sh ab .devbin-m .devbin-mc 64:128:8191:10:plan-only 8:128:8191:20:plan-only 8:16:8191:20:plan-only 2>&1 | tail -6
