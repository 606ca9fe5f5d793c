"""The command line as a user runs it: the guide's command under accelerate, --help, and bad input."""

from __future__ import annotations

import dataclasses
import json
import shlex
import shutil
import subprocess
import sys

import pytest
from safetensors.torch import load_file

from shardtune.config.arguments import ARG_CLASSES
from tests.conftest import ROOT, run_cli, train_records
from tests.unit.test_config import GUIDE_LORA


def _guide_flags(assets, out) -> list[str]:
    """The guide's LoRA command flag for flag, with a local model and dataset, and sizes for a tiny dataset."""
    flags = shlex.split(GUIDE_LORA)
    flags = [f for f in flags if f not in ("--push_to_hub",)]
    i = flags.index("--hub_private_repo")
    del flags[i : i + 4]  # --hub_private_repo True --hub_strategy every_save: nothing to upload to here
    flags[flags.index("--model_name_or_path") + 1] = str(assets["model"])
    flags[flags.index("--dataset_name") + 1] = str(assets["data"])
    flags[flags.index("--output_dir") + 1] = str(out)
    # Later flags override earlier ones: rows of 128 tokens, a small batch, three steps.
    return flags + [
        "--max_seq_len",
        "128",
        "--per_device_train_batch_size",
        "2",
        "--per_device_eval_batch_size",
        "2",
        "--gradient_accumulation_steps",
        "1",
        "--max_steps",
        "3",
        "--logging_steps",
        "1",
    ]


@pytest.mark.skipif(
    shutil.which("accelerate") is None and not (ROOT / ".venv/bin/accelerate").exists(),
    reason="accelerate is not installed",
)
def test_guide_command_under_accelerate_launch(tiny_assets, tmp_path):
    out = tmp_path / "llama-sft-lora-fsdp"
    accelerate = shutil.which("accelerate") or str(ROOT / ".venv/bin/accelerate")
    cmd = [
        accelerate,
        "launch",
        "--config_file",
        str(ROOT / "configs/fsdp_config_cpu.yaml"),
        "--main_process_port",
        "0",
        "-m",
        "shardtune",
        "train",
        *_guide_flags(tiny_assets, out),
    ]
    env = {"OMP_NUM_THREADS": "1", "PATH": f"{ROOT / '.venv/bin'}:{__import__('os').environ['PATH']}"}
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=600, check=False, env={**__import__("os").environ, **env}
    )
    assert proc.returncode == 0, proc.stderr[-5000:]
    records = train_records(out)
    assert [r["step"] for r in records] == [1, 2, 3]
    start = next(r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["type"] == "start")
    assert start["config"]["world_size"] == 2
    assert start["config"]["fsdp"]["sharding_strategy"] == "FULL_SHARD"
    assert start["config"]["train"]["bf16"] is True
    adapter = load_file(out / "adapter_model.safetensors")
    cfg = json.loads((out / "adapter_config.json").read_text())
    assert cfg["r"] == 8 and cfg["lora_alpha"] == 16 and cfg["peft_type"] == "LORA"
    assert any("lora_B" in k for k in adapter) and (out / "tokenizer_config.json").exists()
    # The frozen base computes in bf16; the saved adapter is in fp32 masters.
    assert all(v.dtype.is_floating_point for v in adapter.values())
    # FSDP1-only options of the guide's YAML are named once, as not needed under FSDP2.
    assert "use_orig_params" in proc.stderr + proc.stdout


def test_help_documents_every_flag():
    proc = run_cli(["train", "--help"])
    text = " ".join(proc.stdout.split())
    for cls in ARG_CLASSES:
        for f in dataclasses.fields(cls):
            assert f"--{f.name}" in text, f.name
    assert "--max_seq_len" in text and "Tokens per training row" in text


def test_console_script_and_module_agree():
    exe = ROOT / ".venv/bin/shardtune"
    script = shutil.which("shardtune") or (str(exe) if exe.exists() else None)
    if script is None:
        pytest.skip("console script not on PATH")
    a = subprocess.run([script, "--help"], capture_output=True, text=True, check=True).stdout
    b = subprocess.run([sys.executable, "-m", "shardtune", "--help"], capture_output=True, text=True, check=True).stdout
    assert a == b and "train" in a and "launch" in a


def _train_args(assets, tmp_path, *extra):
    return [
        "train",
        "--model_name_or_path",
        str(assets["model"]),
        "--dataset_name",
        str(assets["data"]),
        "--output_dir",
        str(tmp_path / "out"),
        "--use_peft_lora",
        "True",
        "--max_steps",
        "1",
        "--chat_template_format",
        "chatml",
        *extra,
    ]


def test_bad_flags_exit_2_before_loading(tiny_assets, tmp_path):
    proc = run_cli(
        _train_args(
            tiny_assets,
            tmp_path,
            "--lora_r",
            "0",
            "--bf16",
            "True",
            "--fp16",
            "True",
            "--model_name_or_path",
            str(tmp_path / "nope"),
        ),
        check=False,
    )
    assert proc.returncode == 2
    err = proc.stderr
    assert "--lora_r must be > 0" in err and "--bf16 and --fp16" in err and "no config.json" in err
    assert not (tmp_path / "out").exists()


def test_unknown_role_names_the_row(tiny_assets, tmp_path):
    data = tmp_path / "bad"
    data.mkdir()
    rows = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}] * 3
    rows.append({"messages": [{"role": "robot", "content": "beep"}]})
    (data / "train.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    (data / "test.jsonl").write_text(json.dumps(rows[0]))
    proc = run_cli(
        [
            "train",
            "--model_name_or_path",
            str(tiny_assets["model"]),
            "--dataset_name",
            str(data),
            "--output_dir",
            str(tmp_path / "out"),
            "--chat_template_format",
            "chatml",
            "--max_steps",
            "1",
        ],
        check=False,
    )
    assert proc.returncode == 2
    assert "robot" in proc.stderr and "3" in proc.stderr and "train" in proc.stderr


def test_target_modules_matching_nothing(tiny_assets, tmp_path):
    proc = run_cli(
        _train_args(
            tiny_assets, tmp_path, "--lora_target_modules", "qkv_proj,dense", "--per_device_train_batch_size", "1"
        ),
        check=False,
    )
    assert proc.returncode == 2
    assert "--lora_target_modules" in proc.stderr and "qkv_proj" in proc.stderr
