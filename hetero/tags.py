"""Placement tags: ``set_device`` on modules and ops, ``device_scope`` on regions of ``forward``.

Tags say where computation *should* run; nothing moves until ``hetero.place`` splits the model.
They live outside the user's objects where possible: module tags in a weak dictionary (the module
is not modified and is not kept alive by the tag), op tags in a small wrapper that records its
device as a ``torch.fx.traceback.annotate`` annotation on every node it produces when captured.
A scope does the same for every op inside a ``with`` block. Tags are logical ("cpu" or "device"),
so one plan means the same on a GPU, an NPU, or a CPU-only machine.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import torch
import torch.fx.traceback as fx_traceback
from torch import nn

from foundation import device as hd

#: Key of the fx node annotation that op and scope tags write (``node.meta["custom"][KEY]``).
ANNOTATION_KEY = "hetero_device"

_module_tags: weakref.WeakKeyDictionary[nn.Module, str] = weakref.WeakKeyDictionary()

M = TypeVar("M", bound=nn.Module)


class TaggedOp:
    """An op bound to a device: calling it runs the op; when captured, its nodes carry the tag."""

    def __init__(self, op: Callable[..., Any], device: str) -> None:
        self.op = op
        self.device = device
        functools.update_wrapper(self, op)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with fx_traceback.annotate({ANNOTATION_KEY: self.device}):
            return self.op(*args, **kwargs)

    def __repr__(self) -> str:
        return f"set_device({getattr(self.op, '__name__', self.op)!r}, {self.device!r})"


def _logical(device: str | torch.device) -> str:
    if not isinstance(device, (str, torch.device)):
        raise TypeError(
            f"device must be 'cpu', 'device' or a torch.device, got {type(device).__name__}"
        )
    return hd.logical_name(device)  # raises ValueError listing accepted names


def set_device(obj: M | Callable[..., Any], device: str | torch.device) -> M | TaggedOp:
    """Tag a module (returned as is) or an op (a tagged callable is returned) with a device.

    ``device`` is "cpu"/"CPU", "device"/"DEVICE" (the accelerator), or a ``torch.device``. A module
    tag covers all its ops, parameters and buffers, and those of its children unless a child has a
    tag of its own (the innermost tag wins).
    """
    logical = _logical(device)
    if isinstance(obj, nn.Module):
        _module_tags[obj] = logical
        return obj
    if isinstance(obj, TaggedOp):
        return TaggedOp(obj.op, logical)
    if callable(obj):
        return TaggedOp(obj, logical)
    raise TypeError(
        f"set_device tags an nn.Module or an op (a callable such as torch.matmul or F.gelu), "
        f"got {type(obj).__name__}"
    )


def set_device_tag(module: nn.Module) -> str | None:
    """``module``'s ``set_device`` tag only (not a placement it declares for itself)."""
    return _module_tags.get(module)


def module_tag(module: nn.Module) -> str | None:
    """``module``'s own tag: from ``set_device``, else the placement it declares for itself.

    A module can declare where it belongs (host embedding tables do) with a ``hetero_device``
    attribute holding "cpu" or "device"; an explicit ``set_device`` overrides it.
    """
    tag = _module_tags.get(module)
    if tag is None:
        declared = getattr(module, "hetero_device", None)
        if declared is not None:
            tag = _logical(declared)
    return tag


@contextmanager
def device_scope(device: str | torch.device) -> Iterator[None]:
    """Tag every op run inside the ``with`` block (innermost scope or op tag wins)."""
    with fx_traceback.annotate({ANNOTATION_KEY: _logical(device)}):
        yield
