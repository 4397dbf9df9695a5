"""``parallel.nn.MoE``: a drop-in FFN of ``num_experts`` experts, ``top_k`` per token.

Forward: route (:mod:`.router`), sort the kept token-choices by expert, run each expert on its
tokens (:mod:`.experts`), scale by the routing weights and add each token's results back in its
place. ``moe.aux_loss`` holds the load-balancing loss of the last forward (add it to the
training loss; detached once backward has passed through it), ``moe.dropped`` how many
token-choices exceeded capacity, ``moe.load`` the token-choices each expert was sent.
``dropless=True`` drops nothing (no capacity).

Under ``parallel.parallelize`` with ``ParallelConfig(expert_degree=N)`` the layer is expert-parallel
(``parallel.expert.experts``): its stacked experts are sharded over the ``ep`` ranks, the kept
rows go to their experts and back by all-to-all (:mod:`.exchange`), and routing is agreed over
all the ranks that split the batch (:mod:`.token_plan`), so ``aux_loss``, ``dropped`` and
``load`` are the global batch's and the outputs equal this layer's on the concatenated batch.
``copies`` (``parallel.multi_copy``) splits the expert work so exchanges overlap compute. On fake
tensors (a pipeline's FLOP-balanced split, stage dry runs) the layer only propagates shapes and
an estimate of its work (:meth:`MoE._shape_only`).
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from torch import nn

from foundation.compat import in_backward, is_fake
from parallel.collectives import all_reduce
from parallel.nn.exchange import ExpertGroups, combine, dispatch, splits_for
from parallel.nn.experts import GroupedExperts, local_part
from parallel.nn.router import TopKRouter
from parallel.nn.token_plan import TokenPlan, copy_bounds, plan_tokens

ROUTERS = ("softmax_topk",)


def _check(d_model: int, d_ff: int, num_experts: int, top_k: int, capacity_factor: float,
           aux_loss_factor: float, router: str) -> None:
    for name, value in (("d_model", d_model), ("d_ff", d_ff), ("num_experts", num_experts),
                        ("top_k", top_k)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"MoE: {name} must be a positive int, got {value!r}")
    if top_k > num_experts:
        raise ValueError(f"MoE: top_k={top_k} exceeds num_experts={num_experts}; a token "
                         f"cannot pick more experts than there are")
    if not capacity_factor > 0:
        raise ValueError(f"MoE: capacity_factor must be > 0, got {capacity_factor!r} (use "
                         f"dropless=True for no capacity limit)")
    if not aux_loss_factor >= 0:
        raise ValueError(f"MoE: aux_loss_factor must be >= 0, got {aux_loss_factor!r}")
    if router not in ROUTERS:
        raise ValueError(f"MoE: router {router!r} is not one of {ROUTERS}")


class MoE(nn.Module):
    """Mixture of experts in place of an FFN (see the module docstring).

    Args:
        d_model, d_ff: the FFN's sizes, per expert.
        num_experts, top_k: experts, and how many each token uses.
        capacity_factor: capacity = ceil(top_k · tokens · factor / experts) per expert.
        aux_loss_factor: scale of the load-balancing loss in ``aux_loss``.
        dropless: no capacity; every choice is computed.
        router: ``"softmax_topk"``.
        balance_bias: aux-loss-free balancing; call :meth:`update_balance` after each step.
        copies: split the expert work into this many token ranges whose exchanges overlap each
            other's compute (MindSpore's ``comp_comm_parallel_degree``; ``parallel.multi_copy``
            sets it). Routing, capacity and the loss still see the whole batch.
    """

    def __init__(self, d_model: int, d_ff: int, num_experts: int, *, top_k: int = 2,
                 capacity_factor: float = 1.1, aux_loss_factor: float = 0.05,
                 dropless: bool = False, router: str = "softmax_topk",
                 balance_bias: bool = False, copies: int = 1) -> None:
        super().__init__()
        _check(d_model, d_ff, num_experts, top_k, capacity_factor, aux_loss_factor, router)
        self.num_experts, self.top_k = num_experts, top_k
        self.capacity_factor, self.dropless = capacity_factor, dropless
        self.copies = copies
        self.router = TopKRouter(d_model, num_experts, top_k, aux_loss_factor, balance_bias)
        self.experts = GroupedExperts(d_model, d_ff, num_experts)
        #: set by expert parallel (``parallel.parallelize`` with ``expert > 1``)
        self.groups: ExpertGroups | None = None
        self.aux_loss = torch.zeros(())
        self.dropped = 0
        self.load = torch.zeros(num_experts, dtype=torch.long)

    @property
    def copies(self) -> int:
        return self._copies

    @copies.setter
    def copies(self, value: int) -> None:
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"MoE: copies must be a positive int, got {value!r}")
        self._copies = value

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if is_fake(x):
            return self._shape_only(x)
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        probs, experts, weights = self.router(tokens)
        groups = self.groups
        plan = plan_tokens(experts, self.num_experts,
                           None if self.dropless else self.capacity_factor, self.copies,
                           groups.batch if groups else None, groups.batch_rank if groups else 0)
        prob_sum = probs.sum(0)
        if groups is not None:  # the loss of the global batch, its gradient split over the ranks
            prob_sum = all_reduce(prob_sum, group=groups.batch)
        self._hold_aux_loss(self.router.aux_loss(plan.load, prob_sum, plan.tokens))
        self.load, self.dropped = plan.load, plan.dropped
        return self._run_experts(tokens, experts, weights, plan).reshape(shape)

    def _hold_aux_loss(self, aux: torch.Tensor) -> None:
        """``aux`` as ``self.aux_loss``, its graph let go once backward has passed through it
        (the value stays, detached).

        Why: that graph reaches back through the whole forward, and wrappers hook it (FSDP2's
        pre-backward hooks hold its state, the state the model and its process groups). Held
        by a module attribute, it closes a reference cycle through autograd's C++ nodes, which
        Python's collector cannot follow: a model dropped after training was never freed, with
        its tensors, process groups and their gloo threads, for the life of the process."""
        if in_backward():  # activation recompute runs this forward again inside backward:
            aux = aux.detach()  # that loss is part of no loss, and its graph would be held
        self.aux_loss = aux  # until the next forward (for good, by a model dropped after it)
        if not aux.requires_grad:
            return
        owner_ref, aux_ref = weakref.ref(self), weakref.ref(aux)  # weak: no cycle of their own

        def let_go(grad: torch.Tensor) -> None:
            owner, held = owner_ref(), aux_ref()
            if owner is not None and held is not None and owner.aux_loss is held:
                owner.aux_loss = held.detach()

        aux.register_hook(let_go)

    def _shape_only(self, x: torch.Tensor) -> torch.Tensor:
        """What shape and FLOP propagation on fake tensors sees (a pipeline's automatic split,
        stage dry runs): routing has sizes no fake tensor knows, so every token goes through
        ``top_k`` experts' worth of work instead; the output is shaped and typed as the real
        one, and ``aux_loss`` is zero."""
        tokens = x.reshape(-1, x.shape[-1])
        # the router's share of the work, its choice shaped as the real one (the cluster
        # planner reads ``top_k`` from it)
        self.router.gate(tokens).topk(self.top_k, dim=-1)
        w1, w2 = local_part(self.experts.w1), local_part(self.experts.w2)
        rows = tokens.to(w1.device)
        out = sum(F.gelu(rows @ w1[0]) @ w2[0] for _ in range(self.top_k))
        self.aux_loss = torch.zeros((), device=x.device)
        return out.to(x.device, x.dtype).reshape(x.shape)

    def _run_experts(self, tokens: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor,
                     plan: TokenPlan) -> torch.Tensor:
        """Each copy's kept choices through their experts, scaled and summed into place. All
        copies' dispatches are issued first; then each copy computes while the next one's rows
        (and the previous one's results) are on the wire."""
        me = self.groups.batch_rank if self.groups else 0
        local = self.groups is None or self.groups.ep_size == 1  # every expert is here
        work = []
        for c, (lo, hi) in enumerate(copy_bounds(tokens.shape[0], self.copies)):
            kept = plan.kept[lo:hi].reshape(-1)
            expert = experts[lo:hi].reshape(-1)[kept]
            order = torch.argsort(expert, stable=True)  # group by expert, token order within
            token_of = torch.arange(lo, hi, device=tokens.device).repeat_interleave(self.top_k)
            token = token_of[kept][order]
            weight = weights[lo:hi].reshape(-1)[kept][order]
            counts = [rank[c] for rank in plan.kept_counts]
            if local:
                work.append((token, weight, tokens[token], counts[me]))
            else:
                splits = splits_for(counts, self.groups)
                work.append((token, weight, dispatch(tokens[token], splits, self.groups), splits))
        results = []
        for _, _, rows, how in work:
            if local:
                results.append(self.experts(rows, how))
            else:
                out = self.experts(rows, how.per_expert, blocks=how.blocks)
                results.append(combine(out, how, self.groups))
        combined = torch.zeros_like(tokens)  # summed into in place: no copy per copy
        for (token, weight, _, _), out in zip(work, results, strict=True):
            combined.index_add_(0, token, out * weight.unsqueeze(1))
        return combined

    def update_balance(self, rate: float = 1e-3) -> None:
        """Aux-loss-free balancing: move the routing bias by ``rate`` from the last forward's
        load (a no-op without ``balance_bias``; the load is the global batch's, so every rank
        moves its bias alike)."""
        self.router.update_bias(self.load, rate)
