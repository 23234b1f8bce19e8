"""What a run's data was, so that a resume can tell whether it continues on the same data.

A source's ``fingerprint()`` is a JSON-able dict of some of these keys (each optional):

- ``classes``: ``{class name: number}``;
- ``files``: ``{split: {file name: signature}}`` (the split's members; names relative to the data's folder);
- ``arrays``: ``{array name: {"shape", "dtype", "content"}}``; ``rows``: ``{split: signature of its rows}``;
- ``shards``: ``{split: {path: {"size", "records", "content"}}}`` (records: ``None`` where counting is not cheap);
- anything else (a TFDS version, split expressions): compared as a value.

A file's signature is a hash of its contents when the whole set is small (``SMALL`` bytes), else its size and
modification time. ``compare(old, new)`` says in short phrases what changed.
"""

from __future__ import annotations

import hashlib
import os

import numpy as np

SMALL = 64 << 20  # a set of files up to this many bytes is hashed; a larger one is known by sizes and times
_EXAMPLE = 1  # names shown per kind of change


def file_signatures(paths, names=None) -> dict[str, str]:
    """``{name: signature}`` of files: ``sha:<hash>`` for small sets, else ``<size>:<mtime_ns>``."""
    stats = [os.stat(p) for p in paths]
    names = list(paths) if names is None else list(names)
    if sum(s.st_size for s in stats) <= SMALL:
        return {n: "sha:" + file_hash(p) for n, p in zip(names, paths)}
    return {n: f"{s.st_size}:{s.st_mtime_ns}" for n, s in zip(names, stats)}


def file_hash(path: str) -> str:
    digest = hashlib.blake2b(digest_size=12)
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def array_signature(array, path: str | None = None) -> str:
    """A hash of an array's bytes when it is small, else the size and time of the file it is mapped from."""
    if array.nbytes <= SMALL or path is None:
        digest = hashlib.blake2b(digest_size=12)
        for start in range(0, len(array), 4096):
            digest.update(np.ascontiguousarray(array[start:start + 4096]).tobytes())
        return "sha:" + digest.hexdigest()
    stat = os.stat(path)
    return f"{stat.st_size}:{stat.st_mtime_ns}"


def rows_signature(rows) -> str:
    return f"{len(rows)} rows, " + hashlib.blake2b(np.asarray(rows, np.int64).tobytes(), digest_size=8).hexdigest()


def compare(old: dict, new: dict) -> list[str]:
    """What differs between two fingerprints, as short phrases (empty: the same data)."""
    found, renamed = [], {}
    if "classes" in old or "classes" in new:
        found += _classes(old.get("classes") or {}, new.get("classes") or {}, renamed,
                          old.get("files") or {}, new.get("files") or {})
    if "files" in old or "files" in new:
        found += _files(_renamed(old.get("files") or {}, renamed), new.get("files") or {})
    if "arrays" in old or "arrays" in new:
        found += _arrays(old.get("arrays") or {}, new.get("arrays") or {})
    if old.get("rows") != new.get("rows") and "rows" in old and "rows" in new:
        found.append("the train/test split of the rows differs (" + ", ".join(
            f"{s}: {old['rows'].get(s, '-').split(',')[0]} -> {new['rows'].get(s, '-').split(',')[0]}"
            for s in sorted(set(old["rows"]) | set(new["rows"]))) + ")")
    if "shards" in old or "shards" in new:
        found += _shards(old.get("shards") or {}, new.get("shards") or {})
    for key in sorted((set(old) | set(new)) - {"classes", "files", "arrays", "rows", "shards"}):
        if old.get(key) != new.get(key):
            found.append(f"{key} {_short(old.get(key))} -> {_short(new.get(key))}")
    return found


def _renamed(files: dict, renamed: dict) -> dict:
    """File names with a renamed class folder's new name (its files are then compared as themselves)."""
    if not renamed:
        return files
    def name(n):
        head, sep, tail = n.partition("/")
        return renamed.get(head, head) + sep + tail
    return {split: {name(n): sig for n, sig in names.items()} for split, names in files.items()}


def _classes(old: dict, new: dict, renamed: dict, old_files: dict, new_files: dict) -> list[str]:
    gone = sorted(set(old) - set(new), key=old.get)
    added = sorted(set(new) - set(old), key=new.get)
    by_number = {v: k for k, v in new.items()}
    out = []
    for name in list(gone):
        mine = _members(old_files, name)
        same = [a for a in added if mine and _members(new_files, a) == mine]
        other = same[0] if same else by_number.get(old[name]) if not old_files else None
        if other in added:  # the same files (or, without files, the same number) under another name: renamed
            out.append(f"class {name!r} (number {old[name]}) is now {other!r}")
            renamed[name] = other
            gone.remove(name)
            added.remove(other)
    if gone:
        out.append(f"class(es) {', '.join(map(repr, gone))} gone")
    if added:
        out.append(f"class(es) {', '.join(map(repr, added))} added")
    moved = [f"{n} {old[n]} -> {new[n]}" for n in old if n in new and old[n] != new[n]]
    if moved:
        out.append(f"class numbers changed ({', '.join(moved[:3])})")
    return out


def _members(files: dict, folder: str) -> set:
    """The files of one class folder, by their names inside it and their signatures."""
    prefix = folder + "/"
    return {(n[len(prefix):], sig) for names in files.values() for n, sig in names.items() if n.startswith(prefix)}


def _files(old: dict, new: dict) -> list[str]:
    out = []
    for split in sorted(set(old) | set(new)):
        before, after = old.get(split, {}), new.get(split, {})
        added = sorted(set(after) - set(before))
        removed = sorted(set(before) - set(after))
        changed = sorted(n for n in set(before) & set(after) if _differs(before[n], after[n]))
        parts = [f"{len(names)} file(s) {what} (e.g. {names[0]})"
                 for names, what in ((added, "added"), (removed, "removed"), (changed, "changed")) if names]
        if parts:
            out.append(f"{split} split: " + ", ".join(parts))
    if "test" in old and "train" in new:
        crossed = sorted(set(old["test"]) & set(new["train"]))
        if crossed:
            out.append(f"{len(crossed)} of the run's test files would now be trained on (e.g. {crossed[0]})")
    return out


def _differs(a: str, b: str) -> bool:
    """Two signatures of one file; a hash and a size:time (the set crossed ``SMALL``) compare by size only."""
    if a.startswith("sha:") == b.startswith("sha:"):
        return a != b
    return False


def _arrays(old: dict, new: dict) -> list[str]:
    out = []
    for name in sorted(set(old) | set(new)):
        a, b = old.get(name), new.get(name)
        if a is None or b is None:
            out.append(f"array {name} {'added' if a is None else 'gone'}")
        elif (a["shape"], a["dtype"]) != (b["shape"], b["dtype"]):
            out.append(f"array {name} was {a['shape']} {a['dtype']}, now {b['shape']} {b['dtype']}")
        elif _differs(a["content"], b["content"]):
            out.append(f"array {name}: same shape and dtype, other values")
    return out


def _shards(old: dict, new: dict) -> list[str]:
    out = []
    for split in sorted(set(old) | set(new)):
        before, after = old.get(split, {}), new.get(split, {})
        added, removed = sorted(set(after) - set(before)), sorted(set(before) - set(after))
        if added:
            out.append(f"{split}: {len(added)} shard(s) added (e.g. {added[0]})")
        if removed:
            out.append(f"{split}: {len(removed)} shard(s) gone (e.g. {removed[0]})")
        for path in sorted(set(before) & set(after)):
            a, b = before[path], after[path]
            if a.get("records") != b.get("records") and None not in (a.get("records"), b.get("records")):
                out.append(f"shard {path} held {a['records']} records, now {b['records']}")
            elif a.get("size") != b.get("size"):
                out.append(f"shard {path} was {a['size']} bytes, now {b['size']}")
            elif _differs(a.get("content", ""), b.get("content", "")):
                out.append(f"shard {path} changed (same size)")
    return out


def _short(value) -> str:
    text = str(value)
    return text if len(text) <= 80 else text[:77] + "..."
