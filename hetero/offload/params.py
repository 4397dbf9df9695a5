"""Parameter offload: weights rest in host memory and visit the device one layer at a time.

ZeRO-Infinity's ``offload_param`` and FSDP2's ``CPUOffloadPolicy`` on one process, with a
prefetch. Between steps every parameter of the model *is* a host tensor (FP32, pinned where an
accelerator can use that): ``parameters()``, ``state_dict()``, checkpoints and the optimizer see
the host tensors, so any torch optimizer (or :class:`hetero.optim.OffloadAdamW`, whose slots
are then "in place") steps them in host memory. The device holds only the layers it computes:

* forward: a layer's weights are copied to the device just before it runs
  (``compute_dtype``: cast on the way, FSDP's mixed precision), and the next ``prefetch``
  layers' copies start while it computes (a side stream and events on an accelerator). After
  the layer, its device copies are let go of — except the last layer's, whose backward follows
  at once (torchtitan's rule).
* backward: when the first gradient of a layer's outputs arrives, its weights come back to the
  device and the layer before it starts coming back. As each parameter's gradient is
  accumulated, the gradient is copied to the host (accumulated there in FP32 across
  micro-batches) and the device copy is let go of. At the end of backward what is still on the
  device (the root's frozen weights, a layer whose gradient never came) is let go of too, and
  ``p.grad`` is the host gradient: what the host optimizer reads, without another copy.

How the two faces stay one parameter: the swap is ``param.data = ...`` (what ``Module._apply``
did for years, and FSDP1's flat parameters): the ``nn.Parameter`` object that modules, hooks and
the autograd graph hold stays the same, its version counter too; only its storage moves. A
device copy is a storage of its own, dropped when let go of, so it is freed once nothing else
holds it (a view of the weight that an op saved for backward keeps its storage alive until that
backward: correct values, a little longer residency, never a read of freed memory).

When layers arrive and leave is :mod:`foundation.unit_schedule`'s (shared with optimizer
parallel's level3 gathers); here is how: by copies from and to host memory. The layers are
:func:`foundation.layers.unit_modules`; parameters registered in more than one layer, or
outside every layer (embeddings, final norm, a tied head), belong to the root, which is on the
device from the model's forward until each of its gradients is in. Buffers move to the device
once (they are small and updated in forward).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from foundation import device as hd
from foundation.compat import queue_backward_callback
from foundation.layers import tensors_needing_grad, unit_modules
from foundation.unit_schedule import UnitSchedule, unit_owners
from foundation.weak_hooks import weak_hook
from hetero.offload.host_reduce import average_host_grads
from hetero.offload.mapped_file import MappedFile
from hetero.offload.param_rules import MARK, check_model, host_kept_params, keeps_itself_on_host
from hetero.optim.pinned_chunks import pinned_views


@dataclasses.dataclass(eq=False)
class _Home:
    """One parameter's host tensor, its device copy while it has one, and its gradient's way
    back to the host."""

    param: nn.Parameter
    host: torch.Tensor
    copy: torch.Tensor | None = None  # the device copy, while the parameter has one
    storage_of: torch.Tensor | None = None  # the device copy's tensor, storage freed between
    ready: Any = None  # the event the device copy is complete at (accelerators)
    grad: torch.Tensor | None = None  # the host gradient set aside while backward runs
    arriving: tuple[torch.Tensor, Any] | None = None  # a gradient on its way to the host
    index: int = -1  # the disk tier: its weight's tensor in the file (its gradient's: + count)
    grad_slot: torch.Tensor | None = None  # the disk tier: where its gradient rests


class ParamOffload(UnitSchedule):
    """Keep ``model``'s parameters in host memory between uses (module docstring).

    Args:
        model: built on the host (or the device: its parameters are moved to the host); or the
            modules a pipeline rank runs, one per stage, each entered by its own forward: one
            offload over all of them, so that a weight two of them share (the tied embedding
            and head that torch's zero-bubble V puts on the first rank) has one home.
        device: where the layers compute (``hetero.device`` names; default the accelerator,
            the CPU on a machine without one).
        prefetch: how many layers ahead a copy to the device starts (0: none).
        compute_dtype: the dtype of the device copies (e.g. ``torch.bfloat16``: the host keeps
            FP32 weights and gradients, the device computes in 16 bits); None: the parameters'.
        units: the layers brought to the device one at a time (default
            :func:`foundation.layers.unit_modules`); the rest of the model is the root.
        reduce_group: data parallel over this process group: at the end of each backward
            (outside :meth:`no_sync`) the host gradients are averaged over its ranks, in
            buckets of ``bucket_mb`` (ZeRO-Offload reduces on the host the same way). Each rank
            feeds its own slice of the batch; the weights stay equal on every rank because
            every rank steps the same averaged gradients.
        disk_path: the disk tier: weights and their gradients rest in a scratch file in this
            directory (:class:`~hetero.offload.mapped_file.MappedFile`, one per rank, unlinked
            at once) instead of host memory; a layer's pages are read ahead with its device
            copy and let go of with it, so host memory holds the layers in flight.
        init: for a model built on the meta device: ``init(name, tensor)`` fills each
            parameter's host (or file) tensor with its initial value, one tensor at a time, so
            the whole model is never in memory at once (e.g. ``GPT.init_parameter``).

    A module that keeps its own parameters in host memory (``hetero_device == "cpu"``: a host
    table, ``EmbeddingLookup(target="CPU")``) is left as it is: its lookup ships the rows the
    device needs, and copying the table over would defeat it (and its lookup refuses a table
    off the host). Refused by name: a module with sparse gradients (``sparse=True``), whose
    gradient cannot land in a dense host tensor, and ``reduce_group`` beside a host table,
    whose sparse gradient it does not average.
    """

    def __init__(self, model: nn.Module | Sequence[nn.Module], device: Any = "device",
                 prefetch: int = 1,
                 compute_dtype: torch.dtype | None = None,
                 units: list[nn.Module] | None = None,
                 reduce_group: dist.ProcessGroup | None = None, bucket_mb: float = 25.0,
                 disk_path: str | os.PathLike | None = None,
                 init: Callable[[str, torch.Tensor], None] | None = None) -> None:
        if not isinstance(prefetch, int) or isinstance(prefetch, bool) or prefetch < 0:
            raise ValueError(f"ParamOffload: prefetch must be an int >= 0, got {prefetch!r}")
        if compute_dtype is not None and not compute_dtype.is_floating_point:
            raise ValueError(f"ParamOffload: compute_dtype must be a floating dtype, got "
                             f"{compute_dtype}")
        entries = ([model] if isinstance(model, nn.Module) else
                   list(model) if isinstance(model, Sequence) else [])
        if not entries or not all(isinstance(m, nn.Module) for m in entries):
            raise TypeError(f"ParamOffload: expected an nn.Module or a non-empty sequence of "
                            f"them (a pipeline rank's stages), got {model!r}")
        model = entries[0] if len(entries) == 1 else nn.ModuleList(entries)
        check_model(model, meta_ok=init is not None)
        if reduce_group is not None and host_kept_params(model):
            raise ValueError("ParamOffload: reduce_group averages the offloaded weights' "
                             "gradients, and this model has a host table (hetero_device="
                             "'cpu') whose sparse gradient it would leave unaveraged: shard "
                             "the table's rows (EmbeddingLookup(sharding='row')) or reduce its "
                             "gradient yourself")
        self.model = model
        self.entries = entries  # the modules whose forward starts a pass
        self.disk_path = disk_path
        self._init = init
        self.device = hd.resolve(device)
        self._init_schedule(prefetch)
        self.compute_dtype = compute_dtype
        self.units = ([u for entry in entries for u in unit_modules(entry)] if units is None
                      else list(units))
        self.homes: dict[int, _Home] = {}  # id(param) -> its home
        self.unit_homes, self.root_homes = self._assign()
        self.reduce_group = reduce_group
        self.bucket_bytes = int(bucket_mb * 2**20)
        self.sync = True  # reduce at the end of backward (False inside no_sync)
        self._end_queued = False
        self._side: torch.Stream | None = None
        #: bytes of device copies held now, and the most held at once since :meth:`reset_peak`
        self.device_bytes = 0
        self.peak_device_bytes = 0
        self.hooks: list[Any] = []
        self._move_home()
        self._register()
        for entry in entries:
            setattr(entry, MARK, weakref.ref(self))

    # ------------------------------------------------------------------ set-up
    def _assign(self) -> tuple[list[list[_Home]], list[_Home]]:
        holders: dict[int, list[nn.Module]] = {}  # id(param) -> the modules registering it
        for module in self.model.modules():
            for p in module.parameters(recurse=False):
                holders.setdefault(id(p), []).append(module)
        on_host = {id(p) for p in host_kept_params(self.model)}
        params = [p for p in self.model.parameters() if id(p) not in on_host]
        owners = unit_owners(self.units, [holders[id(p)] for p in params])
        unit_homes: list[list[_Home]] = [[] for _ in self.units]
        root_homes: list[_Home] = []
        for p, owner in zip(params, owners, strict=True):
            home = _Home(p, p.data)
            self.homes[id(p)] = home
            (unit_homes[owner] if owner >= 0 else root_homes).append(home)
        return unit_homes, root_homes

    def _rebind(self, name: str, meta: nn.Parameter, host: torch.Tensor) -> nn.Parameter:
        """A parameter over ``host`` in place of the meta ``meta``, in every module holding
        it (a tied weight keeps one parameter)."""
        param = nn.Parameter(host, requires_grad=meta.requires_grad)
        for module in self.model.modules():
            for key, value in module._parameters.items():
                if value is meta:
                    module._parameters[key] = param
        home = self.homes.pop(id(meta))
        self.homes[id(param)] = home
        return param

    @torch.no_grad()
    def _move_home(self) -> None:
        homes = list(self.homes.values())
        names = {id(p): n for n, p in self.model.named_parameters()}
        self.file: MappedFile | None = None
        if self.disk_path is not None:  # weights, then their gradients, in one file
            specs = [(h.param.shape, h.param.dtype) for h in homes]
            self.file = MappedFile(self.disk_path, f"params.rank{os.environ.get('RANK', '0')}"
                                   f".{os.getpid()}.{id(self)}.bin", specs + specs)
        pinned = pinned_views([(h.param.shape, h.param.dtype) for h in homes]) \
            if self.file is None else []
        for index, home in enumerate(homes):
            if self.file is not None:
                home.index, home.grad_slot = index, self.file.tensors[len(homes) + index]
                host = self.file.tensors[index]
            else:
                host = pinned[index]
            if home.param.is_meta:
                assert self._init is not None  # _check_model refused meta without it
                self._init(names[id(home.param)], host)
            else:
                host.copy_(home.param.data)
            home.host = host
            if home.param.is_meta:  # a meta parameter takes no data swap: made anew
                home.param = self._rebind(names[id(home.param)], home.param, host)
            else:
                home.param.data = host
            if self.file is not None:
                self.file.release([index])
        for module in self.model.modules():
            if keeps_itself_on_host(module):
                module.to(self.device)  # stays on the host, its outputs go to the device
                continue
            for name, buffer in module.named_buffers(recurse=False):
                if buffer is not None:
                    module._buffers[name] = buffer.to(self.device)

    def _register(self) -> None:
        for entry in self.entries:
            self.hooks.append(entry.register_forward_pre_hook(lambda *_: self._enter()))
            self.hooks.append(entry.register_forward_hook(lambda *a: self._after_model(a[2])))
        self.hooks += self._hook_units(self.units, [bool(h) for h in self.unit_homes])
        for home in self.homes.values():
            if home.param.requires_grad:
                # holds this object weakly and the home not at all: the home holds the
                # parameter, whose hooks the collector cannot see, so it would never be freed
                self.hooks.append(home.param.register_post_accumulate_grad_hook(
                    weak_hook(self._gradient_in)))

    def remove(self) -> None:
        """Stop offloading: every parameter back on the device for good, the hooks removed."""
        self._let_go(list(self.homes.values()))
        for hook in self.hooks:
            hook.remove()
        self.hooks = []
        with torch.no_grad():
            for home in self.homes.values():
                home.param.data = home.host.to(self.device, copy=self.file is not None)
        for entry in self.entries:
            delattr(entry, MARK)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backwards inside accumulate their gradients on the host without reducing them; the
        first backward after it reduces the sums (DDP's ``no_sync``)."""
        before, self.sync = self.sync, False
        try:
            yield
        finally:
            self.sync = before

    # ------------------------------------------------------------------ residency
    def resident(self) -> list[nn.Parameter]:
        """The parameters that have a device copy now."""
        return [home.param for home in self.homes.values() if home.copy is not None]

    def reset_peak(self) -> None:
        self.peak_device_bytes = self.device_bytes

    def _stream(self) -> torch.Stream:
        if self._side is None:
            self._side = hd.new_stream(self.device)
        return self._side

    @torch.no_grad()
    def _bring(self, homes: list[_Home], wait: bool) -> None:
        """Give ``homes`` their device copies (started if not yet); ``wait``: the compute
        stream waits for them (they are about to be used)."""
        compute = hd.current_stream(self.device)
        if self.file is not None:  # every page on its way before the first copy waits on one
            self.file.prefetch([h.index for h in homes if h.copy is None])
        for home in homes:
            if home.copy is None:
                dtype = self.compute_dtype or home.host.dtype
                copy = home.storage_of
                if copy is None:  # made once: every later visit regrows the same storage
                    copy = home.storage_of = torch.empty(home.host.shape, dtype=dtype,
                                                         device=self.device)
                else:
                    copy.untyped_storage().resize_(copy.nbytes)
                if self.device.type == "cpu":
                    copy.copy_(home.host)
                else:
                    side = self._stream()
                    hd.wait_stream(side, compute)  # the memory's earlier users are done
                    with hd.stream_scope(side):
                        # an asynchronous DMA from pinned memory straight into the copy; with
                        # a cast, torch's non-blocking copy moves the host dtype and casts on
                        # the device (aten/src/ATen/native/cuda/Copy.cu): no host temporary,
                        # and no device temporary or second pass when the dtypes agree
                        copy.copy_(home.host, non_blocking=True)
                        home.ready = hd.new_event(self.device)
                        home.ready.record(side)
                home.copy = copy
                self.device_bytes += copy.nbytes
                self.peak_device_bytes = max(self.peak_device_bytes, self.device_bytes)
                if home.grad is None and home.param.grad is not None:
                    home.grad = home.param.grad  # set aside: autograd accumulates on the device
                    home.param.grad = None
                home.param.data = copy
            if wait and home.ready is not None:
                home.ready.wait(compute)
                home.ready = None

    @torch.no_grad()
    def _let_go(self, homes: list[_Home]) -> None:
        for home in homes:
            if home.copy is None:
                continue
            if home.ready is not None:  # a prefetch nobody used: never free under a copy
                home.ready.wait(hd.current_stream(self.device))
                home.ready = None
            home.param.data = home.host
            self.device_bytes -= home.copy.nbytes
            # free the memory, keep the storage: what autograd saved of the weight in forward
            # (``weight.t()`` for a Linear's backward) is a view of it, and sees it again when
            # the layer is brought back before its backward (FSDP2 frees its unsharded
            # parameters the same way). Dropping the tensor instead would leave that view
            # holding every layer's copy from forward to backward.
            home.copy.untyped_storage().resize_(0)
            home.copy = None
            if self.file is not None:
                self.file.release([home.index])
            if home.grad is not None and home.arriving is None:
                home.param.grad, home.grad = home.grad, None

    def _fetch(self, indices: list[int], wait: bool) -> None:
        self._bring([home for index in indices for home in self.unit_homes[index]], wait)

    def _drop(self, index: int) -> None:
        self._let_go(self.unit_homes[index])

    # ------------------------------------------------------------------ hooks
    def _enter(self) -> None:
        if not self.backward_running:  # a new forward: whatever the last one left goes
            self._let_go([h for h in self.homes.values() if h.arriving is None])
            if self.file is not None:  # and the pages the optimizer step touched
                self.file.release(range(len(self.file.tensors)))
        self._bring(self.root_homes, wait=True)

    def _after_model(self, output: Any) -> None:
        if not torch.is_grad_enabled() or not tensors_needing_grad(output):
            self._let_go(list(self.homes.values()))
            return
        if not self.backward_running:
            torch.autograd.graph.register_multi_grad_hook(
                tensors_needing_grad(output), lambda _: self._backward_begins(), mode="any")

    def _backward_begins(self) -> None:
        super()._backward_begins()
        self._queue_end()

    def _queue_end(self) -> None:
        if not self._end_queued:
            self._end_queued = True
            queue_backward_callback(self._backward_ends)

    @torch.no_grad()
    def _gradient_in(self, param: torch.Tensor) -> None:
        """``param``'s gradient is accumulated on the device: send it to the host, and let the
        device copy go."""
        home = self.homes[id(param)]
        grad = home.param.grad
        home.param.grad = None
        if grad is not None:
            if grad.device.type == "cpu":  # nothing in flight: it lands now
                self._land(home, grad)
            else:
                buffer = hd.pinned_empty(grad.shape, grad.dtype)
                side = self._stream()
                hd.wait_stream(side, hd.current_stream(self.device))
                with hd.stream_scope(side):
                    buffer.copy_(grad, non_blocking=True)
                    done = hd.new_event(self.device)
                    done.record(side)
                grad.record_stream(side)
                home.arriving = (buffer, done)
        self._let_go([home])

    def _land(self, home: _Home, grad: torch.Tensor) -> None:
        """``grad`` (on the host now) becomes ``home``'s gradient: added to the one kept from
        earlier micro-batches, else its own (under the disk tier: copied into its file slot)."""
        grad = grad.to(home.host.dtype)
        kept = home.grad if home.grad is not None else home.param.grad
        home.grad = None
        if kept is not None:  # accumulation across micro-batches, in the host's dtype
            kept.add_(grad)
            grad = kept
        elif home.grad_slot is not None:
            home.grad_slot.copy_(grad)
            grad = home.grad_slot
        if self.file is not None:
            self.file.release([len(self.homes) + home.index])
        if home.copy is None:
            home.param.grad = grad
        else:  # still on the device (a forward ran inside backward): set aside
            home.grad = grad

    @torch.no_grad()
    def _backward_ends(self) -> None:
        """Every gradient of this backward is on its way: land them, and let go of what the
        device still holds."""
        self._end_queued = False
        self.land_gradients()
        self._let_go(list(self.homes.values()))
        if self.reduce_group is not None and self.sync:
            average_host_grads([h.param for h in self.homes.values() if h.param.requires_grad],
                               self.reduce_group, self.bucket_bytes)
        self._end_step()

    # ------------------------------------------------------------------ split backward
    @contextlib.contextmanager
    def visiting(self, params: list[nn.Parameter], ahead: list[nn.Parameter] | None = None
                 ) -> Iterator[None]:
        """``params`` on the device for a pass that no layer hook sees: the weight pass of a
        split backward (torch's zero-bubble schedules compute the weights' gradients after the
        input pass, once the layers have been let go of). The copies regrow the storages
        their forward used, so what autograd saved of them reads the same values; ``ahead``
        (the next pass's) start coming meanwhile. On leaving, each gradient the pass set on a
        parameter goes to the host as a full backward's does (added to the micro-batches'
        sum there) and the copies go; :meth:`land_gradients` waits for the last of them."""
        homes = [self.homes[id(p)] for p in params if id(p) in self.homes]
        self._bring(homes, wait=True)
        self._bring([self.homes[id(p)] for p in ahead or () if id(p) in self.homes], wait=False)
        try:
            yield
        except BaseException:
            self._let_go(homes)
            raise
        for home in homes:
            self._gradient_in(home.param)

    @torch.no_grad()
    def land_gradients(self) -> None:
        """Wait for the gradients on their way to the host and add each to its parameter's."""
        for home in self.homes.values():
            if home.arriving is None:
                continue
            grad, done = home.arriving
            home.arriving = None
            if done is not None:
                done.synchronize()
            self._land(home, grad)
