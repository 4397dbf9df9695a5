"""``Layout`` and ``ClusterPlan``: one layout of a transformer job on a cluster (its tensor,
pipeline, data, context and expert degrees, micro-batching, schedule, optimizer level, recompute,
sequence parallel and offload) and that layout priced (``layout_price.price``), which converts to
the ``ParallelConfig`` ``parallelize`` applies (:meth:`ClusterPlan.to_config`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from hetero.offload.policy import OffloadPolicy
from parallel.auto.cluster import ClusterSpec
from parallel.auto.plan import StrategyPlan
from parallel.auto.transformer_shape import TransformerShape


@dataclasses.dataclass(frozen=True)
class Layout:
    tensor: int
    pipeline: int
    data: int
    micro_batch_size: int
    micro_batches: int
    virtual_stages: int = 1
    optimizer_level: str | None = None
    recompute: str = "full"
    optimizer_offload: float = 0.0  # the share of the optimizer state on the host
    params_offload: bool = False  # the weights at rest on the host (offload_price.py)
    context: int = 1  # ranks each sequence is split over (context_price.py)
    #: Megatron's sequence parallel inside the tensor group (Korthikanti et al. 2022)
    sequence_parallel: bool = False
    expert: int = 1  # ranks each MoE layer's experts are sharded over (expert_price.py)

    @property
    def replicas(self) -> int:
        """Ranks averaging the gradients of the layers outside the experts and sharing their
        optimizer shards: data × expert × context."""
        return self.data * self.expert * self.context

    @property
    def devices(self) -> int:
        return self.tensor * self.pipeline * self.replicas

    @property
    def offloads(self) -> bool:
        return bool(self.optimizer_offload or self.params_offload or self.recompute == "offload")

    @property
    def schedule(self) -> str:
        return "1f1b" if self.virtual_stages == 1 or self.pipeline == 1 else "interleaved_1f1b"


@dataclasses.dataclass(frozen=True)
class ClusterPlan:
    """A priced layout (module docstring); ``breakdown`` holds seconds per part of a step."""

    layout: Layout
    shape: TransformerShape
    cluster: ClusterSpec
    global_batch: int
    step_time: float
    memory: float
    tflops_per_device: float
    mfu: float
    breakdown: dict[str, float]
    fits: bool
    search_seconds: float = 0.0
    candidates: int = 1
    operators: StrategyPlan | None = None  # the per-operator search on the tensor group
    host_memory: float = 0.0  # bytes one device keeps in host memory (offload_price.py)

    @property
    def offload_policy(self) -> OffloadPolicy:
        """The ``hetero.offload.OffloadPolicy`` this layout trains with."""
        lay = self.layout
        params = lay.params_offload
        share = 1.0 if params else lay.optimizer_offload
        return OffloadPolicy(params="host" if params else "device",
                             optimizer="host" if share else "device", ratio=share or 1.0,
                             activations="host" if lay.recompute == "offload" else "none")

    @property
    def strategies(self) -> dict[str, tuple[tuple[int, ...], ...]]:
        """The searched per-operator strategies for the whole job: the tensor group's (module
        path -> in_strategy, ``operators``) with each batch split over the data ranks too (the
        first entry's first dimension, as the recipe's strategy files write ``dp``); empty
        without a per-operator search."""
        if self.operators is None:
            return {}
        batch_ranks = self.layout.data * self.layout.expert
        return {key: ((entry[0] * batch_ranks, *entry[1:]), *rest) if entry else
                (entry, *rest) for key, (entry, *rest) in self.operators.strategies.items()}

    def __getattr__(self, name: str) -> Any:  # tensor, pipeline, ... read through the layout
        layout = self.__dict__.get("layout")
        if layout is not None and name in {f.name for f in dataclasses.fields(Layout)} | {
                "schedule"}:
            return getattr(layout, name)
        raise AttributeError(name)

    def explain(self) -> str:
        lay, b = self.layout, self.breakdown
        lines = [
            f"cluster {self.cluster.name}: {self.cluster.nodes} nodes × "
            f"{self.cluster.devices_per_node} = {self.cluster.devices} devices; model "
            f"{self.shape.params / 1e9:.1f} B parameters ({self.shape.layers} layers, hidden "
            f"{self.shape.hidden}, {self.shape.heads} heads, seq {self.shape.seq}); global batch "
            f"{self.global_batch}",
            f"layout: tensor {lay.tensor} × pipeline {lay.pipeline} × data {lay.data}"
            + (f" × context {lay.context}" if lay.context > 1 else "")
            + (f" × expert {lay.expert}" if lay.expert > 1 else "") + "; "
            f"micro-batch {lay.micro_batch_size} × {lay.micro_batches}; {lay.schedule}"
            + (f" (v={lay.virtual_stages})" if lay.virtual_stages > 1 else "")
            + f"; optimizer {lay.optimizer_level or 'replicated'}; recompute {lay.recompute}"
            + ("; sequence parallel" if lay.sequence_parallel else "")
            + (f"; offload {self.offload_policy.describe()}" if lay.offloads else ""),
            f"step {self.step_time:.3f} s: " + ", ".join(f"{k} {v:.3f}" for k, v in b.items()),
            f"{self.tflops_per_device:.0f} TFLOP/s per device (MFU {self.mfu:.0%}); memory "
            f"{self.memory / 2**30:.1f} GiB of {self.cluster.memory / 2**30:.0f} per device"
            + (f"; host {self.host_memory / 2**30:.1f} GiB per device, "
               f"{self.host_memory * self.cluster.devices_per_node / 2**30:.0f} GiB of "
               f"{self.cluster.host_memory / 2**30:.0f} per node" if self.host_memory else "")
            + ("" if self.fits else " — does NOT fit"),
        ]
        if self.candidates > 1:
            lines.append(f"searched {self.candidates} layouts in {self.search_seconds:.2f} s")
        if self.operators is not None:
            ops = self.operators
            split = sum(1 for s in ops.strategies.values() if any(max(e) > 1 for e in s))
            lines.append(f"per-operator strategies: {ops.search_mode} on the tensor group's "
                         f"{ops.device_num} devices priced on the cluster (capture "
                         f"{ops.seconds['capture']:.2f} s, search {ops.seconds['search']:.2f} "
                         f"s): {split} of {len(ops.strategies)} modules tensor-sharded; one "
                         f"micro-batch through every layer on those devices modelled at "
                         f"{ops.cost * 1e3:.1f} ms (the step above prices Megatron's layer)")
        return "\n".join(lines)

    def to_config(self, strategies: Mapping[str, Any] | None = None) -> Any:
        """The ``ParallelConfig`` ``parallelize`` applies: semi-auto with ``strategies`` (the
        per-operator layout inside a layer, e.g. ``conf/strategy/gpt_megatron.yaml`` loaded for
        the plan's degrees; default: the searched ones, :attr:`strategies`) when the tensor
        degree is above 1, else data parallel. A plan priced with sequence parallel needs
        strategies that split the sequence (``conf/strategy/gpt_megatron_sp.yaml``) given."""
        from parallel.config import ParallelConfig

        lay = self.layout
        given = bool(strategies)
        strategies = strategies or self.strategies
        fields: dict[str, Any] = dict(
            data_degree=lay.data, pipeline_degree=lay.pipeline,
            micro_batches=lay.micro_batches if lay.pipeline > 1 else 1,
            schedule=lay.schedule if lay.pipeline > 1 else "1f1b",
            virtual_stages=max(2, lay.virtual_stages),
            enable_parallel_optimizer=lay.optimizer_level is not None,
            optimizer_level=lay.optimizer_level or "level1", context_degree=lay.context,
            expert_degree=lay.expert)
        if lay.tensor > 1:
            preset = "gpt_megatron_sp" if lay.sequence_parallel else "gpt_megatron"
            if not strategies or (lay.sequence_parallel and not given):
                need = ("sequence-parallel strategies (norms and residuals split on the "
                        "sequence; the per-operator search does not choose them)"
                        if lay.sequence_parallel else "the per-operator strategies of a layer")
                raise ValueError(f"ClusterPlan.to_config: tensor degree {lay.tensor} needs "
                                 f"{need}, e.g. load_strategy_file('conf/strategy/{preset}"
                                 f".yaml', dp={lay.data}, mp={lay.tensor})")
            # each data rank feeds its slice (the dataset strategy), except under a sequence
            # split, whose positions that strategy cannot take yet: every rank reads the batch
            fields.update(tensor_degree=lay.tensor,
                          strategies=dict(strategies), full_batch=lay.context > 1)
        return ParallelConfig(**fields)
