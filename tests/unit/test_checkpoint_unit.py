"""Checkpoints in one process (a 1-rank gloo group, FSDP2 on a 1-rank mesh): what is saved is what comes back,
bit for bit; folders are found, replaced and pruned as promised; the loop skips non-finite steps and stops; a
signal becomes a stop request; hub uploads follow --hub_strategy."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import ClassVar

import pytest
import torch
import torch.distributed as dist
from torch import nn

from shardtune.parallel import checkpoint
from shardtune.runtime import hooks, hub
from shardtune.training.optimizers import LocalShards, build_optimizer, optimizer_problems
from shardtune.training.trainer import (
    LoopSettings,
    LoopState,
    NonFiniteError,
    StopFlag,
    train,
)


@pytest.fixture(scope="module")
def group():
    """A 1-rank gloo process group and mesh for this module (torn down after it)."""
    from torch.distributed.device_mesh import init_device_mesh

    from shardtune.parallel.dims import ParallelDims
    from shardtune.parallel.mesh import DistInfo

    assert not dist.is_initialized()
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("shard",))
    yield DistInfo(0, 1, 0, 1, torch.device("cpu"), mesh, ParallelDims(dp_replicate=1, dp_shard=1))
    dist.destroy_process_group()


def _model(mesh, seed: int = 0) -> nn.Module:
    """A frozen base layer, a trainable one big enough for 8-bit optimizer states (≥ 4096 values), a trainable bias."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 320), nn.Linear(320, 4))
    model[0].requires_grad_(False)
    for block in model:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _step(model, optimizer, scheduler) -> None:
    loss = model(torch.randn(8, 16)).square().mean()
    loss.backward()
    optimizer.step()
    model.zero_grad(set_to_none=True)
    scheduler.step()


def _snapshot(model, optimizer) -> dict[str, torch.Tensor]:
    out = {f"w.{n}": p.detach().to_local().clone() for n, p in model.named_parameters()}
    for i, st in enumerate(optimizer.state.values()):
        for k, v in st.items():
            if torch.is_tensor(v):
                out[f"o.{i}.{k}"] = (v.to_local() if hasattr(v, "to_local") else v).clone()
    return out


def _build(group, optim: str):
    model = _model(group.mesh)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    opt = build_optimizer(named, optim=optim, lr=1e-2, weight_decay=0.1, betas=(0.9, 0.99), eps=1e-8)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    return model, opt, sched


@pytest.mark.parametrize(
    ("optim", "sdt"),
    [
        ("adamw_torch", "SHARDED_STATE_DICT"),
        ("adamw_torch", "FULL_STATE_DICT"),
        ("adamw_torch_fused", "SHARDED_STATE_DICT"),
        ("adamw_8bit", "SHARDED_STATE_DICT"),
    ],
)
def test_save_then_load_restores_everything_bit_for_bit(group, tmp_path, optim, sdt):
    model, opt, sched = _build(group, optim)
    for _ in range(3):
        _step(model, opt, sched)
    frozen = model[0].weight.detach().to_local().clone()
    path = checkpoint.save(
        tmp_path,
        model=model,
        optimizer=opt,
        scheduler=sched,
        loop_state={"step": 3, "epoch": 0, "batch_in_epoch": 3},
        config={"train": {"seed": 1}},
        state_dict_type=sdt,
    )
    saved, saved_lr = _snapshot(model, opt), sched.get_last_lr()
    after_save = torch.rand(4)
    assert path == tmp_path / "checkpoints" / "checkpoint-3"
    assert (path / ("full_state.pt" if sdt == "FULL_STATE_DICT" else "sharded/.metadata")).exists()
    assert (path / "optim_rank0.pt").exists() == (optim == "adamw_8bit")
    meta = checkpoint.read_meta(path)
    assert meta["loop"]["step"] == 3 and meta["world_size"] == 1 and meta["state_dict_type"] == sdt
    if optim == "adamw_8bit":
        quant = torch.load(path / "optim_rank0.pt", weights_only=True)["state"]["state"]
        dtypes = {v["__bnb_optimizer_quant_state__"]["state1"].dtype for v in quant.values()}
        assert dtypes == {torch.uint8, torch.float32}  # the 16×320 weight is 8-bit, the small ones 32-bit

    # Move on two steps (weights, optimizer, scheduler and RNG all change), then load the checkpoint back.
    for _ in range(2):
        _step(model, opt, sched)
    assert not torch.equal(_snapshot(model, opt)["w.1.weight"], saved["w.1.weight"])
    checkpoint.load(path, model=model, optimizer=opt, scheduler=sched)
    restored = _snapshot(model, opt)
    assert restored.keys() == saved.keys()
    for k in saved:
        assert torch.equal(restored[k], saved[k]), k
    assert sched.get_last_lr() == saved_lr and sched.last_epoch == 3
    assert torch.equal(torch.rand(4), after_save)
    assert torch.equal(model[0].weight.detach().to_local(), frozen)  # the frozen base is neither saved nor touched


def test_local_shards_step_the_fsdp_parameters(group):
    """bitsandbytes steps aliases of the local shards: the FSDP2 parameters themselves move."""
    model, opt, sched = _build(group, "adamw_8bit")
    assert isinstance(opt.local_shards, LocalShards)
    before = model[1].weight.detach().to_local().clone()
    _step(model, opt, sched)
    after = model[1].weight.detach().to_local()
    assert (after - before).abs().max() > 1e-4
    assert all(x.grad is None for x in opt.local_shards.proxies)
    assert model[1].weight.grad is None


def test_sharded_checkpoint_holds_only_trainable_weights(group, tmp_path):
    from torch.distributed.checkpoint import FileSystemReader

    model, opt, sched = _build(group, "adamw_torch")
    _step(model, opt, sched)
    path = checkpoint.save(
        tmp_path, model=model, optimizer=opt, scheduler=sched, loop_state={"step": 1}, config={}, save_total_limit=1
    )
    keys = set(FileSystemReader(str(path / "sharded")).read_metadata().state_dict_metadata)
    assert {"model.1.weight", "model.1.bias", "model.2.weight"} <= keys
    assert not any(k.startswith("model.0.") for k in keys)
    assert any(k.startswith("optim.state.1.weight.exp_avg") for k in keys)


def test_load_refuses_a_checkpoint_of_another_model(group, tmp_path):
    model, opt, sched = _build(group, "adamw_torch")
    _step(model, opt, sched)
    path = checkpoint.save(tmp_path, model=model, optimizer=opt, scheduler=sched, loop_state={"step": 1}, config={})
    other = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 32), nn.Linear(32, 4))
    from torch.distributed.fsdp import fully_shard

    fully_shard(other, mesh=group.mesh)
    o_opt = build_optimizer(
        list(other.named_parameters()), optim="adamw_torch", lr=1e-2, weight_decay=0.0, betas=(0.9, 0.99), eps=1e-8
    )
    with pytest.raises(ValueError, match="do not fit this model"):
        checkpoint.load(
            path, model=other, optimizer=o_opt, scheduler=torch.optim.lr_scheduler.LambdaLR(o_opt, lambda s: 1)
        )


def test_save_replaces_a_same_step_checkpoint_clears_partial_saves_and_prunes(group, tmp_path):
    model, opt, sched = _build(group, "adamw_torch")
    _step(model, opt, sched)
    root = tmp_path / "checkpoints"
    kw = {"model": model, "optimizer": opt, "scheduler": sched, "config": {}, "save_total_limit": 2}
    checkpoint.save(tmp_path, loop_state={"step": 2}, **kw)
    (root / "checkpoint-3.tmp").mkdir()  # what a run killed mid-save leaves
    (root / "checkpoint-2" / "stale.txt").write_text("from an earlier run")
    checkpoint.save(tmp_path, loop_state={"step": 2}, **kw)
    assert not (root / "checkpoint-2" / "stale.txt").exists()
    assert not (root / "checkpoint-3.tmp").exists()
    for step in (4, 10):
        checkpoint.save(tmp_path, loop_state={"step": step}, **kw)
    assert [p.name for p in checkpoint.list_checkpoints(tmp_path)] == ["checkpoint-4", "checkpoint-10"]
    assert sorted(p.name for p in root.iterdir()) == ["checkpoint-10", "checkpoint-4"]


def _save_at(tmp_path, step: int, model, opt, sched):
    kw = {"model": model, "optimizer": opt, "scheduler": sched, "config": {}}
    return checkpoint.save(tmp_path, loop_state={"step": step}, **kw)


@pytest.mark.parametrize("inner", ["unexpected_pos", "file_write_failed", "enospc"])
def test_a_full_disk_in_dcp_is_a_disk_full_error_and_leaves_the_previous_checkpoint(
    group, tmp_path, monkeypatch, inner
):
    """dcp.save's real forms on a full disk (a CheckpointException, which is no Exception, around torch's zip
    writer's RuntimeError or an OSError(ENOSPC)): a DiskFullError naming checkpoint-4 and the bytes needed, the
    `.tmp` folder removed, checkpoint-2 whole."""
    from tests.unit.test_atomic import FILE_WRITE_FAILED, UNEXPECTED_POS, dcp_error

    model, opt, sched = _build(group, "adamw_torch")
    _step(model, opt, sched)
    _save_at(tmp_path, 2, model, opt, sched)
    error = {
        "unexpected_pos": RuntimeError(UNEXPECTED_POS),
        "file_write_failed": RuntimeError(FILE_WRITE_FAILED),
        "enospc": OSError(28, "No space left on device"),
    }[inner]

    def full_disk(state, checkpoint_id):
        Path(checkpoint_id).mkdir()
        (Path(checkpoint_id) / "__0_0.distcp").write_bytes(b"half a shard")
        raise dcp_error(rank0=error)

    monkeypatch.setattr(checkpoint.dcp, "save", full_disk)
    monkeypatch.setattr(checkpoint.atomic, "_free_bytes", lambda folder: 4096)  # the disk is full now
    with pytest.raises(checkpoint.atomic.DiskFullError) as e:
        _save_at(tmp_path, 4, model, opt, sched)
    assert str(e.value).startswith(
        f"no space left on device while writing a checkpoint to {tmp_path / 'checkpoints' / 'checkpoint-4'} (about "
    )
    assert e.value.needed > 20_000  # the 16×320 and 320×4 weights with two Adam moments each
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["checkpoint-2"]
    assert checkpoint.damage(tmp_path / "checkpoints" / "checkpoint-2") is None


def test_a_real_full_disk_during_a_sharded_save(group, tmp_path):
    """The same on a real 64 KiB tmpfs (skipped where mounting is not permitted), where torch raises what it raises."""
    import subprocess

    disk = tmp_path / "disk"
    disk.mkdir()
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(disk)], capture_output=True, check=False
    )
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({proc.stderr.decode().strip()})")
    try:
        model, opt, sched = _build(group, "adamw_torch")
        _step(model, opt, sched)
        with pytest.raises(checkpoint.atomic.DiskFullError, match=r"checkpoint-4 \(about [\d.]+ MiB needed, "):
            _save_at(disk, 4, model, opt, sched)
        assert [p.name for p in (disk / "checkpoints").iterdir()] == []
    finally:
        subprocess.run(["umount", "--lazy", str(disk)], check=True)


BEFORE = {"lr": 1e-2, "weight_decay": 0.1, "kind": "cosine", "warmup": 2, "total": 10}
CHANGES = {  # one flag of a resumed run each, as it reaches the optimizer and the schedule; all of them at once
    "learning_rate": {"lr": 3e-3},
    "lr_scheduler_type": {"kind": "linear"},
    "warmup_steps": {"warmup": 6},  # also --warmup_ratio, which becomes a step count the same way
    "max_steps": {"total": 30},  # also --num_train_epochs, and a batch size that changes the steps per epoch
    "weight_decay": {"weight_decay": 0.0},
    "all": {"lr": 3e-3, "kind": "constant_with_warmup", "warmup": 6, "total": 30, "weight_decay": 0.0},
}


def _optimizer_and_schedule(group, settings: dict):
    from transformers import get_scheduler

    model = _model(group.mesh)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    opt = build_optimizer(
        named,
        optim="adamw_torch",
        lr=settings["lr"],
        weight_decay=settings["weight_decay"],
        betas=(0.9, 0.99),
        eps=1e-8,
    )
    kw = {"num_warmup_steps": settings["warmup"], "num_training_steps": settings["total"]}
    return model, opt, get_scheduler(settings["kind"], opt, **kw)


@pytest.mark.parametrize("flag", CHANGES)
def test_a_resumed_run_trains_with_its_new_settings_from_the_resumed_step(group, tmp_path, flag):
    """Resumed at step 4 with a changed flag, the rate of every later step is what a fresh run's schedule with the
    new flags gives at that step, and the weight decay is the new one; the Adam moments are the checkpoint's.
    Control: loading the checkpoint's scheduler and parameter groups over the new settings (the old behaviour)
    gives other rates."""
    from shardtune.recipe import state

    model, opt, sched = _optimizer_and_schedule(group, BEFORE)
    for _ in range(4):
        _step(model, opt, sched)
    path = _save_at(tmp_path, 4, model, opt, sched)
    moments = _snapshot(model, opt)
    after = {**BEFORE, **CHANGES[flag]}

    def resumed(restore: bool):
        model, opt, sched = _optimizer_and_schedule(group, after)
        fresh = state.run_settings(opt, sched)
        checkpoint.load(path, model=model, optimizer=opt, scheduler=sched)
        if restore:
            state.restore_run_settings(opt, sched, fresh)
        return model, opt, sched

    model, opt, sched = resumed(restore=True)
    assert all(torch.equal(v, moments[k]) for k, v in _snapshot(model, opt).items() if k.startswith("o."))
    _, ref_opt, ref = _optimizer_and_schedule(group, after)  # a fresh run with the new flags, its schedule alone
    for _ in range(4):
        ref_opt.step()  # no gradients: the weights stay; only the schedule moves
        ref.step()
    rates, expected = [], []
    for _ in range(5):  # the rate each later step trains with, then the one it logs (metrics.jsonl: get_last_lr)
        rates.append([g["lr"] for g in opt.param_groups] + sched.get_last_lr())
        expected.append([g["lr"] for g in ref_opt.param_groups] + ref.get_last_lr())
        _step(model, opt, sched)
        ref_opt.step()
        ref.step()
    assert rates == expected
    assert sorted({g["weight_decay"] for g in opt.param_groups}) == sorted({0.0, after["weight_decay"]})
    _, old_opt, old = resumed(restore=False)  # the old behaviour: the checkpoint's rates and decay win
    old_values = [g["lr"] for g in old_opt.param_groups] + old.get_last_lr()
    old_decay = {g["weight_decay"] for g in old_opt.param_groups}
    assert old_values != expected[0] or old_decay != {0.0, after["weight_decay"]}


def test_resume_refusals_name_the_flag_both_values_and_the_fix(tmp_path):
    """recipe.state.resume_refusal: another --seed, or a --max_steps before the checkpoint's step; nothing else."""
    from shardtune.recipe.state import resume_refusal

    ck = tmp_path / "checkpoint-4"
    ck.mkdir()
    (ck / "meta.json").write_text(json.dumps({"loop": {"step": 4}}))
    saved = {"train": {"seed": 42, "max_steps": 10, "learning_rate": 1e-3}}

    def refusal(**train):
        return resume_refusal(ck, saved, {"train": {**saved["train"], **train}}, "latest")

    assert refusal(seed=7) == (
        f"--seed 7 differs from the checkpoint's 42 ({ck}): the packing of the rows and their order in every epoch "
        "depend on it; resume with --seed 42, or start afresh with another --output_dir or --overwrite_output_dir."
    )
    assert refusal(max_steps=3).startswith(f"--max_steps 3 is below the step of {ck} (4): ")
    assert refusal() is None and refusal(max_steps=4) is None and refusal(max_steps=0) is None
    assert refusal(learning_rate=5e-4, max_steps=30) is None  # trained with, from the resumed step


def _minimal_checkpoint(folder) -> None:
    """The files a 1-rank FULL_STATE_DICT checkpoint must have, for checkpoint.damage to find it whole."""
    meta = {"world_size": 1, "state_dict_type": "FULL_STATE_DICT", "loop": {"step": 1}, "optimizer": {}}
    (folder / "meta.json").write_text(json.dumps(meta))
    for name in ("scheduler.pt", "rng_rank0.pt", "full_state.pt"):
        torch.save({}, folder / name)


def test_list_and_resolve(tmp_path):
    root = tmp_path / "checkpoints"
    for name, complete in [("checkpoint-2", True), ("checkpoint-10", True), ("checkpoint-11", False)]:
        (root / name).mkdir(parents=True)
        if complete:
            _minimal_checkpoint(root / name)
    (root / "checkpoint-12.tmp").mkdir()
    _minimal_checkpoint(root / "checkpoint-12.tmp")
    assert [p.name for p in checkpoint.list_checkpoints(tmp_path)] == ["checkpoint-2", "checkpoint-10"]
    assert checkpoint.resolve("latest", tmp_path) == root / "checkpoint-10"
    assert checkpoint.resolve(str(root / "checkpoint-2"), tmp_path) == root / "checkpoint-2"
    with pytest.raises(ValueError, match="no meta.json"):
        checkpoint.resolve(str(root / "checkpoint-11"), tmp_path)
    with pytest.raises(ValueError, match="no complete checkpoint in"):
        checkpoint.resolve("latest", tmp_path / "elsewhere")
    # A newest checkpoint with a truncated file is skipped by `latest` and refused by path, naming the file.
    full = root / "checkpoint-10" / "full_state.pt"
    full.write_bytes(full.read_bytes()[:-30])
    assert checkpoint.resolve("latest", tmp_path) == root / "checkpoint-2"
    with pytest.raises(ValueError, match=r"checkpoint-10/full_state\.pt is missing or truncated"):
        checkpoint.resolve(str(root / "checkpoint-10"), tmp_path)


def test_check_resumable():
    meta = {"world_size": 2, "optimizer": {"class": "AdamW8bit", "per_rank": True}}
    checkpoint.check_resumable("ck", meta, per_rank_optimizer=True, optimizer_name="--optim adamw_8bit", world=2)
    with pytest.raises(ValueError, match=r"cannot be resharded from 2 to 1 rank\(s\)\. Resume on 2 rank\(s\)"):
        checkpoint.check_resumable("ck", meta, per_rank_optimizer=True, optimizer_name="--optim adamw_8bit", world=1)
    with pytest.raises(ValueError, match="AdamW8bit optimizer; this run uses --optim adamw_torch"):
        checkpoint.check_resumable("ck", meta, per_rank_optimizer=False, optimizer_name="--optim adamw_torch", world=2)
    torch_meta = {"world_size": 2, "optimizer": {"class": "AdamW", "per_rank": False}}
    checkpoint.check_resumable("ck", torch_meta, per_rank_optimizer=False, optimizer_name="x", world=1)


def test_changed_settings():
    saved = {"train": {"learning_rate": 1e-3, "output_dir": "a", "seed": 1}, "model": {"lora_r": 8}}
    now = {"train": {"learning_rate": 2e-3, "output_dir": "b", "seed": 1}, "model": {"lora_r": 8}}
    assert checkpoint.changed_settings(saved, now) == ["learning_rate: 0.001 → 0.002"]


def test_resume_position_keeps_the_sample_across_world_sizes():
    meta = {"world_size": 2, "loop": {"step": 3, "epoch": 1, "batch_in_epoch": 6, "samples_in_epoch": 24,
                                      "global_batch": 8, "tokens": 5, "nonfinite_steps": 0, "losses": [1.0]}}  # fmt: skip
    # Same global batch on 1 rank (4 rows per micro-batch): micro-batch 6, no warning.
    loop, notes = checkpoint.resume_position(meta, per_device=4, world=1, grad_accum=2)
    assert loop == {"step": 3, "epoch": 1, "batch_in_epoch": 6, "tokens": 5, "nonfinite_steps": 0, "losses": [1.0]}
    assert notes == []
    # 3 ranks × 2 rows: sample 24 starts micro-batch 4; the global batch changes from 8 to 12 rows.
    loop, notes = checkpoint.resume_position(meta, per_device=2, world=3, grad_accum=2)
    assert loop["batch_in_epoch"] == 4
    (note,) = notes
    assert note == (
        "The checkpoint was trained with a global batch of 8 rows (2 rank(s)); this run uses 12 (2 per device × "
        "3 rank(s) × 2 accumulation steps): the loss curve and the learning-rate schedule per sample change from "
        "here on."
    )
    # 5 rows per micro-batch: sample 24 is inside micro-batch 4, which starts at sample 20.
    loop, notes = checkpoint.resume_position(meta, per_device=5, world=1, grad_accum=1)
    assert loop["batch_in_epoch"] == 4 and notes[-1].endswith("continuing at sample 20.")


def test_optimizer_problems():
    assert optimizer_problems("adamw_torch", torch.device("cpu")) == []
    assert optimizer_problems("adamw_torch_fused", torch.device("cpu")) == []
    assert optimizer_problems("adamw_8bit", torch.device("cpu")) == []
    (msg,) = optimizer_problems("adamw_torch_fused", torch.device("meta"))
    assert "no fused AdamW for meta" in msg and "--optim adamw_torch" in msg


def test_optimizer_problems_when_bitsandbytes_lacks_the_device(monkeypatch):
    import bitsandbytes as bnb

    def fail(self, closure=None):
        raise NotImplementedError("no 8-bit kernel for this device")

    monkeypatch.setattr(bnb.optim.AdamW8bit, "step", fail)
    (msg,) = optimizer_problems("paged_adamw_8bit", torch.device("cpu"))
    assert msg == (
        "--optim paged_adamw_8bit: bitsandbytes cannot run its 8-bit optimizer on cpu "
        "(no 8-bit kernel for this device); use --optim adamw_torch."
    )


def test_fault_hook(monkeypatch):
    """SHARDTUNE_FAULT fires at its point, step and rank only, and a malformed value names the variable."""
    got = []
    old = signal.signal(signal.SIGUSR1, lambda s, f: got.append(s))
    try:
        monkeypatch.setenv(hooks.FAULT_ENV, "save:4:0:USR1")
        hooks.at("save", step=3, rank=0)
        hooks.at("save", step=4, rank=1)
        hooks.at("step", step=4, rank=0)
        assert got == []
        hooks.at("save", step=4, rank=0)
        assert got == [signal.SIGUSR1]
        # The loop reaches the `step` point through its callbacks, without knowing about faults.
        monkeypatch.setenv(hooks.FAULT_ENV, "step:2:0:USR1")
        (callback,) = hooks.step_callbacks()
        callback(LoopState(step=1), 0)
        callback(LoopState(step=2), 1)
        assert got == [signal.SIGUSR1]
        callback(LoopState(step=2), 0)
        assert got == [signal.SIGUSR1, signal.SIGUSR1]
        monkeypatch.setenv(hooks.FAULT_ENV, "mid:4")
        with pytest.raises(ValueError, match=r"SHARDTUNE_FAULT='mid:4': expected <step\|save\|export\|tokenize\|load>"):
            hooks.at("save", step=4, rank=0)
    finally:
        signal.signal(signal.SIGUSR1, old)
        monkeypatch.delenv(hooks.FAULT_ENV)
        hooks.clear()


def test_load_log_hook(monkeypatch, tmp_path):
    monkeypatch.setenv(hooks.LOAD_LOG_ENV, str(tmp_path / "log"))
    try:
        hooks.at("checkpoint_read", rank=3)
        assert [p.name for p in (tmp_path / "log").iterdir()] == ["loaded-rank3"]
    finally:
        monkeypatch.delenv(hooks.LOAD_LOG_ENV)
        hooks.clear()


def test_stop_flag_turns_a_signal_into_a_stop_request(group):
    old = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        stop = StopFlag(torch.device("cpu"))
        assert stop() is False
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)  # torchrun's forwarded copy of the same signal: not fatal
        assert stop() is True and stop.signal == "SIGTERM"
    finally:
        for s, h in old.items():
            signal.signal(s, h)


class _Toy(nn.Module):
    """A model with the training module's interface whose loss is NaN on chosen calls."""

    def __init__(self, nan_calls: set[int]):
        super().__init__()
        self.w = nn.Parameter(torch.ones(4))
        self.nan_calls, self.calls = nan_calls, 0

    def forward(self, input_ids, position_ids, labels, head=None):  # computes the SFT head itself
        self.calls += 1
        loss = (self.w * input_ids[:, :4].float()).sum()
        n = (labels != -100).sum()
        return (loss * float("nan") if self.calls in self.nan_calls else loss), n


class _Logger:
    """Records each logged step with the weights of the model at that point."""

    def __init__(self, model):
        self.model, self.records = model, []

    def log_train(self, step, record):
        self.records.append((step, record, self.model.w.detach().clone()))

    def log_eval(self, step, record):
        pass

    def progress(self, step, postfix):
        pass


def _toy_run(
    group,
    *,
    nan_calls: set[int],
    total: int,
    max_nonfinite: int,
    saved: list,
    logger_box: list,
    save_strategy: str = "steps",
    steps_per_epoch: int = 8,
    stop=lambda: False,
):
    from shardtune.data import PreparedSplit

    rows = [[1 + i % 5] * 6 for i in range(16)]
    split = PreparedSplit(rows, rows, [list(range(6))] * 16, stats={})
    model = _Toy(nan_calls)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    s = LoopSettings(
        batch_size=2, eval_batch_size=2, grad_accum=1, max_grad_norm=0.0, total_steps=total,
        steps_per_epoch=steps_per_epoch, seed=0, pad_id=0, logging_steps=1, logging_strategy="steps",
        eval_strategy="no", eval_steps=1, save_strategy=save_strategy, save_steps=1, max_nonfinite_steps=max_nonfinite,
    )  # fmt: skip
    logger = _Logger(model)
    logger_box.append(logger)
    return train(
        model,
        opt,
        torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0),
        train_split=split,
        eval_split=None,
        info=group,
        settings=s,
        state=LoopState(),
        logger=logger,
        save_fn=lambda st: saved.append((st.step, st.epoch, st.batch_in_epoch)),
        stop_requested=stop,
    )


def test_nonfinite_steps_are_skipped_counted_and_not_saved(group):
    saved, box = [], []
    state = _toy_run(group, nan_calls={2, 3}, total=5, max_nonfinite=3, saved=saved, logger_box=box)
    assert state.step == 5 and state.nonfinite_steps == 2
    assert [step for step, _, _ in saved] == [1, 4, 5]  # the saves due at the skipped steps 2 and 3 are not made
    records = box[0].records
    assert [r["nonfinite_steps"] for _, r, _ in records] == [0, 1, 2, 2, 2]
    w = [w for _, _, w in records]
    assert torch.equal(w[1], w[0]) and torch.equal(w[2], w[0])  # skipped: no update
    assert not torch.equal(w[3], w[2])  # step 4 is finite again and updates


def test_too_many_nonfinite_steps_stop_the_run_without_saving(group):
    saved, box = [], []
    with pytest.raises(
        NonFiniteError, match=r"2 steps had a non-finite loss .*--max_nonfinite_steps 2\); stopped at step 4"
    ):
        _toy_run(group, nan_calls={3, 4}, total=6, max_nonfinite=2, saved=saved, logger_box=box)
    assert [step for step, _, _ in saved] == [1, 2]
    assert [step for step, _, _ in box[0].records] == [1, 2, 3]


def test_epoch_saves_and_a_stop_request_saves_then_ends_the_loop(group):
    saved, box, asked = [], [], []

    def stop():
        asked.append(1)
        return len(asked) == 3

    state = _toy_run(
        group, nan_calls=set(), total=6, max_nonfinite=1, saved=saved, logger_box=box, save_strategy="epoch",
        steps_per_epoch=2, stop=stop,
    )  # fmt: skip
    # Epochs end after steps 2 (saved: epoch 1 begins at batch 0); the stop request after step 3 saves and ends.
    assert saved == [(2, 1, 0), (3, 1, 1)]
    assert state.step == 3 and len(asked) == 3  # asked once per step, so that ranks agree


class _FakeApi:
    calls: ClassVar[list] = []

    def __init__(self, token=None):
        self.token = token

    def upload_folder(self, **kw):
        _FakeApi.calls.append(("upload_folder", kw))
        return "https://hub/commit/1"

    def create_commit(self, **kw):
        _FakeApi.calls.append(("create_commit", kw))
        return "https://hub/commit/2"


@pytest.mark.parametrize("strategy", ["end", "every_save", "checkpoint", "all_checkpoints"])
def test_push_checkpoint_follows_hub_strategy(tmp_path, monkeypatch, strategy):
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "HfApi", _FakeApi)
    _FakeApi.calls = []
    out = tmp_path / "run"
    ck = out / "checkpoints" / "checkpoint-6"
    ck.mkdir(parents=True)
    (ck / "meta.json").write_text("{}")
    for name in ("adapter_model.safetensors", "adapter_config.json", "metrics.jsonl", ".hidden"):
        (out / name).write_text("x")
    urls = hub.push_checkpoint("me/run", ck, out, strategy=strategy, hub_token="t", step=6)
    if strategy == "end":
        assert urls == [] and _FakeApi.calls == []
        return
    commit = [kw for name, kw in _FakeApi.calls if name == "create_commit"]
    assert len(commit) == 1 and urls[-1] == "https://hub/commit/2"
    ops = {op.path_in_repo: op for op in commit[0]["operations"]}
    assert sorted(ops) == ["adapter_config.json", "adapter_model.safetensors", "last_checkpoint.json", "metrics.jsonl"]
    pointer = json.loads(ops["last_checkpoint.json"].path_or_fileobj)
    uploads = [kw for name, kw in _FakeApi.calls if name == "upload_folder"]
    if strategy == "every_save":
        assert uploads == []
        assert pointer == {"step": 6, "checkpoint": "checkpoints/checkpoint-6", "path_in_repo": None}
    else:
        (up,) = uploads
        assert Path(up["folder_path"]) == ck
        want = "last-checkpoint" if strategy == "checkpoint" else "checkpoint-6"
        assert up["path_in_repo"] == want and pointer["path_in_repo"] == want
        assert up["delete_patterns"] == (["*"] if strategy == "checkpoint" else None)
