"""Optimizer offload: FP32 Adam/AdamW on the host against 16-bit weights on the device.

    opt = hetero.optim.OffloadAdamW(model.parameters(), lr=3e-4, param_dtype=torch.bfloat16)
    loss.backward()            # gradients stream to pinned host buffers as backward makes them
    opt.clip_grad_norm_(1.0)   # on the host FP32 gradients
    opt.step()                 # fused host update; the 16-bit weights go back asynchronously

The device keeps only the 16-bit weights (2 bytes per parameter, plus a bucket or two of
gradients in flight during backward) where standard mixed-precision AdamW keeps 16. fp16 needs
:class:`LossScaler`; bf16 does not. ``state_dict()`` loads into ``torch.optim.AdamW`` and back.
"""

from hetero.optim.ftrl import FTRL
from hetero.optim.lazy_adam import LazyAdam
from hetero.optim.loss_scaler import LossScaler
from hetero.optim.offload_adam import OffloadAdam, OffloadAdamW

__all__ = ["FTRL", "LazyAdam", "LossScaler", "OffloadAdam", "OffloadAdamW"]
