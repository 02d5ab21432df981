# The two commands: `make demo` shows tether at work, `make test` runs every test.
# Both set everything up on a fresh machine: a virtual environment in .venv with the test
# dependencies (torch, numpy, pytest, ...), and tether built and installed into it.

VENV      ?= .venv
PYTHON    ?= python3
PY        := $(VENV)/bin/python
DEPS      := $(VENV)/.deps-installed
export VIRTUAL_ENV := $(abspath $(VENV))
export PATH := $(VIRTUAL_ENV)/bin:$(PATH)

.PHONY: all build wheel test test-rust test-python lint demo bench clean

all: build

$(DEPS): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch numpy pytest pytest-timeout maturin ruff loky py-spy
	touch $(DEPS)

# The `tether` command line is compiled into the extension module (tether._native), which
# the `tether` console script and `python -m tether` call: the package needs no binary.
build: $(DEPS)
	$(VENV)/bin/maturin develop --release --quiet

# The wheel a user installs (one abi3 wheel per platform), in dist/.
wheel: $(DEPS)
	$(VENV)/bin/maturin build --release --out dist

test: build lint test-rust test-python

test-rust:
	cargo test --workspace --exclude tether-py

test-python: build
	$(PY) -m pytest

lint: $(DEPS)
	cargo fmt --all -- --check
	cargo clippy --workspace --all-targets -- -D warnings
	$(VENV)/bin/ruff check python tests bench examples

demo: build
	@echo "== tether.spawn: a rank fails, the others are stopped, the root cause is reported"
	$(PY) examples/failing_rank.py
	@echo "== tether.spawn: a CPU training job over 2 ranks with torch.distributed (gloo)"
	$(PY) examples/train_gloo.py
	@echo "== the zygote: 8 processes from a script that imports torch"
	$(PY) examples/zygote.py
	@echo "== tether.Pool: one pool of workers serving DataLoaders epoch after epoch"
	$(PY) examples/pool_dataloaders.py
	@echo "== tether run: 4 ranks of a script, then the same with rank 2 failing"
	$(VENV)/bin/tether run -n 4 examples/rank_report.py
	-$(VENV)/bin/tether run -n 4 --grace-period 5 examples/rank_report.py --fail

bench: build
	$(PY) bench/spawn.py
	$(PY) bench/launcher.py
	$(PY) bench/loaders.py
	$(PY) bench/executor.py
	$(PY) bench/stacks.py

clean:
	rm -rf target dist $(VENV) python/tether/*.so
