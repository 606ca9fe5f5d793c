"""An online-RL run's flags are checked before anything loads (shardtune.rl.checks, recipe.run_config), each problem
one line naming the flag and the fix: GRPO flags given to another objective, ranges, what GRPO does not support yet,
reward functions that cannot be resolved; GRPO's own defaults of shared knobs (TRL GRPOConfig's beta 0.0 and
loss_type dapo) where the run does not set them, and not where it does; a generation batch that is not whole groups;
a dataset without TRL's `prompt` column; the context check reads an RL run's longest row (prompt + completion)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from shardtune.config.errors import ConfigError
from shardtune.recipe.run_config import load_run_config


@pytest.fixture()
def prompts(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text(
        "".join(json.dumps({"prompt": f"What is {i} plus 1?", "answer": str(i + 1)}) + "\n" for i in range(8))
    )
    return path


def _argv(tiny_assets, data, *flags) -> list[str]:
    base = ["--model_name_or_path", str(tiny_assets["model"]), "--dataset_name", str(data), "--splits", "train"]
    return [*base, "--eval_strategy", "no", *flags]


def _problems(argv) -> list[str]:
    with pytest.raises(ConfigError) as e:
        load_run_config(argv, env={})
    return e.value.problems


def test_grpo_takes_trls_defaults_where_not_given(tiny_assets, prompts):
    cfg = load_run_config(_argv(tiny_assets, prompts, "--objective", "grpo", "--reward_funcs", "exact_answer"), env={})
    assert (cfg.train.beta, cfg.train.loss_type) == (0.0, "dapo")
    given = ["--objective", "grpo", "--reward_funcs", "exact_answer", "--beta", "0.04", "--loss_type", "grpo",
             "--use_peft_lora", "True"]  # fmt: skip
    cfg = load_run_config(_argv(tiny_assets, prompts, *given), env={})
    assert (cfg.train.beta, cfg.train.loss_type) == (0.04, "grpo")
    # another objective keeps the shared knobs' own defaults
    assert load_run_config(_argv(tiny_assets, prompts, "--objective", "sft"), env={}).train.beta == 0.1


def test_grpo_flags_with_another_objective_are_refused_naming_them(tiny_assets, prompts):
    problems = _problems(_argv(tiny_assets, prompts, "--num_generations", "4", "--reward_funcs", "format"))
    assert problems == [
        "--num_generations, --reward_funcs only apply to --objective grpo; remove them or set --objective grpo."
    ]


@pytest.mark.parametrize(
    ("flags", "line"),
    [
        (["--num_generations", "1"], "--num_generations must be >= 2"),
        (["--temperature", "0"], "--temperature must be > 0"),
        (["--top_p", "1.5"], "--top_p must be in (0, 1]"),
        (["--loss_type", "sigmoid"], "--loss_type sigmoid is not a GRPO loss; use one of grpo, bnpo, dr_grpo, dapo."),
        (["--packing", "True"], "--packing does not apply to --objective grpo"),
        (["--eval_strategy", "steps"], "--eval_strategy steps: --objective grpo has no evaluation yet"),
        (["--beta", "0.04", "--use_peft_lora", "False"], "--beta > 0 with full fine-tuning needs a second copy"),
        (["--vllm_server_port", "9000"], "--vllm_server_port only apply to --rollout_engine vllm"),
        (["--reward_funcs", "no_such_module:f"], "--reward_funcs 'no_such_module:f'"),
        (["--reward_funcs", "format", "--reward_weights", "1,2"], "--reward_weights"),
    ],
)
def test_each_bad_grpo_setting_is_one_line_naming_its_flag(tiny_assets, prompts, flags, line):
    base = ["--objective", "grpo", "--use_peft_lora", "True", "--reward_funcs", "exact_answer"]
    problems = _problems(_argv(tiny_assets, prompts, *base, *flags))
    assert any(p.startswith(line) or line in p for p in problems), problems
    assert all("\n" not in p for p in problems)


def test_context_parallelism_is_refused_for_grpo(tiny_assets, prompts):
    from shardtune.rl.checks import rl_problems

    cfg = load_run_config(_argv(tiny_assets, prompts, "--objective", "grpo", "--reward_funcs", "format"), env={})
    assert rl_problems(cfg) == []
    cfg.train.context_parallel_size = 2  # what a 2-rank launch with --context_parallel_size 2 gives
    assert rl_problems(cfg) == [
        "--objective grpo does not support context parallelism yet; set --context_parallel_size 1."
    ]


def test_grpo_without_reward_functions_is_refused(tiny_assets, prompts):
    problems = _problems(_argv(tiny_assets, prompts, "--objective", "grpo"))
    need = "built-in names (format, exact_answer, math_answer), module:function or path/to/file.py:function"
    assert problems == [f"--objective grpo needs --reward_funcs: {need}."]


def test_a_generation_batch_of_partial_groups_is_refused_naming_the_flags():
    from shardtune.recipe.rl import rollout_settings

    cfg = SimpleNamespace(train=SimpleNamespace(
        per_device_train_batch_size=3, generation_steps=1, num_generations=4,
    ))  # fmt: skip
    info = SimpleNamespace(dims=SimpleNamespace(dp_size=2))
    with pytest.raises(ValueError, match=r"a generation batch of 6 completions .* is not whole groups of "
                       r"--num_generations 4; make it a multiple\."):  # fmt: skip
        rollout_settings(cfg, info, tokenizer=None)


def test_prompts_without_a_prompt_column_are_refused(tmp_path):
    from transformers import AutoTokenizer

    from shardtune.commands.demo import build_tokenizer
    from shardtune.config.arguments import DataArguments
    from shardtune.data.prompts import build_prompt_datasets

    build_tokenizer(tmp_path / "tok", vocab_size=300)
    tok = AutoTokenizer.from_pretrained(tmp_path / "tok")
    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps({"question": "hi", "answer": "1"}) + "\n")
    with pytest.raises(ValueError, match=r"reads TRL's prompt-only format, a `prompt` column .* found columns"):
        build_prompt_datasets(
            DataArguments(dataset_name=str(data), splits="train"), tokenizer=tok, max_prompt_length=None
        )
    data.write_text(json.dumps({"prompt": "What is one plus one?", "answer": "2"}) + "\n")
    split, _ = build_prompt_datasets(DataArguments(dataset_name=str(data), splits="train"), tokenizer=tok,
                                     max_prompt_length=3)  # fmt: skip
    assert len(split.prompt_ids[0]) == 3 and split.truncated == 1 and split.columns == {"answer": ["2"]}
    whole = tok("What is one plus one?", add_special_tokens=False)["input_ids"]
    assert split.prompt_ids[0] == whole[-3:]  # the prompt's end is kept


def test_the_context_check_reads_an_rl_runs_prompt_plus_completion(tiny_assets, prompts):
    from shardtune.models.preflight import model_input_problems

    ok = ["--objective", "grpo", "--reward_funcs", "exact_answer", "--max_seq_len", "100000"]
    assert not [p for p in model_input_problems(load_run_config(_argv(tiny_assets, prompts, *ok), env={})) if p]
    long = [*ok, "--max_prompt_length", "100000"]
    problems = [p for p in model_input_problems(load_run_config(_argv(tiny_assets, prompts, *long), env={})) if p]
    assert problems and problems[0].startswith("--max_prompt_length + --max_completion_length 100512 is longer than")


def test_a_conversational_prompt_gets_the_template_and_the_generation_prompt(tmp_path):
    """TRL's conversational prompt-only rows: the chat template with add_generation_prompt, a row's
    chat_template_kwargs passed to it; the other columns kept for the rewards."""
    from transformers import AutoTokenizer

    from shardtune.commands.demo import build_tokenizer
    from shardtune.config.arguments import DataArguments
    from shardtune.data.prompts import build_prompt_datasets
    from shardtune.data.templates import setup_tokenizer

    build_tokenizer(tmp_path / "tok", vocab_size=300)
    tok = AutoTokenizer.from_pretrained(tmp_path / "tok")
    setup_tokenizer(tok, "chatml")
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is one plus one?"}]
    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps({"prompt": messages, "solution": "2"}) + "\n")
    split, _ = build_prompt_datasets(DataArguments(dataset_name=str(data), splits="train"), tokenizer=tok,
                                     max_prompt_length=None)  # fmt: skip
    want = tok.apply_chat_template(messages, tokenize=True, return_dict=True, add_generation_prompt=True)
    assert split.prompt_ids[0] == list(want["input_ids"])
    assert tok.decode(split.prompt_ids[0]).endswith("<|im_start|>assistant\n")  # the generation prompt
    assert split.prompts[0] == messages and split.row_columns([0]) == {"solution": ["2"]}


def test_a_completion_ends_at_the_tokenizers_eos_or_a_stop_token_of_the_models_generation_config(tmp_path):
    """Llama 3 Instruct stops on <|eot_id|>, listed in its generation_config.json beside the tokenizer's EOS."""
    from transformers import AutoTokenizer, GenerationConfig

    from shardtune.commands.demo import build_tokenizer
    from shardtune.recipe.rl import eos_ids

    build_tokenizer(tmp_path / "m", vocab_size=300)
    tok = AutoTokenizer.from_pretrained(tmp_path / "m")
    assert eos_ids(tok, str(tmp_path / "m")) == (tok.eos_token_id,)  # no generation_config.json: the tokenizer's
    GenerationConfig(eos_token_id=[tok.eos_token_id, 7]).save_pretrained(tmp_path / "m")
    assert eos_ids(tok, str(tmp_path / "m")) == tuple(sorted({tok.eos_token_id, 7}))
