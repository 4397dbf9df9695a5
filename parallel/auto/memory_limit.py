"""The per-device memory limit of the searches, met by Lagrangian relaxation.

Each byte a candidate holds costs ``price`` seconds; a search run at that price finds the fastest
plan among those holding as little. The smallest price whose plan fits is found by bisection, so
the plan is the fastest the relaxation reaches within the limit. A limit no price meets is refused,
naming the least memory a plan was found to need. Relaxation can miss a constrained optimum that no
price makes optimal (a duality gap): the plan then fits the limit but may be slower than the best
that does. Both searches (dynamic and recursive programming) are run through it.
"""

from __future__ import annotations

from collections.abc import Callable

from parallel.auto.propagate import Decision

Search = Callable[[float], tuple[list[Decision], list[str]]]
#: bisection steps between the last price that did not fit and the first that did
STEPS = 40


def memory(decisions: list[Decision]) -> float:
    """Modelled bytes per device of a plan."""
    return sum(d.candidate.memory for d in decisions)


def within_memory(search: Search, limit: float | None, where: str
                  ) -> tuple[list[Decision], list[str]]:
    """``search(price)`` at the smallest price whose plan holds at most ``limit`` bytes per
    device (``where``: "on 8 devices", "on stage 1's 4 devices", for the error)."""
    decisions, notes = search(0.0)
    if limit is None or memory(decisions) <= limit:
        return decisions, notes
    low, high = 0.0, 1e-12
    while True:
        decisions, notes = search(high)
        if memory(decisions) <= limit:
            break
        if high > 1e3:
            raise ValueError(f"auto parallel: max_device_memory={limit / 2**30:.3f} GiB cannot "
                             f"be met {where}; the least memory a plan found needs is "
                             f"{memory(decisions) / 2**30:.3f} GiB per device")
        low, high = high, high * 10
    for _ in range(STEPS):
        middle = (low + high) / 2
        found, found_notes = search(middle)
        if memory(found) <= limit:
            high, decisions, notes = middle, found, found_notes
        else:
            low = middle
    return decisions, [*notes, f"memory limit {limit / 2**30:.3f} GiB per device met at "
                               f"{memory(decisions) / 2**30:.3f} GiB (each byte priced "
                               f"{high:.3g} s)"]
