# Thin aliases; the README explains each. Everything runs from the repository root.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
# llama.cpp's native build crashed in decode on AMX/AVX-512 CPUs; this portable x86-64 set works. Its multimodal
# library (mtmd) is never used here (llama-cpp-python imports it lazily): not built, a few minutes less cold.
export CMAKE_ARGS ?= -DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DLLAVA_BUILD=OFF
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: install bins images node-deps sglang-env run serve test test-sglang unit lint bench up down env

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[runtime,cpu,operator,dev]'
	touch $@

install: $(VENV)/.installed  ## Python environment with every extra except sglang

bins:  ## control-plane and node binaries from Go modules (cached under ~/.cache/tally)
	hack/build.sh

node-deps:  ## what the real node needs from Debian: runc, CNI plugins, iptables, mmdebstrap and buildah
	hack/node-deps.sh

images: install node-deps bins  ## the runtime, operator, client and pause images, built here (cached under ~/.cache/tally)
	hack/images.sh

serve: install  ## the runtime alone on 127.0.0.1:8000 with the embedded CPU model
	$(VENV)/bin/tally-runtime serve

run: export TALLY_WITH_PROMETHEUS = 0
run: export TALLY_IMAGE_SET = demo
run:  ## the main job: cluster with a real node, chart, operator pods, example service, a completion
	hack/setup.sh
	hack/demo.sh up

sglang-env: install  ## real SGLang 0.5.23 in its own cached venv, and an HF checkpoint of the model
	hack/sglang/env.sh

test:  ## everything CI runs
	hack/setup.sh --sglang
	$(PY) -m ruff check .
	$(PY) -m mypy
	$(PY) -m pytest
	$(MAKE) --no-print-directory bench
	$(MAKE) --no-print-directory test-sglang

test-sglang:  ## the adapter against SGLang's own engine on the CPU (tests/sglang)
	SGLANG_USE_CPU_ENGINE=1 PYTHONPATH=tests/sglang_stub $$(hack/sglang/env.sh) -m pytest tests/sglang -p no:cacheprovider
	$$(hack/sglang/env.sh) benchmarks/frontend.py --concurrency 2 --tokens 8 --requests 2  # its smoke run

unit: install
	$(PY) -m pytest tests/unit tests/contract

lint: install
	$(PY) -m ruff check . && $(PY) -m mypy

bench: install  ## smoke versions of the benchmarks (full runs: benchmarks/README.md)
	$(PY) benchmarks/relay.py --streams 1,8 --tokens 256 --repeats 1 --min-tokens 0 --adapter
	$(PY) benchmarks/burst.py --requests 200 --concurrency 16 --repeats 1 --adapter
	$(PY) benchmarks/usage_truth.py --streams 16 --tokens 4
	$(PY) benchmarks/operator_scale.py --services 0 --pods 50
	$(PY) benchmarks/journal.py --streams 1 --tokens 1 --requests 100 --repeats 1
	$(PY) benchmarks/budgets.py --streams 1 --tokens 1 --requests 100 --repeats 1
	$(PY) benchmarks/budget_waits.py --requests 20 --budget 400 --repeats 1
	$(PY) benchmarks/prefix_slots.py --requests 8 --repeats 1
	$(PY) benchmarks/autoscaling.py

up: bins images  ## the local cluster alone
	hack/cluster.sh up

down:  ## stop everything `make run` or `make up` started (and the test suite's cluster), then check nothing is left
	hack/demo.sh down
	TALLY_CLUSTER_DIR=.tally/test-cluster hack/cluster.sh down
	hack/leftovers.sh

env:
	@hack/cluster.sh env
