"""`--help` for a Keras model (`model=keras_app`, `model=keras_file`, `model=keras_hub`): the cut names `sections=[...]` may use.

The names depend on the model and on the data (a resize layer in front of an application is one), so they are
read from the network the run would build; the answer is cached by config and Keras version, so only the first
`--help` for a model pays for building it (about 10 s for ResNet50V2 on 2 CPU cores), later ones take ~2 s.
"""

from __future__ import annotations

import hashlib
import json
import os
import textwrap
from importlib import metadata
from pathlib import Path

from runner.errors import ConfigError

FALLBACK_SHAPE = (224, 224, 3)
KERAS_BUILDERS = ("models.keras_app.build_keras_app", "models.keras_app.build_keras_file",
                  "models.keras_hub.build_keras_hub")


def wants_help(args: list[str]) -> bool:
    return any(a in ("--help", "-h") for a in args)


def help_args(args: list[str]) -> tuple[list[str], list[str]]:
    """The command line `--help` can show (Hydra composes help as one run: sweep overrides and `-m` would fail),
    and the sweep overrides left out."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser, kept, dropped = OverridesParser.create(), [], []
    for a in args:
        if a in ("-m", "--multirun"):
            continue
        if "=" in a and not a.startswith("-"):
            try:
                if parser.parse_overrides([a])[0].is_sweep_override():
                    dropped.append(a)
                    continue
            except Exception:  # noqa: BLE001 - Hydra's own help reports a malformed override
                pass
        kept.append(a)
    return kept, dropped


def cut_names_section(args: list[str], conf_dir: str, width: int = 100) -> str | None:
    """The `--help` section listing the chosen Keras model's cut names, or None for other models."""
    from hydra import compose, initialize_config_dir

    overrides = [a for a in args if "=" in a and not a.startswith("-") and not a.startswith("hydra")]
    try:
        with initialize_config_dir(config_dir=conf_dir, version_base="1.3", job_name="help"):
            cfg = compose("config", overrides=overrides)
    except Exception:  # noqa: BLE001 - sweep values (a,b) and the like: one model is not chosen, list nothing
        return None
    if cfg.model.get("_target_") == RESNET:
        return resnet_names_section(cfg.model, width)
    if cfg.model.get("_target_") not in KERAS_BUILDERS:
        return None
    note = ""
    try:
        names = cut_names(cfg)
    except Exception as err:  # noqa: BLE001 - whatever stops the build, in one line
        why = f"cannot build the model as configured: {' '.join(str(err).split())}"
        if cfg.model.get("input_shape", "absent") is not None:  # keras_file, or an explicit size
            return f"== Cut names ==\n{why}\n"
        # model=keras_app without model.input_shape on data it cannot take (ResNet50V2 on 28x28 digits): the
        # names are the same at every size the application accepts, so list them at its usual 224x224x3.
        cfg.model.input_shape = list(FALLBACK_SHAPE)
        try:
            names = cut_names(cfg)
        except Exception:  # noqa: BLE001
            return f"== Cut names ==\n{why}\n"
        note = f"({why}; listed for model.input_shape={list(FALLBACK_SHAPE)}, set a size it accepts)\n"
    return format_names(names, width) + note


RESNET = "models.build_resnet"
INTERNAL_GROUPS = ("bench",)  # conf/bench: the benchmark experiments' settings (experiment=bench_*), not for a run


def shown_help(text: str) -> str:
    """Hydra's `--help` text less the internal groups' lines."""
    return "\n".join(line for line in text.split("\n") if not line.startswith(tuple(f"{g}: " for g in INTERNAL_GROUPS)))


def resnet_block_names(model) -> list[str]:
    """The block names `models.build_resnet` gives for `model` (its config), read without building it (no
    TensorFlow for `--help`); tests/test_runner_config.py checks them against the built network."""
    names = ["initial_conv"]
    for i, depth in enumerate(model.get("depths") or ()):
        for j in range(int(depth)):
            names.append(f"scale{i}/block_{j}")
            if model.get("split_blocks"):
                names.append(f"scale{i}/block_{j}/conv2")
    return names + ["final_pool"]


def resnet_names_section(model, width: int = 100) -> str:
    """The `--help` section listing the resnet's boundary names (blocks and their scale groups)."""
    from sections import rules

    try:
        names = list(rules.default_boundaries(resnet_block_names(model)))
    except (TypeError, ValueError) as err:  # depths that are not a list of ints: the run's checks say so
        return f"== Cut names ==\ncannot list them for model.depths={model.get('depths')}: {err}\n"
    wrapped = textwrap.fill(", ".join(names), width, initial_indent="  ", subsequent_indent="  ",
                            break_on_hyphens=False)
    return (f"== Cut names of resnet (sections=[name, ...] starts a section at that block, or at a scale's first "
            f"block) ==\n{len(names)} names (sections=<int> and sections=auto cut among them too; default "
            f"{list(model.get('default_sections') or [])}):\n{wrapped}\n")


def cut_names(cfg) -> dict:
    """{"model", "boundaries", "cut_points", "max_blocks"} of the network `cfg` builds (cached)."""
    from omegaconf import OmegaConf

    key = {"model": OmegaConf.to_container(cfg.model, resolve=True),
           "data": OmegaConf.to_container(cfg.data, resolve=True), "keras": metadata.version("keras"),
           "keras_hub": _version("keras-hub")}
    path = cfg.model.get("path")
    if path and os.path.isfile(path):
        stat = os.stat(path)
        key["file"] = [os.path.abspath(path), stat.st_mtime_ns, stat.st_size]
    digest = hashlib.sha1(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]
    cache = _cache_dir() / f"{digest}.json"
    try:
        names = json.loads(cache.read_text())
    except (OSError, ValueError):
        try:
            names = _build_names(cfg)
        except ConfigError as err:
            if err.key != "model._target_":
                raise  # the data (a missing file, say) may change without the config changing: not cached
            names = {"error": f"{type(err).__name__}: {err}"}  # the model's builder refused this config
        try:
            cache.parent.mkdir(parents=True, exist_ok=True)
            cache.write_text(json.dumps(names))
        except OSError:
            pass  # a read-only home: no cache, same answer
    if "error" in names:
        raise CannotBuild(names["error"])
    return names


class CannotBuild(Exception):
    """The configured model could not be built (the message is the builder's)."""


def format_names(names: dict, width: int = 100) -> str:
    allowed, merged = names["boundaries"], [n for n in names["cut_points"] if n not in names["boundaries"]]
    wrap = lambda items: textwrap.fill(", ".join(items), width, initial_indent="  ", subsequent_indent="  ",
                                       break_on_hyphens=False)
    lines = [f"== Cut names of {names['model']} (sections=[name, ...] ends a section with that layer) ==",
             f"{len(allowed)} allowed (sections=<int> and sections=auto choose among them too):", wrap(allowed)]
    if merged:
        lines += [f"{len(merged)} more cut points, merged into those blocks to keep at most {names['max_blocks']} "
                  f"(model.keep=[name] makes one allowed; a larger model.max_blocks keeps more):", wrap(merged)]
    return "\n".join(lines) + "\n"


def _build_names(cfg) -> dict:
    from runner.platform.quiet import load_tensorflow

    load_tensorflow()
    import keras

    from runner.run.build import instantiate, make_network

    keras.utils.set_random_seed(cfg.train.seed)
    data_cfg = cfg.data.copy()
    if "download" in data_cfg:
        data_cfg.download = False  # --help never downloads (data=mnist): a missing file is one line instead
    data = instantiate(data_cfg, "data")
    net = make_network(cfg, data)
    label = cfg.model.get("name") or Path(str(cfg.model.get("path") or cfg.model.get("preset"))).name
    return {"model": f"{net.model_name} ({label})", "boundaries": list(net.boundaries),
            "cut_points": list(net.cut_points), "max_blocks": cfg.model.get("max_blocks", 64)}


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "sectionflow" / "cut_names"
