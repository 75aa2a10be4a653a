# Two commands: `make demo` and `make test`. Each creates .venv on first use.
# Also: `make lint` (ruff, mypy), `make test-ray` (Ray Train), `make test-oldest` (the oldest DeepSpeed in range), `make test-wheel`
# (the built wheel installed in a fresh venv), `make docs`; `.ci/run` runs them all.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# The CPU build of torch lies on this kind of machine's disk; installing it first keeps pip from
# pulling a multi-GB CUDA build for the package's `torch` range. Override with TORCH_SPEC=torch.
TORCH_SPEC ?= torch==2.13.0

.PHONY: demo test fuzz mutate lint test-ray test-oldest test-wheel bench docs venv clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_SPEC)" || $(PY) -m pip install --quiet torch
	$(PY) -m pip install --quiet -e ".[test,plot,integrations,s3-test]"
	@# transformers imports torchvision whenever it is installed, and none matches torch 2.13 CPU.
	@$(PY) -c "import importlib.util, sys; sys.exit('torchvision is installed: uninstall it (the integrations do not need it)' if importlib.util.find_spec('torchvision') else 0)"
	touch $@

venv: $(VENV)/.installed

demo: $(VENV)/.installed
	$(PY) examples/train_zero.py --nproc 2 --stage 3 --steps 200

test: $(VENV)/.installed
	$(PY) -m pytest -q

# The hostile tables (docs/reliability.md) at a larger seed budget than CI's: FUZZ_BUDGET seeds per class
# (default 8), starting at FUZZ_SEED. Minutes, not seconds.
FUZZ_BUDGET ?= 8
FUZZ_SEED ?= 0
fuzz: $(VENV)/.installed
	FE_FUZZ_BUDGET=$(FUZZ_BUDGET) FE_FUZZ_SEED=$(FUZZ_SEED) $(PY) -m pytest -q -s tests/test_hostile_*.py tests/test_faults.py

# Mutation testing (docs/reliability.md, "Mutation testing"), not run by CI: mutmut in its own venv
# (.venv-mutate, which reads the project venv's packages), each module against its fast test selection
# (.ci/mutate.py). MUTATE_MODULES="schedules _core" picks modules; nice -n 10: it keeps the cores busy.
MUTATE_VENV := .venv-mutate
MUTMUT_SPEC ?= mutmut==3.8.1
MUTATE_MODULES ?=
$(MUTATE_VENV)/.installed: $(VENV)/.installed
	$(PY) -m venv $(MUTATE_VENV)
	$(MUTATE_VENV)/bin/python -m pip install --quiet "$(MUTMUT_SPEC)"
	$(MUTATE_VENV)/bin/python -c "import pathlib, sysconfig; pathlib.Path(sysconfig.get_paths()['purelib'], 'zz_project_venv.pth').write_text('$(abspath $(VENV))/lib/python' + sysconfig.get_python_version() + '/site-packages\\n')"
	touch $@

mutate: $(MUTATE_VENV)/.installed
	nice -n 10 $(MUTATE_VENV)/bin/python .ci/mutate.py $(MUTATE_MODULES)

# ruff (lint and format) over the tree, mypy over the package; the pinned versions of the lint extra.
lint: $(VENV)/.installed
	@$(PY) -c "import importlib.metadata as m, sys; sys.exit(m.version('ruff') != '0.17.6' or m.version('mypy') != '2.4.1')" 2>/dev/null || $(PY) -m pip install --quiet -e ".[lint]"
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy functional_ema

# Ray Train on a local Ray (loopback) and the local S3 server, and the HF Trainer's hyperparameter_search test (its
# Ray backend imports ray.tune): the ray extra added to .venv on first use.
test-ray: $(VENV)/.installed
	@$(PY) -c "import ray.train.torch" 2>/dev/null || $(PY) -m pip install --quiet -e ".[ray]"
	$(PY) -m pytest -q tests/test_ray_train.py \
		"tests/test_integrations_transformers.py::test_a_hyperparameter_search_trial_keeps_its_ema_in_its_own_checkpoints"

# The smoke subset (.ci/smoke-tests.txt) on the oldest DeepSpeed in pyproject's range, in .venv-oldest.
test-oldest:
	bash .ci/oldest.sh

# sdist and wheel built, the wheel's files checked, installed into a fresh venv and run from outside the checkout.
test-wheel:
	bash .ci/wheel.sh

# The documentation site into site/ (the docs extra installed on first use); warnings are errors.
docs: $(VENV)/.installed
	@$(PY) -c "import mkdocstrings_handlers.python, material" 2>/dev/null || $(PY) -m pip install --quiet -e ".[docs]"
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet

# Each benchmark prints its figures and draws them into a dated PNG in benchmarks/results/.
bench: $(VENV)/.installed
	$(PY) benchmarks/bench_update.py --plot benchmarks/results/bench_update_$$(date +%F).png
	$(PY) benchmarks/bench_checkpoint.py --plot benchmarks/results/bench_checkpoint_$$(date +%F).png

clean:
	rm -rf $(VENV) .venv-oldest .venv-build .venv-wheel .venv-mutate .mutate build dist site *.egg-info
