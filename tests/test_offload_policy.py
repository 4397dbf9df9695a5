"""The memory hierarchy on one process: ``hetero.offload``'s policy, parameter offload,
activation offload and a fractional host optimizer train exactly like the run without them, the
device holds at most prefetch + 1 layers' weights, and checkpoints move across settings."""

from __future__ import annotations

import copy
import math
import tempfile

import pytest
import torch

from hetero.offload import OffloadPolicy, ParamOffload, apply_offload
from hetero.optim import OffloadAdamW
from pipeline_helpers import batch, tiny_gpt

STEPS = 3
LR = 1e-2


def _train(policy: OffloadPolicy | None, steps: int = STEPS, accum: int = 1,
           recompute: str = "none", model: torch.nn.Module | None = None,
           state: dict | None = None, start: int = 0
           ) -> tuple[list[float], dict[str, torch.Tensor], dict]:
    """Losses, final weights and (model, optimizer) state of ``steps`` AdamW steps."""
    import parallel

    model = model or tiny_gpt(3)
    if recompute != "none":
        parallel.recompute_layers(model, "blocks.*", recompute)
    if policy is None:
        opt: torch.optim.Optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    else:
        done = apply_offload(model, policy)
        opt = done.optimizer(model.parameters(), lr=LR)
    if state is not None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])
    losses = []
    for step in range(start, start + steps):
        opt.zero_grad()
        for micro in range(accum):
            x, y = batch(step * accum + micro)
            _, loss = model(x, y)
            (loss / accum).backward()
            losses.append(loss.item())
        opt.step()
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    saved = {"model": copy.deepcopy(model.state_dict()),
             "optim": copy.deepcopy(opt.state_dict())}
    return losses, weights, saved


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], exact: bool) -> None:
    """Equal weights: bitwise, or where two optimizer kernels differ in rounding, within what
    Adam makes of that (a key bias's gradient is rounding noise, and Adam scales noise to the
    learning rate: 5e-6 after three steps)."""
    assert a.keys() == b.keys()
    for key in a:
        if exact:
            assert torch.equal(a[key], b[key]), key
        else:
            torch.testing.assert_close(a[key], b[key], rtol=1e-5, atol=1e-5, msg=key)


HOST_ADAM = OffloadPolicy(optimizer="host")
SETTINGS = {  # name -> (policy, the run it equals bit for bit: the same optimizer kernels)
    "params": (OffloadPolicy(params="host", optimizer="host"), HOST_ADAM),
    "params, no prefetch": (OffloadPolicy(params="host", optimizer="host", prefetch=0),
                            HOST_ADAM),
    "params, prefetch 2": (OffloadPolicy(params="host", optimizer="host", prefetch=2),
                           HOST_ADAM),
    "activations": (OffloadPolicy(activations="host"), None),
    "optimizer ratio 0.5": (OffloadPolicy(optimizer="host", ratio=0.5), None),
    "everything": (OffloadPolicy(params="host", optimizer="host", activations="host"),
                   HOST_ADAM),
    "params, state on disk": (OffloadPolicy(params="host", optimizer="disk",
                                            path=tempfile.gettempdir()),
                              HOST_ADAM),
    "params on disk": (OffloadPolicy(params="disk", optimizer="host",
                                     path=tempfile.gettempdir()), HOST_ADAM),
    "params and state on disk": (OffloadPolicy(params="disk", optimizer="disk",
                                               path=tempfile.gettempdir()), HOST_ADAM),
}


@pytest.mark.parametrize("name", list(SETTINGS))
@pytest.mark.parametrize("accum, recompute", [(1, "none"), (2, "none"), (1, "full")])
def test_offload_trains_like_no_offload(name, accum, recompute):
    policy, twin = SETTINGS[name]
    if recompute != "none" and policy.activations == "host":
        pytest.skip("a layer is recomputed or offloaded, not both")
    want_losses, want, _ = _train(None, accum=accum, recompute=recompute)
    losses, got, _ = _train(policy, accum=accum, recompute=recompute)
    assert losses == pytest.approx(want_losses, rel=1e-6)  # plain AdamW, nothing offloaded
    _same(got, want, exact=False)
    if policy.activations == "host" and policy.optimizer == "device":
        twin = None
        assert losses == want_losses  # the same kernels: the same bits
        _same(got, want, exact=True)
    if twin is not None:  # offloading the weights changes no bit of the host optimizer's run
        twin_losses, twin_weights, _ = _train(twin, accum=accum, recompute=recompute)
        assert losses == twin_losses
        _same(got, twin_weights, exact=True)


def test_at_most_prefetch_plus_one_layers_are_on_the_device():
    for prefetch in (0, 1, 2):
        model = tiny_gpt(4)
        offload = ParamOffload(model, prefetch=prefetch)
        blocks = list(model.blocks)
        homes = [offload.unit_homes[i] for i in range(len(blocks))]
        seen: list[int] = []

        def look(*_, homes=homes, seen=seen):
            on = [i for i, hs in enumerate(homes) if any(h.copy is not None for h in hs)]
            seen.append(len(on))
            for hs in homes:  # a device copy is a storage of its own, not the host's
                for h in hs:
                    if h.copy is not None:
                        assert h.param.data_ptr() != h.host.data_ptr()
                        assert h.param.data_ptr() == h.copy.data_ptr()

        for block in blocks:
            block.register_forward_pre_hook(look)
            block.register_forward_hook(look)
            for p in block.parameters():
                p.register_post_accumulate_grad_hook(look)
        for step in range(2):  # the second step prefetches in the order the first recorded
            seen.clear()
            x, y = batch(step)
            _, loss = model(x, y)
            loss.backward()
            assert seen and max(seen) <= prefetch + 1, (prefetch, seen)
            assert offload.resident() == []  # nothing stays on the device between steps
            assert all(p.grad is not None and p.grad.data_ptr() != p.data_ptr()
                       for p in model.parameters())
            model.zero_grad()


def _saved_storage_bytes(out: torch.Tensor) -> int:
    """Bytes of the distinct storages autograd saved for backward behind ``out``."""
    seen: dict[int, int] = {}
    todo, visited = [out.grad_fn], {}  # the nodes kept: a freed wrapper's id is reused
    while todo:
        node = todo.pop()
        if node is None or id(node) in visited:
            continue
        visited[id(node)] = node
        for name in dir(node):
            value = getattr(node, name) if name.startswith("_saved_") else None
            if isinstance(value, torch.Tensor):
                storage = value.untyped_storage()  # one entry per live allocation (a freed
                seen[storage.data_ptr()] = storage.nbytes()  # storage holds 0 bytes)
        todo += [f for f, _ in node.next_functions]
    return sum(seen.values())


def test_what_forward_saves_of_the_weights_is_freed_until_backward():
    """A Linear saves ``weight.t()`` for its backward: a view of the layer's device copy. The
    copy's memory goes when the layer is let go of and comes back, in the same storage, before
    its backward; otherwise every layer's copy would stay from forward to backward."""
    torch.manual_seed(0)
    layers = [torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Tanh()) for _ in range(6)]
    model, plain = torch.nn.Sequential(*layers), copy.deepcopy(torch.nn.Sequential(*layers))
    ParamOffload(model, units=list(model))
    x = torch.randn(4, 256, requires_grad=True)
    y, want = model(x), plain(x)
    weight = 256 * 256 * 4
    assert _saved_storage_bytes(y) == _saved_storage_bytes(want) - 5 * weight  # the last stays
    y.sum().backward()
    want.sum().backward()
    for a, b in zip(model.parameters(), plain.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)


def test_evaluation_leaves_nothing_on_the_device_and_gives_the_same_output():
    want = tiny_gpt(3)
    model = tiny_gpt(3)
    offload = ParamOffload(model)
    x, _ = batch(0)
    with torch.no_grad():
        torch.testing.assert_close(model(x), want(x), rtol=0, atol=0)
    assert offload.resident() == []


def test_a_trained_model_dropped_with_its_parameters_offloaded_is_freed():
    # each parameter's gradient hook held the parameter's home, and the home the parameter: a
    # cycle through the hooks C++ holds, which the collector cannot see, so every parameter
    # (its host tensor, its gradient) stayed for the life of the process
    import gc
    import weakref

    model = tiny_gpt(2)
    ParamOffload(model)
    x, y = batch(0)
    model(x, y)[1].backward()
    alive = [weakref.ref(p) for p in model.parameters()]
    del model
    gc.collect()
    assert sum(r() is not None for r in alive) == 0, f"{len(alive)} parameters, some kept"


@pytest.mark.parametrize("first, second", [
    (OffloadPolicy(params="host", optimizer="host", activations="host"), None),
    (None, OffloadPolicy(params="host", optimizer="host")),
    (OffloadPolicy(optimizer="host", ratio=0.5), OffloadPolicy(optimizer="host", ratio=1.0)),
])
def test_a_checkpoint_resumes_across_offload_settings(first, second):
    want_losses, want, _ = _train(None, steps=4)
    losses, _, state = _train(first, steps=2)
    more, got, _ = _train(second, steps=2, state=state, start=2)
    assert losses + more == pytest.approx(want_losses, rel=1e-6)
    _same(got, want, exact=False)


def test_16_bit_device_copies_keep_fp32_weights_and_gradients_on_the_host():
    model = tiny_gpt(2)
    offload = ParamOffload(model, compute_dtype=torch.bfloat16)
    seen = []
    model.blocks[0].register_forward_pre_hook(
        lambda *_: seen.append(model.blocks[0].ln1.weight.dtype))
    x, y = batch(0)
    _, loss = model(x, y)
    loss.backward()
    assert seen == [torch.bfloat16]
    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32
               for p in model.parameters())
    assert offload.resident() == []


@pytest.mark.parametrize("kwargs, message", [
    (dict(params="nvme"), "params 'nvme' is not one of"),
    (dict(params="disk", optimizer="host"), "params='disk' keeps its state in files: give path="),
    (dict(params="disk", path="/tmp"), "params='disk' keeps the weights .* needs optimizer="),
    (dict(optimizer="host", path="/tmp"), "where params='disk' and optimizer='disk' keep"),
    (dict(activations="device"), "activations 'device' is not one of"),
    (dict(optimizer="host", ratio=1.5), "ratio is the share"),
    (dict(ratio=0.5), "optimizer='device' keeps none there"),
    (dict(params="host"), "needs optimizer='host' \\(or 'disk'\\) with ratio=1.0"),
    (dict(params="host", optimizer="host", ratio=0.5), "needs optimizer='host'"),
    (dict(prefetch=-1), "prefetch must be an int >= 0"),
])
def test_an_impossible_policy_is_refused_by_name(kwargs, message):
    with pytest.raises(ValueError, match=message):
        OffloadPolicy(**kwargs)


class _Scaled(torch.Tensor):
    """A tensor subclass (as a quantized or sharded weight would be)."""


def test_bad_requests_are_refused_before_any_change():
    with pytest.raises(ValueError, match="unknown field"):
        OffloadPolicy.from_mapping({"param": "host"})
    model = tiny_gpt(2)
    ParamOffload(model)
    with pytest.raises(ValueError, match="offloaded already"):
        ParamOffload(model)
    with pytest.raises(ValueError, match="offloaded already"):  # a stage of it, in a list
        ParamOffload([tiny_gpt(2), model])
    with pytest.raises(TypeError, match="a non-empty sequence of them"):
        ParamOffload([])
    with pytest.raises(TypeError, match="an nn.Module or a non-empty sequence"):
        ParamOffload(5)
    wrapped = tiny_gpt(2)
    wrapped.lm_head.weight = torch.nn.Parameter(_Scaled(wrapped.lm_head.weight.detach()))
    before = wrapped.blocks[0].ln1.weight.data_ptr()
    with pytest.raises(ValueError, match="lm_head.weight is a _Scaled; parameter offload holds "
                                         "plain tensors"):
        ParamOffload(wrapped)
    assert wrapped.blocks[0].ln1.weight.data_ptr() == before  # nothing moved
    flat = torch.nn.Linear(4, 4)
    before = flat.weight.data_ptr()
    with pytest.raises(ValueError, match="no layer stack"):
        apply_offload(flat, OffloadPolicy(params="host", optimizer="host"))
    assert flat.weight.data_ptr() == before
    with pytest.raises(ValueError, match="host_ratio is the share"):
        OffloadAdamW(tiny_gpt(2).parameters(), host_ratio=2.0)


class _TableThenLayers(torch.nn.Module):
    """A host table (``EmbeddingLookup(target="CPU")``) feeding two layers."""

    def __init__(self) -> None:
        super().__init__()
        from hetero.nn import EmbeddingLookup

        self.table = EmbeddingLookup(50, 16)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(2))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.table(ids).sum(1)
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def test_a_host_table_stays_where_it_is_and_trains_like_no_offload():
    """A host table keeps its own rows in host memory and ships what the device needs: parameter
    offload leaves it as it is (copying it to the device each step would defeat it, and its
    lookup refuses a table off the host) and offloads the rest."""
    torch.manual_seed(0)
    model = _TableThenLayers()
    plain = copy.deepcopy(model)
    offload = ParamOffload(model)
    assert id(model.table.weight) not in offload.homes
    assert all(id(p) in offload.homes for p in model.layers.parameters())
    ids = torch.randint(0, 50, (4, 3), generator=torch.Generator().manual_seed(1))
    for m in (model, plain):
        opt = torch.optim.SGD(m.parameters(), lr=0.1)  # it takes the table's sparse gradient
        for _ in range(2):
            m(ids).square().sum().backward()
            opt.step()
            opt.zero_grad()
    for a, b in zip(model.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_sparse_gradients_and_an_unaveraged_host_table_are_refused_by_name():
    sparse = torch.nn.Sequential(torch.nn.Embedding(10, 4, sparse=True), torch.nn.Linear(4, 4))
    before = sparse[1].weight.data_ptr()
    with pytest.raises(ValueError, match=r"0 \(Embedding, sparse=True\) gets sparse gradients"):
        ParamOffload(sparse)
    assert sparse[1].weight.data_ptr() == before  # nothing moved
    import parallel

    parallel.init()
    with pytest.raises(ValueError, match="host table .* would leave unaveraged"):
        ParamOffload(_TableThenLayers(), reduce_group=torch.distributed.group.WORLD)


def test_host_weights_are_pinned_in_a_few_chunks_not_one_rounded_block_each(monkeypatch):
    """The caching host allocator rounds every pinned request up to a power of two: one block
    per parameter pinned up to twice the weights. They are views of chunks, each within a
    sixteenth of its rounding."""
    import foundation.device as hd
    from hetero.optim.pinned_chunks import rounded

    asked: list[int] = []
    real = hd.pinned_empty
    monkeypatch.setattr(hd, "pinned_empty",
                        lambda shape, dtype: asked.append(math.prod(shape)) or real(shape, dtype))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(48, 48) for _ in range(6)))  # 2304 + 48 each
    plain = copy.deepcopy(model)
    ParamOffload(model, units=list(model))
    weights = sum(p.numel() for p in model.parameters())
    assert len(asked) < len(list(model.parameters())) // 2
    assert sum(rounded(n) for n in asked) <= weights * 17 / 16 + rounded(asked[-1])
    x = torch.randn(3, 48)
    torch.testing.assert_close(model(x), plain(x), rtol=0, atol=0)


def test_the_host_ratio_splits_the_state_by_elements():
    from hetero.optim.param_slots import host_share

    sizes = [torch.empty(n) for n in (10, 30, 40, 20)]
    assert host_share(sizes, 1.0) == [True] * 4
    assert host_share(sizes, 0.0) == [False] * 4
    assert host_share(sizes, 0.5) == [True, True, True, False]  # 10+30 < 50: one more
    assert host_share(sizes, 0.4) == [True, True, False, False]
