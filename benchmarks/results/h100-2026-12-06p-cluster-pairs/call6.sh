#!/usr/bin/env bash
# Session 21, call 6: the softmax's exp as exp2 of one FFMA (.devbin-fx, branch sm90-fused-exp2): the sm90
# checks of gpu_smoke, then the whole op alternated with main's build at the 64-row kernel's shapes.
set -u
mkdir -p $OUT
export LD_LIBRARY_PATH=$PWD/.devbin-fx/lib
timeout 200 .devbin-fx/smoke sm90 > $OUT/smoke_fx.log 2>&1; echo "smoke exit $?"
grep -cE "^ +PASS" $OUT/smoke_fx.log; grep -E "FAIL|ALL PASS" $OUT/smoke_fx.log | head -5
timeout $((440 - SECONDS)) bash scripts/device_kernel_profile.sh ab .devbin-m .devbin-fx 64:128:8191:10:plan-only 8:128:8191:20:plan-only 128:128:32767:3:plan-only 2>&1 | tail -4
