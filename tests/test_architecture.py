"""The house plan of docs/ARCHITECTURE.md, held against the code: every import (lazy ones inside functions too)
runs down the layers, never up; the plain-Python layer loads no TensorFlow; runner and models use only the engine's
public surface. Read as text (AST), nothing is imported."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Lowest first. A module may import its own layer and the layers before it (in its package), never a later one.
# A folder stands for every module in it.
LAYERS = {
    "sections": [
        ("plain", ["sections/rules.py", "sections/allocator.py", "sections/telemetry.py", "sections/schedule"]),
        ("backend", ["sections/backend"]),
        ("network", ["sections/network"]),
        ("step", ["sections/step"]),
        ("keras fit", ["sections/keras_fit.py"]),
        ("verify", ["sections/verify"]),
        ("facade", ["sections/__init__.py", "sections/tf_compat.py"]),
    ],
    "runner": [
        ("errors", ["runner/errors.py"]),
        ("platform", ["runner/platform"]),
        ("config", ["runner/config"]),
        ("record", ["runner/record"]),
        ("run", ["runner/run"]),
        ("front door", ["runner/__init__.py", "runner/__main__.py", "runner/app.py", "runner/help.py",
                        "runner/job.py", "runner/hydra_callbacks.py", "runner/report.py"]),
    ],
}
#: What of the engine the other packages may import: its public names, its rules, its allocator setting, the names
#: its readings are written under, the TensorFlow internals the runner needs under public names.
PUBLIC_SECTIONS = {"sections", "sections.rules", "sections.allocator", "sections.telemetry", "sections.tf_compat"}
#: The one door to each dependency's internals: only these read ``keras.src``/``tensorflow.python`` or a private
#: attribute of a Keras, keras-hub or TensorFlow object.
DOORS = {"sections/backend/keras_internals.py", "sections/backend/tf_internals.py"}
#: Private names of the standard library the code may read (not Keras's or TensorFlow's), and why.
STDLIB_PRIVATE = {"_exit": "os._exit: a forked job's child leaves without the parent's exit handlers",
                  "_remove": "weakref containers' own callback"}
PRIVATE_MODULES = (("tensorflow", "python"), ("keras", "src"), ("keras_hub", "src"))
#: Layers that must load without TensorFlow (the runner checks config with them before anything heavy loads).
PLAIN = {"plain"}
TF_MODULES = {"tensorflow", "keras"}


def _layer_of() -> dict[str, tuple[str, int, str]]:
    """``{module name: (package, layer index, layer name)}``."""
    out = {}
    for package, layers in LAYERS.items():
        for index, (name, paths) in enumerate(layers):
            for path in _expand(paths):
                out[_module(path)] = (package, index, name)
    return out


def _expand(paths: list[str]) -> list[Path]:
    return [p.relative_to(ROOT) if p.is_absolute() else p for entry in paths
            for p in (sorted((ROOT / entry).rglob("*.py")) if (ROOT / entry).is_dir() else [Path(entry)])]


def _module(path: Path) -> str:
    parts = list(path.with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, source: str | None = None):
    """``(module imported, line, at module level)`` for every import in the file, relative ones resolved."""
    tree = ast.parse(source if source is not None else (ROOT / path).read_text())
    package = _module(path) if path.name == "__init__.py" else _module(path).rsplit(".", 1)[0]
    top = {id(n) for n in tree.body}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno, id(node) in top
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                stem = ".".join(base + ([node.module] if node.module else []))
            else:
                stem = node.module
            for alias in node.names:  # `from . import rules` / `from runner.platform import distribute` name modules
                name = f"{stem}.{alias.name}"
                yield (name if _is_module(name) else stem), node.lineno, id(node) in top


def _upward(path: Path, source: str | None = None) -> list[str]:
    """The imports of ``path`` (its text, or ``source``) that reach a later layer of its own package."""
    layer_of = _layer_of()
    package, mine, my_name = layer_of[_module(path)]
    wrong = []
    for target, line, _ in _imports(path, source):
        if target in layer_of and layer_of[target][0] == package and layer_of[target][1] > mine:
            wrong.append(f"{path}:{line} ({my_name}) imports {target} ({layer_of[target][2]}, a later layer)")
    return wrong


def _is_module(name: str) -> bool:
    path = ROOT.joinpath(*name.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def _files(package: str) -> list[Path]:
    return sorted(p.relative_to(ROOT) for p in (ROOT / package).rglob("*.py"))


@pytest.mark.parametrize("package", list(LAYERS))
def test_every_module_has_a_place_in_the_plan(package):
    placed = {str(p) for _, paths in LAYERS[package] for p in _expand(paths)}
    missing = [str(p) for p in _files(package) if str(p) not in placed]
    gone = [p for p in placed if not (ROOT / p).exists()]
    assert not missing and not gone, (f"docs/ARCHITECTURE.md's plan (tests/test_architecture.py LAYERS) lacks "
                                      f"{missing}; names files that are gone: {gone}")


@pytest.mark.parametrize("package", list(LAYERS))
def test_imports_run_down_the_layers(package):
    wrong = [w for path in _files(package) for w in _upward(path)]
    assert not wrong, "imports against the plan in docs/ARCHITECTURE.md:\n" + "\n".join(wrong)


def test_packages_import_one_way():
    """runner -> models -> sections; runner and models reach the engine only through its public surface."""
    wrong = []
    for package, below in [("sections", set()), ("models", {"sections"}), ("runner", {"sections", "models"})]:
        for path in _files(package):
            for target, line, _ in _imports(path):
                root = target.split(".")[0]
                if root in {"sections", "models", "runner"} - {package} - below:
                    wrong.append(f"{path}:{line} imports {target} ({package} may not import {root})")
                elif root == "sections" and package != "sections" and target not in PUBLIC_SECTIONS:
                    wrong.append(f"{path}:{line} imports {target} (the engine's public names are in `sections`)")
    assert not wrong, "\n".join(wrong)


def test_the_plain_layer_loads_no_tensorflow():
    layer_of, wrong = _layer_of(), []
    for path in _files("sections"):
        if layer_of[_module(path)][2] in PLAIN:
            wrong += [f"{path}:{line} imports {t} at load" for t, line, top in _imports(path)
                      if top and t.split(".")[0] in TF_MODULES]
    assert not wrong, "\n".join(wrong)


def test_the_check_finds_an_upward_import():
    """The checker itself: a lazy relative import of a later layer is resolved and caught; a lower one is not."""
    network = Path("sections/network/network.py")
    assert len(_upward(network, "def f():\n    from ..step.engine import Engine\n    from .. import rules\n")) == 1
    assert _upward(network, "from .. import rules\nfrom ..backend.structure import nbytes\n") == []


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__") and not name.endswith("_")  # `_target_`: Hydra's


def _project_names(paths: list[Path]) -> set[str]:
    """Every name the project defines itself: functions, classes, attributes it assigns, variables, arguments."""
    names = set()
    for path in paths:
        for node in ast.walk(ast.parse((ROOT / path).read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.arg):
                names.add(node.arg)
            elif isinstance(node, ast.alias):
                names.add((node.asname or node.name).split(".")[0])
    return names


def _reaches_inside(path: Path, ours: set[str], source: str | None = None) -> list[str]:
    """Where ``path`` imports a dependency's private module or reads a private attribute the project does not
    define (``x._name``, ``getattr(x, "_name")``): a Keras or TensorFlow internal, outside its door."""
    wrong = []
    for node in ast.walk(ast.parse(source if source is not None else (ROOT / path).read_text())):
        modules = ([a.name for a in node.names] if isinstance(node, ast.Import)
                   else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
        wrong += [f"{path}:{node.lineno} imports {m}" for m in modules if tuple(m.split(".")[:2]) in PRIVATE_MODULES]
        if isinstance(node, ast.Attribute):
            name = node.attr
            if (isinstance(node.value, ast.Name) and (node.value.id, name) in PRIVATE_MODULES + (("tf", "python"),)
                    or _private(name) and name not in ours and name not in STDLIB_PRIVATE):
                wrong.append(f"{path}:{node.lineno} reads {ast.unparse(node)}")
        elif (isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("getattr", "hasattr", "setattr")
              and len(node.args) > 1 and isinstance(node.args[1], ast.Constant)
              and isinstance(node.args[1].value, str) and _private(node.args[1].value)
              and node.args[1].value not in ours):
            wrong.append(f"{path}:{node.lineno} reads {ast.unparse(node)}")
    return wrong


def test_dependency_internals_only_through_their_doors():
    """Keras's and TensorFlow's internals are read in ``DOORS`` only; the rest of the tree (sections/, runner/,
    models/) imports their public names."""
    paths = [p for package in ("sections", "runner", "models") for p in _files(package)]
    ours = _project_names([p for p in paths if str(p) not in DOORS])
    wrong = [w for p in paths if str(p) not in DOORS for w in _reaches_inside(p, ours)]
    assert not wrong, ("a dependency's internals outside sections/backend/keras_internals.py and tf_internals.py "
                       "(docs/ARCHITECTURE.md, Keras internals):\n" + "\n".join(wrong))


def test_the_doors_check_finds_a_private_read():
    here = Path("sections/keras_fit.py")
    ours = {"_mine"}
    source = ("from tensorflow.python.eager import context\nimport keras.src.backend\nx = model._loss_tracker\n"
              "y = getattr(ctx, '_initialized', True)\nz = self._mine + os._exit\nw = cfg._target_\n")
    assert [w.split(" ", 1)[1] for w in _reaches_inside(here, ours, source)] == [
        "imports tensorflow.python.eager", "imports keras.src.backend", "reads model._loss_tracker",
        "reads getattr(ctx, '_initialized', True)"]


@pytest.mark.parametrize("door", sorted(DOORS))
def test_every_touch_point_says_the_releases_it_was_written_for(door):
    """Each public function of a door carries ``@written_for(package, lowest, first unsupported)``."""
    tree = ast.parse((ROOT / door).read_text())
    exempt = {"written_for", "check_versions"}
    bare = [n.name for n in tree.body if isinstance(n, ast.FunctionDef) and not n.name.startswith("_")
            and n.name not in exempt
            and not any(isinstance(d, ast.Call) and getattr(d.func, "id", None) == "written_for"
                        for d in n.decorator_list)]
    assert not bare, f"{door}: touch points without @written_for: {bare}"
