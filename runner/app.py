"""The entry point: compose the config, check it, build data, model and engine, train, return the eval metric."""

from __future__ import annotations

import logging
from pathlib import Path

import hydra
from omegaconf import DictConfig

from runner.config import schema
from runner.config.checks import check_config
from runner.job import guarded

log = logging.getLogger("runner")
CONF = str(Path(__file__).resolve().parent.parent / "conf")
schema.register()


@hydra.main(version_base="1.3", config_path=CONF, config_name="config")
def main(cfg: DictConfig) -> float:
    """One run (or one sweep job); returns the data's metric on the eval split, the value sweeps optimize."""
    return guarded(run, cfg)


def run(cfg: DictConfig, out: Path) -> float:
    """Check `cfg`, build everything, train; `resume=<folder>` continues that run in its own folder."""
    changes, continuing = {}, False
    if cfg.resume is not None:
        cfg, changes, out, continuing = _resumed(cfg)
    check_config(cfg)
    from runner.platform import distribute

    task = distribute.check(cfg)
    if task is not None and not task.is_chief:
        return _run(cfg, out, changes)  # the chief holds the folder's lock; this worker writes into scratch
    from runner.platform.lock import holding

    with holding(out):
        return _run(cfg, out, changes, continuing)


def _run(cfg: DictConfig, out: Path, changes: dict, continuing: bool = False) -> float:
    from runner.platform import distribute
    from runner.platform.quiet import load_tensorflow

    load_tensorflow()
    from runner.platform.gpu_memory import cap_gpu_memory
    from runner.platform.threads import set_inter_op_threads

    cap_gpu_memory(cfg.train.get("gpu_memory"))  # before the GPU runtime starts (listing devices does not)

    set_inter_op_threads(cfg.train.inter_op_threads, cfg.engine._target_)  # before the runtime starts (the strategy starts it)
    strategy = distribute.make_strategy(cfg)  # before anything else runs TensorFlow
    _reserve_cpu_limit()  # before anything else allocates
    from runner.platform.precision import keeping_dtype_policy
    from runner.run.build import build
    from runner.run.train import fit

    with keeping_dtype_policy():
        if distribute.is_chief(strategy):
            return fit(cfg, build(cfg, strategy, out, continuing), out, changes)
        # Another worker of a multi-worker run: it takes part in every step, save included (collective reads),
        # but writes into a scratch folder it deletes; it resumes from the run's own checkpoints.
        with distribute.scratch_folder() as scratch:
            value = fit(cfg, build(cfg, strategy), scratch, changes, restore_from=out / "checkpoints")
    distribute.remove_worker_folder(out)  # Hydra's log of this worker; kept when the run fails
    return value


def _reserve_cpu_limit() -> None:
    """On a device emulated on the CPU (an allocator limit), the limit as one region, as on a GPU."""
    from sections import reserve_cpu_limit

    said = reserve_cpu_limit()
    if said:
        log.info(said)


def _resumed(cfg: DictConfig):
    from hydra.core.hydra_config import HydraConfig

    from runner.config.resume import resumed_config, run_folder, stopped_search
    from runner.errors import ConfigError

    hc = HydraConfig.get() if HydraConfig.initialized() else None
    own = hc is not None and Path(str(cfg.resume)).resolve() == Path(hc.runtime.output_dir).resolve()
    if hc is not None and getattr(hc.mode, "name", None) == "MULTIRUN" and not own:  # own: a continued sweep's job
        raise ConfigError("resume", cfg.resume, "continues one run in its own folder; it cannot be swept (-m)")
    merged, changes = resumed_config(cfg, list(hc.overrides.task) if hc else [])
    folder = run_folder(cfg.resume)
    continuing = stopped_search(folder)
    if continuing:  # a batch=max search stopped before any checkpoint: a new run in its folder, continuing it
        merged.resume = None
    return merged, changes, folder, continuing
