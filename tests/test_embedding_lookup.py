"""hetero.nn.EmbeddingLookup: argument rules, lookups and row-sparse gradients for both targets,
the table's residency under .to() and hetero.place, and the rows-only crossing to a device."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

import foundation.device as hd
import hetero
from hetero.nn import EmbeddingLookup, host_lookup

V, D = 50, 6

# ----------------------------------------------------------------------------- argument rules


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(target="GPU"), ValueError, "target 'GPU' is not one of 'CPU', 'DEVICE'"),
    (dict(target="cpu"), ValueError, "target 'cpu'"),
    (dict(target="CPU", sparse=False), ValueError, "target='CPU' needs sparse=True"),
    (dict(sparse=1), TypeError, "sparse must be a bool"),
    (dict(vocab_size=0), ValueError, "vocab_size must be a positive int, got 0"),
    (dict(vocab_size=-3), ValueError, "vocab_size must be a positive int"),
    (dict(embedding_size=0), ValueError, "embedding_size must be a positive int"),
    (dict(vocab_size=2.0), TypeError, "vocab_size must be an int, got float"),
    (dict(embedding_size="8"), TypeError, "embedding_size must be an int, got str"),
    (dict(vocab_size=True), TypeError, "vocab_size must be an int, got bool"),
    (dict(param_init="gaussian"), ValueError, "unknown param_init 'gaussian'"),
    (dict(param_init=torch.zeros(V, D + 1)), ValueError, r"shape \(50, 6\), got \(50, 7\)"),
    (dict(param_init=3), TypeError, "param_init must be a name, a tensor or a callable"),
])
def test_bad_arguments_raise_clear_errors(kwargs, error, match):
    args = {"vocab_size": V, "embedding_size": D, **kwargs}
    with pytest.raises(error, match=match):
        EmbeddingLookup(**args)


def test_param_init_options():
    assert torch.equal(EmbeddingLookup(V, D, param_init="zeros").weight, torch.zeros(V, D))
    table = torch.randn(V, D)
    emb = EmbeddingLookup(V, D, param_init=table)
    assert torch.equal(emb.weight, table) and emb.weight.data_ptr() != table.data_ptr()
    assert emb.embedding_table is emb.weight
    torch.manual_seed(0)
    std = EmbeddingLookup(2000, 16).weight.std().item()
    assert 0.009 < std < 0.011  # "normal" is MindSpore's Normal(sigma=0.01)
    assert EmbeddingLookup(V, D, param_init=lambda t: t.fill_(2.0)).weight.eq(2.0).all()


@pytest.mark.parametrize("param_init", ["normal", "uniform", "xavier_uniform"])
def test_a_named_init_is_one_table_for_one_seed_whatever_the_storage(param_init):
    """Host, device and row-sharded tables (each rank's block, at any world size) start from the
    same values for the same seed, so switching Wide&Deep to the parameter server (or a cache)
    does not change the model. The blocks are what each rank's constructor computes."""
    from hetero.nn.embedding_lookup import _initial_table
    from hetero.nn.row_blocks import block

    vocab, dim = 150_000, 4  # more than one 65 536-row piece
    torch.manual_seed(7)
    host = EmbeddingLookup(vocab, dim, param_init=param_init, target="CPU").weight
    torch.manual_seed(7)
    device = EmbeddingLookup(vocab, dim, param_init=param_init, target="DEVICE").weight
    assert torch.equal(host.detach().cpu(), device.detach().cpu())
    for world in (2, 3, 4):
        blocks = []
        for rank in range(world):
            torch.manual_seed(7)  # every rank seeds alike
            blocks.append(_initial_table(vocab, dim, param_init, torch.float32,
                                         block(vocab, world, rank)))
        assert torch.equal(torch.cat(blocks), host.detach()), world


# ----------------------------------------------------------------------------- lookups


@pytest.mark.parametrize("target", ["CPU", "DEVICE"])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8])
@pytest.mark.parametrize("shape", [(), (7,), (3, 4), (2, 3, 2)])
def test_lookup_matches_embedding_for_every_integer_dtype_and_shape(target, dtype, shape):
    emb = EmbeddingLookup(V, D, target=target)
    ids = torch.randint(0, V, shape).to(dtype)
    out = emb(ids)
    assert out.shape == (*shape, D)
    assert torch.equal(out, F.embedding(ids.long(), emb.weight))


@pytest.mark.parametrize("target", ["CPU", "DEVICE"])
def test_non_integer_indices_are_refused(target):
    emb = EmbeddingLookup(V, D, target=target)
    for bad in (torch.tensor([1.0, 2.0]), torch.tensor([True, False])):
        with pytest.raises(TypeError, match="indices must have an integer dtype"):
            emb(bad)
    with pytest.raises(TypeError, match="indices must be a torch.Tensor, got list"):
        emb([1, 2])


@pytest.mark.parametrize("target", ["CPU", "DEVICE"])
@pytest.mark.parametrize("bad", [V, V + 7, -1])
def test_out_of_range_index_names_the_value_and_the_vocab(target, bad):
    emb = EmbeddingLookup(V, D, target=target)
    before = emb.weight.detach().clone()
    with pytest.raises(IndexError, match=f"index {bad} is out of range for vocab_size {V}"):
        emb(torch.tensor([[1, 2], [bad, 3]]))
    assert torch.equal(emb.weight, before)


def test_empty_indices():
    emb = EmbeddingLookup(V, D)
    out = emb(torch.empty(0, 3, dtype=torch.int64))
    assert out.shape == (0, 3, D)
    out.sum().backward()
    assert emb.weight.grad.is_sparse and emb.weight.grad._nnz() == 0


# ----------------------------------------------------------------------------- gradients


def _dense_reference_grad(weight: torch.Tensor, ids: torch.Tensor, grad_out: torch.Tensor):
    w = weight.detach().clone().requires_grad_()
    F.embedding(ids, w).backward(grad_out)
    return w.grad


def test_cpu_target_gradient_is_row_sparse_coalesced_and_exact():
    torch.manual_seed(0)
    emb = EmbeddingLookup(V, D)
    ids = torch.tensor([[3, 7, 3], [7, 7, 0]])  # duplicates
    grad_out = torch.randn(2, 3, D)
    emb(ids).backward(grad_out)
    grad = emb.weight.grad
    assert grad.is_sparse and grad.device.type == "cpu"
    assert grad._indices().tolist() == [[0, 3, 7]]  # one row per distinct index, sorted
    torch.testing.assert_close(grad.to_dense(), _dense_reference_grad(emb.weight, ids, grad_out))


@pytest.mark.parametrize("sparse", [True, False])
def test_device_target_is_an_embedding(sparse):
    torch.manual_seed(0)
    emb = EmbeddingLookup(V, D, target="DEVICE", sparse=sparse)
    ids = torch.randint(0, V, (4, 5))
    grad_out = torch.randn(4, 5, D)
    emb(ids).backward(grad_out)
    assert emb.weight.grad.is_sparse == sparse
    torch.testing.assert_close(emb.weight.grad.to_dense(),
                               _dense_reference_grad(emb.weight, ids, grad_out))


def test_switching_target_keeps_state_dict_outputs_and_gradients():
    torch.manual_seed(0)
    host = EmbeddingLookup(V, D, target="CPU")
    dev = EmbeddingLookup(V, D, target="DEVICE")
    assert list(host.state_dict()) == list(dev.state_dict()) == ["weight"]
    dev.load_state_dict(host.state_dict())
    ids = torch.randint(0, V, (8, 3))
    grad_out = torch.randn(8, 3, D)
    host(ids).backward(grad_out)
    dev(ids).backward(grad_out)
    torch.testing.assert_close(host.weight.grad.to_dense(), dev.weight.grad.to_dense())
    assert host.hetero_device == "cpu" and dev.hetero_device is None
    assert "target='CPU'" in repr(host) and "target='DEVICE'" in repr(dev)


# ----------------------------------------------------------------------------- residency


class WideModel(nn.Module):
    def __init__(self, target: str = "CPU") -> None:
        super().__init__()
        self.emb = EmbeddingLookup(V, D, target=target)
        self.mlp = nn.Sequential(nn.Linear(D, 8), nn.ReLU(), nn.Linear(8, 1))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.emb(ids).sum(1)).squeeze(-1)


def test_moving_the_model_leaves_a_host_table_in_place():
    """``.to(accelerator)`` (an accelerator faked with FakeTensorMode: no GPU here) moves the
    MLP and leaves the table where it is, the same object with the same storage."""
    model = WideModel()
    table, ptr = model.emb.weight, model.emb.weight.data_ptr()
    with FakeTensorMode(allow_non_fake_inputs=True):
        model.to_empty(device="cuda")
    assert model.mlp[0].weight.device.type == "cuda"
    assert model.emb.weight is table and table.device.type == "cpu" and table.data_ptr() == ptr
    assert model.emb.output_device.type == "cuda"
    assert [n for n, _ in model.named_parameters()][0] == "emb.weight"  # still registered


def test_host_moves_and_dtype_changes_apply_to_a_host_table():
    model = WideModel().double()
    assert model.emb.weight.dtype == torch.float64 and model.emb.output_device.type == "cpu"
    model.to("meta")
    assert model.emb.weight.device.type == "meta"  # meta init: the table follows
    device_table = WideModel("DEVICE").to("meta")
    assert device_table.emb.weight.device.type == "meta"


def test_place_keeps_the_table_on_the_host_and_trains_like_the_unplaced_model():
    torch.manual_seed(0)
    model = WideModel()
    reference = copy.deepcopy(model)
    ids = torch.randint(0, V, (5, 4))
    placed = hetero.place(model, (ids,))
    plan = placed.plan
    assert plan.tensor_home["emb.weight"] == "cpu"
    assert all(h == "device" for n, h in plan.tensor_home.items() if n.startswith("mlp"))
    assert plan.modules_on("cpu") == {"emb"} and "mlp.0" in plan.modules_on("device")
    assert "on the host: emb.weight" in hetero.explain(placed)
    out = placed(ids)
    torch.testing.assert_close(out, reference(ids))
    out.sum().backward()
    reference(ids).sum().backward()
    assert model.emb.weight.grad.is_sparse
    torch.testing.assert_close(model.emb.weight.grad.to_dense(),
                               reference.emb.weight.grad.to_dense())
    with pytest.raises(IndexError, match="index 99 is out of range"):
        placed(torch.full((5, 4), 99))


def test_place_leaves_a_device_table_with_the_rest():
    placed = hetero.place(WideModel("DEVICE"), (torch.randint(0, V, (5, 4)),))
    assert placed.plan.tensor_home["emb.weight"] == "device"
    assert len(placed.plan) == 1


def test_only_the_distinct_rows_cross_to_the_device(monkeypatch):
    """The accelerator path, exercised on the host: force the crossing and record what crosses."""
    crossed: list[tuple[int, ...]] = []
    real_copy = hd.copy_to

    def spy(x: torch.Tensor, device: torch.device) -> torch.Tensor:
        crossed.append(tuple(x.shape))
        return real_copy(x, device)

    monkeypatch.setattr(host_lookup, "_ships", lambda device: True)
    monkeypatch.setattr(hd, "copy_to", spy)
    torch.manual_seed(0)
    emb = EmbeddingLookup(V, D)
    ids = torch.tensor([[4, 9, 4, 4], [9, 1, 1, 4]])
    grad_out = torch.randn(2, 4, D)
    out = emb(ids)
    assert crossed == [(8,), (3, D)]  # the inverse index, then 3 distinct rows (not 8)
    torch.testing.assert_close(out, F.embedding(ids, emb.weight))
    out.backward(grad_out)
    assert emb.weight.grad._indices().tolist() == [[1, 4, 9]]
    torch.testing.assert_close(emb.weight.grad.to_dense(),
                               _dense_reference_grad(emb.weight, ids, grad_out))


# ----------------------------------------------------------------------------- on a GPU


@pytest.mark.cuda
def test_cuda_host_table_ships_rows_and_gets_host_sparse_gradients():
    torch.manual_seed(0)
    model = WideModel().to("cuda")
    assert model.emb.weight.device.type == "cpu" and model.mlp[0].weight.is_cuda
    ids = torch.randint(0, V, (16, 4))  # ids may stay on the host
    out = model(ids)
    assert out.is_cuda
    reference = copy.deepcopy(model)
    reference.emb = nn.Embedding.from_pretrained(model.emb.weight.detach().cuda(), freeze=False)
    torch.testing.assert_close(out, reference(ids.cuda()))
    out.sum().backward()
    reference(ids.cuda()).sum().backward()
    grad = model.emb.weight.grad
    assert grad.is_sparse and grad.device.type == "cpu"
    torch.testing.assert_close(grad.to_dense(), reference.emb.weight.grad.cpu())
    with pytest.raises(IndexError, match="out of range"):
        model(torch.full((2, 2), V, device="cuda"))


@pytest.mark.cuda
def test_cuda_place_and_device_target():
    ids = torch.randint(0, V, (16, 4), device="cuda")
    placed = hetero.place(WideModel().to("cuda"), (ids,))
    assert placed.emb.weight.device.type == "cpu" and placed.mlp[0].weight.is_cuda
    assert placed(ids).is_cuda
    dev = WideModel("DEVICE").to("cuda")
    assert dev.emb.weight.is_cuda and dev(ids).is_cuda
    with pytest.raises(IndexError, match=f"index {V} is out of range"):
        dev(torch.full((2, 2), V, device="cuda"))
    assert hd.resolve("device").type == "cuda"
    overridden = WideModel().to("cuda")
    hetero.set_device(overridden.emb, "device")  # an explicit tag beats the declared placement
    with pytest.raises(ValueError, match="use target='DEVICE'"):
        hetero.place(overridden, (ids,))(ids)


def test_torch_compile_runs_the_host_lookup_eagerly_and_compiles_around_it():
    torch.manual_seed(0)
    model = WideModel()
    reference = copy.deepcopy(model)
    ids = torch.randint(0, V, (5, 4))
    compiled = torch.compile(model, backend="aot_eager")  # AOTAutograd, no C++ build
    out = compiled(ids)
    torch.testing.assert_close(out, reference(ids))
    out.sum().backward()
    reference(ids).sum().backward()
    assert model.emb.weight.grad.is_sparse
    torch.testing.assert_close(model.emb.weight.grad.to_dense(),
                               reference.emb.weight.grad.to_dense())
