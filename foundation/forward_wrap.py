"""A module's ``forward`` wrapped in place, so that a copy of the module runs its own forward.

Why: recompute (``parallel.recompute``) and activation offload (``hetero.offload``) replace
``module.forward`` with a wrapper. A closure over the module's bound ``forward`` keeps calling
the *original* module once the module is deep-copied, and copies are what capture traces:
``hetero.place`` and the auto-parallel planner export a private copy whose tensors are fake
twins. The closure then traced the original's tensors, real ones (constants in the graph) or, for
a model built on the meta device, meta ones beside fake CPU inputs: a device mismatch. A wrapper
bound as a method is rebound to the copy by ``copy.deepcopy``, and so is the forward it wraps.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable
from typing import Any

from torch import nn

#: ``around(forward, *args, **kwargs)``: runs the module's forward (bound to the module called)
Around = Callable[..., Any]


def wrap_forward(module: nn.Module, around: Around) -> None:
    """Make ``module(...)`` call ``around(forward, *args, **kwargs)``, ``forward`` being the
    forward it had (the class's, or an instance-level one set before), bound to whichever
    object is called: ``module`` or a deep copy of it."""
    inner = module.__dict__.get("forward")  # an earlier wrapper, or None: the class's

    def wrapped(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if inner is None:
            forward = type(self).forward.__get__(self)
        elif isinstance(inner, types.MethodType):
            forward = types.MethodType(inner.__func__, self)
        else:  # a plain function the user set: it knows its module itself
            forward = inner
        return around(forward, *args, **kwargs)

    functools.update_wrapper(wrapped, inner if inner is not None else type(module).forward)
    module.forward = types.MethodType(wrapped, module)
