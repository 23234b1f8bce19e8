"""Between the runner and a data source: this worker's share of each batch, data errors as one line, the record.

    batches = train_iterator(data, batch, seed, strategy)   # iter(data.train_batches(...)), sharded per worker
    batch = next_batch(batches)                             # a data failure (corrupt file ...) is a DataError
    for batch in checked(data.eval_batches(n)): ...
    data = conforming(data, target)                         # a DataSource (models.data.source), else one line
    data, changes = resumed_data(cfg, data, rebuild)        # resume=: the data compared with the run's fingerprint
    write_record(out, data, resumed, changes)               # data.json and data_fingerprint.json
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import TYPE_CHECKING

from runner.errors import ConfigError, RunnerError

if TYPE_CHECKING:  # the contract's module loads TensorFlow's data sources: read only where they are built
    from models.data import DataSource

log = logging.getLogger("runner")
_OP_NOISE = re.compile(r"\{\{function_node [^}]*\}\}\s*|\s*\[Op:\w+\]|\s*\[\[\{\{node [^]]*\]\]")
_ASSERTION = re.compile(r"assertion failed: \[(.*)\]\s*$")
_NAME = re.compile(r"\s*name:\s*$")  # what an eager iterator's error ends with
_READING = "data: reading the input failed: "


class DataError(RunnerError):
    """The data could not be read (a corrupt file, an image of another size, a label out of range ...)."""


def conforming(data, target: str):
    """`data`, where it satisfies the data source contract (`models.data.DataSource`); else a one-line error
    naming what it lacks."""
    from models.data import DataSource, missing_members

    if not isinstance(data, DataSource):
        raise ConfigError("data._target_", target, f"built a {type(data).__name__}, which lacks "
                          f"{', '.join(missing_members(data))} of the data source contract (docs/DATA.md; "
                          f"models.data.BaseSource has defaults for the optional ones)")
    return data


def train_iterator(data: DataSource, batch: int, seed: int, strategy=None):
    """The training batches' iterator; under a multi-worker strategy the source is given this worker's `shard`
    (a streamed source loads only those rows; others load every row, and each worker trains on its own)."""
    shard = worker_shard(strategy)
    if shard:
        index, count = shard
        log.info(f"data: this worker trains rows {index * batch // count}..{(index + 1) * batch // count - 1} of "
                 f"each batch of {batch}")
        return iter(data.train_batches(batch, seed, shard=shard))
    return iter(data.train_batches(batch, seed))


def worker_shard(strategy) -> tuple[int, int] | None:
    """(index, count): this process's replicas train rows index*B/count .. (index+1)*B/count of a global batch
    (`sections` gives replica r rows r*n .. (r+1)*n); None on one worker."""
    if strategy is None or getattr(strategy, "cluster_resolver", None) is None:
        return None
    import tensorflow as tf

    ids = strategy.experimental_local_results(strategy.experimental_distribute_values_from_function(
        lambda ctx: tf.constant(ctx.replica_id_in_sync_group)))
    local, total = len(ids), strategy.num_replicas_in_sync
    if local == total:
        return None
    return min(int(i) for i in ids) // local, total // local


def next_batch(iterator, data: DataSource | None = None):
    """`next(iterator)`, with a failure inside the input pipeline reported as one DataError line (naming the file or
    record, which `data` finds where TensorFlow's error does not say it)."""
    import tensorflow as tf

    try:
        return next(iterator)
    except tf.errors.OpError as err:
        line = message(err)
        if line.startswith(_READING) and data is not None:
            log.info("data: reading the input failed without naming a file; looking for it")
            line = data.find_unreadable() or line
        raise DataError(line) from err


def checked(dataset, data: DataSource | None = None):
    """Iterate `dataset`, reporting input-pipeline failures as DataError."""
    iterator = iter(dataset)
    while True:
        try:
            batch = next_batch(iterator, data)
        except StopIteration:
            return
        yield batch


def message(err) -> str:
    """A TensorFlow input-pipeline error as one line: a source's own check verbatim, else TensorFlow's reason."""
    lines = [line for line in (getattr(err, "message", None) or str(err)).splitlines() if line.strip()]
    text = _OP_NOISE.sub("", lines[0] if lines else type(err).__name__).strip()
    own = _ASSERTION.search(text)
    if own:  # TensorFlow escapes the quotes of the message it prints
        return own.group(1).replace("\\'", "'").replace('\\"', '"')
    return f"{_READING}{_NAME.sub('', text)[:300]}"


def record(data: DataSource) -> dict:
    """What the run records about its data (a source's `info`: class names, sizes, rescale ...); {} if none."""
    return dict(data.info or {})


FINGERPRINT = "data_fingerprint.json"


def fingerprint(data: DataSource) -> dict | None:
    """What the data is (files, classes, arrays, shards: `models.data._fingerprint`), where the source says."""
    return data.fingerprint()


def resumed_data(cfg, data: DataSource, rebuild) -> tuple[DataSource, list[str]]:
    """On `resume=`: `data` compared with the run's `data_fingerprint.json`; returns the data to train on and what
    changed. The data is numbered as the run numbered its classes (`rebuild(class_names=...)`, where the source
    takes them). A change is refused in one line naming it, unless `resume_data=changed`: then the run continues
    on the new data."""
    if cfg.get("resume") is None:
        return data, []
    from models.data import compare_fingerprints

    new, old = fingerprint(data), _read_json(Path(str(cfg.resume)) / FINGERPRINT)
    if new is None:
        return data, []
    if old is None:
        log.warning(f"resume: {cfg.resume} holds no {FINGERPRINT} (a run of an earlier runner): the data it "
                    f"continues on cannot be compared with the run's; it is recorded from now on")
        return data, []
    classes = old.get("classes")
    if classes and classes != new.get("classes"):  # the run's numbering, where the source can follow it
        try:
            data = rebuild(class_names=[name for name, _ in sorted(classes.items(), key=lambda item: item[1])])
            new = fingerprint(data)
        except ConfigError:
            pass  # more classes than numbers: the comparison names them
    changes = compare_fingerprints(old, new)
    if not changes:
        return data, []
    said = "; ".join(changes)
    if cfg.get("resume_data", "same") != "changed":
        raise ConfigError("resume", cfg.resume, f"the data changed since that run: {said}; a resume continues on "
                          f"the run's own data: restore it, or give resume_data=changed to continue on this data "
                          f"knowingly (class numbers kept as the run had them)")
    log.warning(f"resume: the data changed since that run: {said}; continuing on it (resume_data=changed)")
    if classes and classes != new.get("classes"):
        numbers = record(data).get("class_names") or []
        log.warning(f"resume: class numbers kept as the run had them: "
                    + ", ".join(f"{i} {name}" for i, name in enumerate(numbers)))
    return data, changes


def write_record(out: Path, data: DataSource, resumed: bool = False, changes=()) -> None:
    """`data.json` (the source's `info`) and `data_fingerprint.json`; on a resume that continues on changed data
    the run's previous ones are kept as `data.<n>.json` and `data_fingerprint.<n>.json`."""
    from runner.platform.files import keep_copy, write_atomic

    out = Path(out)
    files = {"data.json": record(data), FINGERPRINT: fingerprint(data)}
    if resumed and changes:
        n = 1
        while any((out / _numbered(name, n)).exists() for name in files):
            n += 1
        for name in files:
            if (out / name).is_file():
                keep_copy(out / name, out / _numbered(name, n))
        log.info(f"resume: the run's previous data record kept as {_numbered('data.json', n)} and "
                 f"{_numbered(FINGERPRINT, n)}")
    for name, value in files.items():
        if value:
            write_atomic(out / name, json.dumps(value, indent=1))


def _numbered(name: str, n: int) -> str:
    stem, _, suffix = name.rpartition(".")
    return f"{stem}.{n}.{suffix}"


def _read_json(path: Path):
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None
