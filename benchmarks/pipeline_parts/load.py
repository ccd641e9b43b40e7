"""Waiting for a quiet machine before a timed benchmark (``--wait-load``)."""

from __future__ import annotations

import os
import time
from typing import Any


def wait_for_load(threshold: float | None, max_minutes: float) -> dict[str, Any] | None:
    """Wait (checking every 60 s, at most ``max_minutes``) until the 1-minute load average is
    below ``threshold``; returns what was seen. None without a threshold."""
    if threshold is None:
        return None
    started, seen = time.monotonic(), [os.getloadavg()[0]]
    while seen[-1] >= threshold and time.monotonic() - started < 60 * max_minutes:
        print(f"load average {seen[-1]:.2f} >= {threshold}: waiting 60 s ...", flush=True)
        time.sleep(60)
        seen.append(os.getloadavg()[0])
    return {
        "threshold": threshold,
        "reached": seen[-1] < threshold,
        "waited_s": round(time.monotonic() - started),
        "load_1min_seen": [round(x, 2) for x in seen],
        "load_avg_at_start": os.getloadavg(),
    }
