"""The one module that knows concrete device names ("cuda", "npu", "cpu").

Everything else in hetero-parallel speaks in *logical* names — "cpu" for host memory and host
compute, "device" for the accelerator this process drives — and asks this module what they resolve
to, which collective backend serves a device, and how to get streams, events and pinned buffers.

On a machine with no accelerator, "device" resolves to the CPU and every helper here degrades to a
correct host-only behaviour (no pinning, streams that run inline); that is how CI exercises all
code.

Accelerator discovery stands on ``torch.accelerator``. Ascend NPUs appear there once ``torch_npu``
has been imported (it registers the "npu" device and the "hccl" backend), so we import it when it is
installed rather than making users remember to.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import subprocess
import time
import warnings
from contextlib import AbstractContextManager, nullcontext
from functools import lru_cache
from typing import Any, Literal

import torch
import torch.distributed as dist

LogicalName = Literal["cpu", "device"]
DeviceLike = str | torch.device

#: Names ``resolve`` accepts besides a ``torch.device``, in the case users write them.
ACCEPTED_NAMES = ("cpu", "CPU", "device", "DEVICE")

#: Accelerator types we know how to drive, with the plugin package that registers each one.
#: ``None`` means the type is built into torch.
_KNOWN_ACCELERATORS: dict[str, str | None] = {"cuda": None, "npu": "torch_npu"}

#: Set to "none" to keep this process off the accelerator: "device" then resolves to the host and
#: the default backend is gloo alone ("auto", the default: the accelerator present). The multi-rank
#: test helper sets it, so N gloo ranks on a one-GPU machine do not all bind to that GPU.
ACCELERATOR_ENV = "HETERO_PARALLEL_ACCELERATOR"

#: Collective backends that a device plugin registers with torch.distributed only when it is
#: imported. ``Backend.default_device_backend_map`` is the authority; this table answers for a
#: plugin that is not installed here (so configs and tests can reason about an NPU job on a host
#: without torch_npu) and is consulted only when the map has no entry for the device.
_PLUGIN_BACKENDS = {"npu": "hccl"}

#: Collective backends with an all_reduce of sparse COO tensors. NCCL and HCCL have none: sparse
#: gradients on an accelerator are summed by all-gathers of their indices and values instead.
_SPARSE_ALL_REDUCE_BACKENDS = frozenset({"gloo"})

#: Collective backends trusted with ``ReduceOp.AVG`` and ``ReduceOp.PREMUL_SUM`` (FSDP2's mean
#: reductions). HCCL has neither, gloo has no PREMUL_SUM, and an unknown plugin's support cannot
#: be assumed: every other backend reduces with SUM and divides afterwards.
_AVERAGING_BACKENDS = frozenset({"nccl"})
#: Collective backends with ``ReduceOp.AVG`` in all_reduce and reduce_scatter (gloo has it, not
#: PREMUL_SUM); HCCL has neither
_AVG_BACKENDS = frozenset({"nccl", "gloo"})
#: Collective backends whose all-gather and reduce-scatter run slower than one broadcast / one
#: reduce per rank's chunk (gloo's go through flattening copies; the timings are in
#: ``parallel/optimizer_parallel/chunkwise.py``)
_CHUNKWISE_BACKENDS = frozenset({"gloo"})


@lru_cache(maxsize=1)
def _import_plugins() -> tuple[str, ...]:
    """Import installed device plugins (torch_npu) so torch.accelerator can see their devices."""
    loaded = []
    for plugin in {p for p in _KNOWN_ACCELERATORS.values() if p}:
        if importlib.util.find_spec(plugin) is not None:
            importlib.import_module(plugin)
            loaded.append(plugin)
    return tuple(loaded)


def _discovered_type() -> str | None:
    """The accelerator type torch sees (plugins imported), before :data:`ACCELERATOR_ENV`."""
    _import_plugins()
    if not torch.accelerator.is_available():
        return None
    acc = torch.accelerator.current_accelerator()
    return acc.type if acc is not None else None


def accelerator_hidden() -> bool:
    """Whether :data:`ACCELERATOR_ENV` keeps this process off the accelerator ("none")."""
    raw = os.environ.get(ACCELERATOR_ENV, "auto")
    if raw.lower() not in ("auto", "none", ""):
        raise ValueError(f"{ACCELERATOR_ENV}={raw!r}: accepted values are 'auto' (use the "
                         f"accelerator present) and 'none' (run on the host alone)")
    return raw.lower() == "none"


def accelerator_type() -> str | None:
    """The accelerator type present ("cuda", "npu", ...), or None on a host-only machine (or
    where ``$HETERO_PARALLEL_ACCELERATOR=none`` keeps this process on the host)."""
    return None if accelerator_hidden() else _discovered_type()


def has_accelerator() -> bool:
    """True when an accelerator (GPU, NPU, ...) is present and usable."""
    return accelerator_type() is not None


#: device types whose torch optimizers the recipes run fused unless told otherwise: one kernel
#: per step, and a skipped step decided on the device (``recipes/finite_guard.py``). torch's
#: fused Adam/AdamW/SGD kernels exist for CUDA; torch_npu's coverage of them is unproven here.
_FUSED_OPTIMIZER_TYPES = frozenset({"cuda"})


def fuses_optimizers(device: torch.device) -> bool:
    """Whether torch optimizers over weights on ``device`` run fused by default."""
    return device.type in _FUSED_OPTIMIZER_TYPES


def device_model() -> str | None:
    """The accelerator's model name as its runtime reports it ("NVIDIA H100 80GB HBM3",
    "Ascend910B3"), or None on a host-only machine: ``torch.<type>.get_device_name``, which
    CUDA and ``torch_npu`` both give."""
    kind = accelerator_type()
    runtime = getattr(torch, kind, None) if kind is not None else None
    if runtime is None or not hasattr(runtime, "get_device_name"):
        return None
    return str(runtime.get_device_name(torch.accelerator.current_device_index()))


def supports_bf16() -> bool:
    """Whether this process's device computes in bfloat16: the host does; an accelerator as its
    runtime says (``torch.<type>.is_bf16_supported``: CUDA says yes from Ampere on and, emulated,
    before; the Ascend 910A says no); a runtime without the query is taken to have it."""
    kind = accelerator_type()
    runtime = getattr(torch, kind, None) if kind is not None else None
    query = getattr(runtime, "is_bf16_supported", None)
    return True if query is None else bool(query())


#: Accelerator types torch.compile's default backend (Inductor) generates kernels for
_INDUCTOR_DEVICES = frozenset({"cuda", "xpu"})


def inductor_compiles() -> bool:
    """Whether ``torch.compile``'s default backend (Inductor) generates kernels for this
    process's device: the host and CUDA GPUs; not an Ascend NPU (its graphs go through
    ``torch_npu``'s own backend, which this project has not tried)."""
    kind = accelerator_type()
    return kind is None or kind in _INDUCTOR_DEVICES


def device_count() -> int:
    """Accelerators visible to this process (0 on a host-only machine)."""
    return torch.accelerator.device_count() if has_accelerator() else 0


def machine_memory_bytes() -> int:
    """The memory this machine has for one job: host RAM plus, when an accelerator is visible,
    the memory of the one this process drives (a bound no setting can exceed, whatever it
    offloads).

    Read from the device's properties, before the process has bound its device (the recipes
    check sizes before the process group): a memory query would make a context on it, and on
    device 0 every rank of a node would leave one there (hundreds of MiB each; under
    exclusive compute mode the other ranks could not start)."""
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if not has_accelerator():
        return host
    index = local_device_index(local_rank_from_env(), device_count())
    runtime = getattr(torch, accelerator_type() or "", None)
    properties = getattr(runtime, "get_device_properties", None)
    if properties is not None:
        return host + int(properties(index).total_memory)
    return host + torch.accelerator.get_memory_info(index)[1]


#: PCIe's usable bytes per second and lane, each direction, by generation (after its line
#: coding: 8b/10b for 1-2, 128b/130b for 3-5)
_PCIE_LANE_BYTES = {1: 0.25e9, 2: 0.5e9, 3: 0.985e9, 4: 1.969e9, 5: 3.938e9}


def host_link_bytes_per_s() -> float | None:
    """Bytes per second, each direction, that the link between this process's accelerator and
    host memory can carry: on an NVIDIA GPU the PCIe generation and width its driver reports
    (``nvidia-smi``); None where that is unknown (another accelerator, no tool)."""
    if accelerator_type() != "cuda":
        return None
    index = torch.accelerator.current_device_index()
    try:
        done = subprocess.run(["nvidia-smi", f"--id={index}", "--format=csv,noheader,nounits",
                               "--query-gpu=pcie.link.gen.max,pcie.link.width.max"],
                              capture_output=True, text=True, timeout=30, check=True)
        generation, width = (int(v) for v in done.stdout.strip().splitlines()[0].split(","))
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None
    lane = _PCIE_LANE_BYTES.get(generation)
    return None if lane is None else lane * width


def build_facts() -> str:
    """What this torch build drives: its version and the accelerator runtimes compiled in."""
    runtimes = [f"{name} {version}" for name, version in (
        ("cuda", torch.version.cuda), ("hip", getattr(torch.version, "hip", None)))
        if version]
    try:
        import torch_npu  # noqa: F401  (the Ascend plugin, when installed)

        runtimes.append(f"torch_npu {torch_npu.__version__}")
    except ImportError:
        pass
    return f"torch {torch.__version__} ({', '.join(runtimes) or 'cpu only'})"


def current_device_index() -> int | None:
    """The accelerator index this thread issues work to (None without an accelerator). It is
    per thread: a new thread starts on device 0 whatever the process was bound to."""
    return torch.accelerator.current_device_index() if has_accelerator() else None


def device_index_scope(index: int | None) -> AbstractContextManager[Any]:
    """A context in which this thread issues work to accelerator ``index`` (restored after;
    nothing to do for None, the host)."""
    return nullcontext() if index is None else torch.accelerator.device_index(index)


def stream_scope(stream: torch.Stream | None) -> AbstractContextManager[Any]:
    """A context in which ``stream`` is this thread's current stream on its device (restored
    after); host streams and None change nothing."""
    return nullcontext() if stream is None or stream.device.type == "cpu" else stream


def autocast_device_types() -> tuple[str, ...]:
    """The device types whose autocast state a thread has: the host's and the accelerator's."""
    acc = accelerator_type()
    return ("cpu",) if acc is None else ("cpu", acc)


def accelerator() -> torch.device:
    """The accelerator this thread drives (with its index), or the CPU when there is none."""
    acc = accelerator_type()
    if acc is None:
        return torch.device("cpu")
    return torch.device(acc, torch.accelerator.current_device_index())


#: per accelerator type, the environment its deterministic kernels need before the first one
#: runs: cuBLAS keeps a fixed workspace per stream (NVIDIA's cuBLAS docs, "Results
#: reproducibility"; torch raises without it once deterministic algorithms are asked for)
_DETERMINISTIC_ENV = {"cuda": {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}}


def use_deterministic_algorithms() -> None:
    """Ask for kernels that give the same bits every run (``torch.use_deterministic_algorithms``;
    an operator without one raises, naming itself), with the environment this process's
    accelerator needs for them, unless the user set it. Call before the first device kernel."""
    for name, value in _DETERMINISTIC_ENV.get(accelerator_type() or "", {}).items():
        os.environ.setdefault(name, value)
    torch.use_deterministic_algorithms(True)


def local_device_index(local_rank: int, count: int) -> int:
    """The visible accelerator index a process with ``local_rank`` drives, of ``count`` visible.

    * ``local_rank < count``: that device (torchrun on a node whose devices all are visible);
    * exactly one visible: that one, whatever the rank (SLURM, Kubernetes and per-rank
      ``CUDA_VISIBLE_DEVICES``/``ASCEND_RT_VISIBLE_DEVICES`` launchers give each process its own);
    * otherwise ``local_rank % count``, with a warning: several processes share a device, which
      works for gloo but NCCL and HCCL refuse two ranks of one group on one device.
    """
    if local_rank < 0:
        raise ValueError(f"LOCAL_RANK={local_rank} must be >= 0")
    if count < 1:
        raise ValueError(f"no visible accelerator to bind LOCAL_RANK={local_rank} to")
    if local_rank < count:
        return local_rank
    if count == 1:
        return 0
    index = local_rank % count
    warnings.warn(
        f"LOCAL_RANK={local_rank} but only {count} accelerators are visible: using device "
        f"{index} (local_rank % {count}); ranks sharing a device cannot use NCCL/HCCL together. "
        f"Launch at most {count} processes per node or give each process its own visible device",
        RuntimeWarning, stacklevel=3)
    return index


def set_local_device(local_rank: int) -> torch.device:
    """Bind this process to its accelerator (see :func:`local_device_index`; no-op without an
    accelerator, or where ``$HETERO_PARALLEL_ACCELERATOR=none``); return it."""
    if has_accelerator():
        torch.accelerator.set_device_index(local_device_index(local_rank, device_count()))
    return accelerator()


def _unknown(name: object) -> ValueError:
    return ValueError(
        f"unknown device {name!r}: accepted names are {', '.join(map(repr, ACCEPTED_NAMES))}, "
        f"a concrete accelerator such as 'cuda:0' or 'npu:0' when one is present, "
        f"or a torch.device"
    )


def resolve(device: DeviceLike) -> torch.device:
    """Resolve a logical or concrete device name to the ``torch.device`` it means here.

    "cpu"/"CPU" is the host; "device"/"DEVICE" is this process's accelerator (the CPU when there is
    none). A concrete accelerator string ("cuda:1") or ``torch.device`` is accepted when that
    accelerator is present. Anything else raises ``ValueError`` listing the accepted names.
    """
    if isinstance(device, torch.device):
        name = str(device)
    elif isinstance(device, str):
        name = device
    else:
        raise TypeError(f"device must be a str or torch.device, got {type(device).__name__}")
    lowered = name.lower()
    if lowered == "cpu":
        return torch.device("cpu")
    if lowered == "device":
        return accelerator()
    device_type, _, index = name.partition(":")
    if device_type == "cpu":  # "cpu:0", torch.device("cpu", 0): the host has one memory
        return torch.device("cpu")
    if name != lowered or device_type not in _KNOWN_ACCELERATORS:  # "CUDA", "gpu0", "TPU"
        raise _unknown(device)
    if device_type != accelerator_type():
        raise ValueError(
            f"device {name!r} is not available on this machine "
            f"(accelerator present: {accelerator_type() or 'none'}); use 'device' to mean "
            f"whichever accelerator is present, or 'cpu'"
        )
    if not index:
        return torch.device(device_type, torch.accelerator.current_device_index())
    try:
        return torch.device(name)
    except RuntimeError:
        raise _unknown(device) from None


def logical_name(device: DeviceLike) -> LogicalName:
    """"cpu" for host devices, "device" for the accelerator — the names plans and configs use."""
    if isinstance(device, str) and device.lower() in ("cpu", "device"):
        return device.lower()  # type: ignore[return-value]
    return "cpu" if resolve(device).type == "cpu" else "device"


def backend_for(device: DeviceLike) -> str:
    """The collective backend serving ``device``: cuda→nccl, npu→hccl, cpu→gloo.

    Answers from ``torch.distributed.Backend.default_device_backend_map``, which torch and device
    plugins fill in. Device-type strings are taken as they are, without checking that the device is
    present, so a launcher can plan for hardware it does not run on.
    """
    if isinstance(device, str) and device.lower() in ("cpu", "device"):
        device_type = resolve(device).type
    elif isinstance(device, torch.device):
        device_type = device.type
    else:  # parse by hand: torch.device("npu") fails until torch_npu registers the type
        device_type = device.split(":", 1)[0]
    _import_plugins()
    backend = dist.Backend.default_device_backend_map.get(device_type)
    backend = backend or _PLUGIN_BACKENDS.get(device_type)
    if backend is None:
        raise ValueError(
            f"no collective backend is registered for device type {device_type!r}; known: "
            f"{sorted(set(dist.Backend.default_device_backend_map) | set(_PLUGIN_BACKENDS))}"
        )
    return backend


def _config_parts(group: dist.ProcessGroup | None) -> list[tuple[str | None, str]]:
    """``group``'s backend config ("cpu:gloo,cuda:nccl") as (device type, backend) pairs, the
    device type None for a name given alone (it serves every device)."""
    parts: list[tuple[str | None, str]] = []
    for part in dist.get_backend_config(group).split(","):
        device_type, sep, backend = part.strip().partition(":")
        parts.append((device_type, backend) if sep else (None, device_type))
    return parts


def group_backend(group: dist.ProcessGroup | None, device: torch.device) -> str:
    """The backend ``group`` (None: the world) uses for tensors on ``device``, read from its
    backend config ("cpu:gloo,cuda:nccl"; one name alone serves every device). When the config
    names no backend for the device type, the default for it (:func:`backend_for`)."""
    for device_type, backend in _config_parts(group):
        if device_type in (None, device.type):
            return backend
    return backend_for(device)


def has_host_backend(group: dist.ProcessGroup | None) -> bool:
    """Whether ``group`` (None: the world) has a backend for host tensors ("cpu:gloo" beside
    "cuda:nccl", or gloo alone): small exchanges of host-known values (counts, signatures) then
    travel there, and reading their result drains no device stream."""
    return any(device_type == "cpu" or (device_type is None and backend.lower() == "gloo")
               for device_type, backend in _config_parts(group))


def supports_sparse_all_reduce(backend: str) -> bool:
    """Whether collective ``backend`` all-reduces sparse COO tensors (gloo does; NCCL and HCCL
    do not)."""
    return backend.lower() in _SPARSE_ALL_REDUCE_BACKENDS


def supports_average_reductions(backend: str) -> bool:
    """Whether collective ``backend`` reduces with ``ReduceOp.AVG`` and ``ReduceOp.PREMUL_SUM``
    (NCCL does; HCCL has neither and gloo no PREMUL_SUM: use SUM and a divide factor there)."""
    return backend.lower() in _AVERAGING_BACKENDS


def supports_avg(backend: str) -> bool:
    """Whether collective ``backend`` reduces with ``ReduceOp.AVG`` (NCCL and gloo; not HCCL:
    DTensor's averages are reduced there as a sum and a divide, ``parallel.init``)."""
    return backend.lower() in _AVG_BACKENDS


def mesh_lacks_avg(mesh: Any, mesh_dim: int) -> bool:
    """Whether ``mesh``'s groups along ``mesh_dim`` use a backend without ``ReduceOp.AVG``."""
    return not supports_avg(group_backend(mesh.get_group(mesh_dim),
                                          torch.device(mesh.device_type)))


#: Device types with sparse COO tensors (torch_npu has no sparse kernels)
_SPARSE_DEVICE_TYPES = frozenset({"cpu", "cuda"})


def has_sparse_tensors(device: DeviceLike) -> bool:
    """Whether sparse COO tensors (a lookup table's row-sparse gradient) can live on
    ``device``: the host and CUDA GPUs; not an Ascend NPU, where a table's gradient is dense."""
    return resolve(device).type in _SPARSE_DEVICE_TYPES


#: Per device type, torch's fused attention kernel that gives a block's log-sum-exp (what ring
#: attention merges block by block) and the dtypes it takes: the host's flash kernel
#: (``_scaled_dot_product_flash_attention_for_cpu``), CUDA's FlashAttention-2
#: (``_scaled_dot_product_flash_attention``: 16-bit only; fp32 on a GPU has no flash kernel).
#: torch_npu's ``npu_fusion_attention`` returns the softmax's max and sum, not a log-sum-exp: an
#: NPU runs ring attention's plain-operation kernel.
_ATTENTION_BLOCK_KERNELS: dict[str, tuple[str, frozenset[torch.dtype]]] = {
    "cpu": ("host_flash", frozenset({torch.float32, torch.bfloat16, torch.float16})),
    "cuda": ("flash", frozenset({torch.bfloat16, torch.float16})),
}
#: Largest head dimension CUDA's flash kernel takes
FLASH_MAX_HEAD_DIM = 256


def attention_block_kernel(device: torch.device, dtype: torch.dtype, head_dim: int
                           ) -> str | None:
    """The fused attention kernel with a log-sum-exp for ``dtype`` tensors on ``device`` with
    heads of ``head_dim`` (``"host_flash"`` or ``"flash"``: ``foundation.compat`` calls it), or
    None where there is none."""
    kernel, dtypes = _ATTENTION_BLOCK_KERNELS.get(device.type, (None, frozenset()))
    if dtype not in dtypes or (kernel == "flash" and head_dim > FLASH_MAX_HEAD_DIM):
        return None
    return kernel


def gathers_chunkwise(backend: str) -> bool:
    """Whether collective ``backend`` all-gathers faster as one broadcast per rank's chunk, and
    reduce-scatters as one reduce per rank's chunk (gloo), than with its own collectives."""
    return backend.lower() in _CHUNKWISE_BACKENDS


#: Largest block the host allocator hands out again from memory it keeps: glibc's malloc (torch's
#: CPU allocator) serves larger requests, above its mmap threshold (at most 32 MiB on 64-bit),
#: with fresh pages from the kernel every time, each faulted in and zeroed on first touch.
#: Measured on this project's host: GELU of a 35 MB tensor 23.9 ms into a fresh output against
#: 7.0 ms into a reused one; of 17.6 MB 3.1 ms against 2.8. Accelerators' caching allocators
#: reuse their blocks at any size.
HOST_REUSED_BLOCK_BYTES = 16 * 2**20


def rows_per_block(row_bytes: int, device: DeviceLike) -> int | None:
    """How many rows of ``row_bytes`` an intermediate tensor on ``device`` may hold and still
    come from reused memory (at least 1); None where any size does (an accelerator)."""
    if resolve(device).type != "cpu":
        return None
    return max(1, HOST_REUSED_BLOCK_BYTES // max(row_bytes, 1))


#: Per collective backend, the environment its process group reads at creation that makes a
#: failed or timed-out collective raise on the calling thread: ``wait()`` blocks the host until
#: the collective is done or the process group's timeout passes, then raises, and the watchdog
#: does not tear the process down. Without it NCCL's watchdog (TORCH_NCCL_ASYNC_ERROR_HANDLING=3,
#: torch's default) and HCCL's end the process with an abort after the timeout. gloo raises on
#: the calling thread already.
_RAISING_FAILURE_ENV: dict[str, dict[str, str]] = {
    "nccl": {"TORCH_NCCL_BLOCKING_WAIT": "1", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"},
    "hccl": {"HCCL_BLOCKING_WAIT": "1", "HCCL_ASYNC_ERROR_HANDLING": "0"},
}


def raising_failure_env(backend: str) -> dict[str, str]:
    """Environment variables that make collective ``backend`` raise a failed or timed-out
    collective on the calling thread instead of aborting the process (empty: it already does,
    as gloo, or it is unknown here)."""
    return dict(_RAISING_FAILURE_ENV.get(backend.lower(), {}))


def with_host_backend(backend: str) -> str:
    """``backend`` serving the host too: a string that leaves the CPU unserved (``"nccl"``,
    ``"cuda:nccl"``, ``"hccl"``) gets the host's backend added (``"cpu:gloo,cuda:nccl"``), since
    host-resident tensors (the reducer's host buckets, offloaded gradients, host embeddings)
    are reduced in the same job; a bare name is spelled out for the devices it serves. A
    string that serves the host already comes back as it is."""
    _import_plugins()  # torch_npu registers hccl's device
    parts = [part.strip() for part in backend.split(",") if part.strip()]
    served: set[str] = set()
    for part in parts:
        device, _, name = part.rpartition(":")
        served |= {device} if device else set(
            dist.Backend.backend_capability.get(name.lower(), ["cpu"]))
    if "cpu" in served:
        return backend
    spelled = [part if ":" in part else ",".join(
        f"{device}:{part}" for device in dist.Backend.backend_capability[part.lower()])
        for part in parts]
    return ",".join([f"cpu:{backend_for('cpu')}", *spelled])


def default_backend_string() -> str:
    """Backend string for ``init_process_group`` covering every device in use here.

    Always includes the host ("cpu:gloo") so host-resident tensors (CPU-placed layers, host
    embeddings, offloaded optimizer state) can be reduced in the same job as device tensors, e.g.
    ``"cpu:gloo,cuda:nccl"``.
    """
    parts = [f"cpu:{backend_for('cpu')}"]
    acc = accelerator_type()
    if acc is not None:
        parts.append(f"{acc}:{backend_for(acc)}")
    return ",".join(parts)


def local_rank_from_env() -> int:
    """LOCAL_RANK as torchrun sets it (0 in a plain single process)."""
    return int(os.environ.get("LOCAL_RANK", "0"))


# --------------------------------------------------------------------------------------------
# Host buffers, streams, events
# --------------------------------------------------------------------------------------------


def can_pin() -> bool:
    """Pinned (page-locked) host memory needs an accelerator runtime to allocate it."""
    return has_accelerator()


def pinned_empty(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """A host buffer for fast, asynchronous transfers: pinned when an accelerator is present."""
    return torch.empty(shape, dtype=dtype, device="cpu", pin_memory=can_pin())


def pin(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` in pinned host memory (a copy if needed); unchanged when pinning is impossible."""
    if tensor.device.type != "cpu":
        raise ValueError(f"only host tensors can be pinned, got one on {tensor.device}")
    if not can_pin() or tensor.is_pinned():
        return tensor
    return tensor.pin_memory()


def to_host_async(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Event | HostEvent]:
    """Start copying accelerator ``tensor`` into a pinned host buffer without blocking the host;
    returns the buffer and an event recorded after the copy: ``event.synchronize()`` before
    reading the buffer waits for just the work queued before the copy, so the host can do
    other work meanwhile. A host tensor comes back as it is, with a finished event."""
    done: torch.Event | HostEvent
    if tensor.device.type == "cpu":
        done = HostEvent()
        done.record()
        return tensor, done
    buffer = pinned_empty(tensor.shape, tensor.dtype)
    buffer.copy_(tensor, non_blocking=True)
    done = new_event(tensor.device)
    done.record()
    return buffer, done


def copy_to(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor`` on ``device`` (itself when already there). Host to accelerator goes through
    pinned memory without blocking the host (later work on the stream is ordered after it).
    Accelerator to host lands in pinned memory (a direct DMA, not a staged pageable copy) and
    waits for that copy's event, since the host reads the value right away and a copy not
    waited for would hand it memory the DMA has not filled yet (:func:`to_host_async` is the
    form for a value needed later)."""
    if tensor.device == device:
        return tensor
    if device.type != "cpu" and tensor.device.type == "cpu":
        return pin(tensor).to(device, non_blocking=True)
    if (device.type == "cpu" and tensor.device.type not in ("cpu", "meta")
            and tensor.layout == torch.strided):  # sparse tensors: torch's own copy
        host, done = to_host_async(tensor)
        done.synchronize()
        return host
    return tensor.to(device)


def new_stream(device: DeviceLike = "device") -> torch.Stream:
    """A fresh stream on ``device`` (a host stream runs work inline, in program order)."""
    dev = resolve(device)
    if dev.type == "cpu":
        return torch.Stream(device="cpu")
    return torch.Stream(device=dev)


def current_stream(device: DeviceLike = "device") -> torch.Stream:
    """The stream work is issued to now on ``device``."""
    dev = resolve(device)
    if dev.type == "cpu":
        return torch.Stream(device="cpu")
    return torch.accelerator.current_stream(dev)


class HostEvent:
    """Event for host "streams", where work runs inline in program order.

    torch's CPU backend has no events ("cpu backend doesn't support events"), yet code that orders
    copies with events must run unchanged on a host-only machine. Host work is finished by the time
    ``record`` returns, so every query is already satisfied, and the time between two records is
    the host's wall time between them (what a device event pair measures on its stream).
    """

    def __init__(self) -> None:
        self._at: float | None = None

    def record(self, stream: torch.Stream | None = None) -> None:
        """Mark this point in host program order (already reached)."""
        self._at = time.perf_counter()

    def elapsed_time(self, end: HostEvent) -> float:
        """Milliseconds from this event's record to ``end``'s."""
        if self._at is None or end._at is None:
            raise RuntimeError("both events must be recorded before elapsed_time")
        return (end._at - self._at) * 1e3

    def wait(self, stream: torch.Stream | None = None) -> None:
        """Make ``stream`` wait for this event (nothing to wait for on the host)."""

    def query(self) -> bool:
        """Whether the work before ``record`` is done: always, on the host."""
        return True

    def synchronize(self) -> None:
        """Block until the work before ``record`` is done (it already is)."""


def new_event(device: DeviceLike = "device") -> torch.Event | HostEvent:
    """An event to order work across streams on ``device`` (or to wait for it from the host)."""
    dev = resolve(device)
    return HostEvent() if dev.type == "cpu" else torch.Event(device=dev)


def timing_event(device: DeviceLike = "device") -> torch.Event | HostEvent:
    """An event whose ``elapsed_time`` to another measures ``device``'s time between them: on an
    accelerator, the stream's own clock (work queued, not the host's wait for it); on the host,
    wall time. Call :func:`synchronize` (or ``end.synchronize()``) before reading it."""
    dev = resolve(device)
    return HostEvent() if dev.type == "cpu" else torch.Event(device=dev, enable_timing=True)


def wait_stream(waiter: torch.Stream, producer: torch.Stream) -> None:
    """Make ``waiter`` wait for everything queued on ``producer`` so far (inline on the host)."""
    if waiter.device.type != "cpu":
        waiter.wait_stream(producer)


def synchronize(device: DeviceLike | None = None) -> None:
    """Wait for all work queued on ``device`` (default: this process's accelerator)."""
    dev = resolve(device if device is not None else "device")
    if dev.type != "cpu":
        torch.accelerator.synchronize(dev)
