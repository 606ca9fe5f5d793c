"""The mutation bench: planted bugs of every class shardtune's tests are meant to catch, each run against the tests
that should catch it, with a caught/missed table.

The mutants are listed in bench/mutant_catalogue.py. A mutant is one or more textual edits of src/shardtune
(tests/mutation.py: each edit's text must occur exactly once, so a mutant whose target code changed stops with an
error instead of planting nothing). For each mutant the bench
copies the sources with the edits into a fresh temporary folder and runs its test node ids with pytest in a
subprocess whose PYTHONPATH starts with that copy: the pytest process itself imports the planted code (in-process
unit tests see the bug), and so do the runs it starts (`run_cli`, torchrun's workers). A guard plugin loaded first
(`-p`) stops the run if `shardtune` resolves anywhere else.

Each mutant's tests run clean first (the same copy without the edits, every test, once per list of tests in a
bench run): a test that fails clean makes the mutant's result meaningless, reported as `fails clean` (the planted
run is then skipped). Outcomes: `caught` (a test failed or errored under the bug), `missed` (all passed), `fails
clean`, `broken` (the planted code does not import, or pytest stopped without a result: the mutant says nothing
about the tests), `skipped` (every test skipped), `timeout`. Why each failing test failed comes from pytest's junit
XML (`failure_cause`): an `assertion` (AssertionError, pytest.fail, pytest.raises) or a `crash` (another
exception, a subprocess's non-zero exit, a timeout, an import error, a fixture's error); a mutant caught only by
crashes says so in its result ("caught (crash: RuntimeError in test_x)"), since a crash is not the check the test
was written to make.

    python bench/mutants.py [--only NAME ...] [--list] [--each] [--out docs/mutants.md] [--timeout 600]
    python bench/mutants.py --from_json   # the table again from bench/results/mutants.json

--each runs every test a mutant names instead of stopping at the first failure, so that the table shows which
of them pass under the bug as well.

Results go to bench/results/mutants.json (rows of earlier runs are kept when --only runs a few, unless their
mutant's edits or tests changed) and the table to docs/mutants.md (or --out), which this script rewrites whole.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

from mutant_catalogue import MUTANTS, Mutant

from tests.mutation import plant

RESULTS = ROOT / "bench" / "results" / "mutants.json"
OUTCOMES = ("caught", "missed", "fails clean", "broken", "skipped", "timeout")
DOC = ROOT / "docs" / "mutants.md"


# ---------------------------------------------------------------- running one mutant

GUARD = '''"""Loaded first by the mutation bench (-p): the pytest process must import the planted shardtune."""
import os

import shardtune


def pytest_configure(config):
    want = os.environ["SHARDTUNE_MUTANT_SRC"]
    if not os.path.realpath(shardtune.__file__).startswith(os.path.realpath(want)):
        raise SystemExit(f"mutation bench: shardtune imports from {shardtune.__file__}, not the planted {want}")
'''


def _modules(m: Mutant) -> list[str]:
    return sorted(
        {"shardtune." + e.path.removesuffix(".py").replace("/", ".").removesuffix(".__init__") for e in m.edits}
    )


def run_mutant(m: Mutant, timeout: int, each: bool = False, clean_runs: dict | None = None) -> dict:
    """Run the mutant's tests clean first (the unplanted sources, every test; `clean_runs` keeps the results of
    test lists already run clean), then, if they all pass, plant the mutant in a fresh temporary folder, run the
    tests there and classify the outcome; the folders are removed afterwards."""
    clean_runs = {} if clean_runs is None else clean_runs
    key = tuple(m.tests)
    if key not in clean_runs:
        clean_runs[key] = _clean_run(m, timeout)
    clean = clean_runs[key]
    t0 = time.perf_counter()  # the row's time is the planted run's; the clean run's is clean["seconds"]
    if clean["outcome"] != "passed":
        return _row(m, "fails clean", t0, note=clean["note"], clean=clean)
    status, cases, proc = _run_tests(m, list(m.edits), timeout, each=each)
    if status != "ran":
        return _row(m, status, t0, note=cases, clean=clean)
    return _classify(m, proc, cases, t0, clean)


def _clean_run(m: Mutant, timeout: int) -> dict:
    """The mutant's tests on the unplanted sources, every one of them: "passed" (none failed or errored; skips
    allowed), "failed" (then the mutant's result would be meaningless), "timeout" or "broken"."""
    t0 = time.perf_counter()
    status, cases, proc = _run_tests(m, [], timeout, each=True)
    seconds = round(time.perf_counter() - t0, 1)
    if status != "ran":
        return {"outcome": status, "note": f"clean run {status}: {cases}", "seconds": seconds}
    bad = [c for c in cases if c["outcome"] in ("failed", "error")]
    if bad:
        why = ", ".join(f"{c['name']} ({c['cause']}: {c['why']})" for c in bad)
        return {"outcome": "failed", "note": f"fails clean: {why}", "seconds": seconds}
    if proc.returncode not in (0,) or not cases:  # 5: no test collected (a node id that is gone)
        return {"outcome": "broken", "note": f"clean run: {_last_line(proc.stdout)}", "seconds": seconds}
    return {"outcome": "passed", "note": "", "seconds": seconds}


def _run_tests(m: Mutant, edits: list, timeout: int, each: bool):
    """Plant `edits` (none: the clean sources, copied the same way) in a fresh temporary folder and run the
    mutant's tests there. Returns ("ran", junit cases, process), or (outcome, note, None) for "broken" (the
    planted code does not import; no junit written) and "timeout"."""
    tmp = Path(tempfile.mkdtemp(prefix=f"shardtune-mutant-{m.name}-"))
    try:
        env = {**os.environ, **plant(edits, tmp), "SHARDTUNE_MUTANT_SRC": str(tmp / "src")}
        (tmp / "src" / "_shardtune_mutant_guard.py").write_text(GUARD)
        imp = subprocess.run(
            [sys.executable, "-c", "; ".join(f"import {mod}" for mod in _modules(m))],
            check=False, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        if imp.returncode != 0:
            return "broken", _last_line(imp.stderr), None
        junit = tmp / "junit.xml"
        cmd = [sys.executable, "-m", "pytest", *([] if each else ["-x"]), "-q", "-m", "", "-p"]
        cmd += ["_shardtune_mutant_guard", "--junitxml", str(junit)]
        proc = _run_group([*cmd, *m.tests], env, timeout)
        if proc is None:
            return "timeout", f"over {timeout} s", None
        if not junit.exists():
            return "broken", _last_line(proc.stdout + proc.stderr), None
        return "ran", junit_cases(junit.read_text()), proc
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _run_group(cmd: list[str], env: dict, timeout: int) -> subprocess.CompletedProcess | None:
    """Run pytest in its own process group; on timeout (a planted bug may hang a collective) or an interrupt,
    end the whole group (torchrun and its workers too). None on timeout."""
    proc = subprocess.Popen(
        cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    out = err = None
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        pass
    finally:
        # The whole group, always: on a timeout, on an interrupt, and workers left behind by a pytest that exited.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    return None if out is None else subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _classify(m: Mutant, proc: subprocess.CompletedProcess, cases: list[dict], t0: float, clean: dict) -> dict:
    """caught (a test failed or errored under the bug, all having passed clean), broken, skipped or missed; a
    caught mutant's `cause`: "assertion" when some test failed on an assertion, else "crash"."""
    counts = {k: sum(c["outcome"] == k for c in cases) for k in ("failed", "error", "skipped")}
    counts["tests"] = len(cases)
    failed = [c for c in cases if c["outcome"] in ("failed", "error")]
    passed = [c["name"] for c in cases if c["outcome"] == "passed"]
    if failed:
        asserted = [c["name"] for c in failed if c["cause"] == "assertion"]
        crashed = [f"{c['why']} in {c['name']}" for c in failed if c["cause"] == "crash"]
        parts = ([f"assertion: {', '.join(asserted)}"] if asserted else []) + [f"crash: {x}" for x in crashed]
        # With --each, the tests that passed under the bug too.
        note = "; ".join(parts) + (f"; passed: {', '.join(passed)}" if passed else "")
        cause = "assertion" if asserted else "crash"
        return _row(m, "caught", t0, note=note, counts=counts, clean=clean, cause=cause, failures=failed)
    if proc.returncode != 0:  # 5: no test collected (a node id that is gone)
        return _row(m, "broken", t0, note=_last_line(proc.stdout), counts=counts, clean=clean)
    if counts["tests"] and counts["skipped"] == counts["tests"]:
        return _row(m, "skipped", t0, counts=counts, clean=clean)
    return _row(m, "missed", t0, counts=counts, clean=clean)


# ---------------------------------------------------------------- why a test failed: assertion or crash

# The leading exception type of a failure's message ("RuntimeError: ...", "subprocess.CalledProcessError: ...",
# "_queue.Empty"); pytest's own assertion messages ("assert 1 == 2") have none.
_EXC_TYPE = re.compile(r"^((?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*)(?::|$)")
# An exception line of a subprocess's stderr quoted in the failure (`E   RuntimeError: boom`).
_QUOTED_EXC = re.compile(r"^E?\s*((?:[A-Za-z_]\w*\.)*[A-Z]\w*(?:Error|Exception|Interrupt)):", re.MULTILINE)
# tests/conftest.py's run_cli on a non-zero exit: "AssertionError: <command> failed (<code>):".
_RUN_CLI_EXIT = re.compile(r"^AssertionError: .* failed \((-?\d+)\):")
_TIMEOUTS = ("subprocess.TimeoutExpired", "TimeoutError", "_queue.Empty", "queue.Empty")
_ASSERTIONS = ("AssertionError", "Failed")  # Failed: pytest.fail, pytest.raises' "DID NOT RAISE"


def junit_cases(xml: str) -> list[dict]:
    """Each test case of pytest's junit XML: name, outcome (passed, failed, error, skipped) and, for a failure
    or an error, `cause` ("assertion" or "crash", failure_cause) and `why`."""
    cases = []
    for case in ET.fromstring(xml).iter("testcase"):
        row = {"name": case.get("name", "?"), "outcome": "passed"}
        for tag, outcome in (("failure", "failed"), ("error", "error"), ("skipped", "skipped")):
            el = case.find(tag)
            if el is not None:
                row["outcome"] = outcome
                if tag != "skipped":
                    row["cause"], row["why"] = failure_cause(tag, el.get("message") or "", el.text or "")
                break
        cases.append(row)
    return cases


def failure_cause(tag: str, message: str, text: str) -> tuple[str, str]:
    """Why a test failed, from its junit element (`failure` or `error`), message and text: ("assertion", type)
    for an AssertionError (a plain `assert`, torch.testing.assert_close, ...) or pytest's own failure
    (pytest.fail, pytest.raises' "DID NOT RAISE"); ("crash", what) for anything else: another exception, a
    subprocess that exited non-zero (run_cli's AssertionError "... failed (N):", or a failed assert on a
    `returncode`), a timeout, an import error, or an error in a fixture (`error`: the test never ran)."""
    setup = re.search(r'^failed on (\w+) with "(.*)"$', message, re.DOTALL)
    if tag == "error":
        inner = setup.group(2) if setup else message
        match = _EXC_TYPE.match(inner.strip())
        where = setup.group(1) if setup else "setup"
        return "crash", f"{match.group(1) if match else 'error'} in {where}"
    first = message.strip().splitlines()[0] if message.strip() else ""
    exit_code = _RUN_CLI_EXIT.match(first)
    test_line = next((line for line in text.splitlines() if line.startswith(">")), "")
    if exit_code or (first.startswith(("AssertionError", "assert ")) and "returncode" in test_line):
        quoted = [x for x in _QUOTED_EXC.findall(message + "\n" + text) if x != "AssertionError"]
        code = f" {exit_code.group(1)}" if exit_code else ""
        return "crash", f"subprocess exit{code}" + (f" ({quoted[-1]})" if quoted else "")
    if first.startswith("assert "):
        return "assertion", "assert"
    match = _EXC_TYPE.match(first)
    kind = match.group(1) if match else "error"
    if kind in _ASSERTIONS:
        return "assertion", kind
    if kind in _TIMEOUTS or first.startswith("Failed: Timeout"):
        return "crash", f"timeout ({kind})"
    return "crash", kind


def _last_line(text: str) -> str:
    lines = [x.strip() for x in text.strip().splitlines() if x.strip()]
    return lines[-1][:200] if lines else ""


def _row(m: Mutant, outcome: str, t0: float, note: str = "", counts: dict | None = None, **extra) -> dict:
    """A result row; `extra`: clean (the clean run's outcome, note and seconds), cause and failures (caught)."""
    return {
        "name": m.name,
        "kind": m.kind,
        "outcome": outcome,
        "seconds": round(time.perf_counter() - t0, 1),
        "note": note,
        "counts": counts or {},
        **extra,
        "tests": list(m.tests),
        "fingerprint": m.fingerprint(),
        "date": datetime.now(UTC).strftime("%Y-%m-%d"),
    }


# ---------------------------------------------------------------- results and the table


def machine() -> str:
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model}, {len(os.sched_getaffinity(0))} cores available"


def merged_rows(new: list[dict]) -> list[dict]:
    """This run's rows, and the saved rows of the other mutants whose edits and tests are unchanged, in table order."""
    old = json.loads(RESULTS.read_text())["rows"] if RESULTS.exists() else []
    by_name = {r["name"]: r for r in old}
    by_name.update({r["name"]: r for r in new})
    current = {m.name: m.fingerprint() for m in MUTANTS}
    return [by_name[m.name] for m in MUTANTS if m.name in by_name and by_name[m.name]["fingerprint"] == current[m.name]]


def table(rows: list[dict]) -> str:
    bugs = {m.name: m.bug for m in MUTANTS}
    out = ["| mutant | class | planted bug | tests run | clean run | result | time |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        tests = "<br>".join(f"`{t.removeprefix('tests/')}`" for t in r["tests"])
        result = f"**{r['outcome']}**" + (f" ({_short(r['note'])})" if r["note"] else "")
        out.append(
            f"| `{r['name']}` | {r['kind']} | {bugs[r['name']]} | {tests} | {_clean_cell(r)} | {result} "
            f"| {r['seconds']:.0f} s |"
        )
    return "\n".join(out)


def _clean_cell(r: dict) -> str:
    """The clean run's outcome; rows measured before the bench ran tests clean (and told assertions from crashes)
    say so."""
    clean = r.get("clean")
    if clean is None:
        return f"not run ({r['date']})"
    return f"{clean['outcome']}, {clean['seconds']:.0f} s"


def _short(note: str, keep: int = 3) -> str:
    """A note's lists of test names cut to `keep` names each (the JSON keeps them all)."""
    parts = []
    for part in note.split("; "):
        label, _, names = part.partition(": ")
        names = names.split(", ")
        more = f" and {len(names) - keep} more" if len(names) > keep else ""
        listed = label in ("failed", "passed", "assertion")
        parts.append(f"{label}: {', '.join(names[:keep])}{more}" if listed else part)
    return "; ".join(parts)


def summary(rows: list[dict]) -> str:
    count = {k: sum(r["outcome"] == k for r in rows) for k in OUTCOMES}
    return ", ".join(f"{v} {k}" for k, v in count.items() if v) + f" of {len(rows)} mutants"


def runs(rows: list[dict]) -> str:
    """Which rows were measured when and where: "53 rows on 2026-12-04 (AMD EPYC, ...), 3 on ..."."""
    groups: dict[tuple, list[str]] = {}
    for r in rows:
        groups.setdefault((r["date"], r.get("machine", "machine not recorded")), []).append(r["name"])
    return "; ".join(
        f"{len(names)} row(s) on {date} ({machine})"
        + (f": {', '.join(f'`{n}`' for n in names)}" if len(names) <= 5 else "")
        for (date, machine), names in sorted(groups.items())
    )


def write_doc(rows: list[dict], out: Path, meta: dict) -> None:
    missing = [m.name for m in MUTANTS if m.name not in {r["name"] for r in rows}]
    lines = [
        "# Mutation bench: which planted bugs the tests catch",
        "",
        "Generated by `python bench/mutants.py` (this file is rewritten by it; do not edit by hand). Each row is a",
        "bug planted in a copy of `src/shardtune` (`tests/mutation.py`) and the tests that should catch it, run by",
        "pytest in a subprocess that imports the planted copy, after the same tests ran clean (the copy without the",
        "bug; **fails clean**: a test failed there, so the row proves nothing). **caught**: a test failed under the",
        "bug, on an *assertion* (an AssertionError, pytest.fail/raises) or a *crash* (another exception, a",
        "subprocess's non-zero exit, a timeout, an import or fixture error: `failure_cause` in bench/mutants.py",
        'reads pytest\'s junit XML); a mutant caught only by crashes is listed as "crash: <exception> in <test>".',
        "**missed**: every test passed under the bug; **broken**: the planted code does not import or pytest gave no",
        "result (the mutant proves nothing). How the tests are organised and how to plant a bug:",
        "[testing.md](testing.md).",
        "",
        (
            f"Last run {meta['date']} on {meta['machine']}, Python {meta['python']}, torch {meta['torch']}; "
            f"{summary(rows)}."
        ),
        "Rows of earlier runs are kept when `--only` reruns a few (each row's date is in bench/results/mutants.json):",
        f"{runs(rows)}.",
        "A row whose result lists tests that *passed* was run with `--each` (every named test, not only up to the",
        "first failure): those tests did not fail under that bug. The time is the planted pytest run's, stopping at the",
        "first failure unless `--each` (so without it the cause is the first failure's); the clean run's time is in",
        'its column. Rows whose clean run says "not run (date)" were measured before the bench ran tests clean or',
        'told assertions from crashes: their result is "failed: <test>" without the cause.',
        "",
        table(rows),
        "",
    ]
    if missing:
        lines += [f"Not run yet: {', '.join(f'`{n}`' for n in missing)}.", ""]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", nargs="+", metavar="NAME", help="run only these mutants (names from --list)")
    p.add_argument("--list", action="store_true", help="list the mutants and their tests, run nothing")
    p.add_argument("--out", type=Path, default=DOC, help="the markdown table to write (default docs/mutants.md)")
    p.add_argument("--timeout", type=int, default=600, help="seconds per mutant's pytest run")
    p.add_argument("--from_json", action="store_true", help=f"rewrite the table from {RESULTS.name}, run nothing")
    p.add_argument(
        "--each", action="store_true", help="run every named test of a mutant (default: stop at the first failure)"
    )
    args = p.parse_args(argv)
    names = {m.name for m in MUTANTS}
    if args.only and (unknown := sorted(set(args.only) - names)):
        p.error(f"--only: no mutant named {', '.join(unknown)}; see --list")
    chosen = [m for m in MUTANTS if not args.only or m.name in args.only]
    if args.list:
        for m in chosen:
            print(f"{m.name:34} {m.kind:15} {m.bug}\n{'':50}{' '.join(m.tests)}")
        return 0
    if args.from_json:
        saved = json.loads(RESULTS.read_text())
        write_doc(merged_rows([]), args.out, saved)
        print(f"{args.out} rewritten from {RESULTS}")
        return 0
    import torch

    meta = {
        "date": datetime.now(UTC).strftime("%Y-%m-%d"),
        "machine": machine(),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }
    new, rows, clean_runs = [], [], {}
    for m in chosen:
        row = {**run_mutant(m, args.timeout, args.each, clean_runs), "each": args.each, "machine": meta["machine"]}
        new.append(row)
        print(f"{m.name:34} {row['outcome']:8} {row['seconds']:6.1f} s  {row['note']}", flush=True)
        # After every mutant: an interrupted run keeps the rows it measured.
        rows = merged_rows(new)
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        RESULTS.write_text(json.dumps({**meta, "rows": rows}, indent=1) + "\n")
        write_doc(rows, args.out, meta)
    print(f"\n{summary(new)} run now; table of {len(rows)} written to {args.out}")
    print(table(new))
    return 0


if __name__ == "__main__":
    sys.exit(main())
