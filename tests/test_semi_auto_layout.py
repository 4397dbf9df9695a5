"""Semi-auto parallel without peers: strategy -> layout derivation in the reference's conventions,
layouts -> DTensor placements, every validation error, and parallelize's all-or-nothing checks
(in one process, world size 1)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

import foundation.device as hd
import parallel
from parallel.semi_auto import Layout, derive_plan, load_strategy_file
from parallel.semi_auto.mesh import mesh_shape_for, placements
from parallel.semi_auto.rules import BMM, LINEAR, MATMUL
from parallel.semi_auto.shard import module_tag


def test_layout_tensor_map_counts_axes_from_the_right():
    layout = Layout((2, 4), ("dp", "mp"))
    assert layout("dp", "None").tensor_map == (1, -1)
    assert layout("None", "mp").tensor_map == (-1, 0)
    assert layout(("dp", "mp"), "None").tensor_map == ((1, 0), -1)
    assert layout("dp", "mp").slices() == (2, 4)
    with pytest.raises(ValueError, match="unknown axis name 'tp'"):
        layout("tp", "None")
    with pytest.raises(ValueError, match="outer first"):
        layout(("mp", "dp"), "None")
    with pytest.raises(ValueError, match="uses a device axis twice"):
        layout("dp", "dp")
    with pytest.raises(ValueError, match="must name each"):
        Layout((2, 2), ("dp",))


def test_matmul_layouts_follow_the_reference():
    # MatMul ((a, b), (b, c)) has device matrix (a, b, c): X -> (2, 1), W -> (1, 0), out (2, 0).
    plan = derive_plan("mm", MATMUL, ((2, 1), (1, 2)), None, 4)
    assert plan.device_matrix == (2, 1, 2)
    assert [lay.tensor_map for lay in plan.inputs] == [(2, 1), (1, 0)]
    assert plan.output.tensor_map == (2, 0) and plan.output.partial == ()
    # Product 2 on 4 devices: a leading repeat axis; the tensor maps do not change.
    plan = derive_plan("mm", MATMUL, ((2, 1), (1, 1)), None, 4)
    assert plan.device_matrix == (2, 2, 1, 1)
    assert [lay.tensor_map for lay in plan.inputs] == [(2, 1), (1, 0)]
    # A split contracting dimension leaves partial sums over its axis.
    plan = derive_plan("mm", MATMUL, ((2, 2), (2, 1)), None, 4)
    assert plan.output.tensor_map == (2, 0) and plan.output.partial == (1,)


def test_batch_matmul_broadcast_and_out_strategy():
    # The reference's BatchMatMul ((2, 1, 1), (1, 1, 2)): the weight's batch dim is broadcast.
    plan = derive_plan("bmm", MATMUL, ((2, 1, 1), (1, 1, 2)), None, 4)
    assert plan.device_matrix == (2, 1, 1, 2)
    assert [lay.tensor_map for lay in plan.inputs] == [(3, 2, 1), (-1, 1, 0)]
    assert plan.output.tensor_map == (3, 2, 0)
    all_reduce = derive_plan("mm", MATMUL, ((2, 2), (2, 1)), ((2, 1),), 4)
    assert all_reduce.out.tensor_map == (2, 0) and all_reduce.out.partial == ()
    reduce_scatter = derive_plan("mm", MATMUL, ((2, 2), (2, 1)), ((4, 1),), 4)
    assert reduce_scatter.out.tensor_map == ((2, 1), 0)


def test_layouts_become_placements_on_one_mesh():
    first = derive_plan("mm1", MATMUL, ((2, 1), (1, 2)), None, 4)
    second = derive_plan("mm2", MATMUL, ((2, 2), (2, 1)), None, 4)
    shape = mesh_shape_for([first.device_matrix, second.device_matrix], 4)
    assert shape == (2, 2)
    assert placements(first.output, shape) == (Shard(0), Shard(1))
    assert placements(second.inputs[0], shape) == (Shard(0), Shard(1))  # sample 3: no change
    assert placements(second.output, shape) == (Shard(0), Partial())
    repeat = derive_plan("ln", LINEAR, ((2, 1), (1, 1)), None, 4)
    assert placements(repeat.inputs[0], shape) == (Replicate(), Shard(0))  # repeat axis leads
    assert mesh_shape_for([(4,), (2, 2)], 4) == (2, 2)
    assert placements(Layout((4,), ("x",))("x", "None"), (2, 2)) == (Shard(0), Shard(0))


def _errors():
    lin = nn.Linear(6, 4)
    layout = Layout((2,), ("mp",))
    return [
        (lambda: parallel.shard(torch.matmul, ((2, 0), (1, 1))), "0, which is not a positive int"),
        (lambda: parallel.shard(torch.matmul, ((2, 1.5), (1, 1))), "1.5, which is not a positive"),
        (lambda: parallel.shard(torch.matmul, ((3, 1), (1, 1))), "3, which is not a power of two"),
        (lambda: derive_plan("MatMul", MATMUL, ((4, 1), (1, 1)), None, 6),
         "uses 4 devices .* does not divide the device count 6"),
        (lambda: parallel.shard(torch.matmul, ((2, 2), (1, 2))),
         r"inconsistent contracting dimensions: input dim 1 is cut into 2 but other dim 0 into 1"),
        (lambda: parallel.shard(torch.matmul, ((2, 1),)), "has 1 entries, but matmul takes 2"),
        (lambda: derive_plan("bmm", BMM, ((2, 1, 1), (2, 1, 1), (1,)), None, 2),
         "has 3 entries, but bmm takes 2"),
        (lambda: parallel.shard(lin, ((1, 1), (1, 1, 1))), "linear's weight here has 2 dim"),
        (lambda: parallel.shard(lin, ((1, 4), (1, 4))),
         r"dimension 1 of weight \(size 6\) is not divisible by its 4 slices"),
        (lambda: parallel.shard(nn.Softmax(dim=-1), ((1, 2),)), "softmax cannot split"),
        (lambda: parallel.shard(nn.LayerNorm(8), ((1, 2),)), "layer_norm cannot split"),
        (lambda: parallel.shard(nn.RMSNorm(8), ((1, 2),)), "rms_norm cannot split"),
        (lambda: parallel.shard(_hf_rms_norm(), ((1, 2),)), "rms_norm cannot split"),
        (lambda: parallel.shard(F.scaled_dot_product_attention, ((1, 1, 2, 1),) * 3),
         "can split only batch and head"),
        (lambda: parallel.shard(torch.matmul, (layout("mp", "None"), (1, 1))), "mixes"),
        (lambda: parallel.shard(torch.matmul, ((2, 2), (2, 1)), ((1, 1),)), "not reachable"),
        (lambda: parallel.shard(torch.cumsum, ((1,),)), "no shard rule for <built-in method cum"),
        (lambda: parallel.shard(nn.Conv2d(1, 1, 1), ((1, 1, 1, 1),)), "no shard rule for Conv2d"),
    ]


def _hf_rms_norm() -> nn.Module:
    """A HuggingFace family's own RMSNorm class (found by its name: one rule for them all)."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    return LlamaRMSNorm(8)


@pytest.mark.parametrize("case", range(len(_errors())))
def test_every_bad_strategy_is_named(case):
    make, message = _errors()[case]
    with pytest.raises(ValueError, match=message):
        make()


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


def test_parallelize_checks_everything_before_changing_anything():
    parallel.init()  # one process: a real world-size-1 group
    model = MLP()
    with pytest.raises(ValueError, match=r"fc2 \(Linear\): in_strategy\[1\] has 3 entries"):
        parallel.parallelize(model, parallel.ParallelConfig(
            strategies={"fc1": ((1, 1), (1, 1)), "fc2": ((1, 1), (1, 1, 1))}))
    with pytest.raises(ValueError, match="pattern 'fc3' matches no module"):
        parallel.parallelize(model, parallel.ParallelConfig(strategies={"fc3": ((1, 1), (1, 1))}))
    assert module_tag(model.fc1) is None  # the good entry was not applied either
    assert not any(isinstance(p, DTensor) for p in model.parameters())
    assert not model._forward_pre_hooks and not model.fc1._forward_pre_hooks
    with pytest.raises(ValueError, match="auto_parallel plans on a captured graph: pass "
                                         "example_inputs"):
        parallel.parallelize(model, parallel.ParallelConfig(search_mode="sharding_propagation"))
    with pytest.raises(TypeError, match="a ParallelConfig, got str"):  # the removed door
        parallel.parallelize(model, "semi_auto_parallel")
    if hd.resolve("device").type == "cpu":
        dropped = nn.Sequential(MLP(), nn.Dropout(0.1))
        with pytest.raises(ValueError, match=r"1 \(Dropout, p=0.1\): DTensor has no random"):
            parallel.parallelize(dropped, parallel.ParallelConfig(
                strategies={"0.fc1": ((1, 1), (1, 1))}))


def test_one_process_semi_auto_matches_the_plain_model():
    parallel.init()
    torch.manual_seed(0)
    plain, model = MLP(), MLP()
    model.load_state_dict(plain.state_dict())
    parallel.context.set_auto_parallel_context(
        parallel_mode=parallel.context.ParallelMode.SEMI_AUTO_PARALLEL)
    parallel.parallelize(model, parallel.ParallelConfig.from_context(
        strategies={"fc1": ((1, 1), (1, 1)), "fc2": ((1, 1), (1, 1))}))
    # nothing is written into the context behind the user's back
    # ParallelConfig's default
    assert parallel.context.get_auto_parallel_context("full_batch") is True
    x = torch.randn(4, 8)
    out = model(x)
    assert type(out) is torch.Tensor  # outputs come back as plain tensors
    torch.testing.assert_close(out, plain(x), rtol=1e-5, atol=1e-6)
    matmul = parallel.shard(torch.matmul, ((1, 1), (1, 1)))
    with pytest.raises(ValueError, match=r"input has 3 dimensions \(2, 3, 4\), but its layout "
                                         r"has 2"):
        matmul(torch.randn(2, 3, 4), torch.randn(4, 5))
    with pytest.raises(ValueError, match="passes 1 tensor input"):
        parallel.shard(torch.add, ((1, 1), (1, 1)))(torch.randn(2, 2), 1.0)
    text = parallel.semi_auto.explain_sharding(model)
    assert "fc1  [nn.Linear]" in text and "fc1.weight" in text


def test_strategy_file_fills_in_degrees(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text("fc1: [[dp, 1], [mp, 1]]\n"
                    "fc2: {in_strategy: [[dp, mp], [1, mp]], out_strategy: [[dp, 1]]}\n")
    assert load_strategy_file(path, dp=2, mp=4) == {
        "fc1": ((2, 1), (4, 1)),
        "fc2": {"in_strategy": ((2, 4), (1, 4)), "out_strategy": ((2, 1),)}}
    with pytest.raises(ValueError, match="unknown degree name 'tp'"):
        path.write_text("fc1: [[tp, 1], [1, 1]]\n")
        load_strategy_file(path, dp=1, mp=1)


class Untraceable(nn.Module):
    """A sharded MatMul consuming a parameter inside a forward torch.fx cannot trace."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 4))
        self.matmul = parallel.shard(torch.matmul, ((1, 1), (1, 1)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > 8:  # control flow on a shape stops symbolic tracing
            x = x[:8]
        return self.matmul(x, self.w)


def test_untraceable_forward_is_reported_and_still_correct():
    parallel.init()
    model = Untraceable()
    x = torch.randn(3, 4)
    want = x @ model.w.detach()
    with pytest.warns(UserWarning, match=r"could not trace Untraceable.forward .*parameters: w"):
        parallel.parallelize(model, parallel.ParallelConfig())
    torch.testing.assert_close(model(x), want)
    assert "not traced by torch.fx" in parallel.semi_auto.explain_sharding(model)
    tagged = MLP()
    parallel.shard(tagged.fc1, ((1, 1), (1, 1)))
    with pytest.raises(ValueError, match="'fc1' already has a parallel.shard tag"):
        parallel.parallelize(tagged, parallel.ParallelConfig(strategies={"fc1": ((1, 1), (1, 1))}))


@pytest.mark.cuda
def test_one_process_on_the_accelerator_matches_the_plain_model():
    parallel.init()
    device = hd.resolve("device")
    torch.manual_seed(0)
    plain = MLP().to(device)
    model = MLP().to(device)
    model.load_state_dict(plain.state_dict())
    parallel.parallelize(model, parallel.ParallelConfig(
        strategies={"fc1": ((1, 1), (1, 1)), "fc2": ((1, 1), (1, 1))}))
    assert model.fc1.weight.device_mesh.device_type == device.type != "cpu"
    x = torch.randn(4, 8, device=device)
    torch.testing.assert_close(model(x), plain(x), rtol=1e-5, atol=1e-6)
