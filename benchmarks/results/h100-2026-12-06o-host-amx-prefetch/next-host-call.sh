#!/usr/bin/env bash
# main against amx-sequential-prefetch, the whole CPU op, alternated; `ab` rounds of step 5 within each build.
L=$PWD/.amxbin/lib
B=".amxbin .amxbin-seq"
run() { local bin=$1; shift; LD_LIBRARY_PATH=$L "$@" 2>&1 | sed "s#^#$bin r$r #; s#loop on Intel(R) Xeon(R) Processor : AMX path, ##"; }
lscpu | grep -E "Model name|^Model:" | head -2; for b in $B; do echo "$b: $(cat $b/BUILT_FROM)"; done
LD_LIBRARY_PATH=$L .amxbin-seq/amx_check quick 2>&1 | grep -E "FAIL|amx_check:" | tail -2
echo "== one core, step 5 (bf16 rows, then fp8 rows)"
for r in 1 2 3 4; do for b in $B; do run $b taskset -c 0 $b/amx_check loop 16 3 op; run $b taskset -c 0 $b/amx_check loop 16 3 fp8-op; done; done
echo "== two cores, whole op"
taskset -c 0,1 python3 scripts/cpu_roofline.py --threads 2 2>&1 | tail -3
for r in 1 2 3 4 5 6; do for b in $B; do run $b taskset -c 0,1 $b/amx_check loop 16 5 whole; done; done
echo "== 16 cores, whole op"
for r in 1 2 3 4; do for b in $B; do run $b $b/amx_check loop 16 20 whole; run $b $b/amx_check loop 16 20 fp8-whole; done; done
for r in 1 2; do for b in $B; do run $b $b/amx_check loop 128 5 whole; done; done
python3 scripts/cpu_roofline.py --threads 16 2>&1 | tail -3
