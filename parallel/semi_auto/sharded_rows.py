"""``nn.Linear`` on an activation split on a middle dim (the sequence) where DTensor cannot fold it.

Why: a Linear folds a ``(batch, sequence, features)`` input into ``(batch * sequence,
features)`` (``aten.linear``'s decomposition), and torch 2.11's DTensor refuses to fold dims of
which a later one is sharded ("Attempted to flatten multiple dimensions, with dimension 1 being
sharded"): sequence parallel's split activations, and any strategy that splits a middle dim,
reach the Linear that way. 2.13 folds them. Where it cannot (``foundation.compat
.dtensor_folds_sharded_dims``), the split dim is moved to the front for the Linear and back
after: a Linear acts on the last dim only, so its values and gradients are the same, and the
fold then starts with the sharded dim, which 2.11 takes. It costs two copies of the Linear's
activations there (made contiguous: DTensor folds by ``view``, and models ``view`` a Linear's
output), and nothing on 2.13.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.tensor import DTensor, Shard

from foundation.compat import dtensor_folds_sharded_dims

_MOVED = "_hetero_moved_dims"  # per module: the dims the running calls moved, innermost last


def _middle_split(x: Any) -> int | None:
    """The one middle dim (not the first, not the features) ``x`` is split on, when that is
    its only split among the folded dims; else None."""
    if not isinstance(x, DTensor) or x.dim() < 3:
        return None
    split = {p.dim % x.dim() for p in x.placements if isinstance(p, Shard)} - {x.dim() - 1}
    if len(split) != 1:
        return None
    (dim,) = split
    return dim if dim > 0 else None


def _dim_to_move(x: Any) -> int | None:
    """Which dim of a Linear's input to move to the front: the middle dim it is split on; else,
    for a 3-D or wider DTensor not split on its first dim, dim 1 (the sequence): its output's
    gradient may come back split on the sequence (sequence parallel's reduce-scatters it) and
    must fold in backward too."""
    dim = _middle_split(x)
    if dim is not None or not isinstance(x, DTensor) or x.dim() < 3:
        return dim
    split_first = any(isinstance(p, Shard) and p.dim % x.dim() == 0 for p in x.placements)
    return None if split_first else 1


def foldable(x: Any) -> bool:
    """Whether ``x``'s leading dims fold into one on this torch (a plain tensor's always do; a
    DTensor split on a middle dim only on torch >= 2.13)."""
    return dtensor_folds_sharded_dims() or _middle_split(x) is None


def _to_front(module: nn.Module, args: tuple) -> tuple | None:
    dim = _dim_to_move(args[0]) if args else None
    getattr(module, _MOVED).append(dim)
    # contiguous: DTensor folds by ``view``, which a transposed local tensor refuses
    return None if dim is None else (args[0].transpose(0, dim).contiguous(), *args[1:])


def _back(module: nn.Module, _args: tuple, out: Any) -> Any:
    dim = getattr(module, _MOVED).pop()
    return out if dim is None else out.transpose(0, dim).contiguous()  # as a Linear's is


def fold_middle_splits(model: nn.Module) -> None:
    """Give every ``nn.Linear`` of ``model`` the move of the module docstring, where this
    torch's DTensor needs it; call after the other forward hooks are registered (the move runs
    last before the Linear and first after it)."""
    if dtensor_folds_sharded_dims():
        return
    for module in model.modules():
        if isinstance(module, nn.Linear) and not hasattr(module, _MOVED):
            setattr(module, _MOVED, [])
            module.register_forward_pre_hook(_to_front)
            module.register_forward_hook(_back, prepend=True)
