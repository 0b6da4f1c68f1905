#!/usr/bin/env bash
# Runs HERE (no GPU needed): the builds an `ab` call compares, from patches against HEAD.
#
#   scripts/build_ab_devbins.sh NAME=PATCH[+PATCH...] ...
#
# For each NAME: a worktree of HEAD under /tmp/pymla-ab-NAME with the patches applied in order,
# `scripts/build_devbin.sh` there, and its `bench` and `smoke` copied into `.devbin-NAME` (no `lib/`,
# no PTX: the device copies `.devbin/lib` into them). Then every `.devbin-NAME` is packed into
# `.devbin-ab.tgz` (about 2.5 MB a build: untracked and not ignored, so it travels with the working
# tree; delete it after the call), beside `.devbin` (HEAD's build: run `scripts/build_devbin.sh` first,
# and carry it). On the device:
#
#   tar xzf .devbin-ab.tgz && for d in .devbin-*/; do cp -r .devbin/lib "$d"; done
#   bash scripts/device_kernel_profile.sh ab .devbin .devbin-NAME ... CFG...
#
# Two builds run at once (a build takes one to four minutes on two cores).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
venv=$(readlink -f .venv)
[ $# -gt 0 ] || { echo "usage: $0 NAME=PATCH[+PATCH...] ..." >&2; exit 2; }
names=()
for spec in "$@"; do
  name=${spec%%=*}
  patches=${spec#*=}
  [ "$name" != "$spec" ] && [ -n "$name" ] || { echo "expected NAME=PATCH[+PATCH...], got $spec" >&2; exit 2; }
  wt=/tmp/pymla-ab-$name
  git worktree remove --force "$wt" 2>/dev/null || rm -rf "$wt"
  git worktree add --detach "$wt" HEAD >/dev/null
  ln -sfn "$venv" "$wt/.venv"
  IFS=+ read -ra list <<<"$patches"
  for patch in "${list[@]}"; do
    git -C "$wt" apply "$root/$patch"
  done
  names+=("$name")
done
build() {
  local name=$1 wt=/tmp/pymla-ab-$1
  if (cd "$wt" && bash scripts/build_devbin.sh > "$wt/build.log" 2>&1); then
    rm -rf ".devbin-$name" && mkdir -p ".devbin-$name" && cp "$wt/.devbin/bench" "$wt/.devbin/smoke" ".devbin-$name/"
    echo "built .devbin-$name ($(tail -n 1 "$wt/build.log"))"
  else
    echo "build of $name failed: $wt/build.log" >&2
    return 1
  fi
}
status=0
for ((i = 0; i < ${#names[@]}; i += 2)); do
  pids=()
  for name in "${names[@]:i:2}"; do
    build "$name" & pids+=($!)
  done
  for pid in "${pids[@]}"; do wait "$pid" || status=1; done
done
[ $status -eq 0 ] || exit 1
tar czf .devbin-ab.tgz "${names[@]/#/.devbin-}"
echo "packed .devbin-ab.tgz ($(du -h .devbin-ab.tgz | cut -f1)): ${names[*]/#/.devbin-}"
