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
more then. The hooks of host parameters run on autograd's CPU thread and those of device
parameters on the device thread, so the bookkeeping is under a lock: each bucket is launched once
and the step finished once.

Which parameters got a gradient (and which a row-sparse one) is kept on the host, and one small
MAX all_reduce of that per step (over the group's host backend) tells every rank which were used,
and which were sparse, anywhere: nothing is written into or read back from the device buckets for
this. It is issued right after the last bucket, so it runs beside the buckets' reductions rather
than after them, where it added a blocking round trip to every step (docs/benchmarks.md). Where
the last bucket is on the host in FP32 and every parameter is bucketed, the flags ride in a tail
of that bucket instead, summed with it (``_flag_bucket``): no collective of their own.
Gradients are multiplied by 1 / world size as they are copied into the buckets, as DDP scales
them (on two ranks the results are bit-equal to torch DDP's; on more, gloo's ring sums each
element in an order that depends on its offset in the bucket, and DDP lays its buckets out
otherwise, so they differ in the last bit), and parameters unused on every rank keep
``grad = None``.

Buckets follow the parameters' dtype: when the model was recast after wrapping (OffloadAdamW
casts it to bf16), the next step re-buckets, so the gradients travel in their own dtype.

Row-sparse gradients are reduced as sparse tensors: by the backend's sparse all_reduce where it has
one (gloo), else (NCCL, HCCL) by all-gathering every rank's indices and values and summing them in
rank order, as gloo does — the same result. Parameters declared sparse up front
(``sparse_params``: embedding tables with ``sparse=True``) get no bucket slot, so a huge table
costs only its touched rows on the wire. A parameter whose gradient turns out sparse anyway is
still reduced correctly, its slot just wasted. Every failure of these collectives is a
``parallel.CollectiveError`` naming the reduction and rank. A DTensor parameter (an expert weight
sharded over ``ep``) is reduced through its local shard over the group of ranks holding the same
shard, and its gradient stays a DTensor.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from foundation import device as hd
from foundation.collective_check import check as check_collective
from foundation.compat import queue_backward_callback
from foundation.weak_hooks import weak_hook
from parallel.data.sparse_grads import empty_row_sparse, reduce_sparse
from parallel.errors import collective_guard

_UNUSED, _DENSE, _SPARSE = 0, 1, 2  # a parameter's state in a step; over ranks the largest wins
FIRST_BUCKET_BYTES = 2**20
#: scratch buffers per (device, dtype) in ``keep`` mode: one bucket fills while one is in flight
SCRATCH_SLOTS = 2
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
    buffer: torch.Tensor | None  # the gradients, flat (keep mode: its scratch slot, else None)
    numel: int
    dtype: torch.dtype
    device: torch.device
    slot: int = 0  # keep mode: the scratch buffer it fills (its index in its group, mod slots)
    ready: int = 0
    work: dist.Work | None = None


def _make_buckets(params: list[nn.Parameter], cap_bytes: int, own_buffers: bool = True
                  ) -> list[_Bucket]:
    groups: dict[tuple[torch.device, torch.dtype], list[list[nn.Parameter]]] = {}
    for p in reversed(params):
        chunks = groups.setdefault((p.device, p.dtype), [[]])
        chunks[-1].append(p)
        size = sum(_local(q).numel() for q in chunks[-1]) * p.element_size()
        # a bucket closes once it holds its cap, as DDP's do; the first one's is small (DDP's
        # 1 MiB), so the last layer's gradients go on the wire while backward computes the
        # rest (a cap checked before adding would leave a layer's bias alone in it)
        if size >= (min(cap_bytes, FIRST_BUCKET_BYTES) if len(chunks) == 1 else cap_bytes):
            chunks.append([])
    for chunks in groups.values():
        if not chunks[-1]:
            chunks.pop()
    buckets = []
    for (device, dtype), chunks in groups.items():
        for index, chunk in enumerate(chunks):
            offsets, total = [], 0
            for p in chunk:
                offsets.append(total)
                total += _local(p).numel()
            buffer = torch.zeros(total, dtype=dtype, device=device) if own_buffers else None
            buckets.append(_Bucket(chunk, offsets, buffer, total, dtype, device,
                                   slot=index % SCRATCH_SLOTS))
    return buckets


def _fill(bucket: _Bucket, scale: float | None, drop: bool = False) -> None:
    """Put the bucket's gradients in its buffer, times ``scale`` (1 / world for a mean; None:
    as they are): zeros for a parameter with none here (unused) or a sparse one (reduced on its
    own). The scaling is the copy itself (DDP's ``mul_out`` into the bucket view: one pass over
    the gradient, not a copy and then a division of the whole bucket), by the reciprocal as DDP
    scales.
    Device-side only: nothing goes through the host. ``drop``: a dense gradient copied in is let
    go of at once (keep mode: the whole gradient lives on only in the bucket's scratch)."""
    for p, offset in zip(bucket.params, bucket.offsets, strict=True):
        slot = bucket.buffer[offset:offset + _local(p).numel()]
        if p.grad is None or p.grad.is_sparse:
            slot.zero_()
            continue
        grad = _local(p.grad)
        if grad.data_ptr() == slot.data_ptr():  # accumulated in place (a view of the slot)
            if scale is not None:
                slot.mul_(scale)
        elif scale is not None:
            torch.mul(grad.reshape(-1), scale, out=slot)
        else:
            slot.copy_(grad.reshape(-1))
        if drop:
            p.grad = None


class GradReducer:
    """Averages (or sums) the gradients of ``params`` over ``group`` during backward.

    ``sparse_gather``: how row-sparse gradients are summed — True: all-gather the ranks' indices
    and values (what NCCL and HCCL need: they have no sparse all_reduce); False: the backend's
    sparse all_reduce; None (default): the backend's where it has one.

    keep: ZeRO-2's gradient memory (optimizer parallel level2 keeps only its slices:
    ``whole_weights.py``). The buckets own no buffers: each is filled into one of
    ``SCRATCH_SLOTS`` persistent scratch buffers per (device, dtype), made once and reused by
    every bucket and step (DeepSpeed's reused reduce buckets), and a gradient is let go of
    (``grad = None``) once copied in. Before a scratch buffer takes the next bucket, the one in it
    is waited for and ``keep(param, reduced)`` (``reduced``: the parameter's flat, reduced
    gradient in the scratch) returns what of it outlives the reduction (this rank's rows,
    copied); when ``on_reduced`` runs, :attr:`kept` maps ``id(param)`` to it for the parameters
    with a dense gradient on some rank, and no gradient is written back to the parameters. No
    whole gradient outlives its bucket's reduction, and nothing is allocated per step but what
    ``keep`` returns. ``reduce_bucket(buffer, params, offsets)``, in keep mode, replaces the
    bucket's all-reduce by a reduction returning a ``Work``-like object: one that leaves only
    what ``keep`` reads correct (a reduce-scatter of the rows kept: ``whole_weights.py``).
    """

    def __init__(self, params: Iterable[nn.Parameter], *, mean: bool, cap_bytes: int,
                 group: dist.ProcessGroup | None, sparse_params: Iterable[nn.Parameter] = (),
                 sparse_gather: bool | None = None,
                 keep: Callable[[nn.Parameter, torch.Tensor], torch.Tensor] | None = None,
                 reduce_bucket: Callable[[torch.Tensor, list[nn.Parameter], list[int]],
                                         dist.Work] | None = None) -> None:
        if not (sparse_gather is None or isinstance(sparse_gather, bool)):
            raise TypeError(f"GradReducer: sparse_gather must be True, False or None (ask the "
                            f"backend), got {sparse_gather!r}")
        self.params = [p for p in params if p.requires_grad]
        self.loose = {id(p) for p in sparse_params}  # reduced one by one, outside the buckets
        self.group = group
        self.world = dist.get_world_size(group)
        self.mean = mean
        self.enabled = True
        self.keep = keep
        self.reduce_bucket = reduce_bucket if keep is not None else None
        #: keep mode: what ``keep`` returned, per ``id(param)``, for ``on_reduced`` to take
        self.kept: dict[int, torch.Tensor] = {}
        #: called at the end of every reduction, gradients in place (whole_weights.py's hand-off)
        self.on_reduced: Callable[[], None] | None = None
        self.cap_bytes = cap_bytes
        self.sparse_gather = sparse_gather
        self._gathers: dict[str, bool] = {}  # device type -> sparse by all-gather there
        self._lock = threading.Lock()  # hooks run on autograd's CPU and device threads
        self._bucketed = [p for p in self.params if id(p) not in self.loose]
        self._build_buckets()
        self.index = {id(p): i for i, p in enumerate(self.params)}
        on_grad = weak_hook(self._on_grad)  # a strong one would keep the model's groups alive
        self.handles = [p.register_post_accumulate_grad_hook(on_grad) for p in self.params]
        self._reset()

    def _build_buckets(self) -> None:
        """(Re)make the buckets for the bucketed parameters' devices and dtypes now."""
        self.buckets = _make_buckets(self._bucketed, self.cap_bytes,
                                     own_buffers=self.keep is None)
        self.bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self._bucket_placements = [(p.device, p.dtype) for p in self._bucketed]
        # keep mode: each scratch buffer as large as the largest bucket it takes
        sizes: dict[tuple[torch.device, torch.dtype, int], int] = {}
        for b in self.buckets if self.keep is not None else ():
            key = (b.device, b.dtype, b.slot)
            sizes[key] = max(sizes.get(key, 0), b.numel)
        self._scratch = {key: torch.empty(n, dtype=key[1], device=key[0])
                         for key, n in sizes.items()}
        self._in_scratch: dict[tuple[torch.device, torch.dtype, int], _Bucket] = {}
        self._flags_in = self._flag_bucket()

    def _flag_bucket(self) -> _Bucket | None:
        """The bucket that carries the usage flags in a tail of its own buffer, or None (they
        travel in their own small all_reduce). The last bucket launched carries them when every
        parameter has reported by its launch (no loose ones), when it sums on the host in FP32
        (exact for the counts) and when it is all-reduced whole (not keep mode's reduction): one
        collective a step fewer, which shows where ranks share cores (issue 45)."""
        last = self.buckets[-1] if self.buckets else None
        if (last is None or self.keep is not None or self.loose or last.device.type != "cpu"
                or last.dtype != torch.float32 or self.world >= 2**12):
            return None
        assert last.buffer is not None
        last.buffer = torch.cat([last.buffer, last.buffer.new_zeros(len(self.params))])
        return last

    def _follow_params(self) -> None:
        """Re-bucket when parameters were recast or moved since the buckets were made, so their
        gradients travel in their own dtype and are reduced where they are: OffloadAdamW casts
        the model to bf16 after it is wrapped (not twice the bytes, cast every step), and
        parameter offload (``hetero.offload.ParamOffload``) rests a pipeline stage's weights,
        and lands their gradients, on the host after the stage was wrapped (device buckets
        would bring them back, and leave device gradients on host weights). Every rank changes
        alike: the new buckets match across ranks. Call at the start of a step, before any
        bucket is launched."""
        if [(p.device, p.dtype) for p in self._bucketed] != self._bucket_placements:
            self._build_buckets()

    def _reset(self) -> None:
        self.armed = False
        self.next_launch = 0
        self._usage: tuple[torch.Tensor, dist.Work] | None = None  # the flags' exchange
        self.status = bytearray(len(self.params))  # this rank's view: _UNUSED/_DENSE/_SPARSE
        for bucket in self.buckets:
            bucket.ready, bucket.work = 0, None
            if self.keep is not None:
                bucket.buffer = None
        self._in_scratch = {}

    def _on_grad(self, param: nn.Parameter) -> None:
        if not self.enabled:
            return
        sparse = param.grad is not None and param.grad.is_sparse
        with self._lock:
            if not self.armed:  # the first gradient of this backward
                self.armed = True
                self._follow_params()
                queue_backward_callback(self._finish)
            self.status[self.index[id(param)]] = _SPARSE if sparse else _DENSE
            bucket = self.bucket_of.get(id(param))
            if bucket is not None:
                bucket.ready += 1
                with collective_guard(_WHAT, self.group):
                    self._launch_ready()

    def _launch_ready(self, force: bool = False) -> None:
        """Launch, in bucket order, the buckets that are full (all, with ``force``). Called with
        the lock held: a bucket is launched once, whichever thread fills it."""
        while self.next_launch < len(self.buckets):
            bucket = self.buckets[self.next_launch]
            if not force and bucket.ready < len(bucket.params):
                return
            if self.keep is not None:
                self._take_scratch(bucket)
            _fill(bucket, 1.0 / self.world if self.mean else None, drop=self.keep is not None)
            if bucket is self._flags_in:  # every parameter has reported: the flags are final
                self._write_flags(bucket)
            check_collective("all_reduce", bucket.buffer, self.group, what=_WHAT)
            bucket.work = (self.reduce_bucket(bucket.buffer, bucket.params, bucket.offsets)
                           if self.reduce_bucket is not None else
                           dist.all_reduce(bucket.buffer, group=self.group, async_op=True))
            self.next_launch += 1
        if (self.buckets and self.next_launch == len(self.buckets) and self._usage is None
                and not self.loose and self._flags_in is None):
            # every bucketed parameter has reported (a bucket launches only once all of its
            # have, and buckets launch in order), and there are no loose ones to wait for: the
            # flags are final, so their exchange runs beside the buckets' instead of after them
            self._usage = self._issue_usage()

    def _take_scratch(self, bucket: _Bucket) -> None:
        """Keep mode: ``bucket``'s scratch buffer, once the bucket in it has been reduced and
        what ``keep`` takes of it copied out."""
        key = (bucket.device, bucket.dtype, bucket.slot)
        before = self._in_scratch.get(key)
        if before is not None:
            self._retire(before)
        bucket.buffer = self._scratch[key][:bucket.numel]
        self._in_scratch[key] = bucket

    def _retire(self, bucket: _Bucket) -> None:
        """Keep mode: wait for ``bucket``'s reduction and keep what outlives it."""
        bucket.work.wait()
        for p, offset in zip(bucket.params, bucket.offsets, strict=True):
            self.kept[id(p)] = self.keep(p, bucket.buffer[offset:offset + _local(p).numel()])
        bucket.buffer = None
        del self._in_scratch[(bucket.device, bucket.dtype, bucket.slot)]

    def _finish(self) -> None:
        """End of backward: reduce what is left, once (whichever thread's callback runs)."""
        with self._lock:
            if self.armed:
                self._complete()

    def _complete(self) -> None:
        """Launch what is left, wait, write gradients back, reduce the rest; then reset."""
        with collective_guard(_WHAT, self.group):
            self._reduce_all()
        self._reset()
        if self.on_reduced is not None:
            self.on_reduced()
        self.kept = {}

    def reduce_accumulated(self) -> None:
        """Reduce the gradients already accumulated (backward passes ran with the hooks
        disabled), as the end of a hooked backward would."""
        with self._lock:
            self._follow_params()
            for i, p in enumerate(self.params):
                self.status[i] = (_UNUSED if p.grad is None else
                                  _SPARSE if p.grad.is_sparse else _DENSE)
            self._complete()

    def _issue_usage(self) -> tuple[torch.Tensor, dist.Work]:
        """Start the exchange of each parameter's state over all ranks (unused < dense < sparse:
        the largest wins), one small MAX all_reduce on the host: flags in the device buckets
        would cost host writes per parameter and a blocking read per bucket every step. Every
        rank issues it at the same point, right after its last bucket."""
        usage = torch.frombuffer(self.status, dtype=torch.uint8).clone()
        check_collective("all_reduce", usage, self.group, what=f"{_WHAT} (usage flags)")
        return usage, dist.all_reduce(usage, op=dist.ReduceOp.MAX, group=self.group,
                                      async_op=True)

    def _write_flags(self, bucket: _Bucket) -> None:
        """This rank's flags into ``bucket``'s tail, for the sum over ranks: 1 for a dense
        gradient, world + 1 for a sparse one (any sum past world means sparse somewhere)."""
        flags = torch.frombuffer(self.status, dtype=torch.uint8).to(torch.float32)
        flags[flags == _SPARSE] = self.world + 1
        assert bucket.buffer is not None
        bucket.buffer[bucket.numel:].copy_(flags)

    def _usage_everywhere(self) -> list[int]:
        """Each parameter's state over all ranks, from the exchange issued after the last bucket
        (or now, where loose parameters kept it from starting earlier), or from the flags that
        rode in the last bucket."""
        if not self.params:
            return []
        if self._flags_in is not None:
            bucket = self._flags_in
            assert bucket.work is not None and bucket.buffer is not None
            bucket.work.wait()
            summed = bucket.buffer[bucket.numel:]
            return torch.where(summed > self.world + 0.5, _SPARSE,
                               torch.where(summed > 0.5, _DENSE, _UNUSED)).tolist()
        usage, work = self._usage if self._usage is not None else self._issue_usage()
        work.wait()
        return usage.tolist()

    def _reduce_all(self) -> None:
        self._launch_ready(force=True)
        anywhere = self._usage_everywhere()
        if self.keep is not None:
            self._keep_reduced(anywhere)
        else:
            self._write_back(anywhere)
        for i, state in enumerate(anywhere):  # in parameter order on every rank
            p = self.params[i]
            if state == _SPARSE:
                self._reduce_sparse(p)
            elif state == _DENSE and id(p) in self.loose:
                self._reduce_loose_dense(p)

    def _keep_reduced(self, anywhere: list[int]) -> None:
        """Keep mode: retire the buckets still in scratch; keep what was kept for the
        parameters with a dense gradient on some rank."""
        for bucket in self.buckets:
            if bucket.buffer is not None:  # still in its scratch buffer
                self._retire(bucket)
        self.kept = {i: kept for i, kept in self.kept.items()
                     if anywhere[self.index[i]] == _DENSE}

    def _write_back(self, anywhere: list[int]) -> None:
        """Each dense gradient becomes its reduced bucket slot."""
        for bucket in self.buckets:
            bucket.work.wait()
            for p, offset in zip(bucket.params, bucket.offsets, strict=True):
                if anywhere[self.index[id(p)]] != _DENSE:
                    continue  # unused everywhere (grad stays None) or sparse somewhere
                reduced = _like_param(bucket.buffer[offset:offset + _local(p).numel()], p)
                if reduced.dtype == p.dtype:
                    # the gradient becomes a view of its bucket slot (DDP's
                    # gradient_as_bucket_view): no copy back now, and none in next time when
                    # backward accumulates into it
                    p.grad = reduced
                elif p.grad is None:  # recast in the middle of a step: cast back
                    p.grad = reduced.to(p.dtype)
                else:
                    p.grad.copy_(reduced)

    def _reduce_loose_dense(self, p: nn.Parameter) -> None:
        grad = p.grad if p.grad is not None else torch.zeros_like(p)
        grad = grad / self.world if self.mean else grad.clone()
        check_collective("all_reduce", grad, self.group, what=_WHAT)
        dist.all_reduce(grad, group=self.group)
        p.grad = grad

    def _reduce_sparse(self, p: nn.Parameter) -> None:
        device = _local(p).device
        grad = p.grad if p.grad is not None else empty_row_sparse(p.shape, p.dtype, device)
        p.grad = reduce_sparse(grad, self.group, by_gather=self._sparse_by_gather(device),
                               divide_by=self.world if self.mean else None)

    def _sparse_by_gather(self, device: torch.device) -> bool:
        """Whether sparse gradients on ``device`` are summed by all-gathers: as asked, else
        where the group's backend for the device has no sparse all_reduce (NCCL, HCCL)."""
        if self.sparse_gather is not None:
            return self.sparse_gather
        if device.type not in self._gathers:
            backend = hd.group_backend(self.group, device)
            self._gathers[device.type] = not hd.supports_sparse_all_reduce(backend)
        return self._gathers[device.type]

    def remove(self) -> None:
        """Detach the hooks (the wrapper is being discarded)."""
        for handle in self.handles:
            handle.remove()
