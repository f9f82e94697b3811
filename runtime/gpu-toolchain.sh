#!/bin/sh
# The GPU images' toolchain (runtime/Dockerfile): a C compiler and the Python headers that Triton needs at run time
# to build its kernel launchers, added from Debian/Ubuntu packages where the base lacks them, then checked by
# compiling and importing a tiny extension with Triton's own command (tally_runtime/toolchain.py).
#   gpu-toolchain.sh <python> <toolchain.py>
set -eu
python=$1
check=$2
need=""
if [ -z "${CC:-}" ] && ! command -v gcc >/dev/null 2>&1 && ! command -v clang >/dev/null 2>&1; then
  need="gcc libc6-dev"
fi
if ! "$python" -c 'import sys, sysconfig, os
scheme = sysconfig.get_default_scheme()
scheme = "posix_prefix" if scheme == "posix_local" else scheme
sys.exit(not os.path.isfile(os.path.join(sysconfig.get_paths(scheme=scheme)["include"], "Python.h")))'; then
  version=$("$python" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
  need="$need libpython$version-dev"
fi
if [ -n "$need" ]; then
  apt-get update
  apt-get install -y --no-install-recommends $need
  rm -rf /var/lib/apt/lists/*
fi
"$python" "$check"
