"""Two Ray nodes with different addresses: network namespaces on this machine joined by a veth
pair (192.0.2.10 and 192.0.2.11, the documentation range), a Ray head in one and a Ray worker
node in the other, each with one ``gpu_slot``. The driver runs in the head's namespace.

Two data-parallel training workers, one per node, meet on rank 0's node address and make the
same update as one worker; their rows cross nodes through the store's Ray object-store path.
The namespaces, the veth pair and every process in them are removed at the end; the test skips
with the reason when the machine does not permit namespaces."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HEAD, NODE = "192.0.2.10", "192.0.2.11"
PORT = 6391
IFNAME = "ppo0"  # the veth end's name inside each namespace (gloo binds to it)

DRIVER = Path(__file__).with_name("two_nodes_driver.py")


def _sh(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(args), check=check, capture_output=True, text=True, timeout=120)


def _kill_namespace(ns: str) -> None:
    """SIGKILL every process inside network namespace ``ns``."""
    pids = _sh("ip", "netns", "pids", ns, check=False).stdout.split()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)


@contextlib.contextmanager
def two_namespaces() -> Iterator[tuple[str, str]]:
    suffix = str(os.getpid())
    a, b = f"ppoflow-a-{suffix}", f"ppoflow-b-{suffix}"
    veth_a, veth_b = f"pfa{suffix}"[:15], f"pfb{suffix}"[:15]
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    probe = _sh("ip", "netns", "add", a, check=False)
    if probe.returncode != 0:
        pytest.skip(f"this machine does not permit network namespaces: {probe.stderr.strip()}")
    try:
        _sh("ip", "netns", "add", b)
        _sh("ip", "link", "add", veth_a, "type", "veth", "peer", "name", veth_b)
        _sh("ip", "link", "set", veth_a, "netns", a)
        _sh("ip", "link", "set", veth_b, "netns", b)
        for ns, dev, addr in ((a, veth_a, HEAD), (b, veth_b, NODE)):
            _sh("ip", "-n", ns, "link", "set", dev, "name", IFNAME)  # one name in both
            _sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", IFNAME)
            _sh("ip", "-n", ns, "link", "set", IFNAME, "up")
            _sh("ip", "-n", ns, "link", "set", "lo", "up")
        yield a, b
    finally:
        for ns in (a, b):
            _kill_namespace(ns)
            _sh("ip", "netns", "del", ns, check=False)  # the veth pair goes with its namespace


def _ray_start(ns: str, tmp: Path, *args: str) -> None:
    env = dict(os.environ, RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0", TMPDIR=str(tmp))
    ray = str(Path(sys.executable).with_name("ray"))
    cmd = ["ip", "netns", "exec", ns, ray, "start", "--num-cpus=2", '--resources={"gpu_slot": 1}']
    done = subprocess.run([*cmd, *args], env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]


@pytest.mark.slow
def test_two_data_parallel_workers_on_two_nodes_make_the_update_of_one(assets, tmp_path) -> None:
    with two_namespaces() as (head_ns, node_ns):
        tmp = Path("/tmp") / f"pf2n{os.getpid()}"  # short: Ray's socket paths
        tmp.mkdir(exist_ok=True)
        _ray_start(
            head_ns, tmp, "--head", f"--node-ip-address={HEAD}", f"--port={PORT}",
            "--include-dashboard=false", f"--temp-dir={tmp / 'head'}",
        )  # fmt: skip
        _ray_start(node_ns, tmp, f"--address={HEAD}:{PORT}", f"--node-ip-address={NODE}")
        env = dict(os.environ, RAY_AUTH_MODE="disabled", PYTHONPATH=str(ROOT), TMPDIR=str(tmp))
        env.pop("RAY_ADDRESS", None)
        cmd = [
            "ip", "netns", "exec", head_ns, sys.executable, str(DRIVER),
            str(ROOT), str(assets.policy), str(assets.tokenizer), f"{HEAD}:{PORT}", IFNAME,
        ]  # fmt: skip
        try:
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        finally:
            for ns in (node_ns, head_ns):
                _kill_namespace(ns)
            shutil.rmtree(tmp, ignore_errors=True)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))
        out = {int(k): v for k, v in json.loads(line[len("RESULT ") :]).items()}
    # One worker per node; the two replicas stay identical and make the one-worker update: the
    # same losses and gradient norm, and weights within what Adam's first step does to summation
    # order (it divides each gradient element by its own size, so elements whose gradient sums
    # to about zero move by a fraction of the learning rate that depends on the order).
    assert sorted(out[2]["nodes"]) == [HEAD, NODE]
    one, (two_a, two_b) = out[1]["digest"][0], out[2]["digest"]
    assert two_a == two_b
    for key, value in out[1]["metrics"].items():
        assert out[2]["metrics"][key] == pytest.approx(value, rel=1e-5, abs=1e-7), key
    for key in one:
        assert one[key] == pytest.approx(two_a[key], abs=2e-4), key
