"""A run's inputs, checked and loaded before any resource is taken.

``check_inputs(cfg)`` fails with one-line errors naming the setting: model folders that do not
exist (a hub id is not a local folder), dataset files, reward-function files and functions, the
tools (``rollout.tools``: each loads and has a JSON schema, and a user's chat template renders
a tool turn), the judge's template (it must render), its tokenizer's chat template and its
parse function.
``load_datasets(cfg, models, tokenizer)`` reads the prompt files, renders a user's prompts with
the policy tokenizer's chat template and applies ``data.max_prompt_length`` / ``data.truncation``
(``error`` fails here, naming the file and the row). Both run in the CLI before the flow starts
and again at the start of the flow (a deployment run has no CLI in front of it).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from infra.config import ConfigError, TrainConfig

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from flows.reward_model import ResolvedModels
    from infra.data import PromptDataset, PromptRow, RenderedPrompts

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class InputError(ConfigError):
    """A model folder, dataset file or reward function a setting names is missing or broken."""


def _check_folder(setting: str, path: Path | None) -> None:
    if path is None or path.is_dir():
        return
    if path.exists():
        raise InputError(f"{setting}={path}: not a folder (a Hugging Face model folder is needed)")
    hint = ""
    if _HUB_ID.match(str(path)):
        offline = os.environ.get("HF_HUB_OFFLINE", "") in ("1", "true", "True")
        hint = (
            " — it looks like a hub id, and ppoflow loads local folders only"
            + (" (the hub is offline here: HF_HUB_OFFLINE=1)" if offline else "")
            + f": download it first (`huggingface-cli download {path} --local-dir DIR`) and set "
            f"{setting}=DIR"
        )
    raise InputError(f"{setting}={path}: no such folder{hint}")


def check_inputs(cfg: TrainConfig) -> None:
    """Every path a setting names exists, every reward function and tool loads (and a user's
    chat template renders a tool turn), the judge's template and its tokenizer's chat template
    render and its parse function loads, and vLLM is installed where a setting asks for it."""
    from infra.engines import is_vllm_available
    from infra.engines.vllm_engine import MISSING
    from infra.reward_functions import check_reward_functions
    from infra.tools import check_tools

    judge_engine = cfg.reward.judge.engine if cfg.reward.judge is not None else "hf"
    if "vllm" in (cfg.rollout.engine, judge_engine) and not is_vllm_available():
        setting = "rollout.engine" if cfg.rollout.engine == "vllm" else "reward.judge.engine"
        raise InputError(MISSING.replace("rollout.engine", setting))

    m = cfg.models
    for setting in ("policy", "tokenizer", "reference", "critic", "judge", "teacher"):
        _check_folder(f"models.{setting}", getattr(m, setting))
    ensemble = isinstance(m.reward_model, list)
    for index, path in enumerate(m.reward_models):
        _check_folder(f"models.reward_model{f'[{index}]' if ensemble else ''}", path)
    for setting, files in (
        ("data.train_files", cfg.data.train_files),
        ("data.val_files", cfg.data.val_files),
    ):
        for index, path in enumerate(files):
            if not path.is_file():
                raise InputError(f"{setting}[{index}]={path}: no such file")
    try:
        check_reward_functions(cfg.reward.functions)
        check_tools(cfg.rollout.tools)
        if cfg.reward.judge is not None:
            from infra.judge import check_template, load_parse_function

            check_template(cfg.reward.judge.template)
            load_parse_function(cfg.reward.judge.parse)
        if m.judge is not None:
            from infra.judge import check_judge_tokenizer

            check_judge_tokenizer(m.judge)
    except ValueError as exc:
        raise InputError(str(exc)) from None
    _check_tool_template(cfg)
    policy_tokenizer = m.tokenizer or m.policy
    if m.teacher is not None and policy_tokenizer is not None:
        check_teacher_vocabulary(m.teacher, policy_tokenizer)


def check_teacher_vocabulary(teacher: str | Path, tokenizer: str | Path) -> None:
    """The distillation teacher scores the student's token ids, so it must share the policy's
    vocabulary: its own tokenizer (when its folder has one) maps every token to the same id as
    the policy's ``tokenizer``, and its output layer covers them all. Raises InputError naming
    both."""
    from transformers import AutoConfig, AutoTokenizer

    policy = AutoTokenizer.from_pretrained(tokenizer)
    size = getattr(AutoConfig.from_pretrained(teacher), "vocab_size", None)
    if size is not None and size < len(policy):
        raise InputError(
            f"models.teacher={teacher} has {size} output tokens, fewer than the {len(policy)} of "
            f"the policy's tokenizer {tokenizer}: the teacher must use the policy's vocabulary"
        )
    try:
        own = AutoTokenizer.from_pretrained(teacher)
    except (OSError, ValueError):
        return  # no tokenizer in the teacher's folder: the policy's is the one it was made with
    if own.get_vocab() != policy.get_vocab():
        theirs, ours = own.get_vocab(), policy.get_vocab()
        differ = sorted(set(theirs.items()) ^ set(ours.items()), key=lambda kv: kv[1])[:1]
        example = f" (e.g. token {differ[0][0]!r})" if differ else ""
        raise InputError(
            f"models.teacher={teacher} has another vocabulary ({len(theirs)} tokens) than the "
            f"policy's tokenizer {tokenizer} ({len(ours)} tokens){example}: on-policy "
            "distillation needs a teacher with the policy's tokenizer"
        )


def _check_tool_template(cfg: TrainConfig) -> None:
    """With ``rollout.tools``, a user's policy tokenizer renders a tool turn (a dummy call and
    its answer) the way the agent loop will (the built-in tasks' templates are ppoflow's own)."""
    folder = cfg.models.tokenizer or cfg.models.policy
    if not cfg.rollout.tools or folder is None:
        return
    from transformers import AutoTokenizer

    from infra.agent_loop import check_tool_template
    from infra.tools import tool_schemas

    setting = "models.tokenizer" if cfg.models.tokenizer is not None else "models.policy"
    tokenizer = AutoTokenizer.from_pretrained(folder)
    if getattr(tokenizer, "chat_template", None) is None:
        raise InputError(
            f"{setting}={folder}: the tokenizer has no chat template, which rollout.tools needs "
            "to render the tools and their answers; use a folder whose tokenizer_config.json "
            "defines chat_template"
        )
    try:
        check_tool_template(tokenizer, tool_schemas(cfg.rollout.tools) or [])
    except ValueError as exc:
        raise InputError(f"{setting}={folder}: {exc}") from None


@dataclass
class Datasets:
    """The training prompts, the validation prompts (None: no validation) and what rendering
    them dropped or truncated."""

    train: PromptDataset
    val: list[PromptRow] | None
    notes: dict[str, float]


def _rendered(
    cfg: TrainConfig, files: list[Path], tokenizer: PreTrainedTokenizerBase, setting: str
) -> RenderedPrompts:
    from infra.data import read_rl_rows, render_prompts
    from infra.tools import tool_schemas

    rows = read_rl_rows(files, cfg.data, setting=setting)
    return render_prompts(
        rows,
        tokenizer,
        max_prompt_length=cfg.data.max_prompt_length,
        truncation=cfg.data.truncation,
        setting=setting,
        tools=tool_schemas(cfg.rollout.tools),
    )


def _builtin_file(path: str | None) -> Path:
    """A prompt file of the built-in task (``ResolvedModels``: its assets were built)."""
    if path is None:
        raise InputError(
            "the built-in task's prompt files were not built: leave data.train_files unset "
            "and models.policy unset, or give data.train_files"
        )
    return Path(path)


def load_datasets(
    cfg: TrainConfig, models: ResolvedModels, tokenizer: PreTrainedTokenizerBase
) -> Datasets:
    """The run's prompt datasets, a user's prompts rendered to token ids (see the module
    docstring)."""
    from infra.data import PromptDataset, read_prompt_rows

    data = cfg.data
    if data.builtin:
        # The built-in addition task's prompts are a few tokens long: each step renders its own
        # (``tasks.generate.stage.row_prompt_ids``); the held-out ones are ``heldout_rows``.
        rows = read_prompt_rows(_builtin_file(models.train_data))
        train_set = PromptDataset.from_rows(
            rows, seed=cfg.seed, shuffle=data.shuffle, name="addition"
        )
        return Datasets(train=train_set, val=None, notes={})
    train = _rendered(cfg, data.train_files, tokenizer, "data.train_files")
    if len(train.rows) < cfg.rollout.prompts_per_step:
        raise InputError(
            f"data.train_files hold {len(train.rows)} usable prompt(s), fewer than "
            f"rollout.prompts_per_step={cfg.rollout.prompts_per_step}: lower it or add prompts"
        )
    notes = {
        "data/train_prompts": float(len(train.rows)),
        "data/train_truncated": float(train.truncated),
        "data/train_dropped": float(train.dropped),
    }
    val = None
    if data.val_files:
        rendered = _rendered(cfg, data.val_files, tokenizer, "data.val_files")
        kept = rendered.rows[: data.val_max_samples] if data.val_max_samples else rendered.rows
        val = list(kept)
        notes.update(
            {
                "data/val_prompts": float(len(val)),
                "data/val_truncated": float(rendered.truncated),
                "data/val_dropped": float(rendered.dropped),
            }
        )
    return Datasets(
        train=PromptDataset.from_rows(
            train.rows, seed=cfg.seed, shuffle=data.shuffle, name="train"
        ),
        val=val,
        notes=notes,
    )


def heldout_rows(
    cfg: TrainConfig, models: ResolvedModels, tokenizer: PreTrainedTokenizerBase
) -> list[PromptRow]:
    """The built-in task's held-out prompts for the rule accuracy (first ``trainer.eval_prompts``)."""
    from infra.data import read_prompt_rows, render_prompts
    from infra.tools import tool_schemas

    rows = read_prompt_rows(_builtin_file(models.heldout_data))[: cfg.trainer.eval_prompts]
    return list(
        render_prompts(
            rows,
            tokenizer,
            max_prompt_length=cfg.data.max_prompt_length,
            truncation="error",
            setting="data.val_files",
            tools=tool_schemas(cfg.rollout.tools),
        ).rows
    )
