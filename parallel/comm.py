"""Process-group set-up: one ``parallel.init()`` under torchrun or in a plain single process.

Stands on ``torch.distributed.init_process_group``. What it adds:

* a default backend string that covers every device in use (``"cpu:gloo,cuda:nccl"``), so tensors
  on the host (CPU-placed layers, host embeddings, offloaded optimizer state) and tensors on the
  accelerator can both be reduced in one job;
* a real world-size-1 group when the script is not launched by torchrun, so code written for many
  ranks runs unchanged in one process;
* a bounded default timeout, so a rank that dies makes the others fail with an error instead of
  hanging forever;
* what a dead or stalled peer does on NCCL and HCCL: by default (``on_collective_failure=
  "abort"``) torch's asynchronous error handling, whose watchdog ends the process after the
  timeout, so communication overlaps compute and the host never waits on a collective (a
  launcher restarts the job); with ``"raise"``, blocking waits without the watchdog's
  tear-down, so the failed collective raises after the timeout and ``collective_guard`` turns
  it into ``parallel.CollectiveError``, at the price of the host waiting at every ``wait()``
  (FSDP2's and DTensor's too). gloo raises either way;
* a checking mode (``check_collectives=True`` or ``$HETERO_PARALLEL_CHECK_COLLECTIVES=1``): every
  collective the project issues first all-gathers a small signature (name, dtype, shape), and a
  mismatch is a ``parallel.CollectiveError`` naming each rank's call on every rank, before any data
  moves (``foundation.collective_check``); torch's DETAIL debug level also wraps every backend, so
  the collectives torch issues itself (DTensor, pipelining) are fingerprinted too. It costs a small
  extra exchange per collective. Without it the public collectives still check each new signature
  once per group.
"""

from __future__ import annotations

import gc
import logging
import os
import threading
import weakref
from datetime import timedelta

import torch.distributed as dist

from foundation import collective_check, own_groups
from foundation import device as hd
from foundation.compat import (
    default_to_gloo,
    forget_dtensor_caches,
    reduce_dtensor_averages_by_sum,
)
from parallel.dims import ProcessGroups
from parallel.errors import collective_guard

#: Default collective timeout. torch's own default for gloo is 30 minutes; a job whose peer died
#: should fail sooner than that. Override with ``parallel.init(timeout=...)`` or this variable.
TIMEOUT_ENV = "HETERO_PARALLEL_TIMEOUT_S"
DEFAULT_TIMEOUT = timedelta(minutes=10)
#: Set to 1 to check every collective's shapes across the ranks (see ``init``).
CHECK_ENV = collective_check.CHECK_ENV
#: What a failed collective does: "raise" (blocking waits on NCCL/HCCL) or "abort" (their default).
FAILURE_ENV = "HETERO_PARALLEL_ON_COLLECTIVE_FAILURE"
FAILURE_MODES = ("raise", "abort")
_debug_level_before: list[dist.DebugLevel] = []  # restored by destroy()

_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
#: set by torchrun's agent: how many times it has restarted the job's workers
RESTART_ENV = "TORCHELASTIC_RESTART_COUNT"


def _default_timeout() -> timedelta:
    raw = os.environ.get(TIMEOUT_ENV)
    if raw is None:
        return DEFAULT_TIMEOUT
    try:
        seconds = float(raw)
    except ValueError:
        raise ValueError(f"{TIMEOUT_ENV}={raw!r} must be a number of seconds") from None
    if seconds <= 0:
        raise ValueError(f"{TIMEOUT_ENV}={raw!r} must be positive")
    return timedelta(seconds=seconds)


def _as_timedelta(timeout: float | timedelta | None) -> timedelta:
    if timeout is None:
        return _default_timeout()
    if isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        if timeout <= 0:
            raise ValueError(f"timeout must be positive seconds, got {timeout}")
        return timedelta(seconds=timeout)
    if isinstance(timeout, timedelta):
        return timeout
    raise TypeError(f"timeout must be seconds or a timedelta, got {type(timeout).__name__}")


def failure_env(backend: str, on_collective_failure: str | None = None) -> dict[str, str]:
    """The environment :func:`init` sets before creating the process group for ``backend`` (a
    backend string like ``"cpu:gloo,cuda:nccl"``): for "raise", each accelerator backend's
    blocking wait without watchdog tear-down; nothing for "abort" (the default, else
    ``$HETERO_PARALLEL_ON_COLLECTIVE_FAILURE``: asynchronous, overlapping communication). Variables
    the user set win."""
    mode = on_collective_failure or os.environ.get(FAILURE_ENV) or "abort"
    if mode not in FAILURE_MODES:
        source = "on_collective_failure" if on_collective_failure else f"${FAILURE_ENV}"
        raise ValueError(f"{source}={mode!r} must be one of {list(FAILURE_MODES)}")
    if mode == "abort":
        return {}
    env: dict[str, str] = {}
    for item in backend.split(","):
        env.update(hd.raising_failure_env(item.strip().rpartition(":")[2]))
    return {k: v for k, v in env.items() if k not in os.environ}


def launched_by_torchrun() -> bool:
    """True when torchrun (or another env:// launcher) set RANK/WORLD_SIZE/MASTER_* for us."""
    return all(var in os.environ for var in _TORCHRUN_VARS)


def init(backend: str | None = None, *, timeout: float | timedelta | None = None,
         check_collectives: bool | None = None,
         on_collective_failure: str | None = None) -> None:
    """Create the world process group; safe to call again (a no-op once initialised).

    Under torchrun the group rendezvous over env://; in a plain ``python script.py`` it is a
    world-size-1 group over an in-memory store, so collectives work and return their input.
    ``backend`` defaults to :func:`foundation.device.default_backend_string`; one that leaves
    the host unserved (``"nccl"``) gets ``"cpu:gloo"`` added (host-side collectives); ``timeout``
    (seconds or a timedelta, default 10 minutes or ``$HETERO_PARALLEL_TIMEOUT_S``) bounds every
    collective.
    A repeat call asking for what is there (also after ``torch.distributed.init_process_group``)
    is a no-op; asking for another backend is an error. ``check_collectives`` (default
    ``$HETERO_PARALLEL_CHECK_COLLECTIVES``) checks every collective's shapes across the ranks.
    ``on_collective_failure`` ("raise" or "abort", see :func:`failure_env`) chooses what a dead
    peer does on NCCL and HCCL: a ``CollectiveError`` after ``timeout``, or torch's abort.
    """
    # an accelerator's backend alone ("nccl") would leave host tensors without a backend
    asked = backend or hd.default_backend_string()
    backend = hd.with_host_backend(asked)
    failure_env_now = failure_env(backend, on_collective_failure)  # refuses a bad mode first
    reduce_dtensor_averages_by_sum(hd.mesh_lacks_avg)  # HCCL: no ReduceOp.AVG (compat)
    if dist.is_initialized():
        current = dist.get_backend_config()
        if not (_normalise(backend).items() <= _normalise(current).items()
                and _names(backend) <= _names(current)):
            raise ValueError(
                f"parallel.init(backend={asked!r}) called, but the process group is already "
                f"initialised with backend {current!r}; call parallel.destroy() first"
            )
        return
    pg_timeout = _as_timedelta(timeout)
    os.environ.update(failure_env_now)  # the backends read it when the group is created
    if check_collectives is None:
        check_collectives = os.environ.get(CHECK_ENV, "0") not in ("", "0")
    collective_check.set_enabled(check_collectives)
    if check_collectives and dist.get_debug_level() != dist.DebugLevel.DETAIL:
        _debug_level_before.append(dist.get_debug_level())
        dist.set_debug_level(dist.DebugLevel.DETAIL)
    local_rank = hd.local_rank_from_env()
    hd.set_local_device(local_rank)
    if launched_by_torchrun() and RESTART_ENV in os.environ:
        dist.init_process_group(backend, store=_attempt_store(pg_timeout),
                                rank=int(os.environ["RANK"]),
                                world_size=int(os.environ["WORLD_SIZE"]), timeout=pg_timeout)
    elif launched_by_torchrun():
        dist.init_process_group(backend, init_method="env://", timeout=pg_timeout)
    else:
        dist.init_process_group(
            backend, store=dist.HashStore(), rank=0, world_size=1, timeout=pg_timeout
        )
    if dist.group.WORLD is not None and _normalise(backend) == {"cpu": "gloo"}:  # compat
        default_to_gloo(dist.group.WORLD)


def _attempt_store(timeout: timedelta) -> dist.Store:
    """The job's store under torchrun, its keys under this attempt's own prefix.

    Why not ``init_method="env://"``: a job that torchrun's agent restarts (``--max-restarts``)
    finds the agent's store still holding the previous attempt's keys (torch 2.13's
    ``_create_c10d_store`` assumes a new store per attempt, and the agent keeps its one), so
    gloo's full-mesh connect can read a dead rank's address before the new rank writes its
    own: "connectFullMesh failed ... Connection refused", a restart that fails by chance (NCCL
    the same way, pytorch/pytorch#167288). Prefixing every key with the attempt
    (``TORCHELASTIC_RESTART_COUNT``) keeps attempts apart; the groups created later share the
    prefix through the default group's store."""
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    agent_hosts = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)
    store = dist.TCPStore(host, port, world, is_master=not agent_hosts and rank == 0,
                          timeout=timeout, multi_tenant=not agent_hosts)
    return dist.PrefixStore(f"hetero_parallel/attempt_{os.environ[RESTART_ENV]}", store)


def _names(backend: str) -> set[str]:
    """The backend names in a backend string ("cpu:gloo,cuda:nccl" -> {"gloo", "nccl"}): a
    request for a backend that serves no device of this machine ("nccl" on a host without the
    accelerator) is still a request for another backend."""
    return {item.strip().rpartition(":")[2].lower() for item in backend.split(",")}


def _normalise(backend: str) -> dict[str, str]:
    """A backend string as {device type: backend}, so a request can be compared with what is
    there: a bare name ("gloo") stands for the devices of this machine that it serves."""
    here = {"cpu", hd.accelerator_type()}
    found: dict[str, str] = {}
    for item in backend.split(","):
        device, _, name = item.strip().rpartition(":")
        name = name.lower()
        served = dist.Backend.backend_capability.get(name, ["cpu"])
        found.update({d: name for d in ([device] if device else served) if device or d in here})
    return found


log = logging.getLogger(__name__)
#: seconds an accelerator backend's teardown may take before ``destroy`` leaves it behind
TEARDOWN_ENV = "HETERO_PARALLEL_TEARDOWN_S"


def destroy(*, drain: bool = True, teardown_s: float | None = None) -> None:
    """Tear the world group down (no-op when there is none).

    With ``drain`` (the default) every group this rank belongs to is first passed through a
    barrier, in creation order (the same total order on every rank, so it cannot deadlock): a
    collective still in flight (DTensor's row-parallel all-reduce returns before the bytes
    arrive) would otherwise meet a peer that has already closed its connections, and gloo
    aborts the process. A rank leaving on an exception passes ``drain=False``: its peers may
    never reach the barrier.

    The groups are then released, not only unregistered: the project's and DTensor's caches
    forget them and, if one is still alive, a garbage collection frees those that only reference
    cycles reach, so each gloo group's destructor joins its worker threads now, with the
    interpreter whole. A group left alive at
    exit keeps them running into ``Py_FinalizeEx``, and a worker that drops the last reference to
    a finished collective's tensors then needs the GIL: Python ends that thread with
    ``pthread_exit`` inside a ``noexcept`` destructor and the process aborts ("terminate called
    without an active exception", issue 44). Groups the caller still reaches (a model whose
    DTensor meshes hold them) live on: drop the model before calling this to leave no thread.

    An accelerator backend's teardown is bounded (``teardown_s``, default
    ``$HETERO_PARALLEL_TEARDOWN_S`` or 60 s): a communicator stuck after a failed collective can
    block NCCL's destroy for ever, so past the bound it is left to the process's exit, with a
    warning. gloo's teardown does not hang and runs on the caller's thread."""
    if dist.is_initialized():
        if drain:
            _drain_groups()
        groups = [weakref.ref(group) for group in dist.distributed_c10d._world.pg_map]
        _bounded_teardown(teardown_s if teardown_s is not None else _teardown_bound())
        ProcessGroups.forget()
        own_groups.forget()
        forget_dtensor_caches()
        if any(group() is not None for group in groups):  # a full collection costs ~0.3 s
            gc.collect()
    collective_check.set_enabled(None)
    while _debug_level_before:  # leave torch's debug level as init found it
        dist.set_debug_level(_debug_level_before.pop())


def _teardown_bound() -> float | None:
    """Seconds the world's teardown may take; None (unbounded, on this thread) when gloo
    serves every device of it."""
    if _names(dist.get_backend_config()) <= {"gloo"}:
        return None
    return float(os.environ.get(TEARDOWN_ENV, "60"))


def _bounded_teardown(bound: float | None) -> None:
    """``dist.destroy_process_group()``, given at most ``bound`` seconds (on a helper thread)."""
    if bound is None:
        dist.destroy_process_group()
        return
    worker = threading.Thread(target=dist.destroy_process_group, daemon=True,
                              name="parallel.destroy")
    worker.start()
    worker.join(bound)
    if worker.is_alive():
        log.warning("parallel.destroy: the process group did not shut down within %g s (a "
                    "communicator stuck after a failed collective?); it is left to the "
                    "process's exit ($%s sets the bound)", bound, TEARDOWN_ENV)


def _drain_groups() -> None:
    """A barrier on each group of this rank: a gloo barrier waits for the rank's own earlier
    work on that group, and returns only when every member's has been enqueued. On a group
    of ``cpu:gloo,cuda:nccl`` torch runs the barrier on gloo, which does not wait for NCCL
    kernels still in flight: the device is synchronised first, so they are done."""
    if hd.has_accelerator():
        hd.synchronize()
    for group in list(dist.distributed_c10d._world.pg_map):  # insertion = creation order
        if dist.get_world_size(group) > 1:
            dist.barrier(group=group)


def is_initialized() -> bool:
    """Whether :func:`init` has created the world group."""
    return dist.is_available() and dist.is_initialized()


def _require_init(what: str) -> None:
    if not is_initialized():
        raise RuntimeError(
            f"parallel.{what}() needs the process group: call parallel.init() first "
            f"(it works under torchrun and in a plain single process)"
        )


def get_rank(group: dist.ProcessGroup | None = None) -> int:
    """This process's rank in ``group`` (default: the world)."""
    _require_init("get_rank")
    return dist.get_rank(group)


def get_world_size(group: dist.ProcessGroup | None = None) -> int:
    """Number of ranks in ``group`` (default: the world)."""
    _require_init("get_world_size")
    return dist.get_world_size(group)


def get_group_size(group: dist.ProcessGroup | None = None) -> int:
    """MindSpore's name for :func:`get_world_size`."""
    _require_init("get_group_size")
    return dist.get_world_size(group)


def get_local_rank() -> int:
    """This process's rank on its own node (LOCAL_RANK under torchrun, 0 alone)."""
    _require_init("get_local_rank")
    return hd.local_rank_from_env()


def barrier() -> None:
    """Wait until every rank reaches this point."""
    _require_init("barrier")
    with collective_guard("barrier"):
        dist.barrier()
