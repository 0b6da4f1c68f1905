#!/usr/bin/env bash
# Session 21, call 1: (a) main against amx-sequential-prefetch on the host (issue 22, next-host-call.sh);
# (b) the whole op's GPU timeline under nsys (issue 23: what the steps around attention cost back to back);

set -u
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
mkdir -p $OUT
rm -rf .devbin; ln -s .devbin-m .devbin
NSYS=$(command -v nsys || ls /usr/local/cuda*/bin/nsys /opt/nvidia/nsight-systems/*/bin/nsys 2>/dev/null | head -1)
echo "nsys: ${NSYS:-none}; ncu: $(command -v ncu)"
if [ -n "$NSYS" ]; then
  export LD_LIBRARY_PATH=$PWD/.devbin/lib
  timeout 150 $NSYS profile -t cuda -o $OUT/tl -f true .devbin/bench bench 8:16:8191:10:plan-only 8:128:8191:10:plan-only 64:128:8191:10:plan-only 64:16:8191:10:plan-only > $OUT/nsys_run.log 2>&1
  echo "nsys exit $?"; grep -E "bench|best" $OUT/nsys_run.log | head -20
  timeout 60 $NSYS stats -r cuda_gpu_trace -f csv -o $OUT/tl $OUT/tl.nsys-rep > /dev/null 2>&1; ls -la $OUT
  rm -f $OUT/tl.sqlite
else
  OUT=$OUT bash scripts/device_kernel_profile.sh breakdown 8:16:8191:3:plan-only 64:128:8191:3:plan-only
fi
echo "== host"
timeout $((560 - SECONDS)) bash benchmarks/results/h100-2026-12-06o-host-amx-prefetch/next-host-call.sh > $OUT/host.log 2>&1
echo "host exit $?"; cat $OUT/host.log | tail -80
