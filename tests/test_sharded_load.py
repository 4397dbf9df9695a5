"""Sharded loading: a meta-device model given to ``parallel.parallelize(..., weights=path)``
reads, on every rank, only its block of each tensor straight from a local checkpoint — bitwise
the same slices as loading the file whole in one process and sharding it.

Files are written first to a temporary directory: the recipe GPT (dense and MoE) as a
safetensors file (safetensors' ``save_model``: one name of the tied embedding kept) and as a
DCP directory, and a tiny random-init HF Llama by ``save_pretrained`` (one ``model.safetensors``;
and tied, in 20 KB shards with an index). The one-process tests check the files, the names and
the refusals; the multi-rank cases share one spawn of 4 gloo ranks and one of 2: data,
pipeline, optimizer level 3, expert parallel and their pipeline combinations (semi-auto on the
meta device is skipped while it is refused), a model with values loaded after ``parallelize``
(``parallel.load_weights``: level 3, a pipeline, semi-auto's row- and column-sharded Megatron
layout), the bytes each rank reads (1/N of a sharded tensor, only its stage's tensors) and its
peak memory while loading."""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import transformers
from peak_tensor_bytes import PeakTensorBytes
from safetensors.torch import load_file, save_file, save_model
from torch import nn
from torch.distributed.tensor import DTensor
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

import parallel
from distributed import run_ranks
from foundation.compat import dtensor_slice
from parallel import ParallelConfig
from parallel.semi_auto import load_strategy_file
from parallel.weights.deferred_init import canonical_names
from parallel.weights.files import SafetensorsWeights
from recipes.gpt import GPT, lm_loss
from recipes.parallel_mode import STRATEGY_DIR

VOCAB, SEQ, SEED = 37, 8, 1234
MOE = dict(num_experts=4, top_k=2, capacity_factor=1.0, aux_loss_factor=0.05)


def meta_gpt(moe: bool = False, n_layer: int = 4, d_model: int = 16) -> GPT:
    with torch.device("meta"):
        return GPT(VOCAB, d_model=d_model, n_layer=n_layer, n_head=2, block_size=SEQ,
                   moe=MOE if moe else None, moe_every=2)


def llama_config(tied: bool) -> transformers.LlamaConfig:
    return transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                    num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=2, max_position_embeddings=SEQ,
                                    tie_word_embeddings=tied)


def meta_llama(tied: bool) -> nn.Module:
    """A Llama with every parameter on the meta device; its rotary embedding (buffers computed
    from the config, not saved) built real — the HF ``init_empty_weights`` convention."""
    config = llama_config(tied)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    model.model.rotary_emb = LlamaRotaryEmbedding(config=config)
    return model


def build(kind: str) -> nn.Module:
    return {"gpt": meta_gpt, "gpt_dcp": meta_gpt, "gpt_moe": lambda: meta_gpt(moe=True),
            "llama": lambda: meta_llama(False), "llama_sharded": lambda: meta_llama(True),
            "big": lambda: meta_gpt(d_model=512)}[kind]()


def write_files(root: Path) -> dict[str, str]:
    """Every checkpoint the tests read, written from random-init models."""
    files = {}
    for kind in ("gpt", "gpt_moe", "big"):
        model = parallel.materialize(build(kind), seed=SEED, device="cpu")
        files[kind] = str(root / f"{kind}.safetensors")
        save_model(model, files[kind])
        if kind == "gpt":
            files["gpt_dcp"] = str(root / "gpt_dcp")
            with warnings.catch_warnings():  # one process without a group is meant here
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                dcp.save(model.state_dict(), checkpoint_id=files["gpt_dcp"], no_dist=True)
            state = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
            save_file({k: v for k, v in state.items() if k != "ln_f.bias"},
                      root / "missing.safetensors")
            save_file({**state, "ln_f.bias": torch.zeros(17)}, root / "shape.safetensors")
            save_file({**state, "extra.weight": torch.zeros(2)}, root / "extra.safetensors")
    for kind, tied, shard in (("llama", False, None), ("llama_sharded", True, "20KB")):
        torch.manual_seed(SEED)
        model = transformers.AutoModelForCausalLM.from_config(llama_config(tied))
        files[kind] = str(root / kind)
        model.save_pretrained(files[kind], **({"max_shard_size": shard} if shard else {}))
    for bad in ("missing", "shape", "extra"):
        files[bad] = str(root / f"{bad}.safetensors")
    files["root"] = str(root)
    return files


def whole_file(kind: str, files: dict[str, str]) -> dict[str, torch.Tensor]:
    """The file loaded whole in one process: every key's full tensor."""
    path = Path(files[kind])
    if kind == "gpt_dcp":  # DCP fills a state dict of whole tensors (here: another seed's)
        state = parallel.materialize(build("gpt"), seed=SEED + 2, device="cpu").state_dict()
        with warnings.catch_warnings():  # one process is meant, also on a rank
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, checkpoint_id=str(path), no_dist=True)
        return state
    if path.is_file():
        return load_file(path)
    return {k: v for f in sorted(path.glob("*.safetensors")) for k, v in load_file(f).items()}


def check_slices(model: nn.Module, kind: str, files: dict[str, str]) -> list[str]:
    """Names whose local block is not bitwise the whole file's slice (or still meta); the file's
    tied key serves every alias, a non-persistent buffer is checked against a real build."""
    whole, aliases = whole_file(kind, files), canonical_names(build(kind))
    groups: dict[str, list[str]] = {}
    for name, canonical in aliases.items():
        groups.setdefault(canonical, []).append(name)
    bad = []
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        key = next((n for n in groups[aliases[name]] if n in whole), None)
        if key is None:  # rotary inv_freq: computed from the config
            full = LlamaRotaryEmbedding(config=llama_config(False)).get_buffer(name.split(".")[-1])
        else:
            full = whole[key]
        local, want = (t.to_local(), full[dtensor_slice(t)]) if isinstance(t, DTensor) else \
            (t, full)
        if local.is_meta or not torch.equal(local.detach(), want):
            bad.append(name)
    return bad


def _pipeline_loss(output, target: torch.Tensor) -> torch.Tensor:
    return lm_loss(output[0] if isinstance(output, tuple) else output, target)


class Reads:
    """Records every block read through safetensors ``get_slice`` on this rank."""

    def __init__(self) -> None:
        self.log: list[tuple[str, int]] = []
        self._read = SafetensorsWeights.read

    def __enter__(self) -> Reads:
        log, read = self.log, self._read

        def recording(source, handle, key, index):
            block = read(source, handle, key, index)
            log.append((key, block.numel() * block.element_size()))
            return block

        SafetensorsWeights.read = recording
        return self

    def __exit__(self, *exc) -> None:
        SafetensorsWeights.read = self._read


def sharded(kind: str, config: ParallelConfig, files: dict[str, str]) -> nn.Module:
    model = build(kind)
    pipelined = config.pipeline_degree > 1
    x = torch.randint(0, VOCAB, (2, SEQ))
    return parallel.parallelize(model, config, weights=files[kind],
                                loss_fn=_pipeline_loss if pipelined else None,
                                example_inputs=(x,) if pipelined else None).model


def _case(kind: str, config: ParallelConfig, files: dict[str, str]) -> dict:
    with Reads() as reads:
        try:
            model = sharded(kind, config, files)
        except ValueError as err:  # semi-auto on the meta device: built by another branch
            if "is not built yet with deferred initialization" not in str(err):
                raise
            return {"skipped": str(err)}
    return {"bad": check_slices(model, kind, files), "reads": reads.log}


class DcpReads:
    """Bytes this rank's DCP loads read from the files: each read item's stored chunk (DCP reads
    a chunk whole and narrows it to the overlap)."""

    def __init__(self) -> None:
        self.bytes = 0
        self._read = dcp.FileSystemReader.read_data

    def __enter__(self) -> DcpReads:
        counter, read = self, self._read

        def counting(reader, plan, planner):
            counter.bytes += sum(reader.storage_data[item.storage_index].length
                                 for item in plan.items)
            return read(reader, plan, planner)

        dcp.FileSystemReader.read_data = counting
        return self

    def __exit__(self, *exc) -> None:
        dcp.FileSystemReader.read_data = self._read


def _dcp_layouts(files: dict[str, str]) -> dict:
    """Level 3 on 4 ranks from DCP: saved by one process (one chunk per tensor: each rank reads
    every chunk whole and keeps its rows), and — the ~50 MB GPT, where pickling's per-chunk
    bytes do not count — saved by the same level-3 layout (each rank's shards are its own
    chunks: it reads only those)."""
    config = ParallelConfig(**LEVEL3)
    with DcpReads() as whole_saved:
        sharded("gpt_dcp", config, files)
    saved = str(Path(files["root"]) / "big_dcp_level3")
    dcp.save(sharded("big", config, files).state_dict(), checkpoint_id=saved)
    with DcpReads() as layout_saved:
        model = parallel.parallelize(build("big"), config, weights=saved).model
    return {"whole saved": whole_saved.bytes, "layout saved": layout_saved.bytes,
            "bad": check_slices(model, "big", files)}


def _loaded_after(files: dict[str, str], config: ParallelConfig) -> dict:
    """A model with values (another seed), parallelized, then ``parallel.load_weights``; a bad
    file first, which must leave every value as it was."""
    model = parallel.materialize(build("gpt"), seed=SEED + 1, device="cpu")
    pipelined = config.pipeline_degree > 1
    result = parallel.parallelize(model, config, loss_fn=_pipeline_loss if pipelined else None,
                                  example_inputs=(torch.randint(0, VOCAB, (2, SEQ)),)
                                  if pipelined else None)
    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if isinstance(t, DTensor) else t

    before = [local(t).detach().clone() for t in result.model.parameters()]
    try:
        parallel.load_weights(result, files["shape"])
        refused = ""
    except ValueError as err:
        refused = str(err)
    unchanged = all(torch.equal(a, local(t)) for a, t in zip(
        before, result.model.parameters(), strict=True))
    with Reads() as reads:
        parallel.load_weights(result, files["gpt"])
    return {"bad": check_slices(result.model, "gpt", files), "reads": reads.log,
            "refused": refused, "unchanged": unchanged}


def _refusals(files: dict[str, str]) -> dict[str, str]:
    """Bad files given to parallelize: the error, and the model untouched (still meta)."""
    found = {}
    for bad in ("missing", "shape", "extra"):
        model = build("gpt")
        try:
            parallel.parallelize(model, ParallelConfig(optimizer_level="level3", **OPTIMIZER),
                                 weights=files[bad])
            found[bad] = "loaded"
        except ValueError as err:
            untouched = all(t.is_meta for t in model.parameters())
            found[bad] = str(err) + ("" if untouched else " [MODEL CHANGED]")
    model = parallel.materialize(build("gpt"), seed=SEED, device="cpu")
    try:
        parallel.parallelize(model, ParallelConfig(**LEVEL3), weights=files["shape"])
        found["shape, a model with values"] = "loaded"
    except ValueError as err:
        untouched = not any(isinstance(t, DTensor) for t in model.parameters())
        found["shape, a model with values"] = str(err) + ("" if untouched else
                                                          " [MODEL CHANGED]")
    return found


def _given_values(files: dict[str, str]) -> dict:
    """A model with values (another seed) given to ``parallelize(..., weights=)``: loaded at
    the end, into what the rank holds."""
    model = parallel.materialize(build("gpt"), seed=SEED + 1, device="cpu")
    with Reads() as reads:
        result = parallel.parallelize(model, ParallelConfig(**LEVEL3), weights=files["gpt"])
    return {"bad": check_slices(result.model, "gpt", files), "reads": reads.log}


def _memory(config: ParallelConfig, files: dict[str, str]) -> dict:
    """A ~50 MB GPT (4 blocks of ~13 MB) loaded on 4 ranks: the peak tensor bytes the rank
    allocates while it is parallelized and loaded (the memory-mapped safetensors file is not
    among them), against the whole model and what the rank holds."""
    model = build("big")
    whole = sum(p.numel() * p.element_size() for p in model.parameters())
    largest = max(p.numel() * p.element_size() for p in model.parameters())
    with Reads() as reads, PeakTensorBytes() as peak:
        loaded = sharded("big", config, files)
    held = sum(t.numel() * t.element_size() for t in (
        p.to_local() if isinstance(p, DTensor) else p for p in loaded.parameters()))
    return {"whole": whole, "held": held, "largest": largest, "peak": peak.bytes,
            "read": sum(n for _, n in reads.log), "bad": check_slices(loaded, "big", files)}


OPTIMIZER = dict(enable_parallel_optimizer=True, parallel_optimizer_threshold=0)
LEVEL3 = dict(optimizer_level="level3", **OPTIMIZER)
#: the recipe's Megatron strategies: column- and row-sharded (Shard(0) and Shard(1)) weights
MEGATRON = dict(data_degree=2, tensor_degree=2,
                strategies=load_strategy_file(STRATEGY_DIR / "gpt_megatron.yaml", dp=2, mp=2))
CASES = {  # world -> name -> (file kind, config)
    4: {
        "gpt data dp4": ("gpt", ParallelConfig()),
        "gpt pipeline pp4": ("gpt", ParallelConfig(pipeline_degree=4, micro_batches=4,
                                                   schedule="gpipe")),
        "gpt pipeline pp2×dp2": ("gpt", ParallelConfig(pipeline_degree=2, micro_batches=2)),
        "gpt optimizer level3 dp4": ("gpt", ParallelConfig(**LEVEL3)),
        "gpt pipeline pp2 × level3 dp2": ("gpt", ParallelConfig(pipeline_degree=2,
                                                                micro_batches=2, **LEVEL3)),
        "gpt_moe expert ep4": ("gpt_moe", ParallelConfig(expert_degree=4)),
        "gpt_moe pipeline pp2 × expert ep2": ("gpt_moe", ParallelConfig(
            pipeline_degree=2, micro_batches=2, expert_degree=2)),
        "gpt DCP optimizer level3 dp4": ("gpt_dcp", ParallelConfig(**LEVEL3)),
        "gpt DCP pipeline pp2×dp2": ("gpt_dcp", ParallelConfig(pipeline_degree=2,
                                                               micro_batches=2)),
        "llama save_pretrained data dp4": ("llama", ParallelConfig()),
        "llama sharded index level3 dp4": ("llama_sharded", ParallelConfig(**LEVEL3)),
        "gpt semi-auto megatron dp2×tp2": ("gpt", ParallelConfig(**MEGATRON)),
    },
    2: {
        "gpt pipeline pp2": ("gpt", ParallelConfig(pipeline_degree=2, micro_batches=2)),
        "gpt optimizer level3 dp2": ("gpt", ParallelConfig(**LEVEL3)),
        "gpt_moe expert ep2": ("gpt_moe", ParallelConfig(expert_degree=2)),
        "llama save_pretrained level3 dp2": ("llama", ParallelConfig(**LEVEL3)),
        "llama sharded index data dp2": ("llama_sharded", ParallelConfig()),
    },
}
MEMORY = {
    "memory optimizer level3 dp4": ParallelConfig(**LEVEL3),
    "memory pipeline pp4": ParallelConfig(pipeline_degree=4, micro_batches=4, schedule="gpipe"),
}


AFTER = {  # a model with values, parallelized, then parallel.load_weights
    "loaded after parallelize: level3 dp4": ParallelConfig(**LEVEL3),
    "loaded after parallelize: pipeline pp2×dp2": ParallelConfig(pipeline_degree=2,
                                                                micro_batches=2),
    "loaded after parallelize: semi-auto megatron dp2×tp2": ParallelConfig(**MEGATRON),
}


def _all_cases(rank: int, world: int, files: dict[str, str]) -> dict:
    parallel.init()
    out: dict = {name: _case(kind, config, files) for name, (kind, config) in
                 CASES[world].items()}
    if world == 4:
        out.update({name: _memory(config, files) for name, config in MEMORY.items()})
        out.update({name: _loaded_after(files, config) for name, config in AFTER.items()})
        out["refused"] = _refusals(files)
        out["weights= with values"] = _given_values(files)
        out["dcp layouts"] = _dcp_layouts(files)
    dist.barrier()
    return out


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, str]:
    return write_files(tmp_path_factory.mktemp("weights"))


@pytest.fixture(scope="module")
def ranks(files) -> dict[int, list[dict]]:
    return {4: run_ranks(_all_cases, 4, files, timeout=400),
            2: run_ranks(_all_cases, 2, files, timeout=200)}


# ---------------------------------------------------------------- one process
def test_materialize_from_each_file_kind_equals_the_file(files):
    for kind in ("gpt", "gpt_moe", "gpt_dcp", "llama", "llama_sharded"):
        model = parallel.materialize(build(kind), seed=SEED + 1, device="cpu",
                                     weights=files[kind])
        assert check_slices(model, kind, files) == [], kind
    tied = parallel.materialize(build("llama_sharded"), device="cpu",
                                weights=files["llama_sharded"])
    assert tied.lm_head.weight is tied.model.embed_tokens.weight  # omitted from the file
    assert len(list(Path(files["llama_sharded"]).glob("*.safetensors"))) > 2


def test_bad_sources_are_refused_by_name_before_anything_is_written(files, tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere does not exist"):
        parallel.materialize(build("gpt"), weights=tmp_path / "nowhere")
    (tmp_path / "model.pt").write_bytes(b"")
    with pytest.raises(ValueError, match=r"model.pt is not a .safetensors file.*pickle"):
        parallel.materialize(build("gpt"), weights=tmp_path / "model.pt")
    with pytest.raises(ValueError, match=r"has no model.safetensors, model.safetensors.index"):
        parallel.materialize(build("gpt"), weights=tmp_path)
    (tmp_path / "junk.safetensors").write_bytes(b"not a header")
    with pytest.raises(ValueError, match=r"junk.safetensors is not a readable safetensors file"):
        parallel.materialize(build("gpt"), weights=tmp_path / "junk.safetensors")
    stale = tmp_path / "stale"
    shutil.copytree(files["llama_sharded"], stale)
    index = json.loads((stale / "model.safetensors.index.json").read_text())
    weight_map = index["weight_map"]
    real = weight_map["model.norm.weight"]
    weight_map["model.norm.weight"] = next(f for f in sorted(set(weight_map.values()))
                                           if f != real)
    (stale / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"maps 'model.norm.weight' to .*, which does not hold"):
        parallel.materialize(build("llama_sharded"), weights=stale)
    rules = {"missing": r"missing key 'ln_f.bias' in .*missing.safetensors: strict loading",
             "shape": r"shape mismatch: 'ln_f.bias' is \(17,\) in .*shape.safetensors, the "
                      r"model's 'ln_f.bias' is \(16,\)",
             "extra": r"unexpected key 'extra.weight' \(in .*extra.safetensors\)"}
    for bad, rule in rules.items():
        model = build("gpt")
        with pytest.raises(ValueError, match=rule):
            parallel.materialize(model, weights=files[bad])
        assert all(t.is_meta for t in model.parameters())  # nothing half-applied
    model = parallel.materialize(build("gpt"), seed=SEED, device="cpu")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match="shape mismatch"):
        parallel.load_weights(model, files["shape"])
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    with pytest.raises(ValueError, match="'tok_emb.weight' is on the meta device"):
        parallel.load_weights(build("gpt"), files["gpt"])


def test_non_strict_keeps_what_the_file_lacks_and_ignores_what_the_model_lacks(files):
    model = parallel.materialize(build("gpt"), seed=SEED + 1, device="cpu")
    kept = model.ln_f.bias.detach().clone()
    parallel.load_weights(model, files["missing"], strict=False)
    assert torch.equal(model.ln_f.bias, kept)
    assert torch.equal(model.ln_f.weight, load_file(files["gpt"])["ln_f.weight"])
    parallel.load_weights(model, files["extra"], strict=False)
    seeded = parallel.materialize(build("gpt"), seed=7, device="cpu", weights=files["missing"],
                                  strict=False)
    assert torch.equal(seeded.ln_f.bias, torch.zeros(16))  # GPT's init rule for a LayerNorm


# ---------------------------------------------------------------- the ranks
@pytest.mark.slow
@pytest.mark.parametrize("world,name", [(w, n) for w, cases in CASES.items() for n in cases])
def test_rank_blocks_equal_the_file_loaded_whole_then_sharded(ranks, world, name):
    if "skipped" in ranks[world][0][name]:
        pytest.skip(ranks[world][0][name]["skipped"])
    for rank, results in enumerate(ranks[world]):
        assert results[name]["bad"] == [], f"{name}: rank {rank}"


def _file_bytes(kind: str, files: dict[str, str]) -> dict[str, int]:
    return {k: v.numel() * v.element_size() for k, v in whole_file(kind, files).items()}


@pytest.mark.slow
@pytest.mark.parametrize("world", [4, 2])
def test_each_rank_reads_one_share_of_a_sharded_tensor(ranks, world, files):
    """Optimizer level 3 (every tensor sharded): each key read once per rank, the ranks' blocks
    add up to the file exactly, and no rank reads more than its ceil share of any tensor."""
    name = f"gpt optimizer level3 dp{world}"
    sizes, whole = _file_bytes("gpt", files), whole_file("gpt", files)
    total: dict[str, int] = {}
    for results in ranks[world]:
        reads = results[name]["reads"]
        assert len(reads) == len({k for k, _ in reads}) == len(sizes)
        for key, n in reads:
            rows = whole[key].shape[0]
            assert n <= -(-rows // world) * sizes[key] // rows, (key, n)
            total[key] = total.get(key, 0) + n
    assert total == sizes
    experts = f"gpt_moe expert ep{world}"
    moe_sizes = _file_bytes("gpt_moe", files)
    for results in ranks[world]:
        for key, n in results[experts]["reads"]:
            want = moe_sizes[key] // world if ".experts." in key else moe_sizes[key]
            assert n == want, (key, n)


@pytest.mark.slow
def test_a_pipeline_stage_reads_only_its_own_tensors(ranks, files):
    for rank, results in enumerate(ranks[4]):
        keys = {k for k, _ in results["gpt pipeline pp4"]["reads"]}
        blocks = {k.split(".")[1] for k in keys if k.startswith("blocks.")}
        assert blocks == {str(rank)}, keys  # one block per stage, one stage per rank
        # the embedding and head files' tied key: read on the first and the last stage only
        assert ("pos_emb.weight" in keys) == (rank == 0)
        assert ("ln_f.weight" in keys) == (rank == 3)


@pytest.mark.slow
def test_parallelize_loads_weights_into_a_model_with_values_at_the_end(ranks, files):
    for rank, results in enumerate(ranks[4]):
        given = results["weights= with values"]
        assert given["bad"] == [], f"rank {rank}"
        assert sum(n for _, n in given["reads"]) < sum(_file_bytes("gpt", files).values()) / 3


@pytest.mark.slow
@pytest.mark.parametrize("name", list(AFTER))
def test_loading_into_a_parallelized_model_with_values(ranks, name):
    for results in ranks[4]:
        after = results[name]
        assert "shape mismatch: 'ln_f.bias'" in after["refused"] and after["unchanged"]
        assert after["bad"] == []
        assert len(after["reads"]) > 0


@pytest.mark.slow
def test_bad_files_are_refused_on_every_rank_before_the_model_changes(ranks):
    for results in ranks[4]:
        refused = results["refused"]
        assert "missing key 'ln_f.bias'" in refused["missing"]
        assert "shape mismatch" in refused["shape"]
        assert "unexpected key 'extra.weight'" in refused["extra"]
        assert "shape mismatch" in refused["shape, a model with values"]
        assert not any("MODEL CHANGED" in why for why in refused.values())


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MEMORY))
def test_loading_peak_is_the_share_plus_one_tensor_not_the_model(ranks, name):
    for rank, results in enumerate(ranks[4]):
        mem = results[name]
        assert mem["bad"] == [], f"rank {rank}"
        assert mem["held"] < mem["whole"] / 3
        assert mem["read"] <= mem["held"] + mem["largest"]  # its blocks (a tie read twice)
        assert mem["peak"] <= mem["held"] + 2 * mem["largest"], mem
        assert mem["peak"] < 0.75 * mem["whole"], mem


# ---------------------------------------------------------------- the recipe
RECIPE = ["model.init_device=meta", "model.n_layer=2", "parallel=none"]


def test_recipe_starts_from_a_checkpoint_s_weights_on_meta(tmp_path):
    """``model.weights=`` a DCP checkpoint the recipe wrote (its model under ``model.``, beside
    the optimizer's state): the next run's initial values are the checkpoint's, not its seed's."""
    from recipe_helpers import checkpoint_tensors, train_in_process
    from recipes.checkpoint import latest_checkpoint

    train_in_process([*RECIPE, "trainer.seed=5", "trainer.max_steps=2",
                      "trainer.checkpoint_every=2"], tmp_path / "first", tmp_path / "data")
    saved = latest_checkpoint(tmp_path / "first" / "checkpoints")
    want = {k.removeprefix("model."): v for k, v in checkpoint_tensors(saved, tmp_path).items()
            if k.startswith("model.")}
    seen = {}

    def grab(recipe) -> None:
        seen.update({n: p.detach().clone() for n, p in recipe.model.named_parameters()})

    train_in_process([*RECIPE, "trainer.seed=6", "trainer.max_steps=1",
                      f"model.weights={saved}"], tmp_path / "second", tmp_path / "data", grab)
    assert seen and all(torch.equal(v, want[n]) for n, v in seen.items())


def test_recipe_refuses_weights_without_meta_and_for_models_that_have_their_own(tmp_path):
    from recipe_helpers import compose_train
    from recipes import config_schema

    with pytest.raises(ValueError, match=r"weights=w.safetensors needs init_device=meta or auto"):
        config_schema.check_config(compose_train(["model.weights=w.safetensors",
                                                  "model.init_device=device"]))
    with pytest.raises(ValueError, match=r"unknown config key\(s\) model.weights"):
        config_schema.check_config(compose_train(["model=hf", "model.path=x",
                                                  "+model.weights=w.safetensors"]))


@pytest.mark.slow
def test_dcp_reads_the_chunks_overlapping_the_rank_s_shards(ranks, files):
    small, big = (sum(_file_bytes(kind, files).values()) for kind in ("gpt", "big"))
    for rank, results in enumerate(ranks[4]):
        dcp_reads = results["dcp layouts"]
        assert dcp_reads["bad"] == [], f"rank {rank}"
        # saved by one process: every tensor is one chunk, read whole
        assert dcp_reads["whole saved"] >= small
        # saved on the same layout: only the rank's own chunks, a quarter of the model
        assert 0.2 * big < dcp_reads["layout saved"] < 0.3 * big, dcp_reads
