"""The training loop: one loop of steps with hooks around it (`runner.run.hooks`: profiler, NaN stop, telemetry,
progress, evaluation, checkpoints, signals), then the run's figures in `metrics.json`."""

from __future__ import annotations

import logging
import math
import statistics
import time
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from runner.errors import ConfigError, OutOfMemoryStop, RunnerError
from runner.platform import stops
from runner.run.build import Setup
from runner.run.hooks import (Checkpointing, Evaluation, FiniteStop, Hooks, Profiler, ProgressHook, SignalStop,
                              Telemetry)
from runner.run.oom import OomBreakdown
from runner.run.progress import Progress
from sections import telemetry
from sections.rules import human_bytes
from sections.telemetry import TrainerProtocol

log = logging.getLogger("runner")


def fit(cfg: DictConfig, setup: Setup, out: Path, changes: dict | None = None, restore_from: Path | None = None) -> float:
    """Train `cfg.train.steps` steps (continuing `cfg.resume`, whose folder is `out`); returns the eval metric.
    `restore_from`: where a resumed run's checkpoints are read, when not `out/checkpoints` (another worker)."""
    from runner.config.resume import apply_optimizer_changes
    from runner.record.run_record import RunRecord
    from runner.run import datafeed
    from runner.run.checkpoint import Checkpoints
    from runner.platform import distribute
    from runner.run.export import ModelFiles

    engine, data, train, changes = setup.engine, setup.data, cfg.train, changes or {}
    batches = setup.batches if setup.batches is not None else datafeed.train_iterator(data, cfg.batch, train.seed,
                                                                                       setup.strategy)
    first = setup.probe if setup.batches is not None else None  # the build took it from the same iterator
    checkpoints = Checkpoints(out / "checkpoints", engine, batches, train.keep_checkpoints)
    start, finishing = 0, False
    if cfg.resume:
        start, restored = checkpoints.restore(restore_from)
        first = None  # the restored iterator continues where the run stopped
        finishing = _finishing(restore_from.parent if restore_from else out, train, start)

    hydra = HydraConfig.get() if HydraConfig.initialized() else None
    overrides = list(hydra.overrides.task) if hydra else []
    record = RunRecord(out, cfg, setup, overrides, sweep=_in_sweep(), start_step=start)
    try:
        record.start(changes)
        datafeed.write_record(out, data, resumed=bool(start), changes=setup.data_changes)
        if start:
            log.info(f"resumed from {restored} at step {start}")
            apply_optimizer_changes(engine.optimizer, changes, cfg.optimizer)
        exactness = verify_exact(engine, setup.probe) if train.verify_exact and not finishing else {}
        if exactness:
            record.exactness(exactness)

        eval_batch = train.eval_batch or engine.micro_batch or cfg.batch  # micro-batches: theirs
        progress = Progress(train.steps, start, train.progress, train.log_every)
        telemetry = Telemetry(record.board, cfg.batch)
        # Other workers of a multi-worker run would write into a scratch folder that is deleted: they save nothing.
        save_model = train.get("save_model", True) if distribute.is_chief(setup.strategy) else False
        model_files = ModelFiles(out, engine, data, setup.probe, save_model)
        eval_batch = EvalBatch(eval_batch)  # halved where an evaluation runs out of device memory
        evaluation = Evaluation(lambda: evaluate(engine, data, eval_batch), train.eval_every, train.steps,
                                record.board, progress, then=model_files.evaluated)
        profiler = Profiler(train.get("profile_steps"), out)
        oom_breakdown = OomBreakdown(engine, out, train.get("oom_breakdown", True), profiler,
                                     distribute.workers(setup.strategy))
        hooks = Hooks([profiler,
                       FiniteStop(engine.network.variables, checkpoints),
                       telemetry, ProgressHook(progress, cfg.batch), evaluation,
                       Checkpointing(checkpoints, train.checkpoint_every, train.steps),
                       SignalStop(checkpoints, train.checkpoint_every, train.steps, out)])
        stops.check()  # a signal whose first raise was lost (in a finalizer) stops before the loop's own handlers
        step = _loop(engine, batches, hooks, start, train.steps, first, data, oom_breakdown)
        if finishing:  # no step ran: the final evaluation, for the files that follow from it
            evaluation.results = evaluate(engine, data, eval_batch)
            model_files.evaluated(step, evaluation.results)
        model_files.final(step)
        history, results = telemetry.history, evaluation.results
        metrics = {**describe_setup(engine, cfg.batch), **exactness,
                   **({"batch_max_trials": setup.batch_search.records(),
                       "batch_max_seconds": setup.batch_search.seconds} if setup.batch_search else {}),
                   **summarize(history, results, data, cfg.batch, step)}
        metrics.update(planning_figures(engine, metrics["median_step_seconds"]))
        if datafeed.record(data):
            metrics["data"] = datafeed.record(data)
        if finishing:
            metrics = _kept_metrics(out) or {**metrics, "final_files_written_on_resume": True}
        flops = record.flops
        if flops:
            metrics["flops_per_section"] = flops
            metrics["rerun_flops"] = sum((runs - 1) * f["forward"]
                                         for runs, f in zip(metrics["forward_runs_per_section"], flops))
        record.finish(step, metrics)
    except BaseException:
        record.close(quietly=True)  # the first failure is the one reported
        raise
    record.close()
    return metrics[metrics["metric"]]


FINAL_FILES = ("metrics.json", "model.keras")


def _finishing(folder: Path, train, start: int) -> bool:
    """A resumed run at its last step: True when some final file is missing (written without training further);
    a run that would train no step and has all its files is refused, asking for more steps."""
    if start < train.steps:
        return False
    wanted = [n for n in FINAL_FILES if n != "model.keras" or train.get("save_model", True) is not False]
    missing = [n for n in wanted if not (Path(folder) / n).is_file()]
    if start == train.steps and missing:
        log.info(f"resume: training is complete (step {start} of {train.steps}); writing the missing "
                 f"{', '.join(missing)} without training further")
        return True
    done = f"; its training is complete and its final files are there" if start == train.steps else ""
    raise ConfigError("train.steps", train.steps, f"must exceed the resumed run's step {start} to train further "
                      f"(give train.steps=<more>){done}")


def _kept_metrics(out: Path) -> dict | None:
    """The run's own `metrics.json`, where a resume that only writes missing files finds it."""
    import json

    try:
        metrics = json.loads((out / "metrics.json").read_text())
    except (OSError, ValueError):
        return None
    return metrics if isinstance(metrics, dict) and "metric" in metrics else None


def _loop(engine, batches, hooks: Hooks, start: int, steps: int, first=None, data=None, on_oom=None) -> int:
    """Steps `start + 1 .. steps`, the hooks around each (`first`: the first step's batch, already taken from
    `batches`; `data`: the source, to name a file that fails; `on_oom(step, batch)`: the end of the out-of-memory
    stop line, `runner.run.oom`); returns the last step run."""
    from sections import BudgetExceededError, OutOfMemory, ReplayMismatchError

    from runner.run import datafeed

    step = start
    hooks.on_train_begin()
    try:
        for step in range(start + 1, steps + 1):
            batch, first = (first, None) if first is not None else (datafeed.next_batch(batches, data), None)
            hooks.on_step_begin(step)
            began = time.perf_counter()
            stopped = None
            try:
                stats = engine.train_step(batch)
            except (ReplayMismatchError, BudgetExceededError) as err:
                raise RunnerError(f"step {step}: {err}") from err
            except OutOfMemory as err:
                stopped = f"step {step}: {err}; {what_would_fit(engine)}; {_saved(step)}"
            if stopped:  # out of the except: the failed step's error (and what it holds) is gone before on_oom
                raise OutOfMemoryStop(stopped + (on_oom(step, batch) if on_oom else "")) from None
            hooks.on_step_end(step, stats, time.perf_counter() - began)
    finally:
        hooks.on_train_end()
    return step


def what_would_fit(engine: TrainerProtocol) -> str:
    """The advice an out-of-memory stop gives: the planner where it did not choose, else a smaller batch."""
    if engine.plan is None:
        return ("would fit: sections=auto (plans the sections to the device's memory) or batch=max (the largest "
                "batch whose plan fits), or train.micro_batch=max (keeps this batch: gradients summed over "
                "micro-batches that fit)")
    return (f"the planner's smallest plan did not fit at this batch: batch=max finds the largest that does, "
            f"train.micro_batch=max keeps this batch in micro-batches that fit")


def _saved(step: int) -> str:
    return f"nothing of step {step} was saved"


def verify_exact(engine: TrainerProtocol, batch, examples: int = 64) -> dict:
    """Does one step of this engine equal one ordinary whole-graph step? (State is restored afterwards.)"""
    from sections import OutOfMemory, compare_with_whole

    least = engine.replicas.count
    while True:
        try:
            report = compare_with_whole(engine, batch, examples=examples)
            break
        except OutOfMemory as err:
            if examples // 2 < least:
                log.warning(f"exactness: NOT CHECKED: even {examples} examples' whole-graph step does not fit "
                            f"the device ({err})")
                return {"exact": None, "exact_not_checked": str(err)}
            log.warning(f"exactness: the check on {examples} examples ran out of device memory; "
                        f"checking {examples // 2}")
            examples //= 2
    errors = (report["gradient_rel_error"], report["state_max_abs_diff"])
    exact = bool(report["exact"]) and all(math.isfinite(e) for e in errors)  # NaN gradients equal nothing
    verdict = "equals" if exact else "DIFFERS FROM"
    strategy = engine.strategy
    allowed = report.get("tolerance", math.nan)
    log.info(f"exactness: one {strategy} step {verdict} a whole-graph step on {examples} examples{_micro_note(report)} "
             f"(gradient relative error {report['gradient_rel_error']:.2g} over all variables, allowed "
             f"{allowed:.2g}: the whole step's own rounding sensitivity is "
             f"{report.get('sensitivity', math.nan):.2g}; "
             f"state max |difference| {report['state_max_abs_diff']:.2g}; worst variable: "
             f"{report['worst_variable'] or '-'})" + _fault_note(engine, exact))
    return {"exact": exact, "exact_gradient_rel_error": report["gradient_rel_error"],
            "exact_tolerance": allowed, "exact_sensitivity": report.get("sensitivity", math.nan),
            "exact_state_max_abs_diff": report["state_max_abs_diff"],
            "exact_worst_variable": report["worst_variable"],
            **({"exact_micro_batches": report["micro_batches"], "exact_one_step_rel_error":
                report["one_step_rel_error"]} if "micro_batches" in report else {})}


def _fault_note(engine, exact: bool) -> str:
    """Where a step differs and a kernel is known to compute one of the model's gradients wrongly: that line."""
    fault = engine.kernel_faults
    return f"; a known kernel fault can explain it: {fault}" if fault and not exact else ""


def _micro_note(report: dict) -> str:
    """What the exactness check compared under train.micro_batch: both steps over the same micro-batches, and how
    far one whole-graph step over all the examples is."""
    if "micro_batches" not in report:
        return ""
    return (f", both cut into the same {report['micro_batches']} micro-batches, gradients summed by their shares "
            f"(against one whole-graph step over all the examples: relative distance "
            f"{report['one_step_rel_error']:.2g}, within rounding only without batch statistics)")


def describe_setup(engine: TrainerProtocol, batch: int) -> dict:
    """What was trained and how: for reports that compare runs."""
    from runner.platform import distribute

    info = {
        "strategy": engine.strategy,
        "batch": batch,
        **({"micro_batch": engine.micro_batch, "micro_batches": len(engine.sizes)}  # train.micro_batch
           if engine.micro_batch is not None else {}),
        **distribute.summary(engine.replicas.strategy),
        "num_sections": len(engine.sections),
        "section_blocks": [len(s.block_names) for s in engine.sections],
        "policies": [s.policy for s in engine.sections],
        "num_blocks": len(engine.network.blocks),
        "memory_measured": bool(engine.memory_measured),
        "memory_note": engine.memory_note,  # why not measured (None: measured)
        "lean": engine.lean,  # None: a trainer without lean gradients (whole, recompute_grad)
        # where the optimizer applied the gradients: in the backward section by section, or once at the end (why)
        "apply": "in_backward" if engine.apply_reason is None else "at_end",
        "apply_reason": engine.apply_reason,
    }
    device = engine.device_memory
    if device is not None:
        info.update(device_memory_bytes=device.total, device_memory_source=device.source,
                    device_memory_hard_limit=device.hard)
    if engine.budget_source:
        info["memory_budget_source"] = engine.budget_source
    if engine.plan is not None:
        info.update(memory_budget_bytes=engine.plan.budget, predicted_peak_bytes=engine.plan.predicted_peak,
                    planner_margin=engine.plan.margin, planner_measured_sections=engine.plan.measured_sections,
                    planner_extra_bytes=engine.plan.extra_bytes)
        if engine.planning_seconds is not None:
            info["planning_seconds"] = engine.planning_seconds
    return info


class EvalBatch:
    """The evaluation's batch (`train.eval_batch`, else the training batch: with batch=max, the one found), halved
    for the rest of the run where an evaluation at it runs out of the device's memory."""

    def __init__(self, size: int):
        self.size = int(size)

    def __int__(self) -> int:
        return self.size


def evaluate(engine, data, batch_size) -> dict:
    """Example-weighted means of `engine.evaluate` over one pass of the eval split. `batch_size` an `EvalBatch`:
    an evaluation that runs out of device memory is made again at half its batch (it changes no state), down to
    the replicas' count."""
    import tensorflow as tf

    from sections import OutOfMemory

    if not isinstance(batch_size, EvalBatch):
        return _evaluate(engine, data, int(batch_size))
    least = engine.replicas.count or 1
    while True:
        try:
            return _evaluate(engine, data, batch_size.size)
        except (tf.errors.ResourceExhaustedError, OutOfMemory) as err:
            why = str(err).strip().splitlines()[0][:200] if str(err).strip() else type(err).__name__
        if batch_size.size // 2 < least:
            raise OutOfMemoryStop(f"evaluation: even {batch_size.size} example(s) run out of the device's memory "
                                  f"({why})")
        smaller = max(least, batch_size.size // 2 // least * least)
        log.info(f"evaluation: batch {batch_size.size} ran out of the device's memory; evaluating at {smaller} "
                 f"from now on (train.eval_batch sets it)")
        batch_size.size = smaller


def _evaluate(engine, data, batch_size: int) -> dict:
    from runner.run.datafeed import checked

    totals, count = {}, 0
    for batch in checked(data.eval_batches(batch_size), data):
        size = int(next(iter(batch.values())).shape[0])
        for key, value in engine.evaluate(batch).items():
            totals[key] = totals.get(key, 0.0) + float(value) * size
        count += size
    return {key: total / count for key, total in totals.items()}


def planning_figures(engine, median_step: float | None) -> dict:
    """``sections=auto``: each dry step's predicted and measured peak, and planning's time in steps of training."""
    if engine.plan is None or engine.planning_seconds is None:
        return {}
    steps = engine.planning_seconds / median_step if median_step and median_step == median_step else None
    # train.plan_cache: True where the plan a cache remembered ran, False where it was tried and not, None: none
    return {"planning_dry_steps": list(engine.dry_runs), "planning_in_steps": steps,
            "plan_remembered": engine.plan_remembered}


def summarize(history: list, results: dict, data, batch: int, step: int) -> dict:
    """The final figures: losses, eval metric, median step time, throughput, memory and forward runs per section."""
    timed = [seconds for _, seconds in history[1:]] or [seconds for _, seconds in history]
    median = statistics.median(timed) if timed else float("nan")
    last = history[-1][0] if history else {}
    metric = data.metric
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
        **telemetry.memory_figures([s for s, _ in history]),
    }
    if metrics["step_peak_bytes"] is not None:
        metrics["step_peak"] = human_bytes(metrics["step_peak_bytes"])
    return metrics


def _in_sweep() -> bool:
    return HydraConfig.initialized() and getattr(HydraConfig.get().mode, "name", None) == "MULTIRUN"
