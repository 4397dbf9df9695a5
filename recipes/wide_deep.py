"""Train Wide&Deep on Criteo-format click logs, embedding tables on the host: a recipe.

    python recipes/wide_deep.py                              # one process
    torchrun --nproc-per-node 2 recipes/wide_deep.py         # two ranks, data parallel
    python recipes/wide_deep.py sparse_optim=ftrl data.path=/data/criteo/train.txt

Everything comes from ``conf/wide_deep.yaml`` and its groups (model, data, optim, sparse_optim,
hetero, parallel). The tables are ``hetero.nn.EmbeddingLookup(target="CPU")``: they stay in host
memory when the model moves to the accelerator, the lookups run there, and ``sparse_optim``
(LazyAdam or FTRL) updates their touched rows there; the dense part trains on ``hetero.device``
with Adam (``optim``). Under torchrun, ``parallel=data`` wraps the model in
``parallel.DataParallel``: dense gradients are averaged in buckets over the device's backend, the
tables' row-sparse gradients as sparse tensors over gloo. The held-out split's AUC is printed every
``trainer.eval_every`` steps; for generated data, next to the best AUC possible on it. Each run
writes ``metrics.jsonl`` (rank 0) and ``.hydra/`` into its run directory.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import hydra
import torch
import torch.nn.functional as F
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig
from torch import nn
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

import hetero.device as hd
import parallel
from config_schema import check_known_keys, register_configs
from criteo import CriteoData, get_batch, load_criteo
from criteo_synth import logits_path, synthetic_criteo
from ctr_metrics import log_loss, roc_auc
from hetero.optim import FTRL, LazyAdam
from metrics import MetricsLogger
from optim import build_scheduler
from parallel import ParallelMode
from parallel_mode import apply_parallel_mode
from run_dir import agree_on_run_dir, register_resolvers
from wide_deep_model import WideDeep

log = logging.getLogger("wide_deep")


def build_sparse_optimizer(params: list[nn.Parameter], cfg: DictConfig) -> torch.optim.Optimizer:
    """``hetero.optim.LazyAdam`` or ``FTRL`` for the tables, from the ``sparse_optim`` group."""
    if cfg.name == "lazy_adam":
        return LazyAdam(params, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps,
                        weight_decay=cfg.weight_decay, use_nesterov=cfg.use_nesterov)
    if cfg.name == "ftrl":
        return FTRL(params, initial_accum=cfg.initial_accum, learning_rate=cfg.learning_rate,
                    lr_power=cfg.lr_power, l1=cfg.l1, l2=cfg.l2, weight_decay=cfg.weight_decay)
    raise ValueError(f"unknown sparse_optim.name={cfg.name!r}; options: lazy_adam, ftrl")


def check_recipe_config(cfg: DictConfig) -> None:
    """ValueError for settings of the shared groups that this recipe cannot honour."""
    if cfg.hetero.get("cpu_modules") or cfg.hetero.get("offload_optimizer"):
        raise ValueError(f"hetero={cfg.hetero.name}: this recipe places its tables with "
                         f"model.embedding_target (CPU/DEVICE) and its dense part on "
                         f"hetero.device; use hetero=none")
    if cfg.optim.name != "adamw":
        raise ValueError(f"optim={cfg.optim.name}: the dense part trains with Adam(W); use "
                         f"optim=adamw (the tables' optimizer is sparse_optim)")
    for key in ("max_steps", "log_every", "eval_every"):
        if cfg.trainer[key] < 1:
            raise ValueError(f"trainer.{key}={cfg.trainer[key]} must be at least 1")


class WideDeepRecipe:
    """Builds data, model, optimizers and parallel mode from ``cfg``; trains; evaluates AUC."""

    def __init__(self, cfg: DictConfig, run_dir: str | Path) -> None:
        self.cfg, self.run_dir = cfg, Path(run_dir)
        self.metrics: MetricsLogger | None = None

    def setup(self) -> None:
        """Process group, data (generated on first use), model, optimizers, schedule."""
        cfg = self.cfg
        check_recipe_config(cfg)
        parallel.init()
        self.rank, self.world_size = parallel.get_rank(), parallel.get_world_size()
        if self.rank != 0:
            logging.getLogger().setLevel(logging.WARNING)  # one voice on the console
        self.run_dir = Path(agree_on_run_dir(str(self.run_dir)))
        self.device = hd.resolve(cfg.hetero.device)
        d = cfg.data
        path, data = self._load_data() if self.rank == 0 else (None, None)  # generate, parse ...
        parallel.barrier()
        if self.rank != 0:
            path, data = self._load_data()  # ... once: the other ranks read rank 0's files
        self.train_data, self.eval_data = data.split(d.eval_fraction)
        self.oracle_auc = None
        if logits_path(path).is_file():  # generated data: the best AUC any model can reach
            true_logits = torch.load(logits_path(path))[len(self.train_data):len(data)]
            self.oracle_auc = roc_auc(true_logits, self.eval_data.labels)

        torch.manual_seed(cfg.trainer.seed)  # same initial weights on every rank
        m = cfg.model
        model = WideDeep(d.vocab_size, m.embedding_size, list(m.deep_layers),
                         m.embedding_target, m.dropout).to(self.device)
        self.net, self.tables = model, model.table_parameters()
        if ParallelMode(cfg.parallel.mode) not in (ParallelMode.STAND_ALONE,
                                                   ParallelMode.DATA_PARALLEL):
            raise ValueError(f"parallel={cfg.parallel.name}: the Wide&Deep recipe trains data "
                             f"parallel (parallel=data) or in one process (parallel=none)")
        self.model = apply_parallel_mode(model, cfg.parallel)
        torch.manual_seed(cfg.trainer.seed + 1 + self.rank)  # own dropout stream per rank
        o = cfg.optim
        self.dense_opt = torch.optim.AdamW(model.dense_parameters(), lr=o.lr,
                                           betas=tuple(o.betas), eps=o.eps,
                                           weight_decay=o.weight_decay)
        self.sparse_opt = build_sparse_optimizer(self.tables, cfg.sparse_optim)
        self.scheduler = build_scheduler(self.dense_opt, o, o.total_steps or cfg.trainer.max_steps)
        self.metrics = MetricsLogger(self.run_dir / "metrics.jsonl", enabled=self.rank == 0)
        table_bytes = sum(p.nbytes for p in self.tables)
        log.info("Criteo rows: %d train, %d eval (%s); tables %.1f MB on %s (%s), dense part on "
                 "%s (Adam); %d rank(s); run dir %s", len(self.train_data), len(self.eval_data),
                 path, table_bytes / 1e6, self.tables[0].device, type(self.sparse_opt).__name__,
                 self.device, self.world_size, self.run_dir)

    def _load_data(self) -> tuple[Path, CriteoData]:
        d = self.cfg.data
        path = Path(d.path) if d.path else synthetic_criteo(d.cache_dir, d.seed, d.rows)
        return path, load_criteo(path, d.vocab_size, d.max_rows, d.cache_dir)

    def _on_model_devices(self, batch: CriteoData) -> tuple[torch.Tensor, torch.Tensor]:
        # Host tables read their ids where they are: only looked-up rows cross, never the ids.
        host_ids = self.cfg.model.embedding_target == "CPU"
        ids = batch.ids if host_ids else batch.ids.to(self.device, non_blocking=True)
        return batch.dense.to(self.device, non_blocking=True), ids

    def _step(self, batch: CriteoData) -> torch.Tensor:
        """Forward, backward (gradients averaged over the ranks by the wrapper), both updates."""
        self.dense_opt.zero_grad(set_to_none=True)
        self.sparse_opt.zero_grad(set_to_none=True)
        logits = self.model(*self._on_model_devices(batch))
        loss = F.binary_cross_entropy_with_logits(logits, batch.labels.to(self.device))
        loss.backward()
        if self.cfg.optim.grad_clip:
            nn.utils.clip_grad_norm_(self.net.dense_parameters(), self.cfg.optim.grad_clip)
        self.dense_opt.step()
        self.sparse_opt.step()
        return loss

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """AUC and log loss on the eval split (every rank computes it on its identical replica)."""
        self.net.eval()
        size = self.cfg.data.eval_batch_size
        chunks = [self.eval_data.rows(slice(i, i + size))
                  for i in range(0, len(self.eval_data), size)]
        logits = torch.cat([self.net(*self._on_model_devices(c)).float().cpu() for c in chunks])
        self.net.train()
        labels = self.eval_data.labels
        return {"eval_auc": roc_auc(logits, labels), "eval_logloss": log_loss(logits, labels)}

    def train(self) -> dict:
        """Run steps 1..max_steps; return the summary (also printed on rank 0)."""
        t, batch_size = self.cfg.trainer, self.cfg.data.global_batch_size
        losses: list[float] = []
        evaluation: dict[str, float] = {}
        bar = tqdm(total=t.max_steps, desc="train", dynamic_ncols=True,
                   disable=self.rank != 0 or not t.progress_bar)
        self.model.train()
        t0 = time.perf_counter()
        with logging_redirect_tqdm():
            for step in range(1, t.max_steps + 1):
                t_step = time.perf_counter()
                batch = get_batch(self.train_data, seed=t.seed, step=step,
                                  global_batch_size=batch_size, rank=self.rank,
                                  world_size=self.world_size)
                loss = self._step(batch)
                lr = self.scheduler.get_last_lr()[0]
                self.scheduler.step()
                loss = parallel.all_reduce(loss.detach(), op="mean").item()
                rows_s = batch_size / (time.perf_counter() - t_step)
                losses.append(loss)
                record = {"step": step, "loss": loss, "lr": lr, "rows_per_s": rows_s}
                if step % t.eval_every == 0 or step == t.max_steps:
                    evaluation = self.evaluate()
                    record.update(evaluation)
                    log.info("step %d  loss %.4f  eval AUC %.4f%s  logloss %.4f", step, loss,
                             evaluation["eval_auc"], self._oracle_note(),
                             evaluation["eval_logloss"])
                elif step % t.log_every == 0:
                    log.info("step %d  loss %.4f  lr %.2e  %.0f rows/s", step, loss, lr, rows_s)
                self.metrics.log(**record, elapsed_s=time.perf_counter() - t0)
                auc = evaluation.get("eval_auc", 0.0)
                bar.set_postfix({"loss": f"{loss:.4f}", "AUC": f"{auc:.4f}",
                                 "rows/s": f"{rows_s:,.0f}"}, refresh=False)
                bar.update()
        bar.close()
        return self._summary(losses, evaluation, time.perf_counter() - t0)

    def _oracle_note(self) -> str:
        return f" (best possible {self.oracle_auc:.4f})" if self.oracle_auc is not None else ""

    def _summary(self, losses: list[float], evaluation: dict[str, float], wall: float) -> dict:
        summary = {
            "steps": len(losses),
            "first_loss": losses[0] if losses else None,
            "last_loss": losses[-1] if losses else None,
            "eval_auc": evaluation.get("eval_auc"),
            "oracle_auc": self.oracle_auc,
            "wall_time_s": round(wall, 2),
            "rows_per_s": round(len(losses) * self.cfg.data.global_batch_size / wall),
            "run_dir": str(self.run_dir),
        }
        if self.rank == 0:
            shown = {k: f"{v:.4f}" if isinstance(v, float) else v for k, v in summary.items()}
            print("\nTraining summary\n" + "\n".join(f"  {k:<13} {v}" for k, v in shown.items()),
                  flush=True)
        return summary

    def cleanup(self) -> None:
        """Close the metrics file and tear the process group down."""
        if self.metrics is not None:
            self.metrics.close()
        parallel.destroy()


register_configs()  # schemas and resolvers must exist before @hydra.main composes the config
register_resolvers()


@hydra.main(version_base="1.3", config_path="../conf", config_name="wide_deep")
def main(cfg: DictConfig) -> None:
    check_known_keys(cfg)
    recipe = WideDeepRecipe(cfg, HydraConfig.get().runtime.output_dir)
    try:
        recipe.setup()
        recipe.train()
    finally:
        recipe.cleanup()


if __name__ == "__main__":
    main()
