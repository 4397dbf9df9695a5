"""The GPT recipe with ``hetero=embedding_on_cpu``: placed training on 2 ranks matches unplaced."""

from __future__ import annotations

import pytest

from recipe_helpers import losses_of, run_recipe


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_embedding_on_cpu_trains_like_the_unplaced_recipe(tmp_path):
    cache = tmp_path / "data"
    placed, plain = tmp_path / "placed", tmp_path / "plain"
    proc = run_recipe(["trainer.max_steps=8", "hetero=embedding_on_cpu"], 2, placed, cache)
    assert "placement plan (graph mode)" in (placed / "train.log").read_text()
    assert "on the host: lm_head.weight, tok_emb.weight" in (placed / "train.log").read_text()
    run_recipe(["trainer.max_steps=8"], 2, plain, cache)
    placed_losses, plain_losses = losses_of(placed), losses_of(plain)
    assert sorted(placed_losses) == list(range(1, 9))
    assert placed_losses[8] < placed_losses[1]
    assert [placed_losses[s] for s in range(1, 9)] == pytest.approx(
        [plain_losses[s] for s in range(1, 9)], rel=1e-5)
    assert "Training summary" in proc.stdout


def test_unknown_cpu_module_is_named(tmp_path):
    with pytest.raises(AssertionError, match=r"hetero.cpu_modules names \['tok_embedding'\]"):
        run_recipe(["trainer.max_steps=1", "parallel=none", "hetero=embedding_on_cpu",
                    "hetero.cpu_modules=[tok_embedding]"], None, tmp_path / "r", tmp_path / "d")
