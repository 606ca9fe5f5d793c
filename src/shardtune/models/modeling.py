"""Tokenizer, base model, quantization config and PEFT adapter; and the training module with a chunked loss.

Nothing here imports torch.distributed: sharding lives in shardtune.parallel.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import math
import re
from collections.abc import Iterator

import torch
from torch import nn

from shardtune.config import dtypes
from shardtune.config.validation import tied_head_saved_problem
from shardtune.data.templates import padded_rows, setup_tokenizer
from shardtune.models import families, fastpath, quant, quant_experts, router_aux, targets
from shardtune.models.families import family_attention
from shardtune.models.weights import causal_lm_class, layout_conversions, stacked_experts
from shardtune.runtime.log import print0, warn0


def attn_implementation(use_flash_attn: bool, device_type: str) -> str:
    """flash_attention_2 where it is installed on CUDA, otherwise SDPA run once per packed document
    (shardtune.models.fastpath; said once in the log)."""
    if use_flash_attn:
        if device_type == "cuda" and importlib.util.find_spec("flash_attn") is not None:
            return "flash_attention_2"
        reason = "not on CUDA" if device_type != "cuda" else "flash_attn is not installed"
        print0(f"--use_flash_attn: {reason}; using SDPA attention, run per document of each packed row.")
    return fastpath.register_attention()


def context_parallel_attention(attn_impl: str, context_parallel: int, compute_dtype: torch.dtype) -> tuple[str, bool]:
    """(the model's attention, whether context parallelism runs it as one flash-attention varlen call). Under
    context parallelism the model runs shardtune's attention, which holds the split (shardtune.models.fastpath); where
    flash-attention 2 was chosen (CUDA, installed, version 2.1 or later: its causal mask of fewer queries than
    keys is aligned at the bottom right) and the compute dtype is 16-bit, that attention calls flash's varlen."""
    if context_parallel == 1:
        return attn_impl, False
    flash = attn_impl == "flash_attention_2" and compute_dtype in (torch.float16, torch.bfloat16)
    if flash and _flash_version() < (2, 1):
        print0("--context_parallel_size: flash_attn older than 2.1; using SDPA per part of each row.")
        flash = False
    elif flash:
        print0("--context_parallel_size: flash-attention varlen per document, over the gathered keys.")
    return fastpath.register_attention(), flash


def _flash_version() -> tuple[int, ...]:
    version = importlib.metadata.version("flash_attn")
    return tuple(int(x) for x in re.findall(r"\d+", version)[:2])


def load_tokenizer(
    model_name_or_path: str, *, tokenizer_name_or_path: str | None, chat_template_format: str, trust_remote_code: bool
):
    """Load the tokenizer and apply the chat template format; return (tokenizer, ids of tokens it added)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(
        tokenizer_name_or_path or model_name_or_path, trust_remote_code=trust_remote_code
    )
    new_ids = setup_tokenizer(tok, chat_template_format)
    return tok, list(new_ids)


def bnb_config(
    *, use_4bit: bool, use_8bit: bool, quant_type: str, compute_dtype_name: str, nested: bool, storage_dtype_name: str
):
    """A BitsAndBytesConfig for a 4-bit or 8-bit base, or None."""
    if not (use_4bit or use_8bit):
        return None
    from transformers import BitsAndBytesConfig

    if use_8bit:
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=quant_type,
        bnb_4bit_compute_dtype=_named_dtype(compute_dtype_name, "--bnb_4bit_compute_dtype"),
        bnb_4bit_use_double_quant=nested,
        bnb_4bit_quant_storage=_named_dtype(storage_dtype_name, "--bnb_4bit_quant_storage_dtype"),
    )


def _named_dtype(name: str, flag: str) -> torch.dtype:
    dtype = dtypes.parse(name)
    if dtype is None:
        raise ValueError(f"{flag} {name!r} is not a dtype; use bfloat16, float16 or float32.")
    return dtype


def load_base_model(
    model_name_or_path: str,
    *,
    dtype: torch.dtype,
    attn_impl: str,
    trust_remote_code: bool,
    quantization_config=None,
    on_meta: bool = False,
    quantize_device: torch.device | None = None,
) -> nn.Module:
    """Load AutoModelForCausalLM in `dtype` (the frozen base is held in the compute dtype), or its skeleton on meta.

    A 4-bit base is quantized tensor by tensor while it is read (models.quant); 8-bit is refused by the config.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_name_or_path, trust_remote_code=trust_remote_code)
    attn_impl = family_attention(config, attn_impl)
    if quantization_config is not None and getattr(quantization_config, "load_in_4bit", False):
        check_4bit_layout(config)  # on every rank, before anything is read
        # Built here, filled (or left on meta) and quantized by shardtune.models.quant one tensor at a time.
        model = build_skeleton(config, dtype=dtype, attn_impl=attn_impl, trust_remote_code=trust_remote_code)
        quant.load_4bit_into(
            model,
            model_name_or_path,
            quantization_config=quantization_config,
            dtype=dtype,
            on_meta=on_meta,
            quantize_device=quantize_device,
        )
    elif on_meta:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(
                config, dtype=dtype, attn_implementation=attn_impl, trust_remote_code=trust_remote_code
            )
    else:
        model = AutoModelForCausalLM.from_pretrained(
            model_name_or_path,
            dtype=dtype,
            attn_implementation=attn_impl,
            trust_remote_code=trust_remote_code,
            quantization_config=quantization_config,
            low_cpu_mem_usage=True,
        )
    model.config.use_cache = False
    return model


@contextlib.contextmanager
def params_on_meta() -> Iterator[None]:
    """Create parameters on the meta device while modules compute their buffers (rotary frequencies) for real.

    Parameters are allocated, then moved to meta as they are registered, before any initializer touches them.
    """
    register = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None and not param.is_meta:
            kwargs = dict(param.__dict__) if type(param) is not nn.Parameter else {}
            module._parameters[name] = type(param)(param.to("meta"), requires_grad=param.requires_grad, **kwargs)

    nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def build_skeleton(config, *, dtype: torch.dtype, attn_impl: str, trust_remote_code: bool) -> nn.Module:
    """The model of a config with every parameter on meta (nothing read, nothing initialised) and real buffers."""
    from transformers import AutoModelForCausalLM

    attn_impl = family_attention(config, attn_impl)
    with params_on_meta():
        model = AutoModelForCausalLM.from_config(
            config, dtype=dtype, attn_implementation=attn_impl, trust_remote_code=trust_remote_code
        )
    return model


def check_4bit_layout(config, skeleton: nn.Module | None = None) -> None:
    """Refuse a family whose checkpoint the 4-bit loader cannot read: one whose tensors transformers merges while
    loading in any way but stacking experts (and concatenating gate and up), which models.quant_experts inverts;
    given the model's skeleton, also an experts module that computes outside transformers' experts interface."""
    from transformers.core_model_loading import WeightRenaming

    name = getattr(causal_lm_class(config), "__name__", config.model_type)
    for conv in layout_conversions(config):
        if isinstance(conv, WeightRenaming):
            continue
        if not stacked_experts(conv):
            raise ValueError(
                f"--use_4bit_quantization: {name} checkpoints store {_listed(conv.source_patterns)} that "
                f"transformers converts into {_listed(conv.target_patterns)} while loading in a way shardtune's "
                f"4-bit loader cannot invert. Train {name} without --use_4bit_quantization (LoRA, DoRA or full "
                "fine-tuning in bf16)."
            )
    if skeleton is not None:
        quant_experts.expert_parameters_4bit(skeleton)


def _listed(patterns) -> str:
    return ", ".join(patterns) if isinstance(patterns, list) else str(patterns)


# Set by resize_embeddings on every embedding that transformers' resize grew: its rows before. Gemma 3n's per-layer
# input embedding has fewer rows than the vocabulary (vocab_size_per_layer_input), and the resize grows it to the
# new vocabulary, so rows of old token ids are new there too and are trained and saved like the new tokens' rows.
BASE_ROWS_ATTR = "shardtune_base_rows"


def resize_embeddings(model: nn.Module, n_tokens: int) -> int:
    """Resize the embeddings to hold n_tokens, rounded up as the reference does (data.templates.padded_rows)."""
    current = model.get_input_embeddings().weight.shape[0]
    target = padded_rows(n_tokens)
    if n_tokens <= current:
        return current
    is_meta = model.get_input_embeddings().weight.is_meta
    before = {n: m.num_embeddings for n, m in model.named_modules() if isinstance(m, nn.Embedding)}
    # mean_resizing samples new rows from the old ones' distribution; on meta there is nothing to sample.
    model.resize_token_embeddings(target, mean_resizing=not is_meta)
    for name, module in model.named_modules():
        if isinstance(module, nn.Embedding) and before.get(name, module.num_embeddings) < module.num_embeddings:
            setattr(module, BASE_ROWS_ATTR, before[name])
    print0(f"Resized the embeddings from {current} to {target} rows for the chat template's tokens.")
    return target


def _target_modules(spec: str, model: nn.Module | None = None, experts_adapted: bool = False) -> str | list[str]:
    """all-linear (given the model: the module paths of shardtune.models.targets.plan_all_linear, said in the log), one
    regular expression (peft full-matches a string against module names), or a list of names."""
    names = [s.strip() for s in spec.split(",") if s.strip()]
    if names == ["all-linear"]:
        if model is None:
            return "all-linear"
        plan = targets.plan_all_linear(model)
        for line in plan.log_lines(experts_adapted):
            print0(line)
        return plan.paths or "all-linear"
    if len(names) == 1 and any(c in names[0] for c in "*+?[](){}|^$\\"):
        return names[0]
    return names


@quant_experts.expert_stand_ins
def attach_adapter(
    model: nn.Module,
    *,
    lora_r: int,
    lora_alpha: float,
    lora_dropout: float,
    target_modules: str,
    use_dora: bool,
    modules_to_save: str | None,
    new_token_ids: list[int],
    adapter_name: str = "default",
    adapter_path: str | None = None,
    target_parameters: str | None = None,
    target_experts: bool = False,
) -> nn.Module:
    """Wrap the base in a PEFT LoRA/DoRA adapter; rows of newly added tokens are trained as trainable tokens.

    target_parameters / target_experts: PEFT's target_parameters (expert tensors, router weights; see
    models.targets.plan_parameters). PEFT adapts a parameter as a weight delta, which has no input to drop, and
    refuses any lora_dropout then; so the adapter is made with none, and lora_dropout is put back on the linear
    layers' LoRA inputs (the saved adapter_config.json says 0.0, which is what PEFT needs to load it). 4-bit
    experts are modules, not parameters: PEFT wraps them as the 3-D parameters they stand for (expert_stand_ins)."""
    from peft import LoraConfig, PeftModel, get_peft_model

    if adapter_path:
        model = PeftModel.from_pretrained(model, adapter_path, adapter_name=adapter_name, is_trainable=True)
        print0(f"Continuing training of the adapter in {adapter_path}.")
        if model.peft_config[adapter_name].target_parameters:
            _linear_dropout(model, lora_dropout, adapter_name)
        return model
    plan = targets.plan_parameters(model, target_parameters, experts=target_experts)
    for line in plan.log_lines():
        print0(line)
    params = plan.names or None
    mts = [s.strip() for s in (modules_to_save or "").split(",") if s.strip()] or None
    problem = tied_head_saved_problem(model, mts, adds_rows=bool(new_token_ids))
    if problem:  # said by the preflight before loading when the chat format adds the rows; here for any other way
        raise ValueError(problem)
    tti = None
    if new_token_ids:
        tti = {name: sorted(set(new_token_ids) | set(grown)) for name, grown in _token_modules(model, mts).items()}
    cfg = LoraConfig(
        r=lora_r,
        lora_alpha=lora_alpha,
        lora_dropout=0.0 if params else lora_dropout,
        target_modules=_target_modules(target_modules, model, experts_adapted=targets.EXPERTS in plan.words),
        target_parameters=params,
        use_dora=use_dora,
        modules_to_save=mts,
        trainable_token_indices=tti or None,
        bias="none",
        task_type="CAUSAL_LM",
    )
    try:
        model = get_peft_model(model, cfg, adapter_name=adapter_name)
    except ValueError as e:
        if "not found in the base model" in str(e) or "Target modules" in str(e):
            raise ValueError(f"--lora_target_modules {target_modules!r} matched no module of the model: {e}") from e
        raise
    if params and lora_dropout:
        _linear_dropout(model, lora_dropout, adapter_name)
        print0(
            f"--lora_dropout {lora_dropout} acts on the linear layers' LoRA inputs; a parameter's LoRA (a weight "
            "delta) has no input to drop, and adapter_config.json records lora_dropout 0.0 so that PEFT loads it."
        )
    return model


def _linear_dropout(model: nn.Module, p: float, adapter_name: str) -> None:
    """Dropout p on the input of every linear layer's LoRA of `adapter_name` whose adapter was made without one
    (an adapter that also adapts parameters: see attach_adapter); parameter wrappers have no input to drop."""
    from peft.tuners.lora import LoraLayer, ParamWrapper

    if not p:
        return
    for module in model.modules():
        if isinstance(module, LoraLayer) and not isinstance(module, ParamWrapper):
            drops = module.lora_dropout
            if adapter_name in drops and isinstance(drops[adapter_name], nn.Identity):
                drops[adapter_name] = nn.Dropout(p)


def _token_modules(model: nn.Module, modules_to_save: list[str] | None) -> dict[str, range]:
    """Modules whose new-token rows must be trained, unless saved in full: the input embedding, every other
    embedding looked up by token id, and an untied output head; each with the rows its resize added (Gemma 3n's
    per-layer table: from vocab_size_per_layer_input on), which are trained with the new tokens' rows.

    Token-indexed embeddings besides the input one (Gemma 4's and Gemma 3n's per-layer input embeddings,
    embed_tokens_per_layer) are the nn.Embedding modules that have as many rows as the input embedding after the
    resize: transformers' resize_token_embeddings grows them with it. Left out, their new rows would be a random
    resize that the adapter does not save, and the reloaded model would differ from the trained one on new tokens."""
    tables: dict[str, range] = {}
    full = set(modules_to_save or [])
    emb = model.get_input_embeddings()
    emb_name = _module_name(model, emb)
    if emb_name and emb_name.split(".")[-1] not in full:
        tables[emb_name.split(".")[-1]] = range(0)
    for name, mod in model.named_modules():
        leaf = name.split(".")[-1]
        if mod is emb or not isinstance(mod, nn.Embedding) or leaf in full or leaf in tables:
            continue
        if mod.num_embeddings == emb.num_embeddings:
            tables[leaf] = range(getattr(mod, BASE_ROWS_ATTR, mod.num_embeddings), mod.num_embeddings)
    out = model.get_output_embeddings()
    tied = out is not None and out.weight is emb.weight
    if out is not None and not tied:
        out_name = _module_name(model, out)
        if out_name and out_name.split(".")[-1] not in full:
            tables[out_name.split(".")[-1]] = range(0)
    return tables


def _module_name(root: nn.Module, target: nn.Module) -> str | None:
    for name, mod in root.named_modules():
        if mod is target:
            return name
    return None


def decoder_block_classes(model: nn.Module, override: str | None = None) -> tuple[type, ...]:
    """The decoder block classes to shard one by one: FSDP_TRANSFORMER_CLS_TO_WRAP or the model's _no_split_modules."""
    names = [s.strip() for s in override.split(",")] if override else None
    if not names:
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        names = list(getattr(base, "_no_split_modules", None) or [])
    classes = {type(m) for m in model.modules() if type(m).__name__ in names}
    if not classes:
        raise ValueError(
            f"no module of the model is of a decoder block class {names}; set "
            "fsdp_transformer_layer_cls_to_wrap in the accelerate config to the block's class name."
        )
    return tuple(classes)


def count_parameters(model: nn.Module) -> tuple[int, int]:
    """(trainable, total) parameters; a packed 4-bit weight counts the values it stands for, not its bytes."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    for module in model.modules():
        shape = getattr(getattr(module, "quant_state", None), "shape", None)
        if shape is not None:
            total += math.prod(shape) - module.weight.numel()
    return trainable, total


class CausalLMForTraining(nn.Module):
    """Wraps a (PEFT) causal LM: runs the decoder, then the objective's head (shardtune.objectives.heads) on its
    output: the output head and the loss in chunks of positions, each chunk's logits recomputed in backward, so
    full fp32 [batch, seq, vocab] logits are never held.

    That fast path is used where it is the model's own function (shardtune.models.families checks it on a tiny copy of
    the config: the decoder it calls, the head's logit transform, per-document attention); elsewhere the model's
    own forward runs (full logits) and only the loss is chunked. `layout` forces one (the check passes its
    candidates); `packing`: whether rows hold several documents (None: maybe), which the fast path must keep
    apart to be chosen.

    Labels are already shifted (labels[i] is the target of position i; -100 means none). What forward returns is
    the objective's head's (shardtune.objectives.heads: the summed loss and the number of targets, so that the
    caller normalises over the whole global batch, or per-row log-probs); with `router_aux=True` also the forward's
    router load-balancing loss (models.router_aux; None without one).
    `router_aux_loss_coef` overrides the config's coefficient of that loss (None: the config's; 0: off).
    """

    def __init__(
        self,
        model: nn.Module,
        chunk_size: int = 1024,
        per_document_attention: bool = True,
        layout: families.Layout | None = None,
        packing: bool | None = None,
        router_aux_loss_coef: float | None = None,
        cp_varlen: bool = False,
    ):
        super().__init__()
        self.model = model
        self.chunk_size = chunk_size
        self.per_document_attention = per_document_attention  # see shardtune.models.fastpath
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        self.verdict = None
        if layout is None:
            self.verdict = families.verdict(base.config, base.config._attn_implementation, type(self))
            layout = self.verdict.layout(packing)
            if packing is not False and self.verdict.checked and not self.verdict.packing_ok(layout):
                # shardtune train refuses --packing here (builder.training_layout); a direct caller is told.
                warn0(f"{families.summary(self.verdict, layout, True)} Give it rows of one document each.")
        self.layout = layout
        # Plain attributes, not registered submodules: they are already registered under self.model.
        if layout.path == "fast":
            object.__setattr__(self, "_decoder", families.resolve_decoder(base, layout.decoder))
            # whether the family masks nothing beyond each document's causality (decided once: no row mask then)
            self._plain_mask = families.plain_causal(self._decoder.config)
        object.__setattr__(self, "_head", base.get_output_embeddings())
        # The family's logit transform (Granite's division by logits_scaling, a muP multiplier, Gemma's final
        # soft-capping, ...), read from the language model's config: a multimodal class loaded as a causal LM
        # (Gemma 3n and Gemma 4 are *ForConditionalGeneration) keeps it in its text_config.
        self._transform = families.head_transform(base.config, layout.head)
        self.router_aux = router_aux.family_router_aux(base, router_aux_loss_coef)  # None: a dense model
        # With context parallelism, the micro-batch's CPShard (set by shardtune.training.trainer before each
        # forward): the fast path's attention then gathers each row's keys and values over the cp ranks.
        self.cp_shard = None
        self.cp_varlen = cp_varlen  # the shard's attention as one flash-attention varlen call (modeling.py)

    @property
    def router_aux_loss_coef(self) -> float:
        """The coefficient of the router load-balancing loss in the SFT loss (0: none)."""
        return self.router_aux.coef if self.router_aux is not None else 0.0

    def hidden_states(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        return self._decode(input_ids, position_ids).last_hidden_state

    def _decode(self, input_ids: torch.Tensor, position_ids: torch.Tensor, **extra):
        # Compiled blocks take the masked path: spans that change every batch would recompile them.
        if self.cp_shard is not None:  # context parallelism: this rank's positions of each row
            extra[fastpath.DOCUMENTS_KWARG] = self.cp_shard
        elif self.per_document_attention and self._decoder.config._attn_implementation == fastpath.ATTENTION:
            extra[fastpath.DOCUMENTS_KWARG] = fastpath.packed_documents(position_ids)
        skip = fastpath.DOCUMENTS_KWARG in extra and self._plain_mask
        with fastpath.without_row_mask() if skip else contextlib.nullcontext():  # the attention reads no row mask
            return self._decoder(input_ids=input_ids, position_ids=position_ids, use_cache=False, **extra)

    def _outputs(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """Hidden states (fast path), or the own forward's logits, which the head then leaves as they are."""
        return self._outputs_and_aux(input_ids, position_ids, False)[0]

    def _outputs_and_aux(self, input_ids: torch.Tensor, position_ids: torch.Tensor, with_aux: bool, aux_mask=None):
        """(_outputs, the router load-balancing loss or None). The router logits come from the decoder's (or the
        own forward's) output with output_router_logits, as the family's forward reads them; asked for only when
        the term is on, so that a run without it computes exactly what it did before."""
        with_aux = with_aux and self.router_aux_loss_coef > 0
        extra = {"output_router_logits": True} if with_aux else {}
        if self.layout.path == "fast":
            out = self._decode(input_ids, position_ids, **extra)
            h = out.last_hidden_state
        else:
            out = self.model(input_ids=input_ids, position_ids=position_ids, use_cache=False, **extra)
            h = out.logits
        if not with_aux:
            return h, None
        logits = getattr(out, "router_logits", None)
        if self.cp_shard is not None and isinstance(logits, tuple) and logits:  # the whole rows' tokens
            mask = self.cp_shard.real() if aux_mask is None else aux_mask
            logits, aux_mask = self.cp_shard.gather_tokens(logits, mask)
        return h, self.router_aux(logits, aux_mask)

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        labels: torch.Tensor,
        *,
        head,
        router_aux: bool = False,
        aux_mask: torch.Tensor | None = None,
    ):
        """What the objective's `head` (shardtune.objectives.heads) computes from the decoder's output and the
        labels, inside the root's forward so that FSDP's hooks run; with router_aux, the router load-balancing loss
        (over aux_mask's tokens, or all) appended."""
        h, aux = self._outputs_and_aux(input_ids, position_ids, router_aux, aux_mask)
        out = head(self, h, labels)
        return (*out, aux) if router_aux else out

    def chunk_logits(self, h: torch.Tensor) -> torch.Tensor:
        """The family's fp32 logits of a chunk of hidden states, as its own forward computes them (the head's
        logit transform verified by shardtune.models.families): the one place every loss gets its logits from. On the
        own-forward path `h` already holds the model's logits."""
        if self.layout.path != "fast":
            return h.float()
        return self._transform(self._head(h).float())

    def logits(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """The fp32 logits the loss sees, [batch, seq, vocab] (the conformance check compares them with the
        model's own forward's)."""
        if hasattr(self, "unshard"):
            # Sharded root: calling the decoder directly skips the root's FSDP hooks, so gather its weights here.
            self.unshard()
        return self.chunk_logits(self._outputs(input_ids, position_ids))
