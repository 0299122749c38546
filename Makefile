# fa3_inductor developer entry points.
#
#   make venv   create .venv (CPU torch 2.13.0 unless torch is already importable) and install the package
#   make test   run the CPU test suite (everything not marked `gpu`)
#   make demo   run examples/demo.py (CPU path without a GPU)
#   make gpu    run the GPU suite (tests marked `gpu` + benchmark); meant for an H100/H200 machine
#   make clean  remove the virtual environment and build/test droppings

PYTHON ?= python3
VENV   := .venv
VPY    := $(VENV)/bin/python
STAMP  := $(VENV)/.fa3_inductor-installed

# Pinned so that a CPU-only machine takes the local CPU wheel instead of a multi-GB CUDA build.
TORCH_PIN  := torch==2.13.0
TEST_DEPS  := triton==3.6.0 "numpy<2.4" expecttest pytest pytest-xdist transformers==5.17.0
# Test processes: pytest-xdist's "auto" is one per core (CI: 2). TEST_WORKERS=0 runs in-process.
TEST_WORKERS ?= auto

.PHONY: venv test demo gpu clean

venv: $(STAMP)

# Re-run the install when the package metadata or this recipe changes; otherwise `make venv` is a no-op.
$(STAMP): pyproject.toml Makefile
	@test -x $(VPY) || $(PYTHON) -m venv --system-site-packages $(VENV)
	@if $(VPY) -c "import torch" >/dev/null 2>&1; then \
		echo "venv: torch already importable: $$($(VPY) -c 'import torch; print(torch.__version__)')"; \
	else \
		echo "venv: installing $(TORCH_PIN)"; \
		$(VPY) -m pip install -q "$(TORCH_PIN)"; \
	fi
	$(VPY) -m pip install -q $(TEST_DEPS)
	$(VPY) -m pip install -q --no-deps -e .
	@touch $@

test: venv
	@rc=0; $(VPY) -m pytest -q -n $(TEST_WORKERS) --dist loadgroup --durations=25 tests -m "not gpu and not sm90_compile" || rc=$$?; \
	if [ $$rc -eq 0 ]; then $(VPY) -m pytest -q -n $(TEST_WORKERS) --dist loadgroup --durations=15 tests -m "sm90_compile and not gpu" || rc=$$?; fi; \
	if [ $$rc -eq 5 ]; then echo "make test: FAILED: pytest collected no tests (exit code 5)" >&2; fi; \
	exit $$rc

demo: venv
	$(VPY) examples/demo.py

gpu:
	bash benchmarks/gpu_suite.sh

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache .device_out
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
