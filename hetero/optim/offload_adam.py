"""``OffloadAdam`` / ``OffloadAdamW``: FP32 Adam on the host against 16-bit device weights.

The model keeps computing with its parameters (the *device copies*, in ``param_dtype``); the
optimizer keeps, in host memory, the FP32 master weight and both moments of each (see
:mod:`hetero.optim.param_slots`). Gradients leave the device during backward
(:mod:`hetero.optim.grad_buckets`); ``step()`` waits for them, runs the host kernel
(:mod:`hetero.optim.host_kernels`) over contiguous runs of parameters, and sends the updated
weights back on a side stream. The compute stream waits for that copy through an event, so the
next forward sees the new weights without the host ever synchronizing the device.

After backward, offloaded parameters have ``.grad = None``: their gradients are on the host. Use
``clip_grad_norm_`` of the optimizer (not ``torch.nn.utils``) and :class:`LossScaler` for fp16.
A gradient assigned to ``.grad`` directly (no backward) is taken at ``step()`` as well.

A ``DTensor`` parameter is kept per local shard: each rank holds masters and moments of its own
slice only, and norms are reduced over the mesh dimensions that shard it. Optimizer parallel's
(FSDP2) slices keep their dtype and their gradients are taken at ``step()``; semi-auto's
parameters (``hetero.local_parts.computes_with_dtensor``) are recast to ``param_dtype`` in place
(same object, placements and hooks) and their gradients leave during backward, after semi-auto's
reduction hook has brought them to the parameter's placements.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from foundation import device as hd
from foundation.host_threads import cores_per_rank, thread_scope
from foundation.validate import check_adam_group, check_number
from hetero.optim.grad_buckets import GradOffloader
from hetero.optim.host_grads import HostGradients
from hetero.optim.host_kernels import KERNEL_NAMES, Hyper, TorchKernel, make_kernel
from hetero.optim.param_slots import (
    SUPPORTED_PARAM_DTYPES,
    ParamSlot,
    adopt_slots,
    build_slots,
    check_dtensor_dtype,
    check_param,
    device_dtype_for,
    host_share,
)
from hetero.optim.state_io import load_state
from hetero.optim.update_runs import build_runs, reseed_edited, send_back


class OffloadAdam(HostGradients, torch.optim.Optimizer):
    """Adam (L2 weight decay) with FP32 master weights and moments in host memory.

    Args:
        params: parameters or param-group dicts, as for ``torch.optim.Adam``. A group with
            ``"offload": False`` is not offloaded: its FP32 parameters stay in their dtype where
            they are, their moments beside them, and they are updated there in place by
            torch's fused kernel (offload is per group, not all or nothing).
        host_ratio: the share of each offloaded group's parameters (by elements, whole
            tensors, in order) whose state and update live on the host; the rest are kept
            as a group with ``"offload": False`` would be (Megatron's optimizer offload
            fraction). 1.0: all of them; 0.0: none (torch's fused AdamW where they are).
        lr, betas, eps, weight_decay: as ``torch.optim.Adam``; per-group overrides work.
        param_dtype: ``torch.float16`` / ``torch.bfloat16`` to hold the model's (device) copy of
            each parameter in that dtype, or None to keep each parameter's dtype.
        kernel: host update kernel: "compiled" (ours: fused upcast + update + downcast),
            "torch" (torch's fused CPU AdamW), "deepspeed" (DeepSpeedCPUAdam's op), or "auto"
            (the fastest that works here: compiled, else deepspeed, else torch for 16-bit
            work; torch's for plain FP32 parameters updated in place).
        bucket_cap_mb: gradient bytes per device→host copy bucket.
        overlap_backward: copy gradients out during backward through hooks. Set False when
            something must see ``.grad`` on the device after backward (torch DDP reduces it then);
            ``step()`` copies the gradients out instead.
        host_threads: intra-op threads the host update runs with (set around the update only,
            the previous count restored after). None: the cores this rank owns
            (``foundation.host_threads.cores_per_rank``: its CPU affinity when a launcher bound
            it, else the cores divided by ``$LOCAL_WORLD_SIZE``) — torchrun's
            ``OMP_NUM_THREADS=1`` would otherwise leave the update on one core.
    """

    decoupled_weight_decay = False

    def __init__(self, params: Iterable[Any], lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, *, param_dtype: torch.dtype | None = None,
                 kernel: str = "auto", bucket_cap_mb: float = 25.0,
                 overlap_backward: bool = True, host_threads: int | None = None,
                 host_ratio: float = 1.0) -> None:
        name = type(self).__name__
        check_number(name, "host_ratio", host_ratio, 0.0)
        if host_ratio > 1.0:
            raise ValueError(f"{name}: host_ratio is the share of the optimizer state kept on "
                             f"the host, between 0.0 and 1.0, got {host_ratio}")
        self.host_ratio = float(host_ratio)
        if host_threads is not None and (isinstance(host_threads, bool)
                                         or not isinstance(host_threads, int)
                                         or host_threads < 1):
            raise ValueError(f"{name}: host_threads must be a whole number >= 1 or None (the "
                             f"cores this rank owns), got {host_threads!r}")
        if kernel not in KERNEL_NAMES:
            raise ValueError(f"{name}: unknown kernel {kernel!r}; choose one of "
                             f"{', '.join(map(repr, KERNEL_NAMES))}")
        if param_dtype is not None and param_dtype not in SUPPORTED_PARAM_DTYPES:
            raise ValueError(f"{name}: param_dtype must be torch.float16, torch.bfloat16 or None "
                             f"(keep each parameter's dtype), got {param_dtype}")
        check_number(name, "bucket_cap_mb", bucket_cap_mb, 0.0, strict=True)
        check_adam_group(name, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        if isinstance(params, torch.Tensor):
            raise TypeError(f"{name}: params must be an iterable of tensors or param-group "
                            f"dicts, got a single tensor")
        params = list(params)
        if not params:
            raise ValueError(f"{name}: got an empty parameter list")
        groups = params if isinstance(params[0], dict) else [{"params": params}]
        self.param_dtype = param_dtype
        for i, group in enumerate(groups):
            self._check_group(i, group)
        self._kernel = make_kernel(kernel)  # may build or load a kernel: fail before any state
        self._device_kernel = TorchKernel()
        self._grads = GradOffloader(int(bucket_cap_mb * 2**20))
        self._overlap = overlap_backward
        #: intra-op threads of the host update (see ``host_threads`` above)
        self.host_threads = host_threads or cores_per_rank()
        self._slots: list[list[ParamSlot]] = []
        self._sent: dict[torch.device, Any] = {}
        self._grad_scale = 1.0
        self._norm_cache: dict[tuple, torch.Tensor] = {}
        self._building = True
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        amsgrad=False, maximize=False, offload=True)
        super().__init__(groups, defaults)  # torch's checks: empty list, shared parameters
        self._building = False
        # Validate and allocate everything first, then change the model in one step: a failure
        # (host out of memory) leaves every parameter as it was.
        self._adopt([build_slots(g["params"], self.param_dtype, self._on_host(g))
                     for g in self.param_groups])

    # ------------------------------------------------------------------ groups and state

    def _check_group(self, index: int, group: dict) -> None:
        params = group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        group["params"] = params
        if len({id(p) for p in params}) != len(params):
            raise ValueError(f"param group {index} lists a parameter twice")
        offload = group.get("offload", True)
        if not isinstance(offload, bool):
            raise TypeError(f"param group {index}: offload must be a bool, got "
                            f"{type(offload).__name__}")
        for j, (p, on_host) in enumerate(zip(params, self._on_host(group), strict=True)):
            check_param(p, index, j)
            if not on_host and p.dtype != torch.float32:
                why = ("has offload=False" if not offload else
                       f"keeps {1 - self.host_ratio:.0%} of its state on the device "
                       f"(host_ratio={self.host_ratio})")
                raise ValueError(f"param group {index} {why}, which keeps FP32 parameters and "
                                 f"their state where they are, but parameter {j} is {p.dtype}")
            check_dtensor_dtype(p, device_dtype_for(p, self.param_dtype) if on_host
                                else p.dtype, index, j)
        for flag in ("amsgrad", "maximize"):
            if group.get(flag):
                raise ValueError(f"param group {index}: {flag}=True is not implemented")
        check_adam_group(f"{type(self).__name__} param group {index}", group)

    def _on_host(self, group: dict) -> list[bool]:
        """Per parameter of ``group``: whether its state lives on the host."""
        if not group.get("offload", True):
            return [False] * len(group["params"])
        return host_share(group["params"], self.host_ratio)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group (validated first); its host state is created at once."""
        if self._building:
            return super().add_param_group(param_group)
        self._check_group(len(self.param_groups), param_group)
        super().add_param_group(param_group)
        try:
            group = self.param_groups[-1]
            slots = build_slots(group["params"], self.param_dtype, self._on_host(group))
        except BaseException:
            self.param_groups.pop()
            raise
        self._adopt([slots])

    def _adopt(self, groups: list[list[ParamSlot]]) -> None:
        """Cast the model's copies of the built groups and register their state and hooks."""
        adopt_slots([slot for slots in groups for slot in slots])
        for slots in groups:
            self._slots.append(slots)
            for slot in slots:
                self.state[slot.param] = slot.state()
            if self._overlap:
                self._grads.attach(slots)

    def _all_slots(self) -> list[ParamSlot]:
        return [slot for slots in self._slots for slot in slots]

    def _offloaded(self) -> list[ParamSlot]:
        return [slot for slot in self._all_slots() if not slot.in_place]

    # ------------------------------------------------------------------ gradients (host_grads.py)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop all gradients: device ``.grad`` and the host copies (``set_to_none=False``
        keeps zero gradients, so the next step still decays moments and weights)."""
        keep = [s for s in self._offloaded() if s.count] if not set_to_none else []
        if keep:
            self._grads.wait_all()
        super().zero_grad(set_to_none=set_to_none)
        self._grads.discard(self._offloaded())
        for slot in keep:
            slot.arena.view("staging", slot.index).zero_()
            slot.count = 1
        self._grad_scale = 1.0

    # ------------------------------------------------------------------ the update

    def _wait_sent(self) -> None:
        """Block until the last weights sent to the device have left the host buffers."""
        for event in self._sent.values():
            event.synchronize()
        self._sent.clear()

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One Adam(W) update on the host; the new weights are on their way to the device."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._collect_grads()
        reseed_edited(self._all_slots())
        self._wait_sent()
        updated: list[ParamSlot] = []
        for group, slots in zip(self.param_groups, self._slots, strict=True):
            runs = build_runs(slots, self._grads, updated)
            if runs:
                beta1, beta2 = group["betas"]
                hyper = Hyper(float(group["lr"]), beta1, beta2, group["eps"],
                              group["weight_decay"], self.decoupled_weight_decay,
                              self._grad_scale)
                # a group kept on the accelerator (offload=False) steps there, in torch's
                # fused kernel; the host kernels get the rest
                kept = [r for r in runs if r.param.device.type != "cpu"]
                if kept:
                    self._device_kernel.update(kept, hyper)
                if len(kept) < len(runs):
                    with thread_scope(self.host_threads):
                        self._kernel.update([r for r in runs if r.param.device.type == "cpu"],
                                            hyper)
        self._sent = send_back(updated, self._grads)
        self._grads.discard(self._offloaded())
        self._grad_scale = 1.0
        return loss

    # ------------------------------------------------------------------ state and memory

    def state_dict(self) -> dict[str, Any]:
        """``torch.optim.AdamW``'s layout plus ``"fp32_master"`` per offloaded parameter."""
        reseed_edited(self._all_slots())
        self._wait_sent()
        return super().state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a dict from ``state_dict()`` here or from ``torch.optim.AdamW``/``Adam``."""
        load_state(self, state_dict)

    @property
    def kernel(self) -> str:
        """The host kernel in use ("auto" until its first step has chosen one)."""
        return getattr(self._kernel, "chosen", None) or self._kernel.name

    def memory_stats(self) -> dict[str, int]:
        """Bytes the optimizer keeps per side: ``device_bytes`` (the model's copies of the
        parameters and gradients still held for copying), ``peak_device_grad_bytes``,
        ``host_bytes`` (master, moments, landing and send buffers), ``num_params``."""
        slots = self._all_slots()
        arenas = {id(s.arena): s.arena for s in slots}
        device = hd.resolve("device")  # host partitions updated in place are not device bytes
        on_device = [s for s in slots if not s.in_place or s.device == device]
        return {
            "num_params": sum(s.tensor.numel() for s in slots),
            "device_bytes": sum(s.tensor.nbytes for s in on_device)
            + self._grads.held_bytes
            + sum(a.nbytes() for a in arenas.values() if not a.on_host),
            "peak_device_grad_bytes": self._grads.peak_held_bytes,
            "host_bytes": sum(a.nbytes() for a in arenas.values() if a.on_host),
        }


class OffloadAdamW(OffloadAdam):
    """AdamW (decoupled weight decay, default 1e-2 as ``torch.optim.AdamW``) on the host."""

    decoupled_weight_decay = True

    def __init__(self, params: Iterable[Any], lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, **kwargs: Any) -> None:
        super().__init__(params, lr, betas, eps, weight_decay, **kwargs)
