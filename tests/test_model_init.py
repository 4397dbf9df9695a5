"""model.init_device=auto (the recipes' default, recipes/model_init.py): deferred initialization
wherever the layout takes it, else the whole model from the same seed, so every layout starts
from the same values; other models are built on the device."""

from __future__ import annotations

import pytest
import torch

import foundation.device as hd
import parallel
from recipe_helpers import TINY, compose_train, train_in_process
from recipes.gpt import GPT
from recipes.model_init import deferred_init, seeded_init

SEED = ["trainer.seed=5", "trainer.max_steps=1", "trainer.checkpoint_every=100"]


def _seeded_gpt(cfg, vocab: int) -> dict[str, torch.Tensor]:
    m = cfg.model
    with torch.device("meta"):
        want = GPT(vocab, m.d_model, m.n_layer, m.n_head, m.block_size)
    parallel.materialize(want, seed=5, device="cpu")
    return {n: p.detach() for n, p in want.named_parameters()}


@pytest.mark.parametrize(("overrides", "deferred"), [
    ([], True),                                                    # parallel=data
    (["parallel=none"], True),
    (["parallel.enable_parallel_optimizer=true", "parallel.optimizer_level=level3"], True),
    (["hetero.cpu_modules=[tok_emb]"], False),                     # placement: whole model
    (["hetero=offload"], False),                                   # OffloadAdamW takes values
    (["model=gpt_moe"], True),
    (["offload=params", "parallel.enable_parallel_optimizer=true",     # shards on the host
      "parallel.optimizer_level=level3"], True),
])
def test_auto_defers_wherever_meta_is_accepted(overrides, deferred):
    cfg = compose_train(overrides)
    assert cfg.model.init_device == "auto"
    assert seeded_init(cfg)
    assert deferred_init(cfg, hd.resolve("device")) is deferred


def test_auto_builds_other_models_on_the_device_and_meta_is_still_refused_by_name():
    hf = compose_train(["model=hf", "model.config={model_type: llama}"])
    assert not seeded_init(hf) and not deferred_init(hf, hd.resolve("device"))
    placed = compose_train(["model.init_device=meta", "hetero.cpu_modules=[tok_emb]"])
    with pytest.raises(ValueError, match="init_device=meta with hetero.cpu_modules"):
        deferred_init(placed, hd.resolve("device"))
    assert not deferred_init(compose_train(["model.init_device=device"]),
                             hd.resolve("device"))


@pytest.mark.parametrize("layout", [["parallel=none"], ["parallel=none",
                                                        "hetero.cpu_modules=[tok_emb]"]])
def test_deferred_and_whole_layouts_start_from_the_same_seeded_values(tmp_path, layout):
    seen: dict[str, torch.Tensor] = {}

    def grab(recipe) -> None:
        model = getattr(recipe.model, "module", recipe.model)
        seen.update({n: p.detach().clone() for n, p in model.named_parameters()})
        seen["vocab"] = recipe.tokenizer.vocab_size

    train_in_process([*SEED, *layout], tmp_path / "run", tmp_path / "data", grab)
    want = _seeded_gpt(compose_train([*TINY, *SEED]), seen.pop("vocab"))
    assert seen.keys() == want.keys()
    for name, value in want.items():
        assert torch.equal(seen[name].cpu(), value), name
