"""Count the collectives a piece of code issues, with their sizes, through torch's profiler.

torch's ``CommDebugMode`` would do this, but its module tracker raises IndexError when a module
is called twice inside one parent (multi-copy does exactly that), so the tests read the
profiler's record of the functional-collective ops instead.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from torch.profiler import ProfilerActivity, profile

_NOT_COLLECTIVES = ("wait_tensor", "_wrap_tensor_autograd")


def collectives(fn: Callable[[], Any]) -> dict[str, list[int]]:
    """Run ``fn``; return, per collective (``all_reduce``, ``all_to_all_single``, ...), the
    element count of each call's input, in call order."""
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        fn()
    calls: dict[str, list[int]] = defaultdict(list)
    for event in prof.events():
        prefix, _, op = event.name.partition("::")
        if prefix == "_c10d_functional" and op not in _NOT_COLLECTIVES:
            calls[op].append(math.prod(event.input_shapes[0]))
    return dict(calls)
