"""Train a small GPT on a generated corpus: the hetero-parallel reference recipe.

    python recipes/train.py                                  # one process
    torchrun --nproc-per-node 2 recipes/train.py             # two ranks, data parallel
    python recipes/train.py optim.lr=1e-3 trainer.max_steps=50 parallel=none
    torchrun --nproc-per-node 2 recipes/train.py model=hf model.path=DIR   # a HuggingFace model

The model is the recipe's GPT, a HuggingFace causal LM (``model=hf``) or your own class
(``model=custom``): ``recipes/models.py``, docs/your-model.md.

Everything comes from ``conf/train.yaml`` and its config groups (model, data, optim, hetero,
parallel). Each run writes into its Hydra run directory: ``metrics.jsonl`` (one line per step, rank
0; ``logger=[...]`` adds csv, TensorBoard, W&B), ``loss.png``, ``checkpoints/step_N/`` and
``.hydra/`` (docs/see-the-run.md: loggers, plots, profiler, precision, compile, keep_last).
The recipe class follows torchtune's shape: ``setup`` builds everything, ``train`` runs the
loop (:class:`recipes.base.Recipe`), ``cleanup`` releases the process group.
"""

from __future__ import annotations

import contextlib
import logging
import math
import sys
from pathlib import Path
from typing import Any

if __name__ == "__main__" and not __package__:  # run as a file: import the recipes as a package
    sys.path[0] = str(Path(__file__).resolve().parents[1])
if __name__ == "__main__":  # before the heavy imports: stopped by torchrun before its config
    from recipes.quiet_start import hold_stop  # check, this rank leaves as a config error would

    hold_stop()

import hydra  # noqa: E402
import torch  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

import foundation.device as hd  # noqa: E402
import parallel  # noqa: E402
from parallel.config import OperatorSplit  # noqa: E402
from recipes.base import Recipe, run  # noqa: E402
from recipes.batch_layout import check_batch_layout  # noqa: E402
from recipes.checkpoint import load_checkpoint, save_checkpoint  # noqa: E402
from recipes.checkpoint_async import AsyncCheckpointer  # noqa: E402
from recipes.checkpoint_clock import CheckpointClock  # noqa: E402
from recipes.checkpoint_integrity import CHECKSUMS, checkpoint_digest  # noqa: E402
from recipes.checkpoint_retention import (  # noqa: E402
    foreign_checkpoints,
    prune_checkpoints,
)
from recipes.compiling import compile_model  # noqa: E402
from recipes.config_schema import register_configs  # noqa: E402
from recipes.fail_early import env_world_size  # noqa: E402
from recipes.gpt import lm_loss  # noqa: E402
from recipes.mfu import MfuMeter, device_peak, flops_per_token  # noqa: E402
from recipes.model_init import deferred_init, seeded_init  # noqa: E402
from recipes.models import (  # noqa: E402
    build_model,
    check_model_modes,
    hetero_group_for,
    parallel_group_for,
    recipe_loss,
)
from recipes.offload import (  # noqa: E402
    memory_plan,
    offload_params,
    resolve_offload,
    shard_group,
    state_dir,
    without_level1,
)
from recipes.optim import (  # noqa: E402
    PARAM_DTYPES,
    build_optimizer,
    build_scheduler,
    clip_and_step,
    embedding_names,
    scaled_backward,
)
from recipes.parallel_mode import (  # noqa: E402
    apply_parallel_mode,
    batch_slice,
    feed_count,
    group_split,
    host_shards,
    parallel_config,
)
from recipes.placement import apply_placement, tag_cpu_modules  # noqa: E402
from recipes.precision import autocast, build_scaler  # noqa: E402
from recipes.process_exit import run_then_exit  # noqa: E402
from recipes.resume import resume_path  # noqa: E402
from recipes.run_dir import register_resolvers  # noqa: E402
from recipes.size_check import check_sizes  # noqa: E402
from recipes.train_data import TrainData  # noqa: E402
from recipes.writable_dir import check_writable  # noqa: E402

log = logging.getLogger("train")


class TrainRecipe(Recipe):
    """Builds model, data, optimizer and parallel mode from ``cfg``; trains; checkpoints."""

    rate_name, rate_unit = "tokens_per_s", "tok/s"

    @staticmethod
    def check(cfg: DictConfig) -> None:
        """A mode the model cannot train under, a size no machine of this kind holds: one
        config-error line on rank 0 (``run``)."""
        check_model_modes(cfg)
        check_sizes(cfg, env_world_size())
        check_batch_layout(cfg, env_world_size())
        p = cfg.parallel
        if cfg.trainer.eval_every and p.get("pipeline_degree", 1) > 1 and p.schedule == "zbv":
            raise ValueError("trainer.eval_every with parallel.schedule=zbv: torch's forward-only "
                             "run of the ZBV schedule still issues its backward actions (torch "
                             "2.13 fails in them); evaluate with parallel.schedule=1f1b, gpipe "
                             "or interleaved_1f1b, or from a checkpoint")

    def setup(self) -> None:
        """Process group, device, corpus, model, optimizer and schedule, then maybe resume."""
        cfg = self.cfg
        self.saver: AsyncCheckpointer | None = None  # trainer.checkpoint_async
        check_model_modes(cfg)  # also for in-process callers, who skip ``run``'s checks
        self.init_distributed()
        self.ckpt_root = self.run_dir / cfg.trainer.checkpoint_dir
        check_writable(self.ckpt_root, f"trainer.checkpoint_dir={cfg.trainer.checkpoint_dir}")
        self.checkpoint: Path | None = None  # the newest checkpoint of this run
        if cfg.trainer.keep_last is not None and self.rank == 0:
            if kept := foreign_checkpoints(self.ckpt_root, self.run_id):
                log.warning("trainer.keep_last=%d deletes only this run's checkpoints; it leaves "
                            "%s (a symlink, not a checkpoint of this project, or another run's)",
                            cfg.trainer.keep_last, ", ".join(str(p) for p in kept))

        self.data = TrainData(cfg.data, cfg.trainer.seed, evaluate=cfg.trainer.eval_every > 0)
        self.tokenizer = self.data.tokenizer
        self.units_per_step = cfg.data.global_batch_size * cfg.data.seq_len

        torch.manual_seed(cfg.trainer.seed)  # same initial weights on every rank
        deferred, seeded = deferred_init(cfg, self.device), seeded_init(cfg)
        with torch.device("meta") if seeded else contextlib.nullcontext():
            built = build_model(cfg.model, self.tokenizer.vocab_size)
        policy = resolve_offload(cfg)
        on_host = policy.params != "device"  # weights at rest off the device: not moved
        if seeded and not deferred:  # the layout needs the whole model: from the same seed
            parallel.materialize(built.model, seed=cfg.trainer.seed,
                                 device="cpu" if on_host else self.device,
                                 weights=cfg.model.get("weights"))
        model = built.model if deferred or on_host else built.model.to(self.device)
        log.info("model init: %s", "each rank's share after the split, from trainer.seed"
                 if deferred else "whole on each rank, from trainer.seed" if seeded else
                 f"whole on each rank (model.init_device={cfg.model.init_device})")
        n_params = sum(p.numel() for p in model.parameters() if p.requires_grad)
        self.mfu = self._mfu_meter(model, n_params)
        embeddings = embedding_names(model)
        hetero_cfg = hetero_group_for(cfg.hetero, built)
        parallel_cfg = parallel_group_for(cfg.parallel, built)
        # auto parallel plans on the batch the model sees: every rank feeds the whole of it;
        # the others, one rank's slice (cut as the layout cuts it, not by the world size: a
        # pipeline's stages or a tensor-parallel group feed the same rows)
        split = group_split(cfg.parallel)
        whole = split is OperatorSplit.SEARCH
        slices = feed_count(parallel_config(parallel_cfg, self.world_size, cfg.get("hetero"),
                                            cfg.trainer.grad_accum_steps, cfg.get("offload")))
        example = self._batch(0, 0, 1 if whole else slices)
        if cfg.parallel.pipeline_degree > 1 or split in (OperatorSplit.STRATEGIES,
                                                          OperatorSplit.SEARCH):
            # placed by parallelize: each stage after the split, or by the semi-auto sharding
            tag_cpu_modules(model, hetero_cfg)
        else:
            model = apply_placement(model, hetero_cfg, example)
        if not built.fake_tensors and cfg.parallel.pipeline_degree > 1:
            log.info("pipeline split of %s by parameters (its forward cannot run on fake "
                     "tensors to measure FLOPs); checked on the first step", built.label)
        # offload.activations=host is trainer.recompute=offload (resolve_offload refuses both)
        recompute = "offload" if policy.activations == "host" else cfg.trainer.recompute
        if recompute != "none" and built.layers is None:
            raise ValueError(f"trainer.recompute={recompute} recomputes the model's layer list, "
                             f"and {built.label} has none (an nn.ModuleList)")
        # auto parallel: recomputed before planning, so the plan counts these blocks at their
        # mode (and its own recompute choice, under parallel.max_device_memory, leaves them)
        recomputed = parallel.recompute_layers(model, built.layers or "",
                                               recompute) if whole else []
        self.model, self.parallel, self.offloads = self._parallelize(
            model, built, policy, parallel_cfg, hetero_cfg, example, deferred)
        if not whole:
            recomputed = parallel.recompute_layers(self.model, built.layers or "", recompute)
        if recomputed:
            log.info("recompute (%s): %d blocks", recompute, len(recomputed))
        log.info("offload: %s", policy.describe())
        if cfg.trainer.compile:
            compile_model(self.model)
        self.feed = batch_slice(self.parallel)  # (index, count) of the global batch
        torch.manual_seed(cfg.trainer.seed + 1 + self.rank)  # own dropout stream per rank
        self.optimizer = build_optimizer(
            self.model, cfg.optim, cfg.hetero, embeddings, offload=cfg.offload,
            state_dir=state_dir(cfg, self.run_dir) if policy.optimizer == "disk" else None,
            shard_group=shard_group(self.parallel, cfg.parallel, cfg.offload))
        log.info("%s", memory_plan(self.model, self.optimizer, self.offloads,
                                   host_shards=self.parallel.offload_params))
        # fp16 (trainer.precision or offloaded weights): a loss scaler
        self.scaler = build_scaler(cfg.trainer.precision, self.optimizer, self.device,
                                   PARAM_DTYPES[cfg.offload.param_dtype] if on_host else None)
        if self.scaler is not None and isinstance(self.model, parallel.pipeline.Pipeline):
            raise ValueError("offload.param_dtype=float16 needs loss scaling, which the pipeline "
                             "schedules do not apply (their backward runs inside pipe.step); "
                             "use offload.param_dtype=bfloat16 with parallel=pipeline")
        self.scheduler = build_scheduler(self.optimizer, cfg.optim,
                                         cfg.optim.total_steps or cfg.trainer.max_steps)
        self.checkpoint = self._resume_path()
        if self.checkpoint is not None:
            self.start_step = load_checkpoint(
                self.checkpoint, self.model, self.optimizer, self.scheduler, self.device,
                scaler=self.scaler, allow_partial=cfg.trainer.allow_partial_resume,
                digest=cfg.trainer.resume_digest)
            log.info("resumed from %s at step %d", self.checkpoint, self.start_step)
            self.data.resume(self.checkpoint)
        self.metrics = self.build_loggers()
        if cfg.trainer.checkpoint_async:
            self.saver = AsyncCheckpointer(self.run_id)
        self.clock = CheckpointClock(cfg.trainer.checkpoint_every_minutes)
        log.info("%s with %.2f M parameters, vocab %d, %s; %d rank(s) on %s; run dir %s",
                 built.label, n_params / 1e6, self.tokenizer.vocab_size,
                 self.data.describe(), self.world_size, self.device,
                 self.run_dir)

    def _parallelize(self, model: torch.nn.Module, built: Any, policy: Any,
                     parallel_cfg: DictConfig, hetero_cfg: DictConfig,
                     example: tuple[torch.Tensor, torch.Tensor], deferred: bool
                     ) -> tuple[torch.nn.Module, Any, list]:
        """(the model to train, the resolved ``ParallelConfig``, its parameter offloads):
        the ``parallel`` group applied, or under ``offload.params=host`` without stages the
        model kept on the host with its host gradients averaged (``recipes/offload.py``)."""
        cfg = self.cfg
        if policy.params != "device" and cfg.parallel.pipeline_degree == 1 and \
                not host_shards(parallel_cfg, cfg.offload):  # level2/3: through parallelize
            config = parallel_config(parallel_cfg, self.world_size, hetero_cfg,
                                     cfg.trainer.grad_accum_steps, cfg.offload)
            if deferred:  # the whole model in host memory, from the seed (or its weights)
                parallel.materialize(model, seed=cfg.trainer.seed, device="cpu",
                                     weights=cfg.model.get("weights"))
        else:
            model, config = apply_parallel_mode(
                model, without_level1(parallel_cfg, cfg.offload), loss_fn=lm_loss,
                example_inputs=example[:1] if built.fake_tensors else None,
                hetero=hetero_cfg, offload=cfg.offload,
                accumulate=cfg.trainer.grad_accum_steps,
                init_seed=cfg.trainer.seed if deferred else None,
                plan_file=self.run_dir / "parallel_plan.txt",
                weights=cfg.model.get("weights"))
        offloads = offload_params(
            model, policy, config, hetero_cfg, self.device,
            disk_path=state_dir(self.cfg, self.run_dir) if policy.params == "disk" else None,
        ) if policy.params != "device" and not config.offload_params else []
        return model, config, offloads

    def _resume_path(self) -> Path | None:
        return resume_path(self.cfg.trainer.resume_from, self.ckpt_root)

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean loss over ``trainer.eval_batches`` held-out global batches (the same windows at
        every evaluation), averaged over the ranks."""
        t = self.cfg.trainer
        self.model.eval()
        total = torch.zeros((), device=self.device)
        for x, y in self.data.held_out(t.eval_batches, *self.feed):
            x, y = x.to(self.device), y.to(self.device)
            with self._autocast():
                if isinstance(self.model, parallel.pipeline.Pipeline):  # forward-only schedule
                    loss = self.model.eval_step(x, target=y)
                else:
                    loss = recipe_loss(self.model(x, y), y, lm_loss)
            total = total + loss.detach()
        self.model.train()
        return parallel.collectives.all_reduce(total / t.eval_batches, op="mean").item()

    def _batch(self, step: int, rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's slice of step ``step``'s global batch: a streamed source's next one (step
        0: a look at it, for planning, that leaves the stream where it is)."""
        x, y = self.data.batch(step, rank, world_size)
        # through pinned memory, not blocking the host (a pageable copy drains the stream)
        return hd.copy_to(x, self.device), hd.copy_to(y, self.device)

    def forward(self, step: int) -> torch.Tensor:
        """This rank's slice of the step's batch through the model (a pipeline runs its
        backward too, micro-batch by micro-batch; so do ``trainer.grad_accum_steps`` > 1)."""
        x, y = self._batch(step, *self.feed)
        self.optimizer.zero_grad(set_to_none=True)
        if isinstance(self.model, parallel.pipeline.Pipeline):
            with self._autocast():  # the schedule's backward runs inside too (autocast leaves
                return self.model.step(x, target=y)  # backward ops in the forward's dtypes)
        if self.cfg.trainer.grad_accum_steps > 1:
            return self._accumulate(x, y, self.cfg.trainer.grad_accum_steps)
        with self._autocast():
            return recipe_loss(self.model(x, y), y, lm_loss)

    def _autocast(self):
        """``trainer.precision``'s autocast (nothing for fp32): the forward only."""
        return autocast(self.cfg.trainer.precision, self.device)

    def _accumulate(self, x: torch.Tensor, y: torch.Tensor, micro: int) -> torch.Tensor:
        """Forward and backward of ``micro`` equal parts of the batch, each loss divided by
        ``micro`` so the gradients sum to the whole batch's mean; the data-parallel wrappers
        reduce only after the last part (``no_sync``). Returns the mean loss."""
        if x.shape[0] % micro:
            raise ValueError(f"trainer.grad_accum_steps={micro} must divide this rank's "
                             f"{x.shape[0]} samples per step (data.global_batch_size / ranks)")
        total = torch.zeros((), device=x.device)
        for i, (xs, ys) in enumerate(zip(x.chunk(micro), y.chunk(micro), strict=True)):
            last = i == micro - 1
            no_sync = getattr(self.offloads[0] if self.offloads else self.model, "no_sync",
                              None)
            with contextlib.nullcontext() if last or no_sync is None else no_sync():
                with self._autocast():
                    part = recipe_loss(self.model(xs, ys), ys, lm_loss) / micro
                (self.scaler.scale(part) if self.scaler is not None else part).backward()
            total = total + part.detach()
        return total

    def backward(self, loss: torch.Tensor) -> None:
        """Backward (gradients averaged over ranks by the wrapper); a pipeline ran it inside
        ``pipe.step`` and ``trainer.grad_accum_steps`` > 1 part by part in :meth:`forward`."""
        if (not isinstance(self.model, parallel.pipeline.Pipeline)
                and self.cfg.trainer.grad_accum_steps == 1):
            scaled_backward(loss, self.scaler)

    def step(self) -> None:
        """Clip, update."""
        if isinstance(self.model, parallel.pipeline.Pipeline):
            if self.cfg.optim.grad_clip is not None:
                self.grad_norm = self.model.clip_grad_norm_(self.cfg.optim.grad_clip)
            self.optimizer.step()
            return
        self.grad_norm = clip_and_step(self.model, self.optimizer, self.cfg.optim.grad_clip,
                                       self.scaler)

    def _mfu_meter(self, model: torch.nn.Module, n_params: int) -> MfuMeter | None:
        """The step's MFU from its token rate (``recipes/mfu.py``), or None where this device's
        peak is unknown (said in the log)."""
        cfg = self.cfg
        peak = device_peak(cfg.trainer.precision, cfg.trainer.peak_tflops)
        if peak is None:
            log.info("MFU: this device's peak FLOP/s is unknown here; trainer.peak_tflops=... "
                     "gives it")
            return None
        hf = getattr(model, "config", None)  # an HF model's shape, else the recipe GPT's
        layers = getattr(hf, "num_hidden_layers", None) if hf else cfg.model.get("n_layer")
        width = getattr(hf, "hidden_size", None) if hf else cfg.model.get("d_model")
        per_token = flops_per_token(n_params, layers, width, cfg.data.seq_len)
        log.info("MFU against %g TFLOP/s per device (%s); FLOPs per token: 6 x %d parameters "
                 "+ 12 x %s layers x %s width x %d tokens = %d", peak.flops / 1e12,
                 peak.source, n_params, layers, width, cfg.data.seq_len, per_token)
        return MfuMeter(per_token, self.world_size, peak)

    def after_step(self, step: int, record: dict) -> None:
        t = self.cfg.trainer
        if self.mfu is not None:
            record["mfu"] = self.mfu(record[self.rate_name])
        if t.eval_every and (step % t.eval_every == 0 or step == t.max_steps):
            record["eval_loss"] = self.evaluate()
            record["eval_perplexity"] = math.exp(min(record["eval_loss"], 700.0))  # no overflow
            log.info("step %d  eval loss %.4f  perplexity %.2f", step, record["eval_loss"],
                     record["eval_perplexity"])
        if self.saver is not None:  # an asynchronous save in flight: published once written
            self._published(self.saver.poll())
        if self.clock.due() or step % t.checkpoint_every == 0 or step == t.max_steps:
            self.guard.settle()  # a step whose update the device skipped stops the run first
            self.clock.saved()
            what = dict(scaler=self.scaler, config=self.cfg, tokenizer=self.tokenizer.to_json(),
                        data=self.data.position())
            if self.saver is None:
                self._published(save_checkpoint(self.ckpt_root, step, self.model,
                                                self.optimizer, self.scheduler, self.device,
                                                run=self.run_id, **what))
            else:
                self._published(self.saver.save(self.ckpt_root, step, self.model,
                                                 self.optimizer, scheduler=self.scheduler,
                                                 device=self.device, **what))
                if step == t.max_steps:  # the run's last checkpoint is complete when it ends
                    self._published(self.saver.wait())

    def _published(self, checkpoint: Path | None) -> None:
        """``checkpoint`` is complete on every rank: the run's newest, and older ones pruned
        (``trainer.keep_last``)."""
        if checkpoint is None:
            return
        self.checkpoint = checkpoint
        keep_last = self.cfg.trainer.keep_last
        if keep_last is not None and self.rank == 0:
            prune_checkpoints(self.ckpt_root, keep_last, checkpoint, self.run_id)

    def cleanup(self, *, failed: bool = False) -> None:
        saver = getattr(self, "saver", None)  # set-up may have stopped before it
        if saver is not None:
            saver.close()
        super().cleanup(failed=failed)

    def postfix(self, record: dict) -> dict[str, str]:
        shown = {"loss": f"{record['loss']:.4f}", "lr": f"{record['lr']:.2e}",
                 "tok/s": f"{record['tokens_per_s']:,.0f}"}
        if "grad_norm" in record:
            shown["gnorm"] = f"{record['grad_norm']:.3g}"
        if "mfu" in record:
            shown["mfu"] = f"{record['mfu']:.1%}"
        return shown

    def summary_extras(self) -> dict:
        return {"checkpoint": str(self.checkpoint) if self.checkpoint else None,
                "digest": checkpoint_digest(self.checkpoint)
                if self.checkpoint and (self.checkpoint / CHECKSUMS).is_file() else None}


register_configs()  # schemas and resolvers must exist before @hydra.main composes the config
register_resolvers()


@hydra.main(version_base="1.3", config_path="../conf", config_name="train")
def main(cfg: DictConfig) -> None:
    run(TrainRecipe, cfg)


if __name__ == "__main__":
    run_then_exit(main)
