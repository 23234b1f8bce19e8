"""Every `python -m runner` command in the README and docs/ parses as Hydra overrides and composes (a sweep as its
first job, launcher and sweeper choices included) into a config that passes the runner's own checks, in-process;
so does every override the docs show inline (`data.skip_corrupt=true`) and every override an error message or
warning of the code suggests: a documented key cannot be an unknown key."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FLAGS = {"-m", "--multirun", "--help", "--hydra-help", "--info"}


def documented_commands() -> list[tuple[str, str]]:
    """(where, command) for each `python -m runner ...` line inside a fenced code block."""
    found = []
    for path in DOCS:
        inside, lines = False, []
        for number, line in enumerate(path.read_text().splitlines(), 1):  # continuation lines joined
            if lines and lines[-1][1].endswith("\\"):
                lines[-1] = (lines[-1][0], lines[-1][1][:-1] + " " + line.strip())
            else:
                lines.append((number, line))
        for number, line in lines:
            if line.lstrip().startswith("```"):
                inside = not inside
                continue
            if not inside or "python -m runner " not in line + " " or "python -m runner." in line:
                continue
            command = line[line.index("python -m runner"):]
            command = re.split(r"\s+#", command, maxsplit=1)[0].strip()
            if "<" in command or "..." in command:  # a placeholder, not a command
                continue
            found.append((f"{path.relative_to(ROOT)}:{number}", command))
    return found


COMMANDS = documented_commands()


def test_the_docs_show_commands():
    assert len(COMMANDS) >= 20, COMMANDS


@pytest.mark.parametrize("where, command", COMMANDS, ids=[w for w, _ in COMMANDS])
def test_a_documented_command_parses_and_composes(where, command):
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from runner.config.checks import check_config

    words = shlex.split(command)[3:]
    overrides = [w for w in words if w not in FLAGS and not w.startswith("--cfg")]
    parsed = OverridesParser.create().parse_overrides(overrides)  # raises on what Hydra's parser rejects
    first_job = [f"{o.input_line.split('=', 1)[0]}={next(iter(o.sweep_string_iterator()))}"
                 if o.is_sweep_override() else o.input_line for o in parsed]  # a sweep: its first job
    cfg = compose(first_job)
    if cfg.resume is None:
        check_config(cfg)


def compose(overrides: list[str], hydra: bool = False):
    """The config `python -m runner <overrides>` composes, with Hydra's own part (launcher, sweeper) checked too
    (and kept, with `hydra`)."""
    from hydra import compose as hydra_compose, initialize_config_dir
    from omegaconf import open_dict

    from runner.config import schema

    schema.register()
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfg = hydra_compose("config", overrides=overrides, return_hydra_config=True)
    if not hydra:
        with open_dict(cfg):
            del cfg.hydra
    return cfg


KEYS = r"(?:model|data|optimizer|engine|train|distribute|batch|sections|resume|resume_data|experiment|hydra)"
OVERRIDE = re.compile(rf"[+~]?{KEYS}(?:[./][a-z_0-9]+)*=\S+")
# A value that stands for one the reader gives: R (a run folder), DIR, [a,b], <...>, {...}, ...
PLACEHOLDER = re.compile(r"""=(?:[A-Z]+|\[[a-z](?:,[a-z])*\])$|[<{]|\.\.\.|=['"]""")  # ='auto': Python's


def inline_overrides() -> list[tuple[str, str]]:
    """(where, span) for each inline code span of the docs made only of overrides (`data.skip_corrupt=true`,
    `hydra/launcher=slurm hydra.launcher.partition=gpu`), placeholders left out."""
    found = {}
    for path in DOCS:
        text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
        for m in re.finditer(r"`([^`\n]+)`", text):
            words = m.group(1).split()
            if words and all(OVERRIDE.fullmatch(w) and not PLACEHOLDER.search(w) for w in words):
                line = text[:m.start()].count("\n") + 1
                found.setdefault(m.group(1), f"{path.relative_to(ROOT)}:{line}")
    return [(where, span) for span, where in found.items()]


def suggested_overrides() -> list[tuple[str, str]]:
    """(where, override) for each override the code's messages name (string literals, docstrings left out)."""
    import ast

    found = {}
    for package in ("runner", "models", "sections"):
        for path in sorted((ROOT / package).rglob("*.py")):
            tree = ast.parse(path.read_text())
            docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                          if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                          and node.body and isinstance(node.body[0], ast.Expr)
                          and isinstance(node.body[0].value, ast.Constant)}
            for node in ast.walk(tree):
                if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
                    for m in re.finditer(rf"(?<![\w.$-]){OVERRIDE.pattern}", node.value):
                        word = m.group(0).rstrip(".,;:)'\"`")
                        if not PLACEHOLDER.search(word) and word.count("[") == word.count("]"):
                            found.setdefault((word, _source_of(path)), f"{path.relative_to(ROOT)}:{node.lineno}")
    return [(where, word) for (word, _), where in found.items()]


def _source_of(path: Path) -> str | None:
    """`models/data/tfrecord.py` speaks of `data=tfrecord`'s keys: the option its messages are read in."""
    if path.parent.name == "data" and (ROOT / "conf" / "data" / f"{path.stem}.yaml").is_file():
        return f"data={path.stem}"
    return None


def composes_somewhere(words: list[str], context: str | None = None) -> str | None:
    """None where `words` compose (with `context`, the option a message belongs to, where given; else alone, or with
    an option of the first key's group, or an experiment: `model.name=` needs `model=keras_hub`); else why not.
    Options whose YAML names the key are tried first."""
    tries = [[context]] if context else [[]]
    if not context:
        key = words[0].lstrip("+~").split("=")[0]
        group = re.split(r"[./]", key)[0]
        for g in (group, "experiment"):
            if (ROOT / "conf" / g).is_dir():
                files = sorted((ROOT / "conf" / g).glob("*.yaml"))
                leaf = key.rsplit(".", 1)[-1]
                tries += [[f"{g}={p.stem}"] for p in sorted(files, key=lambda p: leaf not in p.read_text())]
        if key.startswith("hydra.launcher."):  # a launcher's setting: the project's launchers and the plugins'
            tries += [[f"hydra/launcher={name}"] for name in LAUNCHERS]
    why = None
    for extra in tries:
        try:
            compose([*extra, *words])
            return None
        except Exception as err:  # noqa: BLE001 - Hydra's composition errors
            why = why or f"{' '.join([*extra, *words])}: {str(err).splitlines()[0]}"
    return why


LAUNCHERS = ("joblib", "local", "slurm", "submitit_local", "submitit_slurm")


def _chooses(word: str) -> bool:
    """A group choice (`data=tfrecord`, `hydra/launcher=slurm`): it changes what the other keys belong to."""
    key = word.lstrip("+~").split("=")[0]
    return "/" in key or ("." not in key and (ROOT / "conf" / key).is_dir())


def all_compose(units: list[tuple[str, list[str], str | None]]) -> list[str]:
    """`where: why` for each (where, words, context) that does not compose. Composing takes a second on a busy
    machine, so units are composed together, one call per context: a unit without one goes with the default config
    where its keys are there, else with the first option of its group whose YAML names the key; units with a
    group choice go alone; a batch that fails is tried unit by unit."""
    from omegaconf import OmegaConf

    default = compose([], hydra=True)
    batches: dict = {}
    rounds: list[dict] = []  # units with group choices: one compose per round, no group chosen twice in one
    for unit in units:
        where, words, context = unit
        groups = {re.split(r"[./=]", w.lstrip("+~"))[0] for w in words if _chooses(w)}
        if groups:
            if "experiment" in groups:  # an experiment chooses other groups itself: alone
                batches.setdefault(None, []).append(unit)
                continue
            free = next((r for r in rounds if not groups & set(r)), None)
            if free is None:
                rounds.append(free := {})
            free.update(dict.fromkeys(groups, unit))
            continue
        if context is None:
            for word in words:
                key = word.split("=")[0]
                if key.startswith(("+", "~")) or OmegaConf.select(default, key, default=KeyError) is not KeyError:
                    continue
                group, leaf = re.split(r"[./]", key)[0], key.rsplit(".", 1)[-1]
                for g in (group, "experiment"):
                    named = [p.stem for p in sorted((ROOT / "conf" / g).glob("*.yaml")) if leaf in p.read_text()]
                    if named:
                        context = f"{g}={named[0]}"
                        break
                break
        batches.setdefault(context or "", []).append(unit)
    for n, chosen in enumerate(rounds):
        batches[f"round {n}"] = list({id(u): u for u in chosen.values()}.values())
    wrong = []
    for context, batch in batches.items():
        if context is not None:
            words = [w for _, unit_words, _ in batch for w in unit_words]
            try:
                compose([context, *words] if context and not context.startswith("round ") else words)
                continue
            except Exception:  # noqa: BLE001 - one of them: found below
                pass
        wrong += [f"{where}: {why}" for where, words, own in batch if (why := composes_somewhere(words, own))]
    return wrong


INLINE = inline_overrides()
SUGGESTED = suggested_overrides()


def test_the_docs_and_messages_show_overrides():
    assert len(INLINE) >= 40 and len(SUGGESTED) >= 20, (len(INLINE), len(SUGGESTED))
    assert ("models/data/tfrecord.py", "data.skip_corrupt=true") in {(w.split(":")[0], o) for w, o in SUGGESTED}


@pytest.mark.slow  # ~20 s on a busy machine (one compose per context); fast: the skip_corrupt keys below, the commands
def test_every_inline_override_of_the_docs_composes():
    wrong = all_compose([(where, span.split(), None) for where, span in INLINE])
    assert not wrong, "\n".join(wrong)


@pytest.mark.slow  # ~15 s on a busy machine; fast: the skip_corrupt keys below (what this found), the commands
def test_every_override_a_message_suggests_composes_in_its_own_source():
    wrong = all_compose([(where, [word], _source_of(ROOT / where.split(":")[0])) for where, word in SUGGESTED])
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("source", ["tfrecord", "tfds", "image_folder"])
def test_skip_corrupt_is_a_key_of_each_source_whose_errors_name_it(source):
    assert compose([f"data={source}", "data.skip_corrupt=true"]).data.skip_corrupt is True
