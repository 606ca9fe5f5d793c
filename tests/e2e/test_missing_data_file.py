"""A --dataset_name that names a data file which is not there (`missing.jsonl`, `data/train.CSV`, `~/x.parquet`) is
refused when the flags are checked, before the model is read: the name of a data file is never a hub id (the rule
of shardtune.data.sources.is_hub_dataset, which the data loader applies too). Training, evaluation splits and
preference data all come from --dataset_name, so it is the one data flag that names a file."""

from __future__ import annotations

import pytest

from shardtune.config.errors import ConfigError
from shardtune.data.sources import FILE_BUILDERS, load_split
from shardtune.recipe.run_config import load_run_config
from tests.conftest import ROOT, train_args
from tests.e2e.test_bad_inputs import _main, _model_copy, _snapshot

GIVE = (
    "give an existing .jsonl/.json/.parquet/.csv file, a folder saved with save_to_disk, a folder of "
    "<split>.<ext> files, or a hub dataset id."
)
# Every suffix of the loader's table, as written and in other cases; bare names and names shaped like `org/name`
# are valid hub ids by the hub's own rule, so only the suffix tells that they are files.
NAMES = [
    *(f"missing{s}" for s in FILE_BUILDERS),
    *(f"data/missing{s.upper()}" for s in FILE_BUILDERS),
    "missing.JsonL",
    "~/missing.csv",
    "~/data/missing.Parquet",
]


@pytest.fixture(scope="module")
def no_weights_model(tiny_assets, tmp_path_factory):
    """The tiny model without its weight files: a run that got as far as loading the model would stop on that
    (`--model_name_or_path ...: no weights there`), not on the data."""
    return _model_copy(tiny_assets, tmp_path_factory.mktemp("noweights") / "m", drop=("*.safetensors",))


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    """Relative names resolve in tmp_path and `~` is tmp_path/home, so that nothing named here exists."""
    (tmp_path / "home").mkdir()
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.parametrize("name", NAMES)
def test_train_refuses_a_missing_data_file_before_reading_the_model(
    name, tiny_assets, no_weights_model, in_tmp, capsys
):
    before = _snapshot(in_tmp)
    argv = train_args(tiny_assets, in_tmp / "out", model_name_or_path=no_weights_model, dataset_name=name)
    rc, line = _main(argv, capsys)
    assert rc == 2
    assert line == f"- --dataset_name {name}: no such file or folder; {GIVE}"
    assert _snapshot(in_tmp) == before  # no output_dir, no tokenized cache
    # The loader refuses it by the same rule (it is not looked up on the hub).
    with pytest.raises(ValueError, match="no such file or folder"):
        load_split(name, "train", is_train=True)


@pytest.mark.parametrize(
    ("command", "flags"),
    [
        ("train", {"splits": "train,test", "eval_strategy": "steps", "eval_steps": 1}),  # with an evaluation split
        ("train", {"objective": "dpo", "packing": False, "splits": "train"}),  # preference pairs
        ("launch", {}),  # checked before torchrun starts
    ],
)
def test_every_command_and_objective_refuses_it(command, flags, tiny_assets, no_weights_model, in_tmp, capsys):
    before = _snapshot(in_tmp)
    argv = train_args(tiny_assets, in_tmp / "out", model_name_or_path=no_weights_model, dataset_name="pairs.jsonl")
    argv += [x for k, v in flags.items() for x in (f"--{k}", str(v))]
    if command == "launch":
        argv = ["launch", "--config_file", str(ROOT / "configs" / "fsdp_config_cpu.yaml"), *argv[1:]]
    rc, line = _main(argv, capsys)
    assert (rc, line) == (2, f"- --dataset_name pairs.jsonl: no such file or folder; {GIVE}")
    assert _snapshot(in_tmp) == before


def _dataset_problems(name: str) -> list[str]:
    try:
        load_run_config(["--model_name_or_path", "org/model", "--dataset_name", name], env={})
    except ConfigError as e:
        return [p for p in e.problems if p.startswith("--dataset_name")]
    return []


def test_existing_files_folders_and_hub_ids_pass(in_tmp):
    """The same names pass once they exist (`~` expanded), a folder whose name ends like a data file is a
    folder, and a hub id stays a hub id (checked when the data is loaded)."""
    for name in NAMES:
        path = (in_tmp / "home" / name[2:]) if name.startswith("~/") else in_tmp / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text('{"text": "a"}\n')
    (in_tmp / "saved.jsonl").mkdir()
    assert {n: _dataset_problems(n) for n in [*NAMES, "saved.jsonl", "org/dataset", "dataset"]} == {
        n: [] for n in [*NAMES, "saved.jsonl", "org/dataset", "dataset"]
    }
    assert _dataset_problems("org/dataset.csv") == [f"--dataset_name org/dataset.csv: no such file or folder; {GIVE}"]
