#!/usr/bin/env bash
# Build the images the real node runs, from the repository's Dockerfiles, without a registry or Docker:
#
#   hack/images.sh           build (or reuse) them; print the directory of image archives
#   hack/images.sh --base    only the Debian base and the pause image (needs no Python environment: `make run`
#                            builds them beside the pip install)
#   hack/images.sh --print   print that directory without building
#
# TALLY_IMAGE_SET=demo builds what `make run` uses (pause, runtime, operator, client); the default, all, adds the
# tests' runtime-fakes and the endpoint picker (only a service routed through an InferencePool runs it).
#
# - base: a Debian bookworm root filesystem made by mmdebstrap (python3, venv, libgomp1), imported with buildah; it is
#   the Dockerfiles' BASE here (users build FROM the public python image, the Dockerfiles' default).
# - pause: hack/pause, the pod sandbox, built with Go.
# - runtime and operator: runtime/Dockerfile and operator/Dockerfile built by buildah (--isolation chroot),
#   with every wheel prebuilt on this machine (llama.cpp's comes from pip's wheel cache: nothing compiles).
# - client: hack/client, the openai SDK for one-shot pods (the demo's completion, the tests' clients).
# - runtime-fakes (tests only): the runtime image with tests/fakes/sglang, SGLang's contract fake, as `sglang`.
# - epp: the Gateway API Inference Extension's endpoint picker (cmd/epp of its Go module, the pinned version
#   from the module proxy), for services routed through an InferencePool.
#
# Each lands as a docker-archive under ~/.cache/tally/images/, named by a hash of what went into it, and
# $CACHE/images/current links the newest set. The node imports them into containerd (hack/node.sh).
set -euo pipefail

HACK=$(cd "$(dirname "$0")" && pwd)
ROOT=$(dirname "$HACK")
CACHE=${TALLY_CACHE:-$HOME/.cache/tally}
OUT=$CACHE/images
CURRENT=$OUT/current
PY=${PYTHON:-$ROOT/.venv/bin/python}
SUITE=bookworm
MIRROR=${TALLY_DEBIAN_MIRROR:-http://deb.debian.org/debian}
BASE_PACKAGES=python3,python3-venv,ca-certificates,libgomp1
VERSION=$(sed -n 's/^version = "\(.*\)"/\1/p' "$ROOT/pyproject.toml" | head -n 1)

if [[ ${1:-} == --print ]]; then echo "$CURRENT"; exit 0; fi
SET=${TALLY_IMAGE_SET:-all}
[[ $SET == demo || $SET == all ]] || { echo "TALLY_IMAGE_SET is demo or all, not $SET" >&2; exit 2; }

log() { echo "[images] $*" >&2; }
mkdir -p "$OUT"
exec 9>"$OUT/.lock"
flock 9

export GOTOOLCHAIN=local CGO_ENABLED=0 GOFLAGS=-modcacherw GOMODCACHE=$CACHE/gomod GOCACHE=$CACHE/gobuild
BUILDAH=(buildah --root "$OUT/storage" --runroot "$OUT/run" --storage-driver vfs)

hash_of() { sha256sum "$@" "$HACK/images.sh" | sha256sum | cut -c1-12; }

sources_hash() { # what goes into the Python images: the tracked sources and the Dockerfile
  (cd "$ROOT" && git ls-files -z pyproject.toml README.md runtime/tally_runtime operator/tally_operator "$1" \
    | xargs -0 sha256sum) | sha256sum | cut -c1-12
}

build_base() { # $1: archive
  local rootfs=$OUT/tmp/base-rootfs.tar
  mkdir -p "$OUT/tmp"
  local start=$SECONDS
  mmdebstrap --quiet --variant=minbase --include="$BASE_PACKAGES" "$SUITE" "$rootfs" "$MIRROR"
  printf 'FROM scratch\nADD base-rootfs.tar /\nCMD ["/bin/bash"]\n' > "$OUT/tmp/Dockerfile"
  "${BUILDAH[@]}" bud --quiet --isolation chroot -t "localhost/tally-base:$SUITE" -f "$OUT/tmp/Dockerfile" "$OUT/tmp" >/dev/null
  rm -f "$rootfs"
  touch "$1"
  log "base image in $((SECONDS - start))s"
}

build_pause() { # $1: archive
  local ctx=$OUT/tmp/pause
  mkdir -p "$ctx"
  (cd "$HACK/pause" && go build -trimpath -ldflags "-s -w" -o "$ctx/pause" .)
  printf 'FROM scratch\nCOPY pause /pause\nENTRYPOINT ["/pause"]\n' > "$ctx/Dockerfile"
  "${BUILDAH[@]}" bud --quiet --isolation chroot -t localhost/tally-pause:1 -f "$ctx/Dockerfile" "$ctx" >/dev/null
  "${BUILDAH[@]}" push --quiet localhost/tally-pause:1 "docker-archive:$1:localhost/tally-pause:1"
}

build_python_image() { # <image name> <Dockerfile> <extras> <archive>
  set -- "$4" "$1" "$2" "$3"
  local ctx=$OUT/tmp/$2 start=$SECONDS
  [[ -x $PY ]] || { log "no $PY: run make install first"; exit 1; }
  rm -rf "$ctx"; mkdir -p "$ctx"
  (cd "$ROOT" && git ls-files -z pyproject.toml README.md runtime operator | xargs -0 cp --parents -t "$ctx")
  # Every wheel the image installs, so that the build neither compiles nor reaches an index.
  "$PY" -m pip wheel --quiet --wheel-dir "$ctx/wheels" "$ROOT[$4]"
  "${BUILDAH[@]}" bud --quiet --isolation chroot --build-arg "BASE=localhost/tally-base:$SUITE" \
    --build-arg "EXTRAS=$4" -t "$2:$VERSION" -f "$ctx/$3" "$ctx" >/dev/null
  "${BUILDAH[@]}" push --quiet "$2:$VERSION" "docker-archive:$1:$2:$VERSION"
  rm -rf "$ctx"
  log "$2:$VERSION in $((SECONDS - start))s"
}

build_client() { # <archive>
  local ctx=$OUT/tmp/client
  [[ -x $PY ]] || { log "no $PY: run make install first"; exit 1; }
  rm -rf "$ctx"; mkdir -p "$ctx"
  cp "$HACK/client/Dockerfile" "$HACK/client/demo_client.py" "$ctx/"
  "$PY" -m pip wheel --quiet --wheel-dir "$ctx/wheels" "openai>=1.50"
  "${BUILDAH[@]}" bud --quiet --isolation chroot --build-arg "BASE=localhost/tally-base:$SUITE" \
    -t "tally-client:$VERSION" -f "$ctx/Dockerfile" "$ctx" >/dev/null
  "${BUILDAH[@]}" push --quiet "tally-client:$VERSION" "docker-archive:$1:tally-client:$VERSION"
  rm -rf "$ctx"
}

build_fakes() { # <archive>: FROM the runtime image (taken back from its archive when buildah no longer has it)
  local ctx=$OUT/tmp/fakes start=$SECONDS
  rm -rf "$ctx"; mkdir -p "$ctx"
  (cd "$ROOT" && git ls-files -z tests/fakes | xargs -0 cp --parents -t "$ctx")
  "${BUILDAH[@]}" inspect --type image "tally-runtime:$VERSION" >/dev/null 2>&1 \
    || "${BUILDAH[@]}" pull --quiet "docker-archive:$RUNTIME" >/dev/null
  "${BUILDAH[@]}" bud --quiet --isolation chroot --build-arg "RUNTIME=tally-runtime:$VERSION" \
    -t "tally-runtime-fakes:$VERSION" -f "$ctx/tests/fakes/Dockerfile" "$ctx" >/dev/null
  "${BUILDAH[@]}" push --quiet "tally-runtime-fakes:$VERSION" "docker-archive:$1:tally-runtime-fakes:$VERSION"
  rm -rf "$ctx"
  log "tally-runtime-fakes:$VERSION in $((SECONDS - start))s"
}

EPP_MODULE=sigs.k8s.io/gateway-api-inference-extension
EPP_VERSION=v1.5.0  # later versions moved the picker to llm-d's router

build_epp() { # $1: archive
  local ctx=$OUT/tmp/epp start=$SECONDS dir
  rm -rf "$ctx"; mkdir -p "$ctx"
  dir=$(cd "$ctx" && go mod download -json "$EPP_MODULE@$EPP_VERSION" | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')
  [[ -d $dir ]] || { log "could not download $EPP_MODULE@$EPP_VERSION"; exit 1; }
  (cd "$dir" && GOWORK=off go build -trimpath -ldflags "-s -w" -o "$ctx/epp" ./cmd/epp)
  printf 'FROM scratch\nCOPY epp /epp\nUSER 65532:65532\nENTRYPOINT ["/epp"]\n' > "$ctx/Dockerfile"
  "${BUILDAH[@]}" bud --quiet --isolation chroot -t "localhost/tally-epp:$EPP_VERSION" -f "$ctx/Dockerfile" "$ctx" >/dev/null
  "${BUILDAH[@]}" push --quiet "localhost/tally-epp:$EPP_VERSION" "docker-archive:$1:localhost/tally-epp:$EPP_VERSION"
  rm -rf "$ctx"
  log "localhost/tally-epp:$EPP_VERSION in $((SECONDS - start))s"
}

ready() { [[ -s $1 ]]; }

BASE=$OUT/base-$SUITE-$(echo "$MIRROR $BASE_PACKAGES" | sha256sum | cut -c1-12).done
base_key=$(basename "$BASE" .done)
built_any=0

need_base() { # the Debian base, built only when an image FROM it is about to be (a warm run never asks buildah)
  # The base lives in buildah's storage; the marker is only trusted when the image is still there.
  "${BUILDAH[@]}" inspect --type image "localhost/tally-base:$SUITE" >/dev/null 2>&1 || rm -f "$BASE"
  [[ -e $BASE ]] || { rm -f "$OUT"/base-*.done; build_base "$BASE.tmp"; mv "$BASE.tmp" "$BASE"; }
}

built() { # built <archive> <builder> <args...>: build into a temporary name, then rename
  local archive=$1; shift
  ready "$archive" && return
  [[ $1 == build_pause || $1 == build_epp ]] || need_base
  rm -f "$archive.tmp"
  "$@" "$archive.tmp"
  mv -f "$archive.tmp" "$archive"
  built_any=1
}

PAUSE=$OUT/pause-$(hash_of "$HACK/pause/main.go").tar
RUNTIME=$OUT/runtime-$VERSION-$( (sources_hash runtime/Dockerfile; echo "$base_key") | hash_of -).tar
OPERATOR=$OUT/operator-$VERSION-$( (sources_hash operator/Dockerfile; echo "$base_key") | hash_of -).tar
CLIENT=$OUT/client-$VERSION-$( (cat "$HACK"/client/*; echo "$base_key") | hash_of -).tar
FAKES=$OUT/fakes-$VERSION-$( (cd "$ROOT" && git ls-files -z tests/fakes | xargs -0 cat; basename "$RUNTIME") | hash_of -).tar
EPP=$OUT/epp-$EPP_VERSION-$(echo "$EPP_MODULE@$EPP_VERSION" | hash_of -).tar

built "$PAUSE" build_pause
if [[ ${1:-} == --base ]]; then need_base; exit 0; fi
built "$RUNTIME" build_python_image tally-runtime runtime/Dockerfile runtime,cpu
built "$OPERATOR" build_python_image tally-operator operator/Dockerfile operator
built "$CLIENT" build_client
if [[ $SET == all ]]; then
  built "$FAKES" build_fakes
  built "$EPP" build_epp
fi

# The set the node imports: every image of this set, and the others of the same sources when they were built before
tmp=$(mktemp -d "$OUT/.current.XXXXXX")
for pair in pause:"$PAUSE" runtime:"$RUNTIME" operator:"$OPERATOR" client:"$CLIENT" fakes:"$FAKES" epp:"$EPP"; do
  ! ready "${pair#*:}" || ln -s "${pair#*:}" "$tmp/${pair%%:*}.tar"
done
echo localhost/tally-pause:1 > "$tmp/pause.name"
rm -rf "$CURRENT"; mv -T "$tmp" "$CURRENT"
# Keep the two newest archives of each image (the glob expanded by the shell: an image of the other set may have
# none, and a failing `ls` would end the script under pipefail).
shopt -s nullglob
for c in pause runtime operator client fakes epp; do
  archives=("$OUT/$c"-*.tar)
  ((${#archives[@]} > 2)) || continue
  ls -t "${archives[@]}" | tail -n +3 | xargs -r rm -f
done
if ((built_any)); then  # drop buildah's copies (the archives are what the node imports)
  for image in tally-{runtime,runtime-fakes,operator,client}:"$VERSION" localhost/tally-pause:1; do
    "${BUILDAH[@]}" rmi "$image" >/dev/null 2>&1 || true
  done
  "${BUILDAH[@]}" rmi --prune >/dev/null 2>&1 || true  # the build stages' untagged images
fi
echo "$CURRENT"
