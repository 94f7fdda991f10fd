# make train: trains the demo model (simulated CPU devices when there is no GPU)
# make test:  the test suite on 8 simulated CPU devices
# make test-fast: each feature once (tests/conftest.py FAST), a few minutes
# make bench: throughput / compile time / memory of a named config and mesh (BENCH_ARGS=...)
# make notebook: opens notebooks/small_meshes.ipynb in JupyterLab (installed into .venv on first use)
VENV ?= .venv
PY := $(VENV)/bin/python
PYTHON ?= python3

.PHONY: train test test-fast bench notebook clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	touch $@

train: $(VENV)/.installed
	$(PY) -m spmd3d.train $(ARGS)

test: $(VENV)/.installed
	$(PY) -m pytest -q -n 2 --dist loadgroup --durations=10 tests $(PYTEST_ARGS)

test-fast: $(VENV)/.installed
	$(PY) -m pytest -q -n 2 --dist loadgroup --durations=5 -m fast tests $(PYTEST_ARGS)

bench: $(VENV)/.installed
	$(PY) -m spmd3d.bench $(BENCH_ARGS)

notebook: $(VENV)/.installed
	$(PY) -c "import jupyterlab" 2>/dev/null || $(PY) -m pip install --quiet jupyterlab
	$(VENV)/bin/jupyter lab notebooks/small_meshes.ipynb

clean:
	rm -rf $(VENV) runs *.egg-info

# make test-planner: the planner's property over a larger sample of drawn layouts (docs/tests.md)
.PHONY: test-planner
test-planner: $(VENV)/.installed
	PLANNER_DRAWS=$${PLANNER_DRAWS:-24} $(PY) -m pytest -q -s -n 0 tests/test_planner_property.py -k drawn $(PYTEST_ARGS)
