"""`resume=<run folder>`: that run's own `config.yaml`, with this command line's overrides on top.

What may change on resume:
- anything that leaves the math alone (sections, engine, `train.steps`, cadences, progress, checks): allowed;
- the optimizer's hyperparameters: applied after the checkpoint is restored (and logged);
- `train.precision` between float32 and mixed_bfloat16 (variables stay float32); not to or from mixed_float16,
  whose loss-scale optimizer holds state of its own;
- what the checkpoint fixes (model, data, batch, seed, the optimizer's class or its slot variables): refused,
  in one line naming each differing key;
- the data itself (files, classes, arrays, shards) is compared with the run's `data_fingerprint.json` when it is
  built (`runner.run.datafeed.resumed_data`): a change is refused unless `resume_data=changed`.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

import numpy as np

from omegaconf import DictConfig, OmegaConf

from runner.errors import ConfigError

log = logging.getLogger("runner")

FIXED = ("model.", "data.", "batch", "train.seed", "optimizer._target_")
FREE_IN_FIXED = ("model.default_sections",)  # the model's default partition: a partition change
# Optimizer keys that decide which slot variables exist: their state in the checkpoint would not fit.
SLOT_KEYS = ("amsgrad", "centered", "nesterov")


def resumed_config(cfg: DictConfig, task_overrides: list[str]) -> tuple[DictConfig, dict]:
    """The run's saved config with `task_overrides` applied (values taken from the freshly composed `cfg`).

    Returns the config to run and the changes `{key: (before, after)}`; raises ConfigError on a change a
    checkpoint cannot follow."""
    folder = run_folder(cfg.resume)
    saved = saved_config(folder, cfg.resume)
    lacking = [g for g in ("model", "data", "optimizer") if not OmegaConf.is_dict(saved.get(g))]
    if lacking:
        raise ConfigError("resume", cfg.resume, f"its config.yaml has no {', '.join(lacking)}; not a run folder "
                          f"written by this runner")
    merged = OmegaConf.create(OmegaConf.to_container(saved, resolve=True))
    if stopped_search(folder):  # its search continues (a search that ended before the first checkpoint runs its last trial again)
        merged.batch = "max"
    for key in ("engine", "train"):  # keys added to the runner since that run: today's defaults
        for name, value in cfg[key].items():
            if name not in merged.get(key, {}):
                OmegaConf.update(merged, f"{key}.{name}", value, force_add=True)
    for name in ("batch", "sections"):
        if name not in merged:
            merged[name] = cfg[name]
    base = OmegaConf.create(OmegaConf.to_container(merged))  # the saved run, as today's runner reads it

    from hydra.core.override_parser.overrides_parser import OverridesParser

    for o in OverridesParser.create().parse_overrides(task_overrides):
        key = o.key_or_group.split("@")[0]
        if key == "resume" or key.startswith("hydra"):
            continue
        if key == "experiment":
            raise ConfigError("experiment", o.value(), "cannot be applied on resume (the run's own config.yaml "
                              "is the base); give the keys to change instead")
        key = key.replace("/", ".")
        if o.is_delete():
            parent, _, leaf = key.rpartition(".")
            node = OmegaConf.select(merged, parent) if parent else merged
            if node is not None and leaf in node:
                del node[leaf]
            continue
        OmegaConf.update(merged, key, OmegaConf.select(cfg, key), force_add=True, merge=False)
    merged.resume = str(cfg.resume)
    merged.resume_data = cfg.get("resume_data", "same")  # this resume's own choice, never an earlier one's
    if merged.batch == "max" and base.batch != "max":  # batch=max repeated: the batch a search found is kept
        merged.batch = _searched_batch(folder, base.batch)

    changes = differences(base, merged)
    refused = [k for k in changes if k.startswith(FIXED) and not k.startswith(FREE_IN_FIXED)]
    refused += [k for k in changes if _changes_slots(k, *changes[k])]
    # another model/data/optimizer option differs in most keys: its `_target_` says it in one item
    swapped = [k.rsplit(".", 1)[0] + "." for k in refused if k.endswith("._target_")]
    refused = [k for k in refused if k.endswith("._target_") or not k.startswith(tuple(swapped))]
    if refused:
        shown = ", ".join(f"{k} ({show(changes[k][0])} -> {show(changes[k][1])})" for k in refused)
        raise ConfigError("resume", cfg.resume, f"cannot change {shown} on resume: the checkpoint holds state "
                          f"for the saved values; start a new run instead")
    return merged, changes


GROUPS = ("model", "data", "optimizer")


SWEEP_RECORD = "sweep.json"  # a sweep folder's own command line (runner.hydra_callbacks writes it), for resume=<sweep>
RESUMING = "SECTIONFLOW_RESUME_SWEEP"  # set by resume=<sweep folder>: the folder the sweep continues in


def sweep_arguments(folder: Path, value, extra: list[str]) -> list[str]:
    """`resume=<sweep folder>`: the sweep's own command line again (its `sweep.json`), into that folder, where
    each job keeps what it finished, resumes from its checkpoints, or runs (`runner.hydra_callbacks.earlier_attempt`).
    `extra`: only Hydra's own settings may be added (`hydra.launcher.n_jobs=4`); anything else would change the
    jobs. Sets RESUMING for the sweep's callbacks."""
    import json
    import os

    try:
        if (folder / SWEEP_RECORD).is_file():
            record = json.loads((folder / SWEEP_RECORD).read_text())
        else:  # a sweep from before sweep.json: the basic sweeper's multirun.yaml holds the same overrides
            saved = OmegaConf.load(folder / "multirun.yaml").hydra
            record = {"task": list(saved.overrides.task), "hydra": list(saved.overrides.hydra),
                      "sweeper": OmegaConf.select(saved, "sweeper._target_")}
        task, hydra = list(record["task"]), list(record["hydra"])
    except Exception as err:  # noqa: BLE001 - unreadable JSON or YAML, a key missing: one line
        raise ConfigError("resume", value, f"its {SWEEP_RECORD} (or multirun.yaml) cannot be read "
                          f"({type(err).__name__}); not a sweep folder this runner wrote") from None
    changing = [a for a in extra if not a.lstrip("+~").startswith("hydra")]
    if changing:
        raise ConfigError("resume", value, f"continues the sweep as it was launched: {' '.join(changing)} would "
                          f"change its jobs (only Hydra's settings may be added, e.g. hydra.launcher.n_jobs=4)")
    quoted = str(folder).replace("\\", "\\\\").replace("'", "\\'")
    hydra = [o for o in hydra if not o.startswith("hydra.sweep.dir=")] + [f"hydra.sweep.dir='{quoted}'"]
    if "optuna" in str(record.get("sweeper") or "").lower():
        continued = optuna_continuation(folder, value, record.get("optuna"))
        keys = tuple(o.split("=", 1)[0] + "=" for o in continued)
        hydra = [o for o in hydra if not o.startswith(keys)] + continued
    os.environ[RESUMING] = str(folder.resolve())
    return ["-m", *task, *hydra, *extra]


def optuna_continuation(folder: Path, value, study: dict | None) -> list[str]:
    """An Optuna sweep continued from its study's storage (``hydra.sweeper.storage``): the trials it finished stay
    in the study (the sampler reads them), trials a kill interrupted are marked failed and asked again first with
    their parameters (run from the start: Optuna gives a continued trial a new job), and only the trials still
    missing of ``n_trials`` run, in job folders of their own (``c<k>_<job>``). ``study``: the sweep record's
    ``storage``, ``study_name`` and ``n_trials``. Returns the Hydra overrides."""
    try:
        storage, name, total = study.get("storage"), str(study["study_name"]), int(study["n_trials"])
    except (AttributeError, KeyError, TypeError, ValueError) as err:
        raise ConfigError("resume", value, f"its {SWEEP_RECORD} holds no Optuna study ({type(err).__name__}); "
                          f"a sweep from before studies were recorded cannot be continued") from None
    if not storage:
        raise ConfigError("resume", value, "this Optuna sweep kept its study in memory (hydra.sweeper.storage=null): "
                          "its trials ended with the process. Sweeps launched with a storage "
                          "(hydra.sweeper.storage=sqlite:///optuna.db) can be continued")
    if str(storage).startswith("sqlite:///") and not Path(str(storage)[len("sqlite:///"):]).is_file():
        raise ConfigError("resume", value, f"its study's storage {storage} is not found from {Path.cwd()}; run "
                          f"resume= from the folder the sweep was launched in")
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    try:
        study = optuna.load_study(study_name=name, storage=str(storage))
    except Exception as err:  # noqa: BLE001 - no such study, an unreadable database: one line
        raise ConfigError("resume", value, f"study {name!r} cannot be loaded from {storage} "
                          f"({type(err).__name__}: {err})") from None
    trials = study.get_trials(deepcopy=False)
    running = [t for t in trials if t.state == optuna.trial.TrialState.RUNNING]
    finished = sum(1 for t in trials if t.state.is_finished())
    missing = total - finished
    if missing <= 0:
        raise ConfigError("resume", value, f"study {name!r} already has {finished} finished trials of "
                          f"n_trials={total}: nothing to continue (raise hydra.sweeper.n_trials in a new sweep)")
    import warnings

    for trial in running:
        study.tell(trial.number, state=optuna.trial.TrialState.FAIL)
        with warnings.catch_warnings():  # optuna 2.10 marks enqueue_trial experimental
            warnings.simplefilter("ignore")
            study.enqueue_trial(trial.params)
    rounds = 1 + len({p.name.split("_")[0] for p in folder.glob("c*_*") if p.is_dir()})
    print(f"[sweep] Optuna study {name!r} in {storage}: {finished} of {total} trials finished; "
          f"{len(running)} interrupted (asked again with their parameters, from the start); {missing} to run",
          flush=True)
    subdir = f"c{rounds}_" + "${hydra.job.num}"  # resolved by Hydra per job (an override, not a message)
    return [f"hydra.sweeper.n_trials={missing}", "hydra.sweep.subdir=" + subdir]


def resume_arguments(args: list[str]) -> list[str]:
    """With `resume=<folder>`, check each `model.x=`, `data.x=`, `optimizer.x=` against the run's own config (not
    today's default options) and pass it as `++key=value`, so that Hydra, composing the default options, takes it.

    An SGD run's `optimizer.momentum=0.5` is then a change the resume rules judge; a key that run does not have is
    refused in one line listing the keys it has."""
    given = [a for a in args if a.startswith("resume=") and a.split("=", 1)[1] not in ("", "null")]
    if given and any((Path(given[-1].split("=", 1)[1]).expanduser() / name).is_file()
                     for name in (SWEEP_RECORD, "multirun.yaml")):
        sweep = given[-1].split("=", 1)[1]
        return sweep_arguments(Path(sweep).expanduser(), sweep,
                               [a for a in args if not a.startswith("resume=") and a not in ("-m", "--multirun")])
    if not given or any(a in ("-m", "--multirun") for a in args):
        return args
    value = given[-1].split("=", 1)[1]
    folder = Path(value).expanduser()
    if not (folder / "config.yaml").is_file():
        return args  # the config checks say what is wrong with the folder
    saved = saved_config(folder, value)
    out = []
    for arg in args:
        key, eq, rest = arg.partition("=")
        group = key.split(".")[0]
        if eq and group in GROUPS and "." in key and not key.startswith(("+", "~")) and OmegaConf.is_dict(saved.get(group)):
            node = saved[group]
            parts = key.split(".")[1:]
            for depth, part in enumerate(parts):
                if not OmegaConf.is_dict(node) or part not in node:
                    where = ".".join([group, *parts[:depth]])
                    has = ", ".join(str(k) for k in node) if OmegaConf.is_dict(node) else "no keys"
                    raise ConfigError(key, rest, f"unknown key for the resumed run; its {where} has: {has}")
                node = node[part]
            arg = f"++{arg}"
        out.append(arg)
    return out


def saved_config(folder: Path, value) -> DictConfig:
    """The run folder's `config.yaml`; unreadable text or YAML is one ConfigError."""
    path = Path(folder) / "config.yaml"
    try:
        saved = OmegaConf.load(path)
    except UnicodeDecodeError as err:
        raise ConfigError("resume", value, f"its config.yaml is not UTF-8 text (byte {err.start}: "
                          f"{err.object[err.start:err.start + 1]!r}); not a config this runner wrote") from None
    except Exception as err:  # noqa: BLE001 - a YAML syntax error has a multi-line message
        why = " ".join(str(err).split())[:200]
        raise ConfigError("resume", value, f"its config.yaml cannot be read: {type(err).__name__}: {why}") from None
    if not OmegaConf.is_dict(saved):
        raise ConfigError("resume", value, "its config.yaml is not a mapping of keys; not a config this runner wrote")
    return saved


def run_folder(value) -> Path:
    folder = Path(str(value)).expanduser()
    if not folder.is_dir():
        raise ConfigError("resume", value, "no such folder; give a run folder such as outputs/<date>/<time>")
    if not (folder / "config.yaml").is_file() or not (_checkpointed(folder) or stopped_search(folder)):
        raise ConfigError("resume", value, "not a run folder with checkpoints (config.yaml, checkpoints/ckpt-*) "
                          "or a stopped batch=max search")
    return folder


def _checkpointed(folder: Path) -> bool:
    return any((Path(folder) / "checkpoints").glob("ckpt-*.index"))


def stopped_search(folder: Path) -> bool:
    """A `batch=max` run stopped before its first checkpoint (kill -9 in the search): its `config.yaml` (written
    before the first trial) and the trials it recorded (`runner.platform.journal`); `resume=` continues it."""
    from runner.platform.journal import TRIALS

    folder = Path(folder)
    if _checkpointed(folder) or not (folder / "config.yaml").is_file():
        return False
    if (folder / TRIALS).is_file():
        return True
    try:
        return OmegaConf.load(folder / "config.yaml").get("batch") == "max"
    except Exception:  # noqa: BLE001 - an unreadable config.yaml is refused by saved_config, naming why
        return False


def differences(before: DictConfig, after: DictConfig) -> dict:
    """`{dotted key: (before, after)}` for every leaf that differs (`resume` and `resume_data`, one resume's own
    choices, excluded)."""
    a, b = _flat(OmegaConf.to_container(before, resolve=True)), _flat(OmegaConf.to_container(after, resolve=True))
    return {k: (a.get(k), b.get(k)) for k in sorted(set(a) | set(b))
            if k not in ("resume", "resume_data") and a.get(k) != b.get(k)}


def optimizer_changes(changes: dict) -> dict:
    return {k.split(".", 1)[1]: v for k, v in changes.items() if k.startswith("optimizer.")}


def apply_optimizer_changes(optimizer, changes: dict, config=None) -> None:
    """After restoring: the checkpoint put back its own learning rate; the config's value wins, so that
    `config.yaml` records what runs (also when an earlier resume changed it and was killed before saving).

    Other hyperparameters (betas, momentum, epsilon, weight decay, clipping) are plain attributes of the
    optimizer built from the new config, not checkpoint state, so they already apply."""
    for key, (before, after) in optimizer_changes(changes).items():
        log.info(f"resume: optimizer.{key} {show(before)} -> {show(after)} (applied from this step on)")
    wanted = (config or {}).get("learning_rate", changes.get("optimizer.learning_rate", (None, None))[1])
    if not isinstance(wanted, (int, float)) or isinstance(wanted, bool):
        return  # a schedule, or nothing to apply
    restored = float(np.asarray(optimizer.learning_rate))
    if not np.isclose(restored, wanted, rtol=1e-6, atol=0):
        if "optimizer.learning_rate" not in changes:
            log.info(f"resume: optimizer.learning_rate {show(restored)} in the checkpoint -> {show(wanted)} "
                     f"as config.yaml records (applied from this step on)")
        optimizer.learning_rate = wanted


def history_name(folder: Path) -> Path:
    """`config.<n>.yaml`, the first number not yet taken, for the config a resumed run replaces."""
    n = 1
    while (folder / f"config.{n}.yaml").exists():
        n += 1
    return folder / f"config.{n}.yaml"


def _searched_batch(folder: Path, batch):
    """`batch=max` on resume of a run with checkpoints: the batch its own search found is kept (said once); a run
    given its batch by hand is refused, naming it."""
    from runner.platform.journal import recorded_trials

    if recorded_trials(folder):
        log.info(f"resume: batch=max: this run's search found batch {batch}, which its checkpoint holds; kept "
                 f"(the override can be dropped)")
        return batch
    raise ConfigError("batch", "max", f"this run trains at batch {batch}, which its checkpoint holds (no batch=max "
                      f"search made it); drop the override to resume, or start a new run for batch=max")


def _changes_slots(key: str, before, after) -> bool:
    if key == "train.precision":  # mixed_float16 wraps the optimizer in a LossScaleOptimizer (more state)
        return (before == "mixed_float16") != (after == "mixed_float16")
    if not key.startswith("optimizer."):
        return False
    name = key.split(".", 1)[1]
    if name in SLOT_KEYS:
        return True
    # momentum 0 builds no momentum slots; turning it on (or off) changes the optimizer's state
    return name == "momentum" and _is_zero(before) != _is_zero(after)


def _is_zero(value) -> bool:
    return value is None or (isinstance(value, (int, float)) and not isinstance(value, bool) and value == 0)


def _flat(node, prefix: str = "") -> dict:
    out = {}
    if isinstance(node, dict):
        for k, v in node.items():
            out.update(_flat(v, f"{prefix}{k}."))
        return out
    out[prefix[:-1]] = node
    return out


def show(value) -> str:
    if isinstance(value, float) and math.isfinite(value):
        return f"{value:g}"
    if isinstance(value, list):
        return "[" + ",".join(map(str, value)) + "]"
    return "null" if value is None else str(value)
