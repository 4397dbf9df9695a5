"""Train a small GPT on a generated corpus: the hetero-parallel reference recipe.

    python recipes/train.py                                  # one process
    torchrun --nproc-per-node 2 recipes/train.py             # two ranks, data parallel
    python recipes/train.py optim.lr=1e-3 trainer.max_steps=50 parallel=none

Everything comes from ``conf/train.yaml`` and its config groups (model, data, optim, hetero,
parallel). Each run writes into its Hydra run directory: ``metrics.jsonl`` (one line per step, rank
0), ``checkpoints/step_N/`` and ``.hydra/``. The recipe class follows torchtune's shape: ``setup``
builds everything, ``train`` runs the loop, ``cleanup`` releases the process group.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

import hetero.device as hd
import parallel
from checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from config_schema import check_known_keys, register_configs
from corpus import CharTokenizer, get_batch, load_corpus
from gpt import GPT
from metrics import MetricsLogger
from optim import backward_and_step, build_loss_scaler, build_optimizer, build_scheduler
from parallel_mode import apply_parallel_mode
from placement import apply_placement
from run_dir import agree_on_run_dir, register_resolvers

log = logging.getLogger("train")


class TrainRecipe:
    """Builds model, data, optimizer and parallel mode from ``cfg``; trains; checkpoints."""

    def __init__(self, cfg: DictConfig, run_dir: str | Path) -> None:
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.start_step = 0
        self.resumed_from: Path | None = None
        self.metrics: MetricsLogger | None = None

    def setup(self) -> None:
        """Process group, device, corpus, model, optimizer and schedule, then maybe resume."""
        cfg = self.cfg
        parallel.init()
        self.rank, self.world_size = parallel.get_rank(), parallel.get_world_size()
        if self.rank != 0:
            logging.getLogger().setLevel(logging.WARNING)  # one voice on the console
        self.run_dir = Path(agree_on_run_dir(str(self.run_dir)))
        self.ckpt_root = self.run_dir / cfg.trainer.checkpoint_dir
        self.device = hd.resolve(cfg.hetero.device)

        text = load_corpus(cfg.data.cache_dir, cfg.data.corpus_seed, cfg.data.num_chars)
        self.tokenizer = CharTokenizer(text)
        self.tokens = self.tokenizer.encode(text)

        torch.manual_seed(cfg.trainer.seed)  # same initial weights on every rank
        m = cfg.model
        model = GPT(self.tokenizer.vocab_size, m.d_model, m.n_layer, m.n_head, m.block_size,
                    m.dropout).to(self.device)
        example = get_batch(self.tokens, seed=cfg.trainer.seed, step=0,
                            global_batch_size=cfg.data.global_batch_size, seq_len=cfg.data.seq_len,
                            rank=self.rank, world_size=self.world_size)
        model = apply_placement(model, cfg.hetero, tuple(t.to(self.device) for t in example))
        self.model = apply_parallel_mode(model, cfg.parallel)
        torch.manual_seed(cfg.trainer.seed + 1 + self.rank)  # own dropout stream per rank
        self.optimizer = build_optimizer(model, cfg.optim, cfg.hetero)
        self.scaler = build_loss_scaler(self.optimizer)  # fp16 offload only
        self.scheduler = build_scheduler(self.optimizer, cfg.optim,
                                         cfg.optim.total_steps or cfg.trainer.max_steps)
        self.resumed_from = self._resume_path()
        if self.resumed_from is not None:
            self.start_step = load_checkpoint(self.resumed_from, self.model, self.optimizer,
                                              self.scheduler, self.device)
            log.info("resumed from %s at step %d", self.resumed_from, self.start_step)
        self.metrics = MetricsLogger(self.run_dir / "metrics.jsonl", enabled=self.rank == 0,
                                     resume_step=self.start_step)
        log.info("GPT with %.2f M parameters, vocab %d, corpus %d chars; %d rank(s) on %s; "
                 "run dir %s", model.num_params() / 1e6, self.tokenizer.vocab_size,
                 len(self.tokens), self.world_size, self.device, self.run_dir)

    def _resume_path(self) -> Path | None:
        choice = self.cfg.trainer.resume_from
        if choice is None:
            return None
        if choice == "latest":
            found = latest_checkpoint(self.ckpt_root)
            if found is None:
                log.info("resume_from=latest: no checkpoint in %s yet, starting fresh",
                         self.ckpt_root)
            return found
        return Path(choice)

    def train(self) -> dict:
        """Run steps start_step+1 .. max_steps; return the summary (also printed on rank 0)."""
        tcfg, dcfg = self.cfg.trainer, self.cfg.data
        tokens_per_step = dcfg.global_batch_size * dcfg.seq_len
        # full_batch (semi-auto parallel): every rank feeds the whole global batch
        full = parallel.get_auto_parallel_context("full_batch")
        batch_rank, batch_world = (0, 1) if full else (self.rank, self.world_size)
        losses: list[float] = []
        ckpt = self.resumed_from  # the newest checkpoint, until this run writes one
        bar = tqdm(total=tcfg.max_steps, initial=self.start_step, desc="train",
                   disable=self.rank != 0 or not tcfg.progress_bar, dynamic_ncols=True)
        self.model.train()
        t0 = time.perf_counter()
        with logging_redirect_tqdm():
            for step in range(self.start_step + 1, tcfg.max_steps + 1):
                t_step = time.perf_counter()
                x, y = get_batch(self.tokens, seed=tcfg.seed, step=step,
                                 global_batch_size=dcfg.global_batch_size,
                                 seq_len=dcfg.seq_len, rank=batch_rank,
                                 world_size=batch_world)
                loss = self._step(x.to(self.device), y.to(self.device))
                lr = self.scheduler.get_last_lr()[0]
                self.scheduler.step()
                loss = parallel.all_reduce(loss.detach(), op="mean").item()  # waits for the step
                now = time.perf_counter()
                tok_s = tokens_per_step / (now - t_step)
                losses.append(loss)
                self.metrics.log(step=step, loss=loss, lr=lr, tokens_per_s=tok_s,
                                 elapsed_s=now - t0)
                bar.set_postfix({"loss": f"{loss:.4f}", "lr": f"{lr:.2e}",
                                 "tok/s": f"{tok_s:,.0f}"}, refresh=False)
                bar.update()
                if step % tcfg.log_every == 0:
                    log.info("step %d  loss %.4f  lr %.2e  %.0f tok/s", step, loss, lr, tok_s)
                if step % tcfg.checkpoint_every == 0 or step == tcfg.max_steps:
                    ckpt = save_checkpoint(self.ckpt_root, step, self.model, self.optimizer,
                                           self.scheduler, self.device)
        bar.close()
        wall = time.perf_counter() - t0
        return self._summary(losses, wall, tokens_per_step, ckpt)

    def _step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Forward, backward (gradients averaged over ranks by the wrapper), clip, update."""
        self.optimizer.zero_grad(set_to_none=True)
        _, loss = self.model(x, y)
        backward_and_step(self.model, self.optimizer, loss, self.cfg.optim.grad_clip, self.scaler)
        return loss

    def _summary(self, losses: list[float], wall: float, tokens_per_step: int,
                 ckpt: Path | None) -> dict:
        summary = {
            "steps": f"{self.start_step + 1}..{self.start_step + len(losses)}"
                     if losses else "none (already at max_steps)",
            "first_loss": losses[0] if losses else None,
            "last_loss": losses[-1] if losses else None,
            "wall_time_s": round(wall, 2),
            "tokens_per_s": round(len(losses) * tokens_per_step / wall) if losses else 0,
            "checkpoint": str(ckpt) if ckpt else None,
            "run_dir": str(self.run_dir),
        }
        if self.rank == 0:
            shown = {**summary, "wall_time_s": f"{wall:.1f}"}
            for key in ("first_loss", "last_loss"):
                shown[key] = f"{summary[key]:.4f}" if losses else None
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


@hydra.main(version_base="1.3", config_path="../conf", config_name="train")
def main(cfg: DictConfig) -> None:
    check_known_keys(cfg)
    recipe = TrainRecipe(cfg, HydraConfig.get().runtime.output_dir)
    try:
        recipe.setup()
        recipe.train()
    finally:
        recipe.cleanup()


if __name__ == "__main__":
    main()
