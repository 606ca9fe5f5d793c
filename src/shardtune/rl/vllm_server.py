"""The `vllm` rollout engine in server mode: completions sampled by a vLLM OpenAI-compatible server that serves the
base model with LoRA enabled, and the policy's adapter sent to it after each optimizer step.

The server (docs/rl.md) is started by the user, e.g.

    VLLM_ALLOW_RUNTIME_LORA_UPDATING=True python -m vllm.entrypoints.openai.api_server --model BASE \\
        --enable-lora --max-lora-rank R --max-loras 1 --logprobs-mode processed_logprobs

and shardtune talks to it over HTTP with the standard library (no client dependency):

- `sync`: every rank gathers the adapter's full tensors (FSDP all-gathers, one fixed order), rank 0 writes a PEFT
  folder `<adapter_dir>/v{version}`, POSTs /v1/load_lora_adapter as `shardtune-v{version}`, then unloads and
  deletes the older versions; the outcome is broadcast so that every rank raises together. The adapter is never
  merged into the base (a 4-bit base cannot take it, and the server keeps its own base).
- `generate`: POST /v1/completions per prompt (token ids in, token ids out, each with its own seed), with the
  sampled tokens' log-probs of the distribution they were sampled from (the server's processed log-probs).
- `score`: the log-prob of each completion token at temperature 1, as the server's prompt log-probs of the prompt
  and completion sent as one prompt.

What vLLM 0.32 cannot serve (full fine-tuning, DoRA, trained token rows, modules_to_save) and what a server must
have been started with is refused before training by `vllm_engine_problems`, each problem one line with its fix.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import urllib.error
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from torch import nn

from shardtune.parallel.gather import gather_trainable
from shardtune.parallel.mesh import all_gather_objects, broadcast_object
from shardtune.rl.engine import Completion, SamplingSettings
from shardtune.training.export import save_adapter

URL_FLAG = "--vllm_server_base_url"
ADAPTER_PREFIX = "shardtune-v"  # the served name of adapter version v: shardtune-v{v}
# The only modules_to_save vLLM 0.32 loads with a LoRA adapter (vllm/lora/peft_helper.py: classification heads).
SERVED_MODULES_TO_SAVE = ("classifier", "score")
# vLLM 0.32's choices of --max-lora-rank (vllm/config/lora.py, MaxLoRARanks); its default is 16.
MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
_VERSION_FOLDER = re.compile(r"v\d+(\.\d+)?")
# Direct connections, whatever HTTP(S)_PROXY says: a cluster sets a proxy for the internet, which cannot reach an
# inference server on the cluster's own network.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class ServerError(RuntimeError):
    """The server's answer to a failed request: its HTTP status (None: no answer) and its message."""

    def __init__(self, status: int | None, message: str):
        super().__init__(message)
        self.status, self.message = status, message


def _server_message(body: bytes) -> str:
    text = body.decode(errors="replace").strip()
    try:
        data = json.loads(text)
    except ValueError:
        return text[:500]
    if isinstance(data, dict) and isinstance(data.get("error"), dict):
        return str(data["error"].get("message", data["error"]))
    if isinstance(data, dict) and "detail" in data:  # FastAPI's own answers (an unknown route: "Not Found")
        return str(data["detail"])
    return text[:500]


def request(url: str, path: str, body: dict | None = None, timeout_s: float = 30.0):
    """GET (body None) or POST JSON to the server; the decoded JSON answer, or its text (vLLM answers a LoRA load or
    unload with plain text). A refusal or no answer raises ServerError."""
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"} if data is not None else {}
    req = urllib.request.Request(url.rstrip("/") + path, data=data, headers=headers)
    try:
        with _OPENER.open(req, timeout=timeout_s) as answer:
            raw = answer.read()
    except urllib.error.HTTPError as e:
        raise ServerError(e.code, _server_message(e.read())) from None
    except (urllib.error.URLError, OSError) as e:  # refused, unknown host, timed out
        raise ServerError(None, f"no answer ({getattr(e, 'reason', e)})") from None
    text = raw.decode(errors="replace")
    try:
        return json.loads(text)
    except ValueError:
        return text


def adapter_name(version: int) -> str:
    return f"{ADAPTER_PREFIX}{version}"


def served_models(url: str, timeout_s: float = 30.0) -> list[dict]:
    """The server's /v1/models cards: the base model (parent None) and each loaded adapter (parent: the base)."""
    return list(request(url, "/v1/models", timeout_s=timeout_s).get("data", []))


def base_model_name(url: str, timeout_s: float = 30.0) -> str:
    bases = [m["id"] for m in served_models(url, timeout_s) if m.get("parent") is None]
    if not bases:
        raise ServerError(None, "/v1/models lists no base model")
    return bases[0]


class VLLMServerEngine:
    """A RolloutEngine (rl.engine) backed by a vLLM OpenAI server. `adapter_dir` must be a folder the server can
    read at the same path (one machine, or a shared filesystem): rank 0 writes each adapter version there.

    generate and score: each rank sends its own prompts, concurrently, and the server batches them with the other
    ranks' (continuous batching). Rank 0 sending for all would gather the prompts, wait for every completion and
    scatter them back: two collectives and rank 0's connection as the bottleneck, for the same server work. Each
    prompt is its own request (vLLM's completions API gives one seed to all the prompts of a request), so a prompt
    and seed give the same completion whatever the rank or the batch. The ranks then agree on the outcome (one
    small all-gather), so that a refused request raises on every rank rather than leave the others waiting in the
    training step's collectives.
    """

    name = "vllm"

    def __init__(
        self,
        server_url: str,
        adapter_dir: str | Path,
        tokenizer,
        rank: int,
        timeout_s: float = 1800.0,
        max_concurrent: int = 32,
    ):
        self.url = server_url.rstrip("/")
        self.adapter_dir = Path(adapter_dir).resolve()
        self.tokenizer = tokenizer  # written into each adapter folder, as the final adapter's (training.export)
        self.rank = rank
        self.timeout_s = timeout_s
        self.version: int | None = None
        self._base: str | None = None
        self._pool = ThreadPoolExecutor(max_concurrent, thread_name_prefix="vllm-request")

    # -- sync -------------------------------------------------------------------------------------------------------

    def sync(self, model: nn.Module, version: int) -> None:
        """Every rank: gather the adapter (model.model is the PeftModel), rank 0 publishes it, all raise together."""
        # All ranks enter the same all-gathers, in named_parameters order (the same module on every rank), before
        # rank 0 touches the network: a collective that only some ranks reach would hang the others.
        tensors = gather_trainable(model.model)
        problem = self._publish(model.model, tensors, version) if self.rank == 0 else None
        problem = broadcast_object(problem)
        if problem:
            raise RuntimeError(problem)
        self.version = version

    def _publish(self, peft_model: nn.Module, tensors: dict, version: int) -> str | None:
        """Rank 0: write the adapter, load it, unload and delete the older versions; None, or the error line."""
        name = adapter_name(version)
        folder = None
        try:
            served = served_models(self.url, self.timeout_s)
            if any(m["id"] == name for m in served):  # this version served from an earlier process (a resume)
                self._unload(name)
            folder = self._fresh_folder(version)
            save_adapter(peft_model, tensors, self.tokenizer, folder, step=version)
            request(self.url, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(folder)}, self.timeout_s)
            for card in served:
                if card["id"] != name and self._ours(card):
                    self._unload(card["id"])
            self._delete_folders(keep=folder)
        except ServerError as e:
            where = f" from {folder}" if folder else ""
            return (
                f"vllm rollout engine: the server at {self.url} did not load adapter version {version} "
                f"({name}{where}): {e.message}"
            )
        except OSError as e:
            return (
                f"vllm rollout engine: could not write adapter version {version} to {folder or self.adapter_dir}: {e}"
            )
        except Exception as e:  # noqa: BLE001 - the other ranks wait for this outcome: a raise here would hang them
            return f"vllm rollout engine: publishing adapter version {version} to {self.url} failed: {e!r}"
        return None

    def _fresh_folder(self, version: int) -> Path:
        """`v{version}`, or `v{version}.k` when that exists: vLLM's prefix cache keys a LoRA's blocks by its name and
        path, so the same name must never come back at the same path with other weights."""
        folder, k = self.adapter_dir / f"v{version}", 0
        while folder.exists():
            k += 1
            folder = self.adapter_dir / f"v{version}.{k}"
        return folder

    def _ours(self, card: dict) -> bool:
        """An adapter this engine's folder holds (not another run's on the same server)."""
        root = Path(str(card.get("root") or ""))
        return card["id"].startswith(ADAPTER_PREFIX) and root.parent == self.adapter_dir

    def _unload(self, name: str) -> None:
        try:
            request(self.url, "/v1/unload_lora_adapter", {"lora_name": name}, self.timeout_s)
        except ServerError as e:
            if e.status != 404 or "cannot be found" not in e.message:  # already gone: nothing to do
                raise

    def _delete_folders(self, keep: Path | None) -> None:
        for path in self.adapter_dir.iterdir():
            if path != keep and path.is_dir() and _VERSION_FOLDER.fullmatch(path.name):
                shutil.rmtree(path, ignore_errors=True)

    # -- generate and score ---------------------------------------------------------------------------------------

    def _model(self) -> str:
        """The served name to sample from: the synced adapter, or the base model before the first sync."""
        if self.version is not None:
            return adapter_name(self.version)
        if self._base is None:
            self._base = base_model_name(self.url, self.timeout_s)
        return self._base

    def _run_all(self, what: str, bodies: Callable[[str], list[dict]], parse: Callable[[int, dict], object]) -> list:
        """POST each of bodies(served name) to /v1/completions concurrently, and parse(i, first choice) each answer.
        Every rank calls this (see the class's docstring): whatever fails on one rank raises on all of them."""
        problem, out = None, []
        try:
            answers = self._pool.map(
                lambda body: request(self.url, "/v1/completions", body, self.timeout_s), bodies(self._model())
            )
            out = [parse(i, answer["choices"][0]) for i, answer in enumerate(answers)]
        except ServerError as e:
            version = "the base model" if self.version is None else f"adapter version {self.version}"
            problem = f"vllm rollout engine: {what} on the server at {self.url} failed ({version}): {e.message}"
        except Exception as e:  # noqa: BLE001 - an answer of another form: raised on every rank, not on this one only
            problem = f"vllm rollout engine: {what}: an unexpected answer from the server at {self.url}: {e!r}"
        problems = [p for p in all_gather_objects(problem) if p]
        if problems:
            raise RuntimeError(problems[0])
        return out

    def generate(self, prompts: list[list[int]], seeds: list[int], sampling: SamplingSettings) -> list[Completion]:
        def bodies(model: str) -> list[dict]:
            return [_completion_body(model, p, seed, sampling) for p, seed in zip(prompts, seeds, strict=True)]

        return self._run_all("generating", bodies, lambda i, choice: _completion(choice))

    def score(self, prompts: list[list[int]], completions: list[list[int]]) -> list[list[float]]:
        def bodies(model: str) -> list[dict]:
            return [_score_body(model, p + c) for p, c in zip(prompts, completions, strict=True)]

        def parse(i: int, choice: dict) -> list[float]:
            rows, start = choice["prompt_logprobs"], len(prompts[i])
            return [float(rows[start + j][str(t)]["logprob"]) for j, t in enumerate(completions[i])]

        return self._run_all("scoring", bodies, parse)

    def close(self) -> None:
        """Rank 0 unloads and deletes the adapters it loaded (the server keeps running for the next run)."""
        self._pool.shutdown(wait=True)
        if self.rank != 0 or self.version is None:
            return
        try:
            self._unload(adapter_name(self.version))
        except ServerError:
            pass  # the server is gone or restarted: nothing of ours is left on it
        self._delete_folders(keep=None)
        with contextlib.suppress(OSError):  # the folder itself, when nothing but our versions was in it
            self.adapter_dir.rmdir()
        self.version = None


def _completion_body(model: str, prompt: list[int], seed: int, sampling: SamplingSettings) -> dict:
    """One completion request. Every sampling setting is sent, including the neutral ones: a vLLM server applies
    the model's generation_config.json (e.g. a repetition_penalty) to what a request leaves out."""
    return {
        "model": model,
        "prompt": prompt,
        "n": 1,
        "seed": seed,
        "max_tokens": sampling.max_completion_length,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k,  # 0: no top-k, in vLLM as in SamplingSettings
        "min_p": 0.0,
        "repetition_penalty": 1.0,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        # Stop at exactly the trainer's EOS ids (ignore_eos drops the server's own EOS from the stop set); vLLM keeps
        # the stop token in token_ids and its log-prob in token_logprobs.
        "ignore_eos": True,
        "stop_token_ids": list(sampling.eos_token_ids),
        "logprobs": 0,  # the sampled token's log-prob only
        "return_token_ids": True,
    }


def _completion(choice: dict) -> Completion:
    """A completion from vLLM's answer: token_ids (the stop token kept), the sampled tokens' log-probs, and
    finish_reason "length" when it stopped at max_tokens (or at the server's --max-model-len)."""
    ids = [int(t) for t in choice["token_ids"]]
    logps = [float(x) for x in choice["logprobs"]["token_logprobs"]]
    if len(logps) != len(ids):
        raise ValueError(f"{len(ids)} tokens but {len(logps)} log-probs")
    return Completion(ids, logps, truncated=choice["finish_reason"] == "length")


def _score_body(model: str, tokens: list[int]) -> dict:
    """Prompt log-probs of `tokens` (the prompt and the completion as one prompt), one token generated and ignored.
    vLLM computes prompt log-probs from the raw logits: temperature 1, whatever its --logprobs-mode."""
    return {"model": model, "prompt": tokens, "max_tokens": 1, "temperature": 1.0, "prompt_logprobs": 0, "n": 1}


# -- checks before training -------------------------------------------------------------------------------------------


def vllm_engine_problems(
    use_peft_lora: bool,
    use_dora: bool,
    new_token_rows: bool,
    modules_to_save: list[str] | None,
    lora_r: int,
    server_url: str | None,
    adapter_dir: str | Path | None = None,
    timeout_s: float = 5.0,
) -> list[str]:
    """What the `vllm` engine cannot do for this run, one line each with the reason and the fix: what vLLM cannot
    serve, then the server (reachable, runtime LoRA loading, LoRA enabled with a rank of at least --lora_r, able to
    read `adapter_dir`, log-probs of the sampling distribution). With `adapter_dir` None the LoRA checks that need a
    file on the server's side are left to the first sync, whose error line names the server's reason."""
    where = "--rollout_engine vllm"
    problems = []
    if not use_peft_lora:
        problems.append(
            f"{where}: full fine-tuning has no adapter to send to the server (server mode loads LoRA adapters into a "
            "server that keeps its own base); fix: --use_peft_lora True, or --rollout_engine transformers"
        )
    if use_peft_lora and use_dora:
        problems.append(
            f"{where}: vLLM does not serve DoRA adapters; fix: --use_dora False, or --rollout_engine transformers"
        )
    if use_peft_lora and new_token_rows:
        problems.append(
            f"{where}: the run trains new token rows (tokens added for the chat template, or embeddings padded), "
            "which vLLM refuses in an adapter (PEFT's trainable_tokens_delta); fix: add no tokens (--chat_template_format none, or a tokenizer that has "
            "the template's tokens), or --rollout_engine transformers"
        )
    extra = [m for m in modules_to_save or [] if m not in SERVED_MODULES_TO_SAVE]
    if use_peft_lora and extra:
        problems.append(
            f"{where}: vLLM refuses adapters with --modules_to_save {','.join(extra)} (it serves only classifier "
            "heads there); fix: leave --modules_to_save unset, or --rollout_engine transformers"
        )
    if use_peft_lora and lora_r > MAX_LORA_RANKS[-1]:
        top = MAX_LORA_RANKS[-1]
        problems.append(
            f"{where}: --lora_r {lora_r} is above vLLM's largest --max-lora-rank {top}; fix: --lora_r {top}"
        )
    if not server_url:
        return problems + [f"{where} needs {URL_FLAG} (the vLLM server's URL, e.g. http://host:8000)"]
    return problems + _server_problems(
        server_url.rstrip("/"), lora_r if use_peft_lora else None, adapter_dir, timeout_s
    )


def _server_problems(url: str, lora_r: int | None, adapter_dir: str | Path | None, timeout_s: float) -> list[str]:
    try:
        base = base_model_name(url, timeout_s)
    except ServerError as e:
        return [_line(url, f"no vLLM server answered GET /v1/models within {timeout_s:g} s: {e.message}", _START)]
    # The probes run the model: a server's first requests may take longer than an answer from /v1/models.
    probe_s = 12 * timeout_s
    problems = _lora_problems(url, lora_r, adapter_dir, probe_s) if lora_r is not None else []
    try:
        processed = processed_logprobs(url, base, probe_s)
    except ServerError as e:
        return problems + [f"{URL_FLAG} {url}: sampling one token from {base} failed: {e.message}"]
    if processed is False:
        problems.append(
            f"{URL_FLAG} {url}: the server returns the log-probs of the raw logits (vLLM's default --logprobs-mode "
            "raw_logprobs), not of the temperature-scaled distribution it samples from, which the rollout's old "
            "log-probs must be; fix: start it with --logprobs-mode processed_logprobs"
        )
    return problems


def _lora_problems(url: str, lora_r: int, adapter_dir: str | Path | None, timeout_s: float) -> list[str]:
    """Runtime LoRA loading on, LoRA enabled, --max-lora-rank >= lora_r, adapter_dir readable by the server: a probe
    folder holding only an adapter_config.json of rank lora_r, which vLLM validates and then refuses for having no
    tensors (nothing is loaded)."""
    name = f"shardtune-probe-{os.getpid()}"
    try:
        request(url, "/v1/unload_lora_adapter", {"lora_name": name}, timeout_s)
    except ServerError as e:
        if e.message == "Not Found":  # the route itself: runtime loading is off
            why = "the server has no /v1/load_lora_adapter, which sync needs"
            return [_line(url, why, "start it with VLLM_ALLOW_RUNTIME_LORA_UPDATING=True in its environment")]
    if adapter_dir is None:
        return []
    probe = Path(adapter_dir).resolve() / f".probe-{os.getpid()}"
    probe.mkdir(parents=True, exist_ok=True)
    config = {"peft_type": "LORA", "r": lora_r, "lora_alpha": lora_r, "target_modules": ["q_proj"]}
    (probe / "adapter_config.json").write_text(json.dumps(config))
    try:
        request(url, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(probe)}, timeout_s)
        request(url, "/v1/unload_lora_adapter", {"lora_name": name}, timeout_s)  # not expected: it has no tensors
        message = ""
    except ServerError as e:
        message = e.message
    finally:
        shutil.rmtree(probe, ignore_errors=True)
    rank = next(r for r in MAX_LORA_RANKS if r >= lora_r)
    if "LoRA is not enabled" in message:
        return [f"{URL_FLAG} {url}: the server was started without LoRA; fix: --enable-lora --max-lora-rank {rank}"]
    if "max_lora_rank" in message:
        return [f"{URL_FLAG} {url}: {_worker_error(message)}; fix: start it with --max-lora-rank {rank} (>= --lora_r)"]
    if "No adapter found" in message:
        why = f"the server cannot read {probe.parent}, where sync writes the adapters for it to load"
        return [_line(url, why, "an adapter folder that rank 0 and the server both see at the same path")]
    return []


_START = "start it (docs/rl.md: python -m vllm.entrypoints.openai.api_server --enable-lora ...) and give its URL"


def _line(url: str, why: str, fix: str) -> str:
    return f"{URL_FLAG} {url}: {why}; fix: {fix}"


def _worker_error(message: str) -> str:
    """The worker's own words in vLLM's "Call to add_lora method failed: Worker failed with error '...', please
    check the stack trace above" (the whole message when it has another form)."""
    found = re.search(r"error '(.+?)',", message)
    return (found.group(1) if found else message).rstrip(".")


def processed_logprobs(url: str, model: str, timeout_s: float = 30.0, prompt: tuple[int, ...] = (1,)) -> bool | None:
    """Whether the server's sampled-token log-probs are of the temperature-scaled distribution (its --logprobs-mode
    processed_logprobs), which the server shows nowhere: one token sampled at temperature 1 and at 1/2 with the
    top-5 log-probs. Temperature T divides the gaps between log-probs by T when they are processed, and leaves
    them when they are raw. None: the gaps are too small to tell."""

    def top(temperature: float) -> dict[str, float]:
        body = {
            "model": model,
            "prompt": list(prompt),
            "max_tokens": 1,
            "temperature": temperature,
            "seed": 0,
            "top_p": 1.0,
            "top_k": 0,
            "logprobs": 5,
            "return_tokens_as_token_ids": True,
        }
        return request(url, "/v1/completions", body, timeout_s)["choices"][0]["logprobs"]["top_logprobs"][0]

    at_1, at_half = top(1.0), top(0.5)
    common = sorted(set(at_1) & set(at_half), key=at_1.get)
    if len(common) < 2 or at_1[common[-1]] - at_1[common[0]] < 1e-3:
        return None
    ratio = (at_half[common[-1]] - at_half[common[0]]) / (at_1[common[-1]] - at_1[common[0]])
    return abs(ratio - 2.0) < abs(ratio - 1.0)
