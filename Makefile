# The two commands: `make demo` shows tether at work, `make test` runs every test
# (`make test-fast`: all but the slowest, for the edit-test loop).
# Both set everything up on a fresh machine: a virtual environment in .venv with the test
# dependencies (torch, numpy, pytest, ...), and tether built and installed into it.

VENV      ?= .venv
PYTHON    ?= python3
PY        := $(VENV)/bin/python
DEPS      := $(VENV)/.deps-installed
export VIRTUAL_ENV := $(abspath $(VENV))
export PATH := $(VIRTUAL_ENV)/bin:$(PATH)

.PHONY: all build wheel test test-fast test-rust test-python lint docs demo bench clean FORCE

all: build

# The versions the tests and linters were last run with (torch and numpy are test
# dependencies only: tether itself never imports them; cloudpickle is tether's one
# dependency, pinned here to the version the tests ran with; IPython runs notebook-like
# cells; mkdocs builds the documentation site, mkdocstrings its API reference from the
# docstrings; pyte renders a terminal for the tests).
TEST_DEPS := torch==2.15.0 numpy==2.4.6 pytest==9.2.0 pytest-timeout==2.4.0 loky==3.7.0 py-spy==0.4.3 \
             cloudpickle==3.1.3 ipython==9.18.1 mkdocs==1.6.1 mkdocstrings==1.0.8 \
             mkdocstrings-python==2.0.11 pyte==0.8.2
TOOLS     := maturin==1.16.0 ruff==0.17.6 mypy==2.4.1

$(DEPS): pyproject.toml Makefile
	@echo "== setting up $(VENV): a virtual environment for the tests"
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	@echo "== installing $(TEST_DEPS) $(TOOLS)"
	@echo "   (torch is about 5 GB: the first time, this takes a few minutes)"
	$(PY) -m pip install --progress-bar off $(TEST_DEPS) $(TOOLS)
	touch $(DEPS)

# The `tether` command line is compiled into the extension module (tether._native), which
# the `tether` console script and `python -m tether` call: the package needs no binary.
# tether is installed editable (python/ is used in place), so it is built again only when
# what the build reads changed (the Rust sources and Cargo files, pyproject.toml, the files
# installed beside the package, the environment), or when the compiled module is missing.
BUILT        := $(VENV)/.tether-built
BUILD_INPUTS := Cargo.toml Cargo.lock pyproject.toml \
                $(shell find crates/*/Cargo.toml crates/*/src python/tether.data -type f 2>/dev/null)

build: $(BUILT)

$(BUILT): $(DEPS) $(BUILD_INPUTS) $(if $(wildcard python/tether/_native*.so),,FORCE)
	@echo "== building tether (Rust, release; the first build takes a minute or two)"
	$(VENV)/bin/maturin develop --release
	touch $@

# The wheel a user installs (one abi3 wheel per platform), in dist/.
wheel: $(DEPS)
	$(VENV)/bin/maturin build --release --out dist

test: build lint docs test-rust test-python

# The edit-test loop: every test but those marked slow (the wheel's, and the longest stress
# tests; see the "slow" marker in pyproject.toml).
test-fast: build test-rust
	@echo "== Python tests, but the slow ones"
	$(PY) -m pytest -m "not slow"

test-rust:
	@echo "== Rust tests"
	cargo test --workspace --exclude tether-py

test-python: build
	@echo "== Python tests"
	$(PY) -m pytest

# Formatting and lints, the type checker over python/tether, the stubs of the compiled
# module checked against its real signatures, and the layout rules (sizes, imports one way).
lint: build
	@echo "== lint and type checks"
	cargo fmt --all -- --check
	cargo clippy --workspace --all-targets -- -D warnings
	$(VENV)/bin/ruff check python tests bench examples tools
	$(PY) -m mypy
	$(PY) -m mypy.stubtest tether._native
	$(PY) tools/layout.py

# The documentation site (docs/, mkdocs.yml), built strictly: a broken link, a missing anchor
# or a page left out of the navigation fails the build. It is built into a temporary
# directory, removed after: `.venv/bin/mkdocs serve` shows it while you write.
docs: $(DEPS)
	@echo "== the documentation site, built strictly"
	@site=$$(mktemp -d) && trap 'rm -rf "$$site"' EXIT && \
	  $(VENV)/bin/mkdocs build --strict --site-dir "$$site"

# Each section says in one line what to notice; every number printed is labelled.
demo: build
	@echo
	@echo "== 1. tether.spawn: rank 2 fails first, rank 3 later; the others are stopped"
	@echo "   notice: the root cause reported is rank 2 (first in time), with its traceback"
	@$(PY) examples/failing_rank.py
	@echo
	@echo "== 2. tether.spawn: a CPU training job over 2 ranks with torch.distributed (gloo)"
	@echo "   notice: the loss falls and both ranks end with identical weights"
	@$(PY) examples/train_gloo.py
	@echo
	@echo "== 3. the zygote: 2 processes started by torch, then by tether, from a script that imports torch"
	@echo "   notice: a warm start costs a fork (milliseconds per process), not an interpreter and torch"
	@$(PY) examples/zygote.py
	@echo
	@echo "== 4. tether.Pool: one pool serving two DataLoaders at a time, epoch after epoch"
	@echo "   notice: the same worker pids serve every epoch; no worker is started again"
	@$(PY) examples/pool_dataloaders.py
	@echo
	@echo "== 5. tether run: 4 ranks of a script, with torchrun's command line"
	@echo "   notice: every line carries its rank; torchrun's environment in each rank"
	@$(VENV)/bin/tether run --nproc-per-node 4 examples/rank_report.py
	@echo
	@echo "== 6. tether run: the same with rank 2 failing"
	@echo "   notice: the root cause is rank 2, the first to fail; tether stopped the other ranks"
	@$(VENV)/bin/tether run --nproc-per-node 4 --grace-period 5 examples/rank_report.py --fail; \
	  code=$$?; echo "tether run exited with $$code: rank 2's exit code, as torchrun would"; \
	  test $$code -eq 1

bench: build
	$(PY) bench/spawn.py
	$(PY) bench/launcher.py
	$(PY) bench/loaders.py
	$(PY) bench/executor.py
	$(PY) bench/stacks.py
	$(PY) bench/share.py
	$(PY) bench/watch.py
	$(PY) bench/gpu_check.py

clean:
	rm -rf target dist $(VENV) python/tether/*.so
