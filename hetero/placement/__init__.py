"""Heterogeneous placement: capture → assign devices → split → run partitions concurrently."""

from __future__ import annotations

from torch import nn

from foundation.model_view import ModelView, unwrapped
from hetero.placement.auto import Rates, auto_place, device_footprint
from hetero.placement.capture import CaptureError
from hetero.placement.placed import PlacedModule, place
from hetero.placement.plan import Partition, Plan, explain_plan


def explain(placed: nn.Module | Plan) -> str:
    """A readable table of a placed model's plan (partitions, devices, bytes crossing).
    ``placed``: the plan, the model ``hetero.place``/``auto_place`` returned, or any wrapper
    around it (``parallelize``'s ``result.model``: a data-parallel or optimizer-parallel
    wrapper on several ranks, the placed model itself on one)."""
    plan = placed if isinstance(placed, Plan) else next(
        (p for m in unwrapped(placed) if isinstance(p := getattr(m, "plan", None), Plan)),
        None)
    if plan is None:
        raise TypeError(
            f"hetero.explain takes a model returned by hetero.place/auto_place or its plan, "
            f"got {type(placed).__name__}"
        )
    return explain_plan(plan)


__all__ = ["CaptureError", "ModelView", "Partition", "PlacedModule", "Plan", "Rates", "auto_place",
           "device_footprint", "explain", "place"]
