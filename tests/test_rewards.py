"""Built-in rewards, reward-function resolution and RewardManager error isolation, on CPU."""

import asyncio
import logging
import subprocess
import sys
import threading
import time

import pytest

from polyrl.rewards import REWARD_FUNCTIONS, RewardManager, exact_match, resolve_reward_fn
from polyrl.rewards.math import extract_boxed, extract_gsm8k_answer, gsm8k_reward, math_reward
from polyrl.types import Sample


def sample(response="", label=None, group_index=0):
    return Sample(prompt_ids=[1], response_ids=[2], rollout_logprobs=[0.0], finish_reason="stop",
                  group_index=group_index, response=response, label=label)


def write_module(tmp_path, name, source):
    path = tmp_path / f"{name}.py"
    path.write_text(source)
    return path


def bounded(fn, what: str, limit_s: float = 60.0):
    """fn() on a daemon thread, failing with `what` if it has not returned within limit_s: a bound on a wait that a
    broken deadline would make last an hour, not a claim about how fast it returns."""
    out: list = []
    t = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    t.start()
    t.join(limit_s)
    assert out, f"{what} did not return within {limit_s:g} s (the hour-long call was waited for, not abandoned)"
    return out[0]


# ---- built-ins ----

def test_extract_boxed():
    assert extract_boxed(r"so \boxed{1} then \boxed{\frac{1}{2}} done") == r"\frac{1}{2}"
    assert extract_boxed(r"\boxed{\{1,2\}}") == r"\{1,2\}"
    assert extract_boxed("no box") is None
    assert extract_boxed(r"\boxed{\frac{1}{2") is None  # cut off mid-answer


@pytest.mark.parametrize("response,label,expected", [
    (r"The answer is \boxed{\frac{1}{2}}.", "0.5", 1.0),
    (r"\boxed{3}", "4", 0.0),
    (r"\boxed{3}", 3, 1.0),  # non-string labels are stringified
    (r"\boxed{x^2+1}", "1+x^2", 1.0),
    (r"\boxed{1,000}", r"\boxed{1000}", 1.0),
    (r"first \boxed{4} then \boxed{5}", "4", 0.0),  # the last box is the answer
    ("The answer is 0.5", "0.5", 0.0),  # no boxed answer
])
def test_math_reward(response, label, expected):
    assert math_reward(sample(response, label)) == expected


def test_math_reward_off_the_main_thread():
    out = []
    t = threading.Thread(target=lambda: out.append(math_reward(sample(r"\boxed{\frac{1}{2}}", "0.5"))))
    t.start()
    t.join()
    assert out == [1.0]


def test_math_reward_needs_a_label():
    with pytest.raises(ValueError, match="--label-key"):
        math_reward(sample(r"\boxed{1}", None))


def test_gsm8k_extraction_and_reward():
    solution = "Natalia sold 48/2 = 24 clips in May.\nAltogether 48+24 = 72 clips.\n#### 72"
    assert extract_gsm8k_answer(solution) == 72.0
    assert extract_gsm8k_answer("costs $1,234.50 total") == 1234.5
    assert extract_gsm8k_answer("nothing") is None
    assert gsm8k_reward(sample("so 48+24=72\n#### 72", solution)) == 1.0
    assert gsm8k_reward(sample("#### $1,000", "1000")) == 1.0
    assert gsm8k_reward(sample("I think 3, then 72.", "72")) == 1.0  # falls back to the last number
    assert gsm8k_reward(sample("#### 71", solution)) == 0.0
    assert gsm8k_reward(sample("#### -5", "-5")) == 1.0
    assert gsm8k_reward(sample("no number", "5")) == 0.0
    with pytest.raises(ValueError, match="no number"):
        gsm8k_reward(sample("#### 5", "five"))


def test_exact():
    assert exact_match(sample("  Paris \n", "Paris")) == 1.0
    assert exact_match(sample("paris", "Paris")) == 0.0
    assert exact_match(sample("4", 4)) == 1.0


# ---- resolution ----

def test_builtin_table_is_plain_strings():
    assert REWARD_FUNCTIONS["arithmetic"] == "polyrl.tasks.arithmetic:reward"
    assert all(isinstance(v, str) and ":" in v for v in REWARD_FUNCTIONS.values())
    assert resolve_reward_fn("math", None) is math_reward
    assert resolve_reward_fn("gsm8k", None) is gsm8k_reward
    assert resolve_reward_fn("exact", None) is exact_match


def test_resolve_errors_name_the_flags(tmp_path):
    with pytest.raises(ValueError, match=r"--rm-type 'nope' is unknown; valid: math, gsm8k, exact"):
        resolve_reward_fn("nope", None)
    with pytest.raises(ValueError, match="--rm-type .* or --custom-rm-path"):
        resolve_reward_fn(None, None)
    with pytest.raises(ValueError, match=r"--custom-rm-path 'no_such_mod_xyz:f': could not import"):
        resolve_reward_fn(None, "no_such_mod_xyz:f")
    with pytest.raises(ValueError, match="--custom-rm-path .*expected"):
        resolve_reward_fn(None, "just_a_module")
    with pytest.raises(ValueError, match=r"could not import .*missing\.py"):
        resolve_reward_fn(None, f"{tmp_path}/missing.py:f")
    bad = write_module(tmp_path, "broken", "raise RuntimeError('boom at import')\n")
    with pytest.raises(ValueError, match="RuntimeError: boom at import"):
        resolve_reward_fn(None, f"{bad}:f")
    ok = write_module(tmp_path, "ok_rm", "def f(s):\n    return 1.0\n")
    with pytest.raises(ValueError, match="has no function 'g'"):
        resolve_reward_fn(None, f"{ok}:g")


def test_custom_path_from_file_and_module(tmp_path, monkeypatch):
    path = write_module(tmp_path, "my_rm", "def length_reward(sample):\n    return len(sample.response) / 10\n")
    fn = resolve_reward_fn("math", f"{path}:length_reward")  # the custom path wins over --rm-type
    assert fn(sample("abcde")) == 0.5
    monkeypatch.syspath_prepend(str(tmp_path))
    assert resolve_reward_fn(None, "my_rm:length_reward")(sample("ab")) == 0.2


# ---- RewardManager ----

def test_manager_scores_builtin_and_reports_metrics():
    samples = [sample(r"\boxed{2}", "2"), sample(r"\boxed{3}", "2"), sample("none", "2"), sample(r"\boxed{2}", 2)]
    metrics = RewardManager("math").score(samples)
    assert [s.reward for s in samples] == [1.0, 0.0, 0.0, 1.0]
    assert metrics == {"reward/mean": 0.5, "reward/errors": 0.0, "reward/timeouts": 0.0, "reward/accuracy": 0.5,
                       "reward/samples": 4.0, "reward/zeros": 2.0}


def test_manager_isolates_raising_and_invalid_returns(tmp_path, caplog):
    path = write_module(tmp_path, "flaky", (
        "def f(s):\n"
        "    if s.response == 'raise':\n"
        "        raise KeyError('bad sample')\n"
        "    return {'nan': float('nan'), 'none': None, 'str': '1.0', 'inf': float('inf'),\n"
        "            'true': True, 'int': 1}.get(s.response, 0.25)\n"
    ))
    rm = RewardManager(None, f"{path}:f")
    samples = [sample(r) for r in ["raise", "nan", "none", "str", "inf", "true", "int", "ok"]]
    with caplog.at_level(logging.WARNING, logger="polyrl.rewards"):
        metrics = rm.score(samples)
        rm.score([sample("raise")])
    assert [s.reward for s in samples] == [0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.25]
    assert metrics["reward/errors"] == 5.0 and rm.errors_total == 6
    assert metrics["reward/accuracy"] == 2 / 8
    warnings = [r for r in caplog.records if r.name == "polyrl.rewards"]
    assert len(warnings) == 1 and warnings[0].exc_info is not None
    assert "KeyError: 'bad sample'" in caplog.text  # the first traceback, once


def test_manager_awaits_async_functions_concurrently(tmp_path):
    # Each call waits (bounded) until all 11 have started: calls awaited in series would each see only themselves,
    # so the most calls in flight at once is 11 when they run concurrently and 1 when they do not.
    path = write_module(tmp_path, "async_rm", (
        "import asyncio\n"
        "state = {'started': 0, 'in_flight': 0, 'max_in_flight': 0}\n"
        "async def f(s):\n"
        "    state['started'] += 1\n"
        "    state['in_flight'] += 1\n"
        "    state['max_in_flight'] = max(state['max_in_flight'], state['in_flight'])\n"
        "    for _ in range(200):  # at most ~2 s: a serial caller fails the assertion below, it does not hang\n"
        "        if state['started'] == 11:\n"
        "            break\n"
        "        await asyncio.sleep(0.01)\n"
        "    state['in_flight'] -= 1\n"
        "    if s.response == 'raise':\n"
        "        raise RuntimeError('async boom')\n"
        "    return float(s.label)\n"
    ))
    rm = RewardManager(None, f"{path}:f")
    samples = [sample("x", i % 2) for i in range(10)] + [sample("raise", 1)]
    metrics = rm.score(samples)
    assert rm.fn.__globals__["state"] == {"started": 11, "in_flight": 0, "max_in_flight": 11}
    assert [s.reward for s in samples] == [float(i % 2) for i in range(10)] + [0.0]
    assert metrics["reward/errors"] == 1.0


def test_manager_async_inside_a_running_event_loop(tmp_path):
    path = write_module(tmp_path, "async_rm2", "async def f(s):\n    return 1.0\n")
    rm = RewardManager(None, f"{path}:f")
    samples = [sample("x"), sample("y")]

    async def caller():
        return rm.score(samples)

    assert asyncio.run(caller())["reward/mean"] == 1.0


def test_group_rm(tmp_path):
    path = write_module(tmp_path, "group_rm", (
        "def rank(samples):\n"
        "    if samples[0].group_index == 1:\n"
        "        return [1.0]  # wrong length for a group of 2\n"
        "    if samples[0].group_index == 2:\n"
        "        raise ValueError('group boom')\n"
        "    return [float(i) for i, _ in enumerate(samples)]\n"
    ))
    rm = RewardManager(None, f"{path}:rank", group_rm=True)
    samples = [sample("a", group_index=g) for g in [0, 1, 0, 2, 1, 0]]
    metrics = rm.score(samples)
    assert [s.reward for s in samples] == [0.0, 0.0, 1.0, 0.0, 0.0, 2.0]
    assert metrics["reward/errors"] == 3.0


def test_async_group_rm(tmp_path):
    path = write_module(tmp_path, "async_group_rm", (
        "async def f(samples):\n"
        "    return [len(samples)] * len(samples)\n"
    ))
    samples = [sample("a", group_index=g) for g in [0, 0, 1]]
    RewardManager(None, f"{path}:f", group_rm=True).score(samples)
    assert [s.reward for s in samples] == [2.0, 2.0, 1.0]


def test_group_rm_needs_a_custom_function():
    with pytest.raises(ValueError, match="--group-rm needs --custom-rm-path"):
        RewardManager("math", group_rm=True)


# ---- --rm-timeout ----

STUCK = (
    "import asyncio, time\n"
    "def sync_f(s):\n"
    "    if s.response == 'hang':\n"
    "        time.sleep(3600)\n"
    "    return 1.0\n"
    "async def async_f(s):\n"
    "    if s.response == 'hang':\n"
    "        await asyncio.sleep(3600)\n"
    "    return 1.0\n"
    "async def blocks_its_loop(s):\n"
    "    if s.response == 'hang':\n"
    "        time.sleep(3600)  # never yields: only the caller's own deadline gets out of this\n"
    "    return 1.0\n"
    "async def ignores_cancel(s):\n"
    "    while True:\n"
    "        try:\n"
    "            await asyncio.sleep(3600)\n"
    "        except asyncio.CancelledError:\n"
    "            pass\n"
    "def sync_group(samples):\n"
    "    if samples[0].group_index == 1:\n"
    "        time.sleep(3600)\n"
    "    return [1.0] * len(samples)\n"
    "async def async_group(samples):\n"
    "    if samples[0].group_index == 1:\n"
    "        await asyncio.sleep(3600)\n"
    "    return [1.0] * len(samples)\n"
)


@pytest.mark.parametrize("fn", ["sync_f", "async_f"])
def test_a_stuck_call_times_out_scores_zero_and_the_rest_go_on(tmp_path, caplog, fn):
    path = write_module(tmp_path, f"stuck_{fn}", STUCK)
    rm = RewardManager(None, f"{path}:{fn}", timeout=0.3)
    samples = [sample("a"), sample("hang", group_index=1), sample("b", group_index=2)]
    with caplog.at_level(logging.WARNING, logger="polyrl.rewards"):
        metrics = bounded(lambda: rm.score(samples), "scoring with one hour-long call")
        again = bounded(lambda: rm.score([sample("hang"), sample("c")]), "a fresh call after an abandoned one")
    assert [s.reward for s in samples] == [1.0, 0.0, 1.0]
    assert metrics["reward/timeouts"] == 1.0 and metrics["reward/errors"] == 0.0
    assert again["reward/timeouts"] == 1.0 and again["reward/mean"] == 0.5 and rm.timeouts_total == 2
    warnings = [r.getMessage() for r in caplog.records if "--rm-timeout" in r.getMessage()]
    assert len(warnings) == 1 and "group 1" in warnings[0] and "'hang'" in warnings[0]  # the first one, with its sample


@pytest.mark.parametrize("fn", ["ignores_cancel", "blocks_its_loop"])
def test_async_call_that_ignores_cancellation_or_blocks_its_loop_still_returns(tmp_path, fn):
    """Neither can be stopped from outside: the caller's own deadline returns without them. A call
    that blocks the event loop stalls the calls sharing it, which time out with it."""
    rm = RewardManager(None, f"{write_module(tmp_path, f'stuck_{fn}', STUCK)}:{fn}", timeout=0.3)
    assert bounded(lambda: rm.score([sample("hang"), sample("hang")]), f"{fn} x2")["reward/timeouts"] == 2.0
    assert bounded(lambda: rm.score([sample("hang")]), f"{fn} again")["reward/timeouts"] == 1.0


@pytest.mark.parametrize("fn", ["sync_group", "async_group"])
def test_group_rm_timeout_zeroes_that_group(tmp_path, fn):
    rm = RewardManager(None, f"{write_module(tmp_path, f'stuck_{fn}', STUCK)}:{fn}", group_rm=True, timeout=0.3)
    samples = [sample("a", group_index=g) for g in [0, 1, 0, 1, 2]]
    metrics = bounded(lambda: rm.score(samples), f"{fn} with one hour-long group")
    assert [s.reward for s in samples] == [1.0, 0.0, 1.0, 0.0, 1.0]
    assert metrics["reward/timeouts"] == 2.0 and metrics["reward/errors"] == 0.0  # counted per sample


def test_a_stuck_reward_call_does_not_block_process_exit(tmp_path):
    path = write_module(tmp_path, "stuck_exit", STUCK)
    code = ("import sys; from polyrl.rewards import RewardManager; from polyrl.types import Sample\n"
            f"rm = RewardManager(None, {str(path) + ':sync_f'!r}, timeout=0.2)\n"
            "s = Sample(prompt_ids=[1], response_ids=[2], rollout_logprobs=[0.0], finish_reason='stop', response='hang')\n"
            "print(rm.score([s])['reward/timeouts'])\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "1.0", out.stderr


def test_no_timeout_runs_sync_functions_inline():
    rm = RewardManager(None, "polyrl.rewards:exact_match", timeout=0)
    assert rm.timeout is None
    s = sample("x", "x")
    assert rm.score([s])["reward/mean"] == 1.0


def test_sync_calls_go_in_one_hand_off_each_with_its_own_deadline():
    """The helper thread gets all calls of a step at once; the deadline is per call (five 0.1 s calls under a 0.3 s
    timeout all finish: a deadline for the batch would cut the fourth), a stuck call is abandoned and the ones after it
    run on a fresh thread, in order, once each."""
    from polyrl.rewards import TIMED_OUT, _DaemonCaller
    calls: list[tuple[int, threading.Thread]] = []
    release = threading.Event()

    def fn(i):
        calls.append((i, threading.current_thread()))
        if i == 2:
            release.wait(30)  # stuck until the test lets it go (bounded: the thread ends either way)
            return "late"
        time.sleep(0.1 if i < 0 else 0)
        return i * 10

    caller = _DaemonCaller()
    assert caller.map(fn, [-1, -2, -3, -4, -5], 0.3) == [-10, -20, -30, -40, -50]  # 0.5 s in all, none > 0.3 s
    threads = {t for _, t in calls}
    assert {t.name for t in threads} == {"polyrl-reward"} and len(threads) == 1  # one hand-off: one thread ran them all
    calls.clear()
    out = caller.map(fn, [0, 1, 2, 3, 4], 0.3)  # had it waited for the stuck call, 2 would be "late" after 30 s
    assert out == [0, 10, TIMED_OUT, 30, 40]
    stuck = dict(calls)[2]
    assert dict(calls)[3] is dict(calls)[4] is not stuck  # the calls after it went to a fresh thread
    release.set()  # the abandoned call returns now: its thread must end without running 3 or 4 again
    stuck.join(10)
    assert not stuck.is_alive(), "the abandoned reward thread did not end within 10 s of its call returning"
    assert sorted(i for i, _ in calls) == [0, 1, 2, 3, 4]
    assert caller.map(fn, [7], 0.3) == [70]  # a single call goes through the same path
