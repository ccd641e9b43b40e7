"""Shared fixtures: a private local Ray instance and an isolated Prefect test harness.

Every test session gets its own PREFECT_HOME and Ray temp dir, analytics off, one OpenMP thread
per process (``OMP_NUM_THREADS``, inherited by every process a test starts), and a SIGTERM
handler that turns termination into KeyboardInterrupt so harness servers and Ray helpers are
torn down instead of being left running.
"""

from __future__ import annotations

import os
import signal
import tempfile
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from xdist_groups import SERVER_MODULES

SERVER_SCOPE = "prefect-server"  # the one unit of work of SERVER_MODULES

_SESSION_TMP = Path(tempfile.mkdtemp(prefix="ppoflow-tests-"))
os.environ.setdefault("PREFECT_HOME", str(_SESSION_TMP / "prefect-home"))
os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
os.environ["DO_NOT_TRACK"] = "1"
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
os.environ["RAY_AUTH_MODE"] = "disabled"
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# The tests run tiny models in several processes at once (test processes, Ray workers, runs they
# start), which already outnumber the cores: one OpenMP thread per process spends fewer
# CPU-seconds than each process's own pool of one thread per core.
os.environ.setdefault("OMP_NUM_THREADS", "1")


def _raise_keyboard_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"received signal {signum}")


signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def _runs_flows(scope: str) -> bool:
    """A unit of work whose tests run training flows (seconds to a minute each)."""
    return scope == SERVER_SCOPE or scope.startswith("tests/flows/")


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """`--dist loadfile`, with the modules of ``SERVER_MODULES`` as one unit of work, and the
    units that run flows handed out first (xdist's own order, most tests first, puts the flow
    modules of a few long tests last, where one ran alone while the other processes had ended)."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class ServerModulesTogether(LoadFileScheduling):
        ordered = False

        def _split_scope(self, nodeid: str) -> str:
            module = super()._split_scope(nodeid)
            return SERVER_SCOPE if module in SERVER_MODULES else module

        def _assign_work_unit(self, node: Any) -> None:
            if not self.ordered:  # the queue is complete before the first unit goes out
                self.ordered = True
                units = sorted(self.workqueue.items(), key=lambda unit: not _runs_flows(unit[0]))
                self.workqueue = OrderedDict(units)
            super()._assign_work_unit(node)

    return ServerModulesTogether(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _cuda_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def require_vllm() -> None:
    """vLLM must be importable: skipped without it, failed without it under
    ``PPOFLOW_REQUIRE_VLLM=1`` (the vLLM tier of `make test-vllm` and CI)."""
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        return
    message = "vLLM is not installed (make venv-vllm installs its CPU build)"
    if os.environ.get("PPOFLOW_REQUIRE_VLLM") == "1":
        pytest.fail(message + "; PPOFLOW_REQUIRE_VLLM=1 asks for it")
    pytest.skip(message)


@pytest.fixture(scope="session")
def session_tmp() -> Path:
    return _SESSION_TMP


@pytest.fixture(scope="session")
def ray_local(session_tmp: Path) -> Iterator[object]:
    """A private local Ray instance with a fake GPU resource (`gpu_slot`) for placement tests."""
    import ray

    if ray.is_initialized():
        yield ray
        return
    ray_tmp = Path(
        tempfile.mkdtemp(prefix="r", dir="/tmp")
    )  # short: Ray socket paths are length-limited
    ray.init(
        address="local",
        num_cpus=4,
        resources={"gpu_slot": 4},
        include_dashboard=False,
        _temp_dir=str(ray_tmp),
        log_to_driver=False,
        configure_logging=False,
    )
    try:
        yield ray
    finally:
        ray.shutdown()


@pytest.fixture(scope="session")
def prefect_harness(session_tmp: Path) -> Iterator[None]:
    """A real (ephemeral) Prefect API for flow tests, torn down at the end of the session."""
    from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings
    from prefect.testing.utilities import prefect_test_harness

    with (
        prefect_test_harness(server_startup_timeout=120),
        temporary_settings({PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}),
    ):
        yield


@pytest.fixture(scope="session")
def shared_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder every test process of this pytest run shares (pytest-xdist's workers each get a
    base temp folder inside the run's own): what is built there is built once per run, under
    ``infra.assets.build_lock`` and in a folder named after what made it."""
    base = tmp_path_factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    return root / "shared"


@pytest.fixture(scope="session")
def assets(shared_root: Path) -> object:
    """Tiny tokenizer, models and dataset, built once per pytest run (every test process reads
    the same build) and loaded with from_pretrained."""
    from infra.assets import build_tiny_assets

    return build_tiny_assets(shared_root / "assets", seed=0)


@pytest.fixture()
def tiny_overrides(assets: object, tmp_path: Path) -> list[str]:
    """CLI-style overrides that point a tiny run at the session's assets (no warm start; the
    tiny untrained reward model is the reward)."""
    return [
        f"models.assets_dir={assets.root}",  # type: ignore[attr-defined]
        "warmstart.enabled=false",
        f"models.reward_model={assets.reward_model}",  # type: ignore[attr-defined]
        f"run_dir={tmp_path / 'run'}",
        "resources.num_cpus=4",
    ]
