"""Reward functions with verl's signature: loading, built-ins, the process pool and its failures.

Each test writes small reward files into tmp_path and runs them in real spawned workers.
"""

from __future__ import annotations

import math
import os
import re
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from infra.config import RewardFunctionConfig
from infra.reward_functions import (
    FunctionScores,
    RewardFunctionError,
    RewardFunctionLoadError,
    RewardFunctionPool,
    RewardSample,
    check_reward_functions,
    load_reward_function,
    metrics,
)

VERL_FILE = """
import os, sys

def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    ok = solution_str.strip() == str(ground_truth)
    return {"score": float(ok), "acc": ok, "pred": solution_str, "index": extra_info["i"],
            "torch_loaded": "torch" in sys.modules}
"""

# One function whose misbehaviour is chosen by the response text.
MISBEHAVING_FILE = """
import math, os, signal, time

def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    if solution_str == "raise":
        return 1 / 0
    if solution_str == "sleep":
        time.sleep(30)
    if solution_str == "swallow":  # eats the first alarm: the repeated alarm still ends it
        try:
            time.sleep(30)
        except BaseException:
            pass
        time.sleep(30)
    if solution_str == "nan":
        return math.nan
    if solution_str == "text":
        return "five"
    if solution_str == "no_score":
        return {"acc": 1.0}
    if solution_str == "exit":
        os._exit(1)
    if solution_str == "block":  # SIGALRM blocked: only the parent's backstop can end this
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
        time.sleep(30)
    return {"score": 1.0, "pid": os.getpid()}
"""


def _write(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


def _sample(
    text: str, truth: object = "5", i: int = 0, source: str = "openai/gsm8k"
) -> RewardSample:
    return RewardSample(f"p{i}/0", source, text, truth, {"i": i})


def test_file_module_and_builtins_weighted_with_extras(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    verl_file = _write(tmp_path, "my_reward.py", VERL_FILE)
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "lengths.py").write_text(
        "def length_score(data_source, solution_str, ground_truth, extra_info=None, **kw):\n"
        "    return len(solution_str)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))  # spawned workers inherit sys.path
    specs = [
        RewardFunctionConfig(path=verl_file),
        RewardFunctionConfig(path="pkg.lengths", name="length_score", weight=0.5),
        RewardFunctionConfig(name="gsm8k", weight=2.0),
    ]
    texts = ["5", "7", "so 5\n#### 5", "6", "5 ", "#### 1,234"]
    truths = ["5", "5", "5", "5", "5", "1234"]
    samples = [_sample(t, g, i) for i, (t, g) in enumerate(zip(texts, truths))]
    with RewardFunctionPool(specs, workers=2, timeout_s=5.0) as pool:
        fs = pool.score(samples)
    labels = [s.label for s in specs]
    assert list(fs.scores) == labels
    assert fs.scores[labels[0]] == [1.0, 0.0, 0.0, 0.0, 1.0, 0.0]
    assert fs.scores[labels[1]] == [1.0, 1.0, 11.0, 1.0, 2.0, 10.0]
    assert fs.scores[labels[2]] == [0.0, 0.0, 1.0, 0.0, 0.0, 1.0]
    # total = 1·verl + 0.5·length + 2·gsm8k, e.g. sample 2: 0 + 5.5 + 2; sample 4: 1 + 1 + 0.
    assert fs.total == [1.5, 0.5, 7.5, 0.5, 2.0, 7.0]
    # Several functions: extras are named by function; strings ("pred") are not extras.
    assert set(fs.extras) == {
        "reward_extra/compute_score/acc",
        "reward_extra/compute_score/index",
        "reward_extra/compute_score/torch_loaded",
    }
    assert fs.extras["reward_extra/compute_score/acc"] == [1.0, 0.0, 0.0, 0.0, 1.0, 0.0]
    assert fs.extras["reward_extra/compute_score/index"] == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    assert fs.extras["reward_extra/compute_score/torch_loaded"] == [0.0] * 6  # light workers
    logged = metrics(fs)
    assert logged["reward/fn/compute_score/mean"] == pytest.approx(2 / 6)
    assert logged["reward/fn/length_score/mean"] == pytest.approx(26 / 6)
    assert logged["reward/fn/gsm8k/mean"] == pytest.approx(2 / 6)
    assert logged["reward_extra/compute_score/index/mean"] == pytest.approx(2.5)


def test_builtins_have_verl_signature() -> None:
    exact = load_reward_function(RewardFunctionConfig(name="exact_match"), 0)
    gsm8k = load_reward_function(RewardFunctionConfig(name="gsm8k"), 1)
    assert exact("any", " 42\n", "42", None) == 1.0
    assert exact(data_source="any", solution_str="41", ground_truth=42) == 0.0
    assert gsm8k("openai/gsm8k", "so 1,234 in all\n#### 1,234", "1234", {"split": "train"}) == 1.0
    assert gsm8k("openai/gsm8k", "#### 1,233", "1234") == 0.0
    assert gsm8k("openai/gsm8k", "1234", "1234") == 0.0  # no #### answer


def test_metrics_nan_mean_and_repeated_function_names() -> None:
    fs = FunctionScores(
        scores={"a/x.py:compute_score": [1.0, 0.0], "b/y.py:compute_score": [2.0, 4.0]},
        total=[5.0, 8.0],
        extras={"reward_extra/x.compute_score/acc": [1.0, math.nan]},
    )
    # Same name in two files: the file stem tells them apart; the NaN sample is skipped.
    assert metrics(fs) == {
        "reward/fn/x.compute_score/mean": 0.5,
        "reward/fn/y.compute_score/mean": 3.0,
        "reward_extra/x.compute_score/acc/mean": 1.0,
    }


def test_load_errors_name_the_setting(tmp_path: Path) -> None:
    missing = str(tmp_path / "nope.py")
    with pytest.raises(RewardFunctionLoadError, match=r"reward\.functions\[0\]\.path.*nope\.py"):
        check_reward_functions([RewardFunctionConfig(path=missing)])
    ok_file = _write(tmp_path, "ok.py", VERL_FILE + "\nTHRESHOLD = 3\n")
    with pytest.raises(
        RewardFunctionLoadError, match=r"reward\.functions\[1\]\.name.*ok\.py has no 'score_fn'"
    ):
        check_reward_functions(
            [
                RewardFunctionConfig(path=ok_file),
                RewardFunctionConfig(path=ok_file, name="score_fn"),
            ]
        )
    with pytest.raises(
        RewardFunctionLoadError, match=r"'THRESHOLD' in .*ok\.py is not callable \(int\)"
    ):
        load_reward_function(RewardFunctionConfig(path=ok_file, name="THRESHOLD"), 0)
    broken = _write(tmp_path, "broken.py", "import not_a_module_anywhere\n")
    with pytest.raises(
        RewardFunctionLoadError, match=r"functions\[2\]\.path: importing .*broken\.py failed: Mod"
    ):
        load_reward_function(RewardFunctionConfig(path=broken), 2)
    with pytest.raises(
        RewardFunctionLoadError, match=r"functions\[0\]\.path: no module 'no\.such'"
    ):
        load_reward_function(RewardFunctionConfig(path="no.such"), 0)
    with pytest.raises(RewardFunctionLoadError, match=r"no built-in reward function 'f1'"):
        load_reward_function(RewardFunctionConfig(name="f1"), 0)


def test_load_error_in_workers_is_a_load_error(tmp_path: Path) -> None:
    spec = RewardFunctionConfig(path=_write(tmp_path, "r.py", VERL_FILE), name="missing")
    with (
        RewardFunctionPool([spec], workers=1, timeout_s=1.0) as pool,
        pytest.raises(RewardFunctionLoadError, match=r"reward\.functions\[0\]\.name"),
    ):
        pool.score([_sample("5")])


def test_two_workers_serve_one_batch(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        "slow.py",
        "import os, time\n"
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    time.sleep(0.5)\n"
        "    return {'score': 1.0, 'pid': os.getpid()}\n",
    )
    with RewardFunctionPool([RewardFunctionConfig(path=path)], workers=2, timeout_s=5.0) as pool:
        fs = pool.score([_sample("5", i=0), _sample("5", i=1)])
    assert fs.total == [1.0, 1.0]
    pids = fs.extras["reward_extra/pid"]  # one function: extras are not prefixed by its name
    assert len(set(pids)) == 2 and os.getpid() not in pids


def test_empty_batch_starts_nothing() -> None:
    pool = RewardFunctionPool([RewardFunctionConfig(name="exact_match")], workers=1, timeout_s=1.0)
    fs = pool.score([])
    assert fs == FunctionScores(scores={"builtin:exact_match": []}, total=[], extras={})
    assert pool._executor is None


@pytest.fixture(scope="module")
def misbehaving(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RewardFunctionPool]:
    path = _write(tmp_path_factory.mktemp("rewards"), "bad_reward.py", MISBEHAVING_FILE)
    spec = RewardFunctionConfig(path=path)
    with RewardFunctionPool([spec], workers=1, timeout_s=0.3, backstop_slack_s=1.0) as pool:
        yield pool


def _worker_pid(pool: RewardFunctionPool) -> float:
    return pool.score([_sample("fine")]).extras["reward_extra/pid"][0]


@pytest.mark.parametrize(
    ("text", "kind", "detail"),
    [
        ("raise", "raised", r"failed on sample 'p3/0' .*: ZeroDivisionError: division by zero;"),
        ("nan", "bad_value", r"non-finite or non-number value on sample 'p3/0' .*: nan;"),
        ("text", "bad_value", r"non-number value .*: 'five'; return a finite number"),
        ("no_score", "no_score", r"dict without 'score' .*: a dict with keys: acc;"),
        ("sleep", "timeout", r"timed out on sample 'p3/0' .*no result in 0\.3 s; raise "),
        ("swallow", "timeout", r"no result in 0\.3 s; raise reward\.function_timeout_s"),
    ],
)
def test_a_failing_call_fails_the_batch_and_the_pool_goes_on(
    misbehaving: RewardFunctionPool, text: str, kind: str, detail: str
) -> None:
    pid = _worker_pid(misbehaving)
    batch = [_sample("fine", i=0), _sample("fine", i=1), _sample("fine", i=2)]
    with pytest.raises(
        RewardFunctionError, match=r"^reward function .*bad_reward\.py:compute_score"
    ) as info:
        misbehaving.score([*batch, _sample(text, i=3), _sample(text, i=4)])
    message = str(info.value)
    assert "\n" not in message and "(data_source 'openai/gsm8k')" in message
    assert message.endswith("nothing of this batch was written")
    assert re.search(detail, message), message
    assert (info.value.kind, info.value.key) == (kind, "p3/0")  # the first failing sample
    assert _worker_pid(misbehaving) == pid  # the same worker carries on: it was never killed


def test_a_dead_worker_is_replaced(misbehaving: RewardFunctionPool) -> None:
    pid = _worker_pid(misbehaving)
    with pytest.raises(RewardFunctionError, match=r"worker process died .*samples 'p0/0'") as info:
        misbehaving.score([_sample("exit")])
    assert info.value.kind == "died"
    assert _worker_pid(misbehaving) != pid


def test_a_call_stuck_past_the_alarm_is_killed_by_the_backstop(
    misbehaving: RewardFunctionPool,
) -> None:
    pid = int(_worker_pid(misbehaving))
    with pytest.raises(
        RewardFunctionError, match=r"starting at sample 'p0/0' .*reward\.function_timeout_s 0\.3"
    ) as info:
        misbehaving.score([_sample("block")])
    assert info.value.kind == "timeout"
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # terminated and reaped
    assert _worker_pid(misbehaving) != pid
