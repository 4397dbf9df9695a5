"""Train Wide&Deep on Criteo-format click logs, embedding tables on the host: a recipe.

    python recipes/wide_deep.py                              # one process
    torchrun --nproc-per-node 2 recipes/wide_deep.py         # two ranks, data parallel
    python recipes/wide_deep.py sparse_optim=ftrl data.path=/data/criteo/train.txt

Everything comes from ``conf/wide_deep.yaml`` and its groups (model, data, optim, sparse_optim,
hetero, parallel). The tables are ``hetero.nn.EmbeddingLookup(target="CPU")``: they stay in host
memory when the model moves to the accelerator, the lookups run there, and ``sparse_optim``
(LazyAdam or FTRL) updates their touched rows there; the dense part trains on ``hetero.device``
with Adam (``optim``). Under torchrun, ``parallel=data`` wraps the model in
``DataParallel``: dense gradients are averaged in buckets over the device's backend, the
tables' row-sparse gradients as sparse tensors over gloo. The held-out split's AUC is printed every
``trainer.eval_every`` steps; for generated data, next to the best AUC possible on it. Each run
writes ``metrics.jsonl`` (rank 0), ``.hydra/`` and ``checkpoints/step_N/`` (every
``trainer.checkpoint_every`` steps and at the end: the tables — whole, also when the parameter
server holds them in blocks —, the dense part, both optimizers' state, the schedule and the RNG
states, as ``recipes/checkpoint.py`` writes them) into its run directory;
``trainer.resume_from=latest`` continues the newest one bit for bit.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

if __name__ == "__main__" and not __package__:  # run as a file: import the recipes as a package
    sys.path[0] = str(Path(__file__).resolve().parents[1])
if __name__ == "__main__":  # before the heavy imports: stopped by torchrun before its config
    from recipes.quiet_start import hold_stop  # check, this rank leaves as a config error would

    hold_stop()

import hydra  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from hydra.utils import instantiate  # noqa: E402
from omegaconf import DictConfig  # noqa: E402
from torch import nn  # noqa: E402

import parallel  # noqa: E402
from parallel.config import OperatorSplit  # noqa: E402
from recipes.base import Recipe, run  # noqa: E402
from recipes.checkpoint import load_checkpoint, save_checkpoint  # noqa: E402
from recipes.config_schema import register_configs  # noqa: E402
from recipes.criteo import CriteoData, get_batch, load_criteo  # noqa: E402
from recipes.criteo_synth import logits_path, synthetic_criteo  # noqa: E402
from recipes.ctr_metrics import log_loss, roc_auc  # noqa: E402
from recipes.fail_early import ConfigError, env_world_size  # noqa: E402
from recipes.optim import build_scheduler  # noqa: E402
from recipes.parallel_mode import apply_parallel_mode, group_split  # noqa: E402
from recipes.process_exit import run_then_exit  # noqa: E402
from recipes.resume import resume_path  # noqa: E402
from recipes.run_dir import register_resolvers  # noqa: E402
from recipes.wide_deep_model import WideDeep  # noqa: E402
from recipes.writable_dir import check_writable  # noqa: E402

log = logging.getLogger("wide_deep")


def build_sparse_optimizer(params: list[nn.Parameter], cfg: DictConfig) -> torch.optim.Optimizer:
    """The tables' optimizer: ``sparse_optim.optimizer`` instantiated (``_target_``:
    ``hetero.optim.LazyAdam`` or ``hetero.optim.FTRL``) over ``params``."""
    return instantiate(cfg.optimizer, params, _convert_="all")


def check_recipe_config(cfg: DictConfig) -> None:
    """ValueError for settings of the shared groups that this recipe cannot honour."""
    if cfg.hetero.get("cpu_modules") or cfg.hetero.get("offload_optimizer"):
        raise ValueError(f"hetero={cfg.hetero.name}: this recipe places its tables with "
                         f"model.embedding_target (CPU/DEVICE) and its dense part on "
                         f"hetero.device; use hetero=none")
    if cfg.optim.name != "adamw":
        raise ValueError(f"optim={cfg.optim.name}: the dense part trains with Adam(W); use "
                         f"optim=adamw (the tables' optimizer is sparse_optim)")
    if group_split(cfg.parallel) is not OperatorSplit.REPLICAS or \
            cfg.parallel.pipeline_degree > 1:
        raise ValueError(f"parallel={cfg.parallel.name}: the Wide&Deep recipe trains data "
                         f"parallel (parallel=data) or in one process (parallel=none)")
    if cfg.model.embedding_disk and cfg.model.embedding_target != "CPU":
        raise ValueError("model.embedding_disk=true keeps host tables at rest in files; it "
                         "needs model.embedding_target=CPU")
    if not cfg.model.deep_layers:
        raise ValueError("model.deep_layers=[]: give the deep part one or more layer widths")
    if cfg.model.embedding_cache_size is not None and cfg.model.embedding_sharding != "row":
        raise ValueError(f"model.embedding_cache_size={cfg.model.embedding_cache_size} caches "
                         f"the hottest rows of row-sharded tables; it needs "
                         f"model.embedding_sharding=row")


def check_both_labels(labels: torch.Tensor, rows: int, eval_fraction: float) -> None:
    """The held-out rows must hold clicks and non-clicks, or AUC, the recipe's measure, is
    undefined: refused at set-up, not at the first evaluation hours later."""
    clicks = int(labels.sum())
    if clicks in (0, labels.numel()):
        raise ValueError(
            f"the evaluation rows ({labels.numel()} of {rows}, data.eval_fraction="
            f"{eval_fraction}) are all {'non-clicks' if clicks == 0 else 'clicks'}: AUC needs "
            f"both labels; give more rows (data.rows, data.max_rows) or a larger "
            f"data.eval_fraction")


class WideDeepRecipe(Recipe):
    """Builds data, model, optimizers and parallel mode from ``cfg``; trains; evaluates AUC."""

    rate_name, rate_unit = "rows_per_s", "rows/s"

    @staticmethod
    def check(cfg: DictConfig) -> None:
        """Settings this recipe cannot honour, refused before any process group starts."""
        check_recipe_config(cfg)
        batch, ranks = cfg.data.global_batch_size, env_world_size()  # each feeds a slice
        if batch % ranks:
            raise ConfigError(f"data.global_batch_size={batch} does not divide over the "
                              f"{ranks} ranks that each feed a slice of it",
                              f"make it a multiple of {ranks}")

    def setup(self) -> None:
        """Process group, data (generated on first use), model, optimizers, schedule, then maybe
        resume."""
        cfg = self.cfg
        check_recipe_config(cfg)
        self.init_distributed()
        self.ckpt_root = self.run_dir / cfg.trainer.checkpoint_dir
        check_writable(self.ckpt_root, f"trainer.checkpoint_dir={cfg.trainer.checkpoint_dir}")
        self.checkpoint: Path | None = None  # the newest checkpoint of this run
        d = cfg.data
        path, data = self._load_data() if self.rank == 0 else (None, None)  # generate, parse ...
        parallel.barrier()
        if self.rank != 0:
            path, data = self._load_data()  # ... once: the other ranks read rank 0's files
        self.train_data, self.eval_data = data.split(d.eval_fraction)
        check_both_labels(self.eval_data.labels, len(data), d.eval_fraction)
        self.oracle_auc = None
        if logits_path(path).is_file():  # generated data: the best AUC any model can reach
            true_logits = torch.load(logits_path(path), weights_only=True)
            true_logits = true_logits[len(self.train_data):len(data)]
            self.oracle_auc = roc_auc(true_logits, self.eval_data.labels)
        self.units_per_step = d.global_batch_size
        self.evaluation: dict[str, float] = {}

        torch.manual_seed(cfg.trainer.seed)  # same initial weights on every rank
        m = cfg.model
        tables = None
        if m.embedding_disk:  # each rank's files, unlinked as soon as they are made
            tables = self.run_dir / "tables"
            tables.mkdir(parents=True, exist_ok=True)
        model = WideDeep(d.vocab_size, m.embedding_size, list(m.deep_layers),
                         m.embedding_target, m.dropout, m.embedding_sharding,
                         m.embedding_cache_size, tables and str(tables)).to(self.device)
        self.net, self.tables = model, model.table_parameters()
        self.model, _ = apply_parallel_mode(model, cfg.parallel)
        torch.manual_seed(cfg.trainer.seed + 1 + self.rank)  # own dropout stream per rank
        o = cfg.optim
        self.dense_opt = instantiate(o.optimizer, model.dense_parameters(),
                                     weight_decay=o.weight_decay, _convert_="all")
        self.sparse_opt = build_sparse_optimizer(self.tables, cfg.sparse_optim)
        self.scheduler = build_scheduler(self.dense_opt, o, o.total_steps or cfg.trainer.max_steps)
        self.checkpoint = resume_path(cfg.trainer.resume_from, self.ckpt_root)
        if self.checkpoint is not None:
            self.start_step = load_checkpoint(
                self.checkpoint, self.model, self.optimizers, self.scheduler, self.device,
                allow_partial=cfg.trainer.allow_partial_resume, digest=cfg.trainer.resume_digest)
            log.info("resumed from %s at step %d", self.checkpoint, self.start_step)
        self.metrics = self.build_loggers()  # after the resume: later steps of it are dropped
        table_bytes = sum(p.nbytes for p in self.tables)
        log.info("Criteo rows: %d train, %d eval (%s); tables %.1f MB on %s (%s), dense part on "
                 "%s (%s); %d rank(s); run dir %s", len(self.train_data), len(self.eval_data),
                 path, table_bytes / 1e6, self.tables[0].device, type(self.sparse_opt).__name__,
                 self.device, type(self.dense_opt).__name__, self.world_size, self.run_dir)

    @property
    def optimizers(self) -> tuple[torch.optim.Optimizer, torch.optim.Optimizer]:
        """The dense part's and the tables' optimizers: one checkpointed state, by name."""
        return self.dense_opt, self.sparse_opt

    def _load_data(self) -> tuple[Path, CriteoData]:
        d = self.cfg.data
        path = Path(d.path) if d.path else synthetic_criteo(d.cache_dir, d.seed, d.rows)
        return path, load_criteo(path, d.vocab_size, d.max_rows, d.cache_dir)

    def _on_model_devices(self, batch: CriteoData) -> tuple[torch.Tensor, torch.Tensor]:
        # Host tables read their ids where they are: only looked-up rows cross, never the ids.
        host_ids = self.cfg.model.embedding_target == "CPU"
        ids = batch.ids if host_ids else batch.ids.to(self.device, non_blocking=True)
        return batch.dense.to(self.device, non_blocking=True), ids

    def forward(self, step: int) -> torch.Tensor:
        batch = get_batch(self.train_data, seed=self.cfg.trainer.seed, step=step,
                          global_batch_size=self.cfg.data.global_batch_size, rank=self.rank,
                          world_size=self.world_size)
        self.dense_opt.zero_grad(set_to_none=True)
        self.sparse_opt.zero_grad(set_to_none=True)
        logits = self.model(*self._on_model_devices(batch))
        return F.binary_cross_entropy_with_logits(logits, batch.labels.to(self.device))

    def backward(self, loss: torch.Tensor) -> None:
        """Backward (gradients averaged over the ranks by the wrapper)."""
        loss.backward()

    def step(self) -> None:
        """Clip the dense gradients (their norm is the step's ``grad_norm``), both updates."""
        if self.cfg.optim.grad_clip:
            self.grad_norm = nn.utils.clip_grad_norm_(self.net.dense_parameters(),
                                                      self.cfg.optim.grad_clip)
        self.dense_opt.step()
        self.sparse_opt.step()

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

    def after_step(self, step: int, record: dict) -> None:
        record.update(self.net.cache_stats())  # the parameter server's cache hit rate, if any
        t = self.cfg.trainer
        if step % t.eval_every == 0 or step == t.max_steps:
            self.evaluation = self.evaluate()
            record.update(self.evaluation)
            log.info("step %d  loss %.4f  eval AUC %.4f%s  logloss %.4f", step,
                     float(record["loss"]),  # a device tensor until the loop logs it
                     self.evaluation["eval_auc"], self._oracle_note(),
                     self.evaluation["eval_logloss"])
        if step % t.checkpoint_every == 0 or step == t.max_steps:
            self.checkpoint = save_checkpoint(self.ckpt_root, step, self.model, self.optimizers,
                                              self.scheduler, self.device, config=self.cfg,
                                              run=self.run_id)

    def postfix(self, record: dict) -> dict[str, str]:
        return {"loss": f"{record['loss']:.4f}",
                "AUC": f"{self.evaluation.get('eval_auc', 0.0):.4f}",
                "rows/s": f"{record['rows_per_s']:,.0f}"}

    def _oracle_note(self) -> str:
        return f" (best possible {self.oracle_auc:.4f})" if self.oracle_auc is not None else ""

    def summary_extras(self) -> dict:
        return {"eval_auc": self.evaluation.get("eval_auc"), "oracle_auc": self.oracle_auc,
                "checkpoint": str(self.checkpoint) if self.checkpoint else None}


register_configs()  # schemas and resolvers must exist before @hydra.main composes the config
register_resolvers()


@hydra.main(version_base="1.3", config_path="../conf", config_name="wide_deep")
def main(cfg: DictConfig) -> None:
    run(WideDeepRecipe, cfg)


if __name__ == "__main__":
    run_then_exit(main)
