"""Which models parameter offload takes, and how a model says it is offloaded.

Split from :mod:`hetero.offload.params` (the offload itself): the checks a model passes before
anything moves, the modules that keep their own parameters on the host (left as they are), and
the mark an offloaded model carries, which finds its :class:`~hetero.offload.params.ParamOffload`
(held weakly: the offload holds the model, not the other way round).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from hetero.offload.params import ParamOffload

MARK = "_hetero_param_offload"  # on a model whose parameters are offloaded: its ParamOffload


def param_offload_of(model: nn.Module) -> ParamOffload | None:
    """The :class:`ParamOffload` keeping ``model``'s parameters on the host, or None."""
    mark = getattr(model, MARK, None)
    return None if mark is None else mark()


def keeps_itself_on_host(module: nn.Module) -> bool:
    """Whether ``module`` keeps its parameters in host memory itself (``hetero_device ==
    "cpu"``: a host table)."""
    return getattr(module, "hetero_device", None) == "cpu"


def host_kept_params(model: nn.Module) -> list[nn.Parameter]:
    """The parameters of ``model``'s modules that keep them in host memory themselves:
    parameter offload leaves them where they are."""
    return [p for module in model.modules() if keeps_itself_on_host(module)
            for p in module.parameters()]


def check_model(model: nn.Module, meta_ok: bool = False) -> None:
    """ValueError naming what parameter offload cannot hold in ``model``, before anything
    moves."""
    for name, module in model.named_modules():
        if getattr(module, "sparse", False) is True and not keeps_itself_on_host(module):
            raise ValueError(f"ParamOffload: {name or 'the model'} ({type(module).__name__}, "
                             f"sparse=True) gets sparse gradients, which cannot land in the "
                             f"dense host gradient parameter offload keeps: give it "
                             f"sparse=False, or keep the table in host memory "
                             f"(EmbeddingLookup(target='CPU'))")
    if any(getattr(module, MARK, None) is not None for module in model.modules()):
        raise ValueError(f"ParamOffload: {type(model).__name__}'s parameters are offloaded "
                         f"already")
    for name, p in model.named_parameters():
        if p.device.type == "meta" and not meta_ok:
            raise ValueError(f"ParamOffload: parameter {name} is on the meta device; "
                             f"materialise the model first or give init=")
        if type(p) is not nn.Parameter or type(p.data) is not torch.Tensor:
            raise ValueError(f"ParamOffload: parameter {name} is a {type(p.data).__name__}; "
                             f"parameter offload holds plain tensors (apply it before "
                             f"tensor or optimizer parallel shards the model)")
    for name, b in model.named_buffers():
        if b.device.type == "meta":
            raise ValueError(f"ParamOffload: buffer {name} is on the meta device; init= fills "
                             f"parameters only: materialise the buffers first")
