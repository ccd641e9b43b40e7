"""Reward, KL and validation curves from a run's metrics (matplotlib, Agg).

``ppoflow plot RUN_DIR`` writes ``<run_dir>/curves.png`` (``plot_run``); the run report embeds a
small version (``curves_png``, tens of KB) in the run's Prefect artifacts, where the UI shows it.
"""

from __future__ import annotations

import io
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REWARD_KEYS = ("critic/score/mean", "reward/rule/mean")
KL_KEYS = ("actor/kl_to_ref", "actor/ppo_kl", "actor/kl_loss", "actor/reward_kl_penalty")
VALIDATION_PREFIX = "val-core/"
VALIDATION_KEYS = ("eval/rule_accuracy",)  # and every metric starting with VALIDATION_PREFIX
SMALL_SIZE_IN, SMALL_DPI, SMALL_COLORS = (9.0, 2.8), 90, 64
LARGE_SIZE_IN, LARGE_DPI = (15.0, 4.0), 110


def read_metrics(run_dir: Path) -> list[dict[str, float]]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def validation_keys(rows: Sequence[dict[str, Any]]) -> list[str]:
    """``eval/rule_accuracy`` and the ``val-core/...`` metrics the rows hold, in first-seen order."""
    found = dict.fromkeys(k for r in rows for k in r if k.startswith(VALIDATION_PREFIX))
    return [*VALIDATION_KEYS, *found]


def _figure(rows: Sequence[dict[str, Any]], title: str, size: tuple[float, float]) -> Any:
    """Three panels: reward, KL, validation; one line per metric the rows hold."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    panels = (("reward", REWARD_KEYS), ("KL", KL_KEYS), ("validation", validation_keys(rows)))
    fig, axes = plt.subplots(1, len(panels), figsize=size)
    for ax, (name, keys) in zip(axes, panels):
        for key in keys:
            pts = [(r["step"], r[key]) for r in rows if key in r]
            if pts:
                xs, ys = zip(*pts, strict=True)
                ax.plot(xs, ys, marker="." if len(pts) < 40 else None, label=key)
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("step", fontsize=8)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=6)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    return fig


def curves_png(rows: Sequence[dict[str, Any]], title: str) -> bytes:
    """The curves as a small PNG (a 64-colour palette image) for the Prefect artifacts."""
    import matplotlib.pyplot as plt
    from PIL import Image

    fig = _figure(rows, title, SMALL_SIZE_IN)
    raw = io.BytesIO()
    fig.savefig(raw, format="png", dpi=SMALL_DPI)
    plt.close(fig)
    raw.seek(0)
    image = Image.open(raw).convert("RGB").quantize(colors=SMALL_COLORS)
    out = io.BytesIO()
    image.save(out, format="PNG", optimize=True)
    return out.getvalue()


def plot_run(run_dir: Path, out: Path | None = None) -> Path:
    """Write ``<run_dir>/curves.png`` (or ``out``) and return its path."""
    import matplotlib.pyplot as plt

    rows = read_metrics(run_dir)
    if not rows:
        raise FileNotFoundError(
            f"no metrics in {run_dir / 'metrics.jsonl'}: has the run taken a step?"
        )
    out = out or run_dir / "curves.png"
    fig = _figure(rows, run_dir.name, LARGE_SIZE_IN)
    fig.savefig(out, dpi=LARGE_DPI)
    plt.close(fig)
    return out
