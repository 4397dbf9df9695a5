"""The per-device memory limit of the searches, met by Lagrangian relaxation.

Each byte a candidate holds costs ``price`` seconds; a search run at that price finds the fastest
plan among those holding as little. The smallest price whose plan fits is found by bisection, so
the plan is the fastest the relaxation reaches within the limit. A limit no price meets is refused,
naming the least memory a plan was found to need. Relaxation can miss a constrained optimum that
no price makes optimal (a duality gap): the plan then fits the limit but may be slower than the
best that does. Both searches (dynamic and recursive programming) are run through it.

With the graph's layers given (``recompute_choice.LayerRecompute``), each layer's activation
recompute is chosen at the same price and counted in the plan's memory and time: the plan is
then the fastest combination of layouts and recompute the relaxation reaches (the gap that alike
layers open is repaired layer by layer, ``recompute_choice``).
"""

from __future__ import annotations

from collections.abc import Callable

from parallel.auto.propagate import Decision
from parallel.auto.recompute_choice import LayerRecompute, PricedPlan

Search = Callable[[float], tuple[list[Decision], list[str]]]
#: bisection steps between the last price that did not fit and the first that did
STEPS = 40


def memory(decisions: list[Decision]) -> float:
    """Modelled bytes per device of a plan."""
    return sum(d.candidate.memory for d in decisions)


def within_memory(search: Search, limit: float | None, where: str,
                  recompute: LayerRecompute | None = None) -> tuple[list[Decision], list[str]]:
    """``search(price)`` at the smallest price whose plan holds at most ``limit`` bytes per
    device (``where``: "on 8 devices", "on stage 1's 4 devices", for the error).

    ``recompute`` (the graph's layers, ``recompute_choice.LayerRecompute``): at each price every
    layer also chooses its activation recompute, the plan's memory counts it, and the plan that
    fits is repaired layer by layer (``recompute_choice``); the chosen modes are left in
    ``recompute.modes``."""
    def run(price: float) -> PricedPlan:
        decisions, notes = search(price)
        if recompute is None:
            return PricedPlan(decisions, notes, ())
        return recompute.found((decisions, notes), price)

    def held(found: PricedPlan) -> float:
        return memory(found.decisions) if recompute is None else recompute.held(found)

    found = short = run(0.0)
    if limit is None or held(found) <= limit:
        return _done(found, recompute, None, None, [])
    low, high = 0.0, 1e-12
    while True:
        found = run(high)
        if held(found) <= limit:
            break
        if high > 1e3:
            counted = (" with activation recompute counted (every layer at the mode that "
                       "holds least)" if recompute else "")
            raise ValueError(f"auto parallel: max_device_memory={limit / 2**30:.3f} GiB cannot "
                             f"be met {where}; the least memory a plan found needs is "
                             f"{held(found) / 2**30:.3f} GiB per device{counted}")
        low, high, short = high, high * 10, found
    for _ in range(STEPS):
        middle = (low + high) / 2
        trial = run(middle)
        if held(trial) <= limit:
            high, found = middle, trial
        else:
            low, short = middle, trial
    return _done(found, recompute, short, limit, [
        f"memory limit {limit / 2**30:.3f} GiB per device met at {{held}} GiB (each byte "
        f"priced {high:.3g} s)"])


def _done(found: PricedPlan, recompute: LayerRecompute | None, short: PricedPlan | None,
          limit: float | None, notes: list[str]) -> tuple[list[Decision], list[str]]:
    """The plan, after recompute's repairs, with its notes (``{held}``: its memory in GiB)."""
    if recompute is None:
        used = memory(found.decisions)
    else:
        found = recompute.settle(found, short, limit)
        used = recompute.held(found)
        notes = [*notes, recompute.note(found)]
    return found.decisions, [*found.notes, *(n.format(held=f"{used / 2**30:.3f}")
                                             for n in notes if n)]
