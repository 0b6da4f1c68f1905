#!/usr/bin/env bash
# Runs ON the device, with no MAX install: the standalone GPU test binary built here by
# scripts/build_devbin.sh travels as the carried folder .devbin (about 14 MB). Steps:
#   regs               ptxas -v register / spill report of every attention kernel
#   variants CFG...    step 5 alone, the op's choice and pinned variants (CFG = BATCH:HEADS:CACHE_LEN[:ITERS])
#   bench CFG...       the whole op timed, after a device-to-device copy (the HBM yardstick)
#   ncu CFG            Nsight Compute sections of one launch of KERNEL (a regex; default attention_mma)
#   breakdown CFG...   GPU time of every kernel of the whole op, one ncu summary per CFG
#   smoke              the correctness cases
set -u
export LD_LIBRARY_PATH=$PWD/.devbin/lib
out=${OUT:-/tmp/pymla-out}
mkdir -p "$out"
step=$1; shift
case $step in
  regs)
    for f in .devbin/*attention*.ptx; do
      echo "$(basename $f): $(ptxas -arch=sm_90a -v $f -o /dev/null 2>&1 | grep -E 'registers' | sed 's/.*Used/Used/')"
    done ;;
  variants) timeout 300 .devbin/smoke variants "$@" ;;
  bench) timeout 300 .devbin/smoke bench-only "$@" ;;
  ncu)
    timeout 300 ncu --clock-control none -k regex:${KERNEL:-attention_mma} --launch-skip 1 --launch-count 1 \
      --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
      --section SchedulerStats --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
      .devbin/smoke bench-only "$@" > "$out/ncu_${KERNEL:-attention_mma}.log" 2>&1
    echo "ncu exit $?"; grep -v "^==PROF==" "$out/ncu_${KERNEL:-attention_mma}.log" | head -150 ;;
  breakdown)
    for cfg in "$@"; do
      echo "== $cfg"
      timeout 200 ncu --clock-control none --metrics gpu__time_duration.sum --print-summary per-kernel \
        .devbin/smoke bench-only "$cfg" > "$out/breakdown_${cfg//:/_}.log" 2>&1
      grep -E "bench |[a-z_]+_kernel|gpu__time_duration" "$out/breakdown_${cfg//:/_}.log" | grep -v "==PROF==" | head -60
    done ;;
  smoke) timeout 400 .devbin/smoke ;;
  *) echo "unknown step $step"; exit 2 ;;
esac
