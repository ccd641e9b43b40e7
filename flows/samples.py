"""What the policy wrote: each training step's samples in ``<run_dir>/samples/step_<N>.jsonl``.

After a step's update and before its partition is cleared, ``save_step_samples`` reads the
step's rows from the store (``collect_samples``) and writes them, one JSON object per line
(``write_samples``). ``N`` is the step number as it is (``step_3.jsonl``). Each object
holds

    step, uid (the sample key <prompt_uid>/<sample_index>), group, data_source,
    score (the stored ``scores``), each reward part by name (rm, rule, fn/<name>,
    overlong_penalty: unweighted, also gathered under ``rewards``), num_turns,
    prompt (the prompt's message text), response (decoded, special tokens skipped),
    messages (the prompt's chat plus the assistant's response), response_ids, loss_mask,
    judge_verdict (when the store holds ``judge_verdicts``)

At most ``trainer.samples_per_step`` samples a step: ordered by group (in the order groups first
appear in the batch), then batch order, the first ones taken, so whole groups come first. A
field the partition does not hold (``reward_parts``, ``loss_mask``, ``num_turns``,
``judge_verdicts``, ``messages``) is left out or takes its single-turn value: all tokens in the
loss, one turn, the prompt's chat plus the decoded response. A step that kept no group (dynamic sampling) writes an empty file. The file is written
to a temporary name and renamed into place, so a retried or resumed step replaces it whole and
the same samples give the same bytes.

``read_samples`` reads them back (``ppoflow samples RUN_DIR`` prints them with
``format_samples``; ``flows.report`` shows the latest step as the ``<name>-samples`` table
artifact, ``samples_table``). Nothing here imports torch at the top: the CLI reads files only.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from storage import BatchMeta
    from tasks.context import StageContext

Sample = dict[str, Any]

SAMPLES_DIR = "samples"
READS = ("group_ids", "raw_prompt", "data_source", "response_ids", "scores")
OPTIONAL_READS = ("reward_parts", "loss_mask", "num_turns", "judge_verdicts", "messages")
TABLE_TEXT_CHARS = 300  # prompt and response cells of the artifact table are cut to this
_STEP_FILE = re.compile(r"step_(\d+)\.jsonl")


class SamplesNotFound(FileNotFoundError):
    """The run folder, its samples or the asked step's file does not exist."""


def samples_path(run_dir: Path, step: int) -> Path:
    return run_dir / SAMPLES_DIR / f"step_{step}.jsonl"


# ---------------------------------------------------------------------- from the store
def chosen_rows(group_ids: Sequence[int], limit: int) -> list[int]:
    """Row indices of at most ``limit`` samples: by group (groups in order of first appearance),
    then batch order, so whole groups come first and only the last one taken may be cut."""
    first: dict[int, int] = {}
    for i, group in enumerate(group_ids):
        first.setdefault(group, i)
    order = sorted(range(len(group_ids)), key=lambda i: (first[group_ids[i]], i))
    return order[:limit]


def prompt_text(messages: Any) -> str:
    """The prompt as text: one message's content, or ``role: content`` lines for a chat."""
    if not isinstance(messages, list):
        return str(messages)
    if len(messages) == 1:
        return str(messages[0].get("content", ""))
    return "\n".join(f"{m.get('role', '')}: {m.get('content', '')}" for m in messages)


def collect_samples(ctx: StageContext, meta: BatchMeta, step: int, limit: int) -> list[Sample]:
    """The step's samples as written to its jsonl file (see the module docstring): at most
    ``limit``, read from the store before the partition is cleared."""
    from tasks.io import rows

    if ctx.tokenizer is None:
        raise ValueError("collect_samples decodes responses: the stage context needs a tokenizer")
    store = ctx.rt.store
    if not meta.keys:  # a step that kept no group (dynamic sampling)
        return []
    # 1. Which samples: whole groups first.
    group_ids = store.get_fields(meta, ("group_ids",), timeout=0)["group_ids"].tolist()
    picked = meta.subset(meta.keys[i] for i in chosen_rows(group_ids, limit))
    # 2. Read what they hold (optional fields only when every picked sample has them).
    held = store.kv_list(meta.partition_id)
    optional = [f for f in OPTIONAL_READS if all(f in held.get(k, ()) for k in picked.keys)]
    data = store.get_fields(picked, (*READS, *optional), timeout=0)
    response_ids = [r.tolist() for r in rows(data["response_ids"])]
    texts = ctx.tokenizer.batch_decode(response_ids, skip_special_tokens=True)
    loss_masks = (
        [r.tolist() for r in rows(data["loss_mask"])]
        if "loss_mask" in data
        else [[True] * len(ids) for ids in response_ids]
    )
    parts_rows = data.get("reward_parts") or [{}] * len(picked.keys)
    # 3. One object per sample.
    out: list[Sample] = []
    for i, key in enumerate(picked.keys):
        raw = data["raw_prompt"][i]
        messages = list(raw) if isinstance(raw, list) else [{"role": "user", "content": str(raw)}]
        parts = {str(name): float(value) for name, value in dict(parts_rows[i]).items()}
        sample: Sample = {
            "step": step,
            "uid": key,
            "group": int(data["group_ids"][i]),
            "data_source": str(data["data_source"][i]),
            "score": float(data["scores"][i]),
            "rewards": parts,
        }
        for name, value in parts.items():
            sample.setdefault(name, value)
        sample["num_turns"] = int(data["num_turns"][i]) if "num_turns" in data else 1
        if "judge_verdicts" in data:
            sample["judge_verdict"] = data["judge_verdicts"][i]
        sample["prompt"] = prompt_text(messages)
        sample["response"] = texts[i]
        sample["messages"] = (  # a multi-turn rollout's stored conversation, tool turns included
            list(data["messages"][i])
            if "messages" in data
            else [*messages, {"role": "assistant", "content": texts[i]}]
        )
        sample["response_ids"] = response_ids[i]
        sample["loss_mask"] = [bool(m) for m in loss_masks[i]]
        out.append(sample)
    return out


def save_step_samples(ctx: StageContext, meta: BatchMeta, step: int, run_dir: Path) -> Path | None:
    """``trainer.save_samples``: write the step's samples (at most ``trainer.samples_per_step``);
    returns the file, or None when saving is off."""
    trainer = ctx.cfg.trainer
    if not trainer.save_samples:
        return None
    return write_samples(run_dir, step, collect_samples(ctx, meta, step, trainer.samples_per_step))


# ---------------------------------------------------------------------- files
def write_samples(run_dir: Path, step: int, samples: Sequence[Sample]) -> Path:
    """Write ``samples`` as ``samples/step_<N>.jsonl`` atomically (temporary file, then rename)."""
    path = samples_path(run_dir, step)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w", encoding="utf-8") as fh:
        fh.writelines(json.dumps(s, ensure_ascii=False) + "\n" for s in samples)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    return path


def saved_steps(run_dir: Path) -> list[int]:
    """Steps with a samples file, ascending."""
    folder = run_dir / SAMPLES_DIR
    if not folder.is_dir():
        return []
    found = (_STEP_FILE.fullmatch(p.name) for p in folder.iterdir())
    return sorted(int(m.group(1)) for m in found if m is not None)


def drop_samples_from(run_dir: Path, step: int) -> None:
    """Remove the files of ``step`` and later (an interrupted attempt's, about to be redone)."""
    for later in (s for s in saved_steps(run_dir) if s >= step):
        samples_path(run_dir, later).unlink(missing_ok=True)


def latest_samples_step(run_dir: Path) -> int:
    """The last step with a samples file; SamplesNotFound names what is missing."""
    if not run_dir.is_dir():
        raise SamplesNotFound(f"{run_dir}: no such run folder")
    steps = saved_steps(run_dir)
    if not steps:
        raise SamplesNotFound(
            f"{run_dir}: no samples saved (no {SAMPLES_DIR}/step_<N>.jsonl: no step has finished, "
            "or the run had trainer.save_samples=false)"
        )
    return steps[-1]


def read_samples(run_dir: Path, step: int | None = None, limit: int | None = None) -> list[Sample]:
    """The samples of ``step`` (default: the latest saved), at most ``limit`` of them."""
    step = latest_samples_step(run_dir) if step is None else step
    path = samples_path(run_dir, step)
    if not path.is_file():
        steps = saved_steps(run_dir)
        have = f"steps {steps[0]}-{steps[-1]}" if steps else "none"
        raise SamplesNotFound(f"{run_dir}: no samples of step {step} (saved: {have})")
    out: list[Sample] = []
    with path.open(encoding="utf-8") as fh:
        for line in fh:
            if limit is not None and len(out) >= limit:
                break
            if line.strip():
                out.append(json.loads(line))
    return out


# ---------------------------------------------------------------------- for people
def cut(text: str, chars: int = TABLE_TEXT_CHARS) -> str:
    return text if len(text) <= chars else text[: chars - 1] + "…"


def samples_table(samples: Sequence[Sample]) -> list[dict[str, Any]]:
    """Rows of the ``<name>-samples`` artifact: prompt, response (cut), score, turns."""
    return [
        {
            "prompt": cut(s["prompt"]),
            "response": cut(s["response"]),
            "score": round(float(s["score"]), 4),
            "turns": s.get("num_turns", 1),
        }
        for s in samples
    ]


def _indented(label: str, text: str) -> str:
    pad = " " * (len(label) + 2)
    return f"  {label}" + text.replace("\n", "\n" + pad)


def format_samples(samples: Sequence[Sample], step: int, path: Path) -> str:
    """The samples for a terminal: a header, then per sample its key, score, parts, turns,
    prompt and response."""
    lines = [f"step {step}: {len(samples)} sample(s) from {path}"]
    for s in samples:
        parts = ", ".join(f"{k} {v:.4g}" for k, v in s.get("rewards", {}).items())
        verdict = f"  judge {s['judge_verdict']}" if "judge_verdict" in s else ""
        lines += [
            "",
            f"{s['uid']}  group {s['group']}  score {s['score']:.4g}"
            + (f" ({parts})" if parts else "")
            + f"  turns {s.get('num_turns', 1)}{verdict}",
            _indented("prompt:   ", s["prompt"]),
            _indented("response: ", s["response"]),
        ]
    return "\n".join(lines)
