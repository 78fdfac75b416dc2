#!/usr/bin/env bash
# The deployment walk-through (docs/deployment.md) on one machine: a SuperLink with TLS and SuperNode
# authentication, two registered SuperNodes (site0 takes partition 0 of the run's dataset,
# site1 reads its own data-dir), one two-round experiment, then everything is stopped.
# On real machines run the same `fedapp deploy` steps on each machine instead (see docs/deployment.md).
#
#   bash scripts/deploy/local-demo.sh [DIR]      (DIR: the deployment folder, default ./deployment)
set -euo pipefail
cd "$(dirname "$0")/../.."
FEDAPP=.venv/bin/fedapp
DIR=${1:-deployment}
PORT=${SUPERLINK_PORT:-9092}
RUN=(smoke --set 'method="lg-fedavg"' --set num-clients=2 --set 'arch-mix="cnn5,cnn4"')

pids=()
stop() {  # each step runs in its own process group: stop the groups, i.e. Flower's children too
  for pid in "${pids[@]}"; do kill -TERM -- "-$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
}
trap stop EXIT

mkdir -p "$DIR/logs"
$FEDAPP deploy certs --dir "$DIR"
$FEDAPP deploy node-key site0 site1 --dir "$DIR"
$FEDAPP deploy export-shard "${RUN[@]}" --partition-id 1 --out "$DIR/site1-data"

setsid $FEDAPP deploy superlink --dir "$DIR" --port "$PORT" > "$DIR/logs/superlink.log" 2>&1 &
pids+=($!)
for _ in $(seq 60); do (exec 3<>"/dev/tcp/127.0.0.1/$PORT") 2>/dev/null && break; sleep 1; done
$FEDAPP deploy connect "127.0.0.1:$PORT" --dir "$DIR"
$FEDAPP deploy register "$DIR/keys/site0.pub" "$DIR/keys/site1.pub" --dir "$DIR"

setsid $FEDAPP deploy supernode --dir "$DIR" --superlink "127.0.0.1:$PORT" \
  --key "$DIR/keys/site0.key" --port 9094 \
  --node-config 'partition-id=0 num-partitions=2' > "$DIR/logs/site0.log" 2>&1 &
pids+=($!)
setsid $FEDAPP deploy supernode --dir "$DIR" --superlink "127.0.0.1:$PORT" \
  --key "$DIR/keys/site1.key" --port 9095 \
  --node-config "partition-id=1 num-partitions=2 data-dir=\"$(realpath "$DIR/site1-data")\"" \
  > "$DIR/logs/site1.log" 2>&1 &
pids+=($!)

$FEDAPP deploy run "${RUN[@]}" --dir "$DIR" --output-dir "$DIR/results"
