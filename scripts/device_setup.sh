#!/usr/bin/env bash
# Runs ON the device machine, in the repo root, once every part is staged:
#   bash scripts/device_setup.sh
#
# Checks the staged chunks against the MANIFEST, reassembles the wheel tar in
# /tmp/stage, installs ALL wheels into /tmp/site with ONE pip command (a second
# `pip --target` would replace the shared modular/ folder and break the first
# install, so a finished install is marked and never repeated), then checks
# that MAX sees the GPU. It exports nothing for the caller: it prints the
# export line each later command must start with.
set -euo pipefail

STAGE=${STAGE:-/tmp/stage}
SITE=${SITE:-/tmp/site}
MARK="$SITE/.pymla_wheels_installed"
t0=$(date +%s)

if [[ -f "$MARK" ]]; then
    echo "wheels already installed in $SITE ($(cat "$MARK")): not reinstalling"
else
    manifest="$STAGE/MANIFEST"
    [[ -f "$manifest" ]] || {
        echo "SETUP ERROR: no $manifest: stage the parts first" >&2
        exit 2
    }
    total=$(awk '/^chunks /{print $2}' "$manifest")
    missing=0
    while read -r _ name sha _; do
        if [[ ! -f "$STAGE/$name" ]]; then
            echo "SETUP ERROR: $name missing from $STAGE" >&2
            missing=1
        elif [[ "$(sha256sum "$STAGE/$name" | cut -d' ' -f1)" != "$sha" ]]; then
            echo "SETUP ERROR: $name corrupt (sha256 mismatch)" >&2
            missing=1
        fi
    done < <(grep '^chunk ' "$manifest")
    if ((missing)); then
        echo "restage the parts named above (from part 1 if the machine was reset)" >&2
        exit 3
    fi
    rm -rf "$STAGE/w"
    cat "$STAGE"/wheels.tar.part* | tar -xf - -C "$STAGE"
    rm -f "$STAGE"/wheels.tar.part*
    echo "reassembled $total chunks: $(ls "$STAGE"/w/*.whl | wc -l) wheels"
    ls "$STAGE"/w/*.whl | xargs -n1 basename | sed 's/^/  /'
    rm -rf "$SITE"
    PIP_ROOT_USER_ACTION=ignore python3 -m pip install -q --no-index --no-deps --no-compile \
        --target "$SITE" "$STAGE"/w/*.whl
    echo "installed $(date -u +%FT%TZ)" >"$MARK"
    echo "pip install into $SITE took $(($(date +%s) - t0)) s"
fi

export PYTHONPATH="$SITE:$PWD"
export PATH="$SITE/bin:$PATH"
python3 - <<'EOF'
import importlib.metadata as md
import sys

import max.driver as d
import max.engine  # noqa: F401
import max.graph  # noqa: F401

try:
    import torch

    tv = f"torch {torch.__version__}, cuda available {torch.cuda.is_available()}"
except Exception as exc:  # noqa: BLE001
    tv = f"torch import failed: {exc!r}"
print(f"python {sys.version.split()[0]}; max {md.version('max')}; {tv}")
print("accelerator_count", d.accelerator_count())
if d.accelerator_count() < 1:
    sys.exit("SETUP ERROR: MAX sees no accelerator")
acc = d.Accelerator(0)
print("accelerator", acc.label, getattr(acc, "architecture_name", "?"))
EOF
if command -v mojo >/dev/null; then
    echo "mojo on PATH: $(command -v mojo) ($(mojo --version 2>&1 | head -1))"
fi
echo "setup OK in $(($(date +%s) - t0)) s. Start every later command with:"
echo "export PYTHONPATH=$SITE:\$PWD PATH=$SITE/bin:\$PATH PYTHONUNBUFFERED=1"
