# device: the op through MAX, main's task runner vs self-scheduling, alternated (issue 22).
# hostab/simd_main.mojo.txt was `git show 0e0d3f8:mojo_kernels/cpu/simd.mojo`, hostab/simd_ss.mojo.txt
# the file as committed in 461aa47 (both carried in the working tree for the call, not kept).
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
grep -m1 "model name" /proc/cpuinfo
for r in 1 2; do for v in main ss; do
  cp hostab/simd_$v.mojo.txt mojo_kernels/cpu/simd.mojo
  PYMLA_CACHE_DIR=/tmp/pc-$v timeout 250 python3 -m pymla bench --heads 16 128 --batch 8 --context 16384 --cache-format dtype ${FMT:-} --rounds ${ROUNDS:-2} --output-dir $OUT/bench-$v-$r > $OUT/bench-$v-$r.log 2>&1
  echo "== $v round $r exit $?"; grep -E "^ +(16|128) " $OUT/bench-$v-$r.log
done; done
