# The README's two commands are `make train` and `make test`; both install what they need first.
# constraints.txt pins torch to the CPU build this kind of machine carries locally: an unpinned
# `torch` requirement would pull several GB of CUDA wheels onto a CPU-only host.
PYTHON ?= python
PIP := $(PYTHON) -m pip install --quiet -c constraints.txt
TORCHRUN := OMP_NUM_THREADS=1 $(PYTHON) -m torch.distributed.run --standalone
NPROC ?= 2
# pytest-xdist workers: whole test files go to each; one more than this 2-core machine's cores,
# so a worker waiting on a peer's timeout, a rank's start or a launcher's poll leaves no core idle
# (fresh clones, 2026-12-07, the same code each time: 24:50 on three, 26:53 on two; later 20:28 on
# three, 22:16 on four; TEST_WORKERS=0: in-process)
TEST_WORKERS ?= 3

.PHONY: install install-dev train test lint memcheck quarantine bench device-check device-wheels

install:
	$(PIP) -e .

install-dev:
	$(PIP) -e ".[dev]"

train: install  ## the default recipe: small GPT, 2 gloo ranks (override with ARGS="optim.lr=1e-3 ...")
	$(TORCHRUN) --nproc-per-node $(NPROC) recipes/train.py $(ARGS)

lint: install-dev  ## ruff (style, banned private-torch and mesh APIs, complexity), then mypy (setup.cfg)
	$(PYTHON) -m ruff check foundation hetero parallel recipes tests benchmarks launch .ci
	$(PYTHON) -m mypy

test: lint  ## lint, then the whole suite on TEST_WORKERS processes (CPU; CUDA-marked tests skip without a GPU)
	$(PYTHON) -m pytest -n $(TEST_WORKERS) --dist loadfile $(ARGS)

memcheck: install-dev  ## one rank of the pipeline x expert cases under valgrind's memcheck (~8 min; ARGS="--rank 3")
	$(PYTHON) .ci/memcheck.py $(ARGS)

quarantine: install-dev  ## pytest with every process on the quarantine allocator (ARGS="tests" for the whole suite)
	$(PYTHON) .ci/quarantine.py $(ARGS)

bench: install
	$(TORCHRUN) --nproc-per-node 2 benchmarks/collectives.py

# Runs the machine's own torch as it is (a GPU node's CUDA build; nothing is installed): install-dev
# first where pip reaches a registry; an offline node takes device-wheels' files (docs/device-check.md)
device-check:  ## the ten-minute acceptance run of this machine's accelerators: one markdown table
	$(PYTHON) benchmarks/device_check.py $(ARGS)

# The pure-Python packages a GPU node's image lacks, as wheels in .whl/ (about 400 KB), at the
# versions this machine runs; `pip wheel` builds antlr4's (it ships as source only)
device-wheels:  ## wheels of hydra-core, omegaconf and antlr4 for an offline device node
	$(PYTHON) -m pip download --quiet --no-deps --only-binary=:all: -d .whl \
		"hydra-core==$$($(PYTHON) -c 'import hydra; print(hydra.__version__)')" \
		"omegaconf==$$($(PYTHON) -c 'import omegaconf; print(omegaconf.__version__)')"
	$(PYTHON) -m pip wheel --quiet --no-deps -w .whl "antlr4-python3-runtime==$$($(PYTHON) -c \
		'import importlib.metadata as m; print(m.version("antlr4-python3-runtime"))')"
