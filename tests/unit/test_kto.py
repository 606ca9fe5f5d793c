"""KTO: unpaired prompt/completion/label rows (plain and conversational), their KL rows as TRL builds them, and
the first step's numbers against trl 1.16's KTOTrainer on the same batch."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from shardtune.commands.demo import write_preference_dataset
from shardtune.data import setup_tokenizer
from shardtune.data.preference import tokenize_unpaired
from shardtune.objectives.loss import build_objective
from tests.trl_parity import build_pairs, shardtune_first_step, trl_first_step

GROUP = 6  # examples per micro-batch: the KL rows rotate completions within groups of this many


def write_unpaired(pairs_dir: Path, out: Path) -> Path:
    """KTO rows from a pair set: each pair's chosen (label true) and rejected (false), in a seeded order so that
    a batch mixes desirable and undesirable examples."""
    out.mkdir(parents=True, exist_ok=True)
    for split in ("train", "test"):
        rows = []
        for line in (pairs_dir / f"{split}.jsonl").read_text().splitlines():
            pair = json.loads(line)
            rows += [
                {"prompt": pair["prompt"], "completion": pair["chosen"], "label": True},
                {"prompt": pair["prompt"], "completion": pair["rejected"], "label": False},
            ]
        random.Random(3).shuffle(rows)
        (out / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return out


@pytest.fixture(scope="module")
def tok(tiny_assets):
    t = AutoTokenizer.from_pretrained(tiny_assets["model"])
    setup_tokenizer(t, "none")  # pad = EOS, as TRL sets it
    return t


@pytest.fixture(scope="module")
def kto_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("kto")
    return write_unpaired(write_preference_dataset(root / "pairs", n_train=GROUP, n_test=2, seed=5), root / "kto")


def build(tok, data, **kw):
    return build_pairs(tok, data, **{"kto_group": GROUP, **kw})


def test_kl_rows_pair_each_prompt_with_the_previous_completion_of_its_group(tok, kto_dir, tmp_path):
    train, test = build(tok, kto_dir, cache_dir=str(tmp_path))
    rows = [json.loads(line) for line in (kto_dir / "train.jsonl").read_text().splitlines()]
    assert len(train) == 2 * GROUP and len(test) == 4
    assert list(train.desirable) == [r["label"] for r in rows] and train.stats["desirable"] == GROUP
    parts = [tokenize_unpaired(tok, r, "train", i, True) for i, r in enumerate(rows)]
    for i, (prompt, completion, _) in enumerate(parts):
        # TRL: (x_1, y_n), (x_2, y_1), ... within each group of GROUP consecutive examples
        group_start = i - i % GROUP
        partner = group_start + (i - group_start - 1) % GROUP
        assert train.input_ids[2 * i] == prompt + completion
        assert train.input_ids[2 * i + 1] == prompt + parts[partner][1]
        assert [y for y in train.labels[2 * i + 1] if y != -100] == parts[partner][1]  # only the completion counts
    batch = next(iter(train.iterate(batch_size=3, rank=0, world_size=1, epoch=0, seed=0, shuffle=False, pad_id=0)))
    assert batch["desirable"].tolist() == [r["label"] for r in rows[:3]]
    # The cache gives back the same rows and labels.
    again, _ = build(tok, kto_dir, cache_dir=str(tmp_path))
    assert again.from_cache and again.input_ids[5] == train.input_ids[5]
    assert list(again.desirable) == list(train.desirable)


def test_conversational_kto_rows_use_the_chat_template(tiny_assets, tmp_path):
    t = AutoTokenizer.from_pretrained(tiny_assets["model"])
    setup_tokenizer(t, "chatml")
    prompt = [{"role": "user", "content": "The capital of Ghana?"}]
    rows = [
        {"prompt": prompt, "completion": [{"role": "assistant", "content": "Accra."}], "label": True},
        {"prompt": prompt, "completion": [{"role": "assistant", "content": "Ghana."}], "label": False},
    ]
    (tmp_path / "c.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    train, _ = build(t, tmp_path / "c.jsonl", splits="train", kto_group=2)
    full = t.apply_chat_template(prompt + rows[0]["completion"], tokenize=True, return_dict=True)["input_ids"]
    n_prompt = len(
        t.apply_chat_template(prompt, tokenize=True, return_dict=True, add_generation_prompt=True)["input_ids"]
    )
    assert train.input_ids[0] == list(full)
    assert [y for y in train.labels[0] if y != -100] == list(full[n_prompt:])
    assert list(train.desirable) == [True, False]


def test_kto_data_mistakes_name_the_fix(tok, kto_dir, tmp_path):
    with pytest.raises(ValueError, match="--objective kto needs `prompt`, `completion` and `label`.*--objective dpo"):
        build(tok, kto_dir.parent / "pairs")
    with pytest.raises(ValueError, match="`chosen` and `rejected` columns.*--objective kto"):
        build(tok, kto_dir, kto_group=None)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "a", "completion": "b", "label": "yes"}) + "\n")
    with pytest.raises(ValueError, match="row 0: `label` must be true or false .* got 'yes'"):
        build(tok, bad, splits="train")
    with pytest.raises(ValueError, match="--per_device_train_batch_size × ranks >= 2"):
        build(tok, kto_dir, kto_group=1)


def test_kto_first_step_equals_trl(tiny_assets, tok, kto_dir, tmp_path):
    trl = pytest.importorskip("trl")

    policy = AutoModelForCausalLM.from_pretrained(tiny_assets["model"], dtype=torch.float32)
    ref = AutoModelForCausalLM.from_pretrained(tiny_assets["model"], dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        # The reference is a noisy copy: the rewards are not zero, and the mismatched completions are likelier
        # under the (smoother) policy, so the KL estimate is positive rather than clamped to 0.
        for p in ref.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    weights = {"desirable_weight": 1.0, "undesirable_weight": 1.5}

    train, _ = build(tok, kto_dir, splits="train")
    objective = build_objective("kto", beta=0.1, loss_type="sigmoid", simpo_gamma=0.5, **weights)
    ours = shardtune_first_step(objective, policy, ref, train, batch_size=GROUP, pad_id=tok.pad_token_id)
    theirs = trl_first_step(
        trl.KTOTrainer, trl.KTOConfig, policy=policy, ref=ref, data=kto_dir / "train.jsonl", tok=tok,
        batch_size=GROUP, out=tmp_path, beta=0.1, **weights,
    )  # fmt: skip
    assert theirs["kl"] > 0.01 and theirs["rewards/margins"] != 0  # the batch exercises the KL term
    # Sums of ~20 fp32 token log-probs (a few ulp of ~8 each, ~1e-6) differ by ~1e-5 at most; rewards and the KL
    # are beta (0.1) times (means of) differences of them, the loss a smooth function of those.
    for key in ("loss", "kl", "rewards/chosen", "rewards/rejected", "rewards/margins"):
        assert ours[key] == pytest.approx(theirs[key], abs=1e-5), key
    for key in ("logps/chosen", "logps/rejected"):
        assert ours[key] == pytest.approx(theirs[key], abs=2e-5), key


def test_unbalanced_labels_get_trls_weight_advice():
    from shardtune.objectives.loss import kto_weight_advice

    # 100 desirable, 300 undesirable: λ_D·100 / (λ_U·300) must lie in [1, 4/3] (TRL rounds 1.33 and 2 decimals):
    # λ_D in [3.0, 3.99] with λ_U = 1, or λ_U in [1/3/1.33, 1/3] = [0.25, 0.33] with λ_D = 1.
    advice = kto_weight_advice(100, 300, 1.0, 1.0)
    assert "--desirable_weight in [3.0, 3.99]" in advice and "--undesirable_weight in [0.25, 0.33]" in advice
    assert kto_weight_advice(100, 300, 3.5, 1.0) is None and kto_weight_advice(100, 300, 1.0, 0.3) is None
    assert kto_weight_advice(200, 200, 1.0, 5.0) is None  # balanced: TRL says nothing
