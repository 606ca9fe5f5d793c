"""--enable_activation_offloading (training.trainer.saved_on_host: torch's save_on_cpu around the training forward).

On CPU save_on_cpu's copy is the tensor itself, so a run with it must be the run without it to the bit: the same
losses, gradient norms and trained tensors over two optimizer steps of the real loop (`trainer.train`, LoRA with
dropout, checkpointed blocks, packed rows), with non-reentrant and reentrant checkpointing. That alone would also
pass if the flag did nothing, so the pack hook is spied on: with checkpointing, what it receives is each block's
input (their data pointers, read by pre-hooks on the blocks: layers x batch x seq x hidden x dtype bytes) and the
head's (the final norm's and the loss's inputs), byte for byte the planner's `offloaded_tensor_bytes`, from the
model's shape alone. The control: the same step without the flag packs nothing, which the first assertion
would fail on. And the flag's checks: refused without checkpointing and where it is not verified; and
`shardtune train` with the flag, one process and 2 ranks under FSDP2, the same run as without it (its control: the
flag not passed on to the loop, which then never says that nothing moves).
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig

from shardtune.commands.demo import build_model
from shardtune.config.errors import ConfigError
from shardtune.models.builder import ModelSpec, build_training_module
from shardtune.planning.activations import offloaded_tensor_bytes
from shardtune.planning.shape import ModelShape
from shardtune.recipe.run_config import load_run_config
from shardtune.training import trainer
from shardtune.training.trainer import LoopSettings, LoopState, train, train_step
from tests.conftest import run_cli, train_args
from tests.distributed.test_parity import FSDP_ENV, LORA
from tests.parity import train_steps

VOCAB, HIDDEN, LAYERS, BATCH, SEQ, CHUNK = 96, 32, 3, 2, 24, 16


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    build_model(path, vocab_size=VOCAB, hidden_size=HIDDEN, num_layers=LAYERS, num_heads=4, num_kv_heads=2)
    return path


def _module(model_dir, reentrant: bool, dropout: float = 0.1):
    """The training module shardtune builds: LoRA on every linear, checkpointed blocks, packed rows (fp32)."""
    torch.manual_seed(0)
    spec = ModelSpec(model_name_or_path=str(model_dir), dtype=torch.float32, n_tokens=0, lora_dropout=dropout,
                     gradient_checkpointing=True, use_reentrant=reentrant, packing=True, loss_chunk_size=CHUNK)  # fmt: skip
    module, blocks = build_training_module(spec, on_meta=False, quantize_device=None)
    return module.train(), blocks


def _batch(seed: int) -> dict[str, torch.Tensor]:
    """Two packed documents per row (positions restart), every position a target."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (BATCH, SEQ), generator=g)
    positions = torch.cat([torch.arange(10), torch.arange(SEQ - 10)]).repeat(BATCH, 1)
    return {"input_ids": ids, "position_ids": positions, "labels": torch.randint(3, VOCAB, (BATCH, SEQ), generator=g)}


class _Split:
    """A training split that hands out fixed micro-batches (the loop's online-RL hook, trainer._micro_batches)."""

    def micro_batches(self, state, per_epoch):
        for i in range(state.step, 10**6):
            yield _batch(100 + i)


class _Logger:
    def __init__(self):
        self.grad_norms = []

    def log_train(self, step, record):
        self.grad_norms.append(record["grad_norm"])

    def progress(self, step, record):
        pass

    def log_event(self, step, kind, msg):
        pass


def _two_steps(model_dir, info, reentrant: bool, offload: bool):
    module, _ = _module(model_dir, reentrant)
    params = [p for p in module.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    settings = LoopSettings(batch_size=BATCH, eval_batch_size=BATCH, grad_accum=2, max_grad_norm=1.0, total_steps=2,
                            steps_per_epoch=2, seed=0, pad_id=0, logging_steps=1, logging_strategy="steps",
                            eval_strategy="no", eval_steps=1, save_strategy="no", save_steps=1, max_nonfinite_steps=3,
                            activation_offloading=offload)  # fmt: skip
    logger = _Logger()
    state = train(module, optimizer, scheduler, train_split=_Split(), eval_split=None, info=info, settings=settings,
                  state=LoopState(), logger=logger)  # fmt: skip
    trained = {n: p.detach().clone() for n, p in module.named_parameters() if p.requires_grad}
    return state.losses, logger.grad_norms, trained


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_offloading_trains_the_same_numbers_on_cpu(model_dir, info, reentrant, monkeypatch):
    warned = []
    monkeypatch.setattr(trainer, "warn0", warned.append)
    losses, norms, tensors = _two_steps(model_dir, info, reentrant, offload=False)
    assert not warned
    losses_off, norms_off, tensors_off = _two_steps(model_dir, info, reentrant, offload=True)
    assert len(warned) == 1 and "nothing is offloaded" in warned[0]  # once per run, on a machine without CUDA
    # save_on_cpu hands back the very tensor on CPU: the same operations on the same numbers, bit for bit.
    assert losses_off == losses and len(losses) == 2
    assert norms_off == norms and all(n > 0 for n in norms)
    assert tensors_off.keys() == tensors.keys() and len(tensors) == 2 * 7 * LAYERS
    for name, t in tensors.items():
        assert torch.equal(tensors_off[name], t), name


def _packed(model_dir, info, monkeypatch, reentrant: bool, offload: bool):
    """(bytes of every tensor the offloading pack hook receives in one training step, the blocks' inputs among
    them): the trainer's save_on_cpu replaced by one that records what it packs."""
    packed = []

    class Spy(torch.autograd.graph.save_on_cpu):
        def __init__(self, pin_memory: bool = False):
            super().__init__(pin_memory=pin_memory)
            pack = self.pack_hook

            def recording_pack(t):
                packed.append((t.data_ptr(), t.nbytes))
                return pack(t)

            self.pack_hook = recording_pack

    monkeypatch.setattr(trainer, "save_on_cpu", Spy)
    module, blocks = _module(model_dir, reentrant, dropout=0.0)
    inputs = []
    for block in blocks:
        block.register_forward_pre_hook(lambda m, args, kwargs: inputs.append(args[0].data_ptr()), with_kwargs=True)
    train_step(module, [_batch(1)], info, activation_offloading=offload)
    assert len(inputs) == LAYERS  # each block ran forward once here (recomputation runs its forward, not __call__)
    return [n for _, n in packed], sum(n for ptr, n in packed if ptr in inputs)


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_the_pack_hook_receives_the_checkpointed_block_inputs(model_dir, info, monkeypatch, reentrant):
    packed, block_inputs = _packed(model_dir, info, monkeypatch, reentrant, offload=True)
    a = 4  # fp32
    assert block_inputs == LAYERS * BATCH * SEQ * HIDDEN * a
    shape = ModelShape.from_config(AutoConfig.from_pretrained(model_dir))
    assert sorted(packed) == sorted(offloaded_tensor_bytes(shape, BATCH * SEQ, a, CHUNK))


def test_control_without_the_flag_nothing_is_packed(model_dir, info, monkeypatch):
    """The control of the test above: the step run without offloading (as a trainer that ignored the flag would
    run it) packs nothing, so that test's first assertion fails on it."""
    packed, block_inputs = _packed(model_dir, info, monkeypatch, reentrant=False, offload=False)
    assert packed == [] and block_inputs == 0 != LAYERS * BATCH * SEQ * HIDDEN * 4


BASE = ["--model_name_or_path", "org/model", "--dataset_name", "org/data", "--enable_activation_offloading", "True"]


def _problems(*flags) -> str:
    with pytest.raises(ConfigError) as e:
        load_run_config([*BASE, *flags], env={})
    return str(e.value)


def test_refused_without_checkpointing_and_where_not_verified():
    assert "--enable_activation_offloading True needs activation checkpointing" in _problems()
    checkpointed = ("--gradient_checkpointing", "True")
    for flags, why in (
        (("--checkpoint_every_n_layers", "2"), "with --checkpoint_every_n_layers 2: the blocks not recomputed"),
        (("--torch_compile", "True"), "with --torch_compile True: compiled blocks under saved-tensor hooks"),
    ):
        assert f"--enable_activation_offloading True {why}" in _problems(*checkpointed, *flags)
    cfg = load_run_config([*BASE, *checkpointed], env={})
    assert cfg.train.enable_activation_offloading and cfg.activation_checkpointing


@pytest.mark.parametrize(
    "nproc", [1, pytest.param(2, marks=pytest.mark.bench)], ids=["one process", "2 ranks FSDP"]
)  # 2 ranks under FSDP2: ~18 s, run with `-m bench`
def test_shardtune_train_with_offloading_is_the_same_run(tiny_assets, tmp_path, nproc):
    """`shardtune train --enable_activation_offloading True` on CPU (one process, and 2 ranks under FSDP2): the
    flag reaches the loop (it says that nothing moves here) and the run is the run without it, to the bit."""
    runs = {}
    for offload in (False, True):
        out = tmp_path / f"offload_{offload}"
        run = {"max_seq_len": 96, "seed": 7, "max_steps": 2, "gradient_accumulation_steps": 2, "learning_rate": 3e-3}
        args = train_args(tiny_assets, out, **run, gradient_checkpointing=True, per_device_train_batch_size=2,
                          save_strategy="no", enable_activation_offloading=offload)  # fmt: skip
        proc = run_cli([*args, *LORA], nproc=nproc, env=FSDP_ENV if nproc > 1 else None)
        runs[offload] = (train_steps(out), load_file(out / "adapter_model.safetensors"), proc.stdout + proc.stderr)
    (steps, adapter, _), (steps_off, adapter_off, log_off) = runs[False], runs[True]
    assert "--enable_activation_offloading: no CUDA device" in log_off
    assert sorted(steps) == sorted(steps_off) == [1, 2]
    for s in steps:
        assert (steps_off[s]["loss"], steps_off[s]["grad_norm"]) == (steps[s]["loss"], steps[s]["grad_norm"])
    assert adapter.keys() == adapter_off.keys() and adapter
    for name, t in adapter.items():
        assert torch.equal(adapter_off[name], t), name
