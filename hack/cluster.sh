#!/usr/bin/env bash
# A real Kubernetes control plane on loopback: etcd, kube-apiserver, kube-controller-manager,
# kube-scheduler and kwok (fake GPU nodes whose pod IPs are 127.x addresses).
#
#   hack/cluster.sh up     start it (idempotent: a healthy cluster is left as it is)
#   hack/cluster.sh down   stop every process and delete the cluster's state
#   hack/cluster.sh env    print `export KUBECONFIG=...` for this cluster
#   hack/cluster.sh status exit 0 when the cluster is up and ready
#
# Everything binds and advertises 127.0.0.1: no traffic leaves loopback. State and logs live in
# $TALLY_CLUSTER_DIR (default: .tally/cluster in the repository).
set -euo pipefail

HACK=$(cd "$(dirname "$0")" && pwd)
ROOT=$(dirname "$HACK")
DIR=${TALLY_CLUSTER_DIR:-$ROOT/.tally/cluster}
PKI=$DIR/pki
LOGS=$DIR/logs
RUN=$DIR/run
KUBECONFIG_FILE=$DIR/admin.kubeconfig
ETCD_PORT=${TALLY_ETCD_PORT:-23790}
API_PORT=${TALLY_API_PORT:-16443}
KCM_PORT=${TALLY_KCM_PORT:-20257}
SCHED_PORT=${TALLY_SCHEDULER_PORT:-20259}
KWOK_PORT=${TALLY_KWOK_PORT:-20247}
GPU_NODES=${TALLY_GPU_NODES:-2}
# Pod IPs are $POD_NET.<node>.x: a second cluster (the test suite's) uses other addresses, so runtimes
# started on one cluster's pod IPs never collide with the other's.
POD_NET=${TALLY_POD_NET:-127.10}
KWOK_CIDR=${TALLY_KWOK_CIDR:-127.20.0.0/16}
GPUS_PER_NODE=${TALLY_GPUS_PER_NODE:-8}

log() { echo "[cluster] $*" >&2; }
die() { log "ERROR: $*"; exit 1; }

bins() {
  BIN=$("$HACK/build.sh" 2>"$DIR/build.log" | tail -n 1) || { cat "$DIR/build.log" >&2; die "build failed"; }
  export PATH="$BIN:$PATH"
}

# wait_for <seconds> <description> <command...>: poll with a deadline, never a fixed sleep
wait_for() {
  local deadline=$((SECONDS + $1)) what=$2; shift 2
  until "$@" >/dev/null 2>&1; do
    ((SECONDS < deadline)) || die "timed out after $1s waiting for $what (logs: $LOGS)"
    sleep 0.2
  done
}

api_ready() {
  curl -sf --cacert "$PKI/ca.crt" --cert "$PKI/admin.crt" --key "$PKI/admin.key" \
    "https://127.0.0.1:$API_PORT/readyz" | grep -qx ok
}

# start <name> <command...>: a background process in its own session, with a pid file and a log
start() {
  local name=$1; shift
  setsid "$@" >"$LOGS/$name.log" 2>&1 < /dev/null &
  echo $! > "$RUN/$name.pid"
}

alive() { [[ -f $RUN/$1.pid ]] && kill -0 "$(cat "$RUN/$1.pid")" 2>/dev/null; }

make_pki() {
  [[ -f $PKI/admin.crt ]] && return
  mkdir -p "$PKI"; cd "$PKI"
  openssl req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.crt -days 3650 -subj "/CN=tally-local-ca" 2>/dev/null
  openssl req -newkey rsa:2048 -nodes -keyout apiserver.key -out apiserver.csr -subj "/CN=kube-apiserver" 2>/dev/null
  printf 'subjectAltName=IP:127.0.0.1,IP:10.0.0.1,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local\nextendedKeyUsage=serverAuth\n' > server.ext
  openssl x509 -req -in apiserver.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days 3650 -out apiserver.crt -extfile server.ext 2>/dev/null
  openssl req -newkey rsa:2048 -nodes -keyout admin.key -out admin.csr -subj "/O=system:masters/CN=tally-admin" 2>/dev/null
  printf 'extendedKeyUsage=clientAuth\n' > client.ext
  openssl x509 -req -in admin.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days 3650 -out admin.crt -extfile client.ext 2>/dev/null
  openssl genrsa -out sa.key 2048 2>/dev/null
  openssl rsa -in sa.key -pubout -out sa.pub 2>/dev/null
  rm -f ./*.csr
  cd - >/dev/null
}

write_kubeconfig() {
  cat > "$KUBECONFIG_FILE" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: tally-local
  cluster: {server: "https://127.0.0.1:$API_PORT", certificate-authority: "$PKI/ca.crt"}
users:
- name: tally-admin
  user: {client-certificate: "$PKI/admin.crt", client-key: "$PKI/admin.key"}
contexts:
- name: tally-local
  context: {cluster: tally-local, user: tally-admin}
current-context: tally-local
EOF
}

gpu_node() { # gpu_node <index>
  cat <<EOF
apiVersion: v1
kind: Node
metadata:
  name: gpu-node-$1
  annotations: {kwok.x-k8s.io/node: fake, node.alpha.kubernetes.io/ttl: "0"}
  labels:
    type: kwok
    kubernetes.io/hostname: gpu-node-$1
    kubernetes.io/os: linux
    kubernetes.io/arch: amd64
    node.kubernetes.io/instance-type: gpu-8x-h100
    nvidia.com/gpu.present: "true"
    nvidia.com/gpu.product: NVIDIA-H100-80GB-HBM3
    nvidia.com/gpu.count: "$GPUS_PER_NODE"
spec:
  podCIDR: $POD_NET.$1.0/24
  podCIDRs: [$POD_NET.$1.0/24]
  taints:
  - {key: nvidia.com/gpu, value: present, effect: NoSchedule}
status:
  capacity: {cpu: "64", memory: 512Gi, pods: "110", nvidia.com/gpu: "$GPUS_PER_NODE"}
  allocatable: {cpu: "64", memory: 512Gi, pods: "110", nvidia.com/gpu: "$GPUS_PER_NODE"}
  nodeInfo: {architecture: amd64, operatingSystem: linux, kubeletVersion: fake, kubeProxyVersion: fake}
  phase: Running
EOF
}

up() {
  mkdir -p "$DIR" "$LOGS" "$RUN"
  if alive kube-apiserver && api_ready; then
    log "already up; $(env_line)"; return
  fi
  down_processes
  bins
  make_pki
  write_kubeconfig
  local t0=$SECONDS
  start etcd etcd --name=node0 --data-dir="$DIR/etcd" --unsafe-no-fsync=true \
    --listen-client-urls="http://127.0.0.1:$ETCD_PORT" --advertise-client-urls="http://127.0.0.1:$ETCD_PORT" \
    --listen-peer-urls="http://127.0.0.1:$((ETCD_PORT + 1))" \
    --initial-advertise-peer-urls="http://127.0.0.1:$((ETCD_PORT + 1))" \
    --initial-cluster="node0=http://127.0.0.1:$((ETCD_PORT + 1))" \
    --listen-metrics-urls="http://127.0.0.1:$((ETCD_PORT + 2))" --log-level=warn
  wait_for 30 etcd curl -sf "http://127.0.0.1:$ETCD_PORT/health"
  start kube-apiserver kube-apiserver --etcd-servers="http://127.0.0.1:$ETCD_PORT" \
    --bind-address=127.0.0.1 --advertise-address=127.0.0.1 --secure-port="$API_PORT" \
    --tls-cert-file="$PKI/apiserver.crt" --tls-private-key-file="$PKI/apiserver.key" --client-ca-file="$PKI/ca.crt" \
    --service-account-issuer=https://kubernetes.default.svc.cluster.local \
    --service-account-key-file="$PKI/sa.pub" --service-account-signing-key-file="$PKI/sa.key" \
    --service-cluster-ip-range=10.0.0.0/24 --authorization-mode=Node,RBAC --allow-privileged=true \
    --endpoint-reconciler-type=none --cert-dir="$DIR/apiserver-certs" --profiling=false
  wait_for 90 kube-apiserver api_ready
  local k=$KUBECONFIG_FILE
  start kube-controller-manager kube-controller-manager --kubeconfig="$k" --authentication-kubeconfig="$k" \
    --authorization-kubeconfig="$k" --bind-address=127.0.0.1 --secure-port="$KCM_PORT" --leader-elect=false \
    --root-ca-file="$PKI/ca.crt" --service-account-private-key-file="$PKI/sa.key" \
    --cluster-signing-cert-file="$PKI/ca.crt" --cluster-signing-key-file="$PKI/ca.key" \
    --use-service-account-credentials=true --controllers='*,-nodeipam' \
    --authorization-always-allow-paths=/healthz,/readyz,/livez,/metrics
  start kube-scheduler kube-scheduler --kubeconfig="$k" --authentication-kubeconfig="$k" \
    --authorization-kubeconfig="$k" --bind-address=127.0.0.1 --secure-port="$SCHED_PORT" --leader-elect=false \
    --authorization-always-allow-paths=/healthz,/readyz,/livez,/metrics
  start kwok kwok --kubeconfig="$k" --config="$BIN/kwok-stages.yaml" \
    --manage-all-nodes=false --manage-nodes-with-annotation-selector=kwok.x-k8s.io/node=fake \
    --node-ip=127.0.0.1 --node-port="$KWOK_PORT" --server-address="127.0.0.1:$KWOK_PORT" \
    --cidr="$KWOK_CIDR" --node-lease-duration-seconds=40
  wait_for 60 kube-controller-manager curl -skf "https://127.0.0.1:$KCM_PORT/healthz"
  wait_for 60 kube-scheduler curl -skf "https://127.0.0.1:$SCHED_PORT/healthz"
  export KUBECONFIG=$k
  local i
  for ((i = 0; i < GPU_NODES; i++)); do
    kubectl get node "gpu-node-$i" >/dev/null 2>&1 || gpu_node "$i" | kubectl create -f - >/dev/null
  done
  wait_for 60 "GPU nodes Ready" kubectl wait --for=condition=Ready node --all --timeout=5s
  wait_for 60 "default ServiceAccount" kubectl get serviceaccount default -n default
  log "up in $((SECONDS - t0))s; $(env_line)"
}

down_processes() {
  local name pid
  for name in kwok kube-scheduler kube-controller-manager kube-apiserver etcd; do
    [[ -f $RUN/$name.pid ]] || continue
    pid=$(cat "$RUN/$name.pid")
    kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null || true
    local deadline=$((SECONDS + 20))
    while kill -0 "$pid" 2>/dev/null && ((SECONDS < deadline)); do sleep 0.1; done
    kill -KILL -- "-$pid" 2>/dev/null || true
    rm -f "$RUN/$name.pid"
  done
}

down() {
  down_processes
  rm -rf "$DIR"
  log "down"
}

env_line() { echo "export KUBECONFIG=$KUBECONFIG_FILE"; }

case ${1:-} in
  up) up ;;
  down) down ;;
  env) env_line ;;
  status) alive kube-apiserver && api_ready ;;
  *) echo "usage: $0 up|down|env|status" >&2; exit 2 ;;
esac
