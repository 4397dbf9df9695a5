"""``OffloadedStage``: a pipeline stage whose weights may rest on the host between uses.

Parameter offload (``hetero.offload.ParamOffload``) is applied to the stages a rank runs after
the pipeline is built. A full backward brings each layer's weights back through the offload's
layer hooks and lands their gradients on the host as they accumulate. torch's zero-bubble
schedules split backward in two: the input pass (an ``autograd.grad`` to the stage's inputs)
runs those hooks too, and its end lets every layer go; the weight pass then computes the
weights' gradients from the nodes the input pass kept, where no layer hook sees it, and sets
``weight.grad = dw`` itself. Here that pass runs one of torch's parameter groups at a time
(the weights reached from the same kept nodes: a layer or a part of one), each group's weights
brought back for its pass while the next group's start coming, and its gradients landed on the
host like a full backward's (:meth:`ParamOffload.visiting`).

Why both passes are driven here rather than left to torch: torch finds each weight's node in
the graph by asking the weight for its gradient accumulator, and a weight whose data moved to
another device or dtype since the forward (``param.data = ...``, the offload's swap) is given a
new accumulator, not the graph's (torch's ``VariableHooks::set_data``): its input pass would
then leave every layer the offload let go of out of the parameter groups, and their gradients
would never be computed. Here the groups are formed from the accumulators found in the graph
itself (torch's own grouping, ``get_param_groups``), the input pass is torch's, and the weight
pass reads each weight from its accumulator (``.variable``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge
from torch.distributed.pipelining import PipelineStage

from foundation.compat import split_backward
from hetero.offload.param_rules import param_offload_of


class OffloadedStage(PipelineStage):
    """A ``PipelineStage`` whose weight pass brings offloaded weights back (module docstring);
    a stage without parameter offload runs as torch's."""

    def backward_maybe_with_nosync(self, backward_type: str, bwd_kwargs: dict,
                                   last_backward: bool = False) -> Any:
        offload = param_offload_of(self.submod)
        if backward_type == "full" or offload is None:
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
        if backward_type == "input":
            return self._input_pass(bwd_kwargs)
        groups = bwd_kwargs["param_groups"]
        weights = [[node.variable for node in group["params"]] for group in groups]
        for index, group in enumerate(groups):
            ahead = weights[index + 1] if index + 1 < len(weights) else None
            with offload.visiting(weights[index], ahead):
                _weight_pass(group)
        offload.land_gradients()
        return (), None

    def _input_pass(self, bwd_kwargs: dict) -> tuple[tuple, list[dict[str, Any]]]:
        """Torch's input pass, with the parameter groups of the graph's own accumulators; each
        group's nodes keep the gradients they are given, for the weight pass (as torch's
        ``stage_backward_input`` does for the groups it finds)."""
        torch_pass = split_backward()
        outputs = [t for t in bwd_kwargs["stage_output"] if t.grad_fn is not None]
        reverse = torch_pass.construct_reverse_graph([t.grad_fn for t in outputs])
        mine = {id(p) for p in self.submod.parameters()}
        accumulators = [node for node in reverse
                        if id(getattr(node, "variable", None)) in mine]
        inputs = [get_gradient_edge(t).node for t in bwd_kwargs["input_values"]
                  if isinstance(t, torch.Tensor) and t.requires_grad]
        groups = torch_pass.get_param_groups(inputs, accumulators, reverse)
        handles = []
        for group in groups:
            group["intermediates"] = nodes = list(group["intermediates"])
            for index, node in enumerate(nodes):
                handles.append(node.register_prehook(
                    lambda grads, group=group, index=index: _keep(group, index, grads)))
        try:
            grads, _ = torch_pass.stage_backward_input(bwd_kwargs["stage_output"],
                                                       bwd_kwargs["output_grads"],
                                                       bwd_kwargs["input_values"], iter(()))
        finally:
            for handle in handles:
                handle.remove()
        return grads, groups


def _keep(group: dict[str, Any], index: int, grads: tuple) -> None:
    group.setdefault("grads", [None] * len(group["intermediates"]))[index] = grads


def _weight_pass(group: dict[str, Any]) -> None:
    """Torch's weight pass over one parameter group (what ``stage_backward_weight`` computes):
    from the gradients the input pass kept at the group's nodes to its weights, each set on
    (or added to) its weight's ``.grad``."""
    nodes, kept = group.pop("intermediates"), group.pop("grads", None)
    if kept is None:
        return  # no gradient reached the group's nodes in the input pass
    edges, outputs = [], []
    for grads, node in zip(kept, nodes, strict=True):
        for i, grad in enumerate(grads):
            if grad is not None:
                edges.append(GradientEdge(node, i))
                outputs.append(grad)
    if not edges:
        return
    # each node gets the gradient it was given in the input pass, not that plus what flows
    # into it from another of the group's nodes above it (counted once, as torch does)
    handles = ([node.register_prehook(lambda _, grads=grads: grads)
                for grads, node in zip(kept, nodes, strict=True)] if len(nodes) > 1 else [])
    try:
        accumulators = list(group["params"])
        weight_grads = torch.autograd.grad(edges, [GradientEdge(a, 0) for a in accumulators],
                                           grad_outputs=outputs)
    finally:
        for handle in handles:
            handle.remove()
    for accumulator, grad in zip(accumulators, weight_grads, strict=True):
        weight = accumulator.variable
        weight.grad = grad if weight.grad is None else weight.grad + grad
