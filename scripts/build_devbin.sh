#!/usr/bin/env bash
# Runs HERE (no GPU needed): builds .devbin/, the standalone GPU binaries and what they need on
# the device, for scripts/device_kernel_profile.sh (carry [".devbin"]): .devbin/smoke
# (tests/gpu/gpu_smoke.mojo, the correctness checks) and .devbin/bench (tests/gpu/gpu_bench.mojo,
# the timings), one PTX file per kernel instance of each (smoke_*.ptx, bench_*.ptx). About 80 s.
set -euo pipefail
cd "$(dirname "$0")/.."
mojo=${MOJO:-.venv/bin/mojo}
lib=$(echo .venv/lib/python3.*/site-packages/modular/lib)
rm -rf .devbin && mkdir -p .devbin/lib
for name in smoke bench; do
  "$mojo" build --target-accelerator=sm_90 -I . tests/gpu/gpu_$name.mojo -o .devbin/$name
  "$mojo" build --target-accelerator=sm_90 --emit asm -I . tests/gpu/gpu_$name.mojo -o .devbin/$name.s
done
for name in KGENCompilerRTShared AsyncRTMojoBindings MSupportGlobals AsyncRTRuntimeGlobals; do
  cp "$lib/lib$name.so" .devbin/lib/
done
echo "built .devbin ($(du -sh .devbin | cut -f1)): $(ls .devbin/smoke_*.ptx | wc -l) + $(ls .devbin/bench_*.ptx | wc -l) PTX files"
