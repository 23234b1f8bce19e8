"""The training loop: steps, evaluation, TensorBoard, checkpoints, `metrics.json`."""

from __future__ import annotations

import json
import logging
import math
import signal
import statistics
import threading
import time
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from runner.build import Setup
from runner.errors import ConfigError, Interrupted, NonFiniteLoss, RunnerError
from runner.progress import Progress, human_bytes

log = logging.getLogger("runner")


def fit(cfg: DictConfig, setup: Setup, out: Path) -> float:
    """Train `cfg.train.steps` steps (continuing from `cfg.resume`); returns the final eval metric."""
    from sections import ReplayMismatchError

    from runner.checkpoint import Checkpoints
    from runner.tb import Board, hparam_values

    engine, data, train = setup.engine, setup.data, cfg.train
    batches = iter(data.train_batches(cfg.batch, train.seed))
    checkpoints = Checkpoints(out / "checkpoints", engine, batches, train.keep_checkpoints)
    start = checkpoints.restore(cfg.resume) if cfg.resume else 0
    if start >= train.steps:
        raise ConfigError("train.steps", train.steps, f"must exceed the resumed run's step {start}")

    config_text, table = OmegaConf.to_yaml(cfg, resolve=True), engine.describe()
    (out / "config.yaml").write_text(config_text)
    (out / "partition.txt").write_text(table + "\n")
    logdir = out.parent if _in_sweep() else _outputs_root(out)
    log.info(f"run folder: {out}\n{config_text}\n{table}")
    log.info(f"TensorBoard: tensorboard --logdir {logdir}")
    board = Board(out)
    board.text("config", config_text)
    board.text("partition", table)
    board.hparams(hparam_values(OmegaConf.to_container(cfg, resolve=True), HydraConfig.get().runtime.choices,
                                setup.sections))
    if start:
        log.info(f"resumed from {cfg.resume} at step {start}")
    exactness = verify_exact(engine, setup.probe) if train.verify_exact else {}
    if exactness:
        board.text("exactness", json.dumps(exactness))

    eval_batch = train.eval_batch or cfg.batch
    history, results, step = [], {}, start
    progress = Progress(train.steps, start, train.progress, train.log_every)
    try:
        with StopOnCtrlC() as stop:
            for step in range(start + 1, train.steps + 1):
                batch = next(batches)
                began = time.perf_counter()
                try:
                    stats = engine.train_step(batch)
                except ReplayMismatchError as err:
                    raise RunnerError(f"step {step}: {err}") from err
                seconds = time.perf_counter() - began
                if not math.isfinite(stats["loss"]):
                    raise NonFiniteLoss(f"loss is {stats['loss']} at step {step}; stopped. Last good checkpoint: "
                                        f"{checkpoints.latest or 'none (none saved yet)'}")
                history.append((stats, seconds))
                board.train_step(step, stats, seconds, cfg.batch)
                progress.update(step, stats["loss"], cfg.batch / seconds, stats["step_peak_bytes"])
                if _due(step, train.eval_every, train.steps):
                    results = evaluate(engine, data, eval_batch)
                    board.scalars(step, {f"{k}/eval": v for k, v in results.items()})
                    log.info(f"eval @ step {step}: " + "  ".join(f"{k} {v:.4f}" for k, v in results.items()))
                if _due(step, train.checkpoint_every, train.steps):
                    checkpoints.save(step)
                if stop.requested and step < train.steps:
                    path = checkpoints.latest if _due(step, train.checkpoint_every, 0) else checkpoints.save(step)
                    raise Interrupted(f"interrupted at step {step}: saved {path}; continue with resume={out}")
        metrics = {**describe_setup(engine, cfg.batch), **exactness,
                   **summarize(history, results, data, cfg.batch, step)}
        board.scalars(step, {f"final/{k}": v for k, v in metrics.items()
                             if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)})
    finally:
        progress.close()
        board.close()

    (out / "metrics.json").write_text(json.dumps(metrics, indent=1))
    log.info(f"done: {json.dumps(metrics)}\nrun folder: {out}\nTensorBoard: tensorboard --logdir {logdir}")
    return metrics[metrics["metric"]]


def verify_exact(engine, batch, examples: int = 64) -> dict:
    """Does one step of this engine equal one ordinary whole-graph step? (State is restored afterwards.)"""
    from sections import compare_with_whole

    report = compare_with_whole(engine, batch, examples=examples)
    verdict = "equals" if report["exact"] else "DIFFERS FROM"
    log.info(f"exactness: one {engine.strategy} step {verdict} a whole-graph step on {examples} examples "
             f"(gradient relative error {report['gradient_rel_error']:.2g}, state max |difference| "
             f"{report['state_max_abs_diff']:.2g}; worst: {report['worst_variable'] or '-'})")
    return {"exact": report["exact"], "exact_gradient_rel_error": report["gradient_rel_error"],
            "exact_state_max_abs_diff": report["state_max_abs_diff"],
            "exact_worst_variable": report["worst_variable"]}


def describe_setup(engine, batch: int) -> dict:
    """What was trained and how: for reports that compare runs."""
    info = {
        "strategy": engine.strategy,
        "batch": batch,
        "num_sections": len(engine.sections),
        "section_blocks": [len(s.block_names) for s in engine.sections],
        "policies": [s.policy for s in engine.sections],
        "num_blocks": len(engine.network.blocks),
    }
    if engine.plan is not None:
        info.update(memory_budget_bytes=engine.plan.budget, predicted_peak_bytes=engine.plan.predicted_peak)
    return info


def evaluate(engine, data, batch_size: int) -> dict:
    """Example-weighted means of `engine.evaluate` over one pass of the eval split."""
    totals, count = {}, 0
    for batch in data.eval_batches(batch_size):
        size = int(next(iter(batch.values())).shape[0])
        for key, value in engine.evaluate(batch).items():
            totals[key] = totals.get(key, 0.0) + float(value) * size
        count += size
    return {key: total / count for key, total in totals.items()}


def summarize(history: list, results: dict, data, batch: int, step: int) -> dict:
    """The final figures: losses, eval metric, median step time, throughput, memory and forward runs per section."""
    timed = [seconds for _, seconds in history[1:]] or [seconds for _, seconds in history]
    median = statistics.median(timed) if timed else float("nan")
    last = history[-1][0] if history else {}
    metric = getattr(data, "metric", None)
    metric = metric if metric in results and metric != "loss" else "eval_loss"
    metrics = {
        "step": step,
        "loss": last.get("loss"),
        "eval_loss": results.get("loss"),
        "metric": metric,
        metric: results.get(metric, results.get("loss")),
        **{k: v for k, v in results.items() if k not in ("loss", metric)},
        "median_step_seconds": median,
        "examples_per_second": batch / median if median else None,
        "step_peak_bytes": max((s["step_peak_bytes"] for s, _ in history if s["step_peak_bytes"] is not None),
                               default=None),
        # Identical steps can differ by a large allocation or two (op order on several threads varies).
        "median_step_peak_bytes": _median([s["step_peak_bytes"] for s, _ in history[1:] or history
                                           if s["step_peak_bytes"] is not None]),
        "peak_bytes_per_section": [max((v for v in col if v is not None), default=None)
                                   for col in zip(*(s["peak_bytes"] for s, _ in history))],
        "forward_runs_per_section": list(last.get("forward_runs", [])),
    }
    if metrics["step_peak_bytes"] is not None:
        metrics["step_peak"] = human_bytes(metrics["step_peak_bytes"])
    return metrics


def _median(values: list):
    return statistics.median(values) if values else None


class StopOnCtrlC:
    """The first Ctrl-C asks the loop to stop after the current step; a second one aborts at once."""

    requested = False

    def __enter__(self):
        self._previous = None
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        log.warning("Ctrl-C: saving a checkpoint after this step (Ctrl-C again to abort without saving)")

    def __exit__(self, *exc):
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)


def _due(step: int, every: int, last: int) -> bool:
    return step == last or (every > 0 and step % every == 0)


def _in_sweep() -> bool:
    return HydraConfig.get().mode.name == "MULTIRUN"


def _outputs_root(out: Path) -> Path:
    """`outputs` for `outputs/<date>/<time>`, else the run folder's parent."""
    return out.parent.parent if out.parent.parent.name == "outputs" else out.parent
