#!/usr/bin/env bash
# Clone the repo at REPO_REF and install it with the `tpu` extra (jax + the matching libtpu)
# in a venv on every worker of the pod slice.
#   ./tpu_scripts/setup.sh
# Settings: PROJECT, ZONE, NODE_ID, REPO_URL, REPO_REF, REMOTE_DIR, REMOTE_PYTHON (common.sh).
set -euo pipefail
# shellcheck source=tpu_scripts/common.sh
source "$(dirname "$0")/common.sh"

# The remote script: $-expansions with a backslash run on the worker.
remote="set -euo pipefail
if [ -d $(printf %q "$REMOTE_DIR")/.git ]; then
  git -C $(printf %q "$REMOTE_DIR") fetch --quiet origin
else
  git clone --quiet $(printf %q "$REPO_URL") $(printf %q "$REMOTE_DIR")
fi
cd $(printf %q "$REMOTE_DIR")
git checkout --quiet $(printf %q "$REPO_REF")
git pull --quiet --ff-only || true
[ -x .venv/bin/python ] || $(printf %q "$REMOTE_PYTHON") -m venv .venv
.venv/bin/pip install --quiet --upgrade pip
.venv/bin/pip install --quiet -e '.[tpu]'
.venv/bin/pip install --quiet --no-deps google-jetstream==0.2.2
.venv/bin/python -c 'import jax; print(jax.process_index(), jax.device_count(), jax.devices()[0].device_kind)'
"
on_all_workers "$remote"
echo "every worker of $NODE_ID has $REMOTE_DIR at $REPO_REF: next ./tpu_scripts/launch.sh"
