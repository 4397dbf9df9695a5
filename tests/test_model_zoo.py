"""hetero.place on real models: tiny random-init HuggingFace families (see ``zoo_models``), each
with its input lookups on the CPU, must equal the unplaced model in loss, every gradient and three
AdamW steps, for two batch shapes, with a CPU partition in its plan."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import foundation.device as hd
import hetero

pytest.importorskip("transformers")
from zoo_models import ZOO  # noqa: E402

RTOL, ATOL = 1e-4, 1e-5


def _on(device, batch: dict) -> dict:
    return {k: v.to(device) for k, v in batch.items()}


def _step(model, opt, batch) -> torch.Tensor:
    opt.zero_grad()
    loss = model(**batch).loss
    loss.backward()
    return loss.detach().cpu()


def _assert_same_grads(placed, reference) -> None:
    for (name, p), (_, r) in zip(placed.named_parameters(), reference.named_parameters(),
                                 strict=True):
        assert (p.grad is None) == (r.grad is None), name
        if r.grad is not None:
            torch.testing.assert_close(p.grad.cpu(), r.grad.cpu(), rtol=RTOL, atol=ATOL,
                                       msg=name)


@pytest.mark.parametrize("family", list(ZOO))
def test_placed_family_trains_like_unplaced(family):
    entry = ZOO[family]
    dev = hd.resolve("device")
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = entry.build().to(dev)
    reference = copy.deepcopy(model)
    for module in entry.lookups(model):
        hetero.set_device(module, "cpu")
    placed = hetero.place(model)
    gen = torch.Generator().manual_seed(1)

    first = _on(dev, entry.batch(gen, 2, 8))
    out, ref = placed(**first), reference(**first)
    torch.testing.assert_close(out.loss.cpu(), ref.loss.cpu(), rtol=RTOL, atol=ATOL)
    assert placed.plan.on("cpu"), hetero.explain(placed)

    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (placed, reference)]
    for shape in [(2, 8), (3, 5), (2, 8)]:  # a second shape, then back to the first
        batch = _on(dev, entry.batch(gen, *shape))
        ours = _step(placed, opts[0], batch)
        theirs = _step(reference, opts[1], batch)
        torch.testing.assert_close(ours, theirs, rtol=RTOL, atol=ATOL)
        _assert_same_grads(placed, reference)
        for opt in opts:
            opt.step()
    for (name, p), (_, r) in zip(placed.named_parameters(), reference.named_parameters(),
                                 strict=True):
        torch.testing.assert_close(p.detach().cpu(), r.detach().cpu(), rtol=RTOL, atol=ATOL,
                                   msg=name)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_a_model_with_its_default_kv_cache_is_placed_without_the_user_knowing(family):
    """HF configs default to ``use_cache=True`` (a ``DynamicCache`` object in the output, which
    torch.export cannot return): ``hetero.place`` turns it off, says so once, and trains."""
    import transformers

    torch.manual_seed(0)
    config = {"gpt2": lambda: transformers.GPT2Config(
                  n_embd=32, n_layer=2, n_head=2, vocab_size=100, n_positions=32,
                  bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0,
                  attn_pdrop=0.0),
              "llama": lambda: transformers.LlamaConfig(
                  hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=2, vocab_size=100,
                  max_position_embeddings=32, bos_token_id=0, eos_token_id=0)}[family]()
    assert config.use_cache
    model = transformers.AutoModelForCausalLM.from_config(config)
    reference = copy.deepcopy(model)
    hetero.set_device(model.get_input_embeddings(), "cpu")
    x = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(1))
    with pytest.warns(UserWarning, match=r"config.use_cache=False"):
        placed = hetero.place(model, example_kwargs={"input_ids": x, "labels": x})
    assert not model.config.use_cache
    ours, theirs = placed(input_ids=x, labels=x).loss, reference(input_ids=x, labels=x).loss
    torch.testing.assert_close(ours, theirs, rtol=RTOL, atol=ATOL)
    ours.backward()
    theirs.backward()
    _assert_same_grads(placed, reference)
