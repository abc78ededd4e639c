# Two commands (README): `make demo` and `make test`. Both create .venv on first use.
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check -q
STAMP := $(VENV)/.installed

# Offline by default: no W&B upload, no hub downloads (docs/install.md).
export WANDB_MODE ?= offline
export HF_DATASETS_OFFLINE := 1
export HF_HUB_OFFLINE := 1
export HF_HOME := $(CURDIR)/.cache/huggingface
export TOKENIZERS_PARALLELISM := false

DEMO_DIR := runs/demo
# The real traces ship in data/traces (compressed; PROVENANCE.md beside each); PBKV_TRACES_DIR may point at another copy.
TRACES := $(or $(PBKV_TRACES_DIR),data/traces)

.PHONY: setup demo test test-fast results results-pages serve clean

# setup also compiles the replay's hot modules from their current source (serving_integration/compiled.py;
# a second when nothing changed; PBKV_COMPILED=0 skips it and runs them interpreted).
setup: $(STAMP)
	@$(PY) -m serving_integration.build_compiled

# torch first, then everything under the same constraints file, so no CUDA torch is pulled.
$(STAMP): requirements.txt requirements-sglang.txt constraints.txt pyproject.toml
	python3 -m venv $(VENV)
	$(PIP) install -c constraints.txt torch==2.13.0
	$(PIP) install -c constraints.txt -r requirements.txt
	$(PIP) install -c constraints.txt --no-deps -r requirements-sglang.txt
	$(PIP) install -c constraints.txt --no-deps --no-build-isolation -e .
	touch $(STAMP)

# The main job on the embedded default data: generate workloads, import the real traces, train the
# GraphSAGE predictor, replay the test workflows under every policy, build the report.
demo: setup
	@echo "== 1/5 generate the three workloads (1,000 workflows each) into $(DEMO_DIR)/data"
	@for w in hover swebench financebench; do \
	  $(PY) -m data.generate workload=$$w n_workflows=1000 seed=0 out=$(DEMO_DIR)/data/$$w overwrite=true || exit 1; \
	done
	@echo "== 2/5 import the real Who&When and tau-bench traces from $(TRACES)"
	@$(PY) -m data.import_traces format=who_and_when src=$(TRACES)/who_and_when out=$(DEMO_DIR)/data/who_and_when overwrite=true
	@$(PY) -m data.import_traces format=tau_bench src=$(TRACES)/tau_bench/gpt-4o-airline.json out=$(DEMO_DIR)/data/tau_bench overwrite=true
	@echo "== 3/5 train the GraphSAGE predictor on hover"
	@$(PY) train.py model=graphsage data.path=$(DEMO_DIR)/data/hover logger=csv hydra.run.dir=$(DEMO_DIR)/train/graphsage
	@echo "== 4/5 replay the hover test workflows under every policy (simulated Qwen3-14B on one H100)"
	@$(PY) evaluate.py data.path=$(DEMO_DIR)/data/hover predictor.checkpoint=$(DEMO_DIR)/train/graphsage/predictor.pt \
	  "prefetch=[none,conservative]" hydra.run.dir=$(DEMO_DIR)/evaluate
	@echo "== 5/5 build the report"
	@$(PY) -m serving_integration.experiments.report "runs=[$(DEMO_DIR)/evaluate]" out=$(DEMO_DIR)/report

# docs/results.md and docs/results/*.md from runs: every step of conf/results.yaml (datasets, predictors,
# experiments, real servers, benchmarks) into runs/results, then the pages (and README's headline table).
# OMP_NUM_THREADS=1: parallel sweep jobs would fight over torch's threads. results-pages: the pages only.
results: setup
	OMP_NUM_THREADS=1 $(PY) -m serving_integration.experiments.results

results-pages: setup
	$(PY) -m serving_integration.experiments.results render_only=true

test: setup
	$(PY) -m pytest

# The inner loop: every test but the real SGLang servers (`server`) and the end-to-end runs
# (`slow`); the markers are defined in pyproject.toml, the layout in docs/install.md.
test-fast: setup
	$(PY) -m pytest -m "not slow and not server"

# A real SGLang 0.5.23 server on this machine's CPU (tiny random Llama, HiCache, the PBKV plugin):
# `make serve POLICY=pbkv CHECKPOINT=runs/demo/train/graphsage/predictor.pt`; then replay workflows
# against it with `python -m serving_integration.experiments.bench --url http://127.0.0.1:30000 ...`.
POLICY ?= lru
CHECKPOINT ?=
PORT ?= 30000
serve: setup
	$(PY) -m serving_integration.server.launch --cpu --policy $(POLICY) --port $(PORT) \
	  $(if $(CHECKPOINT),--checkpoint $(CHECKPOINT),)

clean:
	rm -rf $(VENV) .cache runs outputs multirun
