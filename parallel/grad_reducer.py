"""Bucketed gradient AllReduce overlapped with backward, for parameters on any mix of devices.

Why not torch DDP's reducer: it assumes one device per module replica, and a model with host
parts (CPU-placed layers, host embedding tables with row-sparse gradients) beside accelerator
parts is exactly what this project trains. This reducer keeps one set of buckets per
(device, dtype), so host gradients travel over gloo and device gradients over NCCL/HCCL through
the multi-device process group in the same step.

How a step goes: a post-accumulate-grad hook marks each parameter ready as autograd produces its
gradient; buckets (reverse registration order, so the last layers' gradients fill the first bucket)
are launched strictly in bucket order, each as soon as it and its predecessors are full — every
rank issues the same collectives in the same order, so ranks never cross-match. At the end of
backward (an autograd engine callback) the remaining buckets are launched with zeros for parameters
that got no gradient, and everything still in flight is waited for: overlapped buckets cost nothing
more then. Each bucket carries two flags per parameter after its gradients (got a gradient here /
got a row-sparse one), so the same AllReduce tells every rank which parameters were used, and which
were sparse, anywhere — no extra collective for bucketed parameters. Gradients are divided by the
world size before the sum (as DDP does, so the results are bit-equal to torch DDP's), parameters
unused on every rank keep ``grad = None``, and row-sparse gradients are all-reduced as sparse
tensors. Parameters declared sparse up front (``sparse_params``: embedding tables with
``sparse=True``) get no bucket slot, so a huge table costs only its touched rows on the wire; their
usage needs one extra small MAX all-reduce per step (then one sparse all-reduce per used table). A
parameter whose gradient turns out sparse anyway is still reduced correctly, its slot just wasted.
Every failure of these collectives is a ``parallel.CollectiveError`` naming the reduction and rank.
A DTensor parameter (an expert weight sharded over ``ep``) is reduced through its local shard
over the group of ranks holding the same shard, and its gradient stays a DTensor.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from foundation.compat import queue_backward_callback
from parallel.errors import collective_guard

_UNUSED, _DENSE, _SPARSE = 0, 1, 2
FIRST_BUCKET_BYTES = 2**20
_WHAT = "DataParallel gradient all_reduce"


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _like_param(reduced: torch.Tensor, p: nn.Parameter) -> torch.Tensor:
    """``reduced`` (flat, local) shaped as ``p``'s gradient: a DTensor for a DTensor ``p``."""
    local = reduced.view(_local(p).shape)
    if isinstance(p, DTensor):
        return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False)
    return local


@dataclasses.dataclass
class _Bucket:
    params: list[nn.Parameter]
    offsets: list[int]
    buffer: torch.Tensor  # gradients, then a used flag and a sparse flag per parameter
    numel: int  # gradient elements
    ready: int = 0
    work: dist.Work | None = None

    def flags(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(used, sparse) flag slots, one per parameter."""
        n = len(self.params)
        return (self.buffer[self.numel:self.numel + n], self.buffer[self.numel + n:])


def _make_buckets(params: list[nn.Parameter], cap_bytes: int) -> list[_Bucket]:
    groups: dict[tuple[torch.device, torch.dtype], list[list[nn.Parameter]]] = {}
    for p in reversed(params):
        chunks = groups.setdefault((p.device, p.dtype), [[]])
        size = sum(_local(q).numel() for q in chunks[-1]) * p.element_size()
        # the first bucket is small (DDP's 1 MiB): the last layers' gradients go on the wire
        # while backward still computes the rest
        cap = min(cap_bytes, FIRST_BUCKET_BYTES) if len(chunks) == 1 else cap_bytes
        if chunks[-1] and size + _local(p).numel() * p.element_size() > cap:
            chunks.append([])
        chunks[-1].append(p)
    buckets = []
    for (device, dtype), chunks in groups.items():
        for chunk in chunks:
            offsets, total = [], 0
            for p in chunk:
                offsets.append(total)
                total += _local(p).numel()
            buffer = torch.zeros(total + 2 * len(chunk), dtype=dtype, device=device)
            buckets.append(_Bucket(chunk, offsets, buffer, total))
    return buckets


class GradReducer:
    """Averages (or sums) the gradients of ``params`` over ``group`` during backward."""

    def __init__(self, params: Iterable[nn.Parameter], *, mean: bool, cap_bytes: int,
                 group: dist.ProcessGroup | None, sparse_params: Iterable[nn.Parameter] = ()
                 ) -> None:
        self.params = [p for p in params if p.requires_grad]
        self.loose = {id(p) for p in sparse_params}  # reduced one by one, outside the buckets
        self.group = group
        self.world = dist.get_world_size(group)
        self.mean = mean
        self.enabled = True
        self.buckets = _make_buckets([p for p in self.params if id(p) not in self.loose],
                                     cap_bytes)
        self.bucket_of = {id(p): (b, i) for b in self.buckets for i, p in enumerate(b.params)}
        self.index = {id(p): i for i, p in enumerate(self.params)}
        self.handles = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self.params]
        self._reset()

    def _reset(self) -> None:
        self.armed = False
        self.next_launch = 0
        self.status = torch.zeros(len(self.params), dtype=torch.uint8)  # this rank's view
        for bucket in self.buckets:
            bucket.ready, bucket.work = 0, None

    def _on_grad(self, param: nn.Parameter) -> None:
        if not self.enabled:
            return
        if not self.armed:
            self.armed = True
            queue_backward_callback(self._finish)
        sparse = param.grad is not None and param.grad.is_sparse
        self.status[self.index[id(param)]] = _SPARSE if sparse else _DENSE
        if id(param) in self.bucket_of:
            self.bucket_of[id(param)][0].ready += 1
            with collective_guard(_WHAT, self.group):
                self._launch_ready()

    def _launch_ready(self, force: bool = False) -> None:
        while self.next_launch < len(self.buckets):
            bucket = self.buckets[self.next_launch]
            if not force and bucket.ready < len(bucket.params):
                return
            used, sparse = bucket.flags()
            for j, (p, offset) in enumerate(zip(bucket.params, bucket.offsets, strict=True)):
                slot = bucket.buffer[offset:offset + _local(p).numel()]
                if p.grad is None or p.grad.is_sparse:
                    slot.zero_()  # reduced separately (sparse) or contributes nothing (unused)
                elif _local(p.grad).data_ptr() != slot.data_ptr():  # else: accumulated in place
                    slot.copy_(_local(p.grad).reshape(-1))
                used[j] = float(p.grad is not None)
                sparse[j] = float(p.grad is not None and p.grad.is_sparse)
            if self.mean:
                bucket.buffer.div_(self.world)
            bucket.work = dist.all_reduce(bucket.buffer, group=self.group, async_op=True)
            self.next_launch += 1

    def _finish(self) -> None:
        """End of backward: launch what is left, wait, write gradients back, reduce the rest."""
        with collective_guard(_WHAT, self.group):
            self._reduce_all()
        self._reset()

    def reduce_accumulated(self) -> None:
        """Reduce the gradients already accumulated (backward passes ran with the hooks
        disabled), as the end of a hooked backward would."""
        for i, p in enumerate(self.params):
            self.status[i] = (_UNUSED if p.grad is None else
                              _SPARSE if p.grad.is_sparse else _DENSE)
        self._finish()

    def _reduce_all(self) -> None:
        self._launch_ready(force=True)
        anywhere = torch.zeros(len(self.params), dtype=torch.uint8)  # usage over all ranks
        if self.loose:  # the same on every rank: their usage needs a collective of its own
            loose = torch.tensor([s if id(p) in self.loose else 0
                                  for p, s in zip(self.params, self.status.tolist(), strict=True)],
                                 dtype=torch.uint8)
            dist.all_reduce(loose, op=dist.ReduceOp.MAX, group=self.group)
            anywhere = torch.maximum(anywhere, loose)
        for bucket in self.buckets:
            bucket.work.wait()
            used, sparse = (f.cpu() > 0 for f in bucket.flags())
            for j, (p, offset) in enumerate(zip(bucket.params, bucket.offsets, strict=True)):
                i = self.index[id(p)]
                anywhere[i] = _SPARSE if sparse[j] else _DENSE if used[j] else _UNUSED
                if anywhere[i] != _DENSE:
                    continue
                reduced = _like_param(bucket.buffer[offset:offset + _local(p).numel()], p)
                if reduced.dtype == p.dtype:
                    # the gradient becomes a view of its bucket slot (DDP's
                    # gradient_as_bucket_view): no copy back now, and none in next time when
                    # backward accumulates into it
                    p.grad = reduced
                elif p.grad is None:  # recast since the buckets were made (OffloadAdamW's bf16)
                    p.grad = reduced.to(p.dtype)
                else:
                    p.grad.copy_(reduced)
        for i in anywhere.nonzero().flatten().tolist():  # in parameter order on every rank
            p = self.params[i]
            if anywhere[i] == _SPARSE:
                self._reduce_sparse(p)
            elif id(p) in self.loose:
                self._reduce_loose_dense(p)

    def _reduce_loose_dense(self, p: nn.Parameter) -> None:
        grad = p.grad if p.grad is not None else torch.zeros_like(p)
        grad = grad / self.world if self.mean else grad.clone()
        dist.all_reduce(grad, group=self.group)
        p.grad = grad

    def _reduce_sparse(self, p: nn.Parameter) -> None:
        grad = p.grad
        if grad is None:
            grad = torch.sparse_coo_tensor(torch.empty(p.dim(), 0, dtype=torch.long),
                                           torch.empty(0, *p.shape[1:], dtype=p.dtype),
                                           p.shape, device=p.device)
        elif not grad.is_sparse:
            grad = grad.to_sparse(sparse_dim=1)
        grad = grad.coalesce()
        if self.mean:
            grad = grad / self.world
        dist.all_reduce(grad, group=self.group)
        p.grad = grad.coalesce()

    def remove(self) -> None:
        """Detach the hooks (the wrapper is being discarded)."""
        for handle in self.handles:
            handle.remove()
