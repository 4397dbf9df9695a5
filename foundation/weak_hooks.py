"""``weak_hook``: a tensor or module hook that holds its owner weakly.

Why: a parameter's hooks are reached from its C++ side, which Python's collector cannot follow
(a parameter whose tensor C++ also holds, a view's base, is not traversed), so a hook holding its
owner strongly keeps the owner, the model it wraps and its process groups (with their threads
and sockets) alive for the life of the process after the user drops them. A hook made here does
nothing once its owner is gone.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any


def weak_hook(method: Callable[..., Any], *args: Any) -> Callable[..., Any]:
    """A hook calling the bound ``method(*args, *what_the_hook_is_given)`` while its object
    lives (``args`` are held strongly: give positions or plain values, not the owner's parts)."""
    ref = weakref.WeakMethod(method)

    def hook(*given: Any) -> Any:
        bound = ref()
        return None if bound is None else bound(*args, *given)
    return hook
