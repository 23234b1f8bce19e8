"""Issue 51, item 7: every documented key real, budgets read one way only, and docs/CONFIG.md's group rows listing
every option in conf/ (the overrides the docs and messages show are composed in tests/test_docs_commands.py)."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from runner.app import CONF
from runner.config.schema import register
from runner.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]


def composed(*overrides: str):
    register()
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        return compose("config", overrides=list(overrides))


@pytest.mark.parametrize("value, parsed", [
    ("2GiB", 2 * 2**30), ("512MiB", 512 * 2**20), ("1.5GB", 1_500_000_000), (0.8, 0.8), (1.0, 1.0), ("0.5", 0.5),
    ("80%", 0.8), ("100%", 1.0)])
def test_a_budget_in_the_config_is_a_size_with_a_unit_a_fraction_or_a_percentage(value, parsed):
    from runner.config.checks import check_config
    from sections import rules

    check_config(composed("sections=auto", f"engine.memory_budget={value}"))
    assert rules.parse_budget(value, "memory_budget", False) == parsed


@pytest.mark.parametrize("value", ["1", "1.5", "1073741824", "0", "0.0", "1e9", "2.5", "-1"])
def test_a_bare_number_budget_is_refused_in_one_line_naming_the_forms(value):
    """`1` was one byte and `1.0` the whole device; `1.5` was read as 1 byte and failed later ("no partition fits")."""
    from runner.config.checks import check_config

    with pytest.raises(ConfigError) as err:
        check_config(composed("sections=auto", f"engine.memory_budget={value}"))
    text = str(err.value)
    shown = {"1e9": "1000000000.0"}.get(value, value)  # as Hydra read it
    assert text.startswith(f"engine.memory_budget={shown}: must be a size with a unit (2GiB, 512MiB"), text
    assert "a fraction of the device's memory written with a decimal point (0 < f <= 1" in text and "(80%)" in text
    assert "\n" not in text


def test_the_engine_api_keeps_int_bytes_and_refuses_a_float_above_one():
    from sections import rules

    assert rules.parse_budget(2**30) == 2**30  # Python: an int is bytes (Engine(memory_budget=2**30))
    for value in (1.5, "1", 0.0, True):
        with pytest.raises(ValueError, match="must be a size with a unit"):
            rules.parse_budget(value)


def test_a_budget_above_the_device_is_warned_of_at_start(caplog):
    from runner.run.build import warn_budget_above_device

    with caplog.at_level(logging.WARNING, logger="runner"):
        assert warn_budget_above_device("1000TiB", "CPU:0")
        assert not warn_budget_above_device("1MiB", "CPU:0") and not warn_budget_above_device(1.0, "CPU:0")
        assert not warn_budget_above_device(None, "CPU:0")
    (line,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert re.fullmatch(r"engine\.memory_budget=1000TiB \(1024000\.0 GiB\) is above the device's memory, CPU:0: "
                        r"[\d.]+ [KMGT]iB \(.+\): plans to it can run out of memory; give at most [\d.]+ [KMGT]iB, or "
                        r"a fraction of the device \(0\.9\)", line), line


GROUP_ROW = re.compile(r"^\| `(\w+)` \| group: ((?:`\w+`(?:, )?)+) \|", re.M)


def test_config_md_group_rows_list_every_option_in_conf():
    """docs/CONFIG.md's `data` row listed 6 of the 10 sources, though the page said a test checked it against conf/."""
    rows = {group: set(re.findall(r"`(\w+)`", options))
            for group, options in GROUP_ROW.findall((ROOT / "docs" / "CONFIG.md").read_text())}
    assert set(rows) >= {"model", "data", "optimizer", "engine"}, sorted(rows)
    for group, listed in rows.items():
        options = {p.stem for p in (ROOT / "conf" / group).glob("*.yaml")} - {"default"}  # engine's shared base
        assert listed == options, f"docs/CONFIG.md's {group} row: missing {sorted(options - listed)}, " \
                                  f"not in conf/: {sorted(listed - options)}"
    experiments = re.search(r"^\| `experiment` \|.*\|(.*)\|$", (ROOT / "docs" / "CONFIG.md").read_text(), re.M)
    assert set(re.findall(r"`(\w+)`", experiments.group(1))) == {
        p.stem for p in (ROOT / "conf" / "experiment").glob("*.yaml")}
