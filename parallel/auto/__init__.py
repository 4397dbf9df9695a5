"""Automatic parallel (``ParallelConfig(search_mode=...)``), built so far: the cost model
(``cost_model.py``), this machine's device profile (``profile.py``), the planning graph captured
with torch.export (``graph.py``), sharding propagation (``propagate.py``) and
``plan_auto_parallel`` (``plan.py``), which plans without applying, and ``apply.py``, which
``parallel.parallelize`` uses to plan and apply under a ``search_mode``. The searches without
annotations: ``dynamic_programming.py`` (MindSpore's eliminations, exact under the cost model,
with a per-device memory limit) and ``recursive_programming.py`` (bisection, for large device
counts). At cluster scale, ``cluster.py`` (``ClusterSpec``: a two-level machine and its
hierarchical collective prices) and ``cluster_planner.py`` (``plan_cluster``: the 3-D layout of a
transformer job, priced and searched)."""

from parallel.auto.cluster import ClusterSpec
from parallel.auto.cluster_planner import ClusterPlan, plan_cluster, price_cluster_plan
from parallel.auto.cost_model import DEFAULT_PROFILES, Comm, DeviceProfile, redistribution
from parallel.auto.plan import StrategyPlan, load_plan, plan_auto_parallel
from parallel.auto.profile import profile_devices, saved_profile
from parallel.auto.transformer_shape import TransformerShape

__all__ = ["DEFAULT_PROFILES", "ClusterPlan", "ClusterSpec", "Comm", "DeviceProfile",
           "StrategyPlan", "TransformerShape", "load_plan", "plan_auto_parallel",
           "plan_cluster", "price_cluster_plan", "profile_devices", "redistribution",
           "saved_profile"]
