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
from typing import Any

import torch
from torch import nn

from foundation.compat import pytree


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


def fake_inputs(model: nn.Module, mode: Any, inputs: Any) -> Any:
    """``inputs`` as fake tensors of ``mode`` for a dry run of ``model``: on the meta device
    when the model is (torch before 2.13 refuses to mix a meta weight with a host index in one
    fake operator, an embedding), else where they are."""
    meta = any(p.is_meta for p in model.parameters())
    return pytree.tree_map_only(
        torch.Tensor, lambda t: mode.from_tensor(t.to("meta") if meta else t), inputs)
