#!/usr/bin/env bash
# Runs ON the device: the measurements prepared for the next device call, in parts that each fit one call
# (600 s), every log into $OUT. Carry `.devbin` (main's build), `.amxbin` (scripts/build_amxbin.sh) and the
# untracked `.devbin-ab.tgz` (`cp .devbin-ab/ab.tgz .devbin-ab.tgz` here; scripts/build_ab_devbins.sh makes it).
#   gpu16    issue 24's 16-head shapes on fp8 rows (and bf16 rows level): main against every pending build
#            (benchmarks/results/pending-2026-12-07{i,j,l,m}-*), alternated; about 5 min
#   gpu128   the 128-head shapes, bf16 and fp8 rows, main against the builds that touch them, then the
#            smoke of the widen-per-box build; about 4 min
#   host     the host CPU's targets from memory (benchmarks/results/pending-2026-12-08-host-cpu-from-memory);
#            about 2-3 min
# e.g. `bash scripts/device_pending.sh gpu16 host`, then on the same machine `bash scripts/device_pending.sh gpu128`.
set -u
out=${OUT:-/tmp/pymla-out}
mkdir -p "$out"

unpack() {
  [ -d .devbin-bw ] && return
  tar xzf .devbin-ab.tgz && for d in .devbin-*/; do cp -r .devbin/lib "$d"; done
}

for part in "$@"; do
  case $part in
    gpu16)
      unpack
      OUT=$out timeout 330 bash scripts/device_kernel_profile.sh ab .devbin .devbin-fs7 .devbin-lr .devbin-bw .devbin-ef \
        64:16:8191:3:fp8-only:plan-only 8:16:8191:3:fp8-only:plan-only 128:16:32767:2:fp8-only:plan-only \
        64:16:8191:2:plan-only > "$out/gpu16.out" 2>&1
      cp "$out/ab.log" "$out/gpu16_ab.log" ;;
    gpu128)
      unpack
      OUT=$out timeout 250 bash scripts/device_kernel_profile.sh ab .devbin .devbin-lr .devbin-bw .devbin-ef \
        64:128:8191:3:plan-only 64:128:8191:2:fp8-only:plan-only > "$out/gpu128.out" 2>&1
      cp "$out/ab.log" "$out/gpu128_ab.log"
      LD_LIBRARY_PATH=$PWD/.devbin/lib timeout 100 .devbin-bw/smoke > "$out/smoke_bw.log" 2>&1
      tail -3 "$out/smoke_bw.log" ;;
    host)
      {
        lscpu | grep -E "Model name|^CPU\(s\)|L3"
        python3 scripts/cpu_roofline.py --threads 16 --heads 16 128
        export LD_LIBRARY_PATH=$PWD/.amxbin/lib
        timeout 100 .amxbin/amx_check ab 16 4 3 cold fp8-cold whole fp8-whole
        timeout 80 .amxbin/amx_check ab 128 3 3 cold fp8-cold
        timeout 60 .amxbin/amx_check ab 16 3 5 op hot fp8-op fp8-hot
        timeout 60 .amxbin/amx_check ab 16 3 5 fp8-op fp8-packed op packed
        python3 scripts/cpu_roofline.py --threads 16 --heads 16 128
      } > "$out/host_cpu.log" 2>&1
      cat "$out/host_cpu.log" ;;
    *) echo "unknown part $part (gpu16, gpu128, host)"; exit 2 ;;
  esac
done
