"""``parallel.auto.profile_devices()``: measure this machine's device and links for the cost model.

Compute, in the dtype a job computes in there (:func:`compute_dtype`: float32 on a host; bf16 on
an accelerator, fp16 where it has no bf16: an H100's fp32 matmul runs at a fifteenth of its bf16
rate, so an fp32 profile would price every Linear 15x too slow): square matmuls (``size`` ×
``size``, :data:`MATMUL_SIZE`) on the device this process drives give the FLOP rate; causal
attention's forward and backward (:data:`ATTENTION_SHAPE`) its own rate; each elementwise and
normalisation operator's forward and backward (:data:`ELEMENTWISE`, on ``elements`` elements)
its seconds per element; and a transformer block too small to
compute much (forward and backward, divided by its ten operators) the seconds an operator costs
beyond its arithmetic (``dispatch``: Python, autograd, views; in a process group run as
replicated DTensors, whose dispatch a planned job pays). These run back to back after one
barrier, each for at least 50 ms, and each figure is the slowest rank's: the sustained rate a
step computes at between two collectives, which wait for the last rank.

Links: with a process group of more than one rank, all-reduces of a small and a large tensor
(``link_bytes``) give the α-β model's latency and bandwidth by the ring formula (the two unknowns
of two measurements), each timed run started on every rank together (a barrier), as a step's
collectives are, so a rank's collective does not also count the time its peers spent on what
came before; and ``collective_call`` is what one collective adds to a step beyond that: a DTensor
redistribution of partial sums after each run of a stretch of compute, against the compute
alone, less its α-β time (DTensor's redistribution and wait, and on a shared host the wait for
the rank descheduled longest). In a single process the link figures of the default profile are
kept. The ranks' figures are averaged, so every rank saves the same profile. The result is saved
as YAML (``path``, by default in ``$HETERO_PARALLEL_CACHE`` or ``~/.cache/hetero-parallel``),
where :func:`saved_profile` finds it.
"""

from __future__ import annotations

import dataclasses
import math
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import foundation.device as hd
from parallel.auto.cost_model import DeviceProfile, default_profile
from parallel.dims import build_mesh


def _profile_path() -> Path:
    root = Path(os.environ.get("HETERO_PARALLEL_CACHE", "~/.cache/hetero-parallel"))
    return root.expanduser() / f"device-profile-{default_profile().kind}.yaml"


def _median_seconds(fn: Callable[[], object], repeats: int, together: bool = False) -> float:
    """Median seconds of ``fn``; ``together``: each run started on every rank together (a
    barrier before it), as in a training step: its collectives start once every rank has
    computed its input."""
    fn()
    times = []
    for _ in range(repeats):
        if together:
            dist.barrier()
        hd.synchronize()
        start = time.perf_counter()
        fn()
        hd.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _sustained_seconds(runs: dict[str, Callable[[], object]], repeats: int, together: bool,
                       window: float = 0.05) -> dict[str, float]:
    """Seconds per call of each of ``runs``, timed one after another with no pause, each over
    at least ``repeats`` calls and ``window`` seconds: the sustained rate a training step
    computes at. (A process that waited, at a barrier, is run first on a shared host, so
    short runs after a barrier read up to 2x faster than a step's compute on a busy one.)
    ``together``: every rank starts at one barrier and runs the same, with every other rank
    beside it (4 ranks on 2 cores: half a core each), and each figure is the slowest rank's,
    as a step's compute between two collectives is (the collective waits for the last)."""
    if together:
        dist.barrier()
    found = []
    for fn in runs.values():
        hd.synchronize()
        start = time.perf_counter()
        fn()
        hd.synchronize()
        count = max(repeats, math.ceil(window / max(time.perf_counter() - start, 1e-9)))
        start = time.perf_counter()
        for _ in range(count):
            fn()
        hd.synchronize()
        found.append((time.perf_counter() - start) / count)
    if together:
        slowest = torch.tensor(found, dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        found = slowest.tolist()
    return dict(zip(runs, found, strict=True))


def _link(small: int, large: int, repeats: int) -> tuple[float, float]:
    """(alpha, bandwidth) of the world group from all-reduces of ``small`` and ``large`` bytes.

    Each is timed from a barrier: unsynchronised, a rank's all-reduce also waited for peers
    still busy with what came before (on 2 ranks sharing 2 busy cores this read α as 1.9 ms,
    where a synchronised 768-byte all-reduce took 0.55 ms in all)."""
    n, device = dist.get_world_size(), hd.resolve("device")
    measured = []
    for size in (small, large):
        tensor = torch.ones(size // 4, device=device)
        measured.append(_median_seconds(lambda t=tensor: dist.all_reduce(t), repeats,
                                        together=True))
    steps = 2 * (n - 1)
    factor = 2 * (n - 1) / n
    per_byte = max((measured[1] - measured[0]) / (factor * (large - small)), 1e-15)
    alpha = max((measured[0] - factor * small * per_byte) / steps, 0.0)
    return alpha, 1.0 / per_byte


#: the elementwise and normalisation operators whose forward and backward the profile times
#: (the ATen names the graph records): name -> the operator on one input tensor
ELEMENTWISE: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu, "relu": F.relu, "silu": F.silu, "tanh": torch.tanh,
    "sigmoid": torch.sigmoid, "add": lambda x: x + x.detach(), "sub": lambda x: x - x.detach(),
    "mul": lambda x: x * x.detach(), "div": lambda x: x / 2.0,
    "layer_norm": lambda x: F.layer_norm(x, x.shape[-1:]),
    "softmax": lambda x: torch.softmax(x, -1),
}
#: (batch, heads, sequence, head size) of the causal attention the profile times: on a host,
#: and on an accelerator (where a small one would time its kernel launches, not its rate)
ATTENTION_SHAPE = (8, 8, 64, 64)
ACCELERATOR_ATTENTION_SHAPE = (8, 16, 1024, 64)
#: elements the elementwise operators are timed at, on a host and on an accelerator
ELEMENTS = {"cpu": 2**18, "accelerator": 2**24}
#: the matmuls' side, on a host and on an accelerator (where 1024 takes a few microseconds:
#: kernel launches, not the rate; 8192 takes about 1.5 ms in bf16 on an H100)
MATMUL_SIZE = {"cpu": 1024, "accelerator": 8192}


def compute_dtype(device: torch.device) -> torch.dtype:
    """The dtype the profile times compute in on ``device``: float32 on a host (what the
    recipes train in there), bf16 on an accelerator (mixed precision's), fp16 on one without
    bf16 (an Ascend 910A)."""
    if device.type == "cpu":
        return torch.float32
    return torch.bfloat16 if hd.supports_bf16() else torch.float16


def _where(device: torch.device) -> str:
    return "cpu" if device.type == "cpu" else "accelerator"


def _forward_backward(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor,
                      grad: torch.Tensor) -> Callable[[], None]:
    def run() -> None:
        fn(x).backward(grad)
        x.grad = None
    return run


def _elementwise(device: torch.device, elements: int, dtype: torch.dtype
                 ) -> dict[str, Callable[[], None]]:
    """Each :data:`ELEMENTWISE` operator's forward and backward on ``elements`` elements."""
    x = torch.randn(elements // 256, 256, device=device, dtype=dtype, requires_grad=True)
    grad = torch.randn(elements // 256, 256, device=device, dtype=dtype)
    return {name: _forward_backward(fn, x, grad) for name, fn in ELEMENTWISE.items()}


def _attention(device: torch.device, dtype: torch.dtype) -> tuple[Callable[[], None], float]:
    """Causal attention's forward and backward, and its FLOPs as the cost model counts them
    (3 x the two products b.h.t.t.d)."""
    b, h, t, d = ATTENTION_SHAPE if device.type == "cpu" else ACCELERATOR_ATTENTION_SHAPE
    q, k, v = (torch.randn(b, h, t, d, device=device, dtype=dtype, requires_grad=True)
               for _ in range(3))

    def run() -> None:
        F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
        q.grad = k.grad = v.grad = None
    return run, 3 * 2 * b * h * t * t * 2 * d


class _TinyBlock(nn.Module):
    """A pre-LN transformer block at sizes whose compute is negligible: what running its ten
    planned operators (two layer norms, four Linears, attention, GELU, two residual adds) costs
    beyond their arithmetic: Python, autograd, views, and a tensor subclass's dispatch."""

    operators = 10

    def __init__(self, width: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, c // self.heads).permute(
            2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


def _dispatch(device: torch.device, together: bool, dtype: torch.dtype) -> Callable[[], None]:
    """A tiny transformer block's forward and backward (what is not arithmetic: divided by its
    operators, the profile's ``dispatch``), as DTensors replicated over the world group when
    there is one (what a planned job runs), else as plain tensors."""
    block = _TinyBlock().to(device, dtype)
    x = torch.randn(2, 4, 16, device=device, dtype=dtype, requires_grad=True)
    if together:
        from torch.distributed.tensor import DTensor, Replicate, distribute_module

        mesh = build_mesh((dist.get_world_size(),), ("world",))
        distribute_module(block, mesh)  # every parameter replicated over the mesh
        x = DTensor.from_local(x.detach(), mesh, [Replicate()]).requires_grad_()

    def run() -> None:
        block(x).sum().backward()
        block.zero_grad(set_to_none=True)
    return run


def _collective_call(device: torch.device, small: int, alpha: float, flops: float,
                     dtype: torch.dtype, segment: float = 0.01, count: int = 15,
                     tries: int = 3) -> float:
    """Seconds one collective adds to a step beyond its α-β time, on the world group: a
    DTensor redistribution of ``small`` bytes of partial sums after each of ``count`` runs of
    ``segment`` seconds of compute (at ``flops``), against the compute alone, less the
    modelled all-reduce (its bytes are few: ``2(n-1)α``). What it measures is what a step's
    collective costs and the α of a synchronised all-reduce leaves out: DTensor's
    redistribution and its wait, and, on a shared host, the wait for the rank descheduled
    longest since the last collective. The median of ``tries``; each figure the slowest
    rank's."""
    from torch.distributed.tensor import DTensor, Partial, Replicate

    n = dist.get_world_size()
    mesh = build_mesh((n,), ("world",))
    partial = DTensor.from_local(torch.ones(small // 4, device=device), mesh, [Partial()])
    side = 256 if device.type == "cpu" else 4096  # a launch-bound matmul has no rate to scale
    a = torch.randn(side, side, device=device, dtype=dtype)  # at the rate ``flops`` was
    chunk = max(1, round(segment * flops / (2 * side**3)))

    def compute() -> None:
        for _ in range(chunk):
            a @ a

    def step() -> None:
        compute()
        partial.redistribute(mesh, [Replicate()]).to_local()
    step()
    found = []
    for _ in range(tries):
        times = []
        for fn in (compute, step):
            dist.barrier()
            start = time.perf_counter()
            for _ in range(count):
                fn()
            hd.synchronize()
            times.append((time.perf_counter() - start) / count)
        slowest = torch.tensor(times, dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        alone, with_collective = slowest.tolist()
        found.append(with_collective - alone - 2 * (n - 1) * alpha)
    return max(statistics.median(found), 0.0)


def profile_devices(path: str | Path | None = None, *, size: int | None = None,
                    repeats: int = 5,
                    link_bytes: tuple[int, int] = (4096, 16 * 2**20),
                    elements: int | None = None,
                    dtype: torch.dtype | None = None) -> DeviceProfile:
    """Measure this machine (see the module docstring), save the profile and return it.
    ``size``: the matmuls' side (default :data:`MATMUL_SIZE`). ``link_bytes``: the small and
    the large all-reduce the link figures come from; give the sizes the planned job's
    collectives have (bandwidth at 16 MB, out of cache, is not that of the sub-megabyte
    messages of a small model's step). ``elements``: the size the elementwise operators are
    timed at (a multiple of 256; default :data:`ELEMENTS`: 2^18 on a host, 2^24 on an
    accelerator, where fewer would time kernel launches). ``dtype``: what compute is timed in
    (default :func:`compute_dtype`: give the job's, an fp32 job on an accelerator too)."""
    device = hd.resolve("device")
    dtype = compute_dtype(device) if dtype is None else dtype
    if not dtype.is_floating_point:
        raise ValueError(f"profile_devices: dtype must be a floating dtype, got {dtype}")
    size = MATMUL_SIZE[_where(device)] if size is None else size
    a = torch.randn(size, size, device=device, dtype=dtype)
    together = dist.is_initialized() and dist.get_world_size() > 1
    runs = 2 * repeats - 1 if together else repeats
    attend, attention_work = _attention(device, dtype)
    if elements is None:
        elements = ELEMENTS[_where(device)]
    named = _elementwise(device, elements, dtype)
    timed = _sustained_seconds({"matmul": lambda: a @ a, "attention": attend,
                                "dispatch": _dispatch(device, together, dtype), **named}, runs,
                               together)
    flops = 2 * size**3 / timed["matmul"]
    attention = attention_work / timed["attention"]
    dispatch = timed["dispatch"] / _TinyBlock.operators
    elementwise = tuple((name, timed[name] / elements) for name in named)
    profile = dataclasses.replace(default_profile(), flops=flops)
    if together:
        alpha, bandwidth = _link(*link_bytes, runs)
        call = _collective_call(device, link_bytes[0], alpha, flops, dtype)
        # one profile for the job: every rank plans from it, and plans must agree
        agreed = torch.tensor([flops, alpha, bandwidth, attention, dispatch, call,
                               *(rate for _, rate in elementwise)], device=device,
                              dtype=torch.float64)
        dist.all_reduce(agreed)
        flops, alpha, bandwidth, attention, dispatch, call, *rates = (
            agreed / dist.get_world_size()).tolist()
        elementwise = tuple((name, rate) for (name, _), rate in zip(elementwise, rates,
                                                                     strict=True))
        profile = dataclasses.replace(profile, flops=flops, alpha=alpha, bandwidth=bandwidth,
                                      collective_call=call)
    profile = dataclasses.replace(profile, elementwise=tuple(sorted(elementwise)),
                                  attention_flops=attention, dispatch=dispatch)
    if device.type != "cpu":
        profile = dataclasses.replace(profile, memory=float(
            torch.accelerator.get_memory_info(device)[1]))
    profile.save(Path(path) if path is not None else _profile_path())
    return profile


def saved_profile() -> DeviceProfile:
    """The profile :func:`profile_devices` saved for this device kind, else the default."""
    return measured_profile() or default_profile()


def measured_profile() -> DeviceProfile | None:
    """The profile :func:`profile_devices` saved for this device kind, or None (not measured
    here: the defaults are guesses, not figures of this machine)."""
    path = _profile_path()
    return DeviceProfile.load(path) if path.exists() else None
