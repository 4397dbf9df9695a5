"""hetero.place at run time and at its edges: concurrency, shared parameters, capture failures and
the hooks fallback, auto_place, and bad input."""

from __future__ import annotations

import contextlib
import copy
import threading

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import foundation.device as hd
import hetero
from placement_models import MLP, BigEmbeddingModel, KwargsLM

# --------------------------------------------------------------------------- concurrency

_BARRIER = threading.Barrier(2, timeout=20)


@torch.library.custom_op("hetero_test::rendezvous", mutates_args=())
def rendezvous(x: torch.Tensor) -> torch.Tensor:
    """Waits until a second caller arrives: only concurrent execution can get past it."""
    _BARRIER.wait()
    return x.clone()


@rendezvous.register_fake
def _(x):
    return torch.empty_like(x)


class Branch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return rendezvous(self.linear(h))


class TwoBranches(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp, self.host, self.dev = nn.Linear(8, 8), Branch(), Branch()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        return self.host(h) + self.dev(h)


def test_independent_cpu_and_device_partitions_run_concurrently():
    model = TwoBranches()
    hetero.set_device(model.host, "cpu")
    placed = hetero.place(model, (torch.randn(2, 8),))
    assert [p.device for p in placed.plan] == ["device", "device", "cpu", "device"]
    _BARRIER.reset()
    # A sequential runtime would wait in the first rendezvous forever (BrokenBarrierError).
    out = placed(torch.randn(2, 8))
    assert out.shape == (2, 8)
    _BARRIER.reset()
    with torch.no_grad():  # grad mode travels to the host worker thread
        assert not placed(torch.randn(2, 8)).requires_grad


@torch.library.custom_op("hetero_test::reject_nan", mutates_args=())
def reject_nan(x: torch.Tensor) -> torch.Tensor:
    if torch.isnan(x).any():
        raise ValueError("NaN reached the host branch")
    return x.clone()


@reject_nan.register_fake
def _(x):
    return torch.empty_like(x)


class Checked(nn.Module):
    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return reject_nan(h)


def test_an_error_in_a_host_partition_reaches_the_caller():
    model = nn.Sequential(nn.Linear(4, 4), Checked(), nn.Linear(4, 4))
    hetero.set_device(model[1], "cpu")
    placed = hetero.place(model, (torch.randn(2, 4),))
    assert [p.device for p in placed.plan] == ["device", "cpu", "device"]
    with pytest.raises(ValueError, match="NaN reached the host branch"):
        placed(torch.full((2, 4), float("nan")))
    assert placed(torch.randn(2, 4)).shape == (2, 4)  # and the runner is still usable


# --------------------------------------------------------------------------- shared parameters


class TiedAcrossDevices(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Linear(8, 8)
        self.decoder = nn.Linear(8, 8)
        self.decoder.weight = self.encoder.weight  # one tensor, two modules

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder(torch.tanh(self.encoder(x)))


def test_parameter_tied_across_devices_has_one_home_and_summed_gradients():
    torch.manual_seed(0)
    model = TiedAcrossDevices()
    reference = copy.deepcopy(model)
    hetero.set_device(model.encoder, "cpu")
    placed = hetero.place(model, (torch.randn(3, 8),))
    assert placed.plan.tensor_home["encoder.weight"] == "cpu"
    assert placed.decoder.weight is placed.encoder.weight
    x = torch.randn(3, 8)
    placed(x).sum().backward()
    reference(x).sum().backward()
    torch.testing.assert_close(placed.encoder.weight.grad, reference.encoder.weight.grad)
    assert placed.encoder.weight.grad.device == torch.device("cpu")


def test_contradictory_tags_on_a_shared_parameter_are_refused():
    model = TiedAcrossDevices()
    hetero.set_device(model.encoder, "cpu")
    hetero.set_device(model.decoder, "device")
    before = model.encoder.weight.device
    with pytest.raises(ValueError, match="'encoder.weight' and 'decoder.weight' are one shared "
                                         "tensor.*'encoder' places it on cpu.*'decoder' on device"):
        hetero.place(model, (torch.randn(3, 8),))
    assert model.encoder.weight.device == before


def test_hooks_mode_serves_a_parameter_shared_across_devices_like_graph_mode():
    torch.manual_seed(0)
    model = KwargsLM()  # input embedding and output head share one weight
    reference = copy.deepcopy(model)
    hetero.set_device(model.embed, "cpu")
    placed = hetero.place(model, mode="hooks")
    assert placed.plan.tensor_home["lm_head.weight"] == "cpu"
    assert placed.lm_head.weight is placed.embed.weight
    opts = [torch.optim.AdamW(m.parameters(), lr=0.05) for m in (placed, reference)]
    ids = torch.randint(0, 50, (3, 7))
    for _ in range(3):
        for m, opt in zip((placed, reference), opts, strict=True):
            opt.zero_grad()
            m(input_ids=ids, labels=ids).loss.backward()
            opt.step()
        torch.testing.assert_close(placed.embed.weight.grad, reference.embed.weight.grad)
    assert placed.embed.weight.device == torch.device("cpu")
    assert isinstance(placed.lm_head._parameters["weight"], nn.Parameter)  # given back
    with pytest.raises(ValueError, match="'encoder.weight' and 'decoder.weight' are one shared"):
        contradictory = TiedAcrossDevices()
        hetero.set_device(contradictory.encoder, "cpu")
        hetero.set_device(contradictory.decoder, "device")
        hetero.place(contradictory, mode="hooks")


# --------------------------------------------------------------------------- capture failures


class DataDependent(nn.Module):
    """Python control flow on a tensor's value: no graph can represent it."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 8)
        self.gate = Gate()
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.gate(self.embed(x)))


class Gate(nn.Module):
    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if h.sum() > 0:  # data-dependent branch
            return F.relu(h)
        return -h


def test_uncapturable_model_names_module_line_and_fallback():
    model = DataDependent()
    hetero.set_device(model.embed, "cpu")
    devices = [p.device for p in model.parameters()]
    with pytest.raises(hetero.CaptureError) as err:
        hetero.place(model, (torch.randn(4, 8),))
    message = str(err.value)
    assert "in module 'gate'" in message
    assert "test_placement_runtime.py" in message and "if h.sum() > 0" in message
    assert "mode='hooks'" in message
    assert [p.device for p in model.parameters()] == devices  # untouched


def test_hooks_fallback_trains_like_the_unplaced_model():
    torch.manual_seed(0)
    model = DataDependent()
    reference = copy.deepcopy(model)
    hetero.set_device(model.embed, "cpu")
    placed = hetero.place(model, mode="hooks")
    assert placed.plan.mode == "hooks"
    assert [(p.name, p.device) for p in placed.plan] == [("<root>", "device"), ("embed", "cpu")]
    assert placed.embed.weight.device == torch.device("cpu")
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (placed, reference)]
    for step in range(5):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
        for m, opt in zip((placed, reference), opts, strict=True):
            opt.zero_grad()
            m(x).pow(2).mean().backward()
            opt.step()
    for (n, p), (_, r) in zip(placed.named_parameters(), reference.named_parameters(),
                              strict=True):
        torch.testing.assert_close(p.detach().cpu(), r.detach(), msg=n)
    assert "hooks mode" in hetero.explain(placed)


# --------------------------------------------------------------------------- auto_place


def _model_bytes(model: nn.Module) -> int:
    return sum(2 * p.numel() * p.element_size() for p in model.parameters())


def test_auto_place_moves_the_embedding_when_the_budget_is_below_its_size():
    model = BigEmbeddingModel()
    ids = torch.randint(0, 20_000, (8, 6))
    table_bytes = 2 * model.table.weight.numel() * 4  # weight + gradient
    budget = table_bytes - 1
    placed = hetero.auto_place(model, (ids,), device_memory_budget=budget)
    assert placed.plan.tensor_home["table.weight"] == "cpu"
    assert placed.plan.tensor_home["mlp.0.weight"] == "device"
    assert placed.table.weight.device == torch.device("cpu")
    assert "auto_place: 1 module(s) on the CPU (table)" in hetero.explain(placed)
    reference = BigEmbeddingModel()
    reference.load_state_dict(model.state_dict())
    torch.testing.assert_close(placed(ids), reference(ids))


def test_auto_place_with_a_roomy_budget_moves_nothing():
    model = BigEmbeddingModel()
    ids = torch.randint(0, 20_000, (8, 6))
    placed = hetero.auto_place(model, (ids,), device_memory_budget=10 * _model_bytes(model))
    assert placed.plan.on("cpu") == []


def test_auto_place_weighs_compute_not_only_bytes():
    # mlp.0 holds more bytes than the table, but it is where the FLOPs are.
    model = BigEmbeddingModel(vocab=256, d=32, hidden=256)
    assert model.mlp[0].weight.numel() + 256 > model.table.weight.numel()
    ids = torch.randint(0, 256, (64, 6))
    budget = hetero.placement.device_footprint(model, (ids,)) - 1  # any one move will do
    same_speed = hetero.placement.Rates(host_flops=1e11, device_flops=1e11,
                                        link_bytes_per_s=float("inf"))
    fast_device = hetero.placement.Rates(host_flops=1e9, device_flops=1e13, link_bytes_per_s=1e10)
    picks = {}
    for name, rates in (("same", same_speed), ("fast", fast_device)):
        placed = hetero.auto_place(model, (ids,), device_memory_budget=budget, rates=rates)
        picks[name] = sorted(placed.plan.modules_on("cpu"))
    # With a fast device the compute-light table goes; at equal speeds nothing costs time, and
    # the smallest move that meets the budget is taken (the last layer: 257 parameters).
    assert picks == {"same": ["mlp.2"], "fast": ["table"]}


def test_auto_place_infeasible_budget_names_the_smallest_feasible():
    model = BigEmbeddingModel()
    hetero.set_device(model.mlp, "device")  # an explicit tag is kept: mlp cannot move
    with pytest.raises(ValueError, match=r"device_memory_budget=10 bytes cannot be met: the "
                                         r"smallest feasible budget is \d+ bytes \(modelled with "
                                         r"2 module\(s\) on the CPU: table, <root ops>\)"):
        hetero.auto_place(model, (torch.randint(0, 20_000, (8, 6)),), device_memory_budget=10)
    assert model.table.weight.device == hd.resolve("device")


# --------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("bad", ["TPU", "gpu0", "cuda7x"])
def test_unknown_device_names(bad):
    with pytest.raises(ValueError, match="accepted names are"):
        hetero.set_device(nn.Linear(2, 2), bad)
    with pytest.raises(ValueError, match="accepted names are"):
        with hetero.device_scope(bad):
            pass


def test_tagging_something_that_is_neither_module_nor_op():
    with pytest.raises(TypeError, match="tags an nn.Module or an op"):
        hetero.set_device(42, "cpu")
    with pytest.raises(TypeError, match="device must be"):
        hetero.set_device(nn.Linear(2, 2), 3)


def test_example_inputs_that_do_not_match_forward_leave_the_model_untouched():
    model = KwargsLM()
    hetero.set_device(model.embed, "cpu")
    with pytest.raises(TypeError, match=r"example inputs do not match KwargsLM.forward"):
        hetero.place(model, example_kwargs={"input_idz": torch.zeros(1, 2, dtype=torch.long)})
    with pytest.raises(TypeError, match="places an nn.Module"):
        hetero.place(lambda x: x)
    with pytest.raises(ValueError, match="mode must be 'graph' or 'hooks'"):
        hetero.place(model, mode="fx")


def test_plan_before_capture_says_what_to_do():
    with pytest.raises(RuntimeError, match="call it once, or pass example_inputs"):
        _ = hetero.place(MLP()).plan
    with pytest.raises(TypeError, match="hetero.explain takes"):
        hetero.explain(MLP())


def test_op_tag_still_runs_eagerly():
    host_gelu = hetero.set_device(F.gelu, "cpu")
    x = torch.randn(3)
    torch.testing.assert_close(host_gelu(x), F.gelu(x))
    assert "gelu" in repr(host_gelu)


# --------------------------------------------------------------------------- worker thread state

_SEEN: list[tuple] = []


@torch.library.custom_op("hetero_test::record_thread_state", mutates_args=())
def record_thread_state(x: torch.Tensor) -> torch.Tensor:
    """Records what the thread running it sees: its name, the device layer's current index and
    the host's autocast state."""
    _SEEN.append((threading.current_thread().name, hd.current_device_index(),
                  torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"),
                  hd.current_stream().stream_id))
    return x.clone()


@record_thread_state.register_fake
def _(x):
    return torch.empty_like(x)


class Recorder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return record_thread_state(self.linear(h))


class HostAndDeviceBranches(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp, self.host, self.dev = nn.Linear(8, 8), Recorder(), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        return self.host(h) + self.dev(h)


@pytest.fixture
def device_index_per_thread(monkeypatch):
    """The device layer's current-index query answering per thread, as CUDA's and the NPU's do
    (a fresh thread is on device 0); the caller's thread is put on device 3."""
    local = threading.local()
    monkeypatch.setattr(hd, "current_device_index", lambda: getattr(local, "index", 0))

    @contextlib.contextmanager
    def scope(index):
        before = getattr(local, "index", 0)
        local.index = index
        try:
            yield
        finally:
            local.index = before

    monkeypatch.setattr(hd, "device_index_scope", scope)
    local.index = 3
    return local


def test_the_host_worker_takes_over_the_callers_device_and_autocast(device_index_per_thread):
    """Rank 3 of a node must not send its host partition's rows to device 0, and a host
    partition inside ``torch.autocast`` computes in the autocast dtype as unplaced code does."""
    torch.manual_seed(0)
    model = HostAndDeviceBranches()
    hetero.set_device(model.host, "cpu")
    placed = hetero.place(model, (torch.randn(2, 8),))
    assert [p.device for p in placed.plan] == ["device", "device", "cpu", "device"]
    x = torch.randn(2, 8)
    _SEEN.clear()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = placed(x)
        want = model(x)
    thread, index, autocast, dtype, _ = _SEEN[0]
    assert thread.startswith("hetero-host")  # it did run on the worker
    assert (index, autocast, dtype) == (3, True, torch.bfloat16)
    assert got.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(got, want)
    _SEEN.clear()
    placed(x)  # and the worker does not keep the previous call's state
    assert _SEEN[0][1:3] == (3, False)


@pytest.mark.cuda
def test_the_host_worker_issues_to_the_callers_stream():
    """On a GPU the host partition's copies to the device go to the stream the caller is on."""
    model = HostAndDeviceBranches()
    hetero.set_device(model.host, "cpu")
    placed = hetero.place(model, (torch.randn(2, 8),))
    side = hd.new_stream()
    _SEEN.clear()
    with hd.stream_scope(side):
        placed(torch.randn(2, 8))
    hd.synchronize()
    assert _SEEN[0][0].startswith("hetero-host")
    assert _SEEN[0][-1] == side.stream_id != hd.current_stream().stream_id
