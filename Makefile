# kvd — the two front-door commands are `make run` and `make test`.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PY := $(BIN)/python
PIP := $(PY) -m pip --disable-pip-version-check -q
TORCH := torch==2.13.0
KVD_EXTRAS ?=
PYTEST_ARGS ?=
VERSION := $(shell sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
IMAGE ?= ghcr.io/kvd/kvd:$(VERSION)
# vLLM's image with kvd_client added, for deploy/k8s/engine-deployment.yaml.
ENGINE_IMAGE ?= ghcr.io/kvd/vllm-openai:v0.33.0-kvd$(VERSION)
# SGLang's image with kvd_client added, for deploy/k8s/sglang-deployment.yaml.
SGLANG_IMAGE ?= ghcr.io/kvd/sglang:v0.5.23-kvd$(VERSION)
CONTAINER ?= podman

.PHONY: help run test test-fast soak bench proto lint fmt venv dev vllm-env sglang-env image engine-image sglang-image wheel clean

help: ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-13s %s\n", $$1, $$2}'

$(BIN)/activate:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip

# setup.py and the C source it names (its extensions' sources and depends, read from it, so
# that a file added there is rebuilt when edited): an editable install builds the extensions in
# place, so a changed source must be rebuilt (a stale build would run old code).
NATIVE := setup.py $(shell grep -o '"kvd_[a-z_/]*\.[ch]"' setup.py | tr -d '"')

$(VENV)/.stamp-run: pyproject.toml $(NATIVE) | $(BIN)/activate
	$(PIP) install -e .
	@touch $@

# The cluster tier's tests run a real Mooncake store: its wheel (x86-64 Linux only) and, as
# root, the two Debian libraries its client loads. Where either cannot be had, those tests
# skip and say why; nothing else depends on them.
$(VENV)/.stamp-test: pyproject.toml $(NATIVE) | $(BIN)/activate
	$(PIP) install $(TORCH)
	$(PIP) install -e '.[test]'
	$(PIP) install -e '.[cluster]' || echo "warning: no Mooncake wheel here: the cluster tier's tests will skip"
	@if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && ! dpkg -s libibverbs1 librdmacm1 >/dev/null 2>&1; then \
	  (apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends libibverbs1 librdmacm1 >/dev/null) \
	    || echo "warning: could not install libibverbs1 librdmacm1: the cluster tier's tests will skip"; \
	fi
	@touch $@

# vLLM 0.33.0's Python code on a CPU-only machine (no CUDA wheels), for the conformance tests.
# vLLM pins torch 2.14.0 and CUDA packages; the tests run it on torch 2.13.0's CPU build with
# the pure-Python subset it needs. So the subset goes in first and vllm last, with --no-deps:
# pip's after-install check would otherwise list vLLM's every pin as an ERROR (--no-warn-conflicts
# keeps a rerun over an installed vllm as quiet).
$(VENV)/.stamp-vllm: tools/vllm-test-requirements.txt tools/setup_vllm_testenv.py $(VENV)/.stamp-test
	$(PIP) install --no-warn-conflicts -r tools/vllm-test-requirements.txt
	$(PIP) install --no-deps vllm==0.33.0
	@echo "vllm 0.33.0 installed without its dependencies: the tests run it on torch 2.13.0 (CPU) with tools/vllm-test-requirements.txt, not its torch 2.14.0 and CUDA pins"
	$(PY) tools/setup_vllm_testenv.py
	@touch $@

# SGLang 0.5.23's Python code (no CUDA), for kvd's SGLang backend tests (tests/sglang): the
# pure-Python subset its storage side imports, then sglang itself with --no-deps, torch held
# at the CPU build.
$(VENV)/.stamp-sglang: tools/sglang-test-requirements.txt tools/torch-constraint.txt $(VENV)/.stamp-vllm
	$(PIP) install --no-warn-conflicts -r tools/sglang-test-requirements.txt -c tools/torch-constraint.txt
	$(PIP) install --no-deps sglang==0.5.23
	@echo "sglang 0.5.23 installed without its dependencies, for tests/sglang"
	@touch $@

venv: $(VENV)/.stamp-run ## create .venv with kvd installed

dev: $(VENV)/.stamp-sglang ## create .venv with test extras and the vLLM and SGLang test environments

vllm-env: $(VENV)/.stamp-vllm ## install vLLM 0.33.0 (CPU, no deps) for the conformance tests

sglang-env: $(VENV)/.stamp-sglang ## install SGLang 0.5.23 (CPU, no deps) for the SGLang backend tests

run: $(VENV)/.stamp-run ## start the daemon in the foreground with the embedded defaults
	$(BIN)/kvd serve

test: $(VENV)/.stamp-sglang ## run the whole test suite (what CI runs)
	VLLM_TARGET_DEVICE=cpu HF_HUB_OFFLINE=1 $(PY) -m pytest -q -m "not soak" $(PYTEST_ARGS)

test-fast: $(VENV)/.stamp-test ## unit tests only
	$(PY) -m pytest -q tests/unit $(PYTEST_ARGS)

soak: $(VENV)/.stamp-sglang ## long fault runs (100 crash rounds), < 30 min
	KVD_SOAK_ROUNDS=100 KVD_SOAK_FUZZ=10000 KVD_SOAK_LOAD_S=60 KVD_SOAK_HARDEN_S=20 \
	  KVD_SOAK_CONNECTIONS=19000 $(PY) -m pytest -q -m "fault or soak" -p no:cacheprovider $(PYTEST_ARGS)

bench: $(VENV)/.stamp-sglang ## run the benchmarks, write bench/results/
	$(PIP) install -e '.[bench]'
	VLLM_TARGET_DEVICE=cpu HF_HUB_OFFLINE=1 $(PY) bench/run_all.py $(BENCH_ARGS)
	$(PY) bench/tiers.py $(BENCH_ARGS)
	$(PY) bench/cluster_tier.py $(BENCH_ARGS)
	$(PY) bench/cluster_scale.py $(BENCH_ARGS)
	VLLM_TARGET_DEVICE=cpu HF_HUB_OFFLINE=1 $(PY) bench/agent_sessions.py $(BENCH_ARGS)
	$(PY) bench/io_engines.py

proto: $(VENV)/.stamp-test ## regenerate the committed gRPC code in kvd_proto/
	$(PY) tools/gen_proto.py

wheel: $(VENV)/.stamp-run ## build the kvd-offload wheel into dist/
	$(PIP) wheel --no-deps --wheel-dir dist .

image: ## build the daemon image ghcr.io/kvd/kvd:VERSION from deploy/Containerfile (CONTAINER=docker, KVD_EXTRAS=cluster)
	$(CONTAINER) build -f deploy/Containerfile --build-arg KVD_EXTRAS=$(KVD_EXTRAS) -t $(IMAGE) .

engine-image: ## build vLLM 0.33.0's image with kvd_client added, from deploy/engine.Containerfile
	$(CONTAINER) build -f deploy/engine.Containerfile -t $(ENGINE_IMAGE) .

sglang-image: ## build SGLang 0.5.23's image with kvd_client added, from deploy/sglang-engine.Containerfile
	$(CONTAINER) build -f deploy/sglang-engine.Containerfile -t $(SGLANG_IMAGE) .

lint: $(VENV)/.stamp-test ## ruff over the tree, mypy over kvd_proto and kvd_client (pyproject.toml)
	$(BIN)/ruff check .
	$(BIN)/mypy

fmt: $(VENV)/.stamp-test
	$(BIN)/ruff check --fix .

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache kvd_proto/_native*.so kvd_server/tiers/disk/_blockio*.so
