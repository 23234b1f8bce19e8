"""The planner on a keras-hub encoder (issue 38, item 3): a 4-layer, 128-wide ``BertBackbone`` (2 heads,
intermediate 512, vocabulary 512, dropout 0.1, random init) with a 2-class head on its pooled output, batch 2.

    python docs/bench/transformer/encoder_auto.py plain 2048            # plain fit's step peaks
    python docs/bench/transformer/encoder_auto.py auto 2048 BYTES       # SectionedModel(sections="auto"),
                                                                        # memory_budget=BYTES: plan, prediction,
                                                                        # step peaks, spreads
Prints one ``RESULT {json}`` line. Peaks: plain's from the CPU allocator (reset per step), auto's from its engine.
"""
import json, os, sys, time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))
from sections import allocator
allocator.configure()
import numpy as np, keras, keras_hub, tensorflow as tf
import sections

mode, seq, batch = sys.argv[1], int(sys.argv[2]), 2
keras.utils.set_random_seed(0)
bb = keras_hub.models.BertBackbone(vocabulary_size=512, num_layers=4, num_heads=2, hidden_dim=128,
                                   intermediate_dim=512, max_sequence_length=seq, dropout=0.1)
out = keras.layers.Dense(2, name="head")(bb.output["pooled_output"])
inputs = [bb.input["token_ids"], bb.input["segment_ids"], bb.input["padding_mask"]]
model = keras.Model(inputs, out)
rng = np.random.default_rng(0)
n = batch * 6
x = [rng.integers(0, 512, (n, seq)).astype("int32"), np.zeros((n, seq), "int32"), np.ones((n, seq), "int32")]
y = rng.integers(0, 2, (n,)).astype("int32")
res = {"mode": mode, "seq": seq}
if mode == "plain":
    peaks = []
    class P(keras.callbacks.Callback):
        def on_train_batch_begin(self, s, logs=None): tf.config.experimental.reset_memory_stats("CPU:0")
        def on_train_batch_end(self, s, logs=None): peaks.append(tf.config.experimental.get_memory_info("CPU:0")["peak"])
    model.compile(keras.optimizers.Adam(1e-4), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x, y, batch_size=batch, verbose=0, callbacks=[P()])
    res["peaks"] = peaks
else:
    wrapped = sections.SectionedModel(model, sections="auto", memory_budget=int(float(sys.argv[3])))
    wrapped.compile(keras.optimizers.Adam(1e-4), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    peaks = []
    class S(keras.callbacks.Callback):
        def on_train_batch_end(self, s, logs=None): peaks.append(wrapped.section_stats["step_peak_bytes"])
    t = time.time()
    try:
        wrapped.fit(x, y, batch_size=batch, verbose=0, callbacks=[S()])
        e = wrapped.engine
        res.update(peaks=peaks, predicted=e.plan.predicted_peak, sections=len(e.sections), replans=e.replans,
                   probe_spread=e.calibrator.section_probe.largest_spread(), dry_spread=e.calibrator.dry_spread,
                   budget=e.memory_budget, spreads=sorted(e.calibrator.section_probe.spread.values())[-5:])
    except Exception as err:
        res["error"] = f"{type(err).__name__}: {err}"
    res["wall"] = time.time() - t
print("RESULT " + json.dumps(res))
