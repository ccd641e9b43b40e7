"""A colocated LLM judge: a causal LM that reads each sample and writes a verdict, parsed to a
score.

The judge's prompt for one sample is rendered in two steps:

1. ``reward.judge.template`` (Jinja: a file path, or the template text itself when it holds
   ``{{`` or ``{%``) renders the text of ONE user message from the variables ``question`` (the
   text of the prompt's last user message; the whole prompt when it is plain text),
   ``response`` (the decoded response, special tokens skipped), ``ground_truth`` and
   ``data_source``. An undefined variable is an error (``StrictUndefined``).
2. the judge tokenizer's own chat template renders ``[{"role": "user", "content": text}]`` with
   the generation prompt, and those ids go to a rollout-style engine (``reward.judge.engine``:
   ppoflow's transformers engine, ``infra.engines.hf``, or vLLM): at most
   ``reward.judge.max_new_tokens`` tokens, greedy at ``reward.judge.temperature`` 0. The verdict
   is the generated text, special tokens skipped.

``infra.judge_model.Judge`` holds the model on a worker (``Sleepable``: it takes turns with the
other models of the pool). The flow process parses the verdicts with ``reward.judge.parse``: a function
``(verdict: str) -> float | None`` from a file or module (``{path, name}``, loaded like
``reward.functions``) or a built-in (``yes_no``, ``last_number``). None counts as a parse failure
and scores ``reward.judge.on_parse_error``; a parse function that raises, or returns anything but
a finite number or None, fails the batch with ``JudgeParseError`` (``judge_scores``).

This module imports the standard library only at the top (Jinja and transformers when used), so
the configuration can check a template without loading a model.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from infra.text import error_text, one_line

if TYPE_CHECKING:
    from jinja2 import Template

__all__ = [
    "BUILTIN_PARSERS",
    "JudgeInput",
    "JudgeParseError",
    "JudgeScores",
    "JudgeTemplateError",
    "check_judge_tokenizer",
    "check_template",
    "judge_scores",
    "last_number",
    "load_parse_function",
    "question_text",
    "render_template",
    "template_text",
    "yes_no",
]

ParseFn = Callable[[str], float | None]
TEMPLATE_SETTING = "reward.judge.template"
PARSE_SETTING = "reward.judge.parse"
# What a template is checked with (config and input checks): every variable it may use.
DUMMY_VARIABLES = {
    "question": "What is 2+3?",
    "response": "5",
    "ground_truth": "5",
    "data_source": "check",
}


# --- built-in parsers ----------------------------------------------------------------------

_YES_NO = re.compile(r"\b(yes|no)\b", re.IGNORECASE)
_NUMBER = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|[-+]?\.\d+")


def yes_no(verdict: str) -> float | None:
    """1.0 or 0.0 by the first whole word ``yes`` or ``no`` in the verdict (any case), None when
    neither appears: "Yes, no doubt" → 1.0, " no." → 0.0, "yesterday" → None."""
    found = _YES_NO.search(verdict)
    if found is None:
        return None
    return 1.0 if found.group(1).lower() == "yes" else 0.0


def last_number(verdict: str) -> float | None:
    """The last number in the verdict (optional sign, digits with optional thousands commas,
    optional decimals) as a float, None when there is none: "score: 7" → 7.0, "8 of 10" → 10.0,
    "-1,250.5" → -1250.5."""
    found = _NUMBER.findall(verdict)
    return float(found[-1].replace(",", "")) if found else None


BUILTIN_PARSERS: dict[str, ParseFn] = {"yes_no": yes_no, "last_number": last_number}


# --- errors ----------------------------------------------------------------------------------


class JudgeTemplateError(ValueError):
    """``reward.judge.template`` is missing, does not compile, or does not render; or the judge
    tokenizer's chat template (``models.judge``) is missing or fails."""


class JudgeParseError(RuntimeError):
    """The judge's parse function raised or returned something else than a finite number or
    None; nothing of the batch has a score."""

    def __init__(self, message: str, *, label: str, key: str) -> None:
        super().__init__(message)
        self.label = label
        self.key = key

    def __reduce__(self) -> tuple[Any, ...]:  # pickles (Prefect and Ray may carry it)
        return (_rebuild_parse_error, (str(self), self.label, self.key))


def _rebuild_parse_error(message: str, label: str, key: str) -> JudgeParseError:
    return JudgeParseError(message, label=label, key=key)


# --- the template ------------------------------------------------------------------------------


def template_text(template: str) -> str:
    """The Jinja source ``template`` names: itself when it holds ``{{`` or ``{%``, else the
    contents of that file; a missing file is a ``JudgeTemplateError`` naming the setting."""
    if "{{" in template or "{%" in template:
        return template
    path = Path(template).expanduser()
    if not path.is_file():
        raise JudgeTemplateError(
            f"{TEMPLATE_SETTING}={template!r}: no such file; give a Jinja file's path or the "
            "template itself (text with {{ question }}, {{ response }}, {{ ground_truth }}, "
            "{{ data_source }})"
        )
    return path.read_text()


def compile_template(source: str) -> Template:
    """``source`` compiled in Jinja's sandbox, undefined variables raising."""
    from jinja2 import StrictUndefined, TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(undefined=StrictUndefined, keep_trailing_newline=False)
    try:
        return env.from_string(source)
    except TemplateError as exc:
        raise JudgeTemplateError(
            f"{TEMPLATE_SETTING}: the template does not compile: {one_line(str(exc), 160)}"
        ) from None


def render_template(template: Template, variables: dict[str, Any]) -> str:
    """The user message's text for one sample; a failure is a ``JudgeTemplateError``."""
    from jinja2 import TemplateError

    try:
        return template.render(**variables)
    except TemplateError as exc:
        raise JudgeTemplateError(
            f"{TEMPLATE_SETTING}: rendering failed: {one_line(str(exc), 160)} (the variables are "
            f"{', '.join(DUMMY_VARIABLES)})"
        ) from None


def check_template(template: str) -> None:
    """Compile ``template`` and render it with dummy values (``DUMMY_VARIABLES``): it must give
    a non-empty message. Raises ``JudgeTemplateError`` naming the setting."""
    text = render_template(compile_template(template_text(template)), dict(DUMMY_VARIABLES))
    if not text.strip():
        raise JudgeTemplateError(
            f"{TEMPLATE_SETTING}: the template renders an empty message; it must write the "
            "judge's question (use {{ question }} and {{ response }})"
        )


def check_judge_tokenizer(model_path: str | Path) -> None:
    """The judge's tokenizer has a chat template that renders one user message with the
    generation prompt (what ``Judge.prompt_ids`` asks of it). Raises ``JudgeTemplateError``
    naming ``models.judge``."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    fix = "use a judge folder whose tokenizer_config.json defines chat_template"
    if getattr(tokenizer, "chat_template", None) is None:
        raise JudgeTemplateError(
            f"models.judge={model_path}: its tokenizer has no chat template, which renders "
            f"the judge's message (reward.judge.template) as a user turn; {fix}"
        )
    message = [{"role": "user", "content": "Is 1 + 2 = 3 right?"}]
    try:
        tokenizer.apply_chat_template(message, add_generation_prompt=True, tokenize=False)
    except Exception as exc:  # the template's own error, whatever its type
        raise JudgeTemplateError(
            f"models.judge={model_path}: its chat template fails on one user message "
            f"({error_text(exc, 160)}); {fix}"
        ) from None


def question_text(raw_prompt: Any) -> str:
    """The text the template gets as ``question``: the content of the prompt's last user message
    (of its last message when none is a user's), the prompt itself when it is plain text."""
    if isinstance(raw_prompt, str):
        return raw_prompt
    messages = [m for m in raw_prompt if isinstance(m, dict)]
    users = [m for m in messages if m.get("role") == "user"] or messages
    return str(users[-1].get("content", "")) if users else ""


# --- parse functions -----------------------------------------------------------------------


class ParseSpec(Protocol):
    """What this module reads of a ``JudgeParseConfig``."""

    @property
    def path(self) -> str | None: ...

    @property
    def name(self) -> str: ...


def parse_label(spec: ParseSpec) -> str:
    """``path:name`` (``builtin:name`` for a built-in): how errors name the parse function."""
    return f"{spec.path or 'builtin'}:{spec.name}"


def load_parse_function(spec: ParseSpec) -> ParseFn:
    """The function ``reward.judge.parse`` names: a built-in (no ``path``) or ``name`` in a
    ``.py`` file or importable module (``infra.reward_functions.load_function``)."""
    from infra.reward_functions import load_function

    function: ParseFn = load_function(
        spec.path, spec.name, setting=PARSE_SETTING, builtins=BUILTIN_PARSERS, kind="parse function"
    )
    return function


@dataclass(frozen=True)
class JudgeScores:
    """Parsed verdicts in sample order: ``values`` (the judge part, ``on_parse_error`` where the
    parse gave None) and ``failed`` (True where it gave None)."""

    values: list[float]
    failed: list[bool]

    @property
    def failure_fraction(self) -> float:
        return sum(self.failed) / len(self.failed) if self.failed else 0.0


def judge_scores(
    verdicts: Sequence[str],
    keys: Sequence[str],
    *,
    parse: ParseFn,
    label: str,
    on_parse_error: float,
) -> JudgeScores:
    """``parse`` over each verdict (see the module docstring); raises ``JudgeParseError`` naming
    ``label`` and the sample key at the first call that raises or returns a bad value."""
    from infra.reward_functions import as_finite

    values: list[float] = []
    failed: list[bool] = []
    for key, verdict in zip(keys, verdicts, strict=True):
        try:
            value = parse(verdict)
        except Exception as exc:
            raise JudgeParseError(
                f"judge parse function {label} raised on sample {key!r} (verdict "
                f"{one_line(repr(verdict), 80)}): {type(exc).__name__}: {one_line(str(exc), 160)}; "
                "nothing of this batch was written",
                label=label,
                key=key,
            ) from None
        if value is None:
            values.append(float(on_parse_error))
            failed.append(True)
            continue
        number = as_finite(value)
        if number is None:
            raise JudgeParseError(
                f"judge parse function {label} returned {one_line(repr(value), 80)} on sample "
                f"{key!r}: return a finite number, or None when the verdict does not parse; "
                "nothing of this batch was written",
                label=label,
                key=key,
            )
        values.append(number)
        failed.append(False)
    return JudgeScores(values=values, failed=failed)


# --- what the judge model reads of a sample -------------------------------------------------


@dataclass(frozen=True)
class JudgeInput:
    """What the template sees of one sample."""

    question: str
    response: str
    ground_truth: Any
    data_source: str
