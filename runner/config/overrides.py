"""Command-line overrides checked against the schema before Hydra composes, so a typo gets one line."""

from __future__ import annotations

import copy
import dataclasses
import typing
from pathlib import Path
from typing import Any

from runner.config.schema import Config
from runner.errors import ConfigError
from sections.rules import _did_you_mean

_TYPE_WORDS = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}


def check_overrides(args: list[str], conf_dir: str) -> None:
    """Raise ConfigError for an unknown key or group option, or a value of the wrong type for the schema."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    candidates = [a for a in args if ("=" in a or a.startswith("~")) and not a.startswith("-")]
    parser = OverridesParser.create()
    try:
        overrides = parser.parse_overrides(candidates)
    except HydraException:
        for arg in candidates:
            try:
                parser.parse_overrides([arg])
            except HydraException as err:
                key, _, value = arg.partition("=")
                why = " ".join(str(err).strip().splitlines()[0].split())
                raise ConfigError(key, value, f"not valid override syntax: {why}") from None
        return
    if any(a in ("-m", "--multirun") for a in args):
        resume = next((o for o in overrides if o.key_or_group == "resume" and o.value() is not None), None)
        if resume is not None:
            raise ConfigError("resume", _shown(resume), "continues one run in its own folder; it cannot be part "
                              "of a sweep (-m)")
    groups = sorted(p.name for p in Path(conf_dir).iterdir() if p.is_dir() and p.name != "hydra")
    searchpath = any(o.key_or_group == "hydra.searchpath" for o in overrides)
    for o in overrides:
        key = o.key_or_group
        if o.is_delete():
            _check_delete(key)
        if o.is_add() or o.is_force_add() or o.is_delete() or o.package is not None or "/" in key:
            continue
        if key in groups and not searchpath:
            _check_option(Path(conf_dir) / key, o)
        if key.split(".")[0] in ("hydra", *groups) and not _schema_node(key):
            continue
        _check_key(key, o, groups)
    _check_group_keys(overrides, conf_dir)
    _check_composes(overrides, conf_dir)


def _check_composes(overrides, conf_dir: str) -> None:
    """Whatever else Hydra or OmegaConf would refuse while composing, as one line (not a multi-line message)."""
    if not overrides or any(o.is_sweep_override() for o in overrides):
        return  # sweep values are checked one by one above; each job is checked again when it runs
    lines = [o.input_line for o in overrides if o.input_line
             and (not o.key_or_group.startswith("hydra") or o.key_or_group == "hydra.searchpath")]  # own conf dirs
    from hydra import compose, initialize_config_dir

    try:
        with initialize_config_dir(config_dir=conf_dir, version_base="1.3", job_name="check"):
            compose("config", overrides=lines)
    except Exception as err:  # noqa: BLE001 - any composition failure becomes one line
        cause = err.__cause__ or err
        key = getattr(cause, "full_key", None) or getattr(cause, "key", None)
        shown = next((o.input_line.split("=", 1)[1] for o in overrides
                      if key and o.input_line and o.key_or_group.lstrip("+~") == key), getattr(cause, "value", ""))
        why = getattr(cause, "msg", None) or str(cause)
        why = " ".join(why.strip().splitlines()[0].split())
        raise ConfigError(str(key) if key else "overrides", shown if key else " ".join(lines), why) from err


_FREE_GROUPS = ("model", "data", "optimizer")


def _check_delete(key: str) -> None:
    """`~key` of a key the schema requires (`~batch`, `~train.seed`, `~model`) would fail later, in many lines."""
    head = key.split(".")[0]
    if head in _FREE_GROUPS and "." in key:
        return  # a builder argument: its default applies
    hints = typing.get_type_hints(Config)
    if head in hints and ("." in key or not dataclasses.is_dataclass(hints[head])):
        raise ConfigError(f"~{key}", ConfigError.NO_VALUE, "cannot be deleted: the runner needs it; set it instead "
                          f"({key}=<value>)")


def _check_group_keys(overrides, conf_dir: str) -> None:
    """`model.x=...`, `data.x=...`, `optimizer.x=...` must name a key the chosen option has."""
    wanted = [o for o in overrides if o.key_or_group.split(".")[0] in _FREE_GROUPS and "." in o.key_or_group
              and not (o.is_add() or o.is_force_add() or o.is_delete())]
    if not wanted:
        return
    choices = [o.input_line for o in overrides
               if ("." not in o.key_or_group and not o.is_sweep_override() and o.input_line
                   and (Path(conf_dir) / o.key_or_group.split("/")[0]).is_dir())
               or o.key_or_group == "hydra.searchpath"]
    # A node given whole (`model.args={num_layers: 2}`) is what other keys under it are checked against.
    whole = [o for o in wanted if not o.is_sweep_override() and isinstance(o.value(), dict)]
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf import OmegaConf

    try:
        with initialize_config_dir(config_dir=conf_dir, version_base="1.3", job_name="check"):
            cfg = compose("config", overrides=choices)
            given = cfg
            if whole:
                try:
                    given = compose("config", overrides=choices + [o.input_line for o in whole])
                except HydraException:  # a whole node under a wrong key: checked below against the defaults
                    pass
    except HydraException:
        return  # a bad group choice; Hydra or the checks above report it
    for o in wanted:
        group, *path = o.key_or_group.split(".")
        node = (cfg if o in whole else given)[group]
        for depth, part in enumerate(path):
            if not OmegaConf.is_dict(node) or part not in node:
                where = ".".join([group, *path[:depth]])
                has = ", ".join(str(k) for k in node) if OmegaConf.is_dict(node) else "no keys"
                hint = f" (+{o.key_or_group}=... adds a new key)" if group != "optimizer" else ""
                near = _did_you_mean(part, [str(k) for k in node]) if OmegaConf.is_dict(node) else ""
                raise ConfigError(o.key_or_group, _shown(o), f"unknown key{near}; {where} has: {has}{hint}")
            if depth == len(path) - 1:
                _check_typed(node, part, o)
            node = node[part]


_TYPE_WORDS = {float: "a number", int: "an integer", bool: "true or false"}


def _check_typed(parent, leaf: str, override) -> None:
    """A value of the wrong type for a typed field of a group (e.g. `optimizer.learning_rate=abc`): the value set on
    a copy of the field, whose type OmegaConf checks."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    words = _TYPE_WORDS.get(OmegaConf.get_type(parent, leaf))
    if words is None:
        return
    for value in _values(override):
        probe = copy.deepcopy(parent)
        try:
            probe[leaf] = value
        except OmegaConfBaseException:
            raise ConfigError(override.key_or_group, value, f"must be {words}") from None


def _check_option(group: Path, override) -> None:
    options = sorted(p.stem for p in group.glob("*.yaml"))
    for value in _values(override):
        if value is not None and value not in options:
            raise ConfigError(group.name, value, f"unknown option{_did_you_mean(str(value), options)}; "
                              f"allowed: {', '.join(options)}")


def _schema_node(key: str) -> bool:
    """Whether `key` lies under a node the schema types field by field (engine, train, the top level)."""
    head = key.split(".")[0]
    hints = typing.get_type_hints(Config)
    return head in hints and dataclasses.is_dataclass(hints[head])


def _check_key(key: str, override, groups: list[str]) -> None:
    node, parts = Config, key.split(".")
    for depth, part in enumerate(parts):
        hints = typing.get_type_hints(node)
        if part not in hints:
            names = list(hints) + ([g for g in groups if g not in hints] if depth == 0 else [])
            where = ".".join(parts[:depth]) or "the top level"
            raise ConfigError(key, _shown(override), f"unknown key{_did_you_mean(part, names)}; {where} has: "
                              f"{', '.join(names)} "
                              f"(+{key}=... adds a new key)")
        node = hints[part]
        if not dataclasses.is_dataclass(node):
            if depth == len(parts) - 1:
                for value in _values(override):
                    if not _fits(value, node):
                        raise ConfigError(key, value, f"must be {_describe(node)}")
            return


def _values(override) -> list:
    if not override.is_sweep_override():
        return [override.value()]
    sweep = override.value()
    return list(getattr(sweep, "list", []))


def _shown(override) -> Any:
    return override.input_line.split("=", 1)[1] if override.input_line else override.value()


def _fits(value, tp) -> bool:
    if tp is Any:
        return True
    args = typing.get_args(tp)
    if typing.get_origin(tp) is typing.Union:
        return any(_fits(value, a) for a in args)
    if tp is type(None):
        return value is None
    if isinstance(value, str) and tp in (int, float, bool):
        return _parses(value, tp)
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is str:
        return isinstance(value, (str, int, float, bool))
    return True


def _parses(text: str, tp) -> bool:
    if tp is bool:
        return text.lower() in ("true", "false", "yes", "no", "on", "off", "1", "0")
    try:
        tp(text)
        return True
    except ValueError:
        return False


def _describe(tp) -> str:
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if typing.get_origin(tp) is typing.Union and len(args) == 1:
        return f"{_TYPE_WORDS.get(args[0], args[0])} or null"
    return _TYPE_WORDS.get(tp, str(tp))
