"""Capture under hetero.place: higher-order regions, lifted constants, threads, and the cache."""

from __future__ import annotations

import copy
import threading
import warnings

import pytest
import torch
from torch import nn

import hetero


class Rotary(nn.Module):
    """Llama's rotary embedding: a ``@torch.no_grad()`` forward reading a buffer."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / (100 ** (torch.arange(0, d, 2).float() / d)))

    @torch.no_grad()
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(x.shape[1], device=x.device).float()
        freqs = torch.outer(pos, self.inv_freq.to(x.device))
        return torch.cat([freqs, freqs], dim=-1).cos()


class RegionModel(nn.Module):
    """A no_grad region, an autocast-disabled region holding a lookup, and a lifted constant."""

    def __init__(self, vocab: int = 20, d: int = 8) -> None:
        super().__init__()
        self.embed, self.rotary, self.out = nn.Embedding(vocab, d), Rotary(d), nn.Linear(d, d)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device_type="cpu", enabled=False):
            h = self.embed(ids) * self.rotary(ids)
        scale = torch.tensor([0.5, 2.0]).repeat(4)  # made in forward: export lifts it
        return self.out(h * scale.to(h.device))


def _twins(factory=RegionModel):
    torch.manual_seed(0)
    model = factory()
    return model, copy.deepcopy(model)


def test_no_grad_and_autocast_regions_and_lifted_constants_place_and_train():
    model, reference = _twins()
    hetero.set_device(model.embed, "cpu")
    placed = hetero.place(model)
    for shape in [(2, 5), (3, 7)]:
        ids = torch.randint(0, 20, shape)
        out, ref = placed(ids), reference(ids)
        torch.testing.assert_close(out.cpu(), ref)
        out.sum().backward()
        ref.sum().backward()
    for (name, p), (_, r) in zip(placed.named_parameters(), reference.named_parameters(),
                                 strict=True):
        torch.testing.assert_close(p.grad.cpu(), r.grad, msg=name)
    # the lookup inside the autocast region still follows its module's tag
    assert [p.modules for p in placed.plan.on("cpu")] == [["embed"]]


def test_a_region_keeps_its_grad_mode():
    model, _ = _twins()
    rotary_only = hetero.place(model.rotary)
    assert not rotary_only(torch.zeros(2, 4, dtype=torch.long)).requires_grad


class Failing(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x).numpy()  # no graph can hold this


def test_a_failed_capture_leaves_the_model_whole():
    model = Failing()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(hetero.CaptureError, match=r"(?s)in module '<root>'.*mode='hooks'"):
        hetero.place(model, (torch.randn(2, 4),))
    for name, value in model.state_dict().items():
        assert value.device.type != "meta", name
        torch.testing.assert_close(value, before[name])


def test_two_threads_capturing_while_a_third_runs_the_model_eagerly():
    model, reference = _twins()
    hetero.set_device(model.embed, "cpu")
    placed = hetero.place(model)
    errors: list[BaseException] = []
    stop = threading.Event()

    def capture_shapes(lengths):
        try:
            for n in lengths:
                ids = torch.randint(0, 20, (2, n))
                torch.testing.assert_close(placed(ids).cpu(), reference(ids))
        except BaseException as err:  # noqa: BLE001 - reported below
            errors.append(err)

    def run_eagerly():
        ids = torch.randint(0, 20, (2, 3))
        try:
            while not stop.is_set():
                torch.testing.assert_close(model(ids), reference(ids))
        except BaseException as err:  # noqa: BLE001
            errors.append(err)

    eager = threading.Thread(target=run_eagerly)
    workers = [threading.Thread(target=capture_shapes, args=(range(s, 12, 2),)) for s in (4, 5)]
    eager.start()
    for w in workers:
        w.start()
    for w in workers:
        w.join(120)
    stop.set()
    eager.join(30)
    assert not errors, errors[0]
    assert all(p.device.type != "meta" for p in model.parameters())
    assert placed._placements.captures == 8


class Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.scale = 1.0

    def forward(self, x: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
        return self.lin(x) * self.scale / temperature


def test_a_float_argument_that_changes_every_call_warns_once_with_the_fix():
    placed = hetero.place(Scaled(), cache_size=4)
    x = torch.randn(2, 4)
    with pytest.warns(RuntimeWarning, match=r"argument \[1\]\['temperature'\] \(a float\) took a "
                                            r"new value.*Pass it as a tensor") as record:
        for i in range(10):
            torch.testing.assert_close(placed(x, temperature=1.0 + i),
                                       placed.model(x, temperature=1.0 + i))
    assert len([w for w in record if w.category is RuntimeWarning]) == 1
    assert len(placed._placements) == 4  # bounded: least recently used dropped


def test_the_cache_is_bounded_and_says_so_when_shapes_churn():
    placed = hetero.place(Scaled(), cache_size=2)
    with pytest.warns(RuntimeWarning, match="2-entry cache is full.*cache_size=N"):
        for n in (1, 2, 3, 1):
            placed(torch.randn(n, 4))
    assert len(placed._placements) == 2 and placed._placements.captures == 4
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        placed(torch.randn(1, 4))  # cached: no capture, no warning
    with pytest.raises(ValueError, match="cache_size must be a positive int"):
        hetero.place(Scaled(), cache_size=0)


def test_changing_a_module_attribute_read_in_forward_recaptures():
    model = Scaled()
    placed = hetero.place(model)
    x = torch.randn(2, 4)
    first = placed(x)
    model.scale = 3.0
    torch.testing.assert_close(placed(x), first * 3.0)
    model.lin.eval()  # a child's train/eval flag is guarded too
    placed(x)
    assert placed._placements.captures == 3


class SharedTable(nn.Module):
    """T5/Bart: ``shared`` holds the table, two other Embeddings look it up, the head is tied."""

    def __init__(self, vocab: int = 30, d: int = 8) -> None:
        super().__init__()
        self.shared = nn.Embedding(vocab, d)
        self.enc_embed, self.dec_embed = nn.Embedding(vocab, d), nn.Embedding(vocab, d)
        self.enc_embed.weight = self.dec_embed.weight = self.shared.weight
        self.unused = nn.Linear(d, d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.shared.weight

    def get_input_embeddings(self) -> nn.Module:
        return self.shared

    def forward(self, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        return self.head(self.enc_embed(src).mean(1, keepdim=True) + self.dec_embed(tgt))


def test_tagging_a_table_that_is_looked_up_through_other_modules_moves_those_lookups():
    model, reference = _twins(SharedTable)
    hetero.set_device(model.get_input_embeddings(), "cpu")
    hetero.set_device(model.unused, "cpu")
    placed = hetero.place(model)
    src, tgt = torch.randint(0, 30, (2, 5)), torch.randint(0, 30, (2, 4))
    out, ref = placed(src, tgt), reference(src, tgt)
    torch.testing.assert_close(out.cpu(), ref)
    out.sum().backward()
    ref.sum().backward()
    torch.testing.assert_close(placed.shared.weight.grad, reference.shared.weight.grad)
    assert sorted(placed.plan.modules_on("cpu")) == ["dec_embed", "enc_embed"]
    assert "head" in placed.plan.modules_on("device")  # a tied head is not a lookup
    text = hetero.explain(placed)
    assert ("'shared' is tagged cpu but ran no operation; 'enc_embed', 'dec_embed' share its "
            "weights and follow its tag") in text
    assert "warning: 'unused' is tagged cpu but ran no operation" in text
