"""``ShardedHostAdamW``: AdamW over host-resident weights with its moments sharded over the data
ranks — optimizer parallel level1 (ZeRO-1) on the host tier, as DeepSpeed's ZeRO-Offload runs
stage 1 with ``offload_optimizer``.

Under parameter offload (:class:`hetero.offload.ParamOffload`) every rank holds the whole model's
FP32 weights and averaged gradients in host memory. Adam's two moments are the largest part
(8 B per parameter); here each rank keeps them for its own share only. Every param group's
parameters are laid end to end in one flat space, cut into one equal range per rank; a step
updates, in place, the slices of the weights that fall in this rank's range (torch's fused AdamW
on each run of slices with gradients and one step count: an update is elementwise, so the bits
are those of the unsharded update), then every rank's range is all-gathered into every rank's
weights. Host memory per rank: weights and gradients (8 B per parameter) plus ``8 / ranks`` B of
moments.

``state_dict()`` is ``torch.optim.AdamW``'s (whole moments, gathered from every rank for the
moment it is saved), so a checkpoint resumes into any tier, at any number of ranks;
``load_state_dict`` keeps this rank's share.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist

from foundation.compat import fused_adam_
from foundation.errors import collective_guard

#: what ``self.state`` says of the moments between state dicts (module ``_mark``)
_PLACEHOLDERS = {"exp_avg": torch.empty(0), "exp_avg_sq": torch.empty(0)}
_WHAT = "sharded host optimizer's weight all_gather (optimizer parallel level1 on the host)"


@dataclasses.dataclass(eq=False)
class _Slice:
    """The part of one parameter in this rank's range: its elements [lo, hi) and where they
    sit in the range."""

    param: torch.nn.Parameter
    lo: int
    hi: int
    at: int


@dataclasses.dataclass(eq=False)
class _Range:
    """One param group's flat space, and this rank's range of it with its moments."""

    params: list[torch.nn.Parameter]
    share: int  # elements per rank (the last ranks may hold fewer real ones)
    slices: list[_Slice]
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor


class ShardedHostAdamW(torch.optim.Optimizer):
    """AdamW with its moments sharded over ``group`` (module docstring); the parameters are host
    tensors, equal on every rank of ``group`` (each rank steps the same averaged gradients)."""

    def __init__(self, params: Iterable[Any], lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, *, group: dist.ProcessGroup | None = None) -> None:
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        amsgrad=False, maximize=False, foreach=None, capturable=False,
                        differentiable=False, fused=True, decoupled_weight_decay=True)
        super().__init__(params, defaults)
        self.group = group
        self.rank, self.ranks = dist.get_rank(group), dist.get_world_size(group)
        for index, g in enumerate(self.param_groups):
            for p in g["params"]:
                if p.device.type != "cpu" or type(p.data) is not torch.Tensor \
                        or p.dtype != torch.float32 or not p.is_contiguous():
                    raise ValueError(
                        f"ShardedHostAdamW: param group {index} holds a {type(p.data).__name__} "
                        f"of {p.dtype} on {p.device}; it steps contiguous FP32 host tensors "
                        f"(the weights ParamOffload keeps at rest)")
        self._ranges = [self._range(g["params"]) for g in self.param_groups]
        self._steps: dict[int, int] = collections.defaultdict(int)  # id(param) -> its steps
        self._mark()

    def _mark(self) -> None:
        """``self.state`` holds each parameter's step count and an empty placeholder per moment
        (the moments are this rank's share, in :attr:`_ranges`). Never empty, so DCP's
        ``get_state_dict`` does not run its zero-gradient "initialise the state" step on it;
        every key there, because DCP's flattened loading reads a parameter's state keys from
        ``optimizer.state``."""
        self.state = collections.defaultdict(dict, {
            p: {"step": torch.tensor(float(self._steps[id(p)])), **_PLACEHOLDERS}
            for g in self.param_groups for p in g["params"]})

    def _range(self, params: list[torch.nn.Parameter]) -> _Range:
        total = sum(p.numel() for p in params)
        share = -(-total // self.ranks)
        a, b = self.rank * share, min((self.rank + 1) * share, total)
        slices, start = [], 0
        for p in params:
            lo, hi = max(a, start), min(b, start + p.numel())
            if lo < hi:
                slices.append(_Slice(p, lo - start, hi - start, lo - a))
            start += p.numel()
        return _Range(params, share, slices, torch.zeros(max(b - a, 0)),
                      torch.zeros(max(b - a, 0)))

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Update this rank's share of the weights, then gather every rank's share."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group, mine in zip(self.param_groups, self._ranges, strict=True):
            stepped = [p for p in group["params"] if p.grad is not None]
            for p in stepped:
                self._steps[id(p)] += 1
            beta1, beta2 = group["betas"]
            for s in mine.slices:
                if s.param.grad is None:
                    continue
                n = s.hi - s.lo
                fused_adam_(s.param.view(-1)[s.lo:s.hi], s.param.grad.view(-1)[s.lo:s.hi],
                            mine.exp_avg[s.at:s.at + n], mine.exp_avg_sq[s.at:s.at + n],
                            self._steps[id(s.param)], lr=float(group["lr"]), beta1=beta1,
                            beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"],
                            decoupled=True)
            self._gather(mine)
        self._mark()
        return loss

    def _gather(self, mine: _Range) -> None:
        """Every rank's share of the weights into every rank's weights: packed into one padded
        buffer whose per-rank parts the all-gather fills in place, then unpacked."""
        total = sum(p.numel() for p in mine.params)
        padded = torch.empty(mine.share * self.ranks)
        padded[total:].zero_()
        torch.cat([p.detach().reshape(-1) for p in mine.params], out=padded[:total])
        parts = list(padded.chunk(self.ranks))
        with collective_guard(_WHAT, self.group):  # (its input may not alias an output)
            dist.all_gather(parts, parts[self.rank].clone(), group=self.group)
        start = 0
        for p in mine.params:
            p.detach().view(-1).copy_(padded[start:start + p.numel()])
            start += p.numel()

    # ------------------------------------------------------------------ state
    def _whole_moments(self, mine: _Range) -> torch.Tensor:
        """Both moments of every rank's share, gathered: [2, share × ranks]."""
        local = torch.zeros(2, mine.share)
        local[0, :mine.exp_avg.numel()] = mine.exp_avg
        local[1, :mine.exp_avg_sq.numel()] = mine.exp_avg_sq
        parts = [torch.zeros_like(local) for _ in range(self.ranks)]
        with collective_guard("sharded host optimizer's state all_gather", self.group):
            dist.all_gather(parts, local, group=self.group)
        return torch.cat(parts, dim=1)

    def state_dict(self) -> dict[str, Any]:
        """``torch.optim.AdamW``'s layout, the moments gathered whole (module docstring)."""
        whole_state: dict[torch.Tensor, dict[str, torch.Tensor]] = {}
        for mine in self._ranges:
            moments = self._whole_moments(mine)
            start = 0
            for p in mine.params:  # every parameter, stepped or not: DCP loads into this
                part = moments[:, start:start + p.numel()]  # layout, so it must be whole
                whole_state[p] = {"step": torch.tensor(float(self._steps[id(p)])),
                                  "exp_avg": part[0].clone().view_as(p),
                                  "exp_avg_sq": part[1].clone().view_as(p)}
                start += p.numel()
        kept, self.state = self.state, collections.defaultdict(dict, whole_state)
        try:
            return super().state_dict()
        finally:
            self.state = kept

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Take the hyperparameters and this rank's share of the moments."""
        saved = state_dict["state"]
        ids = [pid for group in state_dict["param_groups"] for pid in group["params"]]
        super().load_state_dict({"state": {}, "param_groups": state_dict["param_groups"]})
        ours = [p for group in self.param_groups for p in group["params"]]
        entries = {id(p): saved.get(pid, {}) for p, pid in zip(ours, ids, strict=True)}
        for mine in self._ranges:
            mine.exp_avg.zero_()
            mine.exp_avg_sq.zero_()
            for s in mine.slices:
                entry = entries[id(s.param)]
                n = s.hi - s.lo
                for key, into in (("exp_avg", mine.exp_avg), ("exp_avg_sq", mine.exp_avg_sq)):
                    if key in entry:
                        into[s.at:s.at + n].copy_(entry[key].reshape(-1)[s.lo:s.hi])
        for p in ours:
            self._steps[id(p)] = int(entries[id(p)].get("step", 0))
        self._mark()
