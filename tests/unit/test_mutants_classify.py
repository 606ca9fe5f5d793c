"""The mutation bench's reading of pytest's junit XML (bench/mutants.py): why each test failed, an assertion or a
crash, and a mutant's outcome from its clean and its planted run. The XML below is what pytest 9 writes for each
kind of failure (its `message` attribute and the traceback's `>`/`E` lines)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _bench():
    spec = importlib.util.spec_from_file_location("shardtune_mutants_bench", ROOT / "bench" / "mutants.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


B = _bench()


def _case(name: str, tag: str = "", message: str = "", text: str = "") -> str:
    inner = f'<{tag} message="{_esc(message)}">{_esc(text)}</{tag}>' if tag else ""
    return f'<testcase classname="tests.t" name="{name}" time="0.1">{inner}</testcase>'


def _esc(s: str) -> str:
    return (
        s.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace('"', "&quot;").replace("\n", "&#10;")
    )


def _xml(*cases: str) -> str:
    body = "".join(cases)
    return f'<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">{body}</testsuite></testsuites>'


# (name, junit element, message, traceback text) → (cause, why)
FAILURES = [
    ("plain_assert", "failure", "assert [1] == [2]\n  At index 0 diff", ">       assert [1] == [2]\nE       assert", "assertion", "assert"),
    ("assert_msg", "failure", "AssertionError: msg\nassert 1 == 2", '>       assert x == 2, "msg"', "assertion", "AssertionError"),
    ("close", "failure", "AssertionError: Tensor-likes are not close!", ">       torch.testing.assert_close(a, b)", "assertion", "AssertionError"),
    ("raises", "failure", "Failed: DID NOT RAISE ValueError", ">       with pytest.raises(ValueError):", "assertion", "Failed"),
    # Negative controls of the words: an assertion that quotes an exception's name is still an assertion, and an
    # exception whose text says "assert" is still a crash.
    ("assert_quotes", "failure", "AssertionError: expected RuntimeError: boom", ">       assert got == want, msg", "assertion", "AssertionError"),
    ("runtime", "failure", "RuntimeError: assert failed in the kernel", '>       raise RuntimeError("x")', "crash", "RuntimeError"),
    ("run_cli_exit", "failure", "AssertionError: python -m shardtune train failed (1):\nTraceback\nValueError: bad rows",
     ">       raise AssertionError(", "crash", "subprocess exit 1 (ValueError)"),
    ("returncode", "failure", "AssertionError: Traceback (most recent call last):\n  ValueError: bad",
     ">       assert p.returncode == 0, err[-4000:]\nE       AssertionError: Traceback\nE       ValueError: bad", "crash",
     "subprocess exit (ValueError)"),
    ("called", "failure", "subprocess.CalledProcessError: Command '['x']' returned non-zero exit status 3.",
     ">       subprocess.run(cmd, check=True)", "crash", "subprocess.CalledProcessError"),
    ("timeout", "failure", "subprocess.TimeoutExpired: Command 'x' timed out after 600 seconds", ">  p.communicate()", "crash",
     "timeout (subprocess.TimeoutExpired)"),
    ("queue", "failure", "_queue.Empty", ">       queue.get(timeout=240)", "crash", "timeout (_queue.Empty)"),
    ("import", "failure", "ModuleNotFoundError: No module named 'x'", ">       import x", "crash", "ModuleNotFoundError"),
    ("fixture", "error", "failed on setup with \"KeyError: 'k'\"", '>       raise KeyError("k")', "crash", "KeyError in setup"),
]  # fmt: skip


@pytest.mark.parametrize("case", FAILURES, ids=lambda c: c[0])
def test_failure_cause(case):
    name, tag, message, text, cause, why = case
    [got] = B.junit_cases(_xml(_case(name, tag, message, text)))
    want_outcome = "failed" if tag == "failure" else "error"
    assert got == {"name": name, "outcome": want_outcome, "cause": cause, "why": why}


def test_passed_and_skipped_cases_have_no_cause():
    skipped = '<testcase classname="t" name="s"><skipped type="pytest.skip" message="why">x</skipped></testcase>'
    got = B.junit_cases(_xml(_case("ok"), skipped))
    assert got == [{"name": "ok", "outcome": "passed"}, {"name": "s", "outcome": "skipped"}]


def _cases(*names_and_failures):
    """junit cases: a name alone passed; (name, index into FAILURES) failed as that row does."""
    parts = []
    for x in names_and_failures:
        if isinstance(x, str):
            parts.append(_case(x))
        else:
            name, i = x
            parts.append(_case(name, *FAILURES[i][1:4]))
    return B.junit_cases(_xml(*parts))


MUTANT = B.MUTANTS[0]


@pytest.fixture
def runs(monkeypatch):
    """Stands in for the pytest runs: the clean run (no edits) and the planted one each return the given cases."""
    given = {}

    def fake(m, edits, timeout, each):
        cases = given["planted" if edits else "clean"]
        return "ran", cases, subprocess.CompletedProcess([], 1 if any(c["outcome"] != "passed" for c in cases) else 0)

    monkeypatch.setattr(B, "_run_tests", fake)
    return given


def test_a_mutant_caught_only_by_crashes_says_so(runs):
    runs["clean"] = _cases("test_a", "test_b")
    runs["planted"] = _cases(("test_a", 5), "test_b")  # RuntimeError
    row = B.run_mutant(MUTANT, timeout=10)
    assert (row["outcome"], row["cause"], row["clean"]["outcome"]) == ("caught", "crash", "passed")
    assert row["note"] == "crash: RuntimeError in test_a; passed: test_b"
    assert "**caught** (crash: RuntimeError in test_a; passed: test_b)" in B.table([row])


def test_one_assertion_makes_a_mutant_caught_by_assertion(runs):
    runs["clean"] = _cases("test_a", "test_b")
    runs["planted"] = _cases(("test_a", 6), ("test_b", 2))  # run_cli's exit; assert_close
    row = B.run_mutant(MUTANT, timeout=10)
    assert (row["outcome"], row["cause"]) == ("caught", "assertion")
    assert row["note"] == "assertion: test_b; crash: subprocess exit 1 (ValueError) in test_a"


def test_a_test_failing_clean_makes_the_result_meaningless(runs):
    """The negative control of "caught": the same planted failure, but the test failed without the bug too."""
    runs["clean"] = _cases(("test_a", 5), "test_b")
    runs["planted"] = _cases(("test_a", 5), "test_b")
    clean_runs = {}
    row = B.run_mutant(MUTANT, timeout=10, clean_runs=clean_runs)
    assert row["outcome"] == "fails clean" and "cause" not in row
    assert row["note"] == "fails clean: test_a (crash: RuntimeError)"
    assert list(clean_runs) == [tuple(MUTANT.tests)]  # run once per list of tests in a bench run
    assert B.summary([row]) == "1 fails clean of 1 mutants"


def test_all_passing_under_the_bug_is_missed(runs):
    runs["clean"] = runs["planted"] = _cases("test_a")
    row = B.run_mutant(MUTANT, timeout=10)
    assert (row["outcome"], row.get("cause")) == ("missed", None)
