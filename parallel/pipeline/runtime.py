"""``Pipeline``: this rank's stages of a pipelined model, trained with ``pipe.step``.

It *is* this rank's part of the model (a ``ModelView``: ``parameters()``, ``state_dict()`` keys
and optimizers are the original fully-qualified names of the layers this rank holds), and
``step(inputs, target=...)`` runs one training step's forward and backward over all micro-batches
with torch's schedule, then:

* tied parameters held by several stages (an input embedding reused by the output head) get the
  sum of their stages' gradients, over a process group of just the ranks holding them, so the
  copies stay equal under any optimizer;
* data-parallel replicas of a stage average their gradients (``DataParallel``'s bucketed reducer,
  run once after the last micro-batch, not after each);
* the step's mean loss (over micro-batches, and over data-parallel replicas) is returned on every
  rank, broadcast from the rank holding the last stage, plus the MoE layers' balancing losses
  (each stage's, summed over the stages: ``moe_aux.py``).

Without example inputs to dry-run the split on (``verify.py``), the first step checks that every
layer a stage holds actually ran in that stage: a model whose forward skips a part when a
neighbour is missing (a position embedding computed only beside the token embedding) would
otherwise train without it, silently.

The user's ``loss_fn(output, target)`` returns a micro-batch mean; it is divided by the number of
micro-batches inside the schedule so the accumulated gradients are the batch mean's (torch's own
``scale_grads`` would divide a parameter shared by two stages of one rank twice). Under semi-auto's
dataset strategy each data-parallel rank's stage returns its own slice and DTensor sums the
slices' gradients, so the loss is divided by the data-parallel degree too.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

import foundation.device as hd
from foundation.collective_check import check as check_collective
from foundation.model_view import ModelView
from foundation.validate import check_clip_args
from parallel.context_parallel.layout import shard_sequence
from parallel.data.replicas import DataParallel
from parallel.errors import collective_guard
from parallel.grad_clip import group_norms, scale_
from parallel.multi_copy import MultiCopy
from parallel.pipeline.moe_aux import StageAuxLosses
from parallel.pipeline.partition import StagePlan
from parallel.pipeline.schedule import check_batch


@dataclasses.dataclass
class Tie:
    """A parameter several stages hold: its name here, and the group of its holders (None: this
    rank holds every copy, or none)."""

    name: str
    group: dist.ProcessGroup | None
    count_here: bool  # whether this rank counts it in the gradient norm (one holder does)


@dataclasses.dataclass
class PipelineParts:
    """What ``build_pipeline`` made for this rank."""

    plan: StagePlan
    schedule: Any  # torch's schedule object
    stages: list  # torch PipelineStage, one per stage this rank runs
    schedule_name: str
    micro_batches: int
    pp_group: dist.ProcessGroup
    last_rank: int  # global rank holding the last stage, in this rank's pipeline
    ties: list[Tie]
    data_parallel: DataParallel | None
    loss_scale: int  # what loss_fn is divided by: micro-batches (× slices summed by DTensor)
    loss_group: dist.ProcessGroup | None  # ranks feeding their own slices: the loss is averaged
    unchecked: tuple[set[str], list] | None = None  # first-step check: (ran, hook handles)
    aux: StageAuxLosses | None = None  # the model's MoE balancing losses (it has MoE layers)
    #: (this rank's index, degree) of a context split: inputs and targets are cut to its share
    context: tuple[int, int] | None = None


class Pipeline(ModelView):
    """See the module docstring. Built by ``parallel.parallelize(model,
    ParallelConfig(pipeline_degree=P, ...), loss_fn=...)``."""

    def __init__(self, model: nn.Module, parts: PipelineParts, *, dry_run: bool) -> None:
        super().__init__(model)
        object.__setattr__(self, "_parts", parts)
        if not dry_run:  # build_pipeline's dry run on fake tensors already checked the split
            self._watch_units()

    # ------------------------------------------------------------------ info
    @property
    def plan(self) -> StagePlan:
        return self._parts.plan

    @property
    def stages(self) -> list:
        """torch's ``PipelineStage`` objects this rank runs (``.submod`` wraps the stage)."""
        return self._parts.stages

    @property
    def data_parallel(self) -> DataParallel | None:
        """The stage's data-parallel wrapper (None with one replica)."""
        return self._parts.data_parallel

    @property
    def stage_indices(self) -> list[int]:
        """The stages this rank runs."""
        return [stage.stage_index for stage in self.stages]

    @property
    def is_first(self) -> bool:
        return any(stage.is_first for stage in self.stages)

    @property
    def is_last(self) -> bool:
        return any(stage.is_last for stage in self.stages)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("a Pipeline holds only some stages of the model: train it with "
                           "pipe.step(inputs, target=targets), not pipe(inputs)")

    def train(self, mode: bool = True) -> Pipeline:
        super().train(mode)
        for stage in self.stages:
            stage.submod.train(mode)
        return self

    # ------------------------------------------------------------------ first-step check
    def _watch_units(self) -> None:
        modules = dict(self.named_modules())
        ran: set[str] = set()
        handles = []
        for stage in self.stages:
            if _captured(stage.submod.stage):
                continue  # placed: runs a captured graph, which module hooks do not see
            for path in self.plan.stage_units(stage.stage_index):
                handles.append(modules[path].register_forward_pre_hook(
                    lambda *_, path=path: ran.add(path)))
        self._parts.unchecked = (ran, handles)

    def _check_units_ran(self) -> None:
        """After the first step: every held unit ran, on every rank (else ValueError naming it,
        raised on all ranks alike so none waits for the others)."""
        ran, handles = self._parts.unchecked
        self._parts.unchecked = None
        for handle in handles:
            handle.remove()
        mine = [(s.stage_index, path) for s in self.stages
                if not _captured(s.submod.stage)
                for path in self.plan.stage_units(s.stage_index) if path not in ran]
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        idle = sorted({item for found in everyone for item in found})
        if idle:
            stage, path = idle[0]
            raise ValueError(
                f"pipeline stage {stage} holds {path!r} but its forward never ran it "
                f"({len(idle)} such unit(s): {[p for _, p in idle]}): the model's forward skips "
                f"it when a neighbour another stage holds is missing. Tag it into the same stage "
                f"as that neighbour (parallel.pipeline_stage / ParallelConfig.stages)")

    # ------------------------------------------------------------------ step
    def _check_batch(self, what: str, inputs: tuple[torch.Tensor, ...],
                     target: torch.Tensor | None) -> None:
        """The first stage's ranks have the inputs, the last stage's the target, each a batch
        the micro-batches divide (ValueError naming ``Pipeline.<what>`` otherwise)."""
        micro = self._parts.micro_batches
        if self.is_first:
            if not inputs:
                raise ValueError(f"Pipeline.{what}: this rank runs the first stage and needs "
                                 f"the inputs")
            check_batch(inputs[0].shape[0], micro)
        if self.is_last:
            if target is None:
                raise ValueError(f"Pipeline.{what}: this rank runs the last stage and needs "
                                 f"target= for the loss")
            check_batch(target.shape[0], micro)

    def step(self, *inputs: torch.Tensor, target: torch.Tensor | None = None) -> torch.Tensor:
        """Forward and backward of one batch over all micro-batches; returns the mean loss on
        every rank. Ranks of the first stage must pass ``inputs``, ranks of the last ``target``
        (passing both everywhere is fine)."""
        p = self._parts
        self._check_batch("step", inputs, target)
        inputs, target = self._batch_for_stages(inputs, target)
        losses: list[torch.Tensor] = []
        dp = p.data_parallel
        kwargs: dict[str, Any] = {"target": target, "losses": losses} if self.is_last else {}
        with collective_guard("pipeline schedule step (activation send/recv)", p.pp_group,
                              only_backend_errors=True):
            if dp is not None:
                with dp.no_sync():
                    p.schedule.step(*(inputs if self.is_first else ()), **kwargs)
            else:
                p.schedule.step(*(inputs if self.is_first else ()), **kwargs)
        if p.unchecked is not None:
            self._check_units_ran()
        self._sync_ties()
        if dp is not None:
            dp.sync_gradients()
        return self._mean_loss(losses)

    @torch.no_grad()
    def eval_step(self, *inputs: torch.Tensor, target: torch.Tensor | None = None
                  ) -> torch.Tensor:
        """The mean loss of one batch over all micro-batches, forward only (torch's schedule
        ``eval``: no backward, no gradients touched); on every rank, as :meth:`step` returns
        it. The same inputs and targets as :meth:`step`."""
        p = self._parts
        self._check_batch("eval_step", inputs, target)
        inputs, target = self._batch_for_stages(inputs, target)
        losses: list[torch.Tensor] = []
        kwargs: dict[str, Any] = {"target": target, "losses": losses} if self.is_last else {}
        with collective_guard("pipeline evaluation (activation send/recv)", p.pp_group,
                              only_backend_errors=True):
            p.schedule.eval(*(inputs if self.is_first else ()), **kwargs)
        return self._mean_loss(losses)

    def _batch_for_stages(self, inputs: tuple[torch.Tensor, ...], target: torch.Tensor | None
                          ) -> tuple[tuple[torch.Tensor, ...], torch.Tensor | None]:
        """The inputs and the target as torch's schedule is given them: under a context split,
        this rank's tokens (dimension 1, its balanced chunks; each stage then runs on them,
        ``ContextParallel`` stages); and dense. torch's stages check each input's strides
        against those its shape inference recorded for the first micro-batch (always in torch
        2.11, at ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` in 2.13), which 2.11 records dense: a
        language-model loader's inputs, a view of rows one token longer, would fail it."""
        if self._parts.context is not None:
            rank, degree = self._parts.context

            def cut(t: torch.Tensor) -> torch.Tensor:
                return shard_sequence(t, rank, degree) if t.dim() > 1 else t
            inputs, target = tuple(cut(t) for t in inputs), None if target is None else cut(target)
        return (tuple(t.contiguous() for t in inputs),
                None if target is None else target.contiguous())

    def _sync_ties(self) -> None:
        params = dict(self.named_parameters(remove_duplicate=False))
        for tie in self._parts.ties:
            if tie.group is None:
                continue
            grad = params[tie.name].grad
            if grad is None:
                grad = params[tie.name].grad = torch.zeros_like(params[tie.name])
            local = grad.to_local() if isinstance(grad, DTensor) else grad
            with collective_guard(f"pipeline tied-parameter gradient all_reduce ({tie.name})",
                                  tie.group):
                # one label on every stage: a tied weight has another name on each of them
                check_collective("all_reduce", local, tie.group, what="tied-parameter gradient")
                dist.all_reduce(local, group=tie.group)

    def _mean_loss(self, losses: list[torch.Tensor]) -> torch.Tensor:
        p = self._parts
        total = torch.zeros((), dtype=torch.float32, device=hd.resolve("device"))
        if losses:  # each is its micro-batch's mean / loss_scale
            total = torch.stack([loss.detach().float() for loss in losses]).sum() \
                * (p.loss_scale / p.micro_batches)
        with collective_guard("pipeline loss broadcast", p.pp_group):
            if p.loss_group is not None and self.is_last:
                check_collective("all_reduce", total, p.loss_group, what="pipeline loss")
                dist.all_reduce(total, group=p.loss_group)
                total /= dist.get_world_size(p.loss_group)
            check_collective("broadcast", total, p.pp_group, what="pipeline loss",
                             params=(p.last_rank,))
            dist.broadcast(total, src=p.last_rank, group=p.pp_group)
            if p.aux is not None:  # each stage's MoE layers, over the micro-batches
                aux = p.aux.take(p.micro_batches) / p.micro_batches
                check_collective("all_reduce", aux, p.pp_group, what="pipeline MoE aux loss")
                dist.all_reduce(aux, group=p.pp_group)
                total += aux
        return total

    # ------------------------------------------------------------------ clipping
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip every stage's gradients by the norm of the whole model's (each tied parameter
        counted once); returns that total norm on every rank (on this rank's device).

        The norms stay on the device: one per kind of gradient (per mesh of the sharded ones,
        one collective each; per device of the plain ones), summed as squares and reduced over
        the pipeline in one collective; the clip factor is applied without the host reading it.
        """
        check_clip_args("Pipeline.clip_grad_norm_", max_norm, norm_type)
        if norm_type != 2.0:
            raise ValueError(f"Pipeline.clip_grad_norm_ supports norm_type=2, got {norm_type}")
        skip = {t.name for t in self._parts.ties if not t.count_here}
        grads, counted = [], []
        for name, param in self.named_parameters():
            if param.grad is not None:
                grads.append(param.grad)
                if name not in skip:
                    counted.append(param.grad)
        device = hd.resolve("device")
        squares = torch.zeros((), dtype=torch.float32, device=device)
        norms = group_norms(counted, 2.0)
        if norms:
            squares = torch.stack([n.to(device, torch.float32) for n in norms]).square().sum()
        with collective_guard("pipeline gradient-norm all_reduce", self._parts.pp_group):
            check_collective("all_reduce", squares, self._parts.pp_group, what="gradient norm")
            dist.all_reduce(squares, group=self._parts.pp_group)
        total = squares.sqrt()
        scale_(grads, torch.clamp(max_norm / (total + 1e-6), max=1.0))
        return total


def _captured(stage: nn.Module) -> bool:
    """Whether ``stage`` runs a captured graph rather than its modules (a placed stage);
    ``MultiCopy`` calls the stage's own submodules, so their hooks see it."""
    return isinstance(stage, ModelView) and not isinstance(stage, MultiCopy)


class StageRunner(nn.Module):
    """What a ``PipelineStage`` runs: the stage module, with ``None`` entries dropped from a
    tuple output (torch sends and merges tensors only; a model returning ``(logits, None)``
    without targets is common) and a lone remaining tensor unwrapped."""

    def __init__(self, stage: nn.Module) -> None:
        super().__init__()
        self.stage = stage

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        out = self.stage(*args, **kwargs)
        if isinstance(out, (tuple, list)):
            kept = tuple(o for o in out if o is not None)
            return kept[0] if len(kept) == 1 else kept
        return out


def scaled_loss(loss_fn: Callable[[Any, Any], torch.Tensor],
                scale: int) -> Callable[[Any, Any], torch.Tensor]:
    """``loss_fn`` divided by ``scale`` (see the module docstring)."""
    def fn(output: Any, target: Any) -> torch.Tensor:
        return loss_fn(output, target) / scale
    return fn
