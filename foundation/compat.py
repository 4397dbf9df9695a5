"""The torch internals hetero-parallel relies on, gathered in one place and version-checked.

``setup.cfg`` pins the torch range this project is tested on (:data:`TESTED_TORCH`). Importing
this module below :data:`MIN_TORCH` raises an ImportError that says so; above the tested range it
warns once, because the private APIs below are the first things a torch upgrade breaks (and then
only this file needs changing).

What is wrapped here, and why no public API serves (torch 2.13):

* :func:`queue_backward_callback` — ``Variable._execution_engine.queue_callback``: run a function
  when the current backward pass ends (gradient reducer, offloaded-gradient buckets); torch's
  DDP and FSDP use the same hook.
* :data:`fcol` — ``torch.distributed._functional_collectives``: the differentiable collectives
  (the public ``torch.distributed.nn.functional`` is deprecated in their favour).
* :func:`in_backward` — ``torch._C._current_graph_task_id``: whether the caller runs inside a
  backward pass, where activation recompute runs a module's forward again (what it computes
  there for its own sake, an MoE layer's balancing loss, is part of no loss; torch's checkpoint
  knows it is recomputing but tells no one).
* :func:`tensor_version` — ``Tensor._version``: tells whether a parameter was written in place
  since the optimizer last wrote it, and caches gradient norms until a gradient changes.
* :func:`sparse_coo_parts` — ``Tensor._indices()``/``_values()``: the public ``indices()`` refuses
  an uncoalesced tensor, and coalescing one that already is sorted costs a sort per step.
* :func:`cpp_compiler_missing`, :func:`single_compile_thread` — Inductor's ``cpp_builder`` and
  ``config``, to check for a C++ compiler before compiling the fused host Adam kernel.
* :func:`reparametrize_module`, :data:`pytree`, :data:`fx_pytree` —
  ``nn.utils.stateless._reparametrize_module`` (a context manager, unlike the public
  ``torch.func.functional_call``, so ``torch.export`` can trace the module with swapped
  tensors), ``torch.utils._pytree`` and ``torch.fx._pytree`` (no public pytree module yet).
* :func:`fake_tensor_mode` — ``torch._subclasses.FakeTensorMode``: tensors with shape, dtype and
  device but no storage, so placement captures a model of any size on the device type it will
  run on (``torch.export`` reuses the mode of the fake inputs it is given).
* :func:`recast_dtensor_` — a ``DTensor`` parameter's ``_local_tensor``/``_spec``: an offloading
  optimizer holds a semi-auto parameter in 16 bits without replacing the object. ``.data =``
  changes the tensor's dtype but not the shard and spec DTensor keeps as Python attributes, and
  ``torch.utils.swap_tensors`` (what ``Module.to`` uses for DTensors) drops the gradient hooks
  registered on the parameter (semi-auto's reduction).
* :func:`unscale_and_check_` — ``torch._amp_foreach_non_finite_check_and_unscale_``, the fused
  unscale-and-check ``GradScaler`` runs, applied by ``parallel.grad_scaler`` to DTensor
  gradients' local shards (``GradScaler`` hands the op a mix of DTensor and plain tensors,
  which it refuses).
* :func:`dtensor_slice` — ``torch.distributed.tensor._utils.compute_local_shape_and_global_offset``:
  which block of the global tensor a rank's DTensor shard holds (every placement, FSDP2's
  strided shards included), so deferred initialization copies just that block from a value
  generated whole; DTensor has no public offset query.

* :func:`fx_generated_sources`, :func:`forget_fx_sources` — ``torch.fx.graph_module._loader``:
  every ``GraphModule.recompile`` stores its generated source in ``_loader.eval_cache`` and a
  ``linecache`` entry under a new ``<eval_with_key>.N`` name, and nothing ever removes them (~30 KB
  per placement capture). The capture cache forgets the sources of the graphs it drops.
* :func:`fake_dispatch_keys`, :func:`forget_fake_dispatch` — ``FakeTensorMode.cache``, the
  class-level, unbounded cache of fake-op results: its keys hold each op's constant arguments, so
  a capture per new float value adds entries forever. A capture forgets those it added.
* :func:`default_to_gloo` — ``ProcessGroup._set_default_backend``: torch (2.13) leaves the
  default backend of a group made from a device-qualified string (``"cpu:gloo"``) unset once any
  backend plugin is registered (importing FSDP registers its fake one), and every
  ``destroy_process_group`` then printed "No backend of type 0 found" on every rank. This sets
  what ``init_process_group`` sets for a bare ``"gloo"``.
* :func:`reduce_dtensor_averages_by_sum` — ``Partial._reduce_value`` and
  ``Partial._reduce_shard_value``: a DTensor pending an average (a ``mean`` over a sharded
  dimension gives ``Partial("avg")``) is reduced with ``ReduceOp.AVG``, which HCCL lacks; on a
  group whose backend lacks it the reduction runs as a sum and a divide (issue 39). DTensor has
  no hook for a backend's reduce ops.
* :func:`forget_dtensor_caches` — ``torch.distributed.tensor.debug._clear_sharding_prop_cache``,
  the ``lru_cache`` of ``_redistribute._gen_transform_infos`` and of
  ``_collective_utils.MeshTopoInfo.build_from_mesh``, the redistribution planner cache: DTensor
  keeps every op schema, redistribution and mesh it saw, and through them the device meshes and
  their process groups, for the life of the process; ``parallel.destroy`` empties them so the
  groups it destroyed are freed (their worker threads joined) before interpreter exit.
* :func:`fused_attention_block`, :func:`fused_attention_block_backward` — the fused attention
  kernels with their log-sum-exp, and their backward given the merged output and log-sum-exp,
  which ring attention needs block by block (the public ``F.scaled_dot_product_attention``
  returns neither): ``aten._scaled_dot_product_flash_attention_for_cpu`` on the host,
  ``aten._scaled_dot_product_flash_attention`` (FlashAttention-2) on CUDA in 16 bits; which one
  a device gets is ``foundation.device.attention_block_kernel``'s. torch_npu's fused kernel
  gives no log-sum-exp: an NPU runs the plain-operation block kernel of
  ``parallel.context_parallel.blocks``.

Public replacements used instead of private ones elsewhere: ``torch.optim.adam.adam(fused=True,
decoupled_weight_decay=...)`` (:func:`fused_adam_`) for ``torch._fused_adamw_``, ``setattr`` on a
module for writes into ``_parameters``/``_buffers``, ``Tensor.nbytes``, ``torch.func``.
"""

from __future__ import annotations

import contextlib
import linecache
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed._functional_collectives as fcol
import torch.fx._pytree as fx_pytree
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensorMode, is_fake
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.nn.utils.stateless import _reparametrize_module
from torch.optim.adam import adam as _functional_adam

#: Oldest torch this project imports on: 2.11, the CUDA build the lent GPU machines carry (their
#: torch cannot be replaced), through the shims below (the 2.13 collectives' names, FSDP2's
#: SPMD mode refused by name). The whole suite runs there with known failures (see
#: :data:`BELOW_TESTED`), so importing it warns.
MIN_TORCH = (2, 11)
#: The torch releases the whole suite has passed on (keep in step with setup.cfg).
TESTED_TORCH = ((2, 13),)
#: What is known of a release below the tested ones.
BELOW_TESTED = {(2, 11): "the whole suite was run on it (docs/accelerators.md): what fails there "
                         "is activations split on both the batch and the sequence over a 2-D "
                         "mesh (DTensor 2.11 cannot fold them for a Linear), Mixtral under "
                         "semi-auto, and the zbv schedule over gloo and semi-auto x optimizer "
                         "parallel, both refused by name"}

__all__ = ["BELOW_TESTED", "MIN_TORCH", "TESTED_TORCH", "all_gather_autograd",
           "all_gather_single", "attention_block_kernel", "check_stages_on_one_rank",
           "cpp_compiler_missing", "dtensor_folds_sharded_dims", "dtensor_slice",
           "fake_dispatch_keys", "fake_tensor_mode", "fcol", "foreach_mul_",
           "forget_dtensor_caches", "forget_fake_dispatch", "forget_fx_sources", "fsdp_mesh_dims",
           "fused_adam_", "fused_attention_block", "fused_attention_block_backward",
           "fx_generated_sources", "fx_pytree", "graph_module_sources",
           "has_fused_attention_block", "in_backward", "is_fake", "pytree",
           "queue_backward_callback", "recast_dtensor_", "reduce_dtensor_averages_by_sum",
           "reduce_scatter_autograd", "reduce_scatter_single", "reparametrize_module",
           "single_compile_thread", "sparse_coo_parts", "split_backward", "stager_spent",
           "tensor_version", "torch_version"]


def all_gather_single(output: torch.Tensor, input: torch.Tensor,
                      group: torch.distributed.ProcessGroup | None = None,
                      async_op: bool = False) -> Any:
    """Every rank's ``input`` into ``output``, concatenated along dim 0:
    ``torch.distributed.all_gather_single`` (torch 2.13), ``all_gather_into_tensor`` before it
    (the same collective). Looked up at each call, so a test's stand-in is the one called."""
    gather = getattr(torch.distributed, "all_gather_single", None) \
        or torch.distributed.all_gather_into_tensor
    return gather(output, input, group=group, async_op=async_op)


def reduce_scatter_single(output: torch.Tensor, input: torch.Tensor,
                          op: Any = None, group: torch.distributed.ProcessGroup | None = None,
                          async_op: bool = False) -> Any:
    """This rank's slice of dim 0 of the reduction (``op``, default a sum) of every rank's
    ``input`` into ``output``: ``torch.distributed.reduce_scatter_single`` (torch 2.13),
    ``reduce_scatter_tensor`` before it. Looked up at each call."""
    scatter = getattr(torch.distributed, "reduce_scatter_single", None) \
        or torch.distributed.reduce_scatter_tensor
    return scatter(output, input, op=torch.distributed.ReduceOp.SUM if op is None else op,
                   group=group, async_op=async_op)


def all_gather_autograd(tensor: torch.Tensor, group: Any) -> torch.Tensor:
    """Every rank's ``tensor`` concatenated along dim 0 (waited for), the gradient of each
    rank's slice flowing back to it: ``fcol.all_gather_single_autograd`` (torch 2.13),
    ``fcol.all_gather_tensor_autograd`` before it (the same collective)."""
    if hasattr(fcol, "all_gather_single_autograd"):
        return fcol.wait_tensor(fcol.all_gather_single_autograd(tensor, 0, group))
    return _contiguous_grad(fcol.wait_tensor(fcol.all_gather_tensor_autograd(tensor, 0, group)))


def reduce_scatter_autograd(tensor: torch.Tensor, group: Any) -> torch.Tensor:
    """The sum over ranks of ``tensor``, this rank's slice of dim 0 (waited for), with its
    gradient: ``fcol.reduce_scatter_single_autograd`` (torch 2.13),
    ``fcol.reduce_scatter_tensor_autograd`` before it."""
    if hasattr(fcol, "reduce_scatter_single_autograd"):
        return fcol.wait_tensor(fcol.reduce_scatter_single_autograd(tensor, "sum", 0, group))
    return _contiguous_grad(fcol.wait_tensor(
        fcol.reduce_scatter_tensor_autograd(tensor, "sum", 0, group)))


def _contiguous_grad(out: torch.Tensor) -> torch.Tensor:
    """``out``, its gradient made contiguous on the way back: before torch 2.13 the functional
    collectives' backward refuses a strided one (``x.sum()``'s expanded ones)."""
    if out.requires_grad:
        out.register_hook(lambda grad: grad.contiguous())
    return out


def fsdp_mesh_dims(shard: tuple[str, ...] | None, replicate: tuple[str, ...] | None) -> Any:
    """``torch.distributed.fsdp.DataParallelMeshDims(shard=, replicate=)``: which named dims of
    a DTensor parameter's mesh FSDP2 shards over (its SPMD mode, torch 2.13). Older torch has
    no SPMD mode: a ValueError naming the version, before anything is sharded."""
    dims = getattr(torch.distributed.fsdp, "DataParallelMeshDims", None)
    if dims is None:
        raise ValueError(f"optimizer parallel over semi-auto strategies needs FSDP2's SPMD mode "
                         f"(fully_shard(dp_mesh_dims=...), torch >= 2.13); this is torch "
                         f"{torch.__version__}")
    return dims(shard=shard, replicate=replicate)


def check_stages_on_one_rank(backend: str) -> None:
    """ValueError where a rank cannot hold two adjacent pipeline stages (zbv's V puts stages
    P-1 and P on the last rank) over ``backend``: torch before 2.13 sends between them through
    the process group, and gloo has no connection from a rank to itself ("Pair is not
    connected" at the first step). torch 2.13's stages hand the activation over in the process
    (``PipelineStage._is_same_rank``); NCCL may send to itself."""
    from torch.distributed.pipelining import PipelineStage

    if backend.lower() == "gloo" and not hasattr(PipelineStage, "_is_same_rank"):
        raise ValueError(f"parallel.schedule=zbv over gloo needs torch >= 2.13: torch "
                         f"{torch.__version__} sends between the two stages a rank holds "
                         f"through the process group, and gloo connects no rank to itself; "
                         f"use interleaved_1f1b, or NCCL")


def split_backward() -> Any:
    """torch's private split-backward helpers, ``torch.distributed.pipelining._backward``
    (``construct_reverse_graph``, ``get_param_groups``, ``stage_backward_input``: the same in
    2.11 and 2.13), for a stage that drives the zero-bubble passes itself
    (``parallel.pipeline.offloaded_stage``). Imported on first use: pipelining is not loaded at
    start-up."""
    from torch.distributed.pipelining import _backward

    return _backward


def torch_version() -> tuple[int, int]:
    """(major, minor) of the torch in use."""
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def _check_torch() -> None:
    version = torch_version()
    wanted = ".".join(map(str, MIN_TORCH))
    tested = ", ".join(".".join(map(str, v)) for v in TESTED_TORCH)
    if version < MIN_TORCH:
        raise ImportError(f"hetero-parallel needs torch >= {wanted}, found {torch.__version__}")
    if version > max(TESTED_TORCH):
        warnings.warn(f"hetero-parallel is tested on torch {tested}, found {torch.__version__}; "
                      f"the private APIs in foundation/compat.py may have moved",
                      RuntimeWarning, stacklevel=2)
    elif version < min(TESTED_TORCH):
        warnings.warn(f"hetero-parallel is tested on torch {tested}, found {torch.__version__}: "
                      f"{BELOW_TESTED.get(version, 'untried')}", RuntimeWarning, stacklevel=2)


_check_torch()


def queue_backward_callback(fn: Callable[[], None]) -> None:
    """Run ``fn`` once the backward pass now running has finished (call from a grad hook)."""
    torch.autograd.Variable._execution_engine.queue_callback(fn)


def in_backward() -> bool:
    """Whether this thread is running a backward pass now (a grad hook, a recomputed forward)."""
    return torch._C._current_graph_task_id() != -1


def tensor_version(tensor: torch.Tensor) -> int:
    """The tensor's in-place write counter (bumped by every in-place op on it or its views)."""
    return tensor._version


def sparse_coo_parts(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(indices, values) of a sparse COO tensor, coalesced or not, without copying."""
    return tensor._indices(), tensor._values()


def fused_adam_(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
                exp_avg_sq: torch.Tensor, step: int, *, lr: float, beta1: float, beta2: float,
                eps: float, weight_decay: float, decoupled: bool) -> None:
    """One in-place Adam (or AdamW, ``decoupled``) step by torch's fused kernel; ``step`` is the
    number of this update (1 for the first), as in the optimizer's state after it."""
    # the kernel counts it up first; made on the device by a fill, not copied from the host
    # (torch.tensor(x, device=...) is a pageable copy the host waits for: issue 39)
    before = torch.full((), float(step - 1), device=param.device)
    _functional_adam([param], [grad], [exp_avg], [exp_avg_sq], [], [before], fused=True,
                     decoupled_weight_decay=decoupled, amsgrad=False, beta1=beta1, beta2=beta2,
                     lr=lr, weight_decay=weight_decay, eps=eps, maximize=False)


def cpp_compiler_missing() -> str | None:
    """Why Inductor cannot build C++ kernels here, or None when it can."""
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler

        get_cpp_compiler()
    except Exception as err:  # no compiler on PATH, or an Inductor without this helper
        return f"{type(err).__name__}: {err}"
    return None


@contextlib.contextmanager
def single_compile_thread() -> Iterator[None]:
    """Compile in this process: for one small kernel that beats starting Inductor's worker pool."""
    from torch._inductor import config as inductor_config

    with inductor_config.patch(compile_threads=1):
        yield


def reparametrize_module(module: torch.nn.Module, tensors: dict[str, torch.Tensor],
                         *, tie_weights: bool = True) -> contextlib.AbstractContextManager:
    """Within the context, ``module``'s parameters and buffers named in ``tensors`` are those
    tensors (tied names follow with ``tie_weights``); the originals come back on exit."""
    return _reparametrize_module(module, tensors, tie_weights=tie_weights)


def fake_tensor_mode() -> FakeTensorMode:
    """A fake-tensor mode that real tensors may enter (they are converted on the way in)."""
    return FakeTensorMode(allow_non_fake_inputs=True)


def fx_generated_sources() -> set[str]:
    """The file names of the fx code generated so far (one per ``GraphModule.recompile``)."""
    return set(torch.fx.graph_module._loader.eval_cache)


def graph_module_sources(module: torch.nn.Module) -> set[str]:
    """The generated-source file names the graph modules in ``module`` (itself included) run."""
    return {type(m).forward.__code__.co_filename for m in module.modules()
            if isinstance(m, torch.fx.GraphModule)}


def forget_fx_sources(names: set[str]) -> None:
    """Drop the generated sources ``names`` from fx's loader and ``linecache``. Code already
    compiled from them keeps running; only a traceback through it loses its source lines."""
    cache = torch.fx.graph_module._loader.eval_cache
    for name in names:
        cache.pop(name, None)
        linecache.cache.pop(name, None)


def fake_dispatch_keys() -> set:
    """The keys in fake tensors' class-level dispatch cache (``FakeTensorMode.cache``)."""
    return set(FakeTensorMode.cache)


def forget_fake_dispatch(keys: set) -> None:
    """Drop ``keys`` from the fake dispatch cache (a cache of results: they are recomputed)."""
    for key in keys:
        FakeTensorMode.cache.pop(key, None)


def recast_dtensor_(param: DTensor, local: torch.Tensor) -> None:
    """Make the DTensor ``param`` hold ``local`` (its shard in another dtype) in place: the same
    object, placements and autograd hooks; its dtype becomes ``local``'s."""
    new = DTensor.from_local(local, param.device_mesh, param.placements, shape=param.shape,
                             stride=param.stride(), run_check=False)
    param.data = new  # the tensor's own dtype (what autograd and the optimizer see)
    param._local_tensor = new._local_tensor  # what DTensor computes with
    param._spec = new._spec


def dtensor_slice(tensor: DTensor) -> tuple[slice, ...]:
    """The index of the global tensor that ``tensor``'s local shard holds on this rank (an
    empty slice on a rank holding none of it)."""
    shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh,
                                                          tensor.placements)
    return tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))


def foreach_mul_(tensors: list[torch.Tensor], factor: torch.Tensor) -> None:
    """``torch._foreach_mul_``: one fused kernel scaling many tensors in place by a tensor
    factor (no host read of it); torch has no public multi-tensor scale."""
    torch._foreach_mul_(tensors, factor)


def unscale_and_check_(grads: list[torch.Tensor], found_inf: torch.Tensor,
                       inv_scale: torch.Tensor) -> None:
    """``torch._amp_foreach_non_finite_check_and_unscale_``: multiply ``grads`` (one device and
    dtype) by ``inv_scale`` in place and set ``found_inf`` to 1 where one holds Inf or NaN, in
    one kernel and no host read (what ``GradScaler`` runs; no public equivalent)."""
    torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)


#: (kernel, device type, dtype) whose fused block kernel ran, and those that failed on first use
_BLOCK_KERNEL_PROVEN: set[tuple[str, str, torch.dtype]] = set()
_BLOCK_KERNEL_FAILED: set[tuple[str, str, torch.dtype]] = set()


def attention_block_kernel(tensor: torch.Tensor) -> str | None:
    """The fused kernel :func:`fused_attention_block` runs for ``tensor``'s (the queries')
    device, dtype and head dimension (``foundation.device.attention_block_kernel``), or None:
    there is none, or it failed on its first call in this process."""
    from foundation.device import attention_block_kernel as kernel_for

    kernel = kernel_for(tensor.device, tensor.dtype, tensor.shape[-1])
    if kernel is None or (kernel, tensor.device.type, tensor.dtype) in _BLOCK_KERNEL_FAILED:
        return None
    return kernel


def has_fused_attention_block(tensor: torch.Tensor) -> bool:
    """Whether :func:`fused_attention_block` serves ``tensor``'s device and dtype."""
    return attention_block_kernel(tensor) is not None


def _first_use_checked(kernel: str, tensor: torch.Tensor, call: Callable[[], Any]) -> Any:
    """``call()``; None, with a warning naming the kernel and its error, where the kernel fails
    on its first use in this process for ``tensor``'s device and dtype (then never tried again).

    Why: the accelerator kernels are called through private operators whose requirements
    (compute capability, head sizes) are the device's; a first run on a new device then trains
    on the plain-operation kernel, told why, instead of stopping. Once a kernel has run, its
    errors are raised as they are, and running out of memory always is."""
    key = (kernel, tensor.device.type, tensor.dtype)
    if key in _BLOCK_KERNEL_PROVEN:
        return call()
    try:
        result = call()
    except torch.OutOfMemoryError:
        raise
    except (RuntimeError, NotImplementedError) as error:
        _BLOCK_KERNEL_FAILED.add(key)
        warnings.warn(f"ring attention: the fused attention kernel {kernel!r} failed on "
                      f"{tensor.device.type} {tensor.dtype} ({str(error).splitlines()[0]}); "
                      f"attention blocks run in plain tensor operations from now on",
                      RuntimeWarning, stacklevel=3)
        return None
    _BLOCK_KERNEL_PROVEN.add(key)
    return result


def fused_attention_block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                          scale: float, kernel: str | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(out, logsumexp)`` of one attention block (``[batch, heads, tokens, dim]``, equal head
    counts; ``causal`` on a square block) from torch's fused ``kernel`` (default: the one
    :func:`attention_block_kernel` names); None where that kernel failed on its first use."""
    kernel = kernel or attention_block_kernel(q)
    if kernel == "host_flash":
        def call() -> Any:
            return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                q, k, v, 0.0, causal, scale=scale)[:2]
    elif kernel == "flash":
        def call() -> Any:
            return torch.ops.aten._scaled_dot_product_flash_attention(
                q, k, v, 0.0, causal, False, scale=scale)[:2]
    else:
        raise ValueError(f"fused_attention_block: no fused attention kernel {kernel!r} "
                         f"(host_flash, flash)")
    return _first_use_checked(kernel, q, call)


def fused_attention_block_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                                   v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                                   causal: bool, scale: float, kernel: str | None = None
                                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """``(dq, dk, dv)`` of one block, given the merged output and log-sum-exp of its rows
    (fp32), from ``kernel``'s backward; None where that kernel failed on its first use.

    CUDA's flash backward takes its forward's varlen offsets (None for a dense batch), the
    longest query and key lengths, and its random-number state, read only under dropout (none
    here): empty tensors of the forward's dtypes stand in for the state."""
    kernel = kernel or attention_block_kernel(q)
    lse = lse.contiguous()
    if kernel == "host_flash":
        def call() -> Any:
            return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                dout, q, k, v, out, lse, 0.0, causal, scale=scale)
    elif kernel == "flash":
        def call() -> Any:
            seed = torch.empty(2, dtype=torch.uint64, device=q.device)
            offset = torch.empty((), dtype=torch.uint64, device=q.device)
            return torch.ops.aten._scaled_dot_product_flash_attention_backward(
                dout, q, k, v, out, lse, None, None, q.shape[-2], k.shape[-2], 0.0, causal,
                seed, offset, scale=scale)
    else:
        raise ValueError(f"fused_attention_block_backward: no fused attention kernel "
                         f"{kernel!r} (host_flash, flash)")
    return _first_use_checked(kernel, q, call)


def default_to_gloo(group: torch.distributed.ProcessGroup) -> None:
    """Give ``group`` (made from ``"cpu:gloo"``) gloo as its default backend, as
    ``init_process_group("gloo")`` does."""
    group._set_default_backend(torch.distributed.ProcessGroup.BackendType.GLOO)


def reduce_dtensor_averages_by_sum(lacks_average: Callable[[Any, int], bool]) -> None:
    """Reduce DTensor's pending averages (``Partial("avg")``) as a sum and a divide on the mesh
    dimensions where ``lacks_average(mesh, mesh_dim)``; elsewhere as torch does. Installed once
    per process (a later call replaces the predicate)."""
    from torch.distributed.tensor.placement_types import Partial

    _AVERAGE_RULE[:] = [lacks_average]
    if getattr(Partial, "_hetero_average_by_sum", False):
        return

    def by_sum(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        def reduce(self: Any, tensor: torch.Tensor, mesh: Any, mesh_dim: int,
                   *rest: Any) -> torch.Tensor:
            if self.reduce_op != "avg" or not _AVERAGE_RULE[0](mesh, mesh_dim):
                return original(self, tensor, mesh, mesh_dim, *rest)
            return original(Partial("sum"), tensor, mesh, mesh_dim, *rest) / mesh.size(mesh_dim)
        return reduce

    Partial._reduce_value = by_sum(Partial._reduce_value)  # type: ignore[method-assign]
    Partial._reduce_shard_value = by_sum(  # type: ignore[method-assign]
        Partial._reduce_shard_value)
    Partial._hetero_average_by_sum = True  # type: ignore[attr-defined]


#: the predicate :func:`reduce_dtensor_averages_by_sum` installed
_AVERAGE_RULE: list[Callable[[Any, int], bool]] = []


def dtensor_folds_sharded_dims() -> bool:
    """Whether DTensor folds dims of which a later one is sharded (``(b, s, h) -> (b*s, h)``
    with ``s`` split, as ``aten.linear`` does to a 3-D input): torch 2.13 does; 2.11 raises
    "Attempted to flatten multiple dimensions, with dimension 1 being sharded"."""
    return torch_version() >= (2, 13)


def stager_spent(stager: Any) -> bool:
    """Whether DCP's ``DefaultStager`` can stage no more: torch 2.11's closes its state-dict
    copier at the end of every stage (emptying its private ``_deepcopy_dispatch``, so the next
    stage raises ``KeyError: <class 'type'>``); 2.13's stays usable until the caller closes it,
    keeping its staging buffers from one save to the next."""
    copier = getattr(stager, "_state_dict_stager", None)
    return copier is not None and not getattr(copier, "_deepcopy_dispatch", True)


def forget_dtensor_caches() -> None:
    """Empty DTensor's sharding-propagation and redistribution-planner caches (this thread's
    propagation cache and the process-wide ones): they hold device meshes, and so their groups."""
    from torch.distributed.tensor import _redistribute
    from torch.distributed.tensor._collective_utils import MeshTopoInfo
    from torch.distributed.tensor._sharding_prop import ShardingPropagator
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()
    ShardingPropagator._propagate_tensor_meta_cached.cache_clear()
    _redistribute._gen_transform_infos.cache_clear()
    _redistribute.clear_redistribute_planner_cache()
    MeshTopoInfo.build_from_mesh.cache_clear()
