"""``SectionedModel``: a user's Keras model trained section by section inside ``model.fit``.

The wrapper is a ``keras.Model`` whose training step is the engine's cycle over the model cut by
``Network.from_keras``. ``compile`` and ``fit`` keep their Keras meaning: the last section's loss is
``compile()``'s loss (with ``loss_weights``, ``sample_weight``/``class_weight`` and the model's
regularization losses), and the compiled metrics are updated from the outputs that section computed.
``evaluate``, ``predict`` and validation run the wrapped model as Keras does; saving writes the wrapped model.

``fit`` runs each step in Python (the engine measures memory between sections and calls each section's
compiled functions), so Keras's ``steps_per_execution`` cannot apply.
"""

from __future__ import annotations

import weakref

import keras
import tensorflow as tf

from . import rules, telemetry
from .backend import keras_internals as internals
from .network.keras_network import _checked, from_keras
from .step.engine import Engine
from .step.executor import WeightPenalty

__all__ = ["SectionedModel"]

_MiB = 2.0**20
_NAMES_HINT = "SectionedModel(...).network.cut_points lists them all"
# Which wrapper compiled each wrapped model last (a token per compile): a model wrapped twice is compiled by both,
# and each wrapper's save must write its own optimizer and compile settings.
_COMPILED_BY: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


class SectionedModel(keras.Model):
    """A built Functional or Sequential Keras model whose ``fit`` trains it section by section.

    Args:
        model: the user's built ``keras.Model`` (functional API) or ``keras.Sequential`` (with an ``Input``);
            it holds the trained weights, and ``save``/``save_weights`` write it, not the wrapper.
        sections: an int (that many sections, balanced by activation bytes), a list of layer names each of
            which ends a section (cut points of the model's graph: the next section starts after that layer), or
            ``"auto"`` (the planner, under ``memory_budget``).
        policy: ``"recompute"``, ``"store"``, ``"recreate"``, a ``sections.Policy``, or one per section.
        memory_budget: for ``sections="auto"``: bytes, a size such as ``"2GiB"``, or a fraction of the device's
            memory (``0.8``, ``"80%"``); default the device's memory less ``sections.backend.device.HEADROOM``.
        check: compare each re-run's output with its first run and raise on a mismatch.
        probe_batch: no longer used (a warning says so): planning counts costs from traces and measures no block.
        one_graph: compile each step into one graph (``Engine(one_graph=True)``).
        lean: batch norm and some activations with gradients that keep less; ``"recompute"``: also
            convolution and dense inputs re-made in the backward (``Engine(lean=...)``).
        apply: ``"auto"``, ``"in_backward"`` or ``"at_end"``: where the optimizer applies each section's
            gradients (``Engine(apply=...)``).
        max_blocks: at most this many blocks the model is cut into (``Network.from_keras``).
        plan_store: for ``sections="auto"``: a mapping where chosen plans are kept per set-up and tried first by the
            next build of it (``Engine(plan_store=...)``); ``shelve.open(path)`` keeps them across processes.

    Create it (and the model) under ``strategy.scope()`` to train on a ``tf.distribute`` strategy's replicas.

    Example:
        >>> model = keras.applications.ResNet50(weights=None, input_shape=(96, 96, 3), classes=10)
        >>> model = sections.SectionedModel(model, sections=4)     # the one added line
        >>> model.compile("adam", "sparse_categorical_crossentropy", metrics=["accuracy"])
        >>> model.fit(images, labels, batch_size=64, epochs=3, callbacks=[keras.callbacks.TensorBoard("logs")])
    """

    def __init__(self, model, sections=4, policy="recompute", memory_budget=None, check: bool = False,
                 probe_batch: int | None = None, one_graph: bool = False, max_blocks: int = 64, lean: bool | str = True,
                 apply: str = "auto", name=None, plan_store=None):
        _check_model(model)
        super().__init__(name=name or f"sectioned_{model.name}")
        self.model = model
        sections = rules.as_sections(sections)
        self._engine_args = dict(sections=sections,
                                 policy=policy, memory_budget=memory_budget, check=check,
                                 probe_batch=probe_batch, one_graph=one_graph, lean=lean, apply=apply)
        # Set past Keras's attribute tracking, which would copy a dict: the engine writes to the caller's mapping.
        object.__setattr__(self, "plan_store", plan_store)
        self.network = self._cut(model, sections, max_blocks)
        self.engine = self._new_engine(optimizer=None)  # checks sections and policy now: bad input fails here
        self.section_stats: dict | None = None
        self._epoch_peak = 0
        self._fit_ready = False
        self.built = True

    def _cut(self, model, sections, max_blocks: int):
        """The model cut by ``from_keras``; layer names in ``sections`` stay block borders."""
        cut = lambda keep=(): from_keras(model, self._network_loss, inputs="x", fields=_field_names(model),  # noqa: E731
                                         keep=keep, max_blocks=max_blocks, names_hint=_NAMES_HINT)
        network = cut()
        names = list(sections) if isinstance(sections, (list, tuple)) else []
        if any(n not in network.boundaries for n in names):
            if any(not isinstance(n, str) or n not in network.cut_points for n in names):
                network.boundary_starts(names)  # one line: no such layer, or why it cannot be cut there
            network = cut(names)
        return network

    # ------------------------------------------------------------------ Keras's model API
    def call(self, inputs, training=None):
        return self.model(inputs, training=training)

    def compile(self, optimizer="rmsprop", loss=None, loss_weights=None, metrics=None, weighted_metrics=None,
                run_eagerly=False, steps_per_execution=1, jit_compile="auto", auto_scale_loss=True):
        if loss is None:
            raise ValueError(f"SectionedModel.compile(loss=None): the sectioned step trains on compile()'s loss; "
                             f"give loss= (a loss name, a keras.losses.Loss, or a list/dict for the "
                             f"{len(self.model.outputs)} output(s) {[o.name for o in self.model.outputs]}).")
        if steps_per_execution != 1:
            raise ValueError(f"steps_per_execution={steps_per_execution}: SectionedModel runs one step per call "
                             f"(the engine measures memory between sections in Python); use 1.")
        super().compile(optimizer=optimizer, loss=loss, loss_weights=loss_weights, metrics=metrics,
                        weighted_metrics=weighted_metrics, run_eagerly=run_eagerly, steps_per_execution=1,
                        jit_compile=jit_compile, auto_scale_loss=auto_scale_loss)
        # The wrapped model is compiled alike and shares the optimizer, so a saved .keras file is the user's model
        # compiled as plain Keras would save it (metrics included), optimizer state included, and loads without
        # sectionflow. Its own loss and metric objects stay unused: the wrapper's train, evaluate and predict.
        self._model_compile = dict(optimizer=self.optimizer, loss=loss, loss_weights=loss_weights, metrics=metrics,
                                   weighted_metrics=weighted_metrics, run_eagerly=run_eagerly,
                                   jit_compile=jit_compile, auto_scale_loss=auto_scale_loss)
        self._compile_model()
        self.engine = self._new_engine(self.optimizer)
        self._fit_ready = False

    def fit(self, x=None, y=None, batch_size=None, epochs=1, verbose="auto", callbacks=None, **kwargs):
        callbacks = _with_section_telemetry(callbacks)
        return super().fit(x, y, batch_size=batch_size, epochs=epochs, verbose=verbose, callbacks=callbacks,
                           **kwargs)

    def _compile_model(self) -> None:
        self.model.compile(**self._model_compile)
        self._compile_token = _COMPILED_BY[self.model] = object()

    def save(self, filepath, overwrite=True, zipped=None, **kwargs):
        """Saves the wrapped model (a ``.keras`` file ``keras.models.load_model`` reads without sectionflow), with
        this wrapper's optimizer and compile settings (another wrapper of the same model may have compiled it)."""
        if self.compiled and _COMPILED_BY.get(self.model) is not self._compile_token:
            self._compile_model()
        return self.model.save(filepath, overwrite=overwrite, zipped=zipped, **kwargs)

    def get_config(self):
        # Keras's saving writes the object's own class and walks its own attributes, with no hook to hand it the
        # wrapped model instead: a file of the wrapper would need sectionflow to load and hold the weights under
        # other names than the user's model's file.
        raise NotImplementedError(f"SectionedModel {self.name!r} cannot be serialized itself (keras.saving.save_model, "
                        f"to_json, clone_model): save the model it trains, {self.model.name!r}, with "
                        f"wrapper.save(path) or keras.saving.save_model(wrapper.model, path).")

    def save_weights(self, filepath, overwrite=True, max_shard_size=None):
        return self.model.save_weights(filepath, overwrite=overwrite, max_shard_size=max_shard_size)

    def load_weights(self, filepath, skip_mismatch=False, **kwargs):
        return self.model.load_weights(filepath, skip_mismatch=skip_mismatch, **kwargs)

    def reset_metrics(self):
        super().reset_metrics()
        self._epoch_peak = 0

    # ------------------------------------------------------------------ the training step
    def make_train_function(self, force=False):
        if self.train_function is not None and not force:
            return self.train_function

        def one_step(iterator):
            return self.train_step(next(iterator))

        self.train_function = one_step
        return one_step

    def train_step(self, data):
        """One step of the engine's cycle on a batch ``(x, y[, sample_weight])``; returns the logs."""
        data = _global_batch(data, internals.distribute_strategy(self))
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        if y is None:
            raise ValueError("SectionedModel.fit needs targets: give y (or a dataset of (x, y) pairs).")
        if not self._fit_ready:
            with self.distribute_strategy.scope():
                internals.symbolic_build(self, data)  # compiled loss, metrics and optimizer variables
            self._fit_ready = True
        batch = {**self._inputs(x), "y": y}
        if sample_weight is not None:
            batch["sample_weight"] = sample_weight
        stats = self.engine.train_step(batch)
        self.section_stats = stats
        logs = self.get_metrics_result()
        if stats["step_peak_bytes"] is not None:  # None: not measured (engine.memory_note says why)
            self._epoch_peak = max(self._epoch_peak, stats["step_peak_bytes"])
            logs["step_peak_MiB"] = self._epoch_peak / _MiB
        return logs

    def _network_loss(self, outputs, batch):
        """compile()'s loss on the last section's outputs (run inside its compiled function), and the
        compiled metrics updated from them, as Keras's ``train_step`` does after its forward pass."""
        y, sample_weight = batch["y"], batch.get("sample_weight")
        loss = self.compute_loss(x=None, y=y, y_pred=outputs, sample_weight=sample_weight, training=True)
        size = tf.shape(tf.nest.flatten(outputs)[0])[0]
        internals.loss_tracker(self).update_state(internals.unscale_loss_for_distribution(loss), sample_weight=size)
        self.compute_metrics(None, y, outputs, sample_weight=sample_weight)
        # Keras scales each replica's loss by 1/replicas; the engine scales the loss it differentiates itself.
        return internals.unscale_loss_for_distribution(loss)

    def _inputs(self, x) -> dict:
        names = [t.name for t in self.model.inputs]
        if isinstance(x, dict):
            missing = [n for n in names if n not in x]
            if missing:
                raise ValueError(f"x is a dict without the model's input(s) {missing}; its keys: {sorted(x)}.")
            values = [x[n] for n in names]
        elif isinstance(x, (list, tuple)) and len(names) > 1:
            if len(x) != len(names):
                raise ValueError(f"x has {len(x)} arrays; model {self.model.name!r} has {len(names)} inputs "
                                 f"{names}.")
            values = list(x)
        else:
            values = [x[0] if isinstance(x, (list, tuple)) and len(x) == 1 else x]
        return {"x": values[0], **{f"input:{n}": v for n, v in zip(names[1:], values[1:])}}

    def _new_engine(self, optimizer) -> Engine:
        strategy = internals.distribute_strategy(self)
        return Engine(self.network, optimizer, jit_compile=bool(optimizer is not None and self.jit_compile),
                      distribute=strategy if strategy is not None and strategy.num_replicas_in_sync > 1 else None,
                      penalty=_weight_penalty(self.model),
                      extra_state=lambda: [v for m in self.metrics for v in m.variables],  # the loss updates them
                      plan_store=self.plan_store, **self._engine_args)


class _SectionTelemetry(keras.callbacks.Callback):
    """Writes each epoch's per-section memory and forward runs to a TensorBoard callback's train folder."""

    def __init__(self, board: keras.callbacks.TensorBoard):
        super().__init__()
        self.board = board
        self._peaks: list[int] = []
        self._step_peak = 0

    def on_epoch_begin(self, epoch, logs=None):
        self._peaks, self._step_peak = [], 0

    def on_train_batch_end(self, batch, logs=None):
        stats = getattr(self.model, "section_stats", None)
        if not stats or stats["step_peak_bytes"] is None:  # nothing measured: no memory tags
            return
        peaks = stats["peak_bytes"]  # None: a section whose reading measured nothing
        if len(self._peaks) == len(peaks):
            peaks = [max((p for p in pair if p is not None), default=None) for pair in zip(self._peaks, peaks)]
        self._peaks = peaks
        self._step_peak = max(self._step_peak, stats["step_peak_bytes"])

    def on_epoch_end(self, epoch, logs=None):
        stats = getattr(self.model, "section_stats", None)
        if not stats:
            return
        writer = internals.train_writer(self.board)
        with writer.as_default():
            if stats["step_peak_bytes"] is not None:
                for k, peak in enumerate(self._peaks):
                    if peak is not None:
                        tf.summary.scalar(telemetry.SECTION_PEAK.format(k=k), peak / _MiB, step=epoch)
                tf.summary.scalar(telemetry.STEP_PEAK, self._step_peak / _MiB, step=epoch)
            for k, runs in enumerate(stats.forward_runs):
                tf.summary.scalar(telemetry.FORWARD_RUNS.format(k=k), runs, step=epoch)
        writer.flush()


def _with_section_telemetry(callbacks):
    if callbacks is None or isinstance(callbacks, keras.callbacks.CallbackList):
        return callbacks
    callbacks = list(callbacks)
    boards = [c for c in callbacks if isinstance(c, keras.callbacks.TensorBoard)]
    return callbacks + [_SectionTelemetry(b) for b in boards]


def _global_batch(data, strategy):
    """A batch as one global batch: a distributed dataset's per-replica parts joined in replica order (the
    engine splits it again the same way)."""
    if strategy is None:
        return data

    def join(value):
        if isinstance(value, tf.distribute.DistributedValues):
            return tf.concat(strategy.experimental_local_results(value), axis=0)
        return value

    return tf.nest.map_structure(join, data)


def _field_names(model) -> dict:
    return {t.name: f"input:{t.name}" for t in model.inputs[1:]}


def _weight_penalty(model) -> WeightPenalty | None:
    """The model's weight regularizers as the engine's ``WeightPenalty``: the last section's loss is Keras's whole
    loss (every variable's regularization included), but its backward differentiates only its own variables."""
    regularized = tuple(v for v in model.trainable_variables if getattr(v, "regularizer", None) is not None)
    if not regularized:
        return None
    return WeightPenalty(regularized, lambda variables: tf.add_n([tf.reduce_sum(v.regularizer(v)) for v in variables]))


def _check_model(model) -> None:
    if isinstance(model, SectionedModel):
        raise ValueError(f"SectionedModel: model {model.name!r} is already a SectionedModel; use it as it is, or "
                         f"wrap the model it trains ({model.name!r}.model) with other settings.")
    _checked(model, "SectionedModel")
    active = [layer.name for layer in internals.flatten_layers(model) if getattr(layer, "activity_regularizer", None)]
    if active:
        raise ValueError(f"SectionedModel: layer(s) {active} have an activity_regularizer, a loss made inside a "
                         f"section the last section cannot differentiate; move it into compile()'s loss or "
                         f"use a weight regularizer.")
    adding = _adding_losses(model)
    if adding:
        raise ValueError(f"SectionedModel: layer(s) {adding} of model {model.name!r} call add_loss() in call(), a "
                         f"loss made inside a section the last section cannot differentiate; return the value as one "
                         f"more output of the model and give that output a loss in compile(), or train this model "
                         f"with plain fit.")


def _adding_losses(model) -> list[str]:
    """The model's layers whose ``call`` adds a loss (``add_loss``), found by tracing one training call (traced,
    not run: no state moves). Keras's own layers add none in ``call`` (an ``activity_regularizer`` is checked
    apart), so only models holding other layers are traced."""
    if all(type(layer).__module__.startswith("keras.") for layer in internals.flatten_layers(model)):
        return []
    found = []

    def trace(inputs):
        model(inputs, training=True)
        for layer in model.layers:  # losses: add_loss's, then one per regularized weight
            regularized = sum(getattr(w, "regularizer", None) is not None for w in layer.trainable_weights)
            if len(layer.losses) > regularized:
                found.append(layer.name)
        return tf.constant(0)

    specs = tf.nest.map_structure(lambda t: tf.TensorSpec(t.shape, t.dtype), model.input)  # a dict stays one
    tf.function(trace, autograph=False).get_concrete_function(specs)
    return found
