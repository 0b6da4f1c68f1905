#!/usr/bin/env bash
# Runs HERE (no AMX needed): builds .amxbin/, the standalone AMX check (tests/cpu/amx_check.mojo)
# for Sapphire Rapids and the runtime libraries it needs, for a machine without MAX
# (carry [".amxbin"]; run LD_LIBRARY_PATH=$PWD/.amxbin/lib .amxbin/amx_check). About 15 s.
set -euo pipefail
cd "$(dirname "$0")/.."
mojo=${MOJO:-.venv/bin/mojo}
lib=$(echo .venv/lib/python3.*/site-packages/modular/lib)
rm -rf .amxbin && mkdir -p .amxbin/lib
"$mojo" build --target-cpu sapphirerapids -I . tests/cpu/amx_check.mojo -o .amxbin/amx_check
for name in KGENCompilerRTShared AsyncRTMojoBindings MSupportGlobals AsyncRTRuntimeGlobals; do
  cp "$lib/lib$name.so" .amxbin/lib/
done
echo "built .amxbin ($(du -sh .amxbin | cut -f1)): $(objdump -d .amxbin/amx_check | grep -c tdpbf16ps) tdpbf16ps"
