"""Context parallelism (shardtune.parallel.split) from the command line: cp=2 on 2 ranks and dp=2 × cp=2 on 4
ranks train as 1 process with the same global batch, on packed rows whose documents cross the chunk edges: per-step
losses, grad_norm and every trained tensor (tests/families.py's matrix bounds), for LoRA, QLoRA (with gradient
checkpointing), full fine-tuning, DoRA with assistant-only targets, a mixture of experts (Qwen3-MoE) with 4-bit
experts carrying expert LoRA, and LoRA over 2 micro-batches per step. A planted cross-document leak and a planted dropped edge target fail it."""

from __future__ import annotations

import json
import shutil
import socket
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from shardtune.parallel import split
from tests.conftest import train_records
from tests.families import (
    LR,
    STEPS,
    assert_runs_match,
    build_assets,
    eval_rows_file,
    matrix_tolerance,
    run_jobs,
    train_argv,
)
from tests.mutation import Edit, plant

CP = ["--context_parallel_size", "2"]
GC = ["--gradient_checkpointing", "True"]
SAVE = ["--save_strategy", "steps", "--save_steps", "2"]
ACCUM = ["--gradient_accumulation_steps", "2"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _argv(root, assets, out, method, batch, extra=(), family="llama"):
    return [*train_argv(root / family, assets["data"], out, method, batch=batch), *extra]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("cp")
    assets = build_assets(root, families=["llama", "qwen3-moe"])
    # name: (method, flags, family); "dora" adds DoRA's weight norms and assistant-only targets (labels cut mid-row);
    # "moe": 4-bit experts carrying expert and router LoRA
    cases = {"lora": ("lora", (), "llama"), "qlora": ("qlora", GC, "llama"), "full": ("full", (), "llama"),
             "dora": ("lora", ("--use_dora", "True", "--assistant_only_loss", "True"), "llama"),
             "moe": ("qlora-experts", (), "qwen3-moe")}  # fmt: skip
    one = [{"name": n, "argv": _argv(root, assets, root / "one" / n, m, 4, f, fam)}
           for n, (m, f, fam) in cases.items()]  # fmt: skip
    two = [{"name": n, "argv": _argv(root, assets, root / "cp2" / n, m, 4, (*f, *CP), fam)}
           for n, (m, f, fam) in cases.items()]  # fmt: skip
    # Checkpointed twins of the LoRA runs, to resume at step 2 with the other cp size.
    one.append({"name": "saved", "argv": _argv(root, assets, root / "one" / "saved", "lora", 4, SAVE)})
    two.append({"name": "saved", "argv": _argv(root, assets, root / "cp2" / "saved", "lora", 4, (*SAVE, *CP))})
    # Two micro-batches per step: each micro-batch's forward and its backward's recomputation read its own split.
    two.append({"name": "accum", "argv": _argv(root, assets, root / "cp2" / "accum", "lora", 2, (*CP, *ACCUM, *GC))})
    four = [{"name": "lora", "argv": _argv(root, assets, root / "dp2cp2" / "lora", "lora", 2, CP)}]
    codes = {**run_jobs(one, root, nproc=1), **{f"cp2/{k}": v for k, v in run_jobs(two, root, nproc=2).items()}}
    codes["dp2cp2/lora"] = run_jobs(four, root, nproc=4)["lora"]
    return {"root": root, "assets": assets, "codes": codes}


def _moved(tensors: dict, base: dict | None = None) -> float:
    if base is None:
        return max(float(v.abs().max()) for k, v in tensors.items() if "lora_B" in k)
    same = [k for k, v in base.items() if k in tensors and tensors[k].shape == v.shape]  # (resized tables differ)
    return max(float((tensors[k] - base[k]).abs().max()) for k in same)


@pytest.mark.parametrize(
    ("run", "method"),
    [("cp2", "lora"), ("cp2", "qlora"), ("cp2", "full"), ("cp2", "dora"), ("cp2", "moe"), ("cp2", "accum"),
     ("dp2cp2", "lora")],
)  # fmt: skip
def test_context_parallel_ranks_train_as_one_process(runs, run, method):
    root, codes = runs["root"], runs["codes"]
    baseline = "lora" if method == "accum" else method  # accum: the LoRA run's global batch in 2 micro-batches
    assert codes[baseline] == 0 and codes[f"{run}/{method}"] == 0, codes
    tol = matrix_tolerance("qwen3-moe" if method == "moe" else "llama")
    trained = assert_runs_match(root / "one" / baseline, root / run / method, tol, min_updates=STEPS)
    if method == "full":
        from tests.families import saved_tensors

        assert _moved(trained, saved_tensors(root / "llama")) > LR
    else:
        assert _moved(trained) > LR
    log = (root / "log-2.txt").read_text() if run == "cp2" else (root / "log-4.txt").read_text()
    assert "Context parallelism: each row split over 2 ranks (4 chunks, zigzag)" in log
    summary = json.loads((root / run / method / "train_summary.json").read_text())
    one = json.loads((root / "one" / baseline / "train_summary.json").read_text())
    assert summary["final_eval_loss"] == pytest.approx(one["final_eval_loss"], rel=1e-5)  # evaluation under CP too


def _resume(runs, tmp_path, source, name: str, nproc: int, extra=()) -> dict:
    root, assets = runs["root"], runs["assets"]
    out = tmp_path / name
    (out / "checkpoints").mkdir(parents=True)
    shutil.copytree(source / "checkpoints" / "checkpoint-2", out / "checkpoints" / "checkpoint-2")
    argv = _argv(root, assets, out, "lora", 4, (*SAVE, "--resume_from_checkpoint", "latest", *extra))
    assert run_jobs([{"name": name, "argv": argv}], tmp_path, nproc=nproc)[name] == 0
    return out


def test_a_cp2_checkpoint_resumes_with_cp1_and_the_reverse(runs, tmp_path):
    """Step 3 of a cp=2 run resumed at step 2 on 1 process, and of a 1-process run resumed on 2 ranks with cp=2,
    both continue the uninterrupted run: the losses, grad_norm and the adapter (the optimizer state and the data
    position are per data-parallel rank, which cp does not change)."""
    root, codes = runs["root"], runs["codes"]
    assert codes["saved"] == 0 and codes["cp2/saved"] == 0
    to_one = _resume(runs, tmp_path, root / "cp2" / "saved", "to-one", 1)
    to_cp2 = _resume(runs, tmp_path, root / "one" / "saved", "to-cp2", 2, CP)
    for out in (to_one, to_cp2):
        assert [r["step"] for r in train_records(out)] == [3]
        assert_runs_match(root / "one" / "lora", out, matrix_tolerance("llama"), min_updates=0, resumed=True)


def test_the_documents_cross_the_chunk_edges(runs):
    """The runs' rows (their data's eval split, packed as training packs it): several documents per row, and
    documents that span a chunk edge of the zigzag split (rank 0 holds chunks 0 and 3 of 4, rank 1 chunks 1, 2)."""
    root = runs["root"]
    rows = json.loads(eval_rows_file(runs["assets"]["data"], root / "one" / "lora", root, "cp").read_text())
    crossing = 0
    for r in rows:
        pos = torch.tensor([r["position_ids"]])
        docs = split.document_ids(pos)[0]
        length = split.padded_length(len(r["position_ids"]), 2)
        edges = [length // 4 * i for i in (1, 2, 3)]
        crossing += sum(int(e < len(docs) and docs[e] == docs[e - 1]) for e in edges)
        assert int(docs.max()) > 1  # several documents per row
    assert crossing > 0


# The part of a document that began in an earlier chunk attends the row from its start, earlier documents
# included (the leak packed CP had in TRL).
LEAK = Edit(
    "parallel/split.py",
    "parts.append(Part(offset, offset + n, key_start=starts[d], key_end=s + n))",
    "parts.append(Part(offset, offset + n, key_start=0, key_end=s + n))",
)
# Labels shifted after the split: every rank's last position of a chunk loses its target.
EDGE = Edit(
    "parallel/split.py",
    "    local = {k: (v[:, mine] if k in POSITION_KEYS else v) for k, v in batch.items()}\n",
    "    local = {k: (v[:, mine] if k in POSITION_KEYS else v) for k, v in batch.items()}\n"
    "    local['labels'] = local['labels'].clone(); local['labels'][:, len(mine) // 2 - 1 :: len(mine) // 2] = -100\n",
)


@pytest.mark.parametrize(("edit", "name"), [(LEAK, "leak"), (EDGE, "edge")])
def test_a_cross_document_leak_or_a_dropped_edge_target_is_caught(runs, tmp_path, edit, name):
    root, assets = runs["root"], runs["assets"]
    out = tmp_path / name
    jobs = [{"name": name, "argv": _argv(root, assets, out, "lora", 4, CP)}]
    assert run_jobs(jobs, tmp_path, nproc=2, env=plant(edit, tmp_path))[name] == 0
    with pytest.raises(AssertionError, match=r"step 1 (loss|grad_norm)"):
        assert_runs_match(root / "one" / "lora", out, matrix_tolerance("llama"))


def test_the_split_covers_every_position_once_and_attends_as_one_row():
    """zigzag: 2·cp chunks, rank i holds i and 2·cp-1-i; together the ranks hold every position once, and the
    labels travel with their positions (padding has none). Each rank's attention (its local parts, and the parts
    of documents begun in earlier chunks against the row's keys) equals per-document causal attention of the whole
    row at its positions, for documents crossing chunk and rank edges, GQA included."""
    from shardtune.models.fastpath import _context_parallel_attention
    from shardtune.parallel.context_parallel import local_shard

    length, size = 24, 3
    held = torch.cat([split.zigzag(length, size, r) for r in range(size)])
    assert sorted(held.tolist()) == list(range(length))
    assert split.zigzag(length, size, 0).tolist() == [0, 1, 2, 3, 20, 21, 22, 23]
    pos = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 1, 2]])
    batch = {"input_ids": torch.arange(25)[None], "position_ids": pos, "labels": torch.arange(25)[None]}
    padded = torch.cat([pos, torch.arange(5)[None]], dim=1)  # to 30 = a multiple of 2·3
    docs = split.document_ids(padded)[0]
    allowed = (docs[:, None] == docs[None, :]) & torch.ones(30, 30, dtype=torch.bool).tril()
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, 30, 8, generator=g, dtype=torch.float64) for h in (4, 2, 2))
    want = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                                          attn_mask=allowed).transpose(1, 2)  # fmt: skip
    for r in range(size):
        local, rows, order = split.split(batch, size=size, rank=r, pad_id=0)
        mine = split.zigzag(30, size, r)
        assert local["labels"][0].tolist() == [x if x < 25 else -100 for x in mine.tolist()]
        gathered = torch.cat([split.zigzag(30, size, q) for q in range(size)])
        assert torch.equal(gathered[order], torch.arange(30))  # the gathered keys put back in row order
        assert sum(p.end - p.start for p in rows[0]) == len(mine)
        k_r, v_r = k[:, :, mine], v[:, :, mine]
        # one process holds every rank's keys: the all-gather of this rank's k_r (or v_r) is the whole row's
        shard = local_shard(rows, local["position_ids"], lambda x, k_r=k_r: k if x is k_r else v, size=size)
        got = _context_parallel_attention(q[:, :, mine], k_r, v_r, shard, 0.0, None)
        torch.testing.assert_close(got, want[:, mine], rtol=0, atol=1e-12)


@pytest.mark.parametrize(
    "lengths",
    [(8, 16, 8),  # chunks of 8: rank 0 (chunks 0, 3) begins both with a document, rank 1's chunk 2 continues one
     (3, 20, 9)],  # documents crossing chunk and rank edges on both ranks
)  # fmt: skip
def test_every_rank_attends_and_backpropagates_as_one_process(tmp_path, lengths):
    """2 gloo ranks: each rank's context-parallel attention, forward and the gradients of its queries, keys and
    values (the gathered keys' gradients come back through the reduce-scatter), equals autograd over the whole row
    in one process (fp64). The first row gives one rank no document begun in an earlier chunk and the other one:
    both still meet in every all-gather (a rank that skipped it would leave the other waiting)."""
    import subprocess
    import sys

    out = tmp_path / "errors.json"
    worker = Path(__file__).with_name("cp_attention_worker.py")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
           str(_free_port()), str(worker), str(out), ",".join(map(str, lengths))]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = json.loads(out.read_text())
    # fp64 (unit roundoff 1.1e-16) over softmaxes of at most 32 keys and sums of as many terms: 1e-12 is ~10^4
    # roundoffs of the O(1) outputs and gradients; a wrong key range moves them by O(0.1).
    for r in ranks:
        assert all(e < 1e-12 for e in r["errors"].values()), r
    if lengths == (8, 16, 8):
        assert [r["crossing_parts"] for r in ranks] == [0, 1]
