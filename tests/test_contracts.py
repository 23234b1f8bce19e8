"""docs/CONTRACTS.md against the code, read as text (no TensorFlow): every argument it shows a public constructor
taking is one the code takes, every argument the code takes is shown, every method it calls exists, and the policy
names it lists are the registry's."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOC = (ROOT / "docs" / "CONTRACTS.md").read_text()
CODE = "\n".join(re.findall(r"```python\n(.*?)```", DOC, re.S))


def _exports() -> dict[str, Path]:
    """``sections``' public names and the files defining them, from its ``_EXPORTS`` table."""
    tree = ast.parse((ROOT / "sections" / "__init__.py").read_text())
    table = next(ast.literal_eval(n.value) for n in tree.body
                 if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == "_EXPORTS")
    return {name: ROOT / "sections" / (mod.lstrip(".").replace(".", "/") + ".py") for name, mod in table.items()}


def _definition(name: str, path: Path | None = None):
    """The class or function ``name`` where it is defined, following ``from .module import name``."""
    path = path or _exports()[name]
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, (ast.ClassDef, ast.FunctionDef)) and node.name == name:
            return node, path
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.level and any(a.name == name for a in node.names):
            base = path.parents[node.level - 1]
            return _definition(name, base.joinpath(*node.module.split(".")).with_suffix(".py"))
    raise AssertionError(f"{name} is not defined in {path}")


def _parameters(name: str) -> list[str]:
    node, _ = _definition(name)
    if isinstance(node, ast.ClassDef):
        init = next((n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"), None)
        if init is None:  # a dataclass: its annotated fields
            return [n.target.id for n in node.body if isinstance(n, ast.AnnAssign)]
        node = init
    args = node.args
    return [a.arg for a in args.posonlyargs + args.args + args.kwonlyargs if a.arg not in ("self", "cls")]


def _statements() -> list[ast.AST]:
    """The page's code, one statement at a time: comments and ``-> result`` annotations dropped (the page is
    Python with annotations, not a script)."""
    out, chunk = [], ""
    for line in CODE.splitlines():
        chunk += re.sub(r"\s+#.*$|^\s*#.*$", "", line) + "\n"
        if sum(map(chunk.count, "([{")) > sum(map(chunk.count, ")]}")):
            continue
        text = re.sub(r"\)\s*->.*$", ")", chunk.strip(), flags=re.S)
        chunk = ""
        if text:
            out.append(ast.parse(text))  # a line that is not Python fails here: the page must stay readable as code
    return out


def _documented_calls(name: str) -> list[list[str]]:
    """The keyword names of each documented call ``name(...)``."""
    calls = []
    for node in (n for tree in _statements() for n in ast.walk(tree)):
        if isinstance(node, ast.Call):
            callee = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
            if callee == name:
                calls.append([k.arg for k in node.keywords])
    return calls


@pytest.mark.parametrize("name", ["Engine", "SectionedModel", "Network", "from_keras", "compare_with_whole"])
def test_documented_arguments_are_the_code_s(name):
    calls = _documented_calls(name)
    assert calls, f"docs/CONTRACTS.md shows no call of {name}"
    params = _parameters(name)
    for keywords in calls:
        unknown = [k for k in keywords if k not in params]
        assert not unknown, f"docs/CONTRACTS.md gives {name} {unknown}, which it does not take (it takes {params})"


@pytest.mark.parametrize("name", ["Engine", "SectionedModel"])
def test_every_argument_is_documented(name):
    shown = {k for keywords in _documented_calls(name) for k in keywords}
    positional = {"Engine": {"network"}, "SectionedModel": {"model"}}[name]
    missing = [p for p in _parameters(name) if p not in shown | positional]
    assert not missing, f"docs/CONTRACTS.md does not show {name}'s arguments {missing}"


def test_documented_engine_methods_exist():
    methods = set()
    for cls, path in [("Trainer", ROOT / "sections" / "step" / "base.py"), ("Engine", None)]:
        node, _ = _definition(cls, path) if path else _definition(cls)
        methods |= {n.name for n in node.body if isinstance(n, ast.FunctionDef)}
    called = set(re.findall(r"^engine\.(\w+)\(", CODE, re.M))
    assert called and not called - methods, f"docs/CONTRACTS.md calls engine methods that do not exist: " \
                                            f"{called - methods}"


def test_documented_stats_keys_are_reported():
    node, _ = _definition("StepReading", ROOT / "sections" / "telemetry.py")
    reported = {n.target.id for n in node.body if isinstance(n, ast.AnnAssign)}
    shown = set(re.findall(r'stats\["(\w+)"\]', CODE))
    assert shown and not shown - reported, f"docs/CONTRACTS.md shows stats keys no step reports: {shown - reported}"


def test_documented_policies_are_the_registry_s():
    from sections import rules

    line = next(ln for ln in CODE.splitlines() if ln.strip().startswith("policy="))
    assert re.findall(r'"(\w+)"', line.split("#", 1)[1]) == list(rules.POLICIES)


def test_config_reference_defaults_are_the_yaml_s():
    """docs/CONFIG.md's config reference shows each default the YAML holds (the YAML is the one source)."""
    from omegaconf import OmegaConf

    conf = ROOT / "conf"
    def load(path):
        return OmegaConf.to_container(OmegaConf.load(conf / path))

    yaml = {**load("config.yaml"), **{f"engine.{k}": v for k, v in load("engine/default.yaml").items()},
            **{f"train.{k}": v for k, v in load("train/default.yaml").items()}}
    reference = (ROOT / "docs" / "CONFIG.md").read_text()
    rows = re.findall(r"^\| `([\w.]+)` \| [^|]*(?:\\\|[^|]*)* \| ([^|]+) \|", reference, re.M)
    shown = {key: cell.strip().strip("`") for key, cell in rows if key in yaml}
    assert len(shown) >= 15, f"docs/CONFIG.md's config table was not found (read {sorted(shown)})"
    words = {"null": None, "true": True, "false": False}
    wrong = {k: (v, yaml[k]) for k, v in shown.items()
             if (words[v] if v in words else yaml_value(v)) != yaml[k]}
    assert not wrong, f"docs/CONFIG.md's defaults differ from conf/ ({{key: (CONFIG.md, YAML)}}): {wrong}"


def yaml_value(text: str):
    from omegaconf import OmegaConf

    return OmegaConf.create({"v": text}).v if not text.lstrip("-").isdigit() else int(text)
