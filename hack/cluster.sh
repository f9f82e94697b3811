#!/usr/bin/env bash
# A real Kubernetes cluster on one machine: etcd, kube-apiserver, kube-controller-manager, kube-scheduler,
# kwok (fake GPU nodes whose pod IPs are 127.x addresses) and a real node (hack/node.sh: containerd,
# kubelet, kube-proxy) that runs the images hack/images.sh built.
#
#   hack/cluster.sh up     start it (idempotent: a healthy cluster is left as it is)
#   hack/cluster.sh down   stop every process and delete the cluster's state
#   hack/cluster.sh env    print `export KUBECONFIG=... TALLY_PROXY=...` for this cluster
#   hack/cluster.sh status exit 0 when the cluster is up and ready
#   hack/cluster.sh netns  print the name of the cluster's network namespace
#
# The cluster lives in a network namespace of its own (tally-<hash of its directory>): a bridge with the
# node's address, a bridge for pods and a Service range, all in the benchmarking range 198.18.0.0/15 and with
# no uplink, so nothing leaves the machine. The API server is reachable from this machine only through a
# relay on a loopback port (hack/netns_relay.py); kubectl and helm use that. Pods and Services are reachable
# through a SOCKS5 relay on another loopback port ($TALLY_PROXY: `curl -K "$TALLY_CURLRC" http://<ClusterIP>:8000/health`,
# httpx's `proxy=`). State and logs live in
# $TALLY_CLUSTER_DIR (default: .tally/cluster in the repository); TALLY_REAL_NODE=0 leaves the node out.
set -euo pipefail

HACK=$(cd "$(dirname "$0")" && pwd)
ROOT=$(dirname "$HACK")
# Resolved first: the namespace's name hashes it, so `make down` (a relative path) and the test harness
# (an absolute one) must name the same cluster the same way.
DIR=$(realpath -m "${TALLY_CLUSTER_DIR:-$ROOT/.tally/cluster}")
PKI=$DIR/pki
LOGS=$DIR/logs
RUN=$DIR/run
KUBECONFIG_FILE=$DIR/admin.kubeconfig
ETCD_PORT=${TALLY_ETCD_PORT:-23790}
API_PORT=${TALLY_API_PORT:-16443}
PROXY_PORT=${TALLY_PROXY_PORT:-16480}
KCM_PORT=${TALLY_KCM_PORT:-20257}
SCHED_PORT=${TALLY_SCHEDULER_PORT:-20259}
KWOK_PORT=${TALLY_KWOK_PORT:-20247}
GPU_NODES=${TALLY_GPU_NODES:-2}
# kwok's fake pods get IPs in $KWOK_CIDR (nothing listens there: only the real node's pods serve); a second
# cluster (the test suite's) picks other ones so that the two never look alike.
POD_NET=${TALLY_POD_NET:-127.10}
KWOK_CIDR=${TALLY_KWOK_CIDR:-127.20.0.0/16}
GPUS_PER_NODE=${TALLY_GPUS_PER_NODE:-8}
REAL_NODE=${TALLY_REAL_NODE:-1}

# Inside the namespace (the same addresses in every cluster's namespace: they never meet).
NETNS=tally-$(echo "$DIR" | sha256sum | cut -c1-8)
NODE_IP=198.18.0.1
NODE_NAME=tally-node
POD_CIDR=198.18.1.0/24
POD_GW=198.18.1.1
SERVICE_CIDR=198.19.0.0/24
DNS_IP=198.19.0.10  # the kube-dns Service: CoreDNS on the node's address behind it
NS_API_PORT=6443
IMAGES=${TALLY_IMAGES_DIR:-${TALLY_CACHE:-$HOME/.cache/tally}/images/current}
NODE_GPUS=${TALLY_NODE_GPUS:-4}
export DIR NETNS NODE_IP NODE_NAME POD_CIDR POD_GW PKI LOGS RUN IMAGES NODE_GPUS DNS_IP

log() { echo "[cluster] $*" >&2; }
die() { log "ERROR: $*"; exit 1; }

bins() {
  BIN=$("$HACK/build.sh" 2>"$DIR/build.log" | tail -n 1) || { cat "$DIR/build.log" >&2; die "build failed"; }
  export PATH="$BIN:$PATH" BIN
}

IN_NET=(nsenter --net="/run/netns/$NETNS" --)
in_net() { "${IN_NET[@]}" "$@"; }

net_up() {
  ip netns list | grep -qw "$NETNS" || ip netns add "$NETNS"
  ip -n "$NETNS" link set lo up
  ip -n "$NETNS" link show tnode0 >/dev/null 2>&1 || ip -n "$NETNS" link add tnode0 type bridge
  ip -n "$NETNS" addr replace "$NODE_IP/24" dev tnode0
  ip -n "$NETNS" link set tnode0 up
  # Service addresses are translated by kube-proxy; the route only lets the namespace's own clients send.
  ip -n "$NETNS" route replace "$SERVICE_CIDR" dev tnode0
}

# shellcheck source=lib.sh
source "$HACK/lib.sh"

api_ready() {
  curl -sf --cacert "$PKI/ca.crt" --cert "$PKI/admin.crt" --key "$PKI/admin.key" \
    "https://127.0.0.1:$API_PORT/readyz" | grep -qx ok
}

# start <name> <command...>: a background process in its own session (its own process group), with a
# pid file that records who it is (lib.sh) and a log
start() {
  local name=$1; shift
  setsid "$@" >"$LOGS/$name.log" 2>&1 < /dev/null &
  record_pid "$RUN/$name.pid" $!
}

alive() { live_pid "$RUN/$1.pid" >/dev/null; }

# The SOCKS relay admits only who can read its secret (the user who started the cluster: the directory is
# 0700) and reaches only pods, Services and the API server, never the namespace's loopback (etcd, the
# control plane's own ports) or a name.
start_proxy() {
  [[ -s $DIR/proxy.secret ]] || (umask 077 && openssl rand -hex 24 > "$DIR/proxy.secret")
  alive pod-relay || start pod-relay python3 "$HACK/netns_relay.py" --netns "$NETNS" \
    --listen "127.0.0.1:$PROXY_PORT" --socks --secret-file "$DIR/proxy.secret" \
    --allow "$POD_CIDR" --allow "$SERVICE_CIDR" --allow "$NODE_IP/32:$NS_API_PORT"
}

make_pki() {
  [[ -f $PKI/admin.crt ]] && return
  mkdir -p "$PKI"; cd "$PKI"
  openssl req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.crt -days 3650 -subj "/CN=tally-local-ca" 2>/dev/null
  openssl req -newkey rsa:2048 -nodes -keyout apiserver.key -out apiserver.csr -subj "/CN=kube-apiserver" 2>/dev/null
  printf 'subjectAltName=IP:127.0.0.1,IP:%s,IP:%s,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local\nextendedKeyUsage=serverAuth\n' \
    "$NODE_IP" "${SERVICE_CIDR%.0/*}.1" > server.ext
  openssl x509 -req -in apiserver.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days 3650 -out apiserver.crt -extfile server.ext 2>/dev/null
  openssl req -newkey rsa:2048 -nodes -keyout admin.key -out admin.csr -subj "/O=system:masters/CN=tally-admin" 2>/dev/null
  printf 'extendedKeyUsage=clientAuth\n' > client.ext
  openssl x509 -req -in admin.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days 3650 -out admin.crt -extfile client.ext 2>/dev/null
  openssl req -newkey rsa:2048 -nodes -keyout node.key -out node.csr -subj "/O=system:nodes/CN=system:node:$NODE_NAME" 2>/dev/null
  openssl x509 -req -in node.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days 3650 -out node.crt -extfile client.ext 2>/dev/null
  openssl req -newkey rsa:2048 -nodes -keyout coredns.key -out coredns.csr -subj "/CN=tally:coredns" 2>/dev/null
  openssl x509 -req -in coredns.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days 3650 -out coredns.crt -extfile client.ext 2>/dev/null
  openssl genrsa -out sa.key 2048 2>/dev/null
  openssl rsa -in sa.key -pubout -out sa.pub 2>/dev/null
  rm -f ./*.csr
  cd - >/dev/null
}

# etcd has a CA of its own: only a certificate it signed (the API server's) is an etcd client, so none of the
# cluster's own client certificates, and nothing without one, can read or write etcd.
make_etcd_pki() {
  [[ -f $PKI/etcd-client.crt ]] && return
  mkdir -p "$PKI"; cd "$PKI"
  openssl req -x509 -newkey rsa:2048 -nodes -keyout etcd-ca.key -out etcd-ca.crt -days 3650 -subj "/CN=tally-etcd-ca" 2>/dev/null
  openssl req -newkey rsa:2048 -nodes -keyout etcd-server.key -out etcd-server.csr -subj "/CN=etcd" 2>/dev/null
  printf 'subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth,clientAuth\n' > etcd-server.ext
  openssl x509 -req -in etcd-server.csr -CA etcd-ca.crt -CAkey etcd-ca.key -CAcreateserial -days 3650 \
    -out etcd-server.crt -extfile etcd-server.ext 2>/dev/null
  openssl req -newkey rsa:2048 -nodes -keyout etcd-client.key -out etcd-client.csr -subj "/CN=kube-apiserver" 2>/dev/null
  openssl x509 -req -in etcd-client.csr -CA etcd-ca.crt -CAkey etcd-ca.key -CAcreateserial -days 3650 \
    -out etcd-client.crt -extfile client.ext 2>/dev/null
  rm -f ./*.csr
  cd - >/dev/null
}

etcd_ready() {
  in_net curl -sf --cacert "$PKI/etcd-ca.crt" --cert "$PKI/etcd-client.crt" --key "$PKI/etcd-client.key" \
    "https://127.0.0.1:$ETCD_PORT/health"
}

kubeconfig() { # kubeconfig <server> <user>: admin (this machine and the control plane) or node (the kubelet)
  cat <<KUBECONFIG
apiVersion: v1
kind: Config
clusters:
- name: tally-local
  cluster: {server: "$1", certificate-authority: "$PKI/ca.crt"}
users:
- name: tally-$2
  user: {client-certificate: "$PKI/$2.crt", client-key: "$PKI/$2.key"}
contexts:
- name: tally-local
  context: {cluster: tally-local, user: tally-$2}
current-context: tally-local
KUBECONFIG
}

write_kubeconfigs() {
  kubeconfig "https://127.0.0.1:$API_PORT" admin > "$KUBECONFIG_FILE"  # through the relay
  kubeconfig "https://$NODE_IP:$NS_API_PORT" admin > "$DIR/cluster.kubeconfig"
  kubeconfig "https://$NODE_IP:$NS_API_PORT" node > "$DIR/node.kubeconfig"
  kubeconfig "https://$NODE_IP:$NS_API_PORT" coredns > "$DIR/coredns.kubeconfig"
}

# Cluster DNS: CoreDNS answers for cluster.local from the API (as user tally:coredns, read-only) and
# NXDOMAIN for everything else: it has no upstream, nothing leaves the machine.
corefile() {
  cat <<EOF
cluster.local:53 in-addr.arpa:53 ip6.arpa:53 {
    bind $NODE_IP
    kubernetes cluster.local in-addr.arpa ip6.arpa {
        kubeconfig $DIR/coredns.kubeconfig tally-local
        pods insecure
        fallthrough in-addr.arpa ip6.arpa
    }
    ready 127.0.0.1:8181
    errors
    cache 30
}
.:53 {
    bind $NODE_IP
    template ANY ANY {
        rcode NXDOMAIN
    }
}
EOF
}

dns_objects() {
  cat <<EOF
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata: {name: "tally:coredns"}
rules:
- {apiGroups: [""], resources: [services, pods, namespaces], verbs: [list, watch]}
- {apiGroups: [discovery.k8s.io], resources: [endpointslices], verbs: [list, watch]}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata: {name: "tally:coredns"}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: "tally:coredns"}
subjects: [{apiGroup: rbac.authorization.k8s.io, kind: User, name: "tally:coredns"}]
---
apiVersion: v1
kind: Service
metadata: {name: kube-dns, namespace: kube-system, labels: {k8s-app: kube-dns}}
spec:
  clusterIP: $DNS_IP
  ports: [{name: dns, port: 53, protocol: UDP}, {name: dns-tcp, port: 53, protocol: TCP}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: kube-dns-node, namespace: kube-system, labels: {kubernetes.io/service-name: kube-dns}}
addressType: IPv4
endpoints: [{addresses: ["$NODE_IP"], conditions: {ready: true}}]
ports: [{name: dns, port: 53, protocol: UDP}, {name: dns-tcp, port: 53, protocol: TCP}]
EOF
}

start_dns() {
  dns_objects | kubectl apply -f - >/dev/null
  corefile > "$DIR/Corefile"
  alive coredns || start coredns "${IN_NET[@]}" coredns -conf "$DIR/Corefile"
  wait_for 30 coredns in_net curl -sf http://127.0.0.1:8181/ready
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
  - {key: kwok.x-k8s.io/node, value: fake, effect: NoSchedule}  # only pods that ask for a fake node land here
status:
  capacity: {cpu: "64", memory: 512Gi, pods: "110", nvidia.com/gpu: "$GPUS_PER_NODE"}
  allocatable: {cpu: "64", memory: 512Gi, pods: "110", nvidia.com/gpu: "$GPUS_PER_NODE"}
  nodeInfo: {architecture: amd64, operatingSystem: linux, kubeletVersion: fake, kubeProxyVersion: fake}
  phase: Running
EOF
}

up() {
  mkdir -p "$DIR" "$LOGS" "$RUN"
  chmod 0700 "$DIR"  # its PKI, etcd's data and the relay's secret are for the user who started it
  touch "$DIR/.tally-cluster"  # `down` deletes only a directory that says it is a cluster's
  if alive kube-apiserver && api_ready; then
    if [[ $REAL_NODE != 0 && -d $DIR/node ]]; then bins; "$HACK/node.sh" import; fi  # images may be newer
    start_proxy
    log "already up; $(env_line)"; return
  fi
  down_processes
  bins
  make_pki
  make_etcd_pki
  write_kubeconfigs
  net_up
  local t0=$SECONDS
  start etcd "${IN_NET[@]}" etcd --name=node0 --data-dir="$DIR/etcd" --unsafe-no-fsync=true \
    --listen-client-urls="https://127.0.0.1:$ETCD_PORT" --advertise-client-urls="https://127.0.0.1:$ETCD_PORT" \
    --cert-file="$PKI/etcd-server.crt" --key-file="$PKI/etcd-server.key" --client-cert-auth \
    --trusted-ca-file="$PKI/etcd-ca.crt" \
    --listen-peer-urls="https://127.0.0.1:$((ETCD_PORT + 1))" \
    --initial-advertise-peer-urls="https://127.0.0.1:$((ETCD_PORT + 1))" \
    --initial-cluster="node0=https://127.0.0.1:$((ETCD_PORT + 1))" \
    --peer-cert-file="$PKI/etcd-server.crt" --peer-key-file="$PKI/etcd-server.key" --peer-client-cert-auth \
    --peer-trusted-ca-file="$PKI/etcd-ca.crt" --log-level=warn
  wait_for 30 etcd etcd_ready
  start kube-apiserver "${IN_NET[@]}" kube-apiserver --etcd-servers="https://127.0.0.1:$ETCD_PORT" \
    --etcd-cafile="$PKI/etcd-ca.crt" --etcd-certfile="$PKI/etcd-client.crt" --etcd-keyfile="$PKI/etcd-client.key" \
    --bind-address="$NODE_IP" --advertise-address="$NODE_IP" --secure-port="$NS_API_PORT" \
    --tls-cert-file="$PKI/apiserver.crt" --tls-private-key-file="$PKI/apiserver.key" --client-ca-file="$PKI/ca.crt" \
    --service-account-issuer=https://kubernetes.default.svc.cluster.local \
    --service-account-key-file="$PKI/sa.pub" --service-account-signing-key-file="$PKI/sa.key" \
    --service-cluster-ip-range="$SERVICE_CIDR" --authorization-mode=Node,RBAC --allow-privileged=false \
    --kubelet-client-certificate="$PKI/admin.crt" --kubelet-client-key="$PKI/admin.key" \
    --kubelet-preferred-address-types=InternalIP \
    --cert-dir="$DIR/apiserver-certs" --profiling=false
  start api-relay python3 "$HACK/netns_relay.py" --netns "$NETNS" --listen "127.0.0.1:$API_PORT" \
    --to "$NODE_IP:$NS_API_PORT"
  start_proxy
  wait_for 90 kube-apiserver api_ready
  local k=$DIR/cluster.kubeconfig
  start kube-controller-manager "${IN_NET[@]}" kube-controller-manager --kubeconfig="$k" --authentication-kubeconfig="$k" \
    --authorization-kubeconfig="$k" --bind-address=127.0.0.1 --secure-port="$KCM_PORT" --leader-elect=false \
    --root-ca-file="$PKI/ca.crt" --service-account-private-key-file="$PKI/sa.key" \
    --cluster-signing-cert-file="$PKI/ca.crt" --cluster-signing-key-file="$PKI/ca.key" \
    --use-service-account-credentials=true --controllers='*,-nodeipam' \
    --authorization-always-allow-paths=/healthz,/readyz,/livez,/metrics
  start kube-scheduler "${IN_NET[@]}" kube-scheduler --kubeconfig="$k" --authentication-kubeconfig="$k" \
    --authorization-kubeconfig="$k" --bind-address=127.0.0.1 --secure-port="$SCHED_PORT" --leader-elect=false \
    --authorization-always-allow-paths=/healthz,/readyz,/livez,/metrics
  start kwok "${IN_NET[@]}" kwok --kubeconfig="$k" --config="$BIN/kwok-stages.yaml" \
    --manage-all-nodes=false --manage-nodes-with-annotation-selector=kwok.x-k8s.io/node=fake \
    --node-ip=127.0.0.1 --node-port="$KWOK_PORT" --server-address="127.0.0.1:$KWOK_PORT" \
    --cidr="$KWOK_CIDR" --node-lease-duration-seconds=40
  wait_for 60 kube-controller-manager in_net curl -skf "https://127.0.0.1:$KCM_PORT/healthz"
  wait_for 60 kube-scheduler in_net curl -skf "https://127.0.0.1:$SCHED_PORT/healthz"
  export KUBECONFIG=$KUBECONFIG_FILE
  local i
  for ((i = 0; i < GPU_NODES; i++)); do
    kubectl get node "gpu-node-$i" >/dev/null 2>&1 || gpu_node "$i" | kubectl create -f - >/dev/null
  done
  wait_for 60 "GPU nodes Ready" kubectl wait --for=condition=Ready node --all --timeout=5s
  wait_for 60 "default ServiceAccount" kubectl get serviceaccount default -n default
  start_dns
  [[ $REAL_NODE == 0 ]] || "$HACK/node.sh" up
  # The relay's password stays in its 0600 file: logs (a CI log, a shared terminal) get the command, not it.
  log "up in $((SECONDS - t0))s; for kubectl and the relay: eval \"\$(TALLY_CLUSTER_DIR=$DIR $HACK/cluster.sh env)\""
}

down_processes() {
  local name pid
  # Always: the node's processes and cgroups are found by the namespace's name too, so a second `down` after the
  # cluster's directory is gone still removes what the first one could not
  "$HACK/node.sh" down
  for name in coredns kwok kube-scheduler kube-controller-manager pod-relay api-relay kube-apiserver etcd; do
    [[ -f $RUN/$name.pid ]] || continue
    if ! pid=$(live_pid "$RUN/$name.pid"); then
      log "$name: its recorded process is gone (the PID may now be another's): nothing signalled"
      rm -f "$RUN/$name.pid"; continue
    fi
    stop_group "$pid" 20
    rm -f "$RUN/$name.pid"
  done
}

stop_group() { # stop_group <pid> <seconds>: TERM its process group (it leads one: started by setsid), then KILL
  local pid=$1 deadline=$((SECONDS + $2)) group
  group=$(ps -o pgid= -p "$pid" | tr -d ' ')
  [[ $group == "$pid" ]] || group=""  # not a group leader after all: signal the process alone
  kill -TERM -- "${group:+-}$pid" 2>/dev/null || true
  while kill -0 "$pid" 2>/dev/null && ((SECONDS < deadline)); do sleep 0.1; done
  kill -KILL -- "${group:+-}$pid" 2>/dev/null || true
}

down() {
  down_processes
  ! ip netns list | grep -qw "$NETNS" || ip netns delete "$NETNS"
  if [[ -f $DIR/.tally-cluster ]]; then
    rm -rf "$DIR"
  elif [[ -e $DIR ]]; then
    log "not deleting $DIR: it is not a cluster's directory (no .tally-cluster marker)"
  fi
  log "down"
}

env_line() {
  local secret
  secret=$(cat "$DIR/proxy.secret" 2>/dev/null)
  # curl reads the relay's password from a 0600 file (curl -K), never from its command line (the process list)
  [[ ! -d $DIR ]] || (umask 077; printf 'proxy = "socks5://127.0.0.1:%s"\nproxy-user = "tally:%s"\n' \
    "$PROXY_PORT" "$secret" > "$DIR/curlrc")
  echo "export KUBECONFIG=$KUBECONFIG_FILE TALLY_PROXY=socks5://tally:$secret@127.0.0.1:$PROXY_PORT TALLY_CURLRC=$DIR/curlrc"
}

case ${1:-} in
  up) up ;;
  down) down ;;
  env) env_line ;;
  netns) echo "$NETNS" ;;
  status) alive kube-apiserver && api_ready ;;
  *) echo "usage: $0 up|down|env|status|netns" >&2; exit 2 ;;
esac
