"""``explain_sharding``: what semi-auto parallel made of a model, in the reference's terms.

For each tagged module and sharded operator: its strategy, device matrix, the tensor map of every
input and of the output (with the axes it holds partial sums over), their DTensor placements on
the mesh, and the communication inserted at the last forward (AllGather, AlltoAll, AllReduce,
ReduceScatter per mesh dimension; "none" when the layouts already agreed). Then each parameter's
placements and local shape, and which modules ``hetero.set_device`` put on the host (their
parameters are on the host twin of the mesh). Untagged operators follow DTensor's own
propagation rules.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor import DTensor

from foundation.model_view import ModelView
from parallel.semi_auto.apply import semi_auto_state
from parallel.semi_auto.execute import CallRecord
from parallel.semi_auto.mesh import placements
from parallel.semi_auto.shard import ShardedOp, known_device_num
from parallel.semi_auto.strategy import OpPlan


def _fmt_placements(pl) -> str:
    return "(" + ", ".join(str(p) for p in pl) + ")"


def _describe(name: str, kind: str, in_strategy, out_strategy, plan: OpPlan,
              record: CallRecord, mesh_shape: tuple[int, ...] | None) -> list[str]:
    lines = [f"{name}  [{kind}]  in_strategy={in_strategy}"
             + (f" out_strategy={out_strategy}" if out_strategy is not None else ""),
             f"    device_matrix {plan.device_matrix}"]
    rows = plan.describe_inputs() + [("output", plan.output)]
    if plan.out is not plan.output:
        rows.append(("out_strategy", plan.out))
    for label, layout in rows:
        text = f"    {label:<12} tensor_map {layout.tensor_map}"
        if layout.partial:
            text += f" partial over axes {layout.partial}"
        if mesh_shape is not None:
            text += f"  -> {_fmt_placements(placements(layout, mesh_shape, name))}"
        lines.append(text)
    if not plan.local:
        lines.append("    runs through DTensor's own rule (e.g. masked lookup of a split table)")
    if record.calls:
        comms = record.communication()
        lines.append("    communication at the last call: " + ("; ".join(comms) or "none"))
    else:
        lines.append("    not called yet")
    return lines


def explain_sharding(model_or_op: nn.Module | ShardedOp) -> str:
    """A readable account of layouts, placements and inserted communication (see module doc)."""
    if isinstance(model_or_op, ShardedOp):
        op = model_or_op
        device_num = op.mesh.size() if op.mesh is not None else known_device_num()
        shape = tuple(op.mesh.shape) if op.mesh is not None else None
        return "\n".join(_describe(op.name, "op", op.in_strategy, op.out_strategy,
                                   op.plan(device_num), op.record, shape))
    state = semi_auto_state(model_or_op)
    if state is None and isinstance(model_or_op, ModelView):  # e.g. ShardedDataParallel's view
        state = semi_auto_state(model_or_op.module)
    if state is None:
        raise ValueError(f"explain_sharding: {type(model_or_op).__name__} has not been through "
                         f"parallel.parallelize with strategies")
    shape = tuple(state.mesh.shape)
    lines = [f"semi-auto parallel over {state.device_num} devices: {state.mesh}"]
    if state.host:
        lines.append(f"on the host (hetero.set_device), same layouts on its twin mesh: "
                     f"{', '.join(state.host)}")
    lines.append("tagged modules and operators:")
    for path, (_, tag, plan) in state.modules.items():
        kind = f"nn.{tag.kind}" if hasattr(nn, tag.kind) else tag.kind  # or a library's
        lines += _describe(path or "(model)", kind, tag.in_strategy, tag.out_strategy, plan,
                           tag.record, shape)
    for path, op in state.ops.items():
        lines += _describe(path, op.name, op.in_strategy, op.out_strategy, op.plan(
            state.device_num), op.record, shape)
    lines.append("parameters:")
    for name, param in model_or_op.named_parameters():
        if isinstance(param, DTensor):
            layout = state.param_layouts.get(name)
            origin = f"layout of {layout[1]}" if layout else "replicated (untagged)"
            lines.append(f"    {name:<28} {list(param.shape)} -> local "
                         f"{list(param.to_local().shape)}  {_fmt_placements(param.placements)}"
                         f"  {origin}"
                         + ("  [host]" if param.device_mesh != state.mesh else ""))
    if state.untraced:
        lines.append("not traced by torch.fx (their operators' parameters stay replicated): "
                     + "; ".join(state.untraced))
    lines.append("untagged operators follow DTensor's own sharding rules")
    return "\n".join(lines)
