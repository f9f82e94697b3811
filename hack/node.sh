#!/usr/bin/env bash
# The cluster's real node: containerd, kubelet and kube-proxy in the cluster's own network namespace,
# sharing one private mount namespace. Started and stopped by hack/cluster.sh, which exports:
#   DIR NETNS NODE_IP NODE_NAME POD_CIDR POD_GW BIN PKI LOGS RUN IMAGES NODE_GPUS DNS_IP
#
#   hack/node.sh up       start the node and import the images built by hack/images.sh
#   hack/node.sh import   import those images again (after a rebuild) into the running node
#   hack/node.sh down     stop every process, container, mount and cgroup the node made
#
# Nothing touches the machine outside $DIR, the namespace and the node's own cgroup: the kubelet runs with
# protectKernelDefaults (the three sysctls it wants are bind-mounted files in its mount namespace),
# containerd may not raise OOM scores, and iptables rules live in the namespace.
set -euo pipefail

# Refuse empty or unsafe values before they name anything: an empty NETNS would make the node's cgroup the
# root cgroup, whose processes `down` kills
[[ ${DIR:-} == /* && ${NETNS:-} =~ ^[A-Za-z0-9][A-Za-z0-9._-]*$ ]] || {
  echo "[node] ERROR: DIR must be an absolute path and NETNS a plain name (got DIR='${DIR:-}' NETNS='${NETNS:-}')" >&2
  exit 1
}
NODE=$DIR/node
CGROOT=/$NETNS
SOCK=$NODE/run/containerd.sock
HOLDER_PID=$RUN/node-holder.pid

log() { echo "[node] $*" >&2; }
die() { log "ERROR: $*"; exit 1; }

# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"

holder() { live_pid "$HOLDER_PID"; }  # the process holding the node's mount namespace, if it still runs
in_node() { nsenter -t "$(holder)" -m -n -- "$@"; }  # the node's mount and network namespaces

start() { # start <name> <command...>: a process inside the node's namespaces
  local name=$1 holder; shift
  holder=$(holder) || die "the node's namespace holder is not running"
  setsid nsenter -t "$holder" -m -n -- env PATH="$BIN:$PATH" "$@" >"$LOGS/$name.log" 2>&1 < /dev/null &
  record_pid "$RUN/$name.pid" $!
}

cgroup_dirs() { # the node's cgroup in every v1 hierarchy (or the unified one)
  local h
  for h in /sys/fs/cgroup/*/ /sys/fs/cgroup/; do
    [[ -e $h/cgroup.procs ]] && echo "${h%/}$CGROOT"
  done | sort -u
}

make_cgroups() {
  local d parent
  for d in $(cgroup_dirs); do
    mkdir -p "$d"
    parent=$(dirname "$d")
    if [[ -e $d/cpuset.cpus && -z $(cat "$d/cpuset.cpus") ]]; then
      cat "$parent/cpuset.cpus" > "$d/cpuset.cpus"; cat "$parent/cpuset.mems" > "$d/cpuset.mems"
    fi
  done
}

# The mount namespace: sysfs of the node's network namespace (the CNI bridge plugin reads it), the machine's
# cgroup mounts moved in on top, the sysctls kubelet insists on as files that read its values, and tmpfs
# over the fixed scratch paths of containerd, runc and CNI.
holder_script() {
  cat <<EOF
set -e
mount --make-rprivate /
mkdir -p $NODE/cgroup-keep $NODE/sysctl
mount --rbind /sys/fs/cgroup $NODE/cgroup-keep
mount -t sysfs sysfs /sys
mount --move $NODE/cgroup-keep /sys/fs/cgroup
for kv in vm/overcommit_memory=1 vm/panic_on_oom=0 kernel/panic=10 kernel/panic_on_oops=1 \
          kernel/keys/root_maxkeys=1000000 kernel/keys/root_maxbytes=25000000; do
  f=\${kv%=*}; v=\${kv#*=}
  if [ "\$(cat /proc/sys/\$f)" != "\$v" ]; then
    echo "\$v" > $NODE/sysctl/\${f//\//.}; mount --bind $NODE/sysctl/\${f//\//.} /proc/sys/\$f
  fi
done
# Scratch that containerd, runc and CNI keep at fixed paths: private to the node, gone with it.
for d in /run/containerd /run/netns /var/lib/cni; do
  [ -d \$d ] || { mkdir -p \$d; echo \$d >> $NODE/created-dirs; }
  mount -t tmpfs -o mode=0755 tmpfs \$d
done
touch $NODE/holder.ready
exec sleep infinity
EOF
}

write_configs() {
  mkdir -p "$NODE/run" "$NODE/cni/net.d" "$NODE/kubelet" "$NODE/pod-logs"
  cat > "$NODE/containerd.toml" <<EOF
version = 3
root = "$NODE/containerd/root"
state = "$NODE/containerd/state"
disabled_plugins = ["io.containerd.internal.v1.opt", "io.containerd.tracing.processor.v1.otlp",
  "io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.devmapper",
  "io.containerd.snapshotter.v1.blockfile", "io.containerd.snapshotter.v1.erofs"]
[grpc]
  address = "$SOCK"
[ttrpc]
  address = "$NODE/run/containerd.ttrpc.sock"
[debug]
  address = ""
[plugins.'io.containerd.cri.v1.images']
  snapshotter = "overlayfs"
  [plugins.'io.containerd.cri.v1.images'.pinned_images]
    sandbox = "$(cat "$IMAGES/pause.name")"
[plugins.'io.containerd.cri.v1.runtime']
  restrict_oom_score_adj = true
  [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]
    runtime_type = "io.containerd.runc.v2"
    [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
      BinaryName = "$(command -v runc)"
      SystemdCgroup = false
  [plugins.'io.containerd.cri.v1.runtime'.cni]
    bin_dirs = ["/usr/lib/cni"]
    conf_dir = "$NODE/cni/net.d"
[plugins.'io.containerd.grpc.v1.cri']
  stream_server_address = "127.0.0.1"
EOF
  # One bridge for the pods; the namespace routes between it and the node's address. kube-proxy masquerades
  # Service traffic, so replies between pods on the same bridge come back through it.
  cat > "$NODE/cni/net.d/10-tally.conflist" <<EOF
{"cniVersion": "1.0.0", "name": "tally", "plugins": [
  {"type": "bridge", "bridge": "tpods0", "isGateway": true, "hairpinMode": true,
   "ipam": {"type": "host-local", "dataDir": "$NODE/cni/ipam", "ranges": [[{"subnet": "$POD_CIDR", "gateway": "$POD_GW"}]],
            "routes": [{"dst": "0.0.0.0/0"}]}}]}
EOF
  cat > "$NODE/kubelet.yaml" <<EOF
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
address: $NODE_IP
port: 10250
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: 10248
containerRuntimeEndpoint: unix://$SOCK
podLogsDir: $NODE/pod-logs
failCgroupV1: false
failSwapOn: false
cgroupDriver: cgroupfs
cgroupRoot: $CGROOT
protectKernelDefaults: true
# Images cannot be pulled again here: never collect them, and never evict for image disk pressure.
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
evictionHard: {memory.available: 100Mi, nodefs.available: 1%, imagefs.available: 1%}
# Volumes are measured every 5 s (not every minute), so an emptyDir past its sizeLimit is evicted promptly;
# pods are synced every 10 s, so an updated Secret reaches its volumes within seconds.
volumeStatsAggPeriod: 5s
syncFrequency: 10s
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: true}
  x509: {clientCAFile: $PKI/ca.crt}
authorization: {mode: Webhook}
resolvConf: ""
clusterDomain: cluster.local
clusterDNS: [$DNS_IP]
maxPods: 32
EOF
  cat > "$NODE/kube-proxy.yaml" <<EOF
apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
clientConnection: {kubeconfig: $DIR/cluster.kubeconfig}
hostnameOverride: $NODE_NAME
mode: iptables
bindAddress: $NODE_IP
healthzBindAddress: 127.0.0.1:10256
metricsBindAddress: 127.0.0.1:10249
clusterCIDR: $POD_CIDR
nodePortAddresses: ["$NODE_IP/32"]
iptables: {masqueradeAll: true}
conntrack: {maxPerCore: 0, min: 0, tcpEstablishedTimeout: 0s, tcpCloseWaitTimeout: 0s}
EOF
}

import_images() {
  local archive
  for archive in "$IMAGES"/*.tar; do
    [[ -e $archive ]] || continue
    # (ctr warns on every call that cgroup v1 is deprecated: shown only when the import fails)
    ctr --address "$SOCK" -n k8s.io images import "$archive" >"$LOGS/import.log" 2>&1 \
      || { cat "$LOGS/import.log" >&2; die "importing $archive failed"; }
  done
}

up() {
  [[ -e $IMAGES/pause.name ]] || die "no pause image: run hack/images.sh (make images) first"
  mkdir -p "$NODE" "$LOGS" "$RUN"
  make_cgroups
  write_configs
  rm -f "$NODE/holder.ready"
  setsid nsenter --net="/run/netns/$NETNS" unshare --mount --propagation private -- \
    bash -c "$(holder_script)" >"$LOGS/node-holder.log" 2>&1 < /dev/null &
  local pid=$!
  wait_for 10 "the node's mount namespace" test -e "$NODE/holder.ready"
  # Who the holder is and which mount namespace it holds: `down` kills by namespace only on this proof.
  record_pid "$HOLDER_PID" "$pid" "$(readlink "/proc/$pid/ns/mnt")"
  start containerd containerd --config "$NODE/containerd.toml"
  wait_for 60 containerd ctr --address "$SOCK" version
  import_images
  start kubelet kubelet --config="$NODE/kubelet.yaml" --kubeconfig="$DIR/node.kubeconfig" \
    --node-ip="$NODE_IP" --hostname-override="$NODE_NAME" --root-dir="$NODE/kubelet" \
    --cert-dir="$NODE/kubelet/pki" --node-labels=tally.dev/node=real
  start kube-proxy kube-proxy --config="$NODE/kube-proxy.yaml"
  wait_for 90 "node $NODE_NAME Ready" kubectl wait --for=condition=Ready "node/$NODE_NAME" --timeout=5s
  # A few GPUs as extended resources, so that examples asking for one schedule here.
  kubectl patch node "$NODE_NAME" --subresource=status --type=merge \
    -p "{\"status\": {\"capacity\": {\"nvidia.com/gpu\": \"$NODE_GPUS\"}}}" >/dev/null
  log "node $NODE_NAME Ready at $NODE_IP"
}

stop_pid() { # stop_pid <pid> <seconds>: TERM, then KILL after the deadline
  local pid=$1 deadline=$((SECONDS + $2))
  kill -TERM "$pid" 2>/dev/null || return 0
  while kill -0 "$pid" 2>/dev/null && ((SECONDS < deadline)); do sleep 0.1; done
  kill -KILL "$pid" 2>/dev/null || true
}

node_pids() { # every process in the node's mount namespace or in its cgroups (containers, shims)
  local h ns expected mine pid
  if h=$(holder); then
    ns=$(readlink "/proc/$h/ns/mnt" 2>/dev/null) || ns=""
    expected=$(recorded "$HOLDER_PID" 3)
    mine=$(readlink /proc/self/ns/mnt)
    # Kill by namespace only with proof: the recorded holder still runs, holds the namespace recorded when
    # it started, and that namespace is not this machine's own.
    if [[ -z $ns ]]; then
      log "the namespace holder exited just now: nothing is killed by namespace (the node's cgroups still are)"
    elif [[ $ns == "$expected" && $ns != "$mine" ]]; then
      for pid in /proc/[0-9]*; do
        [[ $(readlink "$pid/ns/mnt" 2>/dev/null) == "$ns" ]] && echo "${pid#/proc/}"
      done
    else
      log "not killing by mount namespace: the holder's $ns is not the one recorded (${expected:-none}) or is this machine's own"
    fi
  elif [[ -f $HOLDER_PID ]]; then
    log "the recorded namespace holder is gone (its PID may now be another process's): nothing is killed by namespace"
  fi
  for h in $(cgroup_dirs); do  # the node's own cgroup: only its containers and shims are in it
    [[ -d $h ]] && find "$h" -name cgroup.procs -exec cat {} + 2>/dev/null
  done
  true
}

down() {
  local name pid
  for name in kube-proxy kubelet containerd; do
    if pid=$(live_pid "$RUN/$name.pid"); then stop_pid "$pid" 10; fi
    rm -f "$RUN/$name.pid"
  done
  # Containers, their shims and the holder; mounts live only in the node's namespaces and go with them.
  for _ in 1 2 3; do
    for pid in $(node_pids | sort -u); do
      [[ $pid == "$$" ]] || kill -KILL "$pid" 2>/dev/null || true
    done
  done
  rm -f "$HOLDER_PID"
  [[ ! -f $NODE/created-dirs ]] || xargs -r rmdir < "$NODE/created-dirs" 2>/dev/null || true
  remove_cgroups
}

remove_cgroups() { # the node's cgroup trees, deepest first. A cgroup cannot go while a process is in it (a shim
  # or a container exiting a moment late): what is still there is killed and the removal tried again until
  # nothing is left, for at most 30 s. By name alone, so it works also when the cluster's directory is gone.
  local deadline=$((SECONDS + 30)) d pid left
  while :; do
    left=""
    for d in $(cgroup_dirs); do
      [[ -d $d ]] || continue
      for pid in $(find "$d" -name cgroup.procs -exec cat {} + 2>/dev/null); do
        [[ $pid == "$$" ]] || kill -KILL "$pid" 2>/dev/null || true
      done
      find "$d" -depth -type d -exec rmdir {} + 2>/dev/null || true
      [[ ! -d $d ]] || left+=" $d"
    done
    [[ -n $left ]] || return 0
    ((SECONDS < deadline)) || { log "ERROR: cgroups still hold processes after 30s:$left"; return 1; }
    sleep 0.2
  done
}

case ${1:-} in
  up) up ;;
  import) import_images ;;
  down) down ;;
  *) echo "usage: $0 up|import|down (run by hack/cluster.sh)" >&2; exit 2 ;;
esac
