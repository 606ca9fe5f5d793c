"""Every mutant of the mutation bench (bench/mutant_catalogue.py, run by bench/mutants.py) still plants: each edit's text occurs exactly once in the
current sources, and each named test file exists. A change of the code a mutant targets shows here, not only at
the next bench run."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from tests.mutation import plant

ROOT = Path(__file__).resolve().parents[2]


def _bench():
    spec = importlib.util.spec_from_file_location("shardtune_mutant_catalogue", ROOT / "bench" / "mutant_catalogue.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is created
    spec.loader.exec_module(module)
    return module


MUTANTS = _bench().MUTANTS


def test_mutant_names_are_unique_and_every_class_is_there():
    names = [m.name for m in MUTANTS]
    assert len(names) == len(set(names))
    kinds = {m.kind for m in MUTANTS}
    assert kinds == {"normalisation", "gradient scale", "sharding", "masking", "adapter", "resume", "merge",
                     "preference", "quantization"}  # fmt: skip


@pytest.mark.parametrize("mutant", MUTANTS, ids=lambda m: m.name)
def test_mutant_plants_and_names_existing_tests(mutant, tmp_path):
    env = plant(list(mutant.edits), tmp_path)
    root = Path(env["PYTHONPATH"].split(":")[0]) / "shardtune"
    for e in mutant.edits:
        text = (root / e.path).read_text()
        assert e.new in text and e.old != e.new, e.path
    for node in mutant.tests:
        assert (ROOT / node.split("::")[0]).is_file(), node
