"""The offloaded optimizer's pinned buffers are cut so the caching host allocator's rounding to
powers of two wastes a bounded share (issue 24, finding 12): the arithmetic here, and the arenas
the optimizer builds when pinning is possible (emulated: no accelerator on this machine)."""

from __future__ import annotations

import random

import pytest
import torch

import foundation.device as hd
from hetero.optim import OffloadAdamW
from hetero.optim.pinned_chunks import MAX_WASTE, chunk_sizes, pinned_elements, rounded


def test_rounded_is_the_allocator_s_next_power_of_two():
    assert [rounded(n) for n in (0, 1, 2, 3, 5, 1024, 1025)] == [0, 1, 2, 4, 8, 1024, 2048]


def test_one_flat_buffer_can_waste_almost_half():
    numels = [2**20 + 1]  # one element past a power of two
    assert pinned_elements(numels, [1]) == 2**21


@pytest.mark.parametrize("seed", range(20))
def test_every_closed_chunk_is_within_the_bound(seed):
    rng = random.Random(seed)
    numels = [rng.choice([rng.randint(1, 4096), rng.randint(1, 2**20)])
              for _ in range(rng.randint(1, 60))]
    sizes = chunk_sizes(numels)
    assert sum(sizes) == len(numels) and all(s >= 1 for s in sizes)
    start, chunks = 0, []
    for size in sizes:
        chunks.append(sum(numels[start:start + size]))
        start += size
    for n in chunks[:-1]:
        assert rounded(n) - n <= MAX_WASTE * n
    bound = (1 + MAX_WASTE) * sum(chunks[:-1]) + rounded(chunks[-1])
    assert pinned_elements(numels, sizes) <= bound


def test_a_typical_model_pins_far_less_than_one_rounded_buffer():
    """GPT-2 medium's shapes: 24 blocks of d=1024 and an embedding of 50257 rows (354 M
    parameters: one buffer would pin 537 M)."""
    d = 1024
    block = [d, d, 3 * d * d, 3 * d, d * d, d, d, d, 4 * d * d, 4 * d, 4 * d * d, d]
    numels = [50257 * d] + block * 24
    total = sum(numels)
    chunked = pinned_elements(numels, chunk_sizes(numels))
    assert rounded(total) / total > 1.5  # the one flat buffer's waste
    assert chunked / total < 1 + 2 * MAX_WASTE


def test_bad_bounds_are_refused():
    with pytest.raises(ValueError, match="max_waste"):
        chunk_sizes([4], max_waste=0)


def test_the_optimizer_cuts_its_pinned_arenas_where_pinning_happens(monkeypatch):
    """Emulated pinning: the bf16 weights are "device" weights and their FP32 state offloaded."""
    monkeypatch.setattr(hd, "can_pin", lambda: True)
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self, *a: self.clone())
    monkeypatch.setattr(hd, "pinned_empty",
                        lambda shape, dtype: torch.empty(shape, dtype=dtype))
    params = [torch.nn.Parameter(torch.randn(n)) for n in (1000, 24, 1000, 48, 1000)]
    opt = OffloadAdamW(params, lr=0.1, param_dtype=torch.bfloat16, kernel="torch")
    arenas = {id(s.arena): s.arena for s in opt._all_slots()}
    expected = chunk_sizes([p.numel() for p in params])
    assert [len(a.shapes) for a in arenas.values()] == expected and len(expected) > 1
