"""Preference tuning: pair data (plain and conversational), the objectives' numbers against trl 1.16 on the same
batch, and the reference as the base with the adapter disabled."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from shardtune.commands.demo import write_preference_dataset
from shardtune.data import setup_tokenizer
from shardtune.data.preference import tokenize_pair
from shardtune.models.training_module import CausalLMForTraining
from shardtune.objectives.heads import sequence_logps
from shardtune.objectives.loss import PreferenceObjective, build_objective
from tests.trl_parity import build_pairs, shardtune_first_step, trl_first_step

N_PAIRS = 6  # one batch: every pair of the parity set


@pytest.fixture(scope="module")
def pairs_dir(tmp_path_factory):
    return write_preference_dataset(tmp_path_factory.mktemp("pairs"), n_train=N_PAIRS, n_test=4, seed=5)


@pytest.fixture(scope="module")
def tok(tiny_assets):
    t = AutoTokenizer.from_pretrained(tiny_assets["model"])
    setup_tokenizer(t, "none")  # pad = EOS, as TRL sets it
    return t


def build(tok, data, **kw):
    return build_pairs(tok, data, **kw)


def test_pairs_mask_the_prompt_and_keep_chosen_and_rejected_together(tok, pairs_dir):
    train, test = build(tok, pairs_dir)
    assert len(train) == N_PAIRS and len(test) == 4
    row = json.loads((pairs_dir / "train.jsonl").read_text().splitlines()[0])
    prompt_ids, chosen_ids, rejected_ids = tokenize_pair(tok, row, "train", 0, True)
    for r, completion in ((0, chosen_ids), (1, rejected_ids)):
        ids, labels = train.input_ids[r], train.labels[r]
        assert ids == prompt_ids + completion and completion[-1] == tok.eos_token_id
        # Position t predicts token t+1: targets are exactly the completion tokens, none of the prompt's.
        assert [y for y in labels if y != -100] == completion
        assert all(y == -100 for y in labels[: len(prompt_ids) - 1])
    # Two ranks with 1 pair each see the same pairs as one process with 2 pairs: each pair whole on one rank.
    kw = {"epoch": 0, "seed": 1, "shuffle": True, "pad_id": tok.pad_token_id}
    (single,) = list(train.iterate(batch_size=2, rank=0, world_size=1, **kw))[:1]
    ranks = [next(iter(train.iterate(batch_size=1, rank=r, world_size=2, **kw))) for r in range(2)]
    for r, b in enumerate(ranks):
        assert torch.equal(b["input_ids"][0], single["input_ids"][r])  # chosen of pair r
        assert torch.equal(b["input_ids"][1], single["input_ids"][2 + r])  # its rejected
        assert b["pair_index"].item() == single["pair_index"][r].item()


def test_long_pairs_are_truncated_or_dropped_and_counted(tok, pairs_dir, tmp_path):
    rows = [json.loads(line) for line in (pairs_dir / "train.jsonl").read_text().splitlines()]
    rows[0] = {**rows[0], "prompt": rows[0]["prompt"] + " word" * 60}  # the prompt alone fills max_length
    rows[1] = {**rows[1], "chosen": rows[1]["chosen"] + " word" * 40}  # only the completion is too long
    path = tmp_path / "long.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    train, _ = build(tok, path, splits="train", max_length=40)
    assert (train.stats["dropped"], train.stats["truncated"], len(train)) == (1, 1, N_PAIRS - 1)
    assert max(train.input_ids.lengths()) == 40
    dropped, _ = build(tok, path, splits="train", max_length=40, drop_long_samples=True)
    assert (dropped.stats["dropped"], dropped.stats["truncated"], len(dropped)) == (2, 0, N_PAIRS - 2)


def test_conversational_pairs_use_the_chat_template(tiny_assets, tmp_path):
    t = AutoTokenizer.from_pretrained(tiny_assets["model"])
    setup_tokenizer(t, "chatml")
    data = write_preference_dataset(tmp_path, n_train=3, n_test=1, seed=2, conversational=True)
    train, _ = build(t, data, splits="train")
    row = json.loads((data / "train.jsonl").read_text().splitlines()[0])
    prompt = t.apply_chat_template(row["prompt"], tokenize=True, return_dict=True, add_generation_prompt=True)
    full = t.apply_chat_template(row["prompt"] + row["chosen"], tokenize=True, return_dict=True)["input_ids"]
    assert train.input_ids[0] == list(full)
    n_prompt = len(prompt["input_ids"])
    assert [y for y in train.labels[0] if y != -100] == list(full[n_prompt:])
    # Without a prompt column the shared leading turns are the prompt (TRL's extract_prompt).
    implicit = {"chosen": row["prompt"] + row["chosen"], "rejected": row["prompt"] + row["rejected"]}
    (tmp_path / "implicit.jsonl").write_text(json.dumps(implicit) + "\n")
    again, _ = build(t, tmp_path / "implicit.jsonl", splits="train")
    assert again.input_ids[0] == train.input_ids[0] and again.labels[1] == train.labels[1]


def test_wrong_columns_name_the_fix(tok, tmp_path):
    path = tmp_path / "kto.jsonl"
    path.write_text(json.dumps({"prompt": "a", "completion": "b", "label": True}) + "\n")
    with pytest.raises(ValueError, match="`chosen` and `rejected` columns.*KTO"):
        build(tok, path, splits="train")


# --------------------------------------------------------------------------- numbers equal TRL's


def _policy_and_reference(model_dir):
    """The reference is the tiny model; the policy the same model with seeded noise on every weight, so that
    rewards, margins and accuracies are not trivially zero."""
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    policy = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return policy, ref


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
def test_dpo_first_step_equals_trl(tiny_assets, tok, pairs_dir, tmp_path, loss_type):
    trl = pytest.importorskip("trl")
    policy, ref = _policy_and_reference(tiny_assets["model"])
    train, _ = build(tok, pairs_dir)
    objective = build_objective("dpo", beta=0.1, loss_type=loss_type, simpo_gamma=0.5)
    ours = shardtune_first_step(objective, policy, ref, train, batch_size=N_PAIRS, pad_id=tok.pad_token_id)
    theirs = trl_first_step(
        trl.DPOTrainer, trl.DPOConfig, policy=policy, ref=ref, data=pairs_dir / "train.jsonl", tok=tok,
        batch_size=N_PAIRS, out=tmp_path, beta=0.1, loss_type=[loss_type],
    )  # fmt: skip
    assert theirs["rewards/margins"] != 0 and 0 < theirs["rewards/accuracies"] < 1  # a batch that tells apart
    # fp32 sums of about 20 token log-probs (|log p| < 8, each off by a few ulp of the logits, ~1e-6) differ by
    # ~1e-5 at most in the logps; rewards are beta (0.1) times differences of them, the loss a smooth function.
    for key in ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies"):
        assert ours[key] == pytest.approx(theirs[key], abs=1e-5), key
    for key in ("logps/chosen", "logps/rejected"):
        assert ours[key] == pytest.approx(theirs[key], abs=2e-5), key


def test_simpo_and_orpo_equal_trls_loss_functions(tiny_assets):
    """SimPO and ORPO live in trl.experimental, whose trainers tokenize differently; their loss functions are
    called on the same average log-probs as ours."""
    pytest.importorskip("trl")
    from trl.experimental.cpo import CPOTrainer
    from trl.experimental.orpo import ORPOTrainer

    g = torch.Generator().manual_seed(1)
    logps = -torch.rand(8, generator=g, dtype=torch.float64) * 30 - 0.01
    n = torch.randint(1, 20, (8,), generator=g)
    avg_c, avg_r = (logps / n).chunk(2)

    cpo = CPOTrainer.__new__(CPOTrainer)  # only the loss function's attributes
    cpo.beta, cpo.loss_type, cpo.simpo_gamma, cpo.label_smoothing, cpo.alpha = 2.0, "simpo", 0.5, 0.0, 0.0
    cpo.accelerator = type("A", (), {"device": torch.device("cpu")})()
    losses, chosen_r, rejected_r = cpo.cpo_loss(avg_c, avg_r)
    s = PreferenceObjective("simpo", beta=2.0, simpo_gamma=0.5).scores(logps, n, None)
    torch.testing.assert_close(s.loss, losses, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(s.chosen_rewards, chosen_r)
    torch.testing.assert_close(s.rejected_rewards, rejected_r)

    orpo = ORPOTrainer.__new__(ORPOTrainer)
    orpo.beta, orpo.accelerator = 0.1, cpo.accelerator
    losses, chosen_r, rejected_r, _, _ = orpo.odds_ratio_loss(avg_c, avg_r)
    s = PreferenceObjective("orpo", beta=0.1).scores(logps, n, None)
    torch.testing.assert_close(s.loss, -losses.double())  # TRL returns the term it subtracts
    torch.testing.assert_close(s.chosen_rewards, chosen_r.double())


def test_disabled_adapter_gives_the_base_models_logps(tiny_assets, tok, pairs_dir):
    """The per-step reference of an adapter run is the base: the same log-probs as the model without PEFT."""
    from peft import LoraConfig, get_peft_model

    train, _ = build(tok, pairs_dir)
    batch = next(
        iter(train.iterate(batch_size=2, rank=0, world_size=1, epoch=0, seed=0, shuffle=False, pad_id=tok.pad_token_id))
    )
    base = AutoModelForCausalLM.from_pretrained(tiny_assets["model"], dtype=torch.float32)
    inputs = {k: batch[k] for k in ("input_ids", "position_ids", "labels")}
    with torch.no_grad():
        expected = CausalLMForTraining(base)(**inputs, head=sequence_logps)[0]
    peft = get_peft_model(base, LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False))
    model = CausalLMForTraining(peft)
    objective = build_objective("dpo", beta=0.1, loss_type="sigmoid", simpo_gamma=0.5)
    ref = objective._reference(model, batch)
    torch.testing.assert_close(ref, expected, rtol=0, atol=0)
    with torch.no_grad():
        adapted = model(**inputs, head=sequence_logps)[0]
    assert (adapted - expected).abs().max() > 1e-3  # the adapter is back on after the reference pass
    assert all(p.requires_grad for n, p in peft.named_parameters() if "lora_" in n)


def test_per_sequence_logps_equal_full_logits(tiny_assets, tok, pairs_dir):
    train, _ = build(tok, pairs_dir)
    batch = next(
        iter(train.iterate(batch_size=3, rank=0, world_size=1, epoch=0, seed=0, shuffle=False, pad_id=tok.pad_token_id))
    )
    model = CausalLMForTraining(
        AutoModelForCausalLM.from_pretrained(tiny_assets["model"], dtype=torch.float32), chunk_size=7
    )
    with torch.no_grad():
        logps, n = model(batch["input_ids"], batch["position_ids"], batch["labels"], head=sequence_logps)
        logits = model.logits(batch["input_ids"], batch["position_ids"])
    mask = batch["labels"] != -100
    token = torch.log_softmax(logits, -1).gather(-1, batch["labels"].clamp(min=0)[..., None])[..., 0]
    torch.testing.assert_close(logps, (token * mask).sum(-1), rtol=1e-6, atol=1e-5)
    assert torch.equal(n, mask.sum(-1)) and np.all(n.numpy() > 0)


def test_plan_counts_two_rows_per_pair_and_names_the_reference(tiny_assets, capsys):
    from shardtune.commands.plan import main

    base = ["--model_name_or_path", str(tiny_assets["model"]), "--use_peft_lora", "True", "--json", "True"]
    estimates = {}
    for objective, batch in (("sft", 8), ("dpo", 4)):
        assert main([*base, "--objective", objective, "--per_device_train_batch_size", str(batch)]) == 0
        estimates[objective] = json.loads(capsys.readouterr().out)
    sft, dpo = estimates["sft"], estimates["dpo"]
    # 4 pairs are 8 rows: the activations of SFT with 8 rows (without dropout masks, which DPO turns off).
    assert dpo["run"]["rows_per_example"] == 2 and dpo["run"]["lora_dropout"] == 0.0
    assert any("adapter disabled" in n for n in dpo["notes"]) and not any("--objective" in n for n in sft["notes"])
    assert main([*base, "--objective", "sft", "--per_device_train_batch_size", "8", "--lora_dropout", "0"]) == 0
    no_dropout = json.loads(capsys.readouterr().out)
    assert dpo["device"] == no_dropout["device"]


def test_flags_that_do_not_apply_are_refused_with_the_fix(tiny_assets, pairs_dir):
    from shardtune.config.errors import ConfigError
    from shardtune.recipe.run_config import load_run_config

    base = ["--model_name_or_path", str(tiny_assets["model"]), "--dataset_name", str(pairs_dir)]
    with pytest.raises(ConfigError) as e:
        load_run_config(
            [*base, "--objective", "orpo", "--packing", "True", "--loss_type", "ipo", "--beta", "0"], env={}
        )
    text = str(e.value)
    assert "--packing does not apply to --objective orpo" in text and "set --packing False" in text
    assert "--loss_type only applies to --objective dpo" in text and "--beta must be > 0" in text
    with pytest.raises(ConfigError, match="--loss_type only applies to --objective dpo"):
        load_run_config([*base, "--loss_type", "ipo"], env={})
    assert load_run_config([*base, "--objective", "dpo", "--loss_type", "ipo"], env={}).train.loss_type == "ipo"
    with pytest.raises(ConfigError) as e:
        load_run_config([*base, "--objective", "dpo", "--undesirable_weight", "0", "--desirable_weight", "2"], env={})
    text = str(e.value)
    assert "--undesirable_weight must be > 0 (got 0.0)" in text
    assert "--desirable_weight, --undesirable_weight only apply to --objective kto" in text
    with pytest.raises(ConfigError, match="--precompute_ref_log_probs only applies to --objective dpo or kto"):
        load_run_config([*base, "--objective", "simpo", "--precompute_ref_log_probs", "True"], env={})
    cfg = load_run_config([*base, "--objective", "kto", "--desirable_weight", "1.33"], env={})
    assert (cfg.train.desirable_weight, cfg.train.undesirable_weight) == (1.33, 1.0)


_NOT_READ = {
    "--simpo_gamma": "--simpo_gamma only applies to --objective simpo; remove it or set it.",
    "--beta": "--beta only applies to --objective dpo, simpo, orpo, kto or grpo; remove it or set one of them.",
    "--precompute_ref_log_probs": (
        "--precompute_ref_log_probs only applies to --objective dpo or kto; remove it or set one of them."
    ),
}


@pytest.mark.parametrize(
    ("objective", "flags"),
    [("dpo", ["--simpo_gamma", "1.0"]), ("sft", ["--beta", "0.5"]), ("orpo", ["--precompute_ref_log_probs", "True"])],
)
def test_a_knob_the_objective_does_not_read_is_refused(tiny_assets, pairs_dir, objective, flags):
    """Each objective's spec names the knobs it reads (ObjectiveSpec.knobs): any other knob set away from its default
    would change nothing, and is refused naming the objectives that read it."""
    from shardtune.config.errors import ConfigError
    from shardtune.recipe.run_config import load_run_config

    base = ["--model_name_or_path", str(tiny_assets["model"]), "--dataset_name", str(pairs_dir)]
    with pytest.raises(ConfigError) as e:
        load_run_config([*base, "--objective", objective, *flags], env={})
    assert e.value.problems == [_NOT_READ[flags[0]]]
    reader = {"--simpo_gamma": "simpo", "--beta": "orpo", "--precompute_ref_log_probs": "kto"}[flags[0]]
    assert load_run_config([*base, "--objective", reader, *flags], env={}).train.objective == reader


def test_a_plugin_objective_that_names_no_knobs_may_read_any(tiny_assets, pairs_dir, monkeypatch, capsys):
    """A registered objective without `knobs` receives every knob (build(**knobs)), so none is refused for it; it is
    listed among the readers of every knob, and in --help."""
    from shardtune.cli import main as cli_main
    from shardtune.config.errors import ConfigError
    from shardtune.objectives.loss import OBJECTIVES, ObjectiveSpec
    from shardtune.recipe.run_config import load_run_config

    monkeypatch.setitem(OBJECTIVES, "mine", ObjectiveSpec("mine", OBJECTIVES["sft"].build, help="a plugin's"))
    base = ["--model_name_or_path", str(tiny_assets["model"]), "--dataset_name", str(pairs_dir)]
    cfg = load_run_config([*base, "--objective", "mine", "--simpo_gamma", "2", "--beta", "3"], env={})
    assert (cfg.train.simpo_gamma, cfg.train.beta) == (2.0, 3.0)
    with pytest.raises(ConfigError, match="--simpo_gamma only applies to --objective simpo or mine;"):
        load_run_config([*base, "--objective", "dpo", "--simpo_gamma", "2"], env={})
    assert cli_main(["train", "--help"]) == 0
    help_text = " ".join(capsys.readouterr().out.split())
    assert (
        "kto: unpaired prompt/completion/label rows; grpo: online RL" in help_text and "mine: a plugin's." in help_text
    )


def test_tensorboard_tags_are_trls(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from shardtune.training.metrics import RunLogger

    logger = RunLogger(str(tmp_path), is_main=True, report_to="tensorboard", total_steps=1, disable_progress=True)
    logger.log_train(1, {"loss": 0.69, "rewards/chosen": 0.25, "rewards/accuracies": 0.5, "logps/rejected": -60.0})
    logger.log_eval(1, {"eval_loss": 0.7, "eval_rewards/margins": 0.125})
    logger.close()
    acc = EventAccumulator(str(tmp_path / "runs"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    # What TRL's trainers log through transformers' TensorBoard callback.
    assert {"train/rewards/chosen", "train/rewards/accuracies", "train/logps/rejected"} <= tags
    assert "eval/rewards/margins" in tags and acc.Scalars("train/rewards/chosen")[0].value == 0.25
