#!/usr/bin/env bash
# Runs ON the device, after device_setup.sh: pymla's own GPU checks, one log per step in $OUT.
#   bash scripts/device_pymla_checks.sh smoke demo parity
# Steps: smoke  (tests/gpu/gpu_smoke.mojo: every GPU stage against CPU loops)
#        demo   (python -m pymla demo --device cuda)
#        parity (the pytest parity suite on cuda tensors)
# A step's failure does not stop the next one.
set -u
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
export PYMLA_CACHE_DIR=/tmp/pymla-cache
out=${OUT:-/tmp/pymla-out}
mkdir -p "$out"
for step in "$@"; do
  start=$(date +%s)
  case $step in
    smoke)  timeout 420 mojo run -I . tests/gpu/gpu_smoke.mojo ;;
    demo)   timeout 300 python3 -m pymla demo --device cuda ;;
    parity) timeout 540 python3 -m pytest tests/test_op_parity.py tests/test_plain_torch.py -k cuda -q -rf --maxfail=15 -p no:cacheprovider ;;
    *) echo "unknown step $step"; false ;;
  esac > "$out/$step.log" 2>&1
  status=$?
  echo "== $step: exit $status in $(( $(date +%s) - start )) s"
  tail -n 25 "$out/$step.log"
done
