#!/usr/bin/env bash
# Compile CONFIG for a TPU topology on THIS machine (no TPU needed: libtpu's compiler + AOT),
# before paying for the pod: fails if the program does not compile or does not fit in HBM.
#   TOPOLOGY=v5p-64 CONFIG=configs/qwen3_30b_a3b.yaml ./tpu_scripts/compile_check.sh
# Needs the repo installed with the `tpu` extra here (pip install -e ".[tpu]").
# Settings: CONFIG, TOPOLOGY (empty = TPU_TYPE), TPU_TYPE, TRAIN_ARGS (common.sh).
set -euo pipefail
# The jax-rl executable to use (e.g. .venv/bin/jax-rl).
JAX_RL="${JAX_RL:-jax-rl}"
# shellcheck source=tpu_scripts/common.sh
source "$(dirname "$0")/common.sh"

topology="${TOPOLOGY:-$TPU_TYPE}"
# Compile for the TPU, run on the CPU: never try to open a TPU on this host.
export JAX_PLATFORMS=cpu
# shellcheck disable=SC2086  # TRAIN_ARGS is a list of key=value words
"$JAX_RL" compile "$CONFIG" --topology "$topology" $TRAIN_ARGS
