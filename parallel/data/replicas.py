"""``DataParallel``: the reference's data parallel mode, for models with host parts too.

Wrap a model written for one device; every rank runs it on its own shard of the batch. At wrap
time the ranks check they hold the same model (names, shapes, dtypes) and rank 0's parameters
and buffers are broadcast (``parameter_broadcast``; otherwise they must already be equal). During
backward :class:`~parallel.data.grad_reducer.GradReducer` averages (``gradients_mean``) or sums the
gradients in buckets overlapped with backward, host gradients over gloo and accelerator gradients
over NCCL/HCCL, so every rank then applies the same update. Modules that say ``sparse=True``
(``nn.Embedding``, ``hetero.nn.EmbeddingLookup``) have their row-sparse gradients reduced as
sparse tensors outside the buckets. The wrapper is a view of the model:
``parameters()`` and ``state_dict()`` keys are the model's own (no ``module.`` prefix).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from foundation.collective_check import check as check_collective
from foundation.model_view import ModelView
from hetero.nn.row_blocks import reduces_itself
from parallel.comm import get_rank, get_world_size
from parallel.data.grad_reducer import GradReducer
from parallel.errors import collective_guard
from parallel.grad_clip import clip_grad_norm_
from parallel.weights.deferred_init import materialize_pending, pending, refuse_meta


def _replicated(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Parameters and buffers every rank holds whole: not a row-sharded table's block (each rank
    holds other rows, and its gradients were already pushed to their owners) or its cache (whose
    gradients are summed already), nor a DTensor (sharded over another mesh dimension, e.g.
    experts over ``ep``)."""
    return [(n, t) for n, t in [*model.named_parameters(), *model.named_buffers()]
            if not reduces_itself(t) and not isinstance(t, DTensor)]


Named = list[tuple[str, torch.Tensor]]


def _signature(tensors: Named) -> list[tuple[str, tuple[int, ...], str]]:
    return [(name, tuple(t.shape), str(t.dtype)) for name, t in tensors]


def check_same_model(model: nn.Module, group: dist.ProcessGroup | None,
                     tensors: Named | None = None, who: str = "DataParallel") -> None:
    """The ranks of ``group`` hold the same ``tensors`` (default: every replicated one) by name,
    shape and dtype; ValueError naming the first difference."""
    mine = _signature(_replicated(model) if tensors is None else tensors)
    everyone: list[Any] = [None] * get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    for rank, theirs in enumerate(everyone):
        if theirs == mine:
            continue
        for i in range(max(len(mine), len(theirs))):
            a = mine[i] if i < len(mine) else "nothing"
            b = theirs[i] if i < len(theirs) else "nothing"
            if a != b:
                raise ValueError(
                    f"{who}: rank {get_rank(group)} and rank {rank} hold different models: "
                    f"tensor #{i} is {a} here and {b} there ({len(mine)} vs {len(theirs)} "
                    f"parameters and buffers); every rank must build the same model"
                )


def sync_from_rank0(model: nn.Module, group: dist.ProcessGroup | None, verify: bool,
                    tensors: Named | None = None,
                    who: str = "DataParallel(parameter_broadcast=False)") -> None:
    """Broadcast rank 0's ``tensors`` (default: every replicated one); with ``verify``, only
    check they are already equal."""
    src = dist.get_global_rank(group, 0) if group is not None else 0
    first_diff: list[str | None] = [None]
    with torch.no_grad():
        for name, tensor in _replicated(model) if tensors is None else tensors:
            theirs = tensor.detach().clone() if verify else tensor.data
            check_collective("broadcast", theirs, group, what=f"parameter broadcast ({name})",
                             params=(src,))
            dist.broadcast(theirs, src=src, group=group)
            if verify and first_diff[0] is None and not torch.equal(theirs, tensor):
                first_diff[0] = name
    if verify:
        found: list[Any] = [None] * get_world_size(group)
        dist.all_gather_object(found, first_diff[0], group=group)
        bad = [(rank, name) for rank, name in enumerate(found) if name is not None]
        if bad:
            rank, name = bad[0]
            raise ValueError(
                f"{who}: '{name}' on rank {rank} differs from "
                f"rank 0's; seed every rank alike or use parameter_broadcast=True"
            )


class DataParallel(ModelView):
    """Data-parallel training of ``module`` over the ranks of ``group`` (default: the world).

    Call ``parallel.init()`` first. Gradients are reduced during ``backward``; use
    :meth:`no_sync` for the micro-batches of a gradient-accumulation step but the last.
    DTensor parameters (experts sharded over ``ep`` by expert parallel) are left out of the
    set-up; their gradients are reduced over ``shard_group``, the ranks holding the same shards
    (none: not reduced).
    """

    def __init__(self, module: nn.Module, *, gradients_mean: bool = True,
                 parameter_broadcast: bool = True, bucket_cap_mb: float = 25,
                 group: dist.ProcessGroup | None = None,
                 shard_group: dist.ProcessGroup | None = None) -> None:
        if not isinstance(module, nn.Module):
            raise TypeError(f"DataParallel wraps an nn.Module, got {type(module).__name__}")
        if not isinstance(bucket_cap_mb, (int, float)) or bucket_cap_mb <= 0:
            raise ValueError(f"bucket_cap_mb must be a positive number, got {bucket_cap_mb!r}")
        get_rank(group)  # raises "call parallel.init()" when there is no process group
        refuse_meta(module, "DataParallel")
        super().__init__(module)
        with collective_guard("DataParallel set-up (model check and parameter broadcast)", group):
            check_same_model(module, group)
            if pending(module):  # deferred init: equal on every rank by construction
                materialize_pending(module)
            else:
                sync_from_rank0(module, group, verify=not parameter_broadcast)
        self.gradients_mean = gradients_mean
        self.group = group
        sparse = [p for m in module.modules() if getattr(m, "sparse", False) is True
                  for p in m.parameters(recurse=False) if not reduces_itself(p)]
        self._reducer = GradReducer([p for _, p in _replicated(module)
                                     if isinstance(p, nn.Parameter)], mean=gradients_mean,
                                    cap_bytes=int(bucket_cap_mb * 2**20), group=group,
                                    sparse_params=sparse)
        self._reducers = [self._reducer]
        sharded = [p for p in module.parameters() if isinstance(p, DTensor)]
        if sharded and shard_group is not None and dist.get_world_size(shard_group) > 1:
            self._reducers.append(GradReducer(sharded, mean=gradients_mean,
                                              cap_bytes=int(bucket_cap_mb * 2**20),
                                              group=shard_group))

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._model(*args, **kwargs)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients locally, without communicating."""
        previous = [r.enabled for r in self._reducers]
        for reducer in self._reducers:
            reducer.enabled = False
        try:
            yield
        finally:
            for reducer, enabled in zip(self._reducers, previous, strict=True):
                reducer.enabled = enabled

    def sync_gradients(self) -> None:
        """Reduce the gradients accumulated under :meth:`no_sync` now (e.g. after a pipeline
        schedule's micro-batches), with the same buckets and rules as during backward."""
        for reducer in self._reducers:
            reducer.reduce_accumulated()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the reduced gradients to a global norm of ``max_norm`` (sharded expert
        gradients count over their whole mesh); returns the norm."""
        return clip_grad_norm_(self.parameters(), max_norm, norm_type)

    @property
    def buckets(self) -> list[list[str]]:
        """Parameter names per bucket, in launch order (for inspection and tests)."""
        names = {id(p): n for n, p in self._model.named_parameters()}
        return [[names[id(p)] for p in b.params] for b in self._reducer.buckets]


def context_replicas(model: nn.Module, group: dist.ProcessGroup) -> DataParallel:
    """``model`` split by strategies, run by each context rank of ``group`` on its share of the
    sequence: every gradient, its sharded (DTensor) ones included, averaged over those ranks,
    which compute the same shards on different tokens (the whole model, or a pipeline stage)."""
    return DataParallel(model, gradients_mean=True, group=group, shard_group=group)
