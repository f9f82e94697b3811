#!/usr/bin/env bash
# The whole system on one machine, on the embedded default model:
#   cluster with a real node -> Helm chart (the operator image, 2 replicas with peering) -> example
#   CompletionService on the CPU engine (2 runtime pods from the runtime image) -> a completion streamed
#   through the Service's ClusterIP by the openai SDK in a one-shot Job.
#
#   hack/demo.sh up     bring it up (a second run reuses what is running), print a streamed completion
#   hack/demo.sh down   stop everything and delete the cluster
set -euo pipefail

HACK=$(cd "$(dirname "$0")" && pwd)
ROOT=$(dirname "$HACK")
DIR=$(realpath -m "${TALLY_CLUSTER_DIR:-$ROOT/.tally/cluster}")
NS=demo
RELEASE=tally-operator
VERSION=$(sed -n 's/^version = "\(.*\)"/\1/p' "$ROOT/pyproject.toml" | head -n 1)
log() { echo "[demo] $*" >&2; }

wait_until() { # wait_until <seconds> <description> <command...>
  local seconds=$1 what=$2; shift 2
  local deadline=$((SECONDS + seconds))
  until "$@" >/dev/null 2>&1; do
    ((SECONDS < deadline)) || { log "$what: not reached in ${seconds}s"; kubectl get pods -A -o wide >&2; exit 1; }
    sleep 1
  done
}

ready_and_healthy() {
  [[ $(kubectl get completionservice smollm -n "$NS" \
    -o jsonpath='{.status.conditions[?(@.type=="Ready")].status}{.status.conditions[?(@.type=="UsageHealthy")].status}') \
    == TrueTrue ]]
}

up() {
  "$HACK/images.sh" >/dev/null
  "$HACK/cluster.sh" up
  eval "$("$HACK/cluster.sh" env)"
  export KUBECONFIG PATH="$("$HACK/build.sh" --print):$PATH"
  log "installing the chart: the operator as 2 pods of its image"
  # The CompletionService CRD is part of the release and upgraded with it; --take-ownership adopts one a
  # cluster got from an earlier chart (0.1 installed it from crds/, which Helm never upgrades)
  helm upgrade --install "$RELEASE" "$ROOT/charts/tally-operator" -n tally-system --create-namespace \
    --take-ownership --force-conflicts \
    --set replicaCount=2 --set statusIntervalSeconds=2 --wait --timeout 180s >/dev/null
  kubectl get namespace "$NS" >/dev/null 2>&1 || kubectl create namespace "$NS" >/dev/null
  kubectl apply -n "$NS" -f "$ROOT/crds/examples/smollm-cpu.yaml" >/dev/null
  # Rebuilt images keep their tags: pods of a demo that was already up restart onto them.
  local images; images=$(readlink "$("$HACK/images.sh" --print)"/*.tar | sort | sha256sum)
  if [[ -f $DIR/images && $(cat "$DIR/images") != "$images" ]]; then
    log "images changed: restarting the operator and the example's pods"
    kubectl rollout restart -n tally-system "deployment/$RELEASE" >/dev/null
    kubectl rollout restart -n "$NS" deployment/smollm >/dev/null 2>&1 || true
    # the status still says Ready from before the restart: wait for the new pods first
    kubectl rollout status -n tally-system "deployment/$RELEASE" --timeout=180s >/dev/null
    kubectl rollout status -n "$NS" deployment/smollm --timeout=300s >/dev/null 2>&1 || true
  fi
  echo "$images" > "$DIR/images"
  log "waiting for the CompletionService to be Ready and UsageHealthy"
  wait_until 300 "smollm Ready and UsageHealthy" ready_and_healthy
  local endpoint ip
  endpoint=$(kubectl get completionservice smollm -n "$NS" -o jsonpath='{.status.endpoint}')
  ip=$(kubectl get service smollm -n "$NS" -o jsonpath='{.spec.clusterIP}')
  log "streaming a completion from a pod through the Service, by the name the status gives: $endpoint"
  kubectl delete job demo-client -n "$NS" --ignore-not-found >/dev/null
  kubectl create job demo-client -n "$NS" --image="tally-client:$VERSION" -- \
    tally-demo-client "$endpoint" >/dev/null
  wait_until 120 "the demo client Job" kubectl wait --for=condition=Complete job/demo-client -n "$NS" --timeout=5s
  kubectl logs -n "$NS" job/demo-client
  kubectl get pods -n tally-system -o wide
  kubectl get pods -n "$NS" -o wide
  kubectl get completionservices -n "$NS"
  log "up. For kubectl and the cluster's SOCKS relay: eval \"\$(make env)\" (the relay's password stays in its file)"
  log "then, from this machine: curl -K \"\$TALLY_CURLRC\" http://$ip:8000/v1/models; take it all down with: make down"
}

down() {
  "$HACK/cluster.sh" down
}

case ${1:-} in
  up) up ;;
  down) down ;;
  *) echo "usage: $0 up|down" >&2; exit 2 ;;
esac
