"""A Megatron MLP written by hand for ``mode="hybrid_parallel"``: column- then row-parallel
linears over the model-parallel group, with the collectives in the model itself; and a stack of
such blocks (``Stack`` / ``megatron_stack``) for pipeline stages, each block's collectives over the
``mp`` group of the stage that holds it.

Megatron's conjugate pair keeps every rank of the group on the gradients of the one loss they all
compute: ``copy_to_region`` (f) is the identity forward and all-reduces its gradient backward
(each rank's column slice contributes part of the input's gradient); ``reduce_from_region`` (g)
all-reduces the row slices' partial sums forward and passes the gradient through backward.
``all_reduce`` differentiates as a sum over the ranks' losses, so both are wrapped in a
``torch.autograd.Function``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

import parallel
from parallel import ParallelConfig
from parallel.mesh import batch_mesh
from parallel.nn.moe import MoE

D_IN, HIDDEN, CLASSES, BATCH = 16, 32, 5, 8


class CopyToRegion(torch.autograd.Function):
    """Megatron's f: identity forward, gradient all-reduced over ``group`` backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return parallel.collectives.all_reduce(grad, group=ctx.group), None


class ReduceFromRegion(torch.autograd.Function):
    """Megatron's g: partial sums all-reduced over ``group`` forward, gradient passed through."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        return parallel.collectives.all_reduce(x, group=group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class MLP(nn.Module):
    """The one-process model: LayerNorm -> Linear -> GELU -> Linear (+ bias) -> head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.ln = nn.LayerNorm(D_IN)
        self.fc1 = nn.Linear(D_IN, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, D_IN)
        self.head = nn.Linear(D_IN, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.fc2(F.gelu(self.fc1(self.ln(x)))))


class MegatronMLP(nn.Module):
    """``MLP`` with ``fc1`` split by output rows (column-parallel) and ``fc2`` by input columns
    (row-parallel) over the ``size`` ranks of ``group``; ``fc2``'s bias and the rest replicated.
    The slices are marked with ``parallel.mark_model_parallel``."""

    def __init__(self, full: MLP, group: dist.ProcessGroup, rank: int, size: int) -> None:
        super().__init__()
        self.group = group
        rows = slice(rank * HIDDEN // size, (rank + 1) * HIDDEN // size)
        self.ln = full.ln
        self.fc1_weight = nn.Parameter(full.fc1.weight.detach()[rows].clone())
        self.fc1_bias = nn.Parameter(full.fc1.bias.detach()[rows].clone())
        self.fc2_weight = nn.Parameter(full.fc2.weight.detach()[:, rows].clone())
        self.fc2_bias = full.fc2.bias
        self.head = full.head
        parallel.mark_model_parallel(self.fc1_weight, self.fc1_bias, dim=0)
        parallel.mark_model_parallel(self.fc2_weight, dim=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = CopyToRegion.apply(self.ln(x), self.group)
        h = F.gelu(F.linear(x, self.fc1_weight, self.fc1_bias))
        y = ReduceFromRegion.apply(F.linear(h, self.fc2_weight), self.group) + self.fc2_bias
        return self.head(y)

    def full_state(self) -> dict[str, torch.Tensor]:
        """This rank's slices gathered back into ``MLP``'s parameters."""
        def whole(t: torch.Tensor) -> torch.Tensor:  # an optimizer-parallel shard over dp
            return t.detach().full_tensor() if isinstance(t, DTensor) else t.detach()

        def gather(t: torch.Tensor, dim: int) -> torch.Tensor:
            return parallel.collectives.all_gather(whole(t), dim=dim, group=self.group)

        return {"ln.weight": whole(self.ln.weight), "ln.bias": whole(self.ln.bias),
                "fc1.weight": gather(self.fc1_weight, 0), "fc1.bias": gather(self.fc1_bias, 0),
                "fc2.weight": gather(self.fc2_weight, 1), "fc2.bias": whole(self.fc2_bias),
                "head.weight": whole(self.head.weight), "head.bias": whole(self.head.bias)}


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(50 + step)
    return torch.randn(BATCH, D_IN, generator=g), torch.randint(0, CLASSES, (BATCH,), generator=g)


def reference(steps: int, lr: float = 0.1) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Losses and final parameters of ``MLP`` on the whole batch in one process (SGD)."""
    return train_whole(MLP(), steps, lr)


def train_whole(model: nn.Module, steps: int, lr: float
                ) -> tuple[list[float], dict[str, torch.Tensor]]:
    """``model`` trained in one process on the whole batch (SGD with momentum): its losses and
    final parameters, the references the parallel runs are compared with."""
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    losses = []
    for step in range(steps):
        x, y = batch(step)
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def train_on_ranks(wrapped: nn.Module, resolved: ParallelConfig, steps: int, lr: float = 0.1
                   ) -> list[float]:
    """``wrapped`` (what ``parallelize`` returned for the resolved config ``resolved``) trained
    ``steps`` SGD steps with momentum, each batch rank (``dp × ep``) feeding its slice of
    ``batch(step)``: the step's losses averaged over the slices, as ``train_whole``'s."""
    staged = resolved.pipeline_degree > 1
    ranks = batch_mesh(resolved)
    per = BATCH // resolved.batch_ranks
    start = ranks.get_local_rank() * per
    opt = torch.optim.SGD(wrapped.parameters(), lr=lr, momentum=0.9)
    losses = []
    for step in range(steps):
        x, y = batch(step)
        x, y = x[start:start + per], y[start:start + per]
        opt.zero_grad()
        if staged:  # the step's loss, averaged over the slices
            loss = wrapped.step(x, target=y)
        else:
            loss = F.cross_entropy(wrapped(x), y)
            loss.backward()
            loss = loss.detach().clone()
            if resolved.batch_ranks > 1:
                dist.all_reduce(loss, group=ranks.get_group())
                loss /= resolved.batch_ranks
        opt.step()
        losses.append(loss.item())
    return losses


# ------------------------------------------------------------------ a stack for pipeline stages
class Block(nn.Module):
    """One residual MLP block: LayerNorm -> Linear -> GELU -> Linear (+ bias)."""

    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(D_IN)
        self.fc1 = nn.Linear(D_IN, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, D_IN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.ln(x))))


class MegatronBlock(nn.Module):
    """``Block`` with ``fc1`` column- and ``fc2`` row-parallel over ``group`` (as ``MegatronMLP``);
    its parameter names are ``Block``'s. Built from ``full``'s values, or, with ``full=None``,
    fresh (under ``torch.device("meta")``: deferred initialization gives each slice its part of
    the whole ``Block``'s tensors, by the marks' ``dim``)."""

    def __init__(self, full: Block | None, group: dist.ProcessGroup, rank: int, size: int
                 ) -> None:
        super().__init__()
        self.group = group
        self.ln = full.ln if full is not None else nn.LayerNorm(D_IN)
        self.fc1 = nn.Linear(D_IN, HIDDEN // size)
        self.fc2 = nn.Linear(HIDDEN // size, D_IN)
        if full is not None:
            rows = slice(rank * HIDDEN // size, (rank + 1) * HIDDEN // size)
            with torch.no_grad():
                self.fc1.weight.copy_(full.fc1.weight[rows])
                self.fc1.bias.copy_(full.fc1.bias[rows])
                self.fc2.weight.copy_(full.fc2.weight[:, rows])
                self.fc2.bias.copy_(full.fc2.bias)
        parallel.mark_model_parallel(self.fc1, dim=0)
        parallel.mark_model_parallel(self.fc2.weight, dim=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.fc1(CopyToRegion.apply(self.ln(x), self.group)))
        y = ReduceFromRegion.apply(F.linear(h, self.fc2.weight), self.group) + self.fc2.bias
        return x + y


class MoEBlock(nn.Module):
    """A residual MoE block (``parallel.nn.MoE``, 4 experts, dropless, no balancing loss): the
    framework's expert parallel inside a model that writes its own tensor parallel."""

    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(D_IN)
        self.moe = MoE(D_IN, HIDDEN, 4, dropless=True, aux_loss_factor=0.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.moe(self.ln(x))


class Stack(nn.Module):
    """The one-process model of the pipeline and expert cases: embed, ``layers`` blocks (every
    second one an ``MoEBlock`` with ``moe``), head; as a pipeline stage, the parts another stage
    holds are None and skipped."""

    def __init__(self, layers: int = 4, moe: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(D_IN, D_IN)
        self.blocks = nn.ModuleList(MoEBlock() if moe and i % 2 else Block()
                                    for i in range(layers))
        self.head = nn.Linear(D_IN, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return x if self.head is None else self.head(x)


def megatron_stack(group: dist.ProcessGroup, rank: int, size: int, moe: bool = False,
                   fresh: bool = False) -> Stack:
    """``Stack(moe=moe)`` with every dense block made a ``MegatronBlock`` over ``group`` (this
    rank's slices): the pipeline keeps a stage's blocks, whose collectives then span the stage's
    mp; MoE blocks stay whole (replicated over mp, expert-parallel over ep). ``fresh``: the
    slices are built new, not cut from the whole blocks (a meta model's)."""
    model = Stack(moe=moe)
    for i, block in enumerate(model.blocks):
        if isinstance(block, Block):
            model.blocks[i] = MegatronBlock(None if fresh else block, group, rank, size)
    return model


#: the tensors a ``MegatronBlock`` cuts, and along which dimension
_CUT = {"fc1.weight": 0, "fc1.bias": 0, "fc2.weight": 1}


def gathered(model: nn.Module, group: dist.ProcessGroup) -> dict[str, torch.Tensor]:
    """The parameters ``model`` holds (a pipeline stage's), shards over dp and slices over
    ``group`` gathered back whole: ``Stack``'s names and shapes."""
    out = {}
    for name, param in model.named_parameters():
        value = param.detach()
        if isinstance(value, DTensor):  # an optimizer-parallel shard over dp
            value = value.full_tensor()
        dim = _CUT.get(".".join(name.split(".")[-2:]))  # by name: a shard's face is unmarked
        if dim is not None:
            value = parallel.collectives.all_gather(value, dim=dim, group=group)
        out[name] = value.clone()
    return out


def stack_reference(steps: int, lr: float = 0.1, moe: bool = False
                    ) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Losses and final parameters of ``Stack(moe=moe)`` on the whole batch in one process
    (SGD)."""
    return train_whole(Stack(moe=moe), steps, lr)
