#!/usr/bin/env bash
# Runs ON the device: stages FlashInfer's wheel for scripts/device_gpu_vs_peers.sh in two calls on one
# warm machine (the wheel is 62 MB; a call carries at most 64 MiB with the working tree):
#   call 1, carry [".whl/fi/a1"]:  bash scripts/device_stage_flashinfer.sh 1
#   call 2, carry [".whl/fi/a2"]:  bash scripts/device_stage_flashinfer.sh 2
# then the peers call with ".whl/fi/b" in its carry. Exit 3: the machine was reset between the calls.
set -eu
stage=/tmp/fi_stage
mkdir -p "$stage"
case ${1:-} in
  1) cp .whl/fi/a1/fi.part0 "$stage/" && echo "staged half 1: $(stat -c %s "$stage/fi.part0") bytes" ;;
  2)
    if [ ! -f "$stage/fi.part0" ]; then echo "MACHINE NOT WARM: half 1 is gone, stage it again"; exit 3; fi
    name=$(cat .whl/fi/a2/NAME)
    cat "$stage/fi.part0" .whl/fi/a2/fi.part1 > "$stage/$name"
    rm "$stage/fi.part0"
    if [ "$(sha256sum "$stage/$name" | cut -d' ' -f1)" != "$(cat .whl/fi/a2/SHA256)" ]; then
      echo "SETUP ERROR: $name does not match its sha256"; rm -f "$stage/$name"; exit 1
    fi
    echo "staged $name (sha256 OK)" ;;
  *) echo "usage: device_stage_flashinfer.sh 1|2"; exit 2 ;;
esac
