#!/usr/bin/env bash
# Session 21, call 3: attention_sm90's per-instruction stall profile at 128 h b64 8k (main's kernels);
# one core, fp8 rows: main and amx-sequential-prefetch alternated for more rounds.
set -u
mkdir -p $OUT
rm -rf .devbin; ln -s .devbin-m .devbin
KERNEL=attention_sm9 timeout 240 bash scripts/device_kernel_profile.sh sass 64:128:8191:2:plan-only 2>&1 | tail -48
L=$PWD/.amxbin/lib
for r in 1 2 3 4 5 6; do for b in .amxbin .amxbin-seq; do
  LD_LIBRARY_PATH=$L taskset -c 0 $b/amx_check loop 16 3 fp8-op 2>&1 | sed "s#^#$b r$r #; s#loop on Intel(R) Xeon(R) Processor : AMX path, ##"
  LD_LIBRARY_PATH=$L taskset -c 0 $b/amx_check loop 16 3 op 2>&1 | sed "s#^#$b r$r #; s#loop on Intel(R) Xeon(R) Processor : AMX path, ##"
done; done 2>&1 | tee $OUT/host_one_core.log | grep -v "^$" | tail -30
