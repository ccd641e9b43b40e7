"""The experiment trackers (flows/trackers.py) write what RunReport hands them, read back with
each tracker's own reader: TensorBoard's EventAccumulator, MLflow's client, the records of W&B's
offline run file. A test skips, saying why, when its tracker is not installed."""

from __future__ import annotations

import json
import struct
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prefect import flow

from flows.report import RunReport
from flows.trackers import (
    TrackerRun,
    mlflow_metric_name,
    open_tracker,
    wandb_has_account,
)

VAL = "val-core/addition/reward/mean@1"
CONFIG = {"name": "t", "trainer": {"total_steps": 4}}


def _rows(steps: range, offset: float = 0.0) -> Iterator[tuple[int, dict[str, float]]]:
    for step in steps:
        yield step, {"critic/score/mean": step + offset, VAL: 0.5 * step + offset}


def _log(name: str, run: TrackerRun, steps: range, offset: float = 0.0) -> None:
    tracker = open_tracker(name, run)
    for step, metrics in _rows(steps, offset):
        tracker.log(step, metrics)
    tracker.close()


# ---------------------------------------------------------------------- TensorBoard
def _scalars(log_dir: Path, tag: str) -> list[tuple[int, float]]:
    ea_module = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    acc = ea_module.EventAccumulator(str(log_dir))
    acc.Reload()
    return [(e.step, round(e.value, 6)) for e in acc.Scalars(tag)]


def test_tensorboard_scalars_read_back_and_a_resume_replaces_replayed_steps(
    tmp_path: Path,
) -> None:
    pytest.importorskip("tensorboard", reason="tensorboard is not installed (ppoflow[tensorboard])")
    _log("tensorboard", TrackerRun(tmp_path, "tb"), range(4))
    # A resume from step 2 (the attempt that wrote steps 2-3 was interrupted) logs them again.
    _log("tensorboard", TrackerRun(tmp_path, "tb", start_step=2), range(2, 5), offset=10.0)
    assert _scalars(tmp_path / "tensorboard", "critic/score/mean") == [
        (0, 0.0),
        (1, 1.0),
        (2, 12.0),
        (3, 13.0),
        (4, 14.0),
    ]
    assert _scalars(tmp_path / "tensorboard", VAL)[1] == (1, 0.5)  # the same name as the jsonl


def test_run_report_forwards_every_row(prefect_harness: None, tmp_path: Path) -> None:
    pytest.importorskip("tensorboard", reason="tensorboard is not installed (ppoflow[tensorboard])")

    @flow(name="report-trackers")
    def run() -> None:
        report = RunReport(
            tmp_path,
            "tracked",
            3,
            start_step=0,
            progress_bar=False,
            artifact_interval_s=3600,
            loggers=["jsonl", "tensorboard"],
        )
        report.start(0)
        for step, metrics in _rows(range(3)):
            report.log(step, metrics)
        report.close()

    run()
    assert [s for s, _ in _scalars(tmp_path / "tensorboard", VAL)] == [0, 1, 2]
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 3


# ---------------------------------------------------------------------- MLflow
def test_mlflow_names_map_only_refused_characters() -> None:
    assert mlflow_metric_name("critic/score/mean") == "critic/score/mean"
    assert mlflow_metric_name("timing_s/step") == "timing_s/step"
    assert mlflow_metric_name(VAL) == "val-core/addition/reward/mean_at_1"
    assert mlflow_metric_name("a:b%c") == "a_x3a_b_x25_c"


def test_mlflow_run_reads_back_and_a_resume_appends(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("mlflow", reason="mlflow is not installed (ppoflow[mlflow])")
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    _log("mlflow", TrackerRun(tmp_path, "ml-run", config=CONFIG), range(2))
    _log("mlflow", TrackerRun(tmp_path, "ml-run", start_step=2, config=CONFIG), range(2, 4))
    client = MlflowClient(tracking_uri=f"file:{tmp_path.resolve()}/mlruns")
    experiment = client.get_experiment_by_name("ppoflow")
    assert experiment is not None
    (run,) = client.search_runs([experiment.experiment_id])  # the resume reused the run
    assert run.info.run_name == "ml-run" and run.info.status == "FINISHED"
    history = client.get_metric_history(run.info.run_id, mlflow_metric_name(VAL))
    assert [(m.step, m.value) for m in history] == [(s, 0.5 * s) for s in range(4)]
    assert set(run.data.metrics) == {"critic/score/mean", mlflow_metric_name(VAL)}
    config = client.download_artifacts(run.info.run_id, "config.json", str(tmp_path))
    assert json.loads(Path(config).read_text()) == CONFIG


# ---------------------------------------------------------------------- Weights & Biases
def test_wandb_account_from_env_or_netrc(tmp_path: Path) -> None:
    netrc = tmp_path / "netrc"
    netrc.write_text("machine wandb.example login user password k3y\n")
    netrc.chmod(0o600)
    assert wandb_has_account({"WANDB_API_KEY": "x", "NETRC": str(tmp_path / "none")})
    assert not wandb_has_account({"NETRC": str(tmp_path / "none")})
    on_host = {"NETRC": str(netrc), "WANDB_BASE_URL": "https://wandb.example"}
    assert wandb_has_account(on_host)
    assert not wandb_has_account({**on_host, "WANDB_BASE_URL": "https://other.example"})


def _wandb_records(path: Path) -> Iterator[Any]:
    """The protobuf records of a ``.wandb`` run file: a 7-byte file header, then LevelDB-log
    style 32 KiB blocks of chunks (7-byte header: crc32, little-endian length, chunk type)."""
    from wandb.proto import wandb_internal_pb2

    buf, block = path.read_bytes(), 32 * 1024
    assert buf[:4] == b":W&B"
    pos, parts = 7, b""
    while pos + 7 <= len(buf):
        left = block - pos % block
        if left < 7:  # block trailer padding
            pos += left
            continue
        _crc, size, kind = struct.unpack("<IHB", buf[pos : pos + 7])
        if pos + 7 + size > len(buf):  # a chunk still being written
            return
        parts += buf[pos + 7 : pos + 7 + size]
        pos += 7 + size
        if kind in (1, 4):  # a full record, or the last chunk of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(parts)
            yield record
            parts = b""


def _wandb_history(run_file: Path, timeout_s: float = 30.0) -> list[dict[str, Any]]:
    """The history rows of a finished run file (W&B's service may still be writing its end)."""
    deadline = time.monotonic() + timeout_s
    records = list(_wandb_records(run_file))
    while time.monotonic() < deadline and not (
        records and records[-1].WhichOneof("record_type") == "exit"
    ):
        time.sleep(0.2)
        records = list(_wandb_records(run_file))
    rows = []
    for record in records:
        if record.WhichOneof("record_type") == "history":
            items = record.history.item  # a name with "/" comes split into nested_key
            rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in items})
    return rows


def test_wandb_offline_run_holds_the_metric_names_and_a_resume_keeps_the_id(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("wandb", reason="wandb is not installed (ppoflow[wandb])")
    for var in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_BASE_URL"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb-home"))
    _log("wandb", TrackerRun(tmp_path, "wb-run", config=CONFIG), range(2))
    _log("wandb", TrackerRun(tmp_path, "wb-run", start_step=1, config=CONFIG), range(1, 3))
    run_id = (tmp_path / "wandb-run-id").read_text().strip()
    attempts = sorted((tmp_path / "wandb").glob("offline-run-*"))
    # One folder per attempt, offline-run-<time>-<id> (wandb appends "-1" to the second when both
    # start within the same second); both hold the run's file under the one id.
    assert len(attempts) == 2 and all((a / f"run-{run_id}.wandb").is_file() for a in attempts)
    rows = [r for a in attempts for r in _wandb_history(a / f"run-{run_id}.wandb")]
    assert [r["step"] for r in rows] == [0, 1, 1, 2]  # `wandb sync` of both appends to one run
    assert all({"critic/score/mean", VAL} <= set(r) for r in rows)
    assert rows[-1][VAL] == 1.0
