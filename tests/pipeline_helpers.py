"""A tiny GPT trained the same way in one process and under pipeline configs on gloo ranks."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

import parallel
from parallel.config import OperatorSplit
from recipes.gpt import GPT

VOCAB, SEQ, BATCH = 37, 8, 8


def tiny_gpt(n_layer: int = 4) -> GPT:
    torch.manual_seed(0)
    return GPT(VOCAB, d_model=16, n_layer=n_layer, n_head=2, block_size=SEQ, dropout=0.0)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    return x, torch.roll(x, -1, dims=1)


def gpt_loss(output: Any, target: torch.Tensor) -> torch.Tensor:
    logits = output[0] if isinstance(output, tuple) else output
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def tiny_llama(n_layer: int = 4) -> torch.nn.Module:
    """A HuggingFace Llama of the tiny GPT's sizes, in the recipe's calling convention
    (``model(idx, targets)``), attention by SDPA."""
    from recipes.hf_model import build_hf_model

    torch.manual_seed(0)
    return build_hf_model(None, {"model_type": "llama", "hidden_size": 16,
                                 "intermediate_size": 32, "num_hidden_layers": n_layer,
                                 "num_attention_heads": 2, "num_key_value_heads": 1,
                                 "max_position_embeddings": SEQ}, VOCAB,
                          attn_implementation="sdpa")


MODELS = {"gpt": tiny_gpt, "llama": tiny_llama}


def reference(steps: int, n_layer: int = 4, kind: str = "gpt"
              ) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Losses and final parameters of the plain model on the whole batch (AdamW)."""
    model = MODELS[kind](n_layer)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(steps):
        x, y = batch(step)
        opt.zero_grad()
        _, loss = model(x, y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.state_dict().items()}


def rank_steps(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: range, rank: int,
               world: int) -> list[float]:
    """Optimizer steps of ``model`` on rank ``rank``'s slice of each step's batch; the losses."""
    per, losses = BATCH // world, []
    for step in steps:
        x, y = (t[rank * per:(rank + 1) * per] for t in batch(step))
        opt.zero_grad()
        _, loss = model(x, y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def full_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for name, tensor in model.state_dict().items():
        if hasattr(tensor, "full_tensor"):
            tensor = tensor.full_tensor()
        out[name] = tensor.detach().clone()
    return out


def train_pipelined(config: parallel.ParallelConfig, steps: int, example: bool = False,
                    n_layer: int = 4, kind: str = "gpt", offload: dict | None = None,
                    dtype: torch.dtype | None = None
                    ) -> tuple[list[float], dict[str, torch.Tensor], Any]:
    """Per-step losses and this rank's parameters after ``steps`` AdamW steps under ``config``;
    each data-parallel replica feeds its slice of the global batch. ``offload``: the keywords of
    a ``hetero.offload.ParamOffload`` over the stages this rank runs (their weights at rest on
    the host, as ``offload=params`` does); ``dtype``: the model's (default its own)."""
    parallel.init()
    model = MODELS[kind](n_layer).to(dtype)
    pipe = parallel.parallelize(model, config, loss_fn=gpt_loss,
                                example_inputs=batch(0)[:1] if example else None).model
    if offload is not None:
        from hetero.offload import ParamOffload

        ParamOffload([stage.submod for stage in pipe.stages], **offload)
    resolved = config.resolve(parallel.get_world_size())
    mesh = parallel.mesh.parallel_mesh(resolved)
    dp_rank = mesh["dp"].get_local_rank()
    per = BATCH // resolved.data_degree if (resolved.operator_split is OperatorSplit.REPLICAS
                                     or not resolved.full_batch) else BATCH
    start = dp_rank * per if per < BATCH else 0
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
    losses = []
    for step in range(steps):
        x, y = batch(step)
        opt.zero_grad()
        loss = pipe.step(x[start:start + per], target=y[start:start + per])
        opt.step()
        losses.append(loss.item())
    return losses, full_params(pipe), parallel.pipeline.explain_pipeline(pipe)


class PositionsBesideTokens(torch.nn.Module):
    """A stage-aware model whose position embedding only runs beside the token embedding: a
    split that puts ``pos`` in a later stage would silently train without it."""

    def __init__(self) -> None:
        super().__init__()
        self.tok = torch.nn.Embedding(VOCAB, 16)
        self.pos = torch.nn.Embedding(SEQ, 16)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(2))
        self.head = torch.nn.Linear(16, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tok is not None:
            x = self.tok(x)
            if self.pos is not None:
                x = x + self.pos(torch.arange(x.shape[1]))
        for layer in self.layers:
            x = layer(x)
        return x if self.head is None else self.head(x)
