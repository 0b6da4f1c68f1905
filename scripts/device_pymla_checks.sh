#!/usr/bin/env bash
# Runs ON the device, after device_setup.sh: pymla's own GPU checks, one log per step in $OUT.
#   bash scripts/device_pymla_checks.sh smoke demo parity
# Steps: smoke  (tests/gpu/gpu_smoke.mojo: every GPU stage against CPU loops)
#        demo   (python -m pymla demo --device cuda)
#        parity (the pytest parity suites on cuda tensors, the fp8_ds_mla cache's included)
#        serving  (tests/test_gpu_serving.py: no host sync in run(), CUDA-graph replay == eager)
#        overhead (python -m pymla overhead --device cuda, JSON in $OUT)
#        step     (python -m pymla step --device cuda: 61 layers, eager and replayed, JSON in $OUT)
#        dropin   (examples/multi_layer_decode.py on the GPU beside MAX's built-in, 1 then 2 tokens)
#        sanitize (the cuda parity tests under compute-sanitizer memcheck; exit 9 on any error)
#        cputarget (the host CPU, LLVM's name for it, the CPU paths the compiled kernel has)
#        cpu      (the whole suite but cuda and packaging on the host CPU: AMX Xeon, 16 cores; more than
#                  one call's 560 s there: CPU_TESTS names the files of one call, e.g.
#                  CPU_TESTS="tests/test_op_parity.py tests/test_cpu_paths.py", the default all of tests/)
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
    parity) timeout 540 python3 -m pytest tests/test_op_parity.py tests/test_plain_torch.py tests/test_op_fp8_cache.py -k cuda -q -rf --maxfail=15 -p no:cacheprovider ;;
    serving)  timeout 420 python3 -m pytest tests/test_gpu_serving.py -q -rf -p no:cacheprovider ;;
    overhead) timeout 300 python3 -m pymla overhead --device cuda --json "$out/overhead_h200.json" ;;
    step)     timeout 420 python3 -m pymla step --device cuda --batch 64 --context 1024 --json "$out/step_h200.json" ;;
    dropin)   timeout 540 python3 examples/multi_layer_decode.py --device gpu --compare-with max --tokens 1 --log "$out/max_native_h200.log" &&
              timeout 300 python3 examples/multi_layer_decode.py --device gpu --compare-with max --tokens 2 --log "$out/max_native_h200_2tokens.log" ;;
    sanitize) timeout 570 compute-sanitizer --tool memcheck --error-exitcode 9 --print-limit 20 \
                python3 -m pytest tests/test_op_parity.py -k cuda -q -rf -p no:cacheprovider ;;
    cputarget) lscpu | grep -E "Model name|^Model:|^CPU\(s\)|Flags" | cut -c1-400 &&
               mojo build --print-effective-target &&
               python3 -c "from pymla import cpu_paths as c; print('target', c.compile_target_name(), 'paths', c.kernel_cpu_paths())" ;;
    cpu)      # torch.compile's CPU kernels include Python.h, which the host lacks: the CPython 3.12
              # headers carried with the peers (../shared/peers/pyinc312.tgz), as FlashMLA's build takes them.
              inc=$(python3 -c "import sysconfig; print(sysconfig.get_paths()['include'])")
              if [ ! -f "$inc/Python.h" ] && [ -f ../shared/peers/pyinc312.tgz ]; then
                mkdir -p /tmp/pyinc && tar -xzf ../shared/peers/pyinc312.tgz -C /tmp/pyinc &&
                export CPATH=/tmp/pyinc/python3.12${CPATH:+:$CPATH} && echo "Python.h from the carried headers"
              fi
              timeout 560 python3 -m pytest ${CPU_TESTS:-tests} -k "not cuda" -q -rf -p no:cacheprovider \
                --ignore=tests/test_packaging.py ;;
    *) echo "unknown step $step"; false ;;
  esac > "$out/$step.log" 2>&1
  status=$?
  echo "== $step: exit $status in $(( $(date +%s) - start )) s"
  tail -n 25 "$out/$step.log"
done
