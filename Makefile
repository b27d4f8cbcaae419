# opforge: the two commands a fresh machine needs are `make demo` (set up,
# build, run the main job) and `make test` (set up, build, run the tests).
# `make gpu-check` is for a GPU machine whose python3 already has torch.

SHELL := /bin/bash
.SHELLFLAGS := -o pipefail -c
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMPS := .make
# The CUDA build of torch: lets the CUDA kernels compile even without a GPU.
TORCH_PKGS ?= torch==2.14.1 torchvision==0.29.1
DEV_PKGS ?= ninja pytest expecttest numpy matplotlib
# Formatters at fixed versions: `make lint` must judge the same on every machine.
LINT_PKGS ?= ruff==0.17.6 clang-format==23.1.5

.PHONY: demo test build lint format gpu-check bench-docs clean

# pip's own output goes to a log: on success it is noise, on failure its tail is shown.
$(STAMPS)/venv:
	@mkdir -p $(STAMPS)
	@echo "opforge: creating $(VENV) and installing $(TORCH_PKGS) $(DEV_PKGS) (log in $(STAMPS)/venv.log)"
	@{ $(PYTHON) -m venv $(VENV) \
		&& $(PY) -m pip install -q --upgrade pip setuptools wheel \
		&& $(PY) -m pip install -q $(TORCH_PKGS) $(DEV_PKGS) $(LINT_PKGS); } > $(STAMPS)/venv.log 2>&1 \
		|| { tail -n 30 $(STAMPS)/venv.log; exit 1; }
	@touch $@

# The package is installed once, editable and without kernels (puts the
# opforge command in $(VENV)/bin); the kernels are then built in place by
# tools/build.py, which keeps its objects in build/: later builds recompile
# only what changed. CUDA kernels: OPFORGE_CUDA=1 (unset: only with a GPU).
$(STAMPS)/installed: $(STAMPS)/venv
	@OPFORGE_BUILD_EXT=0 $(PY) -m pip install -q --no-build-isolation --no-deps -e . > $(STAMPS)/install.log 2>&1 \
		|| { tail -n 30 $(STAMPS)/install.log; exit 1; }
	@touch $@

build: $(STAMPS)/installed
	@$(PY) tools/build.py

demo: build
	$(VENV)/bin/opforge demo

test: build
	$(PY) -m pytest -q -p no:cacheprovider tests

# C++/CUDA sources checked by clang-format (the scaffold's .tmpl files are not C++ until rendered).
CXX_SOURCES = $(shell git ls-files 'src/*.cpp' 'src/*.cu' 'src/*.h' 'src/*.cuh' 'tests/*.cpp' 'cpp/*.cpp')

lint: $(STAMPS)/venv
	@$(VENV)/bin/ruff check --quiet src tests tools
	@$(VENV)/bin/ruff format --check --quiet src tests tools
	@$(VENV)/bin/clang-format --dry-run -Werror $(CXX_SOURCES)
	@echo "opforge: lint clean (ruff check, ruff format, clang-format)"

format: $(STAMPS)/venv
	$(VENV)/bin/ruff check --fix --quiet src tests tools
	$(VENV)/bin/ruff format --quiet src tests tools
	$(VENV)/bin/clang-format -i $(CXX_SOURCES)

# On a GPU machine (python3 with torch and a GPU): build for its arch with
# every core, run the CUDA tests, then the demo. Logs go to $OUT if set.
OUT ?= out
gpu-check:
	@mkdir -p $(OUT)
	MAX_JOBS=$${MAX_JOBS:-$$(nproc)} TORCH_CUDA_ARCH_LIST=$${TORCH_CUDA_ARCH_LIST:-native} OPFORGE_CUDA=1 \
		$(PYTHON) tools/build.py 2>&1 | tee $(OUT)/build.log | tail -n 60
	PYTHONPATH=src $(PYTHON) -m pytest -q -m cuda -p no:cacheprovider tests 2>&1 | tee $(OUT)/pytest-cuda.log | tail -n 30
	PYTHONPATH=src $(PYTHON) -m opforge bench --quick --device cuda 2>&1 | tee $(OUT)/demo.log

# The committed results in docs/benchmarks/, regenerated on an idle machine:
# `make bench-docs` on the 2-core CPU, `make bench-docs DEVICE=cuda` on the
# H200 (one run per op family, and the conv backward apart, a few minutes
# each).
DEVICE ?= cpu
GPU_NAME ?= h200
bench-docs:
	@if [ "$(DEVICE)" = cuda ]; then \
		for spec in "add_relu add_relu" "softmax softmax --mode fwd --mode bwd" "nms nms" \
				"conv conv --mode fwd" "conv-bwd conv --mode bwd"; do \
			set -- $$spec; name=$$1; fam=$$2; shift 2; \
			PYTHONPATH=src $(PYTHON) -m opforge bench $$fam "$$@" --device cuda --no-progress \
				--json docs/benchmarks/$(GPU_NAME)-$$name.json --markdown docs/benchmarks/$(GPU_NAME)-$$name.md \
				--plot docs/benchmarks/$(GPU_NAME)-$$name.png || exit 1; \
		done; \
	else \
		PYTHONPATH=src $(PYTHON) -m opforge bench --device cpu --no-progress \
			--json docs/benchmarks/cpu.json --markdown docs/benchmarks/cpu.md --plot docs/benchmarks/cpu.png; \
	fi

clean:
	rm -rf build $(STAMPS) src/opforge/_C*.so src/*.egg-info
