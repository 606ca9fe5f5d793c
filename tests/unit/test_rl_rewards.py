"""The reward functions of --objective grpo (shardtune.rl.rewards): naming them (built-ins, module:function,
path/to/file.py:function), every problem of the flags in one line each, the call with TRL's keywords, None as NaN,
the weighted total as TRL's GRPOTrainer computes it, and the one-line failures: a raising function (the first
failing row found), a wrong result, a slow function (the SIGALRM deadline, the previous handler put back)."""

from __future__ import annotations

import importlib.util
import logging
import math
import signal
import sys
import threading
import time

import pytest
import torch

from shardtune.rl import rewards
from shardtune.rl.rewards import (
    RewardError,
    RewardFunction,
    RewardLog,
    combine_rewards,
    compute_rewards,
    load_reward_functions,
    reward_problems,
)

HAS_MATH_VERIFY = importlib.util.find_spec("math_verify") is not None


def _score(funcs, completions, *, prompts=None, columns=None, row_ids=None, timeout_s=5.0, **kw):
    n = len(completions)
    return compute_rewards(
        funcs,
        prompts=prompts if prompts is not None else [f"prompt {i}" for i in range(n)],
        completions=completions,
        completion_ids=[[i, i + 1] for i in range(n)],
        columns=columns or {},
        row_ids=row_ids if row_ids is not None else list(range(n)),
        timeout_s=timeout_s,
        **kw,
    )


def _fn(fn, name="f", weight=1.0):
    return RewardFunction(name, fn, weight)


# --- naming the functions -----------------------------------------------------------------------------------------

REWARD_MODULE = """
def length(completions, **kwargs):
    return [float(len(c)) for c in completions]

def helper(x, **kwargs):
    return x

NOT_A_FUNCTION = 3

def no_kwargs(completions):
    return [1.0] * len(completions)
"""


@pytest.fixture
def reward_module(tmp_path, monkeypatch):
    """A package `my_rewards_pkg.scores` importable through sys.path, and the same code as a file."""
    pkg = tmp_path / "lib" / "my_rewards_pkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "scores.py").write_text(REWARD_MODULE)
    (tmp_path / "file_rewards.py").write_text(REWARD_MODULE.replace("float(len(c))", "2.0 * len(c)"))
    monkeypatch.syspath_prepend(str(tmp_path / "lib"))
    monkeypatch.chdir(tmp_path)
    yield tmp_path
    sys.modules.pop("my_rewards_pkg.scores", None)
    sys.modules.pop("my_rewards_pkg", None)


def test_each_spec_form_resolves_and_is_called(reward_module):
    specs = [
        "format",
        "my_rewards_pkg.scores:length",
        "file_rewards.py:length",
        f"{reward_module}/file_rewards.py:length",
    ]
    assert reward_problems(specs, None) == []
    funcs = load_reward_functions(specs, None)
    assert [f.name for f in funcs] == specs
    assert [f.weight for f in funcs] == [1.0] * 4  # TRL's default: 1.0 each
    assert funcs[0].fn is rewards.BUILTINS["format"]
    out = _score(funcs, ["<think>a</think>b", "xyz"])
    assert out.tolist() == [[1.0, 17.0, 34.0, 34.0], [0.0, 3.0, 6.0, 6.0]]
    # A file is loaded once per path: the relative and the absolute spelling give the same function.
    assert funcs[2].fn is funcs[3].fn
    assert [f.weight for f in load_reward_functions(["format", "exact_answer"], [0.5, -2])] == [0.5, -2.0]


def test_a_module_beside_the_command_is_found(tmp_path, monkeypatch):
    """As TRL's CLI: the working directory is searched for `module:function`."""
    (tmp_path / "cwd_rewards_mod.py").write_text(REWARD_MODULE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    try:
        assert reward_problems(["cwd_rewards_mod:length"], None) == []
    finally:
        sys.modules.pop("cwd_rewards_mod", None)


@pytest.mark.parametrize(
    "spec, words",
    [
        (
            "nosuch_module_xyz:length",
            ["--reward_funcs 'nosuch_module_xyz:length'", "module 'nosuch_module_xyz' not found", "install it"],
        ),
        (
            "missing.py:length",
            ["--reward_funcs 'missing.py:length'", "file 'missing.py' not found", "give a file's path"],
        ),
        ("my_rewards_pkg.scores:nope", ["'nope'", "it defines: length, helper, no_kwargs", "name one of them"]),
        ("file_rewards.py:nope", ["'file_rewards.py' has no 'nope'", "length"]),
        ("my_rewards_pkg.scores:NOT_A_FUNCTION", ["'NOT_A_FUNCTION' is a int, not a function", "name a function"]),
        ("my_rewards_pkg.scores:no_kwargs", ["takes no **kwargs", "completion_ids=", "add **kwargs"]),
        (
            "accuracy",
            ["--reward_funcs 'accuracy'", "no built-in", "format, exact_answer, math_answer", "module:function"],
        ),
        ("my_rewards_pkg.scores.length", ["did you mean 'my_rewards_pkg.scores:length'?"]),
        ("broken.py:f", ["loading 'broken.py' raised SyntaxError", "fix the file"]),
        ("needs_dep.py:f", ["raised ModuleNotFoundError", "no_such_dep_abc", "fix the file"]),
    ],
)
def test_every_spec_problem_names_the_flag_the_value_and_the_fix(reward_module, spec, words):
    (reward_module / "broken.py").write_text("def f(:\n")
    (reward_module / "needs_dep.py").write_text("import no_such_dep_abc\n")
    [problem] = reward_problems([spec], None)
    assert problem.startswith(f"--reward_funcs {spec!r}")
    for w in words:
        assert w in problem
    with pytest.raises(ValueError) as e:
        load_reward_functions([spec], None)
    assert str(e.value) == problem


def test_weight_and_count_problems_are_all_reported():
    problems = reward_problems(["format", "format", "exact_answer", "nope"], [1.0, 2.0, float("nan"), math.inf])
    assert problems[0] == "--reward_funcs 'format' is given twice; name it once (weigh it with --reward_weights)"
    assert problems[1].startswith("--reward_funcs 'nope'")
    assert problems[2:] == [
        "--reward_weights value nan (for 'exact_answer') is not a finite number; give a finite number",
        "--reward_weights value inf (for 'nope') is not a finite number; give a finite number",
    ]
    many = "--reward_weights has 1 values for 2 --reward_funcs; give one weight per function, in the same order "
    assert reward_problems(["format", "exact_answer"], [1.0]) == [many + "(or none: 1.0 each)"]
    [none] = reward_problems([], None)
    assert none.startswith("--reward_funcs: no reward function given") and "format" in none
    assert reward_problems(["format", "exact_answer"], [1.0, -0.5]) == []  # a penalty is a weight


def test_math_answer_without_math_verify_says_how_to_install_it(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "math_verify" else real(name, *a))
    assert reward_problems(["math_answer"], None) == [
        "--reward_funcs 'math_answer' needs the math-verify package; install it: pip install math-verify"
    ]
    assert reward_problems(["exact_answer"], None) == []  # control: the others need nothing


# --- the call -----------------------------------------------------------------------------------------------------


def test_the_call_passes_trls_keywords_and_collects_the_logs():
    seen = {}

    def spy(**kwargs):
        seen.update(kwargs)
        kwargs["log_extra"]("parsed", ["a", "b"])
        kwargs["log_metric"]("spy/x", 0.5)
        return [1.0, None]

    log, state = RewardLog(), object()
    prompts = [[{"role": "user", "content": "q1"}], [{"role": "user", "content": "q2"}]]
    completions = [[{"role": "assistant", "content": "a1"}], [{"role": "assistant", "content": "a2"}]]
    columns = {"answer": ["1", "2"], "prompt": prompts, "source": ["x", "y"]}
    out = _score([_fn(spy)], completions, prompts=prompts, columns=columns, trainer_state=state, log=log)
    assert sorted(seen) == sorted(
        ["prompts", "completions", "completion_ids", "answer", "source", "trainer_state", "log_extra", "log_metric"]
    )  # TRL: every column but prompt/completion/completion_ids; no environments
    assert seen["prompts"] == prompts and seen["completions"] == completions and seen["answer"] == ["1", "2"]
    assert seen["completion_ids"] == [[0, 1], [1, 2]] and seen["trainer_state"] is state
    assert log.extra == {"parsed": ["a", "b"]} and log.metrics == {"spy/x": [0.5]}
    assert out.dtype == torch.float32 and out.shape == (2, 1)
    assert out[0, 0].item() == 1.0 and math.isnan(out[1, 0].item())  # None -> NaN


def test_results_as_tensors_bools_and_async_functions_are_read():
    async def later(completions, **kwargs):
        return [0.25] * len(completions)

    funcs = [
        _fn(lambda completions, **k: torch.tensor([1.0, 2.0]), "tensor"),
        _fn(lambda completions, **k: (True, False), "bools"),
        _fn(later, "async"),
    ]
    assert _score(funcs, ["a", "b"]).tolist() == [[1.0, 1.0, 0.25], [2.0, 0.0, 0.25]]


def test_rows_every_function_left_out_are_warned_about(caplog):
    funcs = [_fn(lambda completions, **k: [None, 1.0, None], "a"), _fn(lambda completions, **k: [None, None, 2.0], "b")]
    with caplog.at_level(logging.WARNING, logger="shardtune"):
        out = _score(funcs, ["x", "y", "z"], prompts=["What is 2+2?", "p", "q"], row_ids=[40, 41, 42])
    assert torch.isnan(out).all(dim=1).tolist() == [True, False, False]
    [record] = [r.getMessage() for r in caplog.records]
    assert "every reward function returned None for 1 of 3 completions" in record
    assert "dataset row 40 (prompt 'What is 2+2?')" in record
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="shardtune"):
        _score([funcs[0], _fn(lambda completions, **k: [0.0, None, 1.0])], ["x", "y", "z"])  # control: all scored
    assert caplog.records == []


# --- the weighted total -------------------------------------------------------------------------------------------


def _trl_total(rows: list[list[float]], weights: list[float]) -> list[float]:
    """TRL 1.16 GRPOTrainer._generate_and_score_completions, written out: the weighted sum over the functions that
    scored the row (nansum), NaN for a row none scored ("unscorable")."""
    out = []
    for row in rows:
        scored = [w * r for r, w in zip(row, weights) if not math.isnan(r)]
        out.append(sum(scored) if scored else math.nan)
    return out


def test_combine_rewards_is_trls_weighted_nansum():
    nan = math.nan
    rows = [[1.0, 0.5, 2.0], [nan, 1.0, 0.0], [nan, nan, nan], [0.0, nan, -1.0], [3.0, 3.0, 3.0]]
    weights = [1.0, -2.0, 0.5]
    got = combine_rewards(torch.tensor(rows), torch.tensor(weights)).tolist()
    want = _trl_total(rows, weights)
    assert [None if math.isnan(x) else round(x, 6) for x in got] == [
        None if math.isnan(x) else round(x, 6) for x in want
    ]
    assert math.isnan(got[2]) and got[1] == -2.0
    # Negative control: a sum that counts NaN as 0 everywhere gives the unscorable row 0, not NaN.
    assert torch.nan_to_num(torch.tensor(rows)).mul(torch.tensor(weights)).sum(1)[2].item() == 0.0


def test_combine_rewards_reads_loaded_weights():
    funcs = load_reward_functions(["format", "exact_answer"], [2.0, 0.5])
    out = _score(funcs, ["<think>.</think>4", "5"], columns={"answer": ["4", "4"]})
    assert out.tolist() == [[1.0, 1.0], [0.0, 0.0]]
    assert combine_rewards(out, torch.tensor([f.weight for f in funcs])).tolist() == [2.5, 0.0]


# --- failures, in one line ----------------------------------------------------------------------------------------


def test_a_raising_function_is_rerun_to_name_its_first_failing_row():
    def picky(completions, **kwargs):
        for c in completions:
            if c == "bad":
                raise ValueError(f"cannot score {c!r}")
        return [1.0] * len(completions)

    prompts = ["p0", "p0", "What is 2+2? Think step by step and answer in full sentences.", "p1", "p2", "p2"]
    completions = ["ok", "ok", "bad", "bad", "ok", "ok"]
    with pytest.raises(RewardError) as e:
        _score([_fn(picky, "picky")], completions, prompts=prompts, row_ids=[10, 10, 17, 11, 12, 12])
    assert str(e.value) == (
        "reward function 'picky' raised ValueError(\"cannot score 'bad'\") on dataset row 17 (prompt 'What is 2+2? "
        "Think step by step and answ...'); fix the function or the row"
    )
    assert "\n" not in str(e.value)


def test_a_batch_only_failure_names_the_batch():
    def needs_two(completions, **kwargs):
        if len(completions) < 2:
            raise RuntimeError("batch too small")
        raise KeyError("always on the batch")

    with pytest.raises(RewardError) as e:
        _score([_fn(needs_two, "needs_two")], ["a", "b", "c"], row_ids=[4, 5, 6])
    assert str(e.value) == (
        "reward function 'needs_two' raised RuntimeError('batch too small') on dataset row 4 (prompt 'prompt 0'); "
        "fix the function or the row"
    )

    def batch_only(completions, **kwargs):
        if len(completions) > 1:
            raise KeyError("only on the batch")
        return [0.0]

    with pytest.raises(RewardError) as e:
        _score([_fn(batch_only, "batch_only")], ["a", "b", "c"], row_ids=[4, 9, 30])
    assert str(e.value) == (
        "reward function 'batch_only' raised KeyError('only on the batch') on dataset rows 4, 9, 30, though no row "
        "raises alone; fix the function"
    )


@pytest.mark.parametrize(
    "result, message",
    [
        ([1.0], "returned 1 rewards for 3 completions on dataset rows 7..9; return one per completion"),
        (0.5, "returned 0.5 (a float) on dataset rows 7..9, not a list"),
        ([1.0, "yes", 0.0], "returned 'yes' (a str) for dataset row 8 (prompt 'prompt 1'); return a finite number"),
        ([1.0, 0.0, math.nan], "returned nan for dataset row 9 (prompt 'prompt 2'); return a finite number, or None"),
        ([math.inf, 0.0, 1.0], "returned inf for dataset row 7 (prompt 'prompt 0')"),
        ([1.0, [1.0], 0.0], "returned [1.0] (a list) for dataset row 8"),
    ],
)
def test_a_wrong_result_names_the_function_and_the_row(result, message):
    with pytest.raises(RewardError) as e:
        _score([_fn(lambda **k: result, "mine")], ["a", "b", "c"], row_ids=[7, 8, 9])
    assert str(e.value).startswith("reward function 'mine' ")
    assert message in str(e.value)


def _sentinel(signum, frame):
    raise AssertionError("the outer timer fired")


def test_a_slow_function_times_out_and_the_previous_handler_stays():
    def slow(completions, **kwargs):
        time.sleep(10)
        return [1.0] * len(completions)

    previous = signal.signal(signal.SIGALRM, _sentinel)
    try:
        start = time.monotonic()
        with pytest.raises(RewardError) as e:
            _score([_fn(slow, "slow")], ["a", "b"], row_ids=[3, 4], timeout_s=0.2)
        assert time.monotonic() - start < 2.0
        assert str(e.value) == (
            "reward function 'slow' took longer than 0.2 s on dataset rows 3..4 (--reward_timeout); speed it up or "
            "raise the limit"
        )
        assert signal.getsignal(signal.SIGALRM) is _sentinel
        assert signal.getitimer(signal.ITIMER_REAL)[0] == 0.0
        # Control: a fast function under the same limit is scored.
        assert _score([_fn(lambda completions, **k: [1.0, 1.0])], ["a", "b"], timeout_s=0.2).tolist() == [[1.0], [1.0]]
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def test_a_deadline_nests_inside_an_outer_timer():
    """An outer one-shot timer set before the call still fires on time after it (less the time spent)."""
    fired = []
    previous = signal.signal(signal.SIGALRM, lambda s, f: fired.append(time.monotonic()))
    try:
        start = time.monotonic()
        signal.setitimer(signal.ITIMER_REAL, 0.5)
        _score([_fn(lambda completions, **k: [0.0] * len(completions))], ["a"], timeout_s=30)
        assert 0.3 < signal.getitimer(signal.ITIMER_REAL)[0] <= 0.5
        while not fired and time.monotonic() - start < 3:
            time.sleep(0.01)
        assert fired and 0.45 < fired[0] - start < 1.5
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def test_a_function_that_swallows_the_timeout_still_times_out():
    def stubborn(completions, **kwargs):
        try:
            time.sleep(10)
        except BaseException:  # noqa: BLE001, S110 - what a careless reward function does
            pass
        return [1.0] * len(completions)

    with pytest.raises(RewardError, match="took longer than 0.1 s"):
        _score([_fn(stubborn, "stubborn")], ["a"], timeout_s=0.1)


def test_the_timeout_waits_for_an_import_to_end(tmp_path, monkeypatch):
    """Raising inside an import may abort the process (shardtune.runtime.signals): the deadline lands after it."""
    (tmp_path / "slow_import_mod_xyz.py").write_text("import time\ntime.sleep(0.4)\nDONE = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))

    def imports(completions, **kwargs):
        import slow_import_mod_xyz  # noqa: F401 - the import the deadline falls in

        time.sleep(10)
        return [1.0] * len(completions)

    try:
        with pytest.raises(RewardError, match="took longer than 0.1 s"):
            _score([_fn(imports, "imports")], ["a"], timeout_s=0.1)
        assert sys.modules["slow_import_mod_xyz"].DONE  # the import ran to its end
    finally:
        sys.modules.pop("slow_import_mod_xyz", None)


def test_off_the_main_thread_there_is_no_timeout():
    def slowish(completions, **kwargs):
        time.sleep(0.3)
        return [1.0] * len(completions)

    result = {}
    thread = threading.Thread(target=lambda: result.update(out=_score([_fn(slowish)], ["a"], timeout_s=0.05)))
    thread.start()
    thread.join()
    assert result["out"].tolist() == [[1.0]]


# --- the built-ins ------------------------------------------------------------------------------------------------

FORMAT_CASES = [
    "<think>\nThis is my reasoning.\n</think>\nThis is my answer.",
    "<think>\nThis is my reasoning.\nThis is my answer.",
    "<think>a</think>",
    "<think></think><answer>4</answer>",
    " <think>a</think>b",
    "Answer first <think>a</think>",
    "<think>a<think>b</think>c",
    "<think>a</think>b<think>c</think>",
    "<think>multi\nline\n\nthought</think>\n\n<answer>\n42\n</answer>",
    "",
    "</think><think>",
    "<THINK>a</THINK>",
    "<think>a</think>\n<think>",
    "<think>\n</think>",
]


def test_format_agrees_with_trls_think_format_reward():
    from trl.rewards import think_format_reward

    conversational = [[{"role": "assistant", "content": s}] for s in FORMAT_CASES]
    ours = rewards.format_reward(conversational)
    assert ours == think_format_reward(conversational)
    assert rewards.format_reward(FORMAT_CASES) == ours  # plain-text completions read the same
    assert 0 < sum(ours) < len(ours)  # control: the cases tell both verdicts apart
    assert ours[:3] == [1.0, 0.0, 1.0]


@pytest.mark.parametrize(
    "completion, gold, expected",
    [
        ("<think>2+2</think><answer> 4 </answer>", "4", 1.0),
        ("<answer>3</answer> then <answer>4</answer>", "4", 1.0),  # the last answer tag
        ("<answer>3</answer>", "4", 0.0),
        ("so the result is \\boxed{\\frac{1}{2}}", "\\frac{1}{2}", 1.0),
        ("she has 1,000 apples. #### 1,000", "Natalia sold 1000 clips.\n#### 1000", 1.0),  # GSM8K's gold
        ("The answer is 72.", "72", 1.0),  # a number gold: the last number
        ("The answer is 72.0 and not 71", "72", 0.0),
        ("The answer is $72.00", "72", 1.0),
        ("Thinking...\n  the capital is PARIS.  ", "the capital is paris", 1.0),  # the last line, case, period
        ("Paris", "London", 0.0),
        ("<answer>Paris</answer>", None, None),
    ],
)
def test_exact_answer(completion, gold, expected):
    assert rewards.exact_answer_reward([completion], answer=[gold]) == [expected]
    assert rewards.exact_answer_reward([[{"role": "assistant", "content": completion}]], solution=[gold]) == [expected]


def test_exact_answer_without_an_answer_column_is_none():
    assert rewards.exact_answer_reward(["4", "5"]) == [None, None]
    out = _score(load_reward_functions(["exact_answer"], None), ["4", "5"], columns={"question": ["a", "b"]})
    assert torch.isnan(out).all()


MATH_CASES = [
    ("My answer is \\boxed{\\frac{1}{3}}", "$\\frac{1}{3}$"),
    ("My answer is \\boxed{\\frac{1}{2}}", "$\\frac{1}{3}$"),
    ("So $x = \\boxed{0.5}$", "$\\frac{1}{2}$"),
    ("\\boxed{2\\sqrt{2}}", "$\\sqrt{8}$"),
    ("no latex here: 5", "$5$"),
    ("\\boxed{5}", "not math at all"),
]


@pytest.mark.skipif(not HAS_MATH_VERIFY, reason="math-verify is not installed (pip install math-verify)")
def test_math_answer_agrees_with_trls_accuracy_reward():
    from trl.rewards import accuracy_reward

    completions = [[{"role": "assistant", "content": c}] for c, _ in MATH_CASES]
    solutions = [s for _, s in MATH_CASES]
    ours = rewards.math_answer_reward(completions, solution=solutions)
    assert ours == accuracy_reward(completions, solutions)
    assert ours[:3] == [1.0, 0.0, 1.0] and None in ours  # control: right, wrong and unparseable gold all occur
    # Called through compute_rewards under --reward_timeout: its bounded parses leave the deadline working.
    out = _score(
        load_reward_functions(["math_answer"], None), [c for c, _ in MATH_CASES], columns={"answer": solutions}
    )
    assert [None if math.isnan(x) else x for x in out[:, 0].tolist()] == ours
    assert signal.getitimer(signal.ITIMER_REAL)[0] == 0.0


def test_bounded_returns_the_default_past_its_time():
    assert rewards.bounded(0.1, time.sleep, "late", 5) == "late"
    assert rewards.bounded(1.0, lambda: "done", "late") == "done"
    assert rewards.bounded(None, lambda: "done", "late") == "done"
