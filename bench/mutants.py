"""The mutation bench: planted bugs of every class shardtune's tests are meant to catch, each run against the tests
that should catch it, with a caught/missed table.

The mutants are listed in bench/mutant_catalogue.py. A mutant is one or more textual edits of src/shardtune
(tests/mutation.py: each edit's text must occur exactly once, so a mutant whose target code changed stops with an
error instead of planting nothing). For each mutant the bench
copies the sources with the edits into a fresh temporary folder and runs its test node ids with pytest in a
subprocess whose PYTHONPATH starts with that copy: the pytest process itself imports the planted code (in-process
unit tests see the bug), and so do the runs it starts (`run_cli`, torchrun's workers). A guard plugin loaded first
(`-p`) stops the run if `shardtune` resolves anywhere else.

Outcomes: `caught` (a test failed), `missed` (all passed), `broken` (the planted code does not import, or pytest
errored without a failure: the mutant says nothing about the tests), `skipped` (every test skipped), `timeout`.

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


def run_mutant(m: Mutant, timeout: int, each: bool = False) -> dict:
    """Plant the mutant in a fresh temporary folder, run its tests there, classify the outcome; the folder is
    removed afterwards."""
    tmp = Path(tempfile.mkdtemp(prefix=f"shardtune-mutant-{m.name}-"))
    t0 = time.perf_counter()
    try:
        env = {**os.environ, **plant(list(m.edits), tmp), "SHARDTUNE_MUTANT_SRC": str(tmp / "src")}
        (tmp / "src" / "_shardtune_mutant_guard.py").write_text(GUARD)
        imp = subprocess.run(
            [sys.executable, "-c", "; ".join(f"import {mod}" for mod in _modules(m))],
            check=False, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        if imp.returncode != 0:
            return _row(m, "broken", t0, note=_last_line(imp.stderr))
        junit = tmp / "junit.xml"
        cmd = [
            sys.executable,
            "-m",
            "pytest",
            *([] if each else ["-x"]),
            "-q",
            "-m",
            "",
            "-p",
            "_shardtune_mutant_guard",
        ]
        cmd += ["--junitxml", str(junit)]
        proc = _run_group([*cmd, *m.tests], env, timeout)
        if proc is None:
            return _row(m, "timeout", t0, note=f"over {timeout} s")
        return _classify(m, proc, junit, t0)
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


def _classify(m: Mutant, proc: subprocess.CompletedProcess, junit: Path, t0: float) -> dict:
    if not junit.exists():
        return _row(m, "broken", t0, note=_last_line(proc.stdout + proc.stderr))
    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    failed, passed = [], []
    for suite in ET.parse(junit).getroot().iter("testsuite"):
        for k in counts:
            counts[k] += int(suite.get(k, 0))
    for case in ET.parse(junit).getroot().iter("testcase"):
        if case.find("failure") is not None:
            failed.append(case.get("name", "?"))
        elif not any(case.find(x) is not None for x in ("error", "skipped")):
            passed.append(case.get("name", "?"))
    if counts["failures"]:
        # With --each, the tests that passed under the bug too.
        note = f"failed: {', '.join(failed)}" + (f"; passed: {', '.join(passed)}" if passed else "")
        return _row(m, "caught", t0, note=note, counts=counts)
    if counts["errors"] or proc.returncode != 0:  # 5: no test collected (a node id that is gone)
        return _row(m, "broken", t0, note=_last_line(proc.stdout), counts=counts)
    if counts["tests"] and counts["skipped"] == counts["tests"]:
        return _row(m, "skipped", t0, counts=counts)
    return _row(m, "missed", t0, counts=counts)


def _last_line(text: str) -> str:
    lines = [x.strip() for x in text.strip().splitlines() if x.strip()]
    return lines[-1][:200] if lines else ""


def _row(m: Mutant, outcome: str, t0: float, note: str = "", counts: dict | None = None) -> dict:
    return {
        "name": m.name,
        "kind": m.kind,
        "outcome": outcome,
        "seconds": round(time.perf_counter() - t0, 1),
        "note": note,
        "counts": counts or {},
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
    out = ["| mutant | class | planted bug | tests run | result | time |", "|---|---|---|---|---|---|"]
    for r in rows:
        tests = "<br>".join(f"`{t.removeprefix('tests/')}`" for t in r["tests"])
        result = f"**{r['outcome']}**" + (f" ({_short(r['note'])})" if r["note"] else "")
        out.append(f"| `{r['name']}` | {r['kind']} | {bugs[r['name']]} | {tests} | {result} | {r['seconds']:.0f} s |")
    return "\n".join(out)


def _short(note: str, keep: int = 3) -> str:
    """A note's lists of test names cut to `keep` names each (the JSON keeps them all)."""
    parts = []
    for part in note.split("; "):
        label, _, names = part.partition(": ")
        names = names.split(", ")
        more = f" and {len(names) - keep} more" if len(names) > keep else ""
        parts.append(f"{label}: {', '.join(names[:keep])}{more}" if label in ("failed", "passed") else part)
    return "; ".join(parts)


def summary(rows: list[dict]) -> str:
    count = {k: sum(r["outcome"] == k for r in rows) for k in ("caught", "missed", "broken", "skipped", "timeout")}
    return ", ".join(f"{v} {k}" for k, v in count.items() if v) + f" of {len(rows)} mutants"


def write_doc(rows: list[dict], out: Path, meta: dict) -> None:
    missing = [m.name for m in MUTANTS if m.name not in {r["name"] for r in rows}]
    lines = [
        "# Mutation bench: which planted bugs the tests catch",
        "",
        "Generated by `python bench/mutants.py` (this file is rewritten by it; do not edit by hand). Each row is a",
        "bug planted in a copy of `src/shardtune` (`tests/mutation.py`) and the tests that should catch it, run by",
        "pytest in a subprocess that imports the planted copy. **caught**: a test failed; **missed**: every test",
        "passed under the bug; **broken**: the planted code does not import or a test errored (the mutant proves",
        "nothing). How the tests are organised and how to plant a bug: [testing.md](testing.md).",
        "",
        (
            f"Last run {meta['date']} on {meta['machine']}, Python {meta['python']}, torch {meta['torch']}; "
            f"{summary(rows)}."
        ),
        "Rows of earlier runs are kept when `--only` reruns a few (each row's date is in bench/results/mutants.json).",
        "A row whose result lists tests that *passed* was run with `--each` (every named test, not only up to the",
        "first failure): those tests did not fail under that bug. The time is the pytest run's, stopping at the first",
        "failure unless `--each`.",
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
    new, rows = [], []
    for m in chosen:
        row = {**run_mutant(m, args.timeout, args.each), "each": args.each}
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
