"""``ppoflow``: the command line.

ppoflow train [--config configs/grpo.yaml] [key=value ...]   # the training flow (embedded default without args)
ppoflow config [--config configs/grpo.yaml] [key=value ...]  # the resolved config the run would use, as YAML
ppoflow plot RUN_DIR                                          # reward/KL curves → RUN_DIR/curves.png
ppoflow samples RUN_DIR [--step N] [--limit K]                # a step's samples: prompt, response, score
ppoflow deploy [--prefect-yaml PATH]                          # register deployments with a Prefect server
ppoflow serve [--name NAME ...]                               # serve deployments without a work pool
ppoflow export RUN_DIR [--step N] --out DIR [--adapter-only]  # a checkpoint's policy as one HF folder
ppoflow data addition --out DIR                               # the built-in prompts in verl's parquet layout

A bad setting, a missing file or folder, a prompt longer than ``data.max_prompt_length`` (with
``data.truncation=error``) or a reward function that does not load is one line on stderr and
exit status 2, before Ray or Prefect start; a run that fails later exits 1 with its error.
SIGTERM, SIGINT or SIGHUP stop a run at the next checkpoint (``flows.stopping``) and release
everything it started; the exit status is then 128 + the signal's number.

Before ``ppoflow train`` exits it waits up to ``EVENTS_DRAIN_S`` for Prefect's queued events
(task states, iteration events) to reach the API; when the API no longer answers (the server
went away mid-run), the events still queued are dropped with a warning and the command exits
with the run's status instead of retrying each one (docs/operations.md).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from infra.text import error_text, one_line

if TYPE_CHECKING:
    from infra.config import TrainConfig

EVENTS_DRAIN_S = 10.0
# The preset `ppoflow train` and `ppoflow config` read when no --config is given: the main job.
MAIN_JOB = "default"


def _quiet_defaults() -> None:
    for key, value in {
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "DO_NOT_TRACK": "1",
        "RAY_AUTH_MODE": "disabled",
        "RAY_USAGE_STATS_ENABLED": "0",
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1",
        # The temporary server needs ~20 s to start on a busy 2-core machine (Prefect's default
        # allows 20 s, then the run fails before its first task).
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
    }.items():
        os.environ.setdefault(key, value)


def _preflight(cfg: TrainConfig) -> None:
    """What the flow checks first, done before Prefect and Ray start: inputs, the run folder
    (flows.run_record: refused, or moved aside with trainer.resume=never), and the prompts of a
    user's dataset rendered with a user's tokenizer (the built-in task's come with its assets)."""
    from flows.inputs import check_inputs, load_datasets
    from flows.reward_model import resolve_models
    from flows.run_record import check_run_dir, check_warm_start

    check_inputs(cfg)
    aside = check_run_dir(cfg)
    if aside is not None:
        print(
            f"ppoflow: trainer.resume=never: the run that was in {cfg.resolved_run_dir} is now "
            f"in {aside}",
            file=sys.stderr,
            flush=True,
        )
    check_warm_start(cfg)
    if cfg.data.builtin or cfg.models.policy is None:
        return
    from transformers import AutoTokenizer

    models = resolve_models(cfg, None)
    load_datasets(cfg, models, AutoTokenizer.from_pretrained(models.tokenizer))


def _config(args: argparse.Namespace) -> int:
    """Print the resolved config (file, then overrides, validated) as YAML."""
    import yaml

    from infra.config import ConfigError, load_config

    try:
        cfg = load_config(args.config or MAIN_JOB, args.overrides)
    except (ConfigError, ValueError, OSError) as exc:
        print(f"ppoflow: {error_text(exc)}", file=sys.stderr)
        return 2
    print(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False), end="")
    return 0


def _train(args: argparse.Namespace) -> int:
    from flows import stopping
    from infra.config import ConfigError, load_config

    stopping.enable()
    try:
        cfg = load_config(args.config or MAIN_JOB, args.overrides)
        _preflight(cfg)
    except (ConfigError, ValueError, OSError) as exc:
        print(f"ppoflow: {error_text(exc)}", file=sys.stderr)
        return 2
    try:
        with stopping.signals(cfg.trainer.stop_grace_s):
            return _run(cfg)
    except stopping.RunStopped as stop:
        print(f"ppoflow: {stop}", file=sys.stderr, flush=True)
        return stop.exit_code


def _run(cfg: TrainConfig) -> int:
    """The flow run of ``ppoflow train``: 0 when it completed, 1 when it failed."""
    from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings

    from flows.train import ppo_train

    with temporary_settings({PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}):
        try:
            state = ppo_train(cfg, return_state=True)
        except Exception as exc:
            if not _api_lost(exc):
                raise
            _report_unrecorded(cfg, exc)
            return 1
    if not state.is_completed():
        print(
            f"ppoflow: run failed: {one_line(state.message or '') or state.name}",
            file=sys.stderr,
        )
        try:
            state.result()
        except Exception as exc:  # noqa: BLE001 - the run's own error, named in one line
            print(f"ppoflow: {type(exc).__name__}: {error_text(exc)}", file=sys.stderr)
        return 1
    print(json.dumps(state.result(), indent=1))
    return 0


def _api_lost(exc: BaseException) -> bool:
    """Whether ``exc`` (or what caused it) is the Prefect API not answering."""
    import httpx

    cause: BaseException | None = exc
    while cause is not None:
        if isinstance(cause, httpx.TransportError):
            return True
        cause = cause.__cause__ or cause.__context__
    return False


def _report_unrecorded(cfg: TrainConfig, exc: BaseException) -> None:
    """The run's files are what it did: name its latest checkpoint and how to go on."""
    from prefect.settings import PREFECT_API_URL

    from flows.checkpoint import latest_checkpoint

    latest = latest_checkpoint(cfg.resolved_run_dir)
    where = f"its latest checkpoint is {latest}" if latest else "it wrote no checkpoint"
    print(
        f"ppoflow: the Prefect API ({PREFECT_API_URL.value() or 'temporary server'}) stopped "
        f"answering ({type(exc).__name__}: {error_text(exc)}), so the run's final state is not "
        f"recorded there; {where}; run the same command again to resume from it "
        "(trainer.resume=auto)",
        file=sys.stderr,
        flush=True,
    )


def _events_delivered(timeout: float) -> bool:
    """Wait up to ``timeout`` for Prefect's queued events to be sent; False if some were not."""
    from prefect.events.worker import EventsWorker

    waited = EventsWorker.drain_all(timeout=timeout, at_exit=False)
    return not (isinstance(waited, tuple) and waited[1])


def _data(args: argparse.Namespace) -> int:
    from infra.data import write_addition_verl

    train, test = write_addition_verl(Path(args.out), seed=args.seed)
    print(json.dumps({"train": str(train), "test": str(test)}, indent=1))
    return 0


def _plot(args: argparse.Namespace) -> int:
    from flows.plot import plot_run

    print(plot_run(Path(args.run_dir)))
    return 0


def _samples(args: argparse.Namespace) -> int:
    from flows.samples import (
        SamplesNotFound,
        format_samples,
        latest_samples_step,
        read_samples,
        samples_path,
    )

    run_dir = Path(args.run_dir)
    try:
        step = latest_samples_step(run_dir) if args.step is None else args.step
        samples = read_samples(run_dir, step, limit=args.limit)
    except SamplesNotFound as exc:
        print(f"ppoflow samples: {exc}", file=sys.stderr)
        return 2
    print(format_samples(samples, step, samples_path(run_dir, step)))
    return 0


def _deploy(args: argparse.Namespace) -> int:
    from flows.deploy import deploy_all

    deploy_all(Path(args.prefect_yaml) if args.prefect_yaml else None, names=args.name or None)
    return 0


def _serve(args: argparse.Namespace) -> int:
    from flows.deploy import serve_all

    serve_all(
        names=args.name or None,
        prefect_yaml=Path(args.prefect_yaml) if args.prefect_yaml else None,
    )
    return 0


def _export(args: argparse.Namespace) -> int:
    from flows.export import ExportError, export_policy

    try:
        out = export_policy(
            Path(args.run_dir), out=Path(args.out), step=args.step, adapter_only=args.adapter_only
        )
    except ExportError as exc:
        print(f"ppoflow export: {exc}", file=sys.stderr)
        return 2
    print(out)
    return 0


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The ``ppoflow`` command line, built without running anything (the docs' CLI reference is
    generated from it)."""
    parser = argparse.ArgumentParser(
        prog="ppoflow", description="PPO-family RL as Prefect pipelines over Ray."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="run the training flow")
    config = sub.add_parser("config", help="print the resolved config the run would use (YAML)")
    for command, fn in ((train, _train), (config, _config)):
        command.add_argument(
            "--config",
            type=Path,
            default=None,
            help="YAML config or preset name (default: the main job, preset default)",
        )
        command.add_argument(
            "overrides", nargs="*", help="key=value overrides, e.g. trainer.total_steps=20"
        )
        command.set_defaults(fn=fn)
    plot = sub.add_parser("plot", help="plot reward and KL curves of a run")
    plot.add_argument("run_dir")
    plot.set_defaults(fn=_plot)
    samples = sub.add_parser("samples", help="print a step's samples (prompt, response, score)")
    samples.add_argument("run_dir", help="the run's directory (run_dir)")
    samples.add_argument("--step", type=int, default=None, help="step (default: the latest)")
    samples.add_argument("--limit", type=_positive, default=None, help="at most K samples")
    samples.set_defaults(fn=_samples)
    deploy = sub.add_parser("deploy", help="register the deployments in prefect.yaml")
    deploy.add_argument(
        "--prefect-yaml", default=None, help="default: ./prefect.yaml, else the packaged one"
    )
    deploy.add_argument(
        "--name", action="append", help="deployment name(s) to register (default: all)"
    )
    deploy.set_defaults(fn=_deploy)
    serve = sub.add_parser("serve", help="serve the deployments (no work pool needed)")
    serve.add_argument("--name", action="append", help="deployment name(s) to serve (default: all)")
    serve.add_argument(
        "--prefect-yaml", default=None, help="default: ./prefect.yaml, else the packaged one"
    )
    serve.set_defaults(fn=_serve)
    export = sub.add_parser(
        "export", help="write a checkpoint's policy as one save_pretrained folder"
    )
    export.add_argument("run_dir", help="the run's directory (run_dir)")
    export.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
    export.add_argument("--out", required=True, help="a new or empty folder")
    export.add_argument(
        "--adapter-only", action="store_true", help="LoRA runs: write the adapter alone"
    )
    export.set_defaults(fn=_export)
    data = sub.add_parser("data", help="write the built-in task's prompts in verl's layout")
    data.add_argument("dataset", choices=["addition"])
    data.add_argument("--out", required=True, help="folder for train.parquet and test.parquet")
    data.add_argument("--seed", type=int, default=0)
    data.set_defaults(fn=_data)
    return parser


def main(argv: list[str] | None = None) -> int:
    _quiet_defaults()
    args = build_parser().parse_args(argv)
    code = int(args.fn(args))
    if args.command == "train" and not _events_delivered(EVENTS_DRAIN_S):
        print(
            f"ppoflow: Prefect events not delivered within {EVENTS_DRAIN_S:.0f} s (the Prefect "
            "API does not answer) were dropped; the run's files are complete",
            file=sys.stderr,
            flush=True,
        )
        sys.stdout.flush()
        os._exit(code)  # Prefect's exit hook would retry every queued event, without a bound
    return code


if __name__ == "__main__":
    raise SystemExit(main())
