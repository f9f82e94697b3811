#!/usr/bin/env bash
# The whole system on one machine, on the embedded default model:
#   local control plane -> Helm chart -> operator (as the chart's ServiceAccount) -> example
#   CompletionService on the CPU engine -> real runtimes on the pods' loopback IPs.
#
#   hack/demo.sh up     bring it up (a second run reuses what is running), print a streamed completion
#   hack/demo.sh down   stop everything and delete the cluster
set -euo pipefail

HACK=$(cd "$(dirname "$0")" && pwd)
ROOT=$(dirname "$HACK")
DIR=$ROOT/.tally/demo
PY=${PYTHON:-$ROOT/.venv/bin/python}
NS=demo
RELEASE=tally-operator
log() { echo "[demo] $*" >&2; }

alive() { [[ -f $DIR/$1.pid ]] && kill -0 "$(cat "$DIR/$1.pid")" 2>/dev/null; }

background() { # background <name> <command...>
  local name=$1; shift
  alive "$name" && return
  setsid "$@" >"$DIR/$name.log" 2>&1 < /dev/null &
  echo $! > "$DIR/$name.pid"
}

stop() {
  alive "$1" || { rm -f "$DIR/$1.pid"; return; }
  local pid; pid=$(cat "$DIR/$1.pid")
  kill -TERM "$pid" 2>/dev/null || true
  for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
  kill -KILL -- "-$pid" 2>/dev/null || true
  rm -f "$DIR/$1.pid"
}

up() {
  mkdir -p "$DIR"
  "$HACK/cluster.sh" up
  eval "$("$HACK/cluster.sh" env)"
  export KUBECONFIG PATH="$("$HACK/build.sh" --print):$PATH"
  log "installing the chart"
  # Helm installs CRDs but never upgrades them: a cluster that is already up gets the current one.
  kubectl apply --server-side --force-conflicts -f "$ROOT/crds/serving.tally.dev_completionservices.yaml" >/dev/null
  helm upgrade --install "$RELEASE" "$ROOT/charts/tally-operator" -n tally-system --create-namespace \
    --set-json 'tolerations=[{"key":"nvidia.com/gpu","operator":"Exists","effect":"NoSchedule"}]' \
    --wait --timeout 120s >/dev/null
  # The operator runs here as a process (kwok pods run no containers), with the chart's ServiceAccount token.
  "$PY" - "$DIR/operator.kubeconfig" <<'PYEOF'
import json, subprocess, sys
token = subprocess.run(["kubectl", "create", "token", "tally-operator", "-n", "tally-system", "--duration=24h"],
                       check=True, capture_output=True, text=True).stdout.strip()
view = json.loads(subprocess.run(["kubectl", "config", "view", "--raw", "--minify", "-o", "json"], check=True,
                                 capture_output=True, text=True).stdout)
open(sys.argv[1], "w").write(json.dumps({"apiVersion": "v1", "kind": "Config", "current-context": "sa",
    "clusters": [{"name": "c", "cluster": view["clusters"][0]["cluster"]}],
    "users": [{"name": "sa", "user": {"token": token}}],
    "contexts": [{"name": "sa", "context": {"cluster": "c", "user": "sa"}}]}))
PYEOF
  KUBECONFIG=$DIR/operator.kubeconfig TALLY_OPERATOR_METRICS_PORT=19090 TALLY_OPERATOR_STATUS_INTERVAL=2 \
    background operator "$PY" -m tally_operator --liveness=http://127.0.0.1:18080/healthz
  PATH="$(dirname "$PY"):$PATH" background pods "$PY" "$HACK/pod_runner.py" --log-dir "$DIR/pods"
  kubectl get namespace "$NS" >/dev/null 2>&1 || kubectl create namespace "$NS" >/dev/null
  kubectl apply -n "$NS" -f "$ROOT/crds/examples/smollm-cpu.yaml" >/dev/null
  log "waiting for the CompletionService to be Ready and UsageHealthy"
  local deadline=$((SECONDS + 300))
  until [[ $(kubectl get completionservice smollm -n "$NS" \
      -o jsonpath='{.status.conditions[?(@.type=="Ready")].status}{.status.conditions[?(@.type=="UsageHealthy")].status}' \
      2>/dev/null) == TrueTrue ]]; do
    ((SECONDS < deadline)) || { log "not ready after 300s; logs in $DIR"; exit 1; }
    sleep 1
  done
  local ip; ip=$(kubectl get pods -n "$NS" -l serving.tally.dev/completionservice=smollm \
    -o jsonpath='{.items[0].status.podIP}')
  "$PY" "$HACK/demo_client.py" "http://$ip:8000/v1"
  kubectl get completionservices -n "$NS"
  log "up. Pods serve on their IPs (kubectl get pods -n $NS -o wide); operator metrics: http://127.0.0.1:19090/metrics"
  log "$("$HACK/cluster.sh" env); take it all down with: make down"
}

down() {
  stop pods
  stop operator
  "$HACK/cluster.sh" down
  rm -rf "$DIR"
}

case ${1:-} in
  up) up ;;
  down) down ;;
  *) echo "usage: $0 up|down" >&2; exit 2 ;;
esac
