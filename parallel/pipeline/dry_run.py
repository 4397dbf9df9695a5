"""Fake-tensor dry runs of a model (the automatic split's FLOP count, the stage check) leave
nothing behind.

A forward may keep tensors as plain attributes (an MoE layer's ``aux_loss`` and ``load``). From
a dry run those are fake tensors holding their ``FakeTensorMode``, whose converter keeps weak
references to the model's parameters: a meta model could then not be materialized in place
(``torch.utils.swap_tensors`` refuses a tensor with weak references, see
``parallel.weights.deferred_init``), and the model would carry fake values until its first real
forward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn


@contextlib.contextmanager
def tensor_attributes_kept(model: nn.Module) -> Iterator[None]:
    """Put back, on exit, every plain tensor attribute of ``model``'s modules as it was on
    entry (set ones restored, new ones removed); parameters and buffers are not touched."""
    saved = [(m, {k: v for k, v in vars(m).items() if isinstance(v, torch.Tensor)})
             for m in model.modules()]
    try:
        yield
    finally:
        for module, attributes in saved:
            for key in [k for k, v in vars(module).items() if isinstance(v, torch.Tensor)]:
                if key not in attributes:
                    delattr(module, key)
            for key, value in attributes.items():
                setattr(module, key, value)
