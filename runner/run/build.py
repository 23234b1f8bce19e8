"""From a checked config to live objects: data, network, optimizer and engine, from a clean Keras state."""

from __future__ import annotations

import logging
import dataclasses
from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig, OmegaConf

from runner.errors import ConfigError, apply_rule
from runner.run.datafeed import conforming, resumed_data
from runner.platform.precision import set_precision, wrap_optimizer
from sections import rules

log = logging.getLogger("runner")


@dataclass
class Setup:
    data: Any
    engine: Any
    sections: Any  # the resolved `sections` handed to the engine
    probe: dict  # the first training batch, used to build the engine
    # The training iterator the probe came from (its prefetch buffers were in memory while the engine planned);
    # None where the probe came from an iterator of its own (a multi-worker shard): training makes its own.
    batches: Any = None
    strategy: Any = None  # the tf.distribute strategy (None: one device)
    batch_search: Any = None  # batch=max: its trials (runner/run/batch_max.py)
    data_changes: Any = ()  # resume_data=changed: what changed in the data since the run (runner/run/datafeed.py)


def set_determinism(on: bool) -> None:
    """TensorFlow's op determinism, on or off: a process-wide switch, and Hydra runs a sweep's jobs in one process,
    so a job with ``train.deterministic=false`` after one with true must turn it off (it also keeps Keras from
    compiling with XLA)."""
    import tensorflow as tf

    from sections.tf_compat import disable_op_determinism  # TensorFlow names only turning it on publicly

    if on:
        tf.config.experimental.enable_op_determinism()
    else:
        disable_op_determinism()


def build(cfg: DictConfig, strategy=None, folder=None, continuing: bool = False) -> Setup:
    """Under a strategy, the network and optimizer are made in its scope and the engine runs on its replicas.
    `batch=max`: the largest batch that fits is searched for first, and `cfg.batch` becomes it (`folder`: the run
    folder, where its trials are recorded as they end; `continuing`: a stopped search's are read back from it)."""
    import keras

    keras.backend.clear_session()  # also resets the dtype policy: set this run's after it
    set_precision(cfg.train.precision)
    keras.utils.set_random_seed(cfg.train.seed)
    set_determinism(cfg.train.deterministic)

    data = conforming(instantiate(cfg.data, "data"), cfg.data._target_)
    data, data_changes = resumed_data(cfg, data, lambda **kwargs: _rebuild_data(cfg, **kwargs))
    searching = cfg.batch == "max"
    # lazy: nothing allocated
    spec = data.train_batches(1 if searching else cfg.batch, cfg.train.seed).element_spec
    if not searching:
        _check_batch_fits(cfg, spec)  # the examples alone, before the network exists
    micro = cfg.train.get("micro_batch") is not None  # train.micro_batch: activations at a micro-batch (micro.py)
    with _scope(strategy):
        network = make_network(cfg, data)
        if not searching and not micro:
            _check_batch_fits(cfg, spec, network)  # with the blocks' outputs, before the first batch is made
        sections = resolve_sections(cfg)  # checked against the network by the engine (`sections_answer`)
    warn_budget_above_device(cfg.engine.memory_budget)
    if searching:
        setup = _largest(cfg, data, network, sections, strategy, folder, continuing)
        setup.data_changes = data_changes
        return setup
    if micro:
        from types import SimpleNamespace

        from runner.run.micro import micro_batched

        makers = SimpleNamespace(make_engine=make_engine, one_step_fits=_one_step_fits, new_optimizer=new_optimizer)
        engine, probe, batches = micro_batched(cfg, data, network, sections, strategy, makers)
        setup = Setup(data=data, engine=engine, sections=sections, probe=probe, strategy=strategy, batches=batches)
        setup.data_changes = data_changes
        return setup
    engine, probe, batches = make_engine(cfg, data, network, sections, strategy, cfg.batch, remember=True)
    return Setup(data=data, engine=engine, sections=sections, probe=probe, strategy=strategy, batches=batches,
                 data_changes=data_changes)


def warn_budget_above_device(value, device: str | None = None) -> bool:
    """A budget in bytes above the device's memory: the planner would plan to it and a step it allows can run out,
    so say so once, at start (a fraction of the device never is). True where it warned."""
    parsed = None if value is None else rules.parse_budget(value)
    if not isinstance(parsed, int):
        return False
    import sections as engine_lib
    import tensorflow as tf

    memory = engine_lib.device_memory(device or ("GPU:0" if tf.config.list_physical_devices("GPU") else "CPU:0"))
    if memory.total is None or parsed <= memory.total:
        return False
    log.warning(f"engine.memory_budget={value} ({rules.human_bytes(parsed)}) is above the device's memory, "
                f"{memory.describe()}: plans to it can run out of memory; give at most "
                f"{rules.human_bytes(memory.total)}, or a fraction of the device (0.9)")
    return True


def _rebuild_data(cfg: DictConfig, **kwargs):
    """The data again, with `kwargs` (a resumed run's `class_names`) where its builder takes them."""
    import inspect

    from hydra.utils import get_object

    takes = inspect.signature(get_object(cfg.data._target_)).parameters
    return instantiate(cfg.data, "data", **{k: v for k, v in kwargs.items() if k in takes})


def _scope(strategy):
    import contextlib

    return strategy.scope() if strategy is not None else contextlib.nullcontext()


def make_engine(cfg: DictConfig, data, network, sections, strategy, batch: int, raw: bool = False,
                optimizer=None, micro_batch: int | None = None, remember: bool = False):
    """The engine of `cfg.engine` with a fresh optimizer (or `optimizer`), built on the first training batch of
    `batch` examples; returns it, that batch and the training iterator it came from (None under a multi-worker
    shard), so the input pipeline's buffers are in memory while `sections=auto` measures. `raw`: the engine's own
    errors as raised (else one ConfigError naming sections). `remember`: `sections=auto` reads and keeps its plan
    in `train.plan_cache` (`runner/run/plan_cache.py`; not for `batch=max`'s trials, whose floors need the
    least-memory plan measured)."""
    from runner.run.datafeed import next_batch, train_iterator, worker_shard

    if optimizer is None:
        optimizer = new_optimizer(cfg, strategy)
    engine_args = OmegaConf.to_container(cfg.engine, resolve=True)
    batches = train_iterator(data, batch, cfg.train.seed, strategy) if worker_shard(strategy) is None else None
    probe = next_batch(batches if batches is not None else iter(data.train_batches(batch, cfg.train.seed)),
                       data)
    extra = {"distribute": strategy} if strategy is not None else {}
    if remember and sections == "auto" and str(cfg.engine._target_) == "sections.Engine":
        from runner.run.plan_cache import plan_cache

        store = plan_cache(cfg.train.get("plan_cache"))
        if store is not None:
            extra["plan_store"] = store
    try:
        engine = instantiate(cfg.engine, "engine", network=network, optimizer=optimizer, sections=sections,
                             _convert_="all",  # a plain list of boundary names, not a ListConfig
                             **extra)
    except ValueError as err:
        raise sections_answer(err, sections, network) or ConfigError(
            "sections", sections, f"{err} (engine: {_brief(engine_args)})") from err
    if micro_batch is not None and micro_batch < batch:  # train.micro_batch: built and planned for a micro-batch
        import sections as engine_lib

        try:
            engine = engine_lib.MicroBatched(engine, micro_batch)
        except ValueError as err:
            raise ConfigError("train.micro_batch", micro_batch, str(err).split(": ", 1)[-1]) from err
    try:
        engine.build(probe)
    except ValueError as err:
        import sections as engine_lib

        if isinstance(err, engine_lib.VariablesDoNotFit):
            raise variables_answer(cfg, err) from err
        if raw:
            raise
        raise ConfigError("sections", sections, f"{err} (engine: {_brief(engine_args)})") from err
    return engine, probe, batches


def new_optimizer(cfg: DictConfig, strategy):
    with _scope(strategy):
        return wrap_optimizer(instantiate(cfg.optimizer, "optimizer"), cfg.train.precision)


def _largest(cfg: DictConfig, data, network, sections, strategy, folder=None, continuing: bool = False) -> Setup:
    """`batch=max`: the largest batch whose step fits (runner/run/batch_max.py); `cfg.batch` becomes it.

    Every trial steps one optimizer (its state restored after each): an optimizer whose slots a compiled step
    updated stays in memory after it is dropped (TensorFlow 2.21, Keras 3.15: 16 MiB of slots per new SGD
    optimizer on a 2048x2048 Dense, every time; in eager steps they are freed), so a new optimizer per trial left
    each trial's slots behind (ResNet50 on a 1 GiB device: about 100 MiB per trial, batch 16 no longer fitting
    after five trials where 32 had)."""
    import tensorflow as tf

    import sections as engine_lib
    from runner.platform import stops
    from runner.platform.journal import recorded_trials
    from runner.run.batch_max import Trial, announce, largest_batch, plan_of, recorded, start_search

    replicas = strategy.num_replicas_in_sync if strategy is not None else 1
    budget, source = engine_lib.device_budget(cfg.engine.memory_budget)
    cap = data.train_size
    optimizer = new_optimizer(cfg, strategy)
    announce(_short_target(cfg.model._target_), "sections=auto" if cfg.sections == "auto" else
             f"{_short_target(cfg.engine._target_)}, sections={sections}", budget, source, cfg.sections == "auto",
             cap, replicas)
    earlier, said = recorded(recorded_trials(folder), replicas) if folder is not None and continuing else ([], None)
    start_search(folder, cfg, said, keep=bool(earlier))

    floors = []  # sections=auto: each trial's floor (Engine.memory_floor), which the search extrapolates
    stepped = []  # the trials whose engines stepped this optimizer (a built engine's steps, a plan's dry steps)

    def try_batch(batch: int):
        nonlocal optimizer
        try:
            engine, probe, batches = make_engine(cfg, data, network, sections, strategy, batch, raw=True,
                                                 optimizer=optimizer)
        except ValueError as err:
            smallest = getattr(err, "smallest", None)
            if smallest is None:
                raise ConfigError("sections", sections, str(err)) from err
            # The smallest plan's dry step: this batch's floor, as measured (its fixed part and line are the
            # last fitting trial's: neither grows with the batch). A dry step that ran out measured only a lower
            # bound (about the device's size at any batch above it): no floor, the trial bounds the search alone.
            bound = getattr(err, "lower_bound", False)
            floor = dataclasses.replace(floors[-1], least=smallest) if floors and smallest and not bound else None
            stepped.append(batch)
            return Trial(batch, False, smallest or None, "no plan fits", floor)
        except engine_lib.OutOfMemory as err:
            stepped.append(batch)
            return Trial(batch, False, err.in_use + (err.requested or 0), "out of memory while planning")
        except tf.errors.ResourceExhaustedError:  # outside a dry step: an eager op of the build at this batch
            # (EfficientNetB0 at batch 51 on a 352 MiB device: a Sigmoid of the borders' pass) ended the search
            if not stepped:  # it may have run out making the optimizer's slots, leaving it half made: a new one
                optimizer = new_optimizer(cfg, strategy)  # (never stepped, so dropping it frees its slots)
            return Trial(batch, False, None, "out of memory while building its engine")
        stepped.append(batch)
        stops.check()  # planning is over: a signal whose first raise was lost stops here
        if engine.plan is not None:  # sections=auto: its dry steps ran the plan under the budget
            floors.append(engine.memory_floor)
            return Trial(batch, True, engine.plan.predicted_peak, floor=floors[-1], kept=(engine, probe, batches),
                         plan=plan_of(engine))
        fits, peak, why = _one_step_fits(engine, probe, budget)
        return Trial(batch, fits, peak, why, kept=(engine, probe, batches) if fits else None, plan=plan_of(engine))

    def again(best: Trial) -> Trial:  # a fixed partition's steps, in the memory the later trials left
        engine, probe, _ = best.kept  # (sections=auto re-plans)
        if engine.plan is not None:
            return Trial(best.batch, True)
        return Trial(best.batch, *_one_step_fits(engine, probe, budget))

    (batch, kept), search = largest_batch(try_batch, replicas, cap, budget, again, folder, earlier)
    if batch is None:
        raise ConfigError("batch", "max", f"not even {replicas} example(s) fit the device's budget "
                          f"{rules.human_bytes(budget)} ({source}): {search.describe()}")
    cfg.batch = batch
    log.info(f"batch=max: {batch} in {search.seconds:.1f} s (trials: {search.describe()}; budget "
             f"{rules.human_bytes(budget)}, {source})")
    engine, probe, batches = kept if kept is not None else make_engine(cfg, data, network, sections, strategy, batch,
                                                                       optimizer=optimizer)
    return Setup(data=data, engine=engine, sections=sections, probe=probe, strategy=strategy, batches=batches,
                 batch_search=search)


def _short_target(target: str) -> str:
    name = str(target).rsplit(".", 1)[-1]
    return name[len("build_"):] if name.startswith("build_") else name


def _one_step_fits(engine, probe, budget: int, steps: int = 2):
    """Steps of a fixed engine at this batch, every variable restored after: do they run, within `budget`? Two
    steps, the larger peak: with several inter-op threads a whole step's peak moves by tens of MiB from step to
    step (the notebook ResNet at batch 220: 289 MiB in one trial, 342 and 349 MiB in the run's first steps)."""
    import sections as engine_lib

    # Written back where each variable was (not `assign` of an array: a new buffer wherever the allocator put it,
    # which moved the heap from trial to trial, and converting an array on a nearly full device crashed the process:
    # VGG16, whole, batch 8 on a 495 MiB device, after its step ran out)
    state = [*engine.network.variables, *engine.optimizer.variables]
    saved = engine_lib.host_copy(state)
    peaks = []
    try:
        for _ in range(steps):
            peaks.append(engine.train_step(probe)["step_peak_bytes"])
    except engine_lib.OutOfMemory as err:
        return False, err.in_use + (err.requested or 0), "out of memory"
    finally:
        engine_lib.write_back(state, saved)
    peak = None if None in peaks else max(peaks)
    if peak is not None and peak > budget:
        return False, peak, f"its step read {rules.human_bytes(peak)}, over the budget"
    return True, peak, ""


def make_network(cfg: DictConfig, data):
    """The model config's builder, given the data's `model_args`. A key the model config sets itself (keras_app's
    input_shape) wins; the builder sees the data's as `data_args`. `default_sections` is not a builder argument."""
    model_cfg = OmegaConf.masked_copy(cfg.model, [k for k in cfg.model if k != "default_sections"])
    data_args = dict(data.model_args or {})
    own = {k: data_args.pop(k) for k in list(data_args) if model_cfg.get(k) is not None}
    return instantiate(model_cfg, "model", **data_args, **({"data_args": own} if own else {}))


def _check_batch_fits(cfg: DictConfig, spec, network=None) -> None:
    """Refuse a batch that the machine's memory cannot hold, before it is allocated."""
    from runner.platform.sizes import activation_bytes, check_batch_fits

    if isinstance(spec, dict):
        whole = cfg.engine._target_ == "sections.WholeGraph"  # others hold one block's border pair at least
        try:
            per_example = activation_bytes(network, spec, whole) if network is not None else None
        except ValueError as err:  # the estimate lets only sections.VariablesDoNotFit out
            raise variables_answer(cfg, err) from err
        check_batch_fits(cfg.batch, spec, per_example,
                         outputs="block outputs" if whole else "the largest block's input and output")


def variables_answer(cfg: DictConfig, err) -> ConfigError:
    """``sections.VariablesDoNotFit``: no batch, partition or engine helps; the model (its variables could not be
    made) or the optimizer (its slots) is the value to change."""
    key = "model" if err.what == "model" else "optimizer"
    return ConfigError(key, _short_target(cfg[key]._target_), str(err))


def resolve_sections(cfg: DictConfig):
    """Top-level `sections`, else the model's `default_sections`, else 1."""
    value = cfg.sections if cfg.sections is not None else cfg.model.get("default_sections", 1)
    return OmegaConf.to_container(value) if OmegaConf.is_list(value) else value


def sections_answer(err: ValueError, sections, network) -> ConfigError | None:
    """The engine's answer (``sections.rules``, checked once, when the engine is made) on `sections` that cannot
    exist for this network (too many, or boundaries it does not have), worded for the config; None for others."""
    rule, facts = getattr(err, "rule", None), getattr(err, "facts", {})
    block_names = network.block_names
    groups = list(dict.fromkeys(name.split("/", 1)[0] for name in block_names))
    if rule == "unknown_boundary":
        example = next((n for n in block_names if "/" in n), block_names[0])
        return ConfigError("sections", sections, f"unknown boundary name(s) {', '.join(facts['unknown'])}; allowed: "
                           f"{', '.join(groups)}, or a block name such as {example}")
    if rule == "more_sections_than_blocks":
        names = rules.name_list(groups, getattr(network, "names_hint", "see the model"))
        return ConfigError("sections", sections, f"this model has {facts['num_blocks']} blocks; allowed: 1 to "
                           f"{facts['num_blocks']}, or boundary names{names}")
    if rule == "not_a_cut":  # a Keras model's own reason: no such layer, or merged into a block
        return ConfigError("sections", sections, str(err))
    return None


def instantiate(node: DictConfig, group: str, **kwargs):
    """`hydra.utils.instantiate`, with a failure reported as a ConfigError naming the group."""
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate as hydra_instantiate

    try:
        return hydra_instantiate(node, **kwargs)
    except InstantiationException as err:
        cause = err.__cause__
        if isinstance(cause, ValueError) and group == "engine":
            raise cause from err  # the engine's own one-line answer (bad sections, policy or budget)
        why = f"{type(cause).__name__}: {cause}" if cause is not None else str(err)
        why = " ".join(line.strip() for line in why.splitlines() if line.strip())
        raise ConfigError(f"{group}._target_", node.get("_target_"), f"cannot build it: {why}") from err


def _brief(args: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in args.items())
