"""The model card's lm-evaluation-harness section, and the --eval_harness_* flags' checks."""

from __future__ import annotations

from shardtune.training.modelcard import set_eval_section


def test_eval_section_is_added_once_and_replaced(tmp_path):
    card = tmp_path / "README.md"
    card.write_text("---\nlicense: mit\n---\n\n# model\n\n## Results\n\n| a | b |\n")
    set_eval_section(card, "| task | acc |\n| --- | --- |\n| t | 0.25 |")
    set_eval_section(card, "| task | acc |\n| --- | --- |\n| t | 0.75 |\n")
    text = card.read_text()
    assert text.startswith("---\nlicense: mit\n---\n\n# model\n\n## Results\n\n| a | b |\n\n")
    assert text.count("## Evaluation (lm-evaluation-harness)") == 1
    assert "0.75" in text and "0.25" not in text
    assert not list(tmp_path.glob("*.tmp"))


def test_eval_harness_flags_are_checked(tmp_path):
    from shardtune.config.validation import _eval_harness_problems

    assert _eval_harness_problems(None, str(tmp_path)) == ["--eval_harness_include_path needs --eval_harness_tasks."]
    missing = tmp_path / "none"
    assert _eval_harness_problems("t", str(missing)) == [f"--eval_harness_include_path {missing}: no such folder."]
    assert _eval_harness_problems("t", str(tmp_path)) == []
