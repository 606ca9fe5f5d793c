"""Checks of a run's inputs that read configs and file headers but no weights, so that a wrong path, hub id,
module name, sequence length, damaged weight file or adapter stops the run in seconds with one line naming the
flag and the fix, before data is tokenized and the model is loaded (docs/errors.md, "Bad input").

Nothing here imports torch.distributed: train.py runs the model checks on every rank (they read the same files);
the output folder's checks are shardtune.training.run_dir's, on rank 0 only (the others would see rank 0's first files).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from shardtune.models import targets
from shardtune.models.adapter import _target_modules, names_peft_adapts_as_experts
from shardtune.models.adapter_fit import adapter_base_problem, model_shapes
from shardtune.models.loading import check_4bit_layout
from shardtune.models.router_aux import family_router_aux
from shardtune.models.weights import weight_file_problem
from shardtune.runtime.hub import is_hub_id, is_transport_error
from shardtune.runtime.log import warn0

# One HEAD request, no retries: huggingface_hub retries a refused or unresolved connection five times over
# ~23 s per file (measured), and a run reads several files, so an offline machine waited about a minute.
HUB_LOOKUP_TIMEOUT_S = 10.0
WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "spiece.model",
)
# Config fields that hold a model family's trained context length, in the order transformers' families use them.
POSITION_FIELDS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "n_ctx")


# ---------------------------------------------------------------- hub ids


def hub_problem(
    repo_id: str,
    flag: str,
    filename: str = "config.json",
    timeout_s: float = HUB_LOOKUP_TIMEOUT_S,
    endpoint: str | None = None,
) -> str | None:
    """Why `repo_id` cannot be read from the hub (offline and not cached, unreachable, missing, gated), or None.

    One bounded request, so that a machine without network learns it in seconds (see HUB_LOOKUP_TIMEOUT_S).
    endpoint: the hub's address (default: HF_ENDPOINT as huggingface_hub read it).
    """
    from huggingface_hub import constants, hf_hub_url, try_to_load_from_cache
    from huggingface_hub.utils import build_hf_headers, get_session

    cached = isinstance(try_to_load_from_cache(repo_id, filename), str)
    if constants.HF_HUB_OFFLINE:
        if cached:
            return None
        return (
            f"{flag} {repo_id}: HF_HUB_OFFLINE=1 is set and {repo_id} is not in the local cache "
            f"({constants.HF_HUB_CACHE}); download it where there is network (`hf download {repo_id}`), "
            "give a local folder, or unset HF_HUB_OFFLINE."
        )
    try:
        response = get_session().head(
            hf_hub_url(repo_id, filename, endpoint=endpoint),
            headers=build_hf_headers(),
            timeout=timeout_s,
            follow_redirects=True,
        )
    except Exception as e:  # connection, DNS, TLS, proxy or timeout: all mean "unreachable"
        if not (isinstance(e, OSError) or is_transport_error(e)):
            raise
        fix = "set HF_HUB_OFFLINE=1 to use the cached copy" if cached else "give a local model folder"
        return (
            f"{flag} {repo_id}: cannot reach the Hugging Face Hub at {endpoint or constants.ENDPOINT} "
            f"({type(e).__name__}: {str(e)[:120]}); check the network, HF_ENDPOINT and any proxy, or {fix}."
        )
    status = response.status_code
    if status < 400:
        return None
    if status in (401, 403):
        return (
            f"{flag} {repo_id}: the hub refused access (HTTP {status}): the repository is private or gated, or "
            "the id is misspelled; accept its terms on huggingface.co and log in (`hf auth login` or HF_TOKEN)."
        )
    if status == 404:
        return f"{flag} {repo_id}: no such repository or no {filename} in it on the hub; check the id."
    return f"{flag} {repo_id}: the hub answered HTTP {status} for {filename}; try again later."


# ---------------------------------------------------------------- the base model


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return (text.splitlines()[0] if text else type(e).__name__)[:300]


def model_config_or_problem(name: str, *, flag: str = "--model_name_or_path", trust_remote_code: bool = False):
    """(config, None) or (None, the problem) for a local model folder or a hub id; reads no weights."""
    from transformers import AutoConfig

    path = Path(name).expanduser()
    if not is_hub_id(name):
        if not path.is_dir():
            return None, f"{flag} {name}: no such folder; give a model folder or a hub id."
        cfg_file = path / "config.json"
        if not cfg_file.is_file():
            return None, f"{flag} {name}: no config.json there; give a model folder or a hub id."
        try:
            json.loads(cfg_file.read_text())
        except (ValueError, UnicodeDecodeError) as e:
            return (
                None,
                f"{flag} {name}: {cfg_file} is not valid JSON ({_first_line(e)}); restore it from the original model.",
            )
        problem = _weights_problem(path, flag, name)
        if problem:
            return None, problem
    else:
        problem = hub_problem(name, flag)
        if problem:
            return None, problem
    try:
        return AutoConfig.from_pretrained(name, trust_remote_code=trust_remote_code), None
    except (ValueError, KeyError, OSError) as e:
        return None, f"{flag} {name}: transformers cannot read its config.json ({_first_line(e)})."


def _weights_problem(folder: Path, flag: str, name: str) -> str | None:
    """A folder without weights, or whose index names shard files that are not there."""
    for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        index = folder / index_name
        if index.is_file():
            try:
                files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            except (ValueError, KeyError, AttributeError) as e:
                return f"{flag} {name}: {index} is not a valid weight index ({_first_line(e)}); restore it."
            missing = [f for f in files if not (folder / f).is_file()]
            if missing:
                return (
                    f"{flag} {name}: {index_name} names {len(missing)} weight file(s) that are not there "
                    f"(e.g. {missing[0]}); copy or download the complete model."
                )
            return _damaged_weights(folder, files, flag, name)
    present = [f for f in WEIGHT_FILES if (folder / f).is_file()]
    if present:
        return _damaged_weights(folder, present, flag, name)
    return (
        f"{flag} {name}: no weights there (model.safetensors or pytorch_model.bin, or a sharded index); "
        "copy the weight files into the folder, or give the hub id."
    )


def _damaged_weights(folder: Path, files: list[str], flag: str, name: str) -> str | None:
    """A weight file cut short or with a damaged header, found from headers and sizes (no weight is read), so that
    it is named here and not by a safetensors traceback once the data is prepared."""

    for f in files:
        if problem := weight_file_problem(folder / f):
            return f"{flag} {name}: {problem}."
    return None


def tokenizer_problem(name: str, flag: str) -> str | None:
    """A tokenizer folder that does not exist or holds no tokenizer files, or a hub id that cannot be read."""
    path = Path(name).expanduser()
    if is_hub_id(name):
        return hub_problem(name, flag, filename="tokenizer_config.json")
    if not path.is_dir():
        return f"{flag} {name}: no such folder; give a tokenizer (or model) folder or a hub id."
    if not any((path / f).is_file() for f in TOKENIZER_FILES):
        fix = "give --tokenizer_name_or_path" if flag == "--model_name_or_path" else "give the folder that has them"
        return f"{flag} {name}: no tokenizer files there ({', '.join(TOKENIZER_FILES)}); {fix}."
    # transformers names no file when one of these does not parse (a JSONDecodeError's line and column only).
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "vocab.json"):
        try:
            if (path / f).is_file():
                json.loads((path / f).read_bytes())
        except ValueError as e:  # JSONDecodeError and UnicodeDecodeError
            return f"{flag} {name}: {path / f} is not valid JSON ({_first_line(e)}); {TOKENIZER_FIX}."
    return None


TOKENIZER_FIX = "restore the tokenizer files from the original model, or give --tokenizer_name_or_path"


def tokenizer_load_error(name: str, flag: str, e: Exception) -> ValueError:
    """A tokenizer that transformers or tokenizers could not load, as one line naming the folder and the fix."""
    return ValueError(
        f"{flag} {name}: its tokenizer cannot be loaded ({type(e).__name__}: {_first_line(e)}); {TOKENIZER_FIX}."
    )


def context_limit(config) -> tuple[int | None, str]:
    """The longest sequence the model was trained for (with its RoPE scaling) and how that was read."""
    c = config.get_text_config() if hasattr(config, "get_text_config") else config
    base, field = None, ""
    for name in POSITION_FIELDS:
        value = getattr(c, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            base, field = value, name
            break
    if base is None:
        return None, ""
    rope = getattr(c, "rope_scaling", None) or getattr(c, "rope_parameters", None) or {}
    factor = (
        rope.get("factor") if isinstance(rope, dict) and rope.get("rope_type", rope.get("type")) != "default" else None
    )
    if not factor or factor <= 1:
        return base, f"{field} = {base}"
    # linear/dynamic/yarn scale the original context by the factor; llama3-style configs already state the longer
    # one in max_position_embeddings: the larger of the two is what the model is configured for.
    scaled = int((rope.get("original_max_position_embeddings") or base) * factor)
    return max(base, scaled), f"{field} = {base} with RoPE scaling (factor {factor:g})"


def max_length_problem(max_length: int, config, name: str, flag: str = "--max_seq_len") -> str | None:
    """`flag` (the flags whose sum is the longest row, `max_length`) beyond the model's context, with the fix."""
    limit, how = context_limit(config)
    if limit is None or max_length <= limit:
        return None
    return (
        f"{flag} {max_length} is longer than {name} was trained for ({how} in its config.json); lower "
        f"{flag} to {limit} or less, or, to extend the context on purpose, train from a copy of the model "
        "whose config.json sets rope_scaling (or a larger max_position_embeddings)."
    )


def _longest_row(cfg) -> tuple[int, str]:
    """The longest row a run trains on and the flags that set it: online RL (--objective grpo) trains on a prompt
    and its generated completion, every other objective on rows of --max_seq_len."""
    t = cfg.train
    if t.objective == "grpo":
        return (t.max_prompt_length or 0) + t.max_completion_length, "--max_prompt_length + --max_completion_length"
    return cfg.data.max_length, "--max_seq_len"


def meta_skeleton(config, trust_remote_code: bool = False):
    """The model's modules with every parameter on the meta device: names and shapes, nothing allocated."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)


# ---------------------------------------------------------------- module names


def _adaptable(module) -> bool:
    """Layer types peft's LoRA can wrap (transformers' GPT-2-style Conv1D included)."""
    from torch import nn

    return isinstance(module, (nn.Linear, nn.Embedding, nn.Conv1d, nn.Conv2d)) or type(module).__name__ == "Conv1D"


def _linear_names(model) -> list[str]:
    from torch import nn

    names = {
        n.rsplit(".", 1)[-1]
        for n, m in model.named_modules()
        if n and (isinstance(m, nn.Linear) or type(m).__name__ == "Conv1D")
    }
    return sorted(names)


def _matches(full: str, name: str) -> bool:
    return full == name or full.endswith("." + name)


def target_module_problems(model, spec: str, *, explicit: bool, model_name: str) -> list[str]:
    """Names in --lora_target_modules that match no adaptable layer (peft would skip them silently), refused with
    the model's linear layer names. Given by default rather than by the user, unmatched names are only warned of."""

    names = [s.strip() for s in spec.split(",") if s.strip()]
    if names == ["all-linear"]:
        return []
    layers = [n for n, m in model.named_modules() if n and _adaptable(m)]
    if isinstance(_target_modules(spec), str):  # one regular expression
        try:
            pattern = re.compile(names[0])
        except re.error as e:
            return [f"--lora_target_modules {names[0]!r} is not a valid regular expression ({e})."]
        if any(pattern.fullmatch(n) for n in layers):
            return targets.unmatched_alternatives_warned(names[0], layers, _linear_names(model))
        missing = names
    else:
        missing = [n for n in names if not any(_matches(full, n) for full in layers)]
        missing = [n for n in missing if n not in names_peft_adapts_as_experts(model, names)[0]]
    if not missing:
        return []
    have = ", ".join(_linear_names(model))
    msg = (
        f"--lora_target_modules: {', '.join(missing)} matches no linear layer of {model_name}; its linear layers "
        f"are {have} (or give all-linear)."
    )
    if explicit or len(missing) == len(names):
        return [msg]
    warn0(msg.replace("matches no", "(the default) matches no") + " Those names are skipped.")
    return []


def modules_to_save_problems(model, spec: str | None, model_name: str) -> list[str]:
    names = [s.strip() for s in (spec or "").split(",") if s.strip()]
    modules = [n for n, _ in model.named_modules() if n]
    missing = [n for n in names if not any(_matches(full, n) for full in modules)]
    if not missing:
        return []
    leaves = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if n and not list(m.children())})
    names = ", ".join(leaves)
    return [f"--modules_to_save: {', '.join(missing)} is no module of {model_name}; its modules are named {names}."]


# ---------------------------------------------------------------- everything about the model, before loading


def model_input_problems(cfg) -> list[str]:
    """Every model-side problem of a training run (cfg: a RunConfig), from configs and headers only."""
    m = cfg.model
    config, problem = model_config_or_problem(m.model_name_or_path, trust_remote_code=m.trust_remote_code)
    if problem:
        return [problem]
    problems = []
    if m.tokenizer_name_or_path:
        problems.append(tokenizer_problem(m.tokenizer_name_or_path, "--tokenizer_name_or_path"))
    elif not is_hub_id(m.model_name_or_path):
        problems.append(tokenizer_problem(m.model_name_or_path, "--model_name_or_path"))
    longest, flag = _longest_row(cfg)
    problems.append(max_length_problem(longest, config, m.model_name_or_path, flag))
    if m.use_4bit_quantization:
        problems.append(_4bit_layout_problem(config))
    if m.use_peft_lora or cfg.train.router_aux_loss_coef is not None:
        try:
            skeleton = meta_skeleton(config, m.trust_remote_code)
        except Exception as e:  # noqa: BLE001 - an unusual family: leave the module checks to peft
            warn0(
                f"Could not build {m.model_name_or_path} on the meta device to check module names ({_first_line(e)})."
            )
            return [p for p in problems if p]
        problems.append(router_aux_problem(skeleton, cfg.train.router_aux_loss_coef, m.model_name_or_path))
    if m.use_peft_lora:
        if m.use_4bit_quantization and not any(problems):
            problems.append(_4bit_layout_problem(config, skeleton))
        if m.adapter_path:
            vocab = getattr(config.get_text_config(), "vocab_size", None)
            problems.append(
                adapter_base_problem(
                    m.adapter_path,
                    model_shapes(skeleton),
                    base_name=m.model_name_or_path,
                    flag="--adapter_path",
                    vocab_size=vocab,
                    skeleton=skeleton,
                )
            )
        else:
            explicit = "lora_target_modules" in getattr(cfg, "explicit", ())
            problems += target_module_problems(
                skeleton, m.lora_target_modules, explicit=explicit, model_name=m.model_name_or_path
            )
            problems += targets.parameter_target_problems(
                skeleton, m.lora_target_parameters, experts=m.lora_target_experts
            )
            problems += modules_to_save_problems(skeleton, m.modules_to_save, m.model_name_or_path)
            if "lora_r" in getattr(cfg, "explicit", ()):
                warn_full_rank(skeleton, m.lora_r, m.lora_target_modules)
            problems.append(targets.chat_format_problem(skeleton, m.modules_to_save, m.chat_template_format))
    return [p for p in problems if p]


def router_aux_problem(skeleton, coef: float | None, model_name: str) -> str | None:
    """A non-zero --router_aux_loss_coef on a model without a router load-balancing loss (a dense model, or a
    mixture of experts whose family defines none: shardtune.models.router_aux) would change nothing: refused. 0
    ("no such loss") is true of every such model, so a command line shared by several families may say it."""
    if not coef or family_router_aux(skeleton) is not None:
        return None
    return (
        f"--router_aux_loss_coef {coef:g}: {model_name} ({type(skeleton).__name__}) has no router load-balancing "
        "loss (it is not a mixture of experts, or its family defines none), so the flag would change nothing; "
        "remove it."
    )


def _targeted_linears(skeleton, spec: str) -> dict[str, tuple[int, int]]:
    """{path: (out, in)} of the linear layers --lora_target_modules adapts (names, one expression or all-linear)."""
    names = [s.strip() for s in spec.split(",") if s.strip()]
    linears = {n: tuple(m.weight.shape) for n, m in skeleton.named_modules() if n and _adaptable(m)}
    linears = {n: s for n, s in linears.items() if len(s) == 2}
    if names == ["all-linear"]:
        chosen = set(targets.plan_all_linear(skeleton).paths)
        return {n: s for n, s in linears.items() if n in chosen}
    if isinstance(_target_modules(spec), str):  # one regular expression, full-matched as PEFT does
        try:
            pattern = re.compile(names[0])
        except re.error:
            return {}  # said by target_module_problems
        return {n: s for n, s in linears.items() if pattern.fullmatch(n)}
    return {n: s for n, s in linears.items() if any(_matches(n, x) for x in names)}


def warn_full_rank(skeleton, r: int, spec: str) -> None:
    """--lora_r at or above the smaller width of every linear layer it adapts: the update B·A can then have any
    rank, so the LoRA is not low-rank (it holds more numbers than the layer). Warned, not refused: the run still
    trains what was asked (r also sets the scaling alpha/r), yet it is rarely what was meant."""
    linears = _targeted_linears(skeleton, spec)
    if not linears:
        return
    widest = max(linears, key=lambda n: min(linears[n]))
    if r >= min(linears[widest]):
        out, inp = linears[widest]
        warn0(
            f"--lora_r {r} is at least the smaller width of every layer it adapts (the largest is "
            f"{min(out, inp)}, in {widest}: {inp} in, {out} out): the LoRA is not low-rank and holds more numbers "
            f"than those layers; use --lora_r below {min(out, inp)} (e.g. {max(1, min(out, inp) // 4)})."
        )


def _4bit_layout_problem(config, skeleton=None) -> str | None:
    """A family the 4-bit loader cannot read or run (shardtune.models.loading.check_4bit_layout), said before any data
    is prepared."""

    try:
        check_4bit_layout(config, skeleton)
    except ValueError as e:
        return str(e)
    return None
