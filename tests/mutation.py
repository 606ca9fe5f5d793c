"""Planted bugs: a copy of shardtune's sources with one edit, run in place of the real ones.

A negative control must show that a check fails for the bug it is named after. The bug is planted in the
sources themselves, not simulated on the check's inputs: `plant` copies `src/shardtune` into a temporary folder,
applies one textual edit, and returns the environment that puts the copy first on `PYTHONPATH`, so a run started
with it (`run_cli(..., env=...)`, torchrun's workers included) imports the planted code. The tests' own process
keeps the real sources.

An edit names the exact text it replaces, which must occur exactly once in its file: when the code it targets
changes, the mutant stops with an error instead of silently planting nothing (a control that cannot fail).
`bench/mutants.py` runs every mutant of its table against the tests that should catch it.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"


@dataclass(frozen=True)
class Edit:
    """Replace `old` (found exactly once) by `new` in `path`, relative to src/shardtune."""

    path: str
    old: str
    new: str


def plant(edits: Edit | list[Edit], dest: Path) -> dict[str, str]:
    """Copy the sources into `dest` with `edits` applied; return the env overrides that make a subprocess run them."""
    edits = [edits] if isinstance(edits, Edit) else list(edits)
    root = Path(dest) / "src"
    shutil.copytree(SRC / "shardtune", root / "shardtune", ignore=shutil.ignore_patterns("__pycache__"))
    for e in edits:
        file = root / "shardtune" / e.path
        text = file.read_text()
        count = text.count(e.old)
        if count != 1:
            raise AssertionError(f"planted edit of {e.path} finds its text {count} times (not once): {e.old!r}")
        file.write_text(text.replace(e.old, e.new))
    return {"PYTHONPATH": os.pathsep.join([str(root), *filter(None, [os.environ.get("PYTHONPATH")])])}
