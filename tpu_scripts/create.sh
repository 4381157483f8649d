#!/usr/bin/env bash
# Create a TPU pod slice through a queued resource and wait until it is ACTIVE.
#   TPU_TYPE=v5p-64 PROJECT=my-proj ZONE=us-east5-a ./tpu_scripts/create.sh
# Settings: PROJECT, ZONE, QR_ID, NODE_ID, TPU_TYPE, RUNTIME_VERSION, PROVISIONING
# (see common.sh). Run compile_check.sh first: it is free, the pod is not.
set -euo pipefail
# Seconds between state polls, and how long to wait for ACTIVE before giving up (0 = forever).
POLL_S="${POLL_S:-30}"
WAIT_S="${WAIT_S:-0}"
# shellcheck source=tpu_scripts/common.sh
source "$(dirname "$0")/common.sh"

version="$(runtime_version "$TPU_TYPE")"
extra=()
if [[ -n "$PROVISIONING" ]]; then
  extra+=("$PROVISIONING")
fi
gcloud compute tpus queued-resources create "$QR_ID" \
  --node-id="$NODE_ID" --project="$PROJECT" --zone="$ZONE" \
  --accelerator-type="$TPU_TYPE" --runtime-version="$version" "${extra[@]}"

start=$(date +%s)
while true; do
  state="$(gcloud compute tpus queued-resources describe "$QR_ID" --project="$PROJECT" \
    --zone="$ZONE" --format='value(state.state)')"
  echo "$(date -u +%H:%M:%S) $QR_ID: $state"
  case "$state" in
    ACTIVE) break ;;
    FAILED|SUSPENDED) echo "queued resource $QR_ID is $state" >&2; exit 1 ;;
  esac
  if (( WAIT_S > 0 && $(date +%s) - start > WAIT_S )); then
    echo "gave up after ${WAIT_S}s; the request stays queued (delete: gcloud compute tpus queued-resources delete $QR_ID --zone=$ZONE)" >&2
    exit 2
  fi
  sleep "$POLL_S"
done
echo "pod $NODE_ID ($TPU_TYPE) is ready: next ./tpu_scripts/setup.sh"
