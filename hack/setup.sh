#!/usr/bin/env bash
# Everything a command needs built, with the independent steps side by side and a line per step with its time:
#
#   hack/setup.sh          what `make run` needs: the Debian packages, the Python environment, the cluster's
#                          binaries and the images, with the Go builds and the Debian base image beside the pip
#                          install (TALLY_WITH_PROMETHEUS and TALLY_IMAGE_SET choose what the binaries and images hold)
#   hack/setup.sh --sglang the same, and the real-SGLang environment beside the images (`make test`)
#
# Each step caches its work (~/.cache/tally, pip's wheel cache): a warm run takes seconds. A failed step prints
# the tail of its log (.tally/logs/setup-<step>.log) and the script exits non-zero.
set -euo pipefail
HACK=$(cd "$(dirname "$0")" && pwd)
ROOT=$(dirname "$HACK")
LOGS=$ROOT/.tally/logs
mkdir -p "$LOGS"
start=$SECONDS
log() { echo "[setup] $*" >&2; }

declare -A pids started
begin() { # begin <step> <command...>: run a step in the background, its output in its log
  local step=$1; shift
  started[$step]=$SECONDS
  "$@" >"$LOGS/setup-$step.log" 2>&1 &
  pids[$step]=$!
}
finish() { # finish <step>: wait for it, say how long it took, or show why it failed
  local step=$1 rc=0
  wait "${pids[$step]}" || rc=$?
  if ((rc)); then
    log "$step FAILED after $((SECONDS - started[$step]))s (exit $rc); the end of $LOGS/setup-$step.log:"
    tail -n 30 "$LOGS/setup-$step.log" >&2
    exit "$rc"
  fi
  log "$step: $((SECONDS - started[$step]))s"
}
step() { begin "$@"; finish "$1"; }  # a step nothing else runs beside

step packages "$HACK/node-deps.sh"                   # buildah, mmdebstrap, runc, ...: the image steps need them
begin binaries "$HACK/build.sh"                        # Go: Kubernetes, etcd, kwok, helm, containerd, CoreDNS (+ Prometheus)
begin base-image "$HACK/images.sh" --base              # mmdebstrap and buildah: needs no Python environment
step python make --no-print-directory -C "$ROOT" install  # pip, llama.cpp compiled once into pip's wheel cache
finish base-image
[[ ${1:-} != --sglang ]] || begin sglang "$HACK/sglang/env.sh"
step images "$HACK/images.sh"
[[ ${1:-} != --sglang ]] || finish sglang
finish binaries
log "ready in $((SECONDS - start))s"
