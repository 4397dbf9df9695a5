"""What this torch can run, for tests whose paths the project refuses by name on older torch.

The lent GPU machines carry torch 2.11, where two paths are refused at the build with a
ValueError naming the version (``foundation.compat``): the zero-bubble schedule over gloo (2.11
sends between the two stages a rank holds through the process group, and gloo connects no rank
to itself) and optimizer parallel over semi-auto strategies (FSDP2's SPMD mode is 2.13's). Their
tests skip there with that refusal as the reason, and the shared spawns that hold such a case
leave it out, so the other cases of the file still run. A test of the refusal itself does not
use these.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import pytest

from foundation import compat


def _refusal(check: Callable[[], Any]) -> str | None:
    try:
        check()
    except ValueError as refused:
        return str(refused)
    return None


#: why zbv cannot run over gloo on this torch, or None where it can
ZBV_OVER_GLOO = _refusal(lambda: compat.check_stages_on_one_rank("gloo"))
#: why optimizer parallel over semi-auto strategies cannot run on this torch, or None
SPMD_SHARDING = _refusal(lambda: compat.fsdp_mesh_dims(("dp",), None))

needs_zbv_over_gloo = pytest.mark.skipif(ZBV_OVER_GLOO is not None,
                                         reason=ZBV_OVER_GLOO or "")
needs_spmd_sharding = pytest.mark.skipif(SPMD_SHARDING is not None,
                                         reason=SPMD_SHARDING or "")


def is_zbv(case: Any) -> bool:
    """Whether ``case`` (a schedule name, a case name, a ParallelConfig, a dict of its fields or
    a list of recipe overrides) runs the zbv schedule."""
    if isinstance(case, str):
        return "zbv" in case
    if isinstance(case, dict):
        return str(case.get("schedule", "")) == "zbv"
    if isinstance(case, (list, tuple)):
        return any(is_zbv(part) for part in case)
    return str(getattr(case, "schedule", "")) == "zbv"


def runs_here(case: Any) -> bool:
    """Whether ``case`` (as :func:`is_zbv` reads it) runs over gloo on this torch."""
    return ZBV_OVER_GLOO is None or not is_zbv(case)


def zbv_params(cases: Iterable[Any]) -> list[Any]:
    """``cases`` for ``pytest.mark.parametrize`` (a tuple: one value per argument), each zbv
    one skipped where this torch refuses it over gloo."""
    return [case if runs_here(case) else
            pytest.param(*case if isinstance(case, tuple) else (case,), marks=needs_zbv_over_gloo)
            for case in cases]
