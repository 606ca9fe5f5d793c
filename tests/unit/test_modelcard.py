"""Model cards: the hub's own parser must read back what shardtune wrote."""

from __future__ import annotations

import math

import pytest
from huggingface_hub import ModelCard

from shardtune.training.modelcard import write_model_card

HPARAMS = {"lora_r": 8, "lora_alpha": 16, "learning_rate": 1e-4, "max_steps": 200, "bf16": True}


def test_adapter_card_round_trips_through_huggingface_hub(tmp_path):
    path = write_model_card(
        tmp_path / "run",
        base_model="meta-llama/Llama-2-7b-hf",
        method="QLoRA",
        datasets=["smangrul/ultrachat-10k-chatml", str(tmp_path)],
        hyperparameters=HPARAMS,
        metrics={"train_loss": 1.23456, "eval_loss": 1.5},
        tags=["sft", "shardtune"],
    )
    assert path == tmp_path / "run" / "README.md"
    card = ModelCard.load(path)
    data = card.data
    assert data.base_model == "meta-llama/Llama-2-7b-hf"
    assert data.base_model_relation == "adapter"
    assert data.library_name == "peft"
    assert data.pipeline_tag == "text-generation"
    assert data.datasets == ["smangrul/ultrachat-10k-chatml"]  # the local folder is not a hub dataset
    assert data.tags == ["shardtune", "fsdp2", "qlora", "lora", "base_model:adapter:meta-llama/Llama-2-7b-hf", "sft"]
    results = {r.metric_type: r.metric_value for r in data.eval_results}
    assert results == {"loss": 1.5, "perplexity": round(math.exp(1.5), 4)}
    assert {r.dataset_type for r in data.eval_results} == {"smangrul/ultrachat-10k-chatml"}
    text = card.text
    assert "QLoRA fine-tune of [meta-llama/Llama-2-7b-hf](https://huggingface.co/meta-llama/Llama-2-7b-hf)" in text
    assert f"`{tmp_path}`" in text
    assert "| learning_rate | 0.0001 |" in text and "| lora_r | 8 |" in text
    assert "| train_loss | 1.23456 |" in text and f"| perplexity | {math.exp(1.5):.6g} |" in text
    assert 'PeftModel.from_pretrained(base, "run")' in text
    assert "4 bits" in text


def test_merged_model_card_from_a_local_base(tmp_path):
    base = tmp_path / "base_model"
    base.mkdir()
    path = write_model_card(
        tmp_path / "merged",
        base_model=str(base),
        method="full",
        datasets=None,
        hyperparameters={},
        metrics={"train_loss": 2.0, "eval_loss": None},
        library_name="transformers",
        model_name="me/merged-llama",
    )
    data = ModelCard.load(path).data
    # A local path is not a hub id: the metadata would be rejected by the hub, so it goes in the text only.
    assert data.base_model is None and data.to_dict().get("base_model_relation") is None
    assert data.library_name == "transformers"
    assert data.eval_results is None and data.datasets is None
    assert "full-fine-tuning" in data.tags
    text = ModelCard.load(path).text
    assert f"a full fine-tune of `{base}`" in text
    assert 'AutoModelForCausalLM.from_pretrained("me/merged-llama", dtype="auto")' in text
    assert "| train_loss | 2 |" in text and "perplexity" not in text


def test_rejects_unknown_method_and_library(tmp_path):
    common = {"base_model": "gpt2", "datasets": None, "hyperparameters": {}, "metrics": {}}
    with pytest.raises(ValueError, match="method 'prefix': use one of LoRA, QLoRA, DoRA or full"):
        write_model_card(tmp_path, method="prefix", **common)
    with pytest.raises(ValueError, match="library_name 'mlx'"):
        write_model_card(tmp_path, method="lora", library_name="mlx", **common)
    assert not (tmp_path / "README.md").exists()


@pytest.mark.parametrize(
    ("objective", "said"),
    [
        ("sft", {}),
        ("dpo", {"objective": "dpo", "beta": 0.2, "loss_type": "ipo"}),
        ("simpo", {"objective": "simpo", "beta": 0.2, "simpo_gamma": 0.7}),
        ("orpo", {"objective": "orpo", "beta": 0.2}),
        ("kto", {"objective": "kto", "beta": 0.2, "desirable_weight": 1.5, "undesirable_weight": 0.5}),
    ],
)
def test_the_card_records_the_knobs_the_objective_reads(objective, said):
    """The card's hyperparameters name each objective's own knobs (ObjectiveSpec.knobs), no other: SimPO's margin
    is recorded, DPO's loss type only for DPO."""
    from shardtune.config.arguments import TrainArguments
    from shardtune.objectives.loss import objective_settings

    t = TrainArguments(objective=objective, beta=0.2, loss_type="ipo", simpo_gamma=0.7, desirable_weight=1.5)
    t.undesirable_weight, t.precompute_ref_log_probs = 0.5, True
    assert objective_settings(t) == said
