"""Fail early and once: the checks a recipe runs before any process group starts, and how a
config error is reported.

* :func:`check_world_size` resolves the ``parallel`` group for the world size torchrun gives
  (``WORLD_SIZE``; 1 without torchrun) exactly as set-up will, but before
  ``init_process_group``: a layout that cannot run on that many ranks fails at once (no
  rendezvous, no hang), naming the degrees and the world sizes it does fit. A degree the config
  leaves open (``data_degree`` or, under semi-auto, ``tensor_degree: null``) that comes out as 1
  is a warning, so a run never quietly trains without the parallelism its layout names.
* :func:`config_errors_once` turns a config error (``ValueError``) raised in that phase into one
  line on rank 0's stderr — the problem and its fix — and a quiet exit with the same code on
  every other rank (the config, hence the error, is the same on every rank). The quiet ranks
  let rank 0 go first: torchrun stops every worker as soon as one exits, so a quiet rank that
  left first would get rank 0 killed before it printed anything. They wait (at most
  :data:`QUIET_WAIT_S`) until torchrun stops them, and leave with the same code. As with Hydra,
  ``HYDRA_FULL_ERROR=1`` shows the full traceback instead.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from collections.abc import Iterator

from omegaconf import DictConfig

from parallel import ParallelConfig
from parallel.config import OperatorSplit
from recipes.parallel_mode import group_split, parallel_config
from recipes.quiet_start import EXIT_CODE, hold_stop, release_stop
from recipes.run_dir import env_rank

log = logging.getLogger(__name__)

FULL_ERROR = "HYDRA_FULL_ERROR"
#: how long a quiet rank waits for rank 0 to report and torchrun to stop it
QUIET_WAIT_S = 60.0


class ConfigError(ValueError):
    """A setting that cannot work, found before any work starts; ``fix`` says what to change."""

    def __init__(self, problem: str, fix: str) -> None:
        super().__init__(f"{problem}. Fix: {fix}")
        self.problem, self.fix = problem, fix


def env_world_size() -> int:
    """The number of ranks torchrun launches (``WORLD_SIZE``), 1 without torchrun."""
    value = os.environ.get("WORLD_SIZE", "1")
    if not value.isdigit() or int(value) < 1:
        raise ConfigError(f"WORLD_SIZE={value!r} is not a positive number of ranks",
                          "launch with torchrun --nproc-per-node N, or unset WORLD_SIZE")
    return int(value)


def _resolve(cfg: DictConfig, world_size: int) -> ParallelConfig:
    return parallel_config(cfg.parallel, world_size, cfg.get("hetero"),
                           cfg.trainer.get("grad_accum_steps", 1), cfg.get("offload"))


def _fits(cfg: DictConfig, world_size: int) -> bool:
    try:
        _resolve(cfg, world_size)
    except ValueError:
        return False
    return True


def _open_degree(cfg: DictConfig) -> str | None:
    """The degree the layout leaves to the world size: tensor under semi-auto with
    ``tensor_degree: null`` (it takes a stage's ranks), else data unless it is set."""
    p = cfg.parallel
    if group_split(p) is OperatorSplit.STRATEGIES and p.get("tensor_degree") is None:
        return "tensor_degree"
    return "data_degree" if p.get("data_degree") is None else None


def check_world_size(cfg: DictConfig, world_size: int | None = None) -> ParallelConfig:
    """The ``parallel`` group resolved for ``world_size`` (default: ``WORLD_SIZE``), checked
    before any process group starts: ConfigError naming the world sizes the layout fits when it
    does not fit this one; a warning (rank 0) when its open degree comes out as 1."""
    world = env_world_size() if world_size is None else world_size
    name = cfg.parallel.name
    try:
        resolved = _resolve(cfg, world)
    except ValueError as err:
        fits = [n for n in range(1, 129) if _fits(cfg, n)]  # ~1 s with strategy files
        if not fits:
            raise
        open_degree = _open_degree(cfg)
        full = next((n for n in fits if open_degree is None or
                     getattr(_resolve(cfg, n), open_degree) > 1), fits[0])
        sizes = ", ".join(map(str, fits[:4])) + (", ..." if len(fits) > 4 else "")
        fix = (f"run it in one process (without torchrun), or use parallel=data on {world} ranks"
               if fits == [1] else
               f"launch it on {sizes} ranks (torchrun --nproc-per-node {full} gives every "
               f"dimension it names more than one rank), or choose a layout for {world} rank(s)"
               + (" (parallel=none or parallel=data)" if world == 1 else " (e.g. parallel=data)"))
        raise ConfigError(
            f"parallel={name} does not fit this job's {world} rank(s) (WORLD_SIZE={world}): "
            f"{str(err).removeprefix('ParallelConfig: ')}", fix) from err
    degree = _open_degree(cfg)
    trivial = world == 1 and resolved.operator_split is OperatorSplit.REPLICAS
    if degree is not None and getattr(resolved, degree) == 1 and not trivial and env_rank() == 0:
        others = {k: getattr(resolved, k) for k in ("pipeline_degree", "tensor_degree",
                                                    "expert_degree", "context_degree")
                  if k != degree}
        taken = " × ".join(f"{k}={v}" for k, v in others.items() if v > 1)
        what = {"data_degree": "data parallelism (one replica)",
                "tensor_degree": "tensor parallelism (the strategy file shards nothing)"}[degree]
        log.warning("parallel.%s comes out as 1 on %d rank(s)%s: parallel=%s runs without %s; "
                    "launch more ranks for it", degree, world,
                    f" ({taken} take them all)" if taken else "", name, what)
    return resolved


@contextlib.contextmanager
def config_errors_once() -> Iterator[None]:
    """Report a ValueError raised inside as a config error: one line on rank 0's stderr, a quiet
    exit with :data:`EXIT_CODE` elsewhere; the full traceback with ``HYDRA_FULL_ERROR=1``."""
    try:
        yield
    except ValueError as err:
        if os.environ.get(FULL_ERROR) == "1":
            raise
        report_config_error(str(err))
        raise SystemExit(EXIT_CODE) from None


def report_config_error(text: str) -> None:
    """``text`` as one ``Config error:`` line on rank 0's stderr; any other rank waits quietly
    for torchrun's stop (:func:`_let_rank_zero_go_first`)."""
    if env_rank() == 0:
        text = " ".join(text.split())  # one line, whatever the message's layout
        print(f"Config error: {text} (set {FULL_ERROR}=1 for the traceback)", file=sys.stderr,
              flush=True)
    else:
        _let_rank_zero_go_first()


def _let_rank_zero_go_first() -> None:
    """Wait until torchrun stops this quiet rank (SIGTERM, once rank 0 has exited) or
    :data:`QUIET_WAIT_S` passes; either way the exit code is :data:`EXIT_CODE`."""
    hold_stop()  # held already when the recipe started as a script (quiet_start.py)
    try:
        time.sleep(QUIET_WAIT_S)
    finally:
        release_stop()
