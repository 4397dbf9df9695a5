"""Row-sparse gradients summed over a group, the same on every backend.

gloo has a sparse all_reduce; NCCL and HCCL have none. There every rank's coalesced indices and
values are all-gathered (padded to the largest row count, known on the host first) and added in
rank order, as gloo adds them, so the two paths give the same result. Used by
:class:`parallel.data.grad_reducer.GradReducer` for embedding tables with ``sparse=True``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from foundation.collective_check import check as check_collective

_WHAT = "DataParallel gradient all_reduce (sparse)"


def empty_row_sparse(shape: torch.Size, dtype: torch.dtype, device: torch.device
                     ) -> torch.Tensor:
    """A row-sparse (one sparse dim) gradient with no rows: what a rank whose table got no
    gradient contributes."""
    return torch.sparse_coo_tensor(torch.empty(1, 0, dtype=torch.long, device=device),
                                   torch.empty(0, *shape[1:], dtype=dtype, device=device), shape)


def reduce_sparse(grad: torch.Tensor, group: dist.ProcessGroup | None, *, by_gather: bool,
                  divide_by: int | None) -> torch.Tensor:
    """The sum (``divide_by``: the mean) over ``group`` of the row-sparse ``grad`` (a dense
    one is made row-sparse first), coalesced; ``by_gather``: by all-gathers, else by the
    backend's sparse all_reduce."""
    if not grad.is_sparse:
        grad = grad.to_sparse(sparse_dim=1)
    grad = grad.coalesce()
    if divide_by is not None:
        grad = grad / divide_by
    if by_gather:
        return all_gather_sparse(grad, group)
    check_collective("all_reduce", grad, group, what=_WHAT)
    dist.all_reduce(grad, group=group)
    return grad.coalesce()


def all_gather_sparse(grad: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """The sum over the ranks of the coalesced sparse ``grad``, by all-gathers every backend
    has: the row counts first (known on the host, gathered there: no device sync), then the
    indices and values padded to the largest count, each rank's part trimmed back."""
    world = dist.get_world_size(group)
    indices, values = grad.indices(), grad.values()
    gathered = [torch.zeros(1, dtype=torch.long) for _ in range(world)]
    dist.all_gather(gathered, torch.tensor([indices.shape[1]]), group=group)
    counts = [int(c) for c in gathered]
    most = max(counts)
    if most == 0:
        return grad  # no rank has a row: the sum is empty
    pad = most - indices.shape[1]
    indices = torch.cat([indices, indices.new_zeros(indices.shape[0], pad)], dim=1)
    values = torch.cat([values, values.new_zeros(pad, *values.shape[1:])])
    all_indices = [torch.empty_like(indices) for _ in range(world)]
    all_values = [torch.empty_like(values) for _ in range(world)]
    check_collective("all_gather", values, group, what=_WHAT)
    dist.all_gather(all_indices, indices, group=group)
    dist.all_gather(all_values, values, group=group)
    return sum_in_rank_order([i[:, :n] for i, n in zip(all_indices, counts, strict=True)],
                             [v[:n] for v, n in zip(all_values, counts, strict=True)],
                             grad.shape)


def sum_in_rank_order(indices: list[torch.Tensor], values: list[torch.Tensor],
                      shape: torch.Size) -> torch.Tensor:
    """The sum of the ranks' sparse parts, added in rank order and coalesced, as gloo's sparse
    all_reduce adds them (so the two paths give the same result)."""
    total = torch.sparse_coo_tensor(indices[0], values[0], shape)
    for i, v in zip(indices[1:], values[1:], strict=True):
        total += torch.sparse_coo_tensor(i, v, shape)
    return total.coalesce()
