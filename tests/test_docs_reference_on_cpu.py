"""The docs site's generated references (``docs/gen_reference.py``, run by ``make docs``): every
leaf key of ``TrainConfig`` is in the configuration reference with its default, every key a
preset changes names that preset, and every command and option of the parser is in the CLI
reference. Nothing is built or started: the pages are rendered as strings."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from flows.cli import build_parser
from infra.config import TrainConfig, load_config

ROOT = Path(__file__).resolve().parents[1]


def _generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_reference", ROOT / "docs/gen_reference.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


GEN = _generator()


def leaves(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Dotted key → value of every leaf of a ``model_dump(mode="json")`` tree (a list or a null
    is a leaf: a list of entries or an unset optional section is one key)."""
    out: dict[str, Any] = {}
    for name, value in tree.items():
        key = f"{prefix}{name}"
        if isinstance(value, dict):
            out.update(leaves(value, key + "."))
        else:
            out[key] = value
    return out


def value_at(tree: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        tree = tree[part]
    return tree


def table_rows(markdown: str) -> dict[str, list[str]]:
    """The reference's table rows by key: ``| `key` | type | default | description | presets |``."""
    rows = {}
    for line in markdown.splitlines():
        cells = [cell.strip() for cell in re.split(r"(?<!\\)\|", line)[1:-1]]
        if len(cells) == 5 and cells[0].startswith("`"):
            rows[cells[0].strip("`")] = cells
    return rows


@pytest.fixture(scope="module")
def rows() -> dict[str, list[str]]:
    return table_rows(GEN.config_reference())


DEFAULTS = TrainConfig().model_dump(mode="json")


def test_every_leaf_key_appears_with_its_default(rows: dict[str, list[str]]) -> None:
    expected = leaves(DEFAULTS)
    assert len(expected) > 100  # the whole tree, not one section
    missing = sorted(set(expected) - set(rows))
    assert not missing, f"keys missing from the configuration reference: {missing}"
    for key, default in expected.items():
        assert rows[key][2] == f"`{json.dumps(default, ensure_ascii=False)}`", key


def test_keys_of_optional_sections_and_list_entries_are_listed(rows: dict[str, list[str]]) -> None:
    # reward.judge and actor.lora default to null and faults to []: their keys are still listed,
    # with the defaults they take once the section or an entry is given.
    assert rows["reward.judge.template"][2] == "required"
    assert rows["reward.judge.parse.name"][2] == '`"yes_no"`'
    assert rows["actor.lora.rank"][2] == "`8`"
    assert rows["faults[].step"][2] == "required"
    assert rows["faults[].attempt"][2] == "`1`"
    assert rows["rollout.tools[].path"][2] == "required"


def test_a_key_a_preset_changes_lists_the_preset(rows: dict[str, list[str]]) -> None:
    # Hand-picked: configs/ppo.yaml sets algorithm.estimator: gae (default grpo); the main job's
    # preset (default) trains two reward models (warmstart.rm_ensemble, default 1).
    assert '`ppo`: `"gae"`' in rows["algorithm.estimator"][4]
    assert "`default`: `2`" in rows["warmstart.rm_ensemble"][4]
    # Every preset against every default, both ways: listed where it differs, only there.
    expected = leaves(DEFAULTS)
    for name in GEN.preset_names():
        resolved = load_config(name, []).model_dump(mode="json")
        for key, default in expected.items():
            listed = f"`{name}`:" in rows[key][4]
            assert listed == (value_at(resolved, key) != default), (name, key)


def test_cli_reference_lists_every_command_and_option() -> None:
    text = GEN.cli_reference()
    parser = build_parser()
    commands = GEN._subcommands(parser)
    assert {"train", "config", "export", "samples"} <= set(commands)
    for name, sub in commands.items():
        assert f"## `ppoflow {name}`" in text
        for action in sub._actions:
            for option in action.option_strings:
                if option not in ("-h", "--help"):
                    assert f"`{option}" in text, (name, option)
