"""Automatic parallel (``ParallelMode.AUTO_PARALLEL``), built so far: the cost model
(``cost_model.py``), this machine's device profile (``profile.py``), the planning graph captured
with torch.export (``graph.py``), sharding propagation (``propagate.py``) and
``plan_auto_parallel`` (``plan.py``), which plans without applying, and ``apply.py``, which
``parallel.parallelize(mode="auto_parallel")`` uses to plan and apply. The searches without
annotations: ``dynamic_programming.py`` (MindSpore's eliminations, exact under the cost model,
with a per-device memory limit) and ``recursive_programming.py`` (bisection, for large device
counts)."""

from parallel.auto.apply import applied_plan
from parallel.auto.cost_model import DEFAULT_PROFILES, Comm, DeviceProfile, redistribution
from parallel.auto.plan import StrategyPlan, load_plan, plan_auto_parallel
from parallel.auto.profile import profile_devices, saved_profile

__all__ = ["DEFAULT_PROFILES", "applied_plan", "Comm", "DeviceProfile", "StrategyPlan", "load_plan",
           "plan_auto_parallel", "profile_devices", "redistribution", "saved_profile"]
