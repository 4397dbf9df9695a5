"""Run a test function on N CPU ranks over gloo, the way torchrun would, and collect the results.

torch's ``MultiProcessTestCase`` does the same inside ``unittest``; this is the pytest-shaped
version: each rank is a fresh spawned process with torchrun's environment variables, calls
``parallel.init()`` itself, and returns a picklable value. Ranks stay off the accelerator
(``$HETERO_PARALLEL_ACCELERATOR=none``): they are gloo ranks, also on a GPU or NPU machine. A
rank that raises fails the test with that rank's traceback; ranks that outlive ``timeout`` are
killed, so a hang fails instead of stalling the suite.
"""

from __future__ import annotations

import contextlib
import ctypes.util
import faulthandler
import os
import pickle
import queue
import signal
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import torch.multiprocessing as mp
from ports import _ephemeral_ports, free_port  # noqa: F401  (benchmarks/ports.py)

from foundation.device import ACCELERATOR_ENV
from rank_pool import FRESH_ENV, run_pooled


def torchrun_env(rank: int, world: int, port: int) -> dict[str, str]:
    """The variables torchrun gives ``rank`` of ``world`` workers on this host."""
    return {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}


def rank_env(rank: int, world: int, port: int) -> dict[str, str]:
    """torchrun's variables for ``rank`` of ``world`` on this host, and the device layer's switch
    that keeps the rank on the host: these are gloo ranks, and on a machine with fewer
    accelerators than ranks (or one) they would otherwise share device 0."""
    return {**torchrun_env(rank, world, port), "OMP_NUM_THREADS": "1", ACCELERATOR_ENV: "none"}


def _rank_main(rank: int, world: int, port: int, fn: Callable, args: tuple, results: Any) -> None:
    # a rank that dies in native code (a segfault, glibc's abort on a corrupted heap) prints
    # every thread's Python stack to the test's stderr, so the failure names where it was
    faulthandler.enable(all_threads=True)
    os.environ.update(rank_env(rank, world, port))
    import torch

    torch.set_num_threads(1)
    try:
        # Plain pickle bytes: torch.multiprocessing would share tensors through file descriptors
        # that die with this process, before the parent has read them.
        results.put((rank, "ok", pickle.dumps(fn(rank, world, *args))))
    except BaseException:  # report everything, including SystemExit from a rank's code
        results.put((rank, "error", traceback.format_exc()))


def glibc_heap_checks() -> dict[str, str]:
    """Environment that makes glibc check a process's heap: every block filled with a pattern
    when allocated and when freed (``MALLOC_PERTURB_``: a read of freed or never-written memory
    gives garbage values, not plausible ones) and, where glibc's debugging malloc is installed
    (``libc_malloc_debug.so.0``, glibc >= 2.34), every ``free`` and ``malloc`` validated
    (``MALLOC_CHECK_=3``: corruption aborts at once, naming the check). Both are read when a
    process starts: give it to :func:`run_ranks` as ``env``."""
    env = {"MALLOC_PERTURB_": "165"}
    debug = ctypes.util.find_library("c_malloc_debug")
    if debug is not None:
        env.update(MALLOC_CHECK_="3", LD_PRELOAD=" ".join(
            p for p in (os.environ.get("LD_PRELOAD", ""), debug) if p))
    return env


@contextlib.contextmanager
def _environment(env: dict[str, str]) -> Iterator[None]:
    """``env`` set in this process while it starts children (they read it at exec)."""
    before = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _exit_text(code: int) -> str:
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"code {code}"


def run_ranks(
    fn: Callable, world: int = 2, *args: Any, timeout: float = 120.0, may_die: tuple[int, ...] = (),
    env: dict[str, str] | None = None, fresh: bool = False,
) -> list[Any]:
    """Run ``fn(rank, world, *args)`` on ``world`` gloo ranks; return results in rank order.

    ``fn`` must be a module-level function (spawn pickles it by name). The ranks are a pool kept
    between calls (``rank_pool.py``: each call its own process group, environment and seed)
    unless ``fresh``: then, and for ``may_die`` and ``env``, they are new processes. Ranks listed
    in ``may_die`` are allowed to exit without a result (their entry is None): tests of a dying
    peer use it. ``env``: extra environment the ranks start with (e.g.
    :func:`glibc_heap_checks`). ``fresh``: for a check of what a whole process holds.
    """
    if not (fresh or may_die or env or os.environ.get(FRESH_ENV)):
        return run_pooled(fn, world, args, timeout, free_port())
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_rank_main, args=(r, world, port, fn, args, results), daemon=True)
        for r in range(world)
    ]
    with _environment(env or {}):
        for proc in procs:
            proc.start()
    collected: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(collected) < world:
            try:
                rank, status, value = results.get(timeout=0.2)
            except queue.Empty:
                for rank, proc in enumerate(procs):
                    if rank in collected or proc.exitcode is None:
                        continue
                    if rank not in may_die:
                        raise AssertionError(
                            f"rank {rank} exited with {_exit_text(proc.exitcode)} without a "
                            f"result"
                        ) from None
                    collected[rank] = None
                if time.monotonic() > deadline:
                    missing = sorted(set(range(world)) - set(collected))
                    raise AssertionError(
                        f"ranks {missing} gave no result within {timeout:.0f}s (hang?)"
                    ) from None
                continue
            if status == "error":
                raise AssertionError(f"rank {rank} failed:\n{value}")
            collected[rank] = pickle.loads(value)
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
    return [collected[r] for r in range(world)]


def error_after_rank_1_dies(rank: int, step: Callable[[], object]) -> str | None:
    """Inside a rank function: run ``step`` once on every rank, then kill rank 1 (``os._exit``:
    no clean shutdown) and run it again on the others. Returns the ``parallel.CollectiveError``
    message this rank got from the second run, or None if it got none. Run it with
    ``run_ranks(..., may_die=(1,))``."""
    import parallel

    step()
    if rank == 1:
        os._exit(3)
    try:
        step()
    except parallel.CollectiveError as err:
        return str(err)
    return None


def fsdp_param_groups(unit: Any) -> list[Any]:
    """FSDP2's parameter groups of ``unit`` (an ``FSDPModule``): torch 2.13 keeps a list of
    them, torch 2.11 one (or None)."""
    state = unit._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    return [state._fsdp_param_group] if state._fsdp_param_group is not None else []
