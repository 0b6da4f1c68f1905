#!/usr/bin/env bash
# Runs HERE (no GPU needed): builds .devbin/, the standalone GPU binaries and what they need on
# the device, for scripts/device_kernel_profile.sh (carry [".devbin"]): .devbin/smoke
# (tests/gpu/gpu_smoke.mojo, the correctness checks) and .devbin/bench (tests/gpu/gpu_bench.mojo,
# the timings), one PTX file per kernel instance of each (smoke_*.ptx, bench_*.ptx). About 80 s.
# The smoke binary has attention_sm90's mbarrier watchdog (a wait over 2 s traps instead of
# hanging); the bench binary, like the op, has none. Where ptxas is installed, checks that the
# sm90 kernel starts with the registers its setmaxnreg budget assumes (S9_LAUNCH_REGS) and prints
# its registers, spills and ptxas's wgmma serialization notes (C75xx; the smoke binary, with the
# watchdog, spills and serializes: time the bench binary).
set -euo pipefail
cd "$(dirname "$0")/.."
mojo=${MOJO:-.venv/bin/mojo}
lib=$(echo .venv/lib/python3.*/site-packages/modular/lib)
rm -rf .devbin && mkdir -p .devbin/lib
for name in smoke bench; do
  defs=()
  if [ $name = smoke ]; then defs=(-D PYMLA_SM90_WATCHDOG_MS=2000); fi
  "$mojo" build --target-accelerator=sm_90 "${defs[@]}" -I . tests/gpu/gpu_$name.mojo -o .devbin/$name
  "$mojo" build --target-accelerator=sm_90 "${defs[@]}" --emit asm -I . tests/gpu/gpu_$name.mojo -o .devbin/$name.s
done
if command -v ptxas >/dev/null; then
  for ptx in .devbin/*_attention_sm9*.ptx; do
    info=$(ptxas -arch=sm_90a -v "$ptx" -o /dev/null 2>&1 | grep -E "Used|spill|C75" | tr -s ' \n' ' ')
    echo "$(basename "$ptx"): $info"
    if ! grep -q "Used 168 registers" <<<"$info" || grep -q C7507 <<<"$info"; then
      echo "attention_sm90: not 168 registers at launch (S9_LAUNCH_REGS: setmaxnreg would hang) or setmaxnreg dropped (C7507)" >&2
      exit 1
    fi
  done
fi
for name in KGENCompilerRTShared AsyncRTMojoBindings MSupportGlobals AsyncRTRuntimeGlobals; do
  cp "$lib/lib$name.so" .devbin/lib/
done
echo "built .devbin ($(du -sh .devbin | cut -f1)): $(ls .devbin/smoke_*.ptx | wc -l) + $(ls .devbin/bench_*.ptx | wc -l) PTX files"
