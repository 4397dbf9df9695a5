"""Autograd-aware collectives: AllReduce, AllGather, ReduceScatter, Broadcast, AlltoAll.

The exchanges are torch's differentiable functional collectives
(``torch.distributed._functional_collectives``, reached through ``foundation.compat``; the
replacement for the deprecated ``torch.distributed.nn.functional``); nothing here moves bytes by
hand. What this module adds is the reference framework's vocabulary (``op="mean"``,
gather/scatter along any dimension), input checks that name the rule a tensor broke, and an error
that says which collective failed and that a peer is the likely cause, instead of a bare backend
error (a dead rank surfaces as a connection or timeout error from gloo/NCCL/HCCL).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as legacy_fn

from foundation import collective_check
from foundation.compat import all_gather_autograd, fcol, reduce_scatter_autograd
from parallel.comm import get_rank, get_world_size
from parallel.errors import CollectiveError, collective_guard

__all__ = ["CollectiveError", "all_gather", "all_reduce", "all_to_all", "all_to_all_rows",
           "broadcast", "reduce_scatter"]

Group = dist.ProcessGroup | None

_REDUCE_NAMES = ("sum", "mean", "max", "min")


def _world(group: Group) -> dist.ProcessGroup:
    return group if group is not None else dist.group.WORLD


@contextmanager
def _named(what: str, group: Group, tensor: torch.Tensor, params: tuple[int, ...] = (),
           free_dims: tuple[int, ...] = ()) -> Iterator[None]:
    """Name failures after ``what``; first check the ranks agree on the call (every call in
    check mode, each new signature once otherwise: see ``foundation.collective_check``)."""
    get_rank()  # raises the "call parallel.init()" error before any work
    with collective_guard(what, group):
        collective_check.check(what, tensor, group, params=params, free_dims=free_dims,
                               public=True)
        yield


def _check_op(op: str, what: str, allowed: tuple[str, ...] = _REDUCE_NAMES) -> None:
    if op not in allowed:
        raise ValueError(f"{what}: op must be one of {allowed}, got {op!r}")


def _split_dim(tensor: torch.Tensor, dim: int, parts: int, what: str) -> int:
    if tensor.dim() == 0:
        raise ValueError(f"{what}: needs a tensor with at least one dimension to split")
    if not -tensor.dim() <= dim < tensor.dim():
        raise ValueError(f"{what}: dim {dim} is out of range for a {tensor.dim()}-d tensor")
    dim %= tensor.dim()
    if tensor.shape[dim] % parts:
        raise ValueError(
            f"{what}: dimension {dim} of a tensor of shape {tuple(tensor.shape)} must split evenly "
            f"into {parts} parts (one per rank)"
        )
    return dim


def all_reduce(tensor: torch.Tensor, op: str = "sum", group: Group = None) -> torch.Tensor:
    """Reduce ``tensor`` over the ranks of ``group``; every rank gets the result.

    ``op="mean"`` divides the sum by the group size (gloo has no native AVG). The input is left
    untouched. "sum" and "mean" are differentiable (each rank's input gets the sum of all ranks'
    output gradients, scaled for the mean); "max"/"min" are for values only.
    """
    _check_op(op, "all_reduce")
    with _named("all_reduce", group, tensor, (_REDUCE_NAMES.index(op),)):
        out = fcol.all_reduce(tensor, "sum" if op == "mean" else op, _world(group))
        out = fcol.wait_tensor(out)
    return out / get_world_size(group) if op == "mean" else out


def all_gather(tensor: torch.Tensor, dim: int = 0, group: Group = None) -> torch.Tensor:
    """Concatenate every rank's ``tensor`` along ``dim`` in rank order; the gradient of each
    rank's slice flows back to that rank."""
    if tensor.dim() == 0:
        tensor = tensor.unsqueeze(0)
    dim = _split_dim(tensor, dim, 1, "all_gather")
    front = tensor.movedim(dim, 0).contiguous()  # the library gathers along dim 0
    with _named("all_gather", group, front):
        out = all_gather_autograd(front, _world(group))
    return out.movedim(0, dim)


def reduce_scatter(
    tensor: torch.Tensor, dim: int = 0, op: str = "sum", group: Group = None
) -> torch.Tensor:
    """Reduce ``tensor`` over the ranks and give rank *r* the *r*-th slice along ``dim``."""
    _check_op(op, "reduce_scatter", ("sum", "mean"))
    world = get_world_size(group)
    dim = _split_dim(tensor, dim, world, "reduce_scatter")
    front = tensor.movedim(dim, 0).contiguous()  # the library scatters along dim 0
    with _named("reduce_scatter", group, front, (_REDUCE_NAMES.index(op),)):
        out = reduce_scatter_autograd(front, _world(group)).movedim(0, dim)
    return out / world if op == "mean" else out


def broadcast(tensor: torch.Tensor, src: int = 0, group: Group = None) -> torch.Tensor:
    """Every rank gets rank ``src``'s ``tensor``; all ranks' gradients sum back onto ``src``
    (the other ranks' inputs get zero gradient, as they did not influence the result)."""
    world = get_world_size(group)
    if not 0 <= src < world:
        raise ValueError(f"broadcast: src={src} is not a rank of a group of size {world}")
    with _named("broadcast", group, tensor, (src,)):
        if not (torch.is_grad_enabled() and tensor.requires_grad):
            return fcol.wait_tensor(fcol.broadcast(tensor, src, _world(group)))
        # torch 2.13's functional broadcast keeps its gradient local; the legacy differentiable
        # broadcast reduces it onto src as the chain rule requires, so it serves the grad path.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            return legacy_fn.broadcast(tensor, src=src, group=group)


def all_to_all(
    tensor: torch.Tensor, split_dim: int = 0, concat_dim: int = 0, group: Group = None
) -> torch.Tensor:
    """Split ``tensor`` into one slice per rank along ``split_dim``, send slice *r* to rank *r*,
    and concatenate what arrives along ``concat_dim`` in rank order (MindSpore's AlltoAll).

    The exchange is torch's ``all_to_all_single`` on dim 0; other dims are moved to the front and
    back around it.
    """
    world = get_world_size(group)
    split_dim = _split_dim(tensor, split_dim, world, "all_to_all")
    concat_dim = _split_dim(tensor, concat_dim, 1, "all_to_all")
    front = tensor.movedim(split_dim, 0).contiguous()
    with _named("all_to_all", group, front, (concat_dim,)):
        out = fcol.all_to_all_single_autograd(front, None, None, _world(group))
        received = fcol.wait_tensor(out).movedim(0, split_dim)
    return torch.cat(received.chunk(world, dim=split_dim), dim=concat_dim)


def all_to_all_rows(tensor: torch.Tensor, send_rows: list[int], recv_rows: list[int],
                    group: Group = None, *, wait: bool = True) -> torch.Tensor:
    """Send the first ``send_rows[0]`` rows of ``tensor`` to rank 0, the next ``send_rows[1]`` to
    rank 1, ...; receive ``recv_rows[r]`` rows from rank *r*, concatenated in rank order (the
    variable-split exchange of MoE token dispatch). Differentiable: each row's gradient returns
    to the rank that sent it.

    With ``wait=False`` the exchange is only issued: the result waits for it on first use, so work
    issued in between overlaps the communication (multi-copy)."""
    world = get_world_size(group)
    for name, splits in (("send_rows", send_rows), ("recv_rows", recv_rows)):
        if len(splits) != world or any(n < 0 for n in splits):
            raise ValueError(f"all_to_all_rows: {name} needs one non-negative row count per rank "
                             f"({world}), got {splits}")
    if sum(send_rows) != tensor.shape[0]:
        raise ValueError(f"all_to_all_rows: send_rows sum to {sum(send_rows)} but the tensor "
                         f"has {tensor.shape[0]} rows")
    with _named("all_to_all_rows", group, tensor, free_dims=(0,)):
        collective_check.check_splits("all_to_all_rows", send_rows, recv_rows, group)
        out = fcol.all_to_all_single_autograd(tensor.contiguous(), list(recv_rows),
                                              list(send_rows), _world(group))
        return fcol.wait_tensor(out) if wait else out
