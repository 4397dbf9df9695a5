"""Every parallel x hetero combination of the GPT recipe on two ranks resumes bit for bit.

Run A goes straight to step 6 (checkpoints at 3 and 6); run B resumes from A's step 3. B's
losses for steps 4..6 and its step-6 checkpoint (weights, optimizer state, loss-scaler state)
must equal A's exactly. One-process combinations are in test_recipe_reliability.py; the
Wide&Deep recipe's resume is checked in test_wide_deep_checkpoint.py.
"""

from __future__ import annotations

import pytest
import torch

from recipe_helpers import assert_bitwise_equal, checkpoint_tensors, losses_of, run_recipe


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("data")


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("combination", [
    ["parallel=data", "hetero=none", "model.dropout=0.1"],  # RNG states must be restored too
    ["parallel=data", "hetero=embedding_on_cpu"],
    ["parallel=data", "offload=optimizer", "hetero.offload_kernel=torch"],
    ["parallel=data", "offload=optimizer", "hetero.offload_kernel=torch",
     "offload.param_dtype=float16", "optim.lr=3e-2"],
    ["parallel=semi_auto", "hetero=none"],
    ["parallel=data", "parallel.enable_parallel_optimizer=true",
     "parallel.optimizer_level=level2", "parallel.parallel_optimizer_threshold=0"],
], ids=["data-none", "data-embedding_on_cpu", "data-offload_bf16", "data-offload_fp16",
        "semi_auto-none", "data-parallel_optimizer"])
def test_two_rank_resume_is_bitwise(tmp_path, cache, combination):
    same = ["trainer.max_steps=6", "trainer.checkpoint_every=3", *combination]
    a, b = tmp_path / "a", tmp_path / "b"
    run_recipe(same, 2, a, cache)
    run_recipe([*same, f"trainer.resume_from={a / 'checkpoints' / 'step_000003'}"], 2, b, cache)
    a_losses, b_losses = losses_of(a), losses_of(b)
    assert sorted(b_losses) == [4, 5, 6]
    assert [b_losses[s] for s in (4, 5, 6)] == [a_losses[s] for s in (4, 5, 6)]
    assert_bitwise_equal(checkpoint_tensors(a / "checkpoints" / "step_000006", tmp_path),
                         checkpoint_tensors(b / "checkpoints" / "step_000006", tmp_path))
    for rank in (0, 1):
        extra = [torch.load(d / "checkpoints" / "step_000006" / f"rank_0000{rank}.pt")
                 for d in (a, b)]
        assert extra[0]["loss_scaler"] == extra[1]["loss_scaler"]
