"""What a device move gives a tensor that stays on the host, a meta one included.

Why: a module whose tensors live on the host whatever the model's device (a host
``EmbeddingLookup``, host-tagged ``GroupedExperts``) keeps them out of device moves in its
``_apply``. But deferred initialization gives a meta-built model its storage with
``to_empty(device=accelerator)``, which runs through ``_apply`` too: kept out, those tensors stayed
on the meta device and deferred init refused the model. A meta tensor gets uninitialized host
storage instead, as ``to_empty(device="cpu")`` would give it; deferred init then fills it like any
other. ``Module._apply`` does the swap, so parameter objects survive wherever torch keeps them
(``torch.__future__.set_swap_module_params_on_conversion``, which deferred init sets).
"""

from __future__ import annotations

import torch

import foundation.device as hd


def stay_on_host(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """``tensor`` where it is, floating point cast to ``dtype`` (None: kept); a meta tensor as
    uninitialized host memory of its shape."""
    cast = dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype
    if tensor.is_meta:
        return torch.empty(tensor.shape, dtype=cast, device=hd.resolve("cpu"))
    return tensor if cast == tensor.dtype else tensor.to(dtype=cast)
