#!/usr/bin/env bash
# Runs ON the H200 machine: pymla (the carried .devbin, no MAX needed) and its peers at the shapes
# of issue 23, all in ONE call, so every ratio comes from one run (the issue's rule). Writes into
# $OUT the inputs of `python -m pymla.tools.peers FOLDER` (run here afterwards): gpu_both.log
# (step 5 alone and the whole op, `gpu_bench both`), peers.json (FlashMLA, and Triton with
# PEERS_WHICH=flashmla,triton) and, when FlashInfer's wheels are staged, flashinfer.json.
#
#   calls 1 and 2 (optional, FlashInfer's wheel in halves: scripts/device_stage_flashinfer.sh),
#       carry [".whl/fi/a1"]: bash scripts/device_stage_flashinfer.sh 1
#       (FlashMLA's build may start here already, `bash .peers/flashmla_start.sh` with ".peers" carried:
#       call 3 then reuses it)
#       carry [".whl/fi/a2"]: bash scripts/device_stage_flashinfer.sh 2
#   call 3, carry [".devbin", ".peers"] (+ ".whl/fi/b" after calls 1-2), timeout_s 600:
#       bash scripts/device_gpu_vs_peers.sh
#
# (.devbin: scripts/build_devbin.sh, or a branch's build carried under another name and moved
# to .devbin first; .peers: a copy of ../shared/peers.) Order: FlashMLA's build starts in the
# background (CPU only); FlashInfer JIT-compiles and times meanwhile; then FlashMLA; pymla last,
# once no compiler competes for the host's cores.
set -u
out=${OUT:-/tmp/pymla-out}
mkdir -p "$out"
# pymla's shapes: issue 23's; PYMLA_CFGS (space-separated) replaces them, e.g. issue 24's with the fp8
# cache beside the bf16 one: PYMLA_CFGS="128:16:32767:5:fp8 8:16:8191:5:fp8 64:128:8191:5:fp8"
read -r -a CFGS <<< "${PYMLA_CFGS:-64:128:8191:5 128:128:32767:5 8:128:8191:5 128:16:32767:5 64:16:8191:5 8:16:8191:5}"
SHAPES=(--heads 16,128 --batches 8,64,128 --contexts 8192,32768)
start=$(date +%s)
stamp() { echo "[$(( $(date +%s) - start )) s] $*"; }

# A build started by an earlier call on this warm machine (e.g. beside FlashInfer's staging) is kept.
if [ "$(cat /tmp/fmla_build.rc 2> /dev/null)" = 0 ] || pgrep -f flashmla_build.py > /dev/null; then
  echo "FlashMLA: the build of an earlier call on this machine (finished or running) is reused"
else
  bash .peers/flashmla_start.sh
fi
if [ -d .whl/fi/b ] && ls /tmp/fi_stage/flashinfer_python-*.whl > /dev/null 2>&1; then
  cp .whl/fi/b/*.whl /tmp/fi_stage/
  pip install -q --no-index --no-deps --no-compile --target /tmp/fi /tmp/fi_stage/*.whl
  stamp "FlashInfer"
  PYTHONPATH=/tmp/fi PATH=/tmp/fi/bin:$PATH timeout 200 python3 scripts/flashinfer_peer.py "${SHAPES[@]}" \
    --json "$out/flashinfer.json" > "$out/flashinfer.log" 2>&1 || echo "flashinfer_peer: exit $?"
else
  echo "FlashInfer not staged (call 1, and .whl/fi/b in this call's carry): left out"
fi
stamp "waiting for FlashMLA's build"
for _ in $(seq 1 150); do [ -f /tmp/fmla_build.rc ] && break; sleep 2; done
echo "FlashMLA build exit: $(cat /tmp/fmla_build.rc 2> /dev/null || echo 'not finished')"
stamp "FlashMLA"
timeout 200 python3 .peers/peers.py "${SHAPES[@]}" --which "${PEERS_WHICH:-flashmla}" --budget 180 \
  --json "$out/peers.json" > "$out/peers.log" 2>&1 || echo "peers.py: exit $?"
stamp "pymla: step 5 alone, then the whole op, one random case per shape"
LD_LIBRARY_PATH=$PWD/.devbin/lib timeout 400 .devbin/bench both "${CFGS[@]}" > "$out/gpu_both.log" 2>&1 \
  || echo "gpu_bench both: exit $?"
stamp "done"
grep -h -E "^copy|op's plan|best of 2" "$out/gpu_both.log" | head -60
