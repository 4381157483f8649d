#!/usr/bin/env bash
# Shared settings of the tpu_scripts. Every variable a user sets is here, with a default that
# an environment variable of the same name overrides (e.g. `TPU_TYPE=v5p-64 ./create.sh`).
# Sourced by create.sh, setup.sh, launch.sh and compile_check.sh; not run on its own.

# Google Cloud project and zone that hold the TPU quota.
PROJECT="${PROJECT:-my-gcp-project}"
ZONE="${ZONE:-us-east5-a}"
# Name of the queued resource and of the TPU VM (node) it creates.
QR_ID="${QR_ID:-jax-rl-qr}"
NODE_ID="${NODE_ID:-jax-rl-pod}"
# Accelerator type: v4-8, v5litepod-8 (v5e), v5p-8, v5p-64, v6e-8, ...
TPU_TYPE="${TPU_TYPE:-v5p-8}"
# TPU VM software image; empty = chosen from TPU_TYPE (see runtime_version below).
RUNTIME_VERSION="${RUNTIME_VERSION:-}"
# Provisioning model: "" (on demand / reserved quota), "--spot" or "--reserved".
PROVISIONING="${PROVISIONING:-}"
# Git repository and ref every worker checks out, and where.
REPO_URL="${REPO_URL:-https://github.com/your-org/jax-rl.git}"
REPO_REF="${REPO_REF:-main}"
REMOTE_DIR="${REMOTE_DIR:-jax-rl}"
# Python on the TPU VM image (the project needs 3.11).
REMOTE_PYTHON="${REMOTE_PYTHON:-python3.11}"
# Training config (path inside the repo) and extra `key=value` overrides for `jax-rl train`.
CONFIG="${CONFIG:-configs/qwen3_4b.yaml}"
TRAIN_ARGS="${TRAIN_ARGS:-}"
# Where each worker writes its log (relative to REMOTE_DIR); one file per worker.
LOG_DIR="${LOG_DIR:-logs}"
# Topology for compile_check.sh (jax.experimental.topologies name, e.g. v5e:2x2, v5p:2x2x4)
# or a Cloud TPU type (v5p-64); empty = TPU_TYPE.
TOPOLOGY="${TOPOLOGY:-}"

# TPU VM image for an accelerator type (Cloud TPU docs, "TPU VM software versions").
runtime_version() {
  if [[ -n "$RUNTIME_VERSION" ]]; then
    echo "$RUNTIME_VERSION"
    return
  fi
  case "$1" in
    v4-*) echo "tpu-ubuntu2204-base" ;;
    v5litepod-*|v5e-*) echo "v2-alpha-tpuv5-lite" ;;
    v5p-*) echo "v2-alpha-tpuv5" ;;
    v6e-*) echo "v2-alpha-tpuv6e" ;;
    *) echo "unknown TPU_TYPE '$1': set RUNTIME_VERSION" >&2; return 1 ;;
  esac
}

# Run a command on every worker of the pod slice.
on_all_workers() {
  gcloud compute tpus tpu-vm ssh "$NODE_ID" --project="$PROJECT" --zone="$ZONE" \
    --worker=all --command="$1"
}
