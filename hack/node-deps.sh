#!/usr/bin/env bash
# Debian packages the real node and the image build need; installs only what is missing.
set -euo pipefail
need=()
for pair in runc:runc /usr/lib/cni/bridge:containernetworking-plugins iptables:iptables \
            mmdebstrap:mmdebstrap buildah:buildah nsenter:util-linux; do
  cmd=${pair%%:*}
  if [[ $cmd == /* ]]; then [[ -e $cmd ]] || need+=("${pair#*:}"); else command -v "$cmd" >/dev/null || need+=("${pair#*:}"); fi
done
if ((${#need[@]})); then
  echo "[node-deps] installing ${need[*]}" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq && apt-get install -y -qq "${need[@]}" >/dev/null
fi
