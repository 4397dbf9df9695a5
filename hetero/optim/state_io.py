"""``load_state_dict`` for the offloaded optimizers, in ``torch.optim.AdamW``'s layout.

``state_dict()`` needs nothing special: each parameter's state already is ``{"step",
"exp_avg", "exp_avg_sq"}`` (views of the host buffers) plus ``"fp32_master"`` for offloaded
parameters, so it loads into ``torch.optim.AdamW``/``Adam``, which ignore the extra key. Loading
needs care in the other direction: torch's ``Optimizer.load_state_dict`` would cast the moments
to the parameter's dtype (16-bit on the device) and replace our host buffers, so we let it handle
the parameter groups only and copy every tensor into our buffers ourselves, after validating the
whole dict (nothing is applied when anything is wrong).

A dict without ``"fp32_master"`` (one from ``torch.optim.AdamW``) takes the master from the
parameter's current value: load the model's weights first.
"""

from __future__ import annotations

from itertools import chain
from typing import TYPE_CHECKING, Any

import torch

from hetero.optim.param_slots import local

if TYPE_CHECKING:
    from hetero.optim.offload_adam import OffloadAdam

_UNSUPPORTED_FLAGS = ("amsgrad", "maximize")


def _values(value: Any) -> torch.Tensor:
    """A saved state tensor as this rank's values (a sharded parameter's slice)."""
    return local(torch.as_tensor(value) if not isinstance(value, torch.Tensor) else value)


def _validate(opt: OffloadAdam, state_dict: dict[str, Any]) -> dict[int, dict]:
    """Check ``state_dict`` against ``opt``; return its per-parameter state keyed by our slots'
    positions (in param-group order)."""
    if not isinstance(state_dict, dict) or not {"state", "param_groups"} <= set(state_dict):
        raise ValueError("an optimizer state dict has 'state' and 'param_groups' keys")
    saved_groups = state_dict["param_groups"]
    if len(saved_groups) != len(opt.param_groups):
        raise ValueError(f"loaded state dict has {len(saved_groups)} parameter groups, this "
                         f"optimizer has {len(opt.param_groups)}")
    for i, (saved, ours) in enumerate(zip(saved_groups, opt.param_groups, strict=True)):
        if len(saved["params"]) != len(ours["params"]):
            raise ValueError(f"param group {i} has {len(saved['params'])} parameters in the "
                             f"loaded state dict and {len(ours['params'])} here")
        for flag in _UNSUPPORTED_FLAGS:
            if saved.get(flag):
                raise ValueError(f"param group {i} of the loaded state dict has {flag}=True, "
                                 f"which OffloadAdam does not implement")
    saved_ids = list(chain.from_iterable(g["params"] for g in saved_groups))
    params = list(chain.from_iterable(g["params"] for g in opt.param_groups))
    by_position = {}
    for pos, (pid, p) in enumerate(zip(saved_ids, params, strict=True)):
        entry = state_dict["state"].get(pid)
        if not entry:
            continue
        if "max_exp_avg_sq" in entry:
            raise ValueError(f"state of parameter {pid} has max_exp_avg_sq (AMSGrad), which "
                             f"OffloadAdam does not implement")
        for key in ("step", "exp_avg", "exp_avg_sq"):
            if key not in entry:
                raise ValueError(f"state of parameter {pid} has no {key!r}")
        for key in ("exp_avg", "exp_avg_sq", "fp32_master"):
            if key in entry and _values(entry[key]).numel() != local(p).numel():
                raise ValueError(
                    f"state {key!r} of parameter {pid} has {_values(entry[key]).numel()} "
                    f"elements, the parameter has {local(p).numel()} here (shape "
                    f"{tuple(local(p).shape)})")
        by_position[pos] = entry
    return by_position


@torch.no_grad()
def load_state(opt: OffloadAdam, state_dict: dict[str, Any]) -> None:
    """Validate, then load groups (torch's own code) and tensors (into our host buffers)."""
    entries = _validate(opt, state_dict)
    opt._wait_sent()
    offloads = [group["offload"] for group in opt.param_groups]  # how our state is laid out
    torch.optim.Optimizer.load_state_dict(
        opt, {"state": {}, "param_groups": state_dict["param_groups"]})
    for group, offload in zip(opt.param_groups, offloads, strict=True):
        for key, value in opt.defaults.items():
            group.setdefault(key, value)
        group["offload"] = offload
    for pos, slot in enumerate(opt._all_slots()):
        entry = entries.get(pos)
        opt.state[slot.param] = slot.state()
        if entry is None:
            slot.exp_avg.zero_()
            slot.exp_avg_sq.zero_()
            slot.step.zero_()
        else:
            slot.exp_avg.copy_(_values(entry["exp_avg"]).reshape(slot.exp_avg.shape))
            slot.exp_avg_sq.copy_(_values(entry["exp_avg_sq"]).reshape(slot.exp_avg.shape))
            slot.step.fill_(float(entry["step"]))
        if slot.in_place:
            continue
        if entry is not None and "fp32_master" in entry:
            slot.master.copy_(_values(entry["fp32_master"]).reshape(slot.master.shape))
        else:
            slot.master.copy_(slot.tensor)
        slot.tensor.copy_(slot.master)  # the device copy is the master's downcast
        slot.mark_written()
