#!/usr/bin/env bash
# Runs HERE (no GPU needed): builds .devbin/, the standalone GPU test binary and what it needs on
# the device, for scripts/device_kernel_profile.sh (carry [".devbin"]). About 40 s.
set -euo pipefail
cd "$(dirname "$0")/.."
mojo=${MOJO:-.venv/bin/mojo}
lib=$(echo .venv/lib/python3.*/site-packages/modular/lib)
rm -rf .devbin && mkdir -p .devbin/lib
"$mojo" build --target-accelerator=sm_90 -I . tests/gpu/gpu_smoke.mojo -o .devbin/smoke
"$mojo" build --target-accelerator=sm_90 --emit asm -I . tests/gpu/gpu_smoke.mojo -o .devbin/smoke.s
for name in KGENCompilerRTShared AsyncRTMojoBindings MSupportGlobals AsyncRTRuntimeGlobals; do
  cp "$lib/lib$name.so" .devbin/lib/
done
echo "built .devbin ($(du -sh .devbin | cut -f1)): $(ls .devbin/*.ptx | wc -l) PTX files"
