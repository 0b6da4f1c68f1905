#!/usr/bin/env bash
# Session 21, call 5: why the merge branch is slow: .devbin-mg (8 partitions a round trip, nvvm.minctasm 8,
# 64 registers, 96 bytes spilled) and .devbin-mg2 (4 a round trip, no register cap) against main.
set -u
mkdir -p $OUT
timeout 300 bash scripts/device_kernel_profile.sh ab .devbin-m .devbin-mg .devbin-mg2 8:128:8191:20:plan-only 8:16:8191:20:plan-only 2>&1 | tail -6
rm -rf .devbin; ln -s .devbin-mg2 .devbin
OUT=$OUT timeout 150 bash scripts/device_kernel_profile.sh breakdown 8:128:8191:3:plan-only 2>&1 | grep -A1 merge_merge
