"""``ShardedGradScaler``: fp16 loss scaling for models whose gradients are sharded.

``torch.amp.GradScaler`` unscales the gradients it finds in the optimizer's groups, device by
device, with one fused kernel per dtype. Under optimizer parallel, expert shards or tensor
parallel some gradients are ``DTensor`` shards and some plain tensors, and the kernel refuses the
mix ("got mixed torch.Tensor and DTensor"); and a rank sees only its shards, so an overflow in
one rank's shard must skip the step on every rank. This subclass unscales each gradient's local
tensor (a DTensor's shard, a plain tensor as it is) and takes the maximum of the overflow flags
over the process group before the step reads them: every rank skips or steps together, as FSDP's
``ShardedGradScaler`` does for FSDP1's flat shards (which does not take DTensors).
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import foundation.device as hd
from foundation.compat import sparse_coo_parts, unscale_and_check_


class ShardedGradScaler(torch.amp.GradScaler):
    """``torch.amp.GradScaler`` for sharded (``DTensor``) and plain gradients alike; the
    overflow flags agree over ``group`` (default: the world). ``device``: the device type the
    scale lives on (default: the one training runs on, ``foundation.device``'s "device")."""

    def __init__(self, device: str | None = None, *, group: dist.ProcessGroup | None = None,
                 **kwargs: object) -> None:
        super().__init__(device or hd.resolve("device").type, **kwargs)  # type: ignore[arg-type]
        self.group = group

    def _unscale_grads_(self, optimizer: torch.optim.Optimizer, inv_scale: torch.Tensor,
                        found_inf: torch.Tensor, allow_fp16: bool
                        ) -> dict[torch.device, torch.Tensor]:
        """Unscale every gradient's local tensor; one overflow flag per device, agreed over
        the group (the hook ``GradScaler.unscale_`` calls)."""
        by_device: dict[torch.device, dict[torch.dtype, list[torch.Tensor]]] = defaultdict(
            lambda: defaultdict(list))
        with torch.no_grad():
            for group in optimizer.param_groups:
                for param in group["params"]:
                    grad = param.grad
                    if grad is None:
                        continue
                    local = grad.to_local() if isinstance(grad, DTensor) else grad
                    if not allow_fp16 and local.dtype == torch.float16:
                        raise ValueError("Attempting to unscale FP16 gradients.")
                    if local.is_sparse:  # its values, scaled in place
                        local = sparse_coo_parts(local)[1]
                    by_device[local.device][local.dtype].append(local)
        flags: dict[torch.device, torch.Tensor] = {}
        for device, per_dtype in by_device.items():
            flags[device] = found_inf.to(device, copy=True)
            for grads in per_dtype.values():
                unscale_and_check_(grads, flags[device], inv_scale.to(device))
        # an overflow in one rank's shard stops every rank's step: one flag, one all-reduce
        # (a rank may hold gradients on other devices than its peers, or none)
        agreed = found_inf.clone()
        for flag in flags.values():
            torch.maximum(agreed, flag.to(agreed.device), out=agreed)
        if dist.is_initialized():
            dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=self.group)
        for flag in flags.values():
            flag.copy_(agreed)
        return flags or {agreed.device: agreed}
