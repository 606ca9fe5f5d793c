"""SimPO and ORPO against trl.experimental's CPOTrainer and ORPOTrainer on the same batch: their trainers
tokenize pairs their own way, so their collated batch is handed to shardtune's objective as it stands (the same
tokens, prompt masks and padding) and the first step's numbers are compared."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from shardtune.commands.demo import write_preference_dataset
from shardtune.data import setup_tokenizer
from shardtune.models.training_module import CausalLMForTraining
from shardtune.objectives.loss import build_objective

N_PAIRS = 6


def _as_our_batch(batch: dict) -> dict:
    """TRL's chosen_/rejected_ tensors as shardtune's micro-batch: chosen rows then rejected rows, labels shifted
    (ours[t] is the target of position t, TRL's labels[t] is token t itself)."""
    width = max(batch["chosen_input_ids"].shape[1], batch["rejected_input_ids"].shape[1])

    def pad(x, value):
        return torch.nn.functional.pad(x, (0, width - x.shape[1]), value=value)

    ids = torch.cat([pad(batch[f"{s}_input_ids"], 0) for s in ("chosen", "rejected")])
    labels = torch.cat([pad(batch[f"{s}_labels"], -100) for s in ("chosen", "rejected")])
    shifted = torch.cat([labels[:, 1:], torch.full((len(labels), 1), -100)], dim=1)
    positions = torch.arange(width).expand(len(ids), width).contiguous()  # right padding: real tokens from 0
    return {"input_ids": ids, "labels": shifted, "position_ids": positions, "pair_index": torch.arange(N_PAIRS)}


def _first_step(objective, trainer, model) -> tuple[dict, dict]:
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(N_PAIRS)])
    loss, theirs = trainer.get_batch_loss_metrics(trainer.model, batch)
    theirs["loss"] = float(loss)
    ours_batch = _as_our_batch(batch)
    totals = objective.counts(ours_batch)
    _, sums = objective.step(CausalLMForTraining(model, chunk_size=16), ours_batch, totals, grad_scale=1.0)
    return objective.report({k: float(v) for k, v in sums.items()}, totals), theirs


@pytest.fixture(scope="module")
def setup(tiny_assets, tmp_path_factory):
    pytest.importorskip("trl")
    from datasets import load_dataset

    tok = AutoTokenizer.from_pretrained(tiny_assets["model"])
    setup_tokenizer(tok, "none")
    data = write_preference_dataset(tmp_path_factory.mktemp("pairs"), n_train=N_PAIRS, n_test=1, seed=5)
    model = AutoModelForCausalLM.from_pretrained(tiny_assets["model"], dtype=torch.float32)
    ds = load_dataset("json", data_files=str(data / "train.jsonl"), split="train")
    common = {
        "per_device_train_batch_size": N_PAIRS,
        "max_length": 64,
        "report_to": "none",
        "use_cpu": True,
        "bf16": False,
        "save_strategy": "no",
        "remove_unused_columns": False,
    }
    return tok, model, ds, common


# Average log-probs over ~10 completion tokens (each a few fp32 ulp of ~8: ~1e-6) and their smooth functions;
# the NLL term is a mean over ~100 tokens of the same. 1e-5 as for DPO.
TOL = 1e-5


def test_simpo_first_step_equals_trls_cpo_trainer(setup, tmp_path):
    from trl.experimental.cpo import CPOConfig, CPOTrainer

    tok, model, ds, common = setup
    # cpo_alpha 0: SimPO without CPO's NLL term, as TRL's docs set it for SimPO.
    args = CPOConfig(output_dir=str(tmp_path), loss_type="simpo", beta=2.0, simpo_gamma=0.5, cpo_alpha=0.0, **common)
    trainer = CPOTrainer(model=model, args=args, train_dataset=ds, processing_class=tok)
    objective = build_objective("simpo", beta=2.0, loss_type="sigmoid", simpo_gamma=0.5)
    ours, theirs = _first_step(objective, trainer, trainer.model)
    assert theirs["rewards/margins"] != 0 and 0 < theirs["rewards/accuracies"] < 1
    for key in ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies"):
        assert ours[key] == pytest.approx(theirs[key], abs=TOL), key
    for key in ("logps/chosen", "logps/rejected"):
        assert ours[key] == pytest.approx(theirs[key], abs=TOL), key


def test_orpo_first_step_equals_trls_orpo_trainer_but_for_the_prompt_in_the_nll(setup, tmp_path):
    """TRL's ORPOTrainer takes the NLL term over prompt and completion ("orpo chosen nll loss is computed over the
    full prompt and response"); shardtune's over the completion only (prompt tokens never count in a loss, as in
    the ORPO paper). Everything else equals TRL's; the NLL over the completion is checked by hand."""
    from trl.experimental.orpo import ORPOConfig, ORPOTrainer

    tok, model, ds, common = setup
    args = ORPOConfig(output_dir=str(tmp_path), beta=0.1, **common)
    trainer = ORPOTrainer(model=model, args=args, train_dataset=ds, processing_class=tok)
    objective = build_objective("orpo", beta=0.1, loss_type="sigmoid", simpo_gamma=0.5)
    ours, theirs = _first_step(objective, trainer, trainer.model)
    assert theirs["rewards/margins"] != 0
    for key in ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies"):
        assert ours[key] == pytest.approx(theirs[key], abs=TOL), key
    for key in ("logps/chosen", "logps/rejected"):
        assert ours[key] == pytest.approx(theirs[key], abs=TOL), key
    # The odds-ratio term (loss - nll_loss) is TRL's; the NLL differs only in which tokens it averages.
    assert ours["loss"] - ours["nll_loss"] == pytest.approx(theirs["loss"] - theirs["nll_loss"], abs=TOL)
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(N_PAIRS)])
    with torch.no_grad():
        logits = trainer.model(batch["chosen_input_ids"], attention_mask=batch["chosen_attention_mask"]).logits
    nll = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), batch["chosen_labels"][:, 1:].flatten())
    assert ours["nll_loss"] == pytest.approx(float(nll), abs=TOL) and abs(ours["nll_loss"] - theirs["nll_loss"]) > 1e-3
