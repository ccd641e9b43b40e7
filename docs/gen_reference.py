"""The documentation's generated pages: the configuration reference from the config model
(``infra/config.py``), the CLI reference from the parser (``flows/cli.py``), the store's field
table (``storage/schema.py``) and the step plan's description (``tasks/plan.py``).

mkdocs-gen-files runs this file at build time (``mkdocs.yml``), so none of them can drift from the
code; ``tests/test_docs_reference_on_cpu.py`` renders them and checks what they hold. To read one
without building the site:

    .venv/bin/python docs/gen_reference.py config   # or: cli, fields, plan
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from flows.cli import build_parser  # noqa: E402
from infra.config import ConfigError, TrainConfig, load_config  # noqa: E402

PRESETS_DIR = ROOT / "configs"
# Where the pages land in the site (docs_dir-relative).
CONFIG_PAGE = "reference/configuration.md"
CLI_PAGE = "reference/cli.md"
FIELDS_PAGE = "architecture/store.md"  # the field table is appended to the hand-written page
PLAN_PAGE = "architecture/plan.md"  # and the step plan's description to this one
LONGEST_VALUE = 60  # a preset's value longer than this (as JSON) is shown cut, with "…"


@dataclass(frozen=True)
class Key:
    """One row of the configuration reference."""

    dotted: str  # "algorithm.kl.coef"; an entry of a list: "rollout.tools[].path"
    type: str
    default: str  # JSON, as a YAML file may write it; "required" when there is none
    description: str
    presets: tuple[str, ...]  # "ppo: `\"gae\"`", one per preset whose resolved value differs


@dataclass(frozen=True)
class Section:
    """One heading of the configuration reference: a section of the tree and its keys."""

    path: str  # "" for the top level, "algorithm.kl", "rollout.tools[]"
    doc: str
    note: str  # how the section is given: always, optional, or a list of entries
    keys: tuple[Key, ...]


# ----------------------------------------------------------------------------- the config tree
def _section_model(annotation: Any) -> tuple[type[BaseModel] | None, str]:
    """The section model a field holds, and how: "" (always), "optional" or "list"."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation, ""
    args = typing.get_args(annotation)
    origin = typing.get_origin(annotation)
    if origin is list and args and isinstance(args[0], type) and issubclass(args[0], BaseModel):
        return args[0], "list"
    if origin in (typing.Union, types.UnionType):
        models = [a for a in args if isinstance(a, type) and issubclass(a, BaseModel)]
        if len(models) == 1 and type(None) in args and len(args) == 2:
            return models[0], "optional"
    return None, ""


def type_name(annotation: Any) -> str:
    """A field's type in words a YAML writer reads: ``float or null``, ``one of `a`, `b```."""
    if annotation is type(None):
        return "null"
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Literal:
        return "one of " + ", ".join(f"`{a}`" for a in args)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(type_name(a) for a in args)
    if origin is list:
        inner = type_name(args[0]) if args else "values"
        return "list, each " + inner if inner.startswith("one of") else "list of " + inner
    if origin is dict:
        return "mapping"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "section"
    if annotation is Path:
        return "path"
    return getattr(annotation, "__name__", str(annotation))


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def _lookup(tree: Any, dotted: str) -> tuple[bool, Any]:
    """The value at ``dotted`` in a ``model_dump(mode="json")`` tree, if it is there."""
    for part in dotted.split("."):
        if not isinstance(tree, dict) or part not in tree:
            return False, None
        tree = tree[part]
    return True, tree


def _field_default(info: FieldInfo) -> tuple[bool, Any]:
    """A field's own default as JSON (a key of an optional section or of a list's entries)."""
    if info.is_required():
        return False, None
    from pydantic import TypeAdapter

    value = info.get_default(call_default_factory=True)
    return True, TypeAdapter(info.annotation).dump_python(value, mode="json")


def _cut(text: str) -> str:
    return text if len(text) <= LONGEST_VALUE else text[: LONGEST_VALUE - 1] + "…"


def preset_names() -> list[str]:
    """The presets shipped in ``configs/`` (``ppoflow train --config NAME``), by name."""
    return sorted(path.stem for path in PRESETS_DIR.glob("*.yaml"))


def preset_summary(name: str) -> str:
    """A preset's leading comment block, as one paragraph."""
    lines = []
    for line in (PRESETS_DIR / f"{name}.yaml").read_text().splitlines():
        if not line.startswith("#"):
            break
        lines.append(line.lstrip("#").strip())
    return " ".join(lines)


def walk(
    model: type[BaseModel],
    prefix: str,
    defaults: dict[str, Any] | None,
    presets: dict[str, dict[str, Any]],
    note: str = "",
) -> Iterator[Section]:
    """The sections under ``model`` at ``prefix``, depth first, each with its own keys.

    ``defaults`` is the default config's dump (None below an optional section or a list's
    entries: their keys' defaults are the fields' own); ``presets`` each preset's dump."""
    keys: list[Key] = []
    below: list[Section] = []
    for name, info in model.model_fields.items():
        dotted = f"{prefix}.{name}" if prefix else name
        sub, how = _section_model(info.annotation)
        if sub is not None and how == "":
            below.extend(walk(sub, dotted, defaults, presets))
            continue
        if defaults is not None:
            has_default, default = _lookup(defaults, dotted)
        else:
            has_default, default = _field_default(info)
        changed = []
        for preset, tree in presets.items():
            found, value = _lookup(tree, dotted)
            if found and (not has_default or value != default):
                changed.append(f"`{preset}`: `{_cut(_json(value))}`")
        kind = type_name(info.annotation)
        if how == "list":
            kind = f"list of [entries](#{_anchor(dotted + '[]')})"
        elif how == "optional":
            kind = f"[section](#{_anchor(dotted)}) or null"
        keys.append(
            Key(
                dotted=dotted,
                type=kind,
                default=_json(default) if has_default else "required",
                description=" ".join((info.description or "").split()),
                presets=tuple(changed),
            )
        )
        if sub is not None:
            inner = f"{dotted}[]" if how == "list" else dotted
            inner_presets = presets if how == "optional" else {}
            below.extend(walk(sub, inner, None, inner_presets, note=how))
    doc = " ".join((model.__doc__ or "").split()) if model is not TrainConfig else ""
    yield Section(path=prefix, doc=doc, note=note, keys=tuple(keys))
    yield from below


def config_sections() -> list[Section]:
    """Every section of ``TrainConfig`` with its keys, defaults and the presets that change them."""
    defaults = TrainConfig().model_dump(mode="json")
    presets = {name: _preset(name).model_dump(mode="json") for name in preset_names()}
    return list(walk(TrainConfig, "", defaults, presets))


def _preset(name: str) -> TrainConfig:
    try:
        return load_config(name, [])
    except ConfigError as exc:
        raise ConfigError(f"the preset configs/{name}.yaml does not load: {exc}") from None


CODE_SPAN = re.compile(r"(``.+?``|`[^`]+`)")


def _cell(text: str) -> str:
    """Text for a table cell: pipes escaped, and ``<`` / ``>`` outside code spans as entities
    (``runs/<name>`` is not an HTML tag)."""
    parts = CODE_SPAN.split(text)
    for i in range(0, len(parts), 2):
        parts[i] = parts[i].replace("<", "&lt;").replace(">", "&gt;")
    return "".join(parts).replace("|", "\\|")


def _anchor(path: str) -> str:
    return "top-level" if not path else path.replace(".", "-").replace("[]", "-entries")


def config_reference() -> str:
    """The configuration reference page (markdown)."""
    sections = config_sections()
    out = [
        "# Configuration reference",
        "",
        "Generated from the config model (`infra/config.py`) and the presets (`configs/*.yaml`)",
        "when the site is built: every key of `TrainConfig`, its type, its default and what it",
        "does, and the presets whose resolved value differs from the default. A key is set in a",
        "YAML file by its nesting, or on the command line as `key=value`:",
        "",
        "```bash",
        ".venv/bin/ppoflow config --config ppo trainer.total_steps=50   # the resolved config",
        "```",
        "",
        "## Presets",
        "",
        "`ppoflow train --config NAME` reads `configs/NAME.yaml` (shipped in the package as",
        "`infra/presets/`); `ppoflow train` with no `--config` reads `default`, the main job.",
        "",
        "| preset | what it is |",
        "|---|---|",
    ]
    out += [f"| `{name}` | {_cell(preset_summary(name))} |" for name in preset_names()]
    out.append("")
    for section in sections:
        title = f"`{section.path}`" if section.path else "Top level"
        out += [f"## {title} {{#{_anchor(section.path)}}}", ""]
        if section.note == "optional":
            out += [f"Optional: `{section.path}: null` (the default) leaves it out.", ""]
        elif section.note == "list":
            out += [f"Each entry of the list `{section.path[:-2]}` has these keys.", ""]
        if section.doc:
            out += [section.doc, ""]
        out += [
            "| key | type | default | description | presets that change it |",
            "|---|---|---|---|---|",
        ]
        for key in section.keys:
            cells = (
                f"`{key.dotted}`",
                key.type,
                f"`{key.default}`" if key.default != "required" else "required",
                key.description,
            )
            changed = "<br>".join(_cell(c) for c in key.presets)
            out.append("| " + " | ".join(_cell(c) for c in cells) + f" | {changed} |")
        out.append("")
    return "\n".join(out)


# ----------------------------------------------------------------------------- the command line
def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _helps(parser: argparse.ArgumentParser) -> dict[str, str]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return {a.dest: a.help or "" for a in action._choices_actions}
    return {}


def cli_reference() -> str:
    """The CLI reference page (markdown), from ``flows.cli.build_parser``."""
    import flows.cli

    parser = build_parser()
    helps = _helps(parser)
    module_doc = (flows.cli.__doc__ or "").split("\n\n")
    out = [
        "# Command-line reference",
        "",
        "Generated from the parser (`flows/cli.py`, `build_parser`) when the site is built.",
        "",
        "```text",
        module_doc[1].strip() if len(module_doc) > 1 else parser.format_usage().strip(),
        "```",
        "",
    ]
    for part in module_doc[2:]:
        if part.strip():
            out += [" ".join(part.split()), ""]
    for name, sub in _subcommands(parser).items():
        summary = helps.get(name, "")
        out += [f"## `ppoflow {name}`", "", summary[:1].upper() + summary[1:] + ".", ""]
        out += ["```text", sub.format_usage().strip().removeprefix("usage: "), "```", ""]
        out += ["| argument | default | description |", "|---|---|---|"]
        for action in sub._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            names = ", ".join(action.option_strings) or action.dest
            if action.choices is not None:
                names += " {" + ",".join(str(c) for c in action.choices) + "}"
            default = "required" if action.required else f"`{action.default!s}`"
            if action.default is None or action.nargs == "*" and not action.option_strings:
                default = ""
            out.append(f"| `{names}` | {default} | {_cell(action.help or '')} |")
        out.append("")
    return "\n".join(out)


# ----------------------------------------------------------------------------- the store's fields
def fields_table() -> str:
    """The store's field vocabulary (``storage.schema.VOCABULARY``) as a markdown table."""
    from storage.schema import VOCABULARY

    out = [
        "## The field vocabulary",
        "",
        "Generated from `storage/schema.py` (`VOCABULARY`) when the site is built: the fields whose",
        "spec is fixed for every partition.",
        "",
        "| field | kind | dtype | one sample holds |",
        "|---|---|---|---|",
    ]
    for name, spec in VOCABULARY.items():
        dtype = str(spec.dtype).removeprefix("torch.") if spec.dtype is not None else ""
        if spec.kind == "dense":
            holds = f"shape {spec.shape}" if spec.shape else "one value"
        else:
            holds = "a 1-D row of its own length" if spec.kind == "jagged" else "a JSON-like value"
        out.append(f"| `{name}` | {spec.kind} | {dtype} | {holds} |")
    return "\n".join(out) + "\n"


# ----------------------------------------------------------------------------- the step plan
def plan_description() -> str:
    """The step plan's own description (``tasks/plan.py``'s module docstring), as a section."""
    import tasks.plan

    doc = (tasks.plan.__doc__ or "").strip()
    return "## What the plan decides\n\nFrom `tasks/plan.py`:\n\n" + doc + "\n"


def write_pages() -> None:
    """Write the generated pages into the site being built (mkdocs-gen-files)."""
    import mkdocs_gen_files

    with mkdocs_gen_files.open(CONFIG_PAGE, "w") as page:
        page.write(config_reference())
    with mkdocs_gen_files.open(CLI_PAGE, "w") as page:
        page.write(cli_reference())
    with mkdocs_gen_files.open(FIELDS_PAGE, "a") as page:
        page.write("\n" + fields_table())
    with mkdocs_gen_files.open(PLAN_PAGE, "a") as page:
        page.write("\n" + plan_description())
    # Files the results pages show that live beside the benchmarks, not under docs/.
    results = ROOT / "benchmarks" / "results"
    with mkdocs_gen_files.open("results/notes.md", "w") as page:
        page.write(results.joinpath("NOTES.md").read_text())
    for picture in ("recipes.png", "overoptimisation.png"):
        with mkdocs_gen_files.open(f"results/{picture}", "wb") as out:
            out.write(results.joinpath(picture).read_bytes())


RENDERERS = {
    "config": config_reference,
    "cli": cli_reference,
    "fields": fields_table,
    "plan": plan_description,
}

if __name__ == "<run_path>":  # run by mkdocs-gen-files during the build
    write_pages()
elif __name__ == "__main__":
    print(RENDERERS[sys.argv[1] if len(sys.argv) > 1 else "config"]())
