"""The reading route of one GRPO step: which of ppoflow's files a reader opens, following the
code from ``ppoflow train`` to the step's checkpoint, and how often they go back to a file
already left; and the same for the step alone, from ``Trainer.one_step``'s call to its return
(the step's checkpoint included), as one reads a step with the run already set up.

The run is real (``ppoflow train --config tiny`` for one step, on the built-in tiny assets, no
warm start): every process of it — the flow's and each Ray worker's — records the first call of
each of ppoflow's functions (a reader reads a function once; imports are not reading), with its
wall-clock time, and again the first call of each inside the step (a window the flow process
opens and closes with marker files that every process checks). Merged in
time order and mapped to files, consecutive calls in one file collapse into one visit. The store
(``storage/``) is read as a black box: its internals are left out.

    python benchmarks/route.py [--repo PATH] [--output benchmarks/results/route.json]

``--repo`` measures another checkout of ppoflow (e.g. a ``git worktree`` of an older commit)
with this script, for a before/after table. Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

PACKAGES = ("flows", "tasks", "infra")  # storage/ is the black box
STEP = "Trainer.one_step"  # the step's window: from its call to its return
STEP_MARKERS = ("step-started", "step-ended")


def _importing(frame: Any) -> bool:
    """The frame runs inside an import (a decorator, a registry built at import time)."""
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            return True
        frame = frame.f_back
    return False


def install_tracer() -> None:
    """Record the first call of each of ppoflow's functions in this process, to
    ``$ROUTE_DIR/<pid>.jsonl`` (a Ray worker's setup hook, and the flow process's)."""
    root = os.environ["ROUTE_REPO"]
    out = Path(os.environ["ROUTE_DIR"]) / f"{os.getpid()}.jsonl"
    markers = Path(os.environ["ROUTE_DIR"])
    seen: set[tuple[str, int, int]] = set()
    lock = threading.Lock()
    prefixes = tuple(os.path.join(root, p) + os.sep for p in PACKAGES)
    window = {"now": 0, "checked": 0.0}  # 0: before the step, 1: inside it, 2: after it

    def current_window() -> int:
        if window["now"] < 2 and time.monotonic() - window["checked"] > 0.02:
            window["checked"] = time.monotonic()
            window["now"] = sum((markers / name).exists() for name in STEP_MARKERS)
        return int(window["now"])

    def profile(frame: Any, event: str, arg: Any) -> None:
        code = frame.f_code
        step_edge = event in ("call", "return") and code.co_qualname == STEP
        if step_edge and code.co_filename.startswith(prefixes):  # the flow process's step
            marker = STEP_MARKERS[0 if event == "call" else 1]
            (markers / marker).touch()
            window["now"], window["checked"] = (1 if event == "call" else 2), time.monotonic()
        if event != "call":
            return
        path = code.co_filename
        if not path.startswith(prefixes) or not code.co_flags & inspect.CO_NEWLOCALS:
            return  # not ppoflow's, or a module or class body run at import
        key = (path, code.co_firstlineno, current_window())
        if key in seen or _importing(frame):
            return
        with lock:
            if key in seen:
                return
            seen.add(key)
            line = {
                "t": time.time_ns(),
                "file": os.path.relpath(path, root),
                "function": code.co_qualname,
                "line": code.co_firstlineno,
                "window": key[2],
            }
            with out.open("a") as f:
                f.write(json.dumps(line) + "\n")

    sys.setprofile(profile)
    threading.setprofile(profile)


def route(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Files opened and returns to a file already left, from time-ordered first calls."""
    visits: list[str] = []
    functions: list[list[str]] = []
    for record in sorted(records, key=lambda r: r["t"]):
        if not visits or visits[-1] != record["file"]:
            visits.append(record["file"])
            functions.append([])
        functions[-1].append(record["function"])
    opened: list[str] = []
    returns = 0
    for file in visits:
        if file in opened:
            returns += 1
        else:
            opened.append(file)
    return {
        "files_opened": len(opened),
        "returns_to_a_file_left": returns,
        "functions_read": len(records),
        "files": opened,
        "visits": [{"file": f, "functions": fs} for f, fs in zip(visits, functions)],
    }


def run(repo: Path, work: Path) -> dict[str, Any]:
    """One step of ``ppoflow train --config tiny`` in ``repo``, traced in every process."""
    os.environ.update(ROUTE_REPO=str(repo), ROUTE_DIR=str(work / "trace"))
    (work / "trace").mkdir(parents=True)
    sys.path.insert(0, str(repo))
    os.chdir(repo)  # Ray's workers put the driver's working folder first on their path
    import ray

    from infra.assets import build_tiny_assets

    assets = build_tiny_assets(work / "assets", seed=0)
    ray.init(
        address="local",
        num_cpus=4,
        resources={"gpu_slot": 4},
        include_dashboard=False,
        _temp_dir=tempfile.mkdtemp(prefix="rr"),
        runtime_env={
            "worker_process_setup_hook": install_tracer,
            "env_vars": {
                "ROUTE_REPO": str(repo),
                "ROUTE_DIR": str(work / "trace"),
                "PYTHONPATH": str(repo),
            },
        },
    )
    from flows.cli import main

    argv = [
        "train",
        "--config",
        "tiny",
        f"models.assets_dir={assets.root}",
        "warmstart.enabled=false",
        f"models.reward_model={assets.reward_model}",
        f"run_dir={work / 'run'}",
        "trainer.total_steps=1",
        "trainer.checkpoint_every=1",
        "resources.num_cpus=4",
    ]
    install_tracer()
    try:
        main(argv)
    except SystemExit as exc:
        if exc.code not in (0, None):
            raise
    finally:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]
        ray.shutdown()
    records = [
        json.loads(line)
        for path in sorted((work / "trace").glob("*.jsonl"))
        for line in path.read_text().splitlines()
    ]
    first: dict[tuple[str, int], dict[str, Any]] = {}  # the whole run reads a function once
    for record in sorted(records, key=lambda r: r["t"]):
        first.setdefault((record["file"], record["line"]), record)
    whole = route(list(first.values()))
    return {**whole, "one_step": route([r for r in records if r["window"] == 1])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    here = Path(__file__).resolve().parents[1]
    parser.add_argument("--repo", type=Path, default=here, help="the checkout to measure")
    parser.add_argument("--output", type=Path, default=None, help="JSON file to write")
    args = parser.parse_args()
    output = None if args.output is None else args.output.resolve()  # before run() changes folder
    for name in ("PREFECT_SERVER_ANALYTICS_ENABLED", "DO_NOT_TRACK", "RAY_AUTH_MODE"):
        os.environ.setdefault(name, {"PREFECT_SERVER_ANALYTICS_ENABLED": "false"}.get(name, "1"))
    os.environ["RAY_AUTH_MODE"] = "disabled"
    with tempfile.TemporaryDirectory(prefix="route") as tmp:
        result = run(args.repo.resolve(), Path(tmp))
    print("| route | files opened | returns to a file left | functions read |")
    print("|---|---:|---:|---:|")
    for name, part in (
        ("ppoflow train → checkpoint", result),
        ("Trainer.one_step", result["one_step"]),
    ):
        print(
            f"| {name} | {part['files_opened']} | {part['returns_to_a_file_left']} "
            f"| {part['functions_read']} |"
        )
    print("files, in the order first opened:", ", ".join(result["files"]))
    print("the step's files:", ", ".join(result["one_step"]["files"]))
    if output is not None:
        output.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
