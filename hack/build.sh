#!/usr/bin/env bash
# Build the local control plane's binaries from Go modules, once per version.
#
#   hack/build.sh            build (or reuse) everything, print the bin directory (TALLY_WITH_PROMETHEUS=0:
#                            all but Prometheus, which only the end-to-end tests use)
#   hack/build.sh --print    print the bin directory without building
#
# Each component lands in ~/.cache/tally/bin/<component>-<version>-<key>/, where
# <key> hashes the Go version, the committed go.sum and the component's own build
# function (so a change to one recipe rebuilds that component only). A cached
# directory is reused only when its binaries report the expected version.
# Concurrent builds are serialised with flock. Nothing here is required to be
# cached already: a cold run builds everything (about 30 minutes on 2 cores).
set -euo pipefail

HACK=$(cd "$(dirname "$0")" && pwd)
K8S_VERSION=v1.36.3
ETCD_VERSION=v3.6.14
KWOK_VERSION=v0.8.0
HELM_VERSION=v4.3.2
CONTAINERD_VERSION=v2.4.2
COREDNS_VERSION=v1.14.7
PROMETHEUS_MODULE=v0.316.0  # Prometheus 3.16.0 (the module's v0.3XX.Y is Prometheus 3.XX.Y)
PROMETHEUS_VERSION=3.16.0

CACHE=${TALLY_CACHE:-$HOME/.cache/tally}
export GOTOOLCHAIN=local CGO_ENABLED=0 GOFLAGS=-modcacherw
export GOMODCACHE=$CACHE/gomod GOCACHE=$CACHE/gobuild
BIN=$CACHE/bin
mkdir -p "$BIN"

LINK=$BIN/current
if [[ ${1:-} == --print ]]; then echo "$LINK"; exit 0; fi

GOV=$(go env GOVERSION)
key() { # key <component> <files...>: the files, the component's build function(s) and the Go version
  local c=$1; shift
  { cat "$@"; declare -f "build_$c"; [[ $c != kube ]] || declare -f kube_ldflags; echo "$GOV"; } \
    | sha256sum | cut -c1-12
}

log() { echo "[build] $*" >&2; }

# fresh <dir> <binary> <expected version substring> [version command]
# (the output is captured, not piped: under pipefail a `grep -q` that stops reading early fails the pipe)
fresh() { local out; [[ -x $1/$2 ]] && out=$("$1/$2" "${4:---version}" 2>/dev/null) && [[ $out == *"$3"* ]]; }

build_into() { # build_into <final dir> <command...>; builds in a temp dir, then renames
  local final=$1; shift
  local tmp; tmp=$(mktemp -d "$BIN/.tmp.XXXXXX")
  local start=$SECONDS
  if OUT=$tmp "$@"; then
    rm -rf "$final"; mv -T "$tmp" "$final"
    log "built $(basename "$final") in $((SECONDS - start))s"
  else
    rm -rf "$tmp"; log "FAILED: $(basename "$final")"; return 1
  fi
}

kube_ldflags() {
  local major=${K8S_VERSION#v}; major=${major%%.*}
  local minor=${K8S_VERSION#v*.}; minor=${minor%%.*}
  local flags="-s -w" p
  for p in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    flags+=" -X $p.gitVersion=$K8S_VERSION -X $p.gitMajor=$major -X $p.gitMinor=$minor"
    flags+=" -X $p.gitTreeState=clean -X $p.buildDate=1970-01-01T00:00:00Z"
  done
  echo "$flags"
}

build_kube() {
  (cd "$HACK/kube" && go build -mod=readonly -trimpath -pgo=off -tags=selinux,notest,grpcnotrace \
    -ldflags "$(kube_ldflags)" -o "$OUT/" \
    k8s.io/kubernetes/cmd/kube-apiserver k8s.io/kubernetes/cmd/kube-controller-manager \
    k8s.io/kubernetes/cmd/kube-scheduler k8s.io/kubernetes/cmd/kubectl \
    k8s.io/kubernetes/cmd/kubelet k8s.io/kubernetes/cmd/kube-proxy)
}

build_etcd() {
  (cd "$HACK/etcd" && go build -mod=readonly -trimpath -ldflags "-s -w" -o "$OUT/etcd" go.etcd.io/etcd/server/v3)
}

build_kwok() {
  GOBIN=$OUT go install -trimpath -ldflags "-s -w" \
    "sigs.k8s.io/kwok/cmd/kwok@$KWOK_VERSION"
  # The node and pod lifecycle stages kwok needs, taken from the same module.
  local stages; stages=$(go env GOMODCACHE)/sigs.k8s.io/kwok@$KWOK_VERSION/kustomize/stage
  local f first=1
  for f in node/fast/node-initialize.yaml node/heartbeat-with-lease/node-heartbeat-with-lease.yaml \
           pod/fast/pod-ready.yaml pod/fast/pod-complete.yaml pod/fast/pod-delete.yaml; do
    [[ $first == 1 ]] || echo "---"
    first=0; cat "$stages/$f"
  done > "$OUT/kwok-stages.yaml"
}

build_helm() {
  GOBIN=$OUT go install -trimpath -ldflags "-s -w -X helm.sh/helm/v4/internal/version.version=$HELM_VERSION" \
    "helm.sh/helm/v4/cmd/helm@$HELM_VERSION"
}

build_containerd() { # the real node's container runtime (runc and CNI plugins come from Debian)
  local c
  for c in containerd containerd-shim-runc-v2 ctr; do
    GOBIN=$OUT go install -trimpath -ldflags "-s -w -X github.com/containerd/containerd/v2/version.Version=$CONTAINERD_VERSION" \
      "github.com/containerd/containerd/v2/cmd/$c@$CONTAINERD_VERSION"
  done
}

build_coredns() { # the cluster's DNS (hack/node.sh runs it on the node)
  GOBIN=$OUT go install -trimpath -ldflags "-s -w" "github.com/coredns/coredns@$COREDNS_VERSION"
}

build_prometheus() { # the end-to-end tests' monitoring: only Kubernetes service discovery compiled in
  local c
  for c in prometheus promtool; do
    GOBIN=$OUT go install -trimpath -tags remove_all_sd,enable_kubernetes_sd \
      -ldflags "-s -w -X github.com/prometheus/common/version.Version=$PROMETHEUS_VERSION" \
      "github.com/prometheus/prometheus/cmd/$c@$PROMETHEUS_MODULE"
  done
}

K8S_DIR=$BIN/kube-$K8S_VERSION-$(key kube "$HACK/kube/go.sum")
ETCD_DIR=$BIN/etcd-$ETCD_VERSION-$(key etcd "$HACK/etcd/go.sum")
KWOK_DIR=$BIN/kwok-$KWOK_VERSION-$(key kwok)
HELM_DIR=$BIN/helm-$HELM_VERSION-$(key helm)
CTRD_DIR=$BIN/containerd-$CONTAINERD_VERSION-$(key containerd)
DNS_DIR=$BIN/coredns-$COREDNS_VERSION-$(key coredns)
PROM_DIR=$BIN/prometheus-$PROMETHEUS_VERSION-$(key prometheus)

exec 9>"$CACHE/.build.lock"
flock 9

fresh "$ETCD_DIR" etcd "${ETCD_VERSION#v}" || build_into "$ETCD_DIR" build_etcd
fresh "$K8S_DIR" kube-apiserver "$K8S_VERSION" || build_into "$K8S_DIR" build_kube
fresh "$KWOK_DIR" kwok "${KWOK_VERSION#v}" || build_into "$KWOK_DIR" build_kwok
fresh "$HELM_DIR" helm "$HELM_VERSION" version || build_into "$HELM_DIR" build_helm
fresh "$CTRD_DIR" containerd "$CONTAINERD_VERSION" || build_into "$CTRD_DIR" build_containerd
fresh "$DNS_DIR" coredns "${COREDNS_VERSION#v}" -version || build_into "$DNS_DIR" build_coredns
# Prometheus is for the end-to-end tests only: `make run` passes TALLY_WITH_PROMETHEUS=0 (3 minutes less cold)
if [[ ${TALLY_WITH_PROMETHEUS:-1} != 0 ]]; then
  fresh "$PROM_DIR" prometheus "$PROMETHEUS_VERSION" || build_into "$PROM_DIR" build_prometheus
fi

# One directory of symlinks so callers need a single PATH entry.
tmp=$(mktemp -d "$BIN/.tmp.XXXXXX")
for d in "$ETCD_DIR" "$K8S_DIR" "$KWOK_DIR" "$HELM_DIR" "$CTRD_DIR" "$DNS_DIR" "$PROM_DIR"; do
  [[ -d $d ]] || continue  # Prometheus, when not built
  for f in "$d"/*; do ln -s "$f" "$tmp/$(basename "$f")"; done
done
rm -rf "$LINK"; mv -T "$tmp" "$LINK"

# Keep only the newest two builds per component. A component may have none (Prometheus under `make run`):
# the glob is expanded by the shell (nullglob), never by an `ls` whose failure pipefail would make fatal.
shopt -s nullglob
for c in kube etcd kwok helm containerd coredns prometheus; do
  builds=("$BIN/$c"-*)
  ((${#builds[@]} > 2)) || continue
  ls -dt "${builds[@]}" | tail -n +3 | xargs -r rm -rf
done
echo "$LINK"
