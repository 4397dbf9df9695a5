"""hetero.place: placed vs unplaced numerics and gradients, the plan, and training."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils import _pytree as pytree

import foundation.device as hd
import hetero
from placement_models import MLP, Branchy, KwargsLM, OpTagged, ScopeTagged
from recipes.gpt import GPT


def _to_host(value):
    return value.cpu() if isinstance(value, torch.Tensor) else value


def _twins(factory, seed: int = 0):
    torch.manual_seed(seed)
    model = factory()
    return model, copy.deepcopy(model)


def _assert_same_grads(placed, reference):
    for (name, p), (_, r) in zip(placed.named_parameters(), reference.named_parameters(),
                                 strict=True):
        assert p.grad is not None, name
        assert p.grad.device == p.device, f"{name}: gradient not on its parameter's device"
        torch.testing.assert_close(p.grad.cpu(), r.grad, rtol=1e-5, atol=1e-6, msg=name)


def _check(factory, tag, inputs, kwargs=None, loss=lambda out: out.float().pow(2).mean()):
    model, reference = _twins(factory)
    tag(model)
    placed = hetero.place(model)
    out, ref = placed(*inputs, **(kwargs or {})), reference(*inputs, **(kwargs or {}))
    torch.testing.assert_close(pytree.tree_map(_to_host, out), ref, rtol=1e-5, atol=1e-6)
    loss(out).backward()
    loss(ref).backward()
    _assert_same_grads(placed, reference)
    return placed


def test_mlp_middle_layer_on_cpu():
    placed = _check(MLP, lambda m: hetero.set_device(m.fc2, "cpu"), (torch.randn(8, 16),))
    assert [p.device for p in placed.plan] == ["device", "cpu", "device"]
    assert placed.plan[1].modules == ["fc2"]
    assert placed.fc2.weight.device == torch.device("cpu")
    assert placed.fc1.weight.device == hd.resolve("device")
    # fc1 -> gelu -> [fc2 on cpu] -> gelu -> fc3: the cpu partition takes fc1's activation in.
    assert placed.plan[1].bytes_in == 8 * 64 * 4
    assert placed.plan[1].bytes_out == 8 * 64 * 4
    assert placed.plan[1].param_bytes == (64 * 64 + 64) * 4


def test_branches_on_two_devices_are_independent_partitions():
    placed = _check(Branchy, lambda m: hetero.set_device(m.left, "cpu"), (torch.randn(4, 16),))
    first, right, left, merge = placed.plan.partitions
    assert [p.device for p in placed.plan] == ["device", "device", "cpu", "device"]
    assert first.modules == ["inp"]
    assert right.modules == ["right.0", "right.1", "right.2"] and right.depends_on == [0]
    assert left.modules == ["left.0", "left.1", "left.2"] and left.depends_on == [0]
    assert sorted(merge.depends_on) == [0, 1, 2] and merge.modules == ["", "norm"]


def test_gpt_token_embedding_on_cpu_with_tied_head():
    placed = _check(lambda: GPT(40, 32, 2, 2, 16, 0.0),
                    lambda m: hetero.set_device(m.tok_emb, "cpu"),
                    (torch.randint(0, 40, (2, 12)),),
                    loss=lambda out: out[0].pow(2).mean())
    host = placed.plan.on("cpu")
    assert len(host) == 1 and host[0].modules == ["tok_emb"]
    assert placed.plan.tensor_home["tok_emb.weight"] == "cpu"
    # The tied head (lm_head.weight is tok_emb.weight) runs on the device: the weight has one
    # home (the host), copied for the other use.
    assert placed.plan.tensor_home["lm_head.weight"] == "cpu"
    head = placed.plan.on("device")[-1]
    assert head.copies_in == ["embedding", "lm_head_weight"]
    assert host[0].copies_in == ["idx"]  # the token ids arrive on the device, as inputs do


def test_op_level_tag():
    placed = _check(OpTagged, lambda m: None, (torch.randn(5, 16),))
    host = placed.plan.on("cpu")
    assert len(host) == 1 and len(host[0].nodes) == 1
    assert placed.plan.tensor_home["w"] == "device"  # the op runs on the host, w is copied in


def test_scope_tag():
    placed = _check(ScopeTagged, lambda m: None, (torch.randn(5, 16),))
    host = placed.plan.on("cpu")
    assert len(host) == 1 and len(host[0].nodes) == 3  # softmax, mul, add
    assert all(p.device == "device" for p in placed.plan if p is not host[0])


def test_kwargs_and_dataclass_output():
    model, reference = _twins(KwargsLM)
    hetero.set_device(model.embed, "cpu")
    ids = torch.randint(0, 50, (3, 7))
    mask = torch.ones(3, 7)
    placed = hetero.place(model)
    out = placed(input_ids=ids, attention_mask=mask, labels=ids)
    ref = reference(input_ids=ids, attention_mask=mask, labels=ids)
    assert type(out) is type(ref)
    torch.testing.assert_close(out.logits.cpu(), ref.logits, rtol=1e-5, atol=1e-6)
    out.loss.backward()
    ref.loss.backward()
    _assert_same_grads(placed, reference)
    assert placed.plan.tensor_home["lm_head.weight"] == "cpu"  # tied to the tagged embedding


def test_huggingface_gpt2():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50, n_positions=16,
                                  bos_token_id=0, eos_token_id=0, use_cache=False)
    model, reference = _twins(lambda: transformers.GPT2LMHeadModel(cfg))
    hetero.set_device(model.transformer.wte, "cpu")
    ids = torch.randint(0, 50, (2, 8))
    placed = hetero.place(model, example_kwargs={"input_ids": ids, "labels": ids})
    torch.manual_seed(3)
    out = placed(input_ids=ids, labels=ids)
    torch.manual_seed(3)
    ref = reference(input_ids=ids, labels=ids)
    assert type(out) is type(ref)
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-5, atol=1e-6)
    out.loss.backward()
    ref.loss.backward()
    _assert_same_grads(placed, reference)
    assert placed.plan.on("cpu")[0].modules == ["transformer", "transformer.wte"]  # + ids.view


def test_state_dict_and_parameters_are_the_models_own():
    model = MLP()
    keys = list(model.state_dict())
    params = list(model.parameters())
    hetero.set_device(model.fc1, "cpu")
    placed = hetero.place(model, (torch.randn(2, 16),))
    assert list(placed.state_dict()) == keys
    assert all(a is b for a, b in zip(placed.parameters(), params, strict=True))
    assert placed.model is model and placed.module is model


@pytest.mark.parametrize("mode", ["graph", "hooks"])
def test_train_and_eval_reach_the_wrapped_model(mode):
    model = MLP()
    placed = hetero.place(model, mode=mode)
    placed.eval()
    assert not model.training and not placed.training and not model.fc1.training
    placed.train()
    assert model.training and placed.training and model.fc1.training


def test_new_shapes_recapture_once_each():
    model, reference = _twins(lambda: GPT(40, 32, 1, 2, 16, 0.0))
    hetero.set_device(model.tok_emb, "cpu")
    placed = hetero.place(model)
    for shape in [(2, 8), (3, 5), (2, 8), (1, 16)]:
        idx = torch.randint(0, 40, shape)
        torch.testing.assert_close(placed(idx)[0], reference(idx)[0], rtol=1e-5, atol=1e-6)
    assert len(placed._placements) == 3
    placed.eval()  # train/eval is part of the signature too
    placed(torch.randint(0, 40, (2, 8)))
    assert len(placed._placements) == 4


def test_twenty_steps_match_unplaced_training():
    model, reference = _twins(lambda: GPT(40, 32, 2, 2, 16, 0.0))
    hetero.set_device(model.tok_emb, "cpu")
    hetero.set_device(model.blocks[1].mlp, "cpu")
    placed = hetero.place(model)
    opt = torch.optim.AdamW(placed.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        idx = torch.randint(0, 40, (4, 16), generator=gen)
        for m, o in ((placed, opt), (reference, ref_opt)):
            o.zero_grad()
            _, loss = m(idx, idx.roll(1, 1))
            loss.backward()
            o.step()
        torch.testing.assert_close(placed(idx, idx)[1], reference(idx, idx)[1],
                                   rtol=1e-5, atol=1e-6)
    for (name, p), (_, r) in zip(placed.named_parameters(), reference.named_parameters(),
                                 strict=True):
        torch.testing.assert_close(p.detach().cpu(), r.detach(), rtol=1e-4, atol=1e-6, msg=name)


def test_explain_is_a_readable_table():
    model = MLP()
    hetero.set_device(model.fc2, "cpu")
    text = hetero.explain(hetero.place(model, (torch.randn(2, 16),)))
    lines = text.splitlines()
    assert lines[0] == "placement plan (graph mode): 3 partition(s)"
    assert lines[1].split()[:3] == ["#", "device", "ops"]
    assert "fc2" in lines[3] and lines[3].split()[1] == "cpu"
    assert "on the host: fc2.bias, fc2.weight" in text


@pytest.mark.cuda
def test_cuda_copies_are_pinned_and_grads_land_home():
    model, reference = _twins(lambda: GPT(40, 32, 1, 2, 16, 0.0))
    hetero.set_device(model.tok_emb, "cpu")
    placed = hetero.place(model.to(hd.resolve("device")))
    idx = torch.randint(0, 40, (2, 8), device=hd.resolve("device"))
    _, loss = placed(idx, idx)
    loss.backward()
    assert placed.tok_emb.weight.grad.device.type == "cpu"
    assert placed.blocks[0].attn.qkv.weight.grad.device == hd.resolve("device")
