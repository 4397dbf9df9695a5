"""Learning-rate schedules (``optim.schedule``): linear warm-up, then cosine, linear, constant or
warmup-stable-decay (WSD), each a multiplier of ``optim.lr`` per step for ``LambdaLR``.

``cosine`` (the default) and ``linear`` decay from the peak to ``min_lr_ratio`` over the steps
after warm-up; ``constant`` holds the peak; ``wsd`` (MiniCPM's warmup-stable-decay, used for
runs whose length is not known in advance) holds the peak and decays linearly to
``min_lr_ratio`` over the last ``decay_fraction`` of the steps. Each is checked against the
schedule's length: a WSD whose warm-up and decay do not fit is refused by name, and a warm-up as
long as the run (the rate would never reach ``optim.lr``) is reported.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from foundation.validate import check_count, check_number

SCHEDULES = ("cosine", "linear", "constant", "wsd")


def decay_steps(schedule: str, total_steps: int, decay_fraction: float) -> int:
    """The steps at the end of a WSD schedule that decay (0 for the others)."""
    return max(1, round(decay_fraction * total_steps)) if schedule == "wsd" else 0


def check_schedule(schedule: str, warmup_steps: int, total_steps: int,
                   decay_fraction: float) -> str | None:
    """ValueError naming the settings for a schedule that cannot run as set; a note (str) when
    it runs but the rate never reaches its peak; None when it is as asked."""
    if schedule not in SCHEDULES:
        raise ValueError(f"optim.schedule={schedule!r} is not one of {SCHEDULES}")
    if schedule == "wsd":
        decay = decay_steps(schedule, total_steps, decay_fraction)
        if warmup_steps + decay > total_steps:
            raise ValueError(
                f"optim.schedule=wsd: optim.warmup_steps={warmup_steps} and the decay "
                f"(optim.decay_fraction={decay_fraction} of {total_steps} steps = {decay}) do "
                f"not fit in the schedule's {total_steps} steps; lower them, or lengthen the "
                f"run (trainer.max_steps, optim.total_steps)")
    if warmup_steps >= total_steps:
        return (f"optim.warmup_steps={warmup_steps} spans the whole schedule of {total_steps} "
                f"steps: the learning rate peaks at {total_steps / max(warmup_steps, 1):.0%} of "
                f"optim.lr and never decays; set optim.warmup_steps below {total_steps}")
    return None


def lr_factor(schedule: str, warmup_steps: int, total_steps: int, min_ratio: float,
              decay_fraction: float = 0.2) -> Callable[[int], float]:
    """The multiplier of the peak rate for scheduler step ``s`` (``s`` steps already taken)."""
    check_count("lr_factor", "warmup_steps", warmup_steps, low=0)
    check_count("lr_factor", "total_steps", total_steps, low=1)
    check_number("lr_factor", "min_ratio", min_ratio, 0.0)
    if min_ratio > 1:
        raise ValueError(f"lr_factor: invalid min_ratio={min_ratio} (must be <= 1)")
    check_schedule(schedule, warmup_steps, total_steps, decay_fraction)
    decay = decay_steps(schedule, total_steps, decay_fraction)

    def factor(s: int) -> float:
        if s < warmup_steps:
            return (s + 1) / warmup_steps
        if schedule == "constant":
            return 1.0
        if schedule == "wsd":
            into = s - (total_steps - decay)
            return 1.0 if into < 0 else 1.0 - (1.0 - min_ratio) * min(1.0, (into + 1) / decay)
        progress = min(1.0, (s - warmup_steps) / max(1, total_steps - warmup_steps))
        if schedule == "linear":
            return 1.0 - (1.0 - min_ratio) * progress
        return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
    return factor
