for r in 1 2; do
for v in old new; do
  if [ $v = old ]; then PP=/tmp/wt_old; else PP=/work/main; fi
  for c in "128 1 4095" "16 1 4095" "16 8 16383" "128 8 16383"; do
    set -- $c
    echo -n "$v r$r: "; cd /tmp && PYTHONPATH=$PP HEADS=$1 B=$2 CTX=$3 timeout 600 /work/main/.nox/tests/bin/python timing.py steps 2>&1 | grep -v Crash | tr '\n' ' '; echo
  done
done
done
