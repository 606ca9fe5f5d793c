"""Would packing preference pairs pay? Padding fraction and training tokens/s of shardtune's padded pair batches
(B pairs = 2B rows padded to the longest sequence of the global batch) against the same pairs packed whole into
rows of 2·max_length tokens (best fit decreasing, each sequence a document of its own: per-document attention, no
cross-attention), forward and backward of a LoRA-free small Llama.

Two length distributions:
  demo    the pairs `shardtune demo --objective dpo` generates, tokenized by the demo tokenizer;
  uf-like a synthetic distribution shaped like UltraFeedback's (long prompts, varied completions): prompt, chosen
          and rejected lengths lognormal with medians 160, 280 and 230 tokens (σ 0.9, 0.7, 0.8), cut to
          --max_length. These parameters are assumptions, not fitted to data; they only set the shape.

Usage: python bench/preference_packing.py [--threads 2] [--pairs_per_batch 4] [--batches 6]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from shardtune.objectives.heads import sequence_logps


def demo_lengths(n: int, tmp: Path) -> np.ndarray:
    from shardtune.commands.demo import build_tokenizer, write_preference_dataset
    from shardtune.data.preference import tokenize_pair

    tok = build_tokenizer(tmp / "tok", vocab_size=1024)
    data = write_preference_dataset(tmp / "pairs", n_train=n, n_test=1, seed=0, copies=True)
    out = []
    for i, line in enumerate((data / "train.jsonl").read_text().splitlines()):
        p, c, r = tokenize_pair(tok, json.loads(line), "train", i, True)
        out.append((len(p) + len(c), len(p) + len(r)))
    return np.array(out)


def uf_like_lengths(n: int, max_length: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    prompt = np.clip(rng.lognormal(np.log(160), 0.9, n), 8, max_length // 2).astype(int)
    chosen = np.clip(rng.lognormal(np.log(280), 0.7, n), 4, None).astype(int)
    rejected = np.clip(rng.lognormal(np.log(230), 0.8, n), 4, None).astype(int)
    return np.stack([np.minimum(prompt + chosen, max_length), np.minimum(prompt + rejected, max_length)], 1)


def padded_batches(lengths: np.ndarray, pairs: int, seed: int = 0) -> list[np.ndarray]:
    """Shuffled batches of `pairs` pairs, as shardtune's PreferenceSplit.iterate forms them."""
    order = np.random.default_rng(seed).permutation(len(lengths))
    return [order[i : i + pairs] for i in range(0, len(order) - pairs + 1, pairs)]


def padding_fractions(lengths: np.ndarray, pairs: int, max_length: int) -> tuple[float, float]:
    from shardtune.data.packing import best_fit_decreasing

    real = lengths.sum()
    padded = sum(2 * len(b) * lengths[b].max() for b in padded_batches(lengths, pairs))
    used = sum(lengths[b].sum() for b in padded_batches(lengths, pairs))
    rows = best_fit_decreasing(lengths.sum(1).tolist(), 2 * max_length, seed=0)
    return 1 - used / padded, 1 - real / (len(rows) * 2 * max_length)


def build_model(tmp: Path):
    from transformers import AutoModelForCausalLM

    from shardtune.commands.demo import build_model as write_model
    from shardtune.models import fastpath
    from shardtune.models.training_module import CausalLMForTraining

    write_model(tmp / "model", vocab_size=1024, hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2)
    model = AutoModelForCausalLM.from_pretrained(
        tmp / "model", dtype=torch.float32, attn_implementation=fastpath.register_attention()
    )
    return CausalLMForTraining(model)


def _rows(seqs: list[list[int]], width: int) -> dict[str, torch.Tensor]:
    """Rows of documents (lengths), padded to width: random tokens, position ids restarting per document."""
    ids = torch.randint(1, 1024, (len(seqs), width))
    pos = torch.zeros(len(seqs), width, dtype=torch.long)
    labels = torch.full((len(seqs), width), -100)
    for r, docs in enumerate(seqs):
        at = 0
        for n in docs:
            pos[r, at : at + n] = torch.arange(n)
            labels[r, at : at + n - 1] = ids[r, at + 1 : at + n]
            at += n
        pos[r, at:] = torch.arange(width - at)
    return {"input_ids": ids, "position_ids": pos, "labels": labels}


def _time(model, batches: list[dict]) -> float:
    t0 = time.perf_counter()
    for b in batches:
        logps, _ = model(**b, head=sequence_logps)
        logps.sum().backward()
    return time.perf_counter() - t0


def speed(model, lengths: np.ndarray, pairs: int, n_batches: int, max_length: int) -> tuple[float, float]:
    """Real tokens/s, padded and packed, of the same n_batches × pairs pairs (median of 3 interleaved runs)."""
    from shardtune.data.packing import best_fit_decreasing

    chosen = padded_batches(lengths, pairs)[:n_batches]
    padded = [_rows([[a] for a in lengths[b, 0]] + [[r] for r in lengths[b, 1]], int(lengths[b].max())) for b in chosen]
    sel = np.concatenate(chosen)
    groups = best_fit_decreasing(lengths[sel].sum(1).tolist(), 2 * max_length, seed=0)
    docs = [[int(x) for i in g for x in lengths[sel[i]]] for g in groups]
    width = max(sum(d) for d in docs)
    per = max(1, round(len(docs) / n_batches))  # as many micro-batches as the padded run
    packed = [_rows(docs[i : i + per], width) for i in range(0, len(docs), per)]
    real = int(lengths[sel].sum())
    _time(model, padded[:1])  # warm up
    times = {"padded": [], "packed": []}
    for _ in range(3):
        times["padded"].append(_time(model, padded))
        times["packed"].append(_time(model, packed))
    return real / statistics.median(times["padded"]), real / statistics.median(times["packed"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--pairs_per_batch", type=int, default=4)
    ap.add_argument("--batches", type=int, default=6)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        model = build_model(tmp)
        for name, lengths, max_length in (
            ("demo", demo_lengths(800, tmp), 64),
            ("uf-like", uf_like_lengths(2000, 1024), 1024),
        ):
            for pairs in (args.pairs_per_batch, 2 * args.pairs_per_batch):
                pad_padded, pad_packed = padding_fractions(lengths, pairs, max_length)
                print(
                    f"{name:8s} B={pairs:2d} pairs: mean sequence {lengths.mean():.0f} tokens; padding "
                    f"padded {pad_padded:.3f}, packed {pad_packed:.3f}"
                )
            tps_padded, tps_packed = speed(model, lengths, args.pairs_per_batch, args.batches, max_length)
            print(
                f"{name:8s} B={args.pairs_per_batch:2d}: tokens/s padded {tps_padded:.0f}, packed {tps_packed:.0f} "
                f"({tps_packed / tps_padded:.2f}x)"
            )


if __name__ == "__main__":
    main()
