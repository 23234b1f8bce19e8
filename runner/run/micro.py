"""`train.micro_batch`: gradient accumulation. The engine is built (and, with `sections=auto`, planned) for a
micro-batch, and each step sums the gradients of the batch's micro-batches, weighted by their shares, and applies
them once (`sections.MicroBatched`): the effective batch stays `batch` on a device where its step does not fit.

`train.micro_batch=max` searches the largest micro-batch whose step fits the device. Its candidates are the equal
cuts of the batch: `ceil(batch / n)` examples for n = 1, 2, 3, ... micro-batches. n = 1 (the whole batch, no
micro-batches) is tried first, then n doubles (2, 4, 8, ...) until a cut fits, then n is bisected between the last
cut that did not fit and the first that did, until the smallest micro-batch that does not fit is within
`batch_max.TOLERANCE` (10%) above the largest that does. A trial is what a `batch=max` trial is (build.py): the
engine builds at that micro-batch (with `sections=auto`, its dry steps find a plan under the budget), else two
accumulated steps run within the budget, state restored; as there, the best trial of a fixed partition steps once
more after later trials ran, and where it no longer fits the search goes on below it.
"""

from __future__ import annotations

import gc
import logging
import math

from omegaconf import DictConfig

from runner.errors import ConfigError
from sections.rules import human_bytes

log = logging.getLogger("runner")


def micro_batched(cfg: DictConfig, data, network, sections, strategy, makers):
    """The run's (engine, probe, batches) with the engine stepping micro-batches (`cfg.train.micro_batch`: a number,
    or max, which becomes the micro-batch found). `makers`: build.py's `make_engine`, `one_step_fits` and
    `new_optimizer`, handed in (build.py imports this module, so this one does not import it back)."""
    value = cfg.train.micro_batch
    if value == "max":
        micro, kept = _largest_micro(cfg, data, network, sections, strategy, makers)
        engine, probe, batches = kept
    else:
        micro = int(value)
        engine, probe, batches = makers.make_engine(cfg, data, network, sections, strategy, cfg.batch,
                                                    micro_batch=micro)
    if micro >= cfg.batch:
        log.info(f"train.micro_batch={micro}: the whole batch of {cfg.batch} in one step (no micro-batches)")
    return engine, probe, batches


def sizes(batch: int, count: int) -> int:
    """The micro-batch of `count` equal cuts of `batch` (the largest of them, where they cannot be equal)."""
    return math.ceil(batch / count)


def _largest_micro(cfg: DictConfig, data, network, sections, strategy, makers):
    """`micro_batch=max` (the module's docstring): the micro-batch found (written into `cfg.train.micro_batch`, so the
    run's config.yaml, and a resume, keep it) and its trial's (engine, probe, batches)."""
    import sections as engine_lib
    from runner.run.batch_max import TOLERANCE
    make_engine, _one_step_fits, new_optimizer = makers.make_engine, makers.one_step_fits, makers.new_optimizer

    batch = cfg.batch
    budget, source = engine_lib.device_budget(cfg.engine.memory_budget)
    optimizer = new_optimizer(cfg, strategy)  # one optimizer for every trial (build.py `_largest` says why)

    def attempt(count: int):
        micro = sizes(batch, count)
        try:
            engine, probe, batches = make_engine(cfg, data, network, sections, strategy, batch, raw=True,
                                                 optimizer=optimizer, micro_batch=micro)
        except ValueError as err:
            if getattr(err, "smallest", None) is None:  # not the planner's refusal (as batch=max's trials)
                raise ConfigError("sections", sections, str(err)) from err
            return micro, False, err.smallest or None, "no plan fits", None
        except engine_lib.OutOfMemory as err:
            return micro, False, err.in_use + (err.requested or 0), "out of memory while planning", None
        if engine.plan is not None:  # sections=auto: its dry steps ran the plan under the budget
            return micro, True, engine.plan.predicted_peak, "", (engine, probe, batches)
        fits, peak, why = _one_step_fits(engine, probe, budget)
        return micro, fits, peak, why, (engine, probe, batches) if fits else None

    def again(kept):  # a fixed partition's steps, in the memory the later trials left (sections=auto re-plans)
        engine, probe, _ = kept
        return (True, None, "") if engine.plan is not None else _one_step_fits(engine, probe, budget)

    best, kept, trials = search(batch, attempt, again, TOLERANCE)
    if best is None:
        raise ConfigError("train.micro_batch", "max", f"not even micro-batches of 1 example fit the device's budget "
                          f"{human_bytes(budget)} ({source}): {_describe(trials)}")
    micro = sizes(batch, best)
    cfg.train.micro_batch = micro
    log.info(f"micro_batch=max: {micro} ({best} micro-batch{'es' if best > 1 else ''} per batch of {batch}; "
             f"trials: {_describe(trials)}; budget {human_bytes(budget)}, {source})")
    return micro, kept


def search(batch: int, attempt, again=None, tolerance: float = 0.1, collect=gc.collect):
    """Trials `attempt(count) -> (micro-batch, fits, peak or None, why, kept or None)` over `count` micro-batches
    per batch (the module's docstring says which); returns the fewest micro-batches that fit (None: not even one
    example each), what that trial kept, and the trials `(micro-batch, fits, peak, why)`. `again(kept) -> (fits,
    peak, why)`: the best trial checked once more where later trials ran after it (their failures can leave the
    device with less room, as `batch=max` found); where it no longer fits, the search goes on below it.
    `collect`: frees what a dropped trial held (the garbage collector)."""
    trials, kept, best, worst, count = [], None, None, None, 1
    while True:
        while count is not None:
            micro, fits, peak, why, engine = attempt(count)
            trials.append((micro, fits, peak, why))
            log.info(f"micro_batch=max: micro-batch {micro} ({count} per batch of {batch}) "
                     f"{'fits' if fits else 'does not fit'}" + (f" ({why})" if why else "")
                     + (f", peak {human_bytes(peak)}" if peak else ""))
            if fits:
                kept = None  # the larger micro-batch's engine is freed before the smaller one is kept
                collect()
                kept, best = engine, count
            else:
                worst = count if worst is None else max(worst, count)
            del engine
            collect()
            count = _next_count(batch, best, worst, tolerance)
        if again is None or kept is None or trials[-1][0] == sizes(batch, best):
            break  # nothing to check, or the best is the last trial: nothing ran after it
        fits, peak, why = again(kept)
        if fits:
            break
        why = f"{why or 'it no longer fits'}, checked again after the later trials"
        trials.append((sizes(batch, best), False, peak, why))
        log.info(f"micro_batch=max: micro-batch {sizes(batch, best)} does not fit any more ({why}); searching "
                 f"below it")
        kept = None
        collect()
        best, worst = None, best
        count = _next_count(batch, best, worst, tolerance)
        if count is None:
            break
    return best, kept, trials


def _next_count(batch: int, best: int | None, worst: int | None, tolerance: float) -> int | None:
    """The next number of micro-batches to try, or None when the search is done."""
    if best is None:  # nothing fitted yet: twice as many, up to one example each
        if worst >= batch:
            return None
        return min(2 * worst, batch)
    if worst is None or best - worst <= 1 or sizes(batch, worst) <= sizes(batch, best) * (1 + tolerance):
        return None
    middle = (worst + best) // 2
    # counts that give the same micro-batch as a known one are skipped: the smallest count of the middle's size
    while middle > worst + 1 and sizes(batch, middle - 1) == sizes(batch, middle):
        middle -= 1
    if sizes(batch, middle) in (sizes(batch, best), sizes(batch, worst)):
        return None
    return middle


def _describe(trials: list) -> str:
    return ", ".join(f"{m} {'fits' if ok else 'does not'}" + (f" ({human_bytes(p)})" if p else "")
                     for m, ok, p, _ in trials)
