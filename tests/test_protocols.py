"""The declared contracts, held against the code: every data source satisfies `models.data.DataSource` and every
trainer `sections.telemetry.TrainerProtocol` (members and method signatures), the runner reads them through those
members and never probes them (`getattr`, `hasattr`, `inspect.signature`), and no data source class holds more than
20 attributes counting its bases (the pipeline is composed of a reader and a decoder, not a chain of subclasses)."""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
MOST_ATTRIBUTES = 20


# ------------------------------------------------------------------------------------------- read as text (AST)
def _classes(folder: Path) -> dict[str, ast.ClassDef]:
    return {node.name: node for path in sorted(folder.glob("*.py")) for node in ast.parse(path.read_text()).body
            if isinstance(node, ast.ClassDef)}


def _own_attributes(node: ast.ClassDef) -> set[str]:
    """``self.<name> = ...`` anywhere in the class, and a dataclass's fields (annotated names in its body)."""
    names = set()
    dataclass = any("dataclass" in ast.unparse(d) for d in node.decorator_list)
    if dataclass:
        names |= {n.target.id for n in node.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
    for n in ast.walk(node):
        targets = n.targets if isinstance(n, ast.Assign) else [n.target] if isinstance(n, (ast.AnnAssign,
                                                                                            ast.AugAssign)) else []
        for target in targets:
            names |= {e.attr for e in ast.walk(target) if isinstance(e, ast.Attribute)
                      and isinstance(e.value, ast.Name) and e.value.id == "self"}
        if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "setattr" and n.args \
                and getattr(n.args[0], "id", None) == "self":
            names.add(f"setattr({ast.unparse(n.args[1])})")  # a name the AST cannot read: counted once per call
    return names


def attributes(name: str, classes: dict[str, ast.ClassDef]) -> set[str]:
    """A class's instance attributes counting its bases (those defined in the same package)."""
    node = classes[name]
    found = _own_attributes(node)
    for base in node.bases:
        if isinstance(base, ast.Name) and base.id in classes:
            found |= attributes(base.id, classes)
    return found


def test_no_data_source_class_holds_over_20_attributes_counting_its_bases():
    classes = _classes(ROOT / "models" / "data")
    counts = {name: len(attributes(name, classes)) for name in classes}
    over = {name: n for name, n in counts.items() if n > MOST_ATTRIBUTES}
    assert not over, f"models/data classes over {MOST_ATTRIBUTES} attributes with their bases: {over}"
    assert counts["ImagePipeline"] >= 5, counts  # the count reads the code (not a class that went missing)


def test_the_attribute_count_reads_bases_and_dataclass_fields():
    classes = {n.name: n for n in ast.parse(
        "from dataclasses import dataclass\n"
        "class A:\n    def __init__(self):\n        self.a, self.b = 1, 2\n"
        "class B(A):\n    def f(self):\n        self.c = 3\n        self.a += 1\n"
        "@dataclass\nclass C(B):\n    d: int\n    e: int = 0\n").body if isinstance(n, ast.ClassDef)}
    assert attributes("C", classes) == {"a", "b", "c", "d", "e"}


PROBES = {"getattr", "hasattr"}
PROBED = re.compile(r"(^|\.)(engine|trainer|data|source)$")


def test_the_runner_reads_trainers_and_sources_without_probing_them():
    """No `getattr`/`hasattr` of an engine or a data source, no `inspect.signature` of a source's methods: the
    runner reads the members `TrainerProtocol` and `DataSource` declare."""
    found = []
    for path in sorted((ROOT / "runner").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call) or not node.args:
                continue
            callee = ast.unparse(node.func)
            subject = ast.unparse(node.args[0])
            inner = node.args[0].args[0] if isinstance(node.args[0], ast.Call) and node.args[0].args else None
            if callee in PROBES and (PROBED.search(subject) or
                                     (inner is not None and PROBED.search(ast.unparse(inner)))):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
            elif callee == "inspect.signature" and re.search(r"^(?!cfg\.)(\w+\.)*data\.", subject):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    assert not found, "the runner probes a trainer or a data source:\n" + "\n".join(found)


def test_the_planner_s_records_satisfy_what_the_runner_reads():
    """`Plan` (the planner's) and `Floor` (the calibrator's) hold every field `PlanReport` and `FloorReport`
    declare, read as text: the runner reads them off `engine.plan` and `engine.memory_floor`."""
    from sections.telemetry import FloorReport, PlanReport

    for protocol, path, name in [(PlanReport, "sections/schedule/planner.py", "Plan"),
                                 (FloorReport, "sections/step/calibrate.py", "Floor")]:
        node = _classes(ROOT / Path(path).parent)[name]
        held = {n.target.id for n in node.body if isinstance(n, ast.AnnAssign)} | {
            n.name for n in node.body if isinstance(n, ast.FunctionDef)}
        declared = set(_members(protocol))
        assert declared <= held, f"{name} lacks {declared - held} of {protocol.__name__}"


# ------------------------------------------------------------------------------------------------ live objects
def _members(protocol) -> list[str]:
    names = [n for n in protocol.__annotations__]
    names += [n for n, v in vars(protocol).items() if not n.startswith("_") and (callable(v) or
                                                                                 isinstance(v, property))]
    return list(dict.fromkeys(names))


def _signature_mismatches(obj, protocol) -> list[str]:
    """Each method the protocol declares: the object's takes the protocol's parameters, by name, in order, with a
    default wherever the protocol has one; any further parameter has a default."""
    wrong = []
    for name, declared in vars(protocol).items():
        if name.startswith("_") or not inspect.isfunction(declared):
            continue
        want = list(inspect.signature(declared).parameters.values())[1:]  # less self
        have = list(inspect.signature(getattr(obj, name)).parameters.values())
        names = [p.name for p in have[:len(want)]]
        if names != [p.name for p in want]:
            wrong.append(f"{name}{inspect.signature(getattr(obj, name))}: takes {names}, declared "
                         f"{[p.name for p in want]}")
            continue
        missing_default = [p.name for p, q in zip(have, want)
                           if q.default is not inspect.Parameter.empty and p.default is inspect.Parameter.empty]
        extra = [p.name for p in have[len(want):] if p.default is inspect.Parameter.empty
                 and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        if missing_default or extra:
            wrong.append(f"{name}: {missing_default + extra} need a default")
    return wrong


def _sources(tmp_path: Path) -> dict:
    """One instance of every bundled source (mnist, which downloads, is an ImageSource as digits is), and
    docs/examples' stripes."""
    import sys

    import tensorflow as tf

    from models import data
    from models.data.text import TextSource

    folder = tmp_path / "folder"
    for k, name in enumerate(("a", "b")):
        (folder / name).mkdir(parents=True)
        for i in range(3):
            tf.io.write_file(str(folder / name / f"{i}.png"), tf.io.encode_png(np.full((4, 4, 3), 40 * k + i,
                                                                                       np.uint8)))
    np.savez(tmp_path / "a.npz", x=np.zeros((10, 4, 4), np.uint8), y=np.arange(10) % 2)
    np.save(tmp_path / "tokens.npy", np.arange(40).reshape(10, 4) % 7)
    with tf.io.TFRecordWriter(str(tmp_path / "s.tfrecord")) as writer:
        for i in range(4):
            feature = {"image": tf.train.Feature(bytes_list=tf.train.BytesList(value=[tf.io.encode_png(
                np.full((4, 4, 3), i, np.uint8)).numpy()])),
                "label": tf.train.Feature(int64_list=tf.train.Int64List(value=[i % 2]))}
            writer.write(tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString())
    sys.path.insert(0, str(ROOT / "docs" / "examples"))
    try:
        from stripes import stripes
    finally:
        sys.path.remove(str(ROOT / "docs" / "examples"))
    shards = str(tmp_path / "s.tfrecord")
    import tensorflow_datasets as tfds

    tfds.dataset_builders.store_as_tfds_dataset(
        name="tiny_protocol", version="1.0.0", data_dir=str(tmp_path / "tfds"),
        features=tfds.features.FeaturesDict({"image": tfds.features.Image(shape=(4, 4, 3)),
                                             "label": tfds.features.ClassLabel(names=["a", "b"])}),
        split_datasets={split: tf.data.Dataset.from_tensor_slices({"image": np.zeros((4, 4, 4, 3), np.uint8),
                                                                   "label": np.arange(4) % 2})
                        for split in ("train", "test")})
    return {"tfds": data.tfds("tiny_protocol", data_dir=str(tmp_path / "tfds")),"digits": data.digits(), "synthetic": data.synthetic(train_size=8, test_size=4),
            "sequences": data.sequences(), "text": TextSource("text", "abcdefgh" * 40, seq_len=8),
            "tokens": data.tokens(str(tmp_path / "tokens.npy"), test_fraction=0.2),
            "image_folder": data.image_folder(str(folder), validation_split=0.5),
            "arrays": data.arrays(str(tmp_path / "a.npz")),
            "tfrecord": data.tfrecord(shards, shards, num_classes=2),
            "stripes": stripes()}


def test_every_data_source_satisfies_the_protocol(tmp_path):
    from models.data import DataSource, Decoder, ImagePipeline, Reader, missing_members

    for name, source in _sources(tmp_path).items():
        assert isinstance(source, DataSource), f"{name} lacks {missing_members(source)}"
        assert not _signature_mismatches(source, DataSource), (name, _signature_mismatches(source, DataSource))
        if isinstance(source, ImagePipeline):  # composed: its parts satisfy theirs
            assert isinstance(source.reader, Reader) and isinstance(source.decoder, Decoder), name
            assert not _signature_mismatches(source.reader, Reader) + _signature_mismatches(source.decoder, Decoder)
        assert source.metric_direction in ("maximize", "minimize") and isinstance(source.model_args, dict), name
        batch = next(iter(source.train_batches(2, 0, shard=None)))
        assert isinstance(batch, dict), name


def test_every_class_with_train_batches_takes_the_declared_arguments():
    """Read as text: a class of models/data (or docs/examples) defining `train_batches` takes `(batch_size, seed,
    shard)`, so a new source is held to the contract before any instance is made."""
    wrong = []
    for folder in (ROOT / "models" / "data", ROOT / "docs" / "examples"):
        for name, node in _classes(folder).items():
            for fn in (n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == "train_batches"):
                args = [a.arg for a in fn.args.args]
                if args[:4] != ["self", "batch_size", "seed", "shard"]:
                    wrong.append(f"{folder.name}/{name}.train_batches{tuple(args)}")
    assert not wrong, wrong


def test_the_runner_refuses_a_source_that_lacks_a_member_in_one_line():
    from runner.errors import ConfigError
    from runner.run.datafeed import conforming

    class Bare:
        name, model_args = "bare", {}

        def train_batches(self, batch_size, seed=0, shard=None): ...

        def eval_batches(self, batch_size): ...

    with pytest.raises(ConfigError) as err:
        conforming(Bare(), "mine.bare")
    assert "lacks metric, metric_direction, info, train_size, fingerprint, describe, find_unreadable" in str(err.value)

    from models.data import BaseSource

    class Based(Bare, BaseSource):
        pass

    source = Based()
    assert conforming(source, "mine.based") is source


def _network():
    import keras
    import tensorflow as tf

    from sections import Network

    layers = [keras.layers.Dense(8, activation="relu"), keras.layers.Dense(8, activation="relu"),
              keras.layers.Dense(3)]
    loss = lambda out, b: tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(b["y"], out,  # noqa: E731
                                                                                     from_logits=True))
    return Network(blocks=[(f"b{k}", layer) for k, layer in enumerate(layers)], loss=loss, inputs="x",
                   loss_fields=("y",))


def _batch(n: int = 8) -> dict:
    import tensorflow as tf

    rng = np.random.default_rng(0)
    return {"x": tf.constant(rng.normal(size=(n, 5)).astype("float32")),
            "y": tf.constant(rng.integers(0, 3, size=n).astype("int64"))}


TRAINERS = ["Engine", "WholeGraph", "RecomputeGrad", "MicroBatched"]


@pytest.mark.parametrize("kind", TRAINERS)
def test_every_trainer_satisfies_the_protocol(kind):
    """Each trainer the runner can build (after a step: the members read after training are there too), and what
    it reports: a `StepReading`, and no plan without the planner."""
    import keras

    import sections
    from sections.telemetry import StepReading, TrainerProtocol

    def make(cls=kind, **kw):
        return getattr(sections, cls)(_network(), keras.optimizers.SGD(0.1), sections=2, **kw)

    trainer = sections.MicroBatched(make("Engine"), 4) if kind == "MicroBatched" else make()
    assert isinstance(trainer, TrainerProtocol)  # before build, too
    assert isinstance(trainer.train_step(_batch()), StepReading)
    assert isinstance(trainer, TrainerProtocol), [m for m in _members(TrainerProtocol) if not hasattr(trainer, m)]
    assert not _signature_mismatches(trainer, TrainerProtocol), _signature_mismatches(trainer, TrainerProtocol)
    assert trainer.plan is None and trainer.memory_floor is None and trainer.planning_seconds is None
    assert len(trainer.sections) == 2 and isinstance(trainer.describe(), str)
    assert (trainer.flops() is None) == (kind in ("WholeGraph", "RecomputeGrad"))
    assert (trainer.lean is None) == (kind in ("WholeGraph", "RecomputeGrad"))


def test_a_csv_of_image_paths_is_one_reader_of_about_fifty_lines(tmp_path):
    """docs/DATA.md's example, as docs/examples/csv_images.py runs it: a reader and a factory, and the bundled
    pipeline gives the batches, the fingerprint and the header line."""
    import tensorflow as tf

    from docs.examples import csv_images
    from models.data import DataSource

    example = (ROOT / "docs" / "examples" / "csv_images.py").read_text()
    shown = (ROOT / "docs" / "DATA.md").read_text().split("class CSVReader:", 1)[1].split("```", 1)[0]
    assert "class CSVReader:" + shown in example, "docs/DATA.md's reader differs from docs/examples/csv_images.py"
    reader = _classes(ROOT / "docs" / "examples")["CSVReader"]
    assert reader.end_lineno - reader.lineno + 1 <= 55
    rows = []
    for i in range(6):
        tf.io.write_file(str(tmp_path / f"{i}.png"), tf.io.encode_png(np.full((5, 7, 3), 40 * i, np.uint8)))
        rows.append(f"{i}.png,{i % 3}")
    (tmp_path / "list.csv").write_text("\n".join(rows) + "\n")
    source = csv_images.csv_images(str(tmp_path / "list.csv"), image_size=(4, 4), test_fraction=0.34)
    assert isinstance(source, DataSource) and not _signature_mismatches(source, DataSource)
    assert (source.train_size, source.test_size, source.model_args) == (4, 2, {"num_classes": 3,
                                                                               "input_shape": (4, 4, 3)})
    batch = next(iter(source.train_batches(3, 0)))
    assert batch["image"].shape == (3, 4, 4, 3) and sorted(batch["label"].numpy()) != []
    assert [int(y) for b in source.eval_batches(5) for y in b["label"]] == [0, 1]
    assert set(source.fingerprint()["files"]["train"]) == {str(tmp_path / f"{i}.png") for i in range(2, 6)}
    assert source.describe().startswith("csv_images: 4 train / 2 test, images [4, 4, 3], 3 classes")


def test_a_planned_engine_reports_its_plan_and_floor_as_declared():
    """`sections="auto"` (about 4 s on CPU): the plan, the floor and the planning time the runner reads."""
    import keras

    import sections
    from sections.telemetry import FloorReport, PlanReport, TrainerProtocol

    engine = sections.Engine(_network(), keras.optimizers.SGD(0.1), sections="auto", memory_budget="64MiB")
    engine.train_step(_batch())
    assert isinstance(engine, TrainerProtocol) and isinstance(engine.plan, PlanReport)
    assert isinstance(engine.memory_floor, FloorReport) and engine.planning_seconds > 0
    assert engine.memory_budget == 64 * 2**20 and engine.budget_source
