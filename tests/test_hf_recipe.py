"""``model=hf`` and ``model=custom`` in the GPT recipe (recipes/hf_model.py, recipes/models.py).

Tiny Llama (loaded from a ``save_pretrained`` directory), Qwen2, GPT-2 and Mixtral (configs given
inline) train under data, semi-auto, pipeline and optimizer parallel on 2 gloo ranks with the
losses of ``parallel=none`` on the same global batch; Llama, GPT-2 and Mixtral also under auto
parallel, Llama with its embedding on the host, GPT-2 under optimizer offload, and a user's own
class. The 2-rank runs share one spawn (every run in the same two rank processes, one after the
other, on one process group); the ``parallel=none`` references run in this process. Fast tests
cover the pipeline stage split of each family, building and loading, the calling convention, and
the refusals.
"""

from __future__ import annotations

import json
import logging
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from recipe_helpers import HF_TINY, compose_train, losses_of, run_recipe, train_in_process
from recipes import config_schema

transformers = pytest.importorskip("transformers")

_LAYERS = "hidden_size:32,num_hidden_layers:2,num_attention_heads:4,num_key_value_heads:2," \
          "intermediate_size:64"
INLINE = {
    "qwen2": f"model.config={{model_type:qwen2,{_LAYERS}}}",
    "gpt2": "model.config={model_type:gpt2,n_embd:32,n_layer:2,n_head:4,resid_pdrop:0.0,"
            "embd_pdrop:0.0,attn_pdrop:0.0}",
    "mixtral": f"model.config={{model_type:mixtral,{_LAYERS},num_local_experts:4,"
               f"num_experts_per_tok:2}}",
    # families whose stages come from their structure alone (no list of known layouts)
    "phi3": f"model.config={{model_type:phi3,{_LAYERS}}}",
    "gemma2": f"model.config={{model_type:gemma2,{_LAYERS},head_dim:8}}",  # logit soft-cap
    "falcon": f"model.config={{model_type:falcon,{_LAYERS}}}",
}
#: families outside the six whose layouts were once listed by hand, trained in pipeline stages
STRUCTURAL = ("phi3", "gemma2", "falcon")
LLAMA = f"model.config={{model_type:llama,{_LAYERS}}}"
OPTIMIZER = ["parallel=data", "parallel.enable_parallel_optimizer=true",
             "parallel.optimizer_level=level3", "parallel.parallel_optimizer_threshold=0"]
MODES = {"data": ["parallel=data"], "semi_auto": ["parallel=semi_auto"],
         "pipeline": ["parallel=pipeline"], "optimizer": OPTIMIZER}
FAMILIES = ("llama", "qwen2", "gpt2", "mixtral")
CUSTOM = ["model=custom", "model._target_=custom_lm.TinyLM",
          "model.kwargs={d_model:32,n_layer:2,returns:both}"]


# ----------------------------------------------------------------------------- fixtures

@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("data")


@pytest.fixture(scope="module")
def saved_llama(tmp_path_factory) -> Path:
    """A tiny Llama written by ``save_pretrained`` (48 token rows: the corpus needs 40)."""
    torch.manual_seed(3)
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2,
                                      vocab_size=48, max_position_embeddings=64,
                                      bos_token_id=0, eos_token_id=0)
    path = tmp_path_factory.mktemp("llama")
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path


def _model_args(family: str, saved_llama: Path) -> list[str]:
    if family == "llama":
        return ["model=hf", f"model.path={saved_llama}"]
    if family == "custom":
        return CUSTOM
    return ["model=hf", INLINE[family]]


def _runs(saved_llama: Path) -> dict[str, list[str]]:
    """Every 2-rank run: name -> overrides (after ``HF_TINY``)."""
    runs = {f"{family}-{mode}": [*_model_args(family, saved_llama), *args]
            for family in FAMILIES for mode, args in MODES.items()}
    runs["mixtral-semi_auto"].append("model.experts_implementation=batched_mm")
    llama = _model_args("llama", saved_llama)
    runs["llama-auto"] = [*llama, "parallel=auto"]
    runs["gpt2-auto"] = [*_model_args("gpt2", saved_llama), "parallel=auto"]
    runs["mixtral-auto"] = [*_model_args("mixtral", saved_llama), "parallel=auto",
                            "model.experts_implementation=batched_mm"]
    runs["llama-embedding_on_cpu"] = [*llama, "parallel=data", "hetero=embedding_on_cpu"]
    runs["gpt2-offload"] = [*_model_args("gpt2", saved_llama), "parallel=data", "offload=optimizer",
                            "hetero.offload_kernel=torch"]
    runs["custom-data"] = [*CUSTOM, "parallel=data"]
    runs.update({f"{family}-pipeline": [*_model_args(family, saved_llama), "parallel=pipeline"]
                 for family in STRUCTURAL})
    return runs


def _train_all(rank: int, world: int, runs: dict[str, list[str]], cache: str, root: str
               ) -> dict[str, str | None]:
    """Each run of ``runs`` through the recipe, one after another on this rank's one process
    group (kept between runs: a rank process rendezvous once). Returns name -> None, or the
    error a run raised. Rank 0 writes each run's log to its ``train.log``."""
    import parallel
    from recipes.train import TrainRecipe

    warnings.simplefilter("ignore")
    failed: dict[str, str | None] = {}
    for name, args in runs.items():
        run = Path(root) / name
        run.mkdir(parents=True, exist_ok=True)
        handler = logging.FileHandler(run / "train.log") if rank == 0 else logging.NullHandler()
        logging.getLogger().addHandler(handler)
        logging.getLogger().setLevel(logging.INFO)
        cfg = compose_train([*HF_TINY, f"data.cache_dir={cache}", *args])
        recipe = TrainRecipe(cfg, run)
        try:
            config_schema.check_config(cfg)
            recipe.setup()
            recipe.train()
            failed[name] = None
        except Exception as err:  # reported by the test of that run
            failed[name] = f"{type(err).__name__}: {err}"
        finally:
            logging.getLogger().removeHandler(handler)
            handler.close()
            if recipe.metrics is not None:
                recipe.metrics.close()
    parallel.destroy()
    return failed


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory, cache, saved_llama) -> tuple[Path, dict[str, str | None]]:
    """All 2-rank runs in one spawn: (their root directory, name -> error or None)."""
    from distributed import run_ranks

    root = tmp_path_factory.mktemp("two_ranks")
    results = run_ranks(_train_all, 2, _runs(saved_llama), str(cache), str(root), timeout=840)
    return root, {name: results[0][name] or results[1][name] for name in results[0]}


@pytest.fixture(scope="module")
def single(tmp_path_factory, cache, saved_llama) -> dict[str, dict[int, float]]:
    """``parallel=none`` references in this process: name -> step -> loss."""
    refs = {family: _model_args(family, saved_llama)
            for family in (*FAMILIES, *STRUCTURAL, "custom")}
    refs["gpt2-offload"] = [*refs["gpt2"], "offload=optimizer", "hetero.offload_kernel=torch"]
    found = {}
    for name, args in refs.items():
        run = tmp_path_factory.mktemp("single") / name
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            train_in_process([*args, "parallel=none"], run, cache, tiny=HF_TINY)
        found[name] = losses_of(run)
    return found


def _losses(two_ranks: tuple[Path, dict], name: str) -> dict[int, float]:
    root, failed = two_ranks
    assert failed[name] is None, f"{name}: {failed[name]}"
    return losses_of(root / name)


def _assert_same(got: dict[int, float], want: dict[int, float], rel: float = 1e-5) -> None:
    assert sorted(got) == [1, 2, 3, 4] and got[4] < got[1]
    assert [got[s] for s in range(1, 5)] == pytest.approx([want[s] for s in range(1, 5)],
                                                          rel=rel)


# ----------------------------------------------------------------------------- 2 ranks

@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("family", FAMILIES)
def test_family_under_mode_matches_one_process(family, mode, two_ranks, single):
    _assert_same(_losses(two_ranks, f"{family}-{mode}"), single[family])


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("family", STRUCTURAL)
def test_a_family_split_by_its_structure_trains_in_stages_like_one_process(family, two_ranks,
                                                                           single):
    """Phi-3, Gemma 2 (its logits soft-capped after the head) and Falcon were refused for
    pipeline stages (a list of six families); their stages now come from the model's structure,
    checked against its whole forward."""
    _assert_same(_losses(two_ranks, f"{family}-pipeline"), single[family])


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_what_each_mode_did_is_logged(two_ranks):
    root, _ = two_ranks
    log = {name: (root / name / "train.log").read_text()
           for name in ("llama-semi_auto", "gpt2-semi_auto", "mixtral-semi_auto",
                        "llama-pipeline", "mixtral-pipeline", "llama-optimizer",
                        "llama-embedding_on_cpu", "llama-auto")}
    assert "uses conf/strategy/hf_llama_megatron.yaml" in log["llama-semi_auto"]
    assert "model.layers.0.mlp.gate_proj.weight [64, 32] -> local [32, 32]  (S(0))" in \
        log["llama-semi_auto"]  # column parallel over the 2 ranks
    assert "transformer.h.0.mlp.c_fc.weight [32, 128] -> local [32, 64]  (S(1))" in \
        log["gpt2-semi_auto"]  # GPT-2's Conv1D: weight [in, out], columns split
    assert "uses conf/strategy/hf_mixtral_megatron.yaml" in log["mixtral-semi_auto"]
    assert "model.embed_tokens" in log["llama-pipeline"] and "stage 1" in log["llama-pipeline"]
    assert "pipeline split of MixtralForCausalLM (model=hf) by parameters" in \
        log["mixtral-pipeline"]  # HF's expert loop does not run on fake tensors
    assert "optimizer parallel level3" in log["llama-optimizer"]
    assert "tok_emb is LlamaForCausalLM (model=hf)'s input embedding, model.embed_tokens" in \
        log["llama-embedding_on_cpu"]
    assert "on the host: model.embed_tokens.weight" in log["llama-embedding_on_cpu"]
    assert "uses conf/strategy/hf_llama_auto.yaml" in log["llama-auto"]


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", ["llama-auto", "gpt2-auto", "mixtral-auto",
                                  "llama-embedding_on_cpu", "custom-data"])
def test_more_modes_match_one_process(name, two_ranks, single):
    _assert_same(_losses(two_ranks, name), single[name.split("-")[0]])


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_offloaded_gpt2_matches_one_offloaded_process(two_ranks, single):
    """bf16 weights, FP32 Adam on the host: equal up to the order the ranks' bf16 gradients
    are reduced in."""
    _assert_same(_losses(two_ranks, "gpt2-offload"), single["gpt2-offload"], rel=1e-3)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_cli_trains_a_saved_model_on_two_ranks(tmp_path, cache, saved_llama, single):
    """torchrun recipes/train.py model=hf model.path=DIR: Hydra's command line, the saved weights
    (the same run as the in-process reference), a checkpoint that resumes."""
    run = tmp_path / "cli"
    proc = run_recipe(["model=hf", f"model.path={saved_llama}", "parallel=data",
                       "trainer.checkpoint_every=2"], 2, run, cache, tiny=HF_TINY,
                      torchrun=True)
    _assert_same(losses_of(run), single["llama"])
    assert "LlamaForCausalLM (model=hf) with" in (run / "train.log").read_text()
    assert "Training summary" in proc.stdout
    again = tmp_path / "resumed"
    run_recipe(["model=hf", f"model.path={saved_llama}", "parallel=data",
                f"trainer.resume_from={run / 'checkpoints' / 'step_000002'}"], 2, again, cache,
               tiny=HF_TINY)
    resumed = losses_of(again)
    assert [resumed[3], resumed[4]] == pytest.approx([single["llama"][3], single["llama"][4]],
                                                     rel=1e-5)


# ----------------------------------------------------------------------------- in process

def _build(model_type: str, layers: int = 4, vocab: int = 40, **extra: Any) -> torch.nn.Module:
    from recipes.hf_model import build_hf_model

    sizes = ({"n_embd": 32, "n_layer": layers, "n_head": 4} if model_type == "gpt2" else
             {"hidden_size": 32, "num_hidden_layers": layers, "num_attention_heads": 4,
              "num_key_value_heads": 2, "intermediate_size": 64})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return build_hf_model(None, {"model_type": model_type, **sizes, **extra}, vocab,
                              experts_implementation="batched_mm")


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2", "qwen3", "mixtral", "gpt2",
                                        "phi3", "gemma", "gemma2", "falcon", "olmo2",
                                        "gpt_neox", "cohere", "bloom"])
def test_two_pipeline_stages_compute_the_whole_models_logits(model_type):
    """The stage split (module deletion) of each family, its layout read from its structure:
    stage 0 holds the embedding and the first layers, stage 1 the rest, the final norm and the
    head; run one after the other they give the whole model's logits exactly, and the dry run on
    fake tensors (which the pipeline split runs) passes."""
    from parallel.pipeline.carve import carve
    from parallel.pipeline.partition import plan_stages
    from parallel.pipeline.verify import check_stages_run

    torch.manual_seed(0)
    model = _build(model_type, **({"head_dim": 8} if model_type == "qwen3" else {})).eval()
    x = torch.randint(0, 40, (2, 8), generator=torch.Generator().manual_seed(1))
    logits, _ = model(x)
    plan = plan_stages(model, 2, {}, (x,))
    check_stages_run(model, plan, (x,))
    units = {u.path for u in plan.units}
    hidden = x
    for stage in range(2):
        hidden = carve(model, set(plan.stage_units(stage)), units, in_place=False)(hidden)
    assert plan.stage_units(0)[0].endswith(("embed_tokens", "wte", "embed_in", "word_embeddings"))
    assert plan.stage_units(1)[-1] == "lm_head"
    torch.testing.assert_close(hidden, logits, rtol=0, atol=0)


def test_an_inline_config_takes_the_tokenizers_vocabulary():
    model = _build("gpt2", layers=1)
    assert model.config.vocab_size == 40 and not model.config.use_cache
    assert model.config.bos_token_id is None  # GPT-2's 50256 names no token of 40
    assert _build("llama", layers=1, vocab_size=64).config.vocab_size == 64  # larger: kept
    with pytest.raises(ValueError, match=r"model.config.vocab_size=30 is smaller than the data's "
                                         r"tokenizer \(40 tokens\)"):
        _build("llama", layers=1, vocab_size=30)
    with pytest.raises(ValueError, match="Unrecognized model identifier: nosuch"):
        _build("nosuch")


def test_a_saved_model_loads_with_its_weights(saved_llama):
    from recipes.hf_model import build_hf_model

    model = build_hf_model(str(saved_llama), None, 40)
    saved = transformers.AutoModelForCausalLM.from_pretrained(saved_llama)
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.vocab_size == 48
    for (name, p), (_, q) in zip(model.named_parameters(), saved.named_parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=name)
    with pytest.raises(ValueError, match=r"has vocab_size=48, but the data's tokenizer has 50"):
        build_hf_model(str(saved_llama), None, 50)
    with pytest.raises(ValueError, match="not a local save_pretrained directory .* does not "
                                         "download"):
        build_hf_model("meta-llama/Llama-3.2-1B", None, 40)


def test_the_recipe_convention_and_huggingfaces_own(tmp_path):
    """``model(idx, targets)`` is ``(logits, HF's .loss)`` on already-shifted targets (strided
    ones too); called the HF way the model is unchanged, and ``save_pretrained`` writes a model
    ``from_pretrained`` loads with the same logits."""
    torch.manual_seed(0)
    model = _build("llama", layers=2).eval()
    window = torch.randint(0, 40, (2, 9), generator=torch.Generator().manual_seed(1))
    x, y = window[:, :-1], window[:, 1:]  # the recipe's batches: y is a strided view
    logits, loss = model(x, y)
    torch.testing.assert_close(loss, torch.nn.functional.cross_entropy(
        logits.flatten(0, 1), y.flatten()))
    out = model(input_ids=x, labels=x)  # HF shifts its labels itself
    assert isinstance(out, transformers.modeling_outputs.CausalLMOutputWithPast)
    torch.testing.assert_close(out.logits, logits)
    model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == \
        ["LlamaForCausalLM"]
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(again).__module__.startswith("transformers.")
    torch.testing.assert_close(again(input_ids=x).logits, logits)


def test_a_view_of_an_hf_model_walks_its_names():
    """Wrappers (``ModelView``) answer attribute paths as the model does: an HF causal LM's
    decoder is its submodule ``model``, so ``view.model.embed_tokens`` (how DCP walks a state
    dict's key) is the model's, not the wrapper's alias of the whole model."""
    from foundation.model_view import ModelView

    hf = _build("llama", layers=1)
    view = ModelView(hf)
    assert view.model is hf.model and view.module is hf
    assert view.get_submodule("model.embed_tokens") is hf.model.embed_tokens


def test_a_placed_hf_model_takes_strided_targets():
    """``hetero.place`` captures on contiguous twins of the inputs; a strided ``targets`` (the
    recipe's) runs the captured graph as it is, with the unplaced model's loss."""
    import hetero

    torch.manual_seed(0)
    model = _build("llama", layers=1)
    reference = _build("llama", layers=1)
    reference.load_state_dict(model.state_dict())
    hetero.set_device(model.model.embed_tokens, "cpu")
    window = torch.randint(0, 40, (2, 9), generator=torch.Generator().manual_seed(1))
    placed = hetero.place(model, (window[:, :-1], window[:, 1:]))
    window = torch.randint(0, 40, (2, 9), generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(placed(window[:, :-1], window[:, 1:])[1],
                               reference(window[:, :-1], window[:, 1:])[1])


def _custom(returns: str) -> list[str]:
    return ["model=custom", "model._target_=custom_lm.TinyLM",
            f"model.kwargs={{d_model:32,n_layer:1,returns:{returns}}}", "parallel=none",
            "trainer.recompute=full"]


@pytest.fixture(scope="module")
def custom_losses(tmp_path_factory, cache) -> dict[int, float]:
    """The user's class returning its loss, in this process."""
    run = tmp_path_factory.mktemp("custom") / "loss"
    train_in_process(_custom("loss"), run, cache, tiny=HF_TINY)
    return losses_of(run)


@pytest.mark.parametrize("returns", ["logits", "both"])
def test_a_custom_class_trains_whatever_it_returns(returns, tmp_path, cache, custom_losses):
    """Logits (the recipe's cross-entropy on them) or (logits, loss): the losses of the class
    returning its loss, which learns; its layer list is recomputed."""
    assert custom_losses[4] < custom_losses[1]
    train_in_process(_custom(returns), tmp_path, cache, tiny=HF_TINY)
    got = losses_of(tmp_path)
    assert [got[s] for s in range(1, 5)] == pytest.approx(
        [custom_losses[s] for s in range(1, 5)], rel=1e-6)


def test_an_hf_model_trains_in_process_with_eval_and_recompute(tmp_path, cache):
    train_in_process(["model=hf", INLINE["qwen2"], "parallel=none", "trainer.eval_every=2",
                      "trainer.recompute=selective", "trainer.grad_accum_steps=2"],
                     tmp_path, cache, tiny=HF_TINY)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "eval_loss" in r] == [2, 4]
    assert records[-1]["loss"] < records[0]["loss"]


# ----------------------------------------------------------------------------- refusals

def _check(overrides: list[str]) -> None:
    from recipes.models import check_model_modes

    cfg = compose_train([*HF_TINY, *overrides])
    config_schema.check_config(cfg)
    check_model_modes(cfg)


@pytest.mark.parametrize("overrides, match", [
    (["model=hf", INLINE["mixtral"], "parallel=expert"],
     r"parallel.expert_degree=2 shards the experts of parallel.nn.MoE layers, and model=hf "
     r"\(mixtral\) has none: mixtral keeps its experts in HuggingFace's own module"),
    (["model=hf", INLINE["mixtral"], "parallel=semi_auto"],
     r"HuggingFace's expert loop \(model.experts_implementation=eager\) routes tokens with "
     r"torch.nonzero, which DTensor cannot shard. model.experts_implementation=batched_mm"),
    (["model=hf", f"model.config={{model_type:xglm,{_LAYERS}}}", "parallel=pipeline"],
     r"for model_type 'xglm' two stages of a 2-layer xglm do not compute its forward "
     r"\(largest difference .*\): its forward does more than embed -> layers -> norm -> head"),
    (["model=hf", f"model.config={{model_type:biogpt,{_LAYERS}}}", "parallel=pipeline"],
     r"for model_type 'biogpt' two stages of a 2-layer biogpt cannot run its forward "
     r"\(TypeError: .*position_ids"),
    (["model=hf", INLINE["mixtral"].replace("}", ",output_router_logits:true}"),
      "parallel=pipeline"], r"output_router_logits=true adds the router's balancing loss"),
    (["model=hf", "model.config={model_type:gemma,hidden_size:32}", "parallel=semi_auto"],
     r"parallel.strategy=gpt_megatron shards the recipe GPT's modules; model=hf \(gemma\) needs "
     r"a strategy file of its own"),
    ([*CUSTOM, "parallel=auto"], r"parallel.strategy=gpt_mlp_columns shards the recipe GPT's "
                                 r"modules; model=custom \(custom_lm.TinyLM\) needs"),
    (["model=hf", LLAMA, "parallel=semi_auto", "parallel.multi_copy=2"],
     r"parallel.multi_copy=2 .* cannot trace HuggingFace's forward"),
    (["model=hf", LLAMA, "parallel=data", "parallel.tensor_degree=2"],
     r"parallel.tensor_degree=2 without a strategy file or a search asks the model to split "
     r"itself"),
    (["model=hf", "model.path=/no/such/dir"], r"model.path=/no/such/dir: not a local "
                                              r"save_pretrained directory"),
])
def test_a_mode_the_model_cannot_train_under_is_refused_by_name(overrides, match):
    with pytest.raises(ValueError, match=match):
        _check(overrides)


def test_refusals_come_before_any_work(tmp_path, cache):
    """The recipe refuses before its process group, data or model exist."""
    import torch.distributed as dist

    from recipes.train import TrainRecipe

    cfg = compose_train([*HF_TINY, f"data.cache_dir={cache / 'never'}", "model=hf",
                         INLINE["mixtral"], "parallel=expert"])
    with pytest.raises(ValueError, match="expert_degree=2"):
        TrainRecipe(cfg, tmp_path).setup()
    assert not dist.is_initialized() and not (cache / "never").exists()


@pytest.mark.parametrize("overrides, match", [
    (["model=hf"], "model.path and config are both unset: model=hf needs one of them"),
    (["model=hf", LLAMA, "model.path=/x"], "model.path=/x and config are both set"),
    (["model=hf", "model.config={hidden_size:32}"], "config needs its model_type"),
])
def test_the_model_group_is_checked_when_composed(overrides, match):
    with pytest.raises(ValueError, match=match):
        _check(overrides)


def test_the_modes_that_work_pass_the_check(saved_llama):
    for overrides in (["model=hf", f"model.path={saved_llama}", "parallel=pipeline"],
                      ["model=hf", INLINE["mixtral"], "parallel=semi_auto",
                       "model.experts_implementation=batched_mm"],
                      ["model=hf", INLINE["gpt2"], "parallel=auto"],
                      ["model=hf", LLAMA, "parallel=hybrid_3d"],
                      [*CUSTOM, "parallel=semi_auto", "parallel.strategy=/my/strategy.yaml"]):
        _check(overrides)


def test_a_trained_hf_run_exports_to_a_directory_from_pretrained_loads(tmp_path, cache):
    """``model=hf`` run -> its checkpoint -> ``recipes.export --to hf`` -> ``from_pretrained``:
    the loaded model's logits equal the trained model's."""
    from recipes.export import export

    held: dict[str, Any] = {}
    train_in_process(["model=hf", INLINE["qwen2"], "parallel=none", "trainer.checkpoint_every=4"],
                     tmp_path, cache, patch=lambda recipe: held.update(recipe=recipe),
                     tiny=HF_TINY)
    trained = held["recipe"].model
    trained = getattr(trained, "module", trained).eval()
    out = export(tmp_path / "checkpoints" / "step_000004", "hf", tmp_path / "qwen2-hf")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(loaded).__name__ == "Qwen2ForCausalLM"
    idx = torch.randint(0, loaded.config.vocab_size, (2, 16), generator=torch.Generator()
                        .manual_seed(0))
    with torch.no_grad():
        logits, _ = trained(idx)  # the recipe's calling convention: (logits, loss)
        assert torch.equal(loaded(idx).logits, logits)
