"""``ppoflow plot RUN_DIR``: reward and KL curves from ``metrics.jsonl`` as a PNG."""

from __future__ import annotations

import json
from pathlib import Path

REWARD_KEYS = ("critic/score/mean", "reward/rule/mean", "eval/rule_accuracy")
KL_KEYS = ("actor/kl_to_ref", "actor/ppo_kl", "actor/kl_loss", "actor/reward_kl_penalty")


def read_metrics(run_dir: Path) -> list[dict[str, float]]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot_run(run_dir: Path, out: Path | None = None) -> Path:
    """Write ``<run_dir>/curves.png`` (or ``out``) and return its path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(run_dir)
    if not rows:
        raise FileNotFoundError(
            f"no metrics in {run_dir / 'metrics.jsonl'}: has the run taken a step?"
        )
    out = out or run_dir / "curves.png"
    fig, (ax_r, ax_k) = plt.subplots(1, 2, figsize=(11, 4))
    for ax, keys, title in ((ax_r, REWARD_KEYS, "reward"), (ax_k, KL_KEYS, "KL")):
        for key in keys:
            pts = [(r["step"], r[key]) for r in rows if key in r]
            if pts:
                xs, ys = zip(*pts, strict=True)
                ax.plot(xs, ys, marker="." if len(pts) < 40 else None, label=key)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(run_dir.name)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
