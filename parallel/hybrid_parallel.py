"""``ParallelConfig(tensor_degree=M)`` with no strategies and no search: the model writes its own
model-parallel collectives; the framework does what the reference's HYBRID_PARALLEL mode defines.

In MindSpore's HYBRID_PARALLEL the user "knows how to design the logic and implementation of
parallel training" and puts the communication operators (AllReduce, AllGather, ...) in the
network; the framework keeps only the data-parallel duties: ``parameter_broadcast`` at wrap and
the gradient AllReduce (a mean with ``gradients_mean``). Here the job's ``(pp, dp, ep, mp)``
mesh says which ranks are which:

* the **model-parallel group** is the config mesh's ``mp`` dimension, ``model`` ranks per data
  replica: the model takes it from ``parallel.mesh.parallel_mesh(config)["tp"]`` (``.get_group()``
  for the collectives, ``.get_local_rank()`` for which slice to hold). The mesh is built once,
  so the model may ask for it before ``parallelize`` or after;
* the **data-parallel group** is ``dp``: its ranks feed their own slices of the batch (all
  ``model`` ranks of one replica feed the same slice: ``parallel.mesh.batch_mesh(config)``'s
  local rank picks it), and every parameter's gradient is averaged (or summed) over it only,
  never over ``mp``, whose ranks hold different slices or already agree;
* a parameter (or buffer) holding this rank's own **slice** is marked with
  :func:`mark_model_parallel` (MindSpore's ``Parameter(layerwise_parallel=True)``): it is
  broadcast over ``dp`` only (each slice from the first replica's rank holding it), whereas
  every unmarked tensor is the same on all ranks and is broadcast over ``dp`` and ``mp``;
* with **pipeline stages** (``pipeline_degree > 1``) each stage's ranks are a ``dp × mp`` grid
  of their own (the mesh's ``pp`` is outermost): ``parallel_mesh(config)["tp"]`` is this rank's
  stage's ``mp`` group, so a layer's collectives stay inside the stage that holds it; the
  broadcasts and the gradient reduction run per stage, over the stage's ``mp`` and ``dp`` ranks
  (``parallel.pipeline.build``).

The model's collectives must leave every rank of an ``mp`` group the gradients of the one loss
the group computes (Megatron's conjugate pairs: a copy into the parallel region all-reduces its
gradient in backward, a reduction out of it passes the gradient through). ``all_reduce``
differentiates as a sum over the ranks' losses, so the reductions are wrapped in a
``torch.autograd.Function`` as Megatron does (``tests/hybrid_models.py`` has a column/row MLP).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from parallel.config import OperatorSplit, ParallelConfig
from parallel.data.replicas import (
    Named,
    _replicated,
    check_same_model,
    sync_from_rank0,
)
from parallel.errors import collective_guard
from parallel.weights.deferred_init import Split, canonical_names, pending

#: the attribute a marked tensor carries: the dimension its slice was cut along (``_NO_DIM``:
#: marked without ``dim``). An attribute, not a registry of weak references: deferred
#: initialization swaps a meta parameter's storage in place (``torch.utils.swap_tensors``, which
#: refuses a tensor with weak references) and keeps its attributes
#: (``parallel.weights.deferred_hooks``); copies stay marked
_MARK = "_hybrid_model_parallel"
_NO_DIM = -1
_WHO = "hybrid_parallel"


def mark_model_parallel(*targets: nn.Module | torch.Tensor | Iterable[torch.Tensor],
                        dim: int | None = None) -> None:
    """Mark parameters or buffers (a module: all of its own and its children's) as holding this
    rank's slice along the model-parallel ranks, split by the model's own code: hybrid parallel
    broadcasts them over the data-parallel ranks only. The mark is an attribute of the tensor.

    ``dim``: the dimension along which the whole tensor was cut into ``tensor_degree`` equal
    slices, this rank's being the one at its ``mp`` position (Megatron's layout: a column-parallel
    Linear's weight and bias ``dim=0``, a row-parallel one's weight ``dim=1``). It is what a
    model built on the meta device needs (deferred initialization): each slice is then initialized
    as exactly that part of the whole tensor the one-process model (``tensor_degree=1``) holds."""
    marked = []
    for target in targets:
        if isinstance(target, nn.Module):
            tensors: Iterable = [*target.parameters(), *target.buffers()]
        elif isinstance(target, torch.Tensor):
            tensors = [target]
        elif isinstance(target, Iterable):
            tensors = list(target)
        else:
            raise TypeError(f"mark_model_parallel takes modules, parameters or buffers, got "
                            f"{type(target).__name__}")
        for tensor in tensors:
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(f"mark_model_parallel takes modules, parameters or buffers, "
                                f"got {type(tensor).__name__}")
            if dim is not None and not (isinstance(dim, int) and -tensor.dim() <= dim <
                                        tensor.dim()):
                raise ValueError(f"mark_model_parallel: dim={dim!r} is not a dimension of a "
                                 f"tensor of shape {tuple(tensor.shape)}")
            marked.append(tensor)
    for tensor in marked:  # every target checked first: nothing is half-marked
        setattr(tensor, _MARK, _NO_DIM if dim is None else dim % tensor.dim())


def is_model_parallel(tensor: torch.Tensor) -> bool:
    """Whether :func:`mark_model_parallel` marked ``tensor``."""
    return hasattr(tensor, _MARK)


def split_dim(tensor: torch.Tensor) -> int | None:
    """The dimension :func:`mark_model_parallel` said ``tensor``'s slice was cut along (None:
    not marked, or marked without ``dim``)."""
    dim = getattr(tensor, _MARK, _NO_DIM)
    return None if dim == _NO_DIM else dim


def deferred_splits(model: nn.Module, config: ParallelConfig, mesh: DeviceMesh
                    ) -> dict[str, Split]:
    """For a meta-device ``model`` in hybrid parallel: each marked tensor's canonical name ->
    (dim, this rank's ``mp`` position, ``tensor_degree``), what deferred initialization cuts its
    slice of the whole value by. ValueError naming the first marked tensor without ``dim``."""
    if config.tensor_degree == 1:
        return {}
    index = mesh["tp"].get_local_rank()
    canonical = canonical_names(model)
    splits = {}
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if not is_model_parallel(tensor):
            continue
        dim = split_dim(tensor)
        if dim is None:
            raise ValueError(
                f"parallel.parallelize: '{name}' is marked with parallel.mark_model_parallel "
                f"without dim=, so deferred initialization cannot tell which part of the whole "
                f"tensor this rank's slice is; mark it with mark_model_parallel(tensor, dim=d) "
                f"(the dimension the model cut into tensor_degree={config.tensor_degree} "
                f"slices), or call parallel.materialize(model) before parallelize")
        splits[canonical[name]] = Split(dim, index, config.tensor_degree)
    return splits


def replicated_tensors(model: nn.Module) -> Named:
    """``model``'s parameters and buffers that every rank holds whole (not marked)."""
    return [(n, t) for n, t in _replicated(model) if not is_model_parallel(t)]


def prepare_hybrid(model: nn.Module, config: ParallelConfig, mesh: DeviceMesh, *,
                   checked: bool = False) -> None:
    """Hybrid parallel's own duties on a resolved ``config`` and its ``(pp, dp, ep, mp)``
    ``mesh``: the checks (:func:`check_hybrid`; a pipeline stage passes ``checked=True``, its
    whole model was checked before the other stages' layers were dropped), then the unmarked
    tensors broadcast over ``mp``. What follows is data parallel's, over the ranks that split
    the batch: ``DataParallel`` over ``dp`` (broadcast of everything over ``dp``, so every rank
    ends with data-rank 0's slice of its ``mp`` position and the one copy of the rest; gradients
    averaged over ``dp`` only), or, with MoE layers, experts sharded over ``ep`` and the rest
    reduced over ``dp × ep`` (``parallel.expert.experts``: each ``mp`` coordinate runs its own
    all-to-alls, the ``mp`` ranks computing the replicated MoE layers alike), or optimizer
    parallel's shards over the same ranks."""
    if not checked:
        check_hybrid(model, config, mesh)
    mp_group = _mp_group(config, mesh)
    # parameter_broadcast=False: check_hybrid verified them; a meta model (deferred init) is
    # given the same values on every rank when it is materialized
    if mp_group is None or not config.parameter_broadcast or pending(model):
        return
    with collective_guard(f"{_WHO} set-up (parameter broadcast over 'mp')", mp_group):
        sync_from_rank0(model, mp_group, verify=False, tensors=replicated_tensors(model))


def check_hybrid(model: nn.Module, config: ParallelConfig, mesh: DeviceMesh) -> None:
    """Every check of hybrid parallel, changing nothing: the config's mode, some tensor marked
    when ``tensor_degree > 1`` (else the broadcast over ``mp`` would make every slice rank 0's),
    the ``mp`` ranks holding the same unmarked tensors, and, with ``parameter_broadcast=False``,
    holding them equal. Collective over ``mp``. A pipelined model is checked whole, before its
    stages are kept: one stage may hold only replicated layers."""
    if config.operator_split is not OperatorSplit.MODEL:
        raise ValueError(f"apply_hybrid_parallel: the config splits operators by "
                         f"{config.operator_split.value!r}, not the model's own collectives")
    replicated = replicated_tensors(model)
    if config.tensor_degree > 1 and len(replicated) == len(_replicated(model)):
        raise ValueError(f"ParallelConfig.tensor_degree={config.tensor_degree} splits operators "
                         f"over {config.tensor_degree} ranks, and nothing says how: no strategies, "
                         f"no parallel.shard tag, no search_mode, and no parameter of "
                         f"{type(model).__name__} is marked with parallel.mark_model_parallel "
                         f"(a model whose own collectives split it; each unmarked one would be "
                         f"made rank 0's copy on all {config.tensor_degree} ranks). Give one of "
                         f"them, or tensor_degree=1")
    mp_group = _mp_group(config, mesh)
    if mp_group is None:
        return
    with collective_guard(f"{_WHO} set-up (model-parallel ranks' check)", mp_group):
        check_same_model(model, mp_group, replicated, who=f"{_WHO} over 'mp'")
        if not config.parameter_broadcast and not pending(model):  # verify only: no write
            sync_from_rank0(model, mp_group, verify=True, tensors=replicated,
                            who=f"{_WHO}(parameter_broadcast=False) over 'mp'")


def _mp_group(config: ParallelConfig, mesh: DeviceMesh) -> dist.ProcessGroup | None:
    return mesh["tp"].get_group() if config.tensor_degree > 1 else None
