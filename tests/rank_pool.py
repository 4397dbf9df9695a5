"""Gloo ranks kept alive between tests: spawn once per world size, run many test functions.

Each ``run_ranks`` used to spawn fresh processes: on this project's 2-core machine that is ~2.7 s
for 2 ranks and ~5.8 s for 4 (importing torch, and transformers and hydra where a test needs
them) before the first line of the test runs, paid ~100 times per suite. A pool keeps ``world``
rank processes and hands them one test function at a time, so the imports are paid once.

What makes a pooled run equal to a fresh one, per task:

* the environment is the caller's at the moment of the call (as a fresh spawn would inherit it)
  plus torchrun's variables with a new ``MASTER_PORT``: each task makes its own process group
  (a *plain* pool of one process gets none: ``python script.py`` as a user runs it alone);
* torch's default random generator is reseeded as a fresh process has it, the default dtype and
  the thread count are put back, and the MindSpore-style context is reset;
* after the task, every rank destroys its process group (``parallel.destroy``: groups, DTensor
  caches and their gloo threads go with it); a rank whose group the task left broken (a test
  of a stalled peer) cannot, and ends instead;
* a rank where a process group's gloo threads outlive that destroy (something the task built
  still holds a group) takes no other test: it answers the next one "retired" and ends, and the
  pool is made anew and runs that test.

What a pool cannot give, a fresh spawn does (``run_ranks(fresh=True)``, and always for
``may_die`` and ``env=``): a rank meant to die, an environment read when a process starts
(``MALLOC_CHECK_``), a check of what a process holds as a whole (its threads). Any failure,
timeout or death ends the pool; the next call starts a new one. ``HETERO_TEST_FRESH_RANKS=1``
turns pooling off for a run.
"""

from __future__ import annotations

import faulthandler
import os
import pickle
import queue
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

FRESH_ENV = "HETERO_TEST_FRESH_RANKS"
_POOLS: dict[tuple[int, bool], RankPool] = {}  # (world, plain) -> its pool


def _reset_after_task() -> None:
    """What a finished task leaves that a fresh process would not have."""
    import gc

    import torch

    import parallel

    if parallel.is_initialized():
        parallel.destroy()
    parallel.context.reset_auto_parallel_context()
    torch.set_default_dtype(torch.float32)
    gc.collect()


def gloo_threads() -> list[str]:
    """The names of this process's gloo threads, sorted (each group's workers and transport
    loop): what a process group still alive keeps running."""
    names: list[str] = []
    if not os.path.isdir("/proc/self/task"):  # not Linux: nothing to look at
        return names
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as comm:
                name = comm.read().strip()
        except OSError:  # the thread ended meanwhile
            continue
        if "gloo" in name:
            names.append(name)
    return sorted(names)


def _module_functions() -> dict[tuple[str, str], Any]:
    """The functions of the modules a test patches inside a rank (``torch.distributed``, the
    device module) as they are now: a task that replaces one and leaves it replaced changes
    every later task in this process."""
    import torch.distributed as dist

    import foundation.device as hd

    return {(module.__name__, name): value for module in (dist, hd)
            for name, value in vars(module).items()
            if callable(value) and not isinstance(value, type)}


def _restore_patched(functions: dict[tuple[str, str], Any]) -> list[str]:
    """Put back every function of ``functions`` a task replaced; their names."""
    patched = []
    for (module, name), value in functions.items():
        if getattr(sys.modules[module], name, None) is not value:
            setattr(sys.modules[module], name, value)
            patched.append(f"{module}.{name}")
    return patched


class _Retired(Exception):
    """A pooled rank refused a task: a process group of an earlier one outlived it."""


def _worker(rank: int, world: int, inbox: Any, results: Any, parent: int) -> None:
    faulthandler.enable(all_threads=True)  # a native crash names its Python stacks
    import torch

    from distributed import rank_env

    fresh_seed = torch.initial_seed()  # what an unseeded fresh process draws from
    functions = _module_functions()
    retired = False  # an earlier task left a process group alive in this process
    while True:
        try:
            task = inbox.get(timeout=5)
        except queue.Empty:
            if os.getppid() != parent:  # the test session is gone
                return
            continue
        if task is None:
            return
        task_id, port, environ, fn, args = task
        if retired:
            results.put((task_id, rank, "retired", None))
            return
        os.environ.clear()  # a plain process (port None): no torchrun variables
        os.environ.update({**environ, **(rank_env(rank, world, port) if port else {})})
        torch.manual_seed(fresh_seed)
        torch.set_num_threads(1)
        try:
            value = pickle.dumps(fn(rank, world, *args))
            if patched := _restore_patched(functions):  # the test fails by name; the next
                results.put((task_id, rank, "error", f"the task left {patched} replaced "
                             f"(restored now): restore them in a finally, the rank runs other "
                             f"tests' tasks next"))  # task gets the real ones
            else:
                results.put((task_id, rank, "ok", value))
        except BaseException:  # report everything, including SystemExit from a rank's code
            _restore_patched(functions)
            results.put((task_id, rank, "error", traceback.format_exc()))
        try:
            _reset_after_task()
        except BaseException:  # a group the task left broken (a stalled peer's test): this
            return  # rank ends, and the next call makes a new pool
        retired = bool(gloo_threads())


class RankPool:
    """``world`` spawned gloo ranks that run one function at a time (module docstring)."""

    def __init__(self, world: int) -> None:
        ctx = mp.get_context("spawn")
        self.world = world
        self.inboxes = [ctx.Queue() for _ in range(world)]
        self.results = ctx.Queue()
        self.procs = [ctx.Process(target=_worker, daemon=True,
                                  args=(r, world, self.inboxes[r], self.results, os.getpid()))
                      for r in range(world)]
        for proc in self.procs:
            proc.start()
        self.tasks = 0

    def alive(self) -> bool:
        return all(proc.is_alive() for proc in self.procs)

    def run(self, fn: Callable, args: tuple, timeout: float, port: int | None) -> list[Any]:
        self.tasks += 1
        task = (self.tasks, port, dict(os.environ), fn, args)
        for inbox in self.inboxes:
            inbox.put(task)
        collected: dict[int, Any] = {}
        deadline = time.monotonic() + timeout
        while len(collected) < self.world:
            try:
                task_id, rank, status, value = self.results.get(timeout=0.2)
            except queue.Empty:
                for rank, proc in enumerate(self.procs):
                    if proc.exitcode is not None and rank not in collected:
                        from distributed import _exit_text

                        raise AssertionError(f"rank {rank} exited with "
                                             f"{_exit_text(proc.exitcode)} without a result"
                                             ) from None
                if time.monotonic() > deadline:
                    missing = sorted(set(range(self.world)) - set(collected))
                    raise AssertionError(f"ranks {missing} gave no result within "
                                         f"{timeout:.0f}s (hang?)") from None
                continue
            if task_id != self.tasks:
                continue
            if status == "retired":
                raise _Retired(f"rank {rank}")
            if status == "error":
                raise AssertionError(f"rank {rank} failed:\n{value}")
            collected[rank] = pickle.loads(value)
        return [collected[r] for r in range(self.world)]

    def close(self) -> None:
        for inbox in self.inboxes:
            try:
                inbox.put(None)
            except (OSError, ValueError):
                pass
        for proc in self.procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)


def run_pooled(fn: Callable, world: int, args: tuple, timeout: float, port: int | None
               ) -> list[Any]:
    """``fn(rank, world, *args)`` on the pool of ``world`` ranks (made on first use); a pool
    whose task failed, hung or lost a rank is closed, and the error raised. ``port`` None: the
    plain pool (``world`` 1, no torchrun variables)."""
    key = (world, port is None)
    for attempt in range(2):
        pool = _POOLS.get(key)
        if pool is None or not pool.alive():
            pool = _POOLS[key] = RankPool(world)
        try:
            return pool.run(fn, args, timeout, port)
        except _Retired:  # the ranks of an earlier test that leaked a group: fresh ones,
            _POOLS.pop(key, None)  # on a port no refused rank may have touched
            pool.close()
            if attempt:
                raise
            from distributed import free_port

            port = None if port is None else free_port()
        except BaseException:
            _POOLS.pop(key, None)
            pool.close()
            raise
    raise AssertionError("unreachable")


def close_pools() -> None:
    """End every pool (the test session's end)."""
    while _POOLS:
        _POOLS.popitem()[1].close()
