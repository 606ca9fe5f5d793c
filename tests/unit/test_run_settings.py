"""Each run decision has one home, read by `shardtune train` (its ModelSpec, loop, data and start-up plan) and by
`shardtune plan` alike (recipe/settings.py's docstring lists the homes). Each test derives the decision through
every reader and fails when a second derivation disagrees; each docstring names the negative control: the bug put
back in a planted copy of the sources (tests/mutation.py), under which the test was run and failed. The last test
counts the planner's passes during a `shardtune train` start-up: one.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml

from shardtune.commands.plan import make_plan
from shardtune.config.accelerate import accelerate_env, read_accelerate_yaml
from shardtune.config.errors import ConfigError
from shardtune.config.fsdp import SINGLE_PROCESS_ENV
from shardtune.data import build_datasets
from shardtune.models.builder import ModelSpec, build_training_module, model_facts, model_spec
from shardtune.models.loading import bnb_config, load_tokenizer
from shardtune.parallel.parallelize import ShardingSettings, sharding_settings, use_fsdp
from shardtune.planning import PlanInputs, fit
from shardtune.planning.estimate import estimate_memory, loss_chunk
from shardtune.planning.fit import RunFit, launch_from_settings, plan_inputs
from shardtune.planning.shape import ModelShape
from shardtune.planning.state import GiB
from shardtune.recipe import settings
from shardtune.recipe.rl import rollout_settings
from shardtune.recipe.run_config import load_run_config
from tests.conftest import build_data, train_args

# A Llama-shaped config.json: train's checks read the folder, plan reads the config.
TINY = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 256, "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "max_position_embeddings": 512, "torch_dtype": "float32",
}  # fmt: skip


@pytest.fixture
def model_dir(tmp_path) -> Path:
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(TINY))
    return folder


def _yaml(tmp_path: Path, processes: int = 2, machines: int = 1, parallelism: dict | None = None, **top) -> Path:
    fsdp = top.pop("fsdp_config", {})
    cfg = {
        "compute_environment": "LOCAL_MACHINE", "distributed_type": "FSDP", "mixed_precision": "no",
        "num_processes": processes, "num_machines": machines, "machine_rank": 0, "use_cpu": True,
        "fsdp_config": {"fsdp_version": 2, "fsdp_reshard_after_forward": True, **fsdp}, **top,
    }  # fmt: skip
    if parallelism:
        cfg["parallelism_config"] = {f"parallelism_config_{k}": v for k, v in parallelism.items()}
    path = tmp_path / "accelerate.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _train_env(path: Path) -> dict[str, str]:
    """The environment `accelerate launch --config_file path` gives a worker of the run."""
    cfg = read_accelerate_yaml(path)
    world = int(cfg["num_processes"])
    local = world // int(cfg.get("num_machines") or 1)
    return {**accelerate_env(cfg), "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(local)}


def _both(model_dir: Path, flags: list[str], path: Path | None = None):
    """(train's RunConfig, plan's Plan) for the same flags and YAML, or the problems each refused them with."""
    argv = ["--model_name_or_path", str(model_dir), *flags]
    try:
        train = load_run_config([*argv, "--dataset_name", "org/data"], env=_train_env(path) if path else {})
    except ConfigError as e:
        train = e.problems
    try:
        plan = make_plan([*argv, *(["--config_file", str(path)] if path else [])])
    except ConfigError as e:
        plan = e.problems
    return train, plan


def _info(world: int, local: int | None = None) -> SimpleNamespace:
    return SimpleNamespace(world_size=world, local_world_size=local or world, is_main=True, device=torch.device("cpu"))


# ---------------------------------------------------------------- packed rows


def _documents_per_row(split) -> list[int]:
    """Documents in each row of a streamed split's first window (positions restart at 0 for each document)."""
    _, rows, _ = next(split.windows(epoch=0, seed=0, start_window=0))
    positions = rows["position_ids"]
    return [int((positions.array(r) == 0).sum()) for r in range(len(positions))]


@pytest.mark.parametrize(("streaming", "packing"), [(True, False), (True, True), (False, False), (False, True)])
def test_packed_rows_are_what_the_data_the_builder_and_the_planner_read(tiny_assets, model_dir, streaming, packing):
    """DataArguments.packed_rows: --packing, for a streamed split too. The rows the data builds (a streamed
    window's: several documents a row exactly when packed), the layout the builder picks (ModelSpec.packing,
    read by builder.training_layout) and the planner's PlanInputs.packing, from `shardtune plan` too, agree.
    Negative control: the builder's old `packing=cfg.data.packing or cfg.data.streaming` planted, this test fails
    for --streaming True --packing False (the builder laid out packed rows the data never made)."""
    flags = ["--streaming", str(streaming), "--packing", str(packing), "--max_steps", "2", "--max_seq_len", "128"]
    cfg, plan = _both(model_dir, flags)
    assert cfg.data.packed_rows is packing
    assert model_spec(cfg, "cpu", 256, []).packing is packing
    assert plan.inputs.packing is packing
    assert plan_inputs(cfg, launch_from_settings(cfg.fsdp, 1, 1)).packing is packing
    if streaming:
        tok, _ = load_tokenizer(str(tiny_assets["model"]), tokenizer_name_or_path=None, chat_template_format="chatml",
                                trust_remote_code=False)  # fmt: skip
        split, _ = build_data(
            build_datasets, tokenizer=tok, dataset_name=str(tiny_assets["data"]), splits="train", max_length=128,
            packing=packing, streaming=True, packing_window=32, seed=0, chat_template_format="chatml",
        )  # fmt: skip
        per_row = _documents_per_row(split)
        assert (max(per_row) > 1) is packing, per_row


# ---------------------------------------------------------------- context-parallel size


@pytest.mark.parametrize(
    "flags",
    [[], ["--context_parallel_size", "2"], ["--context_parallel_size", "1"], ["--context_parallel_size", "4"]],
)
def test_plan_and_train_take_the_context_parallel_size_by_one_rule(tmp_path, model_dir, flags):
    """A YAML with parallelism_config_cp_size 2 on 4 processes: train (the environment accelerate launch sets) and
    plan (the YAML) both get 2, and both refuse a --context_parallel_size that contradicts it, with the same line
    (config.run.resolve_parallel_sizes). Negative control: plan's old rule planted (the YAML's cp_size only where
    the flag is 1, then a divisibility check), this test fails for --context_parallel_size 1 (plan took 2, train
    refused) and 4 (plan planned 4)."""
    path = _yaml(tmp_path, processes=4, parallelism={"dp_shard_size": 2, "cp_size": 2})
    train, plan = _both(model_dir, [*flags, "--bf16", "True"], path)
    if isinstance(train, list):
        assert plan == train and "parallelism_config_cp_size 2 differ" in train[0]
    else:
        assert train.train.context_parallel_size == 2
        assert plan.inputs.context_parallel == plan.run.train.context_parallel_size == 2


def test_a_context_parallel_size_that_does_not_divide_the_processes_is_one_line_from_either(tmp_path, model_dir):
    """The same check and line from train and plan: the size must divide the processes."""
    path = _yaml(tmp_path, processes=4)
    train, plan = _both(model_dir, ["--context_parallel_size", "3"], path)
    assert train == plan == ["--context_parallel_size 3: it must be a whole number ≥ 1 that divides the 4 processes."]


# ---------------------------------------------------------------- the launch: world size, machines, strategy


def test_the_launch_the_planner_sees_is_the_runs(tmp_path, model_dir, monkeypatch):
    """2 machines of 2 processes, parallelism_config dp_replicate 2 × dp_shard 2 (HYBRID_SHARD), offload: train's
    start-up plan (recipe.settings.run_launch, from RunConfig.fsdp and the processes) and `shardtune plan` (the YAML)
    plan the same world size, machines, strategy and offload, as the run shards. Negative control: run_launch
    reading the environment again (the old launch_from_env) planted, this test fails: the YAML's FULL_SHARD is
    planned where the run uses HYBRID_SHARD."""
    path = _yaml(tmp_path, processes=4, machines=2, parallelism={"dp_replicate_size": 2, "dp_shard_size": 2},
                 fsdp_config={"fsdp_offload_params": True})  # fmt: skip
    for k, v in _train_env(path).items():  # as a worker of the run sees it
        monkeypatch.setenv(k, v)
    cfg = load_run_config(["--model_name_or_path", str(model_dir), "--dataset_name", "org/data"])
    plan = make_plan(["--model_name_or_path", str(model_dir), "--config_file", str(path)])
    launch = settings.run_launch(cfg, _info(4, 2))
    fields = ("world_size", "num_nodes", "sharding_strategy", "offload", "single_process", "expandable_segments")
    assert [getattr(launch, f) for f in fields] == [getattr(plan.launch, f) for f in fields]
    assert (launch.sharding_strategy, launch.num_nodes, launch.offload) == (cfg.fsdp.sharding_strategy, 2, True)
    assert cfg.fsdp.sharding_strategy == "HYBRID_SHARD"
    mine = dataclasses.asdict(plan_inputs(cfg, launch))
    assert mine == dataclasses.asdict(plan.inputs)


# ---------------------------------------------------------------- precision and activation checkpointing


@pytest.mark.parametrize(
    ("flags", "top", "fsdp"),
    [([], {"mixed_precision": "bf16"}, {}), (["--fp16", "True"], {}, {}), ([], {}, {}),
     ([], {}, {"fsdp_activation_checkpointing": True}), (["--gradient_checkpointing", "True"], {}, {}),
     (["--use_peft_lora", "True", "--bf16", "True"], {}, {})],
)  # fmt: skip
def test_precision_and_checkpointing_are_the_runs_in_the_plan(tmp_path, model_dir, flags, top, fsdp):
    """The YAML's mixed_precision and fsdp_activation_checkpointing, or the flags: the builder's ModelSpec (its
    parameter dtype, its checkpointing) and the plan's inputs read RunConfig.precision and
    RunConfig.activation_checkpointing. Negative control: plan_inputs resolving the precision from the flags alone
    (`resolve_precision(bf16=train.bf16, fp16=train.fp16)`) planted, this test fails for the YAML's bf16; planted
    `gradient_checkpointing=train.gradient_checkpointing`, it fails for the YAML's fsdp_activation_checkpointing."""
    path = _yaml(tmp_path, fsdp_config=fsdp, **top)
    train, plan = _both(model_dir, flags, path)
    spec = model_spec(train, "cpu", 256, [])
    compute = spec.param_dtype or torch.float32
    assert (plan.inputs.bf16, plan.inputs.fp16) == (compute == torch.bfloat16, compute == torch.float16)
    assert compute == train.precision.compute
    assert plan.inputs.gradient_checkpointing is spec.gradient_checkpointing is train.activation_checkpointing


# ---------------------------------------------------------------- FSDP or the plain module


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("setting", ["auto", "fsdp", "no_fsdp"])
@pytest.mark.parametrize(("flags", "offload"), [([], False), (["--bf16", "True"], False), ([], True),
                                                (["--use_peft_lora", "True", "--bf16", "True"], False)])  # fmt: skip
def test_fsdp_or_the_plain_module_is_one_rule_for_the_run_and_the_plan(monkeypatch, model_dir, world, setting, flags,
                                                                       offload):  # fmt: skip
    """Whether the run shards (parallel.parallelize.use_fsdp) and whether the planner plans FSDP's buffers
    (PlanInputs.fsdp) read config.fsdp.fsdp_reason, for one and two processes, every SHARDTUNE_FSDP_SINGLE_PROCESS,
    offload, full fine-tuning in fp32 and bf16, and LoRA. Negative control: plan_inputs' "full mixed precision"
    planted as `not model.use_peft_lora` (the dtype left out), this test fails for fp32 full fine-tuning on one
    process under auto (the planner planned FSDP, the run trains the plain module)."""
    env = {SINGLE_PROCESS_ENV: setting, "ACCELERATE_USE_FSDP": "true", "WORLD_SIZE": str(world)}
    env["FSDP_OFFLOAD_PARAMS"] = str(offload).lower()
    cfg = load_run_config(["--model_name_or_path", str(model_dir), "--dataset_name", "org/data", *flags], env=env)
    spec = model_spec(cfg, "cpu", 256, [])
    trains_fsdp, _ = use_fsdp(spec, sharding_settings(cfg.fsdp), SimpleNamespace(world_size=world))
    assert plan_inputs(cfg, launch_from_settings(cfg.fsdp, world, 1)).fsdp is trains_fsdp


# ---------------------------------------------------------------- the loss's chunk, the objective's defaults


@pytest.mark.parametrize("vocab", [256, 128256])
def test_the_loss_chunk_is_the_runs_in_every_plan(tmp_path, vocab):
    """The run's chunk of the lm_head + cross-entropy (models.training_module.loss_chunk_tokens of the head's rows:
    ModelSpec leaves it None) is what `shardtune plan`, the estimate of default PlanInputs and the traced step plan,
    for a small vocabulary and for Llama-3's (256 positions: 2**25 logits). Negative control: the planner's
    default planted back as the constant 1024, the 128,256-token case fails."""
    from shardtune.planning.trace import trace_step

    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({**TINY, "vocab_size": vocab, "hidden_size": 16}))
    cfg, plan = _both(folder, [])
    spec = model_spec(cfg, "cpu", vocab, [])
    assert (
        spec.loss_chunk_size is None and inspect.signature(trace_step).parameters["loss_chunk_tokens"].default is None
    )
    module, _ = build_training_module(spec, on_meta=True, quantize_device=None)
    assert plan.inputs.loss_chunk_tokens is None  # the estimate's rule, as for a train start-up's plan_inputs
    assert module.chunk_size == plan.to_dict()["run"]["loss_chunk_tokens"] == loss_chunk(plan.shape, PlanInputs())
    assert module.chunk_size == {256: 1024, 128256: 256}[vocab]
    # the estimate of the rule's default is the estimate of that chunk given explicitly
    given = dataclasses.replace(plan.inputs, loss_chunk_tokens=module.chunk_size)
    assert (
        estimate_memory(plan.shape, given).total
        == estimate_memory(plan.shape, dataclasses.replace(plan.inputs, loss_chunk_tokens=None)).total
    )


def test_the_objective_s_defaults_are_filled_in_for_the_plan_as_for_the_run(model_dir):
    """GRPO's own defaults (beta 0, loss_type dapo) where the flags do not give them, and the flags where they do:
    train (recipe.run_config.complete_run_config) and plan read the same values. Negative control: plan checking
    the flags without filling the defaults in (the run_config.validate call, no complete_run_config) planted, this
    test fails (plan refuses GRPO's run: "--loss_type sigmoid is not a GRPO loss")."""
    grpo = ["--objective", "grpo", "--reward_funcs", "format", "--use_peft_lora", "True"]
    for given, want in (([], (0.0, "dapo")), (["--beta", "0.04", "--loss_type", "grpo"], (0.04, "grpo"))):
        train, plan = _both(model_dir, [*grpo, *given])
        assert not isinstance(train, list) and not isinstance(plan, list), (train, plan)  # neither refused it
        assert (train.train.beta, train.train.loss_type) == (plan.run.train.beta, plan.run.train.loss_type) == want


def test_a_generation_batch_s_micro_batches_are_one_rule(model_dir, tmp_path):
    """--steps_per_generation, else --gradient_accumulation_steps: the rollouts (recipe.rl.rollout_settings) and the
    planner's generation phase read TrainArguments.generation_steps. Negative control: the planner's old
    `train.steps_per_generation or 1` planted, this test fails where --steps_per_generation is unset."""
    for given, want in (([], 4), (["--steps_per_generation", "2"], 2)):
        flags = ["--objective", "grpo", "--reward_funcs", "format", "--gradient_accumulation_steps", "4",
                 "--num_generations", "2", *given]  # fmt: skip
        cfg, plan = _both(model_dir, flags)
        cfg.model.model_name_or_path = str(tmp_path)  # no generation_config.json: the tokenizer's EOS alone
        info = SimpleNamespace(dims=SimpleNamespace(dp_size=1))
        rollouts = rollout_settings(cfg, info, SimpleNamespace(eos_token_id=1, pad_token_id=0))
        assert rollouts.steps_per_generation == plan.inputs.steps_per_generation == want


# ---------------------------------------------------------------- the model's facts, and FSDP's decisions beside them

# What model_spec adds to the facts for the run: the attention this device runs and the embeddings' rows.
DEVICE_AND_TOKENIZER = {"attn_impl", "cp_varlen", "n_tokens", "new_token_ids"}


def test_the_planner_reads_the_model_s_facts_off_its_spec(model_dir, monkeypatch):
    """planning.fit.plan_inputs fills every PlanInputs field that is a fact of the model (the compute dtype, the
    4-bit base, the adapter, checkpointing, packed rows, the context-parallel split, attention per document, the
    attention asked for, the loss's chunk) from the model's spec (models.builder.model_facts, which the run's own
    ModelSpec completes: recipe.settings.model_settings), never from the flags again: with a spec whose every such
    fact differs from the flags', the plan follows the spec, field by field. Negative control: plan_inputs reading
    the flag again planted (`spec = replace(model_facts(cfg), lora_r=cfg.model.lora_r)`, or the old
    `attn_implementation or ("flash_attention_2" if cfg.model.use_flash_attn else "sdpa")`), this test fails (the
    plan keeps the flag's 8, or sdpa)."""
    flags = ["--use_peft_lora", "True", "--bf16", "True", "--lora_r", "8", "--gradient_checkpointing", "True"]
    cfg = load_run_config(["--model_name_or_path", str(model_dir), "--dataset_name", "org/data", *flags], env={})
    facts = model_facts(cfg)
    run = settings.model_settings(cfg, _info(1), 256, [])  # the spec the run builds: the same facts, completed
    same = [f.name for f in dataclasses.fields(ModelSpec) if f.name not in DEVICE_AND_TOKENIZER]
    assert {k: getattr(run, k) for k in same} == {k: getattr(facts, k) for k in same}
    launch = launch_from_settings(cfg.fsdp, 1, 1)
    from_flags = plan_inputs(cfg, launch)
    planted = dataclasses.replace(
        facts, param_dtype=torch.float16, use_peft_lora=False, lora_r=48, lora_target_modules="q_proj,v_proj",
        lora_target_parameters="routers", lora_target_experts=True, lora_dropout=0.25, use_dora=True,
        modules_to_save="lm_head", gradient_checkpointing=False, packing=not facts.packing, context_parallel=2,
        torch_compile=True, attn_impl="flash_attention_2", loss_chunk_size=777,
        quantization_config=bnb_config(use_4bit=True, use_8bit=False, quant_type="nf4", compute_dtype_name="float16",
                                       nested=True, storage_dtype_name="float16"),
    )  # fmt: skip
    monkeypatch.setattr(fit, "model_facts", lambda c: planted)
    want = {
        "bf16": False, "fp16": True, "use_4bit": True, "nested_quant": True, "quant_storage_dtype": "float16",
        "use_peft_lora": False, "lora_r": 48, "lora_target_modules": "q_proj,v_proj",
        "lora_target_parameters": ("routers", "experts"), "lora_dropout": 0.25, "use_dora": True,
        "modules_to_save": ("lm_head",), "gradient_checkpointing": False, "packing": planted.packing,
        "context_parallel": 2, "per_document_attention": False, "attn_implementation": "flash_attention_2",
        "loss_chunk_tokens": 777, "fsdp": True,  # full fine-tuning in fp16 keeps FSDP on one process (fsdp_reason)
    }  # fmt: skip
    assert [k for k in want if getattr(from_flags, k) == want[k]] == []  # every fact differs from the flags'
    got = plan_inputs(cfg, launch)
    assert {k: getattr(got, k) for k in want} == want


def test_a_4bit_compute_dtype_that_is_not_one_is_refused_with_the_flags(model_dir):
    """The spec's 4-bit config parses --bnb_4bit_compute_dtype, and the start-up plan derives the spec on rank 0
    alone (plan_inputs): a name that is not a dtype is refused with the other flags' problems, by train and plan
    alike, before the spec is read. Negative control: the check left out of quantization_problems, this test fails
    (the spec raises instead, on whichever rank reads it first)."""
    flags = ["--use_4bit_quantization", "True", "--use_peft_lora", "True", "--bnb_4bit_compute_dtype", "junk"]
    train, plan = _both(model_dir, flags)
    line = "--bnb_4bit_compute_dtype 'junk' is not a dtype; use bfloat16, float16 or float32."
    assert isinstance(train, list) and line in train and line in plan, (train, plan)


def test_the_model_spec_holds_no_fsdp_decision(model_dir):
    """The model's spec holds the model's facts; how FSDP shards and places it (the strategy, offload, prefetch, the
    block classes, which ranks read the weights, the frozen base's placement, one process's setting) is
    ShardingSettings, copied from the run's FSDP settings once (parallel.parallelize.sharding_settings) with the
    start-up plan's placement (recipe.settings.sharding). Negative control: `offload: bool = False` put back in
    ModelSpec, this test fails."""
    spec_fields = {f.name for f in dataclasses.fields(ModelSpec)}
    assert spec_fields & {f.name for f in dataclasses.fields(ShardingSettings)} == set()
    assert spec_fields & {"offload", "frozen_base", "sharding_strategy", "cpu_ram_efficient_loading"} == set()
    env = {"ACCELERATE_USE_FSDP": "true", "FSDP_SHARDING_STRATEGY": "SHARD_GRAD_OP", "FSDP_FORWARD_PREFETCH": "true",
           "FSDP_CPU_RAM_EFFICIENT_LOADING": "true", "FSDP_TRANSFORMER_CLS_TO_WRAP": "LlamaDecoderLayer"}  # fmt: skip
    cfg = load_run_config(["--model_name_or_path", str(model_dir), "--dataset_name", "org/data"], env=env)
    got = settings.sharding(cfg, RunFit(frozen_base="replicated"))
    f = cfg.fsdp
    assert got == ShardingSettings(
        sharding_strategy="SHARD_GRAD_OP", reshard_after_forward=f.reshard_after_forward, offload=f.offload_params,
        cpu_ram_efficient_loading=True, forward_prefetch=True, backward_prefetch=f.backward_prefetch,
        transformer_cls_to_wrap="LlamaDecoderLayer", frozen_base="replicated", single_process=f.single_process,
    )  # fmt: skip


# ---------------------------------------------------------------- the planner, once per start-up


def test_the_planner_runs_once_per_start_up(tiny_assets, tmp_path, monkeypatch, capsys):
    """A tiny `shardtune train` (one process, in this one) starting as on a GPU of 80 GiB whose launch the planner
    sees as 2 ranks with --frozen_base auto: the frozen base's placement and the too-small check both need the plan,
    and the model's shape (planning.shape.ModelShape.from_config, the planner's costly part) is read once. Negative
    control: frozen_base_choice reading the shape again (the start-up before recipe.settings.start_plan: the
    warning's plan and the placement's each their own) planted, this test fails with 2 reads."""
    reads = []
    from_config = ModelShape.from_config.__func__

    def counted(cls, config):
        reads.append(type(config).__name__)
        return from_config(cls, config)

    monkeypatch.setattr(ModelShape, "from_config", classmethod(counted))
    monkeypatch.setattr(settings, "gpu_memory", lambda info: 80 * GiB)
    run_launch = settings.run_launch
    monkeypatch.setattr(
        settings, "run_launch", lambda cfg, info: dataclasses.replace(run_launch(cfg, info), world_size=2)
    )
    args = train_args(tiny_assets, tmp_path / "out", max_steps=1, max_seq_len=64, per_device_train_batch_size=2,
                      use_peft_lora=True, lora_r=4, frozen_base="auto", dataset_num_proc=1, splits="train",
                      dataset_cache_dir=tmp_path / "cache")  # fmt: skip
    from shardtune.cli import main as cli_main

    assert cli_main(args) == 0
    log = capsys.readouterr().err
    assert "Frozen base replicated on every rank (--frozen_base auto)" in log
    assert len(reads) == 1, reads
