"""Optimizer parallel without FSDP2: whole weights for forward and backward, ``Shard(0)``
slices for the optimizer (ZeRO-1/2 as torch's ``ZeroRedundancyOptimizer`` and DeepSpeed's
stages 1-2 do them; level3 on gloo builds on this in :mod:`.resharded`).

Only where gathers run chunkwise (gloo groups: ``backends.py`` chooses). Why not FSDP2 there:
FSDP2 gathers every unit's weights in its forward and reduce-scatters every unit's gradients in
its backward, with a copy into and out of each collective's buffer; where the device has no side
streams to hide them on (the host, gloo) all of it is exposed, and level1/level2 stepped at 1.5x
a data-parallel step (``benchmarks/optimizer_parallel.py``). On NCCL or HCCL FSDP2's side streams
hide those copies and its per-unit reduce-scatter moves half an all-reduce's bytes, so level1/2
run there. Neither level frees weights between uses, so neither
needs per-unit collectives: gradients are reduced in DDP's buckets while backward runs
(:class:`parallel.data.grad_reducer.GradReducer` in keep mode), each rank updates its slice, and the
updated slices are all-gathered once before the next forward (in place for tensors whose rows
split evenly, packed per bucket otherwise).

How the pieces stay one model. Each sharded parameter has two faces:

* the *whole* tensor: the module's original ``nn.Parameter`` (the reducer's hooks sit on it);
  it is registered in its modules while a step's forward and backward run;
* the *slice*: an ``nn.Parameter`` holding a ``Shard(0)`` DTensor whose local tensor is a view of
  the whole tensor's rows on this rank; it is registered at rest — so ``parameters()``, the
  optimizer, ``state_dict``, DCP checkpoints and clipping see the same ``Shard(0)`` DTensors
  FSDP2 gives, in the same layout (torch.chunk rows).

An optimizer step writes the slice in place, i.e. this rank's rows of the whole tensor; the next
forward all-gathers every rank's rows into the whole tensors (:meth:`WholeWeights.enter`), also
after a checkpoint load, which writes the slices. The gradients are ZeRO-2's: each bucket is
filled into one of two persistent scratch buffers (reused by every bucket and step, as DeepSpeed
reuses its reduce buckets), each whole gradient is let go of once copied in, and after the
bucket's reduction only this rank's rows are copied out (:meth:`WholeWeights.keep_rows`). On a
1-D mesh that reduction is a reduce-scatter of the rows by exchange
(:meth:`WholeWeights.scatter_bucket`: each rank's rows summed on it alone, half an all-reduce's
bytes), on replicas an all-reduce. At the end of a reduced backward
(:meth:`WholeWeights.leave`) the rows become the slices' gradients (added to ones already there:
accumulation without ``zero_grad`` works) and the slices are registered again. So gradient
memory is the slices plus a scratch of at most two buckets, and nothing is allocated per step but
the rows. Level2 reduces every micro-batch (``no_sync`` included); level1's ``no_sync``
micro-batches accumulate whole gradients without communicating, reduced once at the last.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from foundation.compat import all_gather_single
from parallel.errors import collective_guard
from parallel.optimizer_parallel.chunkwise import RangeReduce, broadcast_chunks

_WHAT = "optimizer parallel (levels 1-2) weight all_gather"


@dataclasses.dataclass(eq=False)  # compared by identity
class _Pair:
    whole: nn.Parameter
    part: nn.Parameter  # the Shard(0) slice
    slots: list[tuple[nn.Module, str]]  # every (module, name) registering it (ties: several)
    name: str
    flat_rows: list[tuple[int, int]]  # per shard rank: its [start, end) in the flattened whole


def _rows(length: int, ranks: int) -> list[tuple[int, int]]:
    """Each rank's rows of a dimension of ``length`` under ``Shard(0)`` (torch.chunk's split,
    as DTensor and FSDP2 cut it: the last ranks may hold fewer or none)."""
    size = -(-length // ranks)
    return [(min(r * size, length), min((r + 1) * size, length)) for r in range(ranks)]


class WholeWeights:
    """The whole/slice faces of ``params`` (module docstring), over ``mesh``'s last dim."""

    def __init__(self, model: nn.Module, params: list[nn.Parameter], mesh: DeviceMesh,
                 level: str, cap_bytes: int = 25 * 2**20) -> None:
        self.level = level
        self.mesh = mesh
        self.group = mesh.get_group(mesh.ndim - 1)
        self.ranks = mesh.shape[-1]
        self.rank = mesh.get_local_rank(mesh.ndim - 1)
        self.placements = (*[Replicate()] * (mesh.ndim - 1), Shard(0))
        ids = {id(p) for p in params}
        slots: dict[int, list[tuple[nn.Module, str]]] = {}
        for module in model.modules():
            for name, p in module._parameters.items():
                if p is not None and id(p) in ids:
                    slots.setdefault(id(p), []).append((module, name))
        names = {id(p): n for n, p in model.named_parameters()}
        self.pairs = [self._pair(p, slots[id(p)], names[id(p)]) for p in params]
        self._pair_of = {id(pair.whole): pair for pair in self.pairs}
        # evenly split, contiguous tensors are gathered in place; the rest packed in buckets
        self.even = [pair for pair in self.pairs if pair.whole.shape[0] % self.ranks == 0
                     and pair.whole.is_contiguous()]
        self.buckets = self._buckets([pair for pair in self.pairs if pair not in self.even],
                                     cap_bytes)
        self.at_rest = False
        self.leave()
        # on the model itself, as FSDP2's are: calling the inner model (not the wrapper) works
        self.hooks = [model.register_forward_pre_hook(lambda *_: self.enter()),
                      model.register_forward_hook(lambda _m, _a, out: self._after_forward(out))]

    def _after_forward(self, output: Any) -> None:
        if not torch.is_grad_enabled():  # no backward follows: the slices registered again
            self.leave()

    def _pair(self, whole: nn.Parameter, slots: list[tuple[nn.Module, str]], name: str
              ) -> _Pair:
        rows = _rows(whole.shape[0], self.ranks)
        start, end = rows[self.rank]
        local = whole.detach()[start:end]  # a view: the optimizer's writes land in ``whole``
        part = nn.Parameter(self._dtensor(local, whole), requires_grad=whole.requires_grad)
        per_row = whole[0].numel() if whole.shape[0] else 0
        return _Pair(whole, part, slots, name, [(a * per_row, b * per_row) for a, b in rows])

    def _dtensor(self, local: torch.Tensor, like: torch.Tensor) -> DTensor:
        return DTensor.from_local(local, self.mesh, self.placements, run_check=False,
                                  shape=like.shape, stride=like.stride())

    @staticmethod
    def _buckets(pairs: list[_Pair], cap_bytes: int) -> list[list[_Pair]]:
        """Pairs grouped for one all-gather each: same device and dtype, up to ``cap_bytes``."""
        groups: dict[tuple[torch.device, torch.dtype], list[list[_Pair]]] = {}
        for pair in pairs:
            chunks = groups.setdefault((pair.whole.device, pair.whole.dtype), [[]])
            size = sum(p.whole.nbytes for p in chunks[-1])
            if chunks[-1] and size + pair.whole.nbytes > cap_bytes:
                chunks.append([])
            chunks[-1].append(pair)
        return [chunk for chunks in groups.values() for chunk in chunks]

    def _register(self, whole: bool) -> None:
        for pair in self.pairs:
            face = pair.whole if whole else pair.part
            for module, name in pair.slots:
                module._parameters[name] = face

    def enter(self) -> None:
        """Before a forward: gather the updated rows and register the whole tensors (nothing
        when they are registered already: a forward after a ``no_sync`` backward)."""
        if not self.at_rest:
            return
        self._check_views()
        with torch.no_grad(), collective_guard(_WHAT, self.group):
            works = [work for pair in self.even for work in self._gather_in_place(pair)]
            for bucket in self.buckets:
                self._all_gather(bucket)
            for work in works:
                work.wait()
        self._register(whole=True)
        self.at_rest = False

    def _check_views(self) -> None:
        """RuntimeError naming the parameter whose slice no longer views its whole tensor's
        rows (its ``.data`` was replaced, e.g. recast to another dtype): the optimizer's updates
        would never reach the weights the model computes with."""
        for pair in self.pairs:
            local, whole = pair.part.to_local(), pair.whole
            a, _ = pair.flat_rows[self.rank]
            if local.numel() and (local.dtype != whole.dtype or local.data_ptr() !=
                                  whole.data_ptr() + a * whole.element_size()):
                raise RuntimeError(
                    f"ShardedDataParallel(level={self.level}): "
                    f"the slice of {pair.name} no longer views its whole weight (its .data was "
                    f"replaced, dtype now {local.dtype}, weight {whole.dtype}); slices are updated "
                    f"in place. For 16-bit weights give ShardedDataParallel(param_dtype=...)")

    def _gather_in_place(self, pair: _Pair) -> list[dist.Work]:
        """A tensor whose rows split evenly: its flattened whole tensor is the all-gather's
        output as it stands (rank r's rows at r's place), so no buffer and no copy: one
        broadcast per rank's rows (``chunkwise``)."""
        flat = pair.whole.detach().view(-1)
        a, b = pair.flat_rows[self.rank]
        return broadcast_chunks(flat, flat[a:b], self.group)

    def _all_gather(self, bucket: list[_Pair]) -> None:
        """Every rank's rows of the bucket's tensors, by one ``all_gather_single``: each
        rank packs its rows (padded to the largest rank's count) into its part of a flat buffer,
        and the others' parts are copied into their rows of the whole tensors."""
        sizes = [max(b - a for a, b in pair.flat_rows) for pair in bucket]
        per_rank = sum(sizes)
        first = bucket[0].whole
        send = torch.empty(per_rank, dtype=first.dtype, device=first.device)
        out = torch.empty(per_rank * self.ranks, dtype=first.dtype, device=first.device)
        offset = 0
        for pair, size in zip(bucket, sizes, strict=True):
            a, b = pair.flat_rows[self.rank]
            send[offset:offset + b - a].copy_(pair.whole.detach().view(-1)[a:b])
            offset += size
        all_gather_single(out, send, group=self.group)
        for r in range(self.ranks):
            if r == self.rank:
                continue
            offset = r * per_rank
            for pair, size in zip(bucket, sizes, strict=True):
                a, b = pair.flat_rows[r]
                pair.whole.detach().view(-1)[a:b].copy_(out[offset:offset + b - a])
                offset += size

    def keep_rows(self, whole: nn.Parameter, reduced: torch.Tensor) -> torch.Tensor:
        """Level2's reducer ``keep``: this rank's rows of ``whole``'s flat, reduced gradient
        (in the reducer's scratch), copied out before the scratch takes the next bucket."""
        pair = self._pair_of[id(whole)]
        a, b = pair.flat_rows[self.rank]
        return reduced[a:b].view(pair.part.to_local().shape).clone()

    def scatter_bucket(self, buffer: torch.Tensor, params: list[nn.Parameter],
                       offsets: list[int]) -> RangeReduce:
        """Level1-3's bucket reduction on a 1-D mesh: each rank's rows of each of the
        bucket's gradients (``params`` at ``offsets`` in the flat ``buffer``) summed on that rank
        only (:class:`~.chunkwise.RangeReduce`), which is all :meth:`keep_rows` reads."""
        ranges = [[(offset + self._pair_of[id(p)].flat_rows[r][0],
                    offset + self._pair_of[id(p)].flat_rows[r][1])
                   for p, offset in zip(params, offsets, strict=True)] for r in range(self.ranks)]
        return RangeReduce(buffer, ranges, self.group)

    def leave(self, rows: dict[int, torch.Tensor] | None = None) -> None:
        """Register the slices again; after a reduced backward, ``rows`` (the reducer's
        :meth:`keep_rows`, per ``id`` of the whole tensor) become the slices' gradients (added
        to ones already there: accumulation without ``zero_grad`` works)."""
        for pair in self.pairs if rows is not None else ():
            mine = rows.get(id(pair.whole))
            if mine is None:
                continue
            if pair.part.grad is None:
                pair.part.grad = self._dtensor(mine, pair.whole)
            else:
                pair.part.grad.to_local().add_(mine)
        self._register(whole=False)
        self.at_rest = True
