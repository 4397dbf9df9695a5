"""Semi-auto parallel on torch DTensor: per-operator shard strategies become tensor layouts
(device matrix, tensor map), layouts become DTensor placements on one DeviceMesh, and DTensor's
redistribution inserts the communication between operators whose layouts disagree; its autograd
makes the backward communication too.

    parallel.shard(module_or_op, in_strategy, out_strategy=None)       # tag (shard.py)
    parallel.semi_auto.Layout(device_matrix, alias_name)("dp", "None")  # layouts (layout.py)
    parallel.parallelize(model, ParallelConfig(strategies=..., ...))  # or tags (apply.py)
    parallel.semi_auto.explain_sharding(model)                         # (explain.py)

Rules per operator live in rules.py (which ops and modules have one: registry.py), the
strategy -> layout derivation and its checks in strategy.py, layout -> placements and the shared
mesh in mesh.py, running a tagged op in execute.py, finding the parameters a sharded op consumes
in trace.py, the module hooks in hooks.py, module-path strategy maps and files in
strategy_file.py, and sharding rules DTensor lacks on CPU in dtensor_rules.py.
"""

from parallel.semi_auto import dtensor_rules  # noqa: F401  (registers CPU attention rules)
from parallel.semi_auto.apply import parallelize_semi_auto
from parallel.semi_auto.explain import explain_sharding
from parallel.semi_auto.layout import Layout, TensorLayout
from parallel.semi_auto.shard import ShardedOp, shard
from parallel.semi_auto.strategy import derive_plan
from parallel.semi_auto.strategy_file import load_strategy_file

__all__ = [
    "Layout",
    "ShardedOp",
    "TensorLayout",
    "derive_plan",
    "explain_sharding",
    "load_strategy_file",
    "parallelize_semi_auto",
    "shard",
]
