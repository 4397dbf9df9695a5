"""A placed model re-capturing on every call (a Python float that keeps changing) holds its memory
flat: the capture cache stays at its size and nothing else a capture made outlives it (fx's
generated sources and their ``linecache`` entries, fake tensors' dispatch-cache entries).

Captures take ~0.1-0.4 s each on a quiet 2-core machine, so 2000 of them do not fit a test:
the churn runs as many captures as fit ``BUDGET_S`` (at most 2000), fits a line to the RSS
sampled after a warm-up, and bounds the growth that slope extrapolates to over 2000 captures by
5 MiB (before the fix: ~0.05 MiB per capture, ~95 MiB per 2000). It runs in a fresh interpreter
so the test process's own memory does not interfere.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

BUDGET_S, WARMUP, STEPS, LIMIT_MIB = 25.0, 40, 2000, 5.0

_CHURN = textwrap.dedent("""
    import gc, json, sys, time, warnings
    import psutil, torch
    from torch import nn
    import hetero

    class Tempered(nn.Module):
        def __init__(self):
            super().__init__()
            self.host, self.out = nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x, temperature: float = 1.0):
            return self.out(torch.tanh(self.host(x))) / temperature

    warnings.simplefilter("ignore")  # the re-capture warning is the point here
    torch.manual_seed(0)
    model = Tempered()
    hetero.set_device(model.host, "cpu")
    placed = hetero.place(model)
    x, proc = torch.randn(2, 8), psutil.Process()
    budget, warmup, steps = float(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    samples, start = [], None
    for step in range(steps):
        placed(x, temperature=1.0 + step * 1e-3)
        if step == warmup:
            start = time.monotonic()
        if step >= warmup and step % 5 == 0:
            gc.collect()
            samples.append((step, proc.memory_info().rss / 2**20))
            if time.monotonic() - start > budget:
                break
    print(json.dumps({"samples": samples, "cached": len(placed._placements),
                      "captures": placed._placements.captures}))
""")


def _slope(samples: list[list[float]]) -> float:
    n = len(samples)
    mx = sum(s for s, _ in samples) / n
    my = sum(m for _, m in samples) / n
    return (sum((s - mx) * (m - my) for s, m in samples)
            / sum((s - mx) ** 2 for s, _ in samples))


@pytest.mark.slow
def test_capture_churn_keeps_memory_flat():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
         os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", _CHURN, str(BUDGET_S), str(WARMUP), str(STEPS)],
                          capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    samples = result["samples"]
    assert result["cached"] == 8 and result["captures"] > WARMUP + 50, result
    measured = samples[-1][0] - samples[0][0]
    growth = _slope(samples) * STEPS
    assert growth < LIMIT_MIB, (
        f"RSS grows {growth:.1f} MiB per {STEPS} captures (slope fitted over {measured} captures "
        f"after {WARMUP} of warm-up: {samples[0][1]:.1f} -> {samples[-1][1]:.1f} MiB)")
