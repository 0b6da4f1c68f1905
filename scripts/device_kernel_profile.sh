#!/usr/bin/env bash
# Runs ON the device, with no MAX install: the standalone GPU binaries built here by
# scripts/build_devbin.sh (.devbin/smoke: tests/gpu/gpu_smoke.mojo, .devbin/bench:
# tests/gpu/gpu_bench.mojo) travel as the carried folder .devbin. Steps:
#   regs               ptxas -v register / spill report of every attention kernel (both binaries' PTX)
#   variants CFG...    step 5 alone, the op's choice and pinned variants (CFG = BATCH:HEADS:CACHE_LEN[:ITERS[:FLAG...]];
#                      `fp8`: again with an fp8_ds_mla cache, after the bf16 cache; `fp8-only`: that cache alone;
#                      `plan-only`: `bench` and `ab` time the op's plan alone, not also three turned plans)
#   bench CFG...       the whole op timed, after a device-to-device copy (the HBM yardstick; CFG as variants)
#   proj CFG...        steps 1-4 on q and step 6 alone, the op's tile, every tile, the FMA path
#   ncu CFG            Nsight Compute sections of one launch of KERNEL (a regex; default attention_mma), the
#                      launch after the first LAUNCH_SKIP (default 1) that match (KERNEL=steps_fused matches the
#                      q step and the output step, in that order per call: LAUNCH_SKIP=2 the q step, 1 the output step)
#   sass CFG           one launch as `ncu sass` picks it, with the instruction mix and warp-stall samples per SASS
#                      instruction: the report ($OUT/sass_KERNEL.ncu-rep), its source page as CSV
#                      ($OUT/sass_KERNEL.csv) and the 40 instructions with the most stall samples
#   pipes CFG          one launch of KERNEL: the share of peak of every SM pipe's instructions and the tensor pipe's
#                      cycles (which unit a stage of the kernel saturates: e.g. conversions on the xu pipe)
#   breakdown CFG...   GPU time of every kernel of the whole op, one ncu summary per CFG
#   smoke [sm90]       the correctness cases (sm90: the sm90 TMA kernel's raw checks alone)
#   ab A B [C...] CFG...  the whole op (`bench`) of two or more builds carried as folders (e.g. .devbin-main
#                      and a branch's .devbin-x: bench, smoke and lib/ are enough), alternated, 2 rounds each;
#                      prints a line per build and round with each CFG's best-of-2 time (us), the full
#                      log in $OUT/ab.log
#   abproj A B [C...] CFG...  the same for the projection steps alone (`proj`): the op's choice of each
#                      build, alternated, 2 rounds; the full log (every tile) in $OUT/abproj.log
set -u
export LD_LIBRARY_PATH=$PWD/.devbin/lib
out=${OUT:-/tmp/pymla-out}
mkdir -p "$out"
step=$1; shift

# `bench MODE CFG...` of every carried build (the leading arguments that are folders with a `bench`),
# the builds alternated, 2 rounds, each run under `timeout LIMIT`, all into LOG.
alternate() {
  local mode=$1 limit=$2 log=$3
  shift 3
  local builds=()
  while [ $# -gt 0 ] && [ -x "$1/bench" ]; do builds+=("$1"); shift; done
  for round in 1 2; do
    for d in "${builds[@]}"; do
      echo "== $d (round $round)"
      LD_LIBRARY_PATH=$PWD/$d/lib timeout "$limit" "$d/bench" "$mode" "$@"
    done
  done > "$log" 2>&1
}
case $step in
  regs)
    for f in .devbin/*_mojo_kernels_gpu_attention*.ptx; do
      echo "$(basename $f): $(ptxas -arch=sm_90a -v $f -o /dev/null 2>&1 | grep -E 'registers' | sed 's/.*Used/Used/')"
    done ;;
  variants) timeout 300 .devbin/bench variants "$@" ;;
  bench) timeout 300 .devbin/bench bench "$@" ;;
  proj) timeout 300 .devbin/bench proj "$@" ;;
  ncu)
    timeout 300 ncu --clock-control none -k regex:${KERNEL:-attention_mma} --launch-skip ${LAUNCH_SKIP:-1} --launch-count 1 \
      --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
      --section SchedulerStats --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
      .devbin/bench bench "$@" > "$out/ncu_${KERNEL:-attention_mma}_${LAUNCH_SKIP:-1}.log" 2>&1
    echo "ncu exit $?"; grep -v "^==PROF==" "$out/ncu_${KERNEL:-attention_mma}_${LAUNCH_SKIP:-1}.log" | head -150 ;;
  sass)
    rep="$out/sass_${KERNEL:-attention_mma}"
    timeout 400 ncu --clock-control none -k regex:${KERNEL:-attention_mma} --launch-skip ${LAUNCH_SKIP:-1} --launch-count 1 \
      --section SpeedOfLight --section InstructionStats --section WarpStateStats --section SourceCounters \
      --import-source no -f -o "$rep" .devbin/bench bench "$@" > "$rep.log" 2>&1
    echo "ncu exit $?"
    ncu -i "$rep.ncu-rep" --page details --print-details all > "$rep.details.txt" 2>&1
    grep -iE "Duration|Issue Slots|Eligible|Warp Cycles Per|stall" "$rep.details.txt" | cut -c1-160 | head -40
    ncu -i "$rep.ncu-rep" --page source --print-source sass --csv > "$rep.csv" 2>&1
    echo "source page: $(wc -l < "$rep.csv") lines"; head -2 "$rep.csv" | cut -c1-400
    python3 - "$rep.csv" <<'PY'
import csv, sys
lines = open(sys.argv[1]).read().splitlines()
# The page may open with title lines ("Kernel Name", ...) before the column header.
start = next((i for i, line in enumerate(lines) if line.startswith('"Address"')), 0)
rows = list(csv.DictReader(lines[start:]))
if not rows:
    sys.exit("no rows in the source page")
names = list(rows[0])
key = next((k for k in names if "Sampling" in k and "All" in k), None) or next(
    (k for k in names if "Sampl" in k), None)
if key is None:
    sys.exit(f"no stall-sampling column; the columns: {names}")
def num(x):
    try:
        return float(str(x).replace(",", ""))
    except ValueError:
        return 0.0
total = sum(num(r[key]) for r in rows) or 1.0
print(f"column {key!r}, {len(rows)} instructions, {total:.0f} samples")
for r in sorted(rows, key=lambda r: -num(r[key]))[:40]:
    print(f"{100 * num(r[key]) / total:5.1f}%  {r.get('Address', '')}  {r.get('Source', '')[:90]}")
PY
    ;;
  pipes)
    timeout 300 ncu --clock-control none -k regex:${KERNEL:-attention_mma} --launch-skip ${LAUNCH_SKIP:-1} --launch-count 1 \
      --metrics "regex:sm__inst_executed_pipe_.*\.avg\.pct_of_peak_sustained_active$,regex:sm__pipe_.*_cycles_active\.avg\.pct_of_peak_sustained_active$,gpu__time_duration.sum,sm__warps_active.avg.per_cycle_active,smsp__issue_active.avg.pct_of_peak_sustained_active" \
      .devbin/bench bench "$@" > "$out/pipes_${KERNEL:-attention_mma}.log" 2>&1
    echo "ncu exit $?"; grep -E "pct|duration|per_cycle" "$out/pipes_${KERNEL:-attention_mma}.log" | awk '$NF+0 > 0.5 || /duration|per_cycle/' | head -60 ;;
  breakdown)
    for cfg in "$@"; do
      echo "== $cfg"
      timeout 200 ncu --clock-control none --metrics gpu__time_duration.sum --print-summary per-kernel \
        .devbin/bench bench "$cfg" > "$out/breakdown_${cfg//:/_}.log" 2>&1
      grep -E "bench |[a-z_]+_kernel|gpu__time_duration" "$out/breakdown_${cfg//:/_}.log" | grep -v "==PROF==" | head -60
    done ;;
  smoke) timeout 560 .devbin/smoke "$@" ;;
  ab)
    alternate bench 150 "$out/ab.log" "$@"
    # One line per build and round: the best-of-2 whole-op time of each CFG, in us, in CFG order.
    awk '/^== /{if (line) print line; sub(/\)/, "", $4); line=$2" round "$4} /best of 2/{sub(/.*step : /, ""); sub(/ us \(.*/, ""); line=line" "$0} END{print line}' "$out/ab.log" ;;
  abproj)
    alternate proj 120 "$out/abproj.log" "$@"
    grep -E "^== |proj B|op's choice" "$out/abproj.log" ;;
  *) echo "unknown step $step"; exit 2 ;;
esac
