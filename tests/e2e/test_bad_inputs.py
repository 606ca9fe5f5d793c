"""Bad input, class by class (docs/errors.md, "Bad input"): each stops with exit code 2 and one line naming the
flag, file or value and the fix, without a traceback, before any data is prepared or weights are read, and
leaves the files on disk as they were. Most run `shardtune.cli.main` in this process and stop before a model
loads; one finished training run (a subprocess) is shared by the output-folder checks."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shardtune import cli
from shardtune.models import adapter_fit, preflight
from shardtune.training import run_dir
from tests.conftest import _free_port, run_cli, train_args

DIST_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    """Every file under folder with its size and modification time: what must not change."""
    if not folder.exists():
        return {}
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.rglob("*")}


def _main(argv: list[str], capsys) -> tuple[int, str]:
    """`shardtune <argv>` in this process: (exit code, the one line of the problem) after checking stderr holds
    no traceback and that the problem is said on one line."""
    rc = cli.main([str(a) for a in argv])
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = [line.strip() for line in err.splitlines() if line.strip().startswith(("- ", "error: ", "shardtune "))]
    lines = [line for line in lines if not line.endswith("Invalid configuration:")]  # the heading of the list
    assert len(lines) == 1, err
    return rc, lines[0]


@pytest.fixture
def no_dist_env(monkeypatch):
    """A single in-process run sets RANK etc. (shardtune.parallel.mesh); undo it after the test."""
    for k in DIST_ENV:
        monkeypatch.setenv(k, "x")
        monkeypatch.delenv(k)


@pytest.fixture(scope="module")
def finished_run(tiny_assets, tmp_path_factory) -> Path:
    """A LoRA run of 2 steps with a checkpoint after each: adapter, checkpoints and metrics.jsonl on disk."""
    out = tmp_path_factory.mktemp("finished") / "run"
    run_cli(_run_args(tiny_assets, out, max_steps=2, save_strategy="steps", save_steps=1))
    return out


def _run_args(assets, out, **flags) -> list[str]:
    lora = {"use_peft_lora": True, "lora_r": 4, "lora_target_modules": "q_proj,v_proj"}
    return train_args(assets, out, max_seq_len=64, per_device_train_batch_size=2, **{**lora, **flags})


@pytest.fixture(scope="module")
def other_base_adapter(tmp_path_factory) -> Path:
    """A LoRA adapter of a model twice as narrow as the tiny model (hidden 32, not 64)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from shardtune.commands.demo import build_model

    root = tmp_path_factory.mktemp("other")
    build_model(root / "base", vocab_size=600, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2)
    model = AutoModelForCausalLM.from_pretrained(root / "base")
    get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"])).save_pretrained(root / "adapter")
    return root / "adapter"


def _model_copy(tiny_assets, dest: Path, drop: tuple[str, ...] = ()) -> Path:
    shutil.copytree(tiny_assets["model"], dest, ignore=shutil.ignore_patterns(*drop))
    return dest


# ---------------------------------------------------------------- 1. loading failures


@pytest.mark.parametrize("case", ["broken_config", "no_weights", "no_tokenizer_files", "missing_tokenizer", "offline"])
def test_loading_failures_name_the_path_and_the_fix(case, tiny_assets, tmp_path, capsys, monkeypatch):
    out = tmp_path / "out"
    flags: dict = {}
    if case == "broken_config":
        model = _model_copy(tiny_assets, tmp_path / "m")
        (model / "config.json").write_text('{"model_type": "llama",\n')
        flags["model_name_or_path"], want = (
            model,
            f"--model_name_or_path {model}: {model}/config.json is not valid JSON",
        )
    elif case == "no_weights":
        model = _model_copy(tiny_assets, tmp_path / "m", drop=("*.safetensors",))
        flags["model_name_or_path"], want = model, f"--model_name_or_path {model}: no weights there"
    elif case == "no_tokenizer_files":
        model = _model_copy(tiny_assets, tmp_path / "m", drop=("tokenizer*",))
        flags["model_name_or_path"], want = model, f"--model_name_or_path {model}: no tokenizer files there"
    elif case == "missing_tokenizer":
        flags["tokenizer_name_or_path"] = tmp_path / "tok"
        want = f"--tokenizer_name_or_path {tmp_path / 'tok'}: no such folder"
    else:
        from huggingface_hub import constants

        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
        monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
        flags["model_name_or_path"] = "someone/some-model"
        want = "--model_name_or_path someone/some-model: HF_HUB_OFFLINE=1 is set and someone/some-model is not in"
    before = _snapshot(tmp_path)
    rc, line = _main(train_args(tiny_assets, out, **flags), capsys)
    assert rc == 2 and line.startswith(f"- {want}"), line
    assert _snapshot(tmp_path) == before  # nothing written: no output_dir, no tokenized cache
    if case == "offline":  # an id without a namespace is a hub id too, not a missing folder
        assert preflight.model_config_or_problem("gpt2")[1].startswith("--model_name_or_path gpt2: HF_HUB_OFFLINE=1")


def test_unreachable_hub_fails_in_seconds_without_retries(tmp_path, monkeypatch):
    """huggingface_hub retries a refused connection 5 times (~23 s per file); the preflight asks once."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    endpoint = f"http://127.0.0.1:{_free_port()}"  # nothing listens: connection refused
    t0 = time.monotonic()
    problem = preflight.hub_problem("someone/m", "--model_name_or_path", endpoint=endpoint)
    assert time.monotonic() - t0 < 5
    assert problem.startswith(f"--model_name_or_path someone/m: cannot reach the Hugging Face Hub at {endpoint} (")
    assert problem.endswith("check the network, HF_ENDPOINT and any proxy, or give a local model folder.")


def test_launch_checks_before_torchrun_starts(tiny_assets, tmp_path, capsys):
    from tests.conftest import ROOT

    config = ROOT / "configs" / "fsdp_config_cpu.yaml"
    flags = train_args(tiny_assets, tmp_path / "out", use_peft_lora=True, lora_target_modules="q_proj,foo_proj")[1:]
    t0 = time.monotonic()
    rc, line = _main(["launch", "--config_file", config, *flags], capsys)
    assert rc == 2 and line.startswith("- --lora_target_modules: foo_proj matches no linear layer")
    assert time.monotonic() - t0 < 10 and not (tmp_path / "out").exists()  # no torchrun, no workers


# ---------------------------------------------------------------- adapters of another base


def test_adapter_of_another_base_is_refused_by_train_chat_and_merge(
    tiny_assets, other_base_adapter, tmp_path, capsys, no_dist_env
):
    model, before = tiny_assets["model"], _snapshot(tmp_path)
    want = f"--adapter_path {other_base_adapter} was trained on another base than {model}"
    rc, line = _main(
        train_args(tiny_assets, tmp_path / "out", use_peft_lora=True, adapter_path=other_base_adapter), capsys
    )
    mismatch = "lora_A.weight expects in_features 32 but the base's model.layers.0.self_attn.q_proj (64 x 64) has 64"
    assert rc == 2 and line.startswith(f"- {want}") and mismatch in line, line
    assert line.endswith(f"pass that base with --model_name_or_path, or an adapter trained on {model}.")
    rc, line = _main(["chat", "--model_name_or_path", model, "--adapter", other_base_adapter, "--prompt", "hi"], capsys)
    assert rc == 2 and line.startswith(f"shardtune chat: {want.replace('_path', '')}")
    rc, line = _main(
        ["merge", "--base", model, "--adapter", other_base_adapter, "--output_dir", tmp_path / "m"], capsys
    )
    assert rc == 2 and line.startswith(f"- {want.replace('_path', '')}")
    assert _snapshot(tmp_path) == before


def test_chat_checks_the_model_and_tokenizer_before_loading(tiny_assets, tmp_path, capsys):
    model = _model_copy(tiny_assets, tmp_path / "m", drop=("*.safetensors",))
    rc, line = _main(["chat", "--model_name_or_path", model, "--prompt", "hi"], capsys)
    assert rc == 2 and line.startswith(f"shardtune chat: --model_name_or_path {model}: no weights there")
    tok = tmp_path / "tok"
    rc, line = _main(["chat", "--model_name_or_path", tiny_assets["model"], "--tokenizer_name_or_path", tok], capsys)
    assert rc == 2 and line.startswith(f"shardtune chat: --tokenizer_name_or_path {tok}: no such folder")


def test_adapter_of_the_same_base_passes_the_check(tiny_assets, finished_run):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(tiny_assets["model"])
    shapes = preflight.model_shapes(preflight.meta_skeleton(config))
    assert any("lora_A" in k for k in adapter_fit.adapter_tensor_shapes(finished_run))
    kwargs = {"base_name": str(tiny_assets["model"]), "flag": "--adapter", "vocab_size": config.vocab_size}
    assert preflight.adapter_base_problem(finished_run, shapes, **kwargs) is None
    # The same adapter against a narrower base's shapes is refused: the check reads the shapes, not the names.
    narrow = {k: tuple(d // 2 if d == 64 else d for d in v) for k, v in shapes.items()}
    assert "was trained on another base" in preflight.adapter_base_problem(finished_run, narrow, **kwargs)


# ---------------------------------------------------------------- 2. module names (from a meta skeleton)


@pytest.mark.parametrize(
    ("flag", "value", "want"),
    [
        (
            "lora_target_modules",
            "q_proj,foo_proj",
            (
                "- --lora_target_modules: foo_proj matches no linear layer of {model}; its linear layers are "
                "down_proj, gate_proj, k_proj, lm_head, o_proj, q_proj, up_proj, v_proj (or give all-linear)."
            ),
        ),
        ("modules_to_save", "embed_tokens,lm_heads", "- --modules_to_save: lm_heads is no module of {model};"),
    ],
)
def test_unknown_module_names_are_refused_with_the_models_names(tiny_assets, tmp_path, capsys, flag, value, want):
    rc, line = _main(train_args(tiny_assets, tmp_path / "out", use_peft_lora=True, **{flag: value}), capsys)
    assert rc == 2 and line.startswith(want.format(model=tiny_assets["model"])), line
    assert not (tmp_path / "out").exists()


def test_all_linear_and_a_regex_still_select_modules(tiny_assets):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    from shardtune.models.adapter import _target_modules

    skeleton = preflight.meta_skeleton(AutoConfig.from_pretrained(tiny_assets["model"]))
    regex = r".*\.(q_proj|v_proj)"
    for spec in ("all-linear", regex, "self_attn.q_proj,v_proj"):
        assert preflight.target_module_problems(skeleton, spec, explicit=True, model_name="m") == []
    assert preflight.target_module_problems(skeleton, r".*\.qq_proj", explicit=True, model_name="m") != []
    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(tiny_assets["model"]),
        LoraConfig(r=2, target_modules=_target_modules(regex)),
    )
    adapted = sorted({n.split(".lora_A")[0].split(".")[-1] for n, _ in model.named_parameters() if "lora_A" in n})
    assert adapted == ["q_proj", "v_proj"]


# ---------------------------------------------------------------- 3. sequence length beyond the model's context


def test_max_seq_len_beyond_the_model_is_refused_before_tokenizing(tiny_assets, tmp_path, capsys):
    before = _snapshot(tmp_path)
    rc, line = _main(train_args(tiny_assets, tmp_path / "out", max_seq_len=100_000_000), capsys)
    assert rc == 2
    assert line.startswith("- --max_seq_len 100000000 is longer than") and "max_position_embeddings = 2048" in line
    assert "lower --max_seq_len to 2048 or less" in line and "rope_scaling" in line
    assert _snapshot(tmp_path) == before  # no .shardtune_cache beside the output_dir: nothing was tokenized


def test_context_limit_follows_rope_scaling():
    from transformers import GPT2Config, LlamaConfig

    linear = LlamaConfig(max_position_embeddings=512, rope_scaling={"rope_type": "linear", "factor": 4.0})
    llama3 = {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8192}
    llama3.update(low_freq_factor=1.0, high_freq_factor=4.0)
    assert preflight.context_limit(linear)[0] == 2048
    assert preflight.context_limit(LlamaConfig(max_position_embeddings=131072, rope_scaling=llama3))[0] == 131072
    assert preflight.context_limit(GPT2Config(n_positions=128))[0] == 128
    assert preflight.max_length_problem(2048, linear, "m") is None
    assert "(max_position_embeddings = 512 with RoPE scaling (factor 4)" in preflight.max_length_problem(
        2049, linear, "m"
    )


# ---------------------------------------------------------------- 4. output folders


def test_output_dir_that_is_a_file_or_unwritable_is_refused(tiny_assets, tmp_path, capsys, no_dist_env):
    (tmp_path / "f").write_text("keep")
    before = _snapshot(tmp_path)
    rc, line = _main(train_args(tiny_assets, tmp_path / "f"), capsys)
    assert (
        rc == 2 and line == f"error: --output_dir {tmp_path / 'f'} is a file; give a folder (it is created if missing)."
    )
    rc, line = _main(train_args(tiny_assets, tmp_path / "f" / "sub"), capsys)
    assert rc == 2 and line.startswith(f"error: --output_dir {tmp_path / 'f' / 'sub'}: {tmp_path / 'f'} is a file")
    assert _snapshot(tmp_path) == before


def test_read_only_output_dir_is_refused(request):
    """Checked by creating a file (os.access says yes to root, and to anyone on a read-only mount); as root, the
    check runs in a child that drops to an unprivileged user (after its imports), for whom 0o555 is read-only."""
    import tempfile

    # pytest's own folders are private to root: the unprivileged child could not even look (which says
    # "permission denied on ..."); a folder in /tmp that it may enter.
    base = Path(tempfile.mkdtemp(prefix="shardtune-ro-"))
    base.chmod(0o755)
    ro = base / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    request.addfinalizer(lambda: shutil.rmtree(base))
    code = (
        "import os, sys; from shardtune.training.run_dir import output_dir_problem as p\n"
        "if os.geteuid() == 0: os.setuid(65534)\n"
        "for d in sys.argv[1:]: print(p(d, overwrite=False, resuming=False))"
    )
    private = Path("/root/shardtune-test/out")  # /root is 0o700: the child may not even look inside
    argv = [sys.executable, "-c", code, str(ro / "out"), str(private)]
    proc = subprocess.run(argv, check=False, capture_output=True, text=True)
    fix = "fix its permissions or give another folder."
    assert proc.stdout.splitlines() == [
        f"--output_dir {ro / 'out'} is not writable ({ro}, where it would be created); {fix}",
        f"--output_dir {private}: permission denied on {private}; {fix}",
    ], proc.stderr[-2000:]
    assert list(ro.iterdir()) == []


def test_output_dir_of_another_run_is_refused_and_kept(tiny_assets, finished_run, capsys, no_dist_env):
    before = _snapshot(finished_run)
    assert {"adapter_config.json", "metrics.jsonl", "checkpoints/checkpoint-2/meta.json"} <= set(before)
    rc, line = _main(_run_args(tiny_assets, finished_run, max_steps=2), capsys)
    assert rc == 2 and line.startswith(f"error: --output_dir {finished_run} already holds a run (adapter_config.json")
    assert "add --overwrite_output_dir" in line and "--resume_from_checkpoint latest" in line
    # Resuming with settings that make it another run (rank 8, not 4) never picks this run's checkpoint.
    rc, line = _main(_run_args(tiny_assets, finished_run, lora_r=8, resume_from_checkpoint="latest"), capsys)
    assert rc == 2
    assert line == (
        f"error: --resume_from_checkpoint latest: {finished_run}/checkpoints/checkpoint-2 belongs to another run "
        "(lora_r 4 there, 8 now); resume with that run's settings, or start afresh with another --output_dir or "
        "--overwrite_output_dir."
    )
    assert _snapshot(finished_run) == before


def test_overwrite_output_dir_starts_a_fresh_history(tiny_assets, finished_run, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(finished_run, out)
    proc = run_cli(_run_args(tiny_assets, out, max_steps=1, save_strategy="no", overwrite_output_dir=True))
    assert "removed the previous run's checkpoints, metrics.jsonl, train_summary.json" in proc.stderr
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["type"] for r in records] == ["start", "train", "summary"] and records[-1]["steps"] == 1
    assert not (out / "checkpoints").exists()
    assert json.loads((out / "train_summary.json").read_text())["steps"] == 1


def test_resume_keeps_one_history_in_metrics(tmp_path):
    """metrics.jsonl on resume from step 2: records after step 2 (and the old summary) are redone, so dropped."""
    lines = [
        {"type": "start", "total_steps": 4},
        {"type": "train", "step": 1},
        {"type": "train", "step": 2},
        {"type": "eval", "step": 2},
        {"type": "train", "step": 3},
        {"type": "summary", "step": 3},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines) + '{"type": "tr')
    assert run_dir.trim_metrics(str(tmp_path), 2) == 3  # step 3, the summary and the torn line
    kept = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert kept == lines[:4]
    assert run_dir.trim_metrics(str(tmp_path), 2) == 0


def test_run_file_with_a_wrong_type_exits_2_without_traceback(tiny_assets, tmp_path, capsys):
    run = tmp_path / "run.yaml"
    run.write_text(f"model_name_or_path: {tiny_assets['model']}\ndataset_name: {tiny_assets['data']}\nlora_r: [8]\n")
    rc, line = _main(["train", run], capsys)
    assert rc == 2 and line == f"- {run}: lora_r: [8] is not a number; write e.g. lora_r: 1."


def test_resume_compares_the_data_by_content_not_by_path(tiny_assets, finished_run, tmp_path, capsys, no_dist_env):
    """The same rows under another path (another node's copy, a moved folder) resume; other rows under any path are
    refused once tokenized, before the model loads, naming the checkpoint."""
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    moved = shutil.copytree(tiny_assets["data"], tmp_path / "moved-data")
    changed = shutil.copytree(tiny_assets["data"], tmp_path / "changed-data")
    rows = (changed / "train.jsonl").read_text().splitlines()
    (changed / "train.jsonl").write_text("\n".join(rows[1:]) + "\n")  # one conversation fewer
    before = _snapshot(run)
    flags = {"max_steps": 3, "resume_from_checkpoint": "latest", "dataset_cache_dir": tmp_path / "cache"}
    rc, line = _main([*_run_args(tiny_assets, run, **flags), "--dataset_name", changed], capsys)
    assert rc == 2 and line.startswith(
        f"error: --resume_from_checkpoint latest: {run}/checkpoints/checkpoint-2 was trained on other rows than "
        f"--dataset_name {changed} gives now"
    ), line
    assert _snapshot(run) == before
    proc = run_cli([*_run_args(tiny_assets, run, **flags), "--dataset_name", str(moved)])
    assert f"Resumed from {run}/checkpoints/checkpoint-2 at step 2" in proc.stderr + proc.stdout
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["type"] == "train"] == [1, 2, 3]
