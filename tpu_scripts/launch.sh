#!/usr/bin/env bash
# Start `jax-rl train CONFIG TRAIN_ARGS` on every worker at once (one process per host; the
# processes find each other through jax.distributed's TPU auto-detection). Each worker logs
# to REMOTE_DIR/LOG_DIR/worker-<hostname>.log; the run keeps going if this shell exits.
#   CONFIG=configs/qwen3_4b.yaml TRAIN_ARGS="run.dir=gs://bucket/run1" ./tpu_scripts/launch.sh
# Settings: PROJECT, ZONE, NODE_ID, REMOTE_DIR, CONFIG, TRAIN_ARGS, LOG_DIR (common.sh).
# Follow a worker: gcloud compute tpus tpu-vm ssh NODE_ID --zone ZONE --worker=0 \
#   --command "tail -f REMOTE_DIR/LOG_DIR/worker-*.log"
set -euo pipefail
# Set to 1 to stop a previous `jax-rl train` on the workers before starting (a TPU chip can
# only be held by one process).
KILL_PREVIOUS="${KILL_PREVIOUS:-1}"
# shellcheck source=tpu_scripts/common.sh
source "$(dirname "$0")/common.sh"

kill_cmd=":"
if [[ "$KILL_PREVIOUS" == "1" ]]; then
  # the pid file written by the previous launch; never a pattern kill
  kill_cmd="if [ -f $(printf %q "$LOG_DIR")/train.pid ]; then kill \$(cat $(printf %q "$LOG_DIR")/train.pid) 2>/dev/null || true; sleep 5; fi"
fi
remote="set -euo pipefail
cd $(printf %q "$REMOTE_DIR")
mkdir -p $(printf %q "$LOG_DIR")
$kill_cmd
unset JAX_PLATFORMS
nohup .venv/bin/jax-rl train $(printf %q "$CONFIG") $TRAIN_ARGS \
  > $(printf %q "$LOG_DIR")/worker-\$(hostname).log 2>&1 < /dev/null &
echo \$! > $(printf %q "$LOG_DIR")/train.pid
echo \"\$(hostname): started pid \$(cat $(printf %q "$LOG_DIR")/train.pid)\"
"
on_all_workers "$remote"
