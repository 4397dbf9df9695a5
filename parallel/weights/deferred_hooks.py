"""Parameter hooks and attributes kept across deferred initialization's ``to_empty``.

:func:`parallel.weights.deferred_init.materialize_pending` gives a rank's meta parameters storage
with ``to_empty`` under ``swap_module_params_on_conversion``, so every ``nn.Parameter`` keeps its
object (what wrappers captured stays valid). ``torch.utils.swap_tensors`` swaps the tensors' whole
state, though: the gradient hooks registered on a parameter (``register_hook``,
``register_post_accumulate_grad_hook``) no longer reach autograd afterwards, and its Python
attributes are the new tensor's. Semi-auto and auto parallel register theirs on meta parameters that
a later step gives storage (optimizer parallel's replicated ones: the gradient's reduction to the
parameter's placements, the offloading optimizer's DTensor flag), so :func:`keeping_hooks` records
them before the swap and registers them again after it — on the parameters whose tensor was swapped
only (a hook registered twice would fire twice).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from torch import nn


@contextmanager
def keeping_hooks(roots: Sequence[nn.Module]) -> Iterator[None]:
    """The parameters of ``roots`` whose tensors are swapped inside keep their gradient hooks
    (registered again, in their order) and their Python attributes."""
    saved = []
    for p in {id(p): p for root in roots for p in root.parameters()}.values():
        pre = list((p._backward_hooks or {}).values())
        post = list((p._post_accumulate_grad_hooks or {}).values())
        saved.append((p, p._cdata, pre, post, dict(p.__dict__)))
    yield
    for p, cdata, pre, post, attrs in saved:
        if p._cdata == cdata:  # not swapped: its hooks are still in place
            continue
        p._backward_hooks = None  # the swapped-in dicts are no longer autograd's
        p._post_accumulate_grad_hooks = None
        for hook in pre:
            p.register_hook(hook)
        for hook in post:
            p.register_post_accumulate_grad_hook(hook)
        for key, value in attrs.items():
            p.__dict__.setdefault(key, value)

