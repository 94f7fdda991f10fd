# make train: trains the demo model (simulated CPU devices when there is no GPU)
# make test:  the test suite on 8 simulated CPU devices, less its costly repeats (SLOW)
# make test-fast: each feature once (tests/conftest.py FAST), a few minutes
# make test-slow: the costly repeats make test leaves out (tests/conftest.py SLOW; CI runs them)
# make test-all: both, in one session
# make test-planner: the planner's estimate against the compiled step on 24 drawn layouts
# make bench: throughput / compile time / memory of a named config and mesh (BENCH_ARGS=...)
# make notebook: opens notebooks/small_meshes.ipynb in JupyterLab (installed into .venv on first use)
# make versions: the Python and jax that .venv runs
#
# The interpreter: the newest Python >= 3.12 on PATH or under pyenv (jax >= 0.11 needs 3.12;
# 3.11 gets jax 0.10.2 at most), else python3; `make test PYTHON=python3.11 VENV=.venv-oldest`
# picks another. A venv made by another Python is made again (its stamp names the version).
VENV ?= .venv
PY := $(VENV)/bin/python
ifeq ($(origin PYTHON),undefined)
PYTHON := $(or $(shell for p in $$(command -v python3.19 python3.18 python3.17 python3.16 \
	python3.15 python3.14 python3.13 python3.12 python3) $${PYENV_ROOT:-$$HOME/.pyenv}/versions/3.1[2-9]*/bin/python3.1[2-9]; do \
	"$$p" -c 'import sys; assert sys.version_info >= (3, 12); print(*sys.version_info[:3])' \
	2>/dev/null | sed "s|$$| $$p|"; done | sort -n -k1,1 -k2,2 -k3,3 | tail -n 1 | cut -d" " -f4),python3)
endif
PYVER := $(shell $(PYTHON) -c 'import sys; print("%d.%d.%d" % sys.version_info[:3])')
STAMP := $(VENV)/.installed-python$(PYVER)

.PHONY: train test test-fast test-slow test-all test-planner bench notebook versions clean

$(STAMP): pyproject.toml
	@test -n "$(PYVER)" || { echo "$(PYTHON) does not run"; exit 1; }
	@if [ -d $(VENV) ] && [ "$$($(PY) -c 'import sys; print("%d.%d.%d" % sys.version_info[:3])' 2>/dev/null)" != "$(PYVER)" ]; then \
		echo "$(VENV) is not Python $(PYVER)'s: making it again"; rm -rf $(VENV); fi
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	rm -f $(VENV)/.installed*
	touch $@

versions: $(STAMP)
	@$(PY) -c 'import sys, jax, jaxlib; print("python", sys.version.split()[0], sys.executable); print("jax", jax.__version__, "jaxlib", jaxlib.__version__)'

train: $(STAMP)
	$(PY) -m spmd3d.train $(ARGS)

test: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist loadgroup --durations=10 -m "not slow" tests $(PYTEST_ARGS)

test-slow: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist loadgroup --durations=10 -m slow tests $(PYTEST_ARGS)

test-all: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist loadgroup --durations=10 tests $(PYTEST_ARGS)

test-fast: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist loadgroup --durations=5 -m fast tests $(PYTEST_ARGS)

bench: $(STAMP)
	$(PY) -m spmd3d.bench $(BENCH_ARGS)

notebook: $(STAMP)
	$(PY) -c "import jupyterlab" 2>/dev/null || $(PY) -m pip install --quiet jupyterlab
	$(VENV)/bin/jupyter lab notebooks/small_meshes.ipynb

clean:
	rm -rf $(VENV) runs *.egg-info

# the planner's property over a larger sample of drawn layouts (docs/tests.md)
test-planner: $(STAMP)
	PLANNER_DRAWS=$${PLANNER_DRAWS:-24} $(PY) -m pytest -q -s -n 0 tests/test_planner_property.py -k drawn $(PYTEST_ARGS)
