"""The profile schema: one strict pydantic model shared by every command.

The schema is the documentation: every field has a one-line docstring, bounds and
literal choices. Defaults are the adapter-first method's recommended values. Nothing here imports
torch. Cross-field rules live in ``model_validator(mode="after")`` and name the YAML key
and the fix.

No ``from __future__ import annotations``: pydantic would compile every field's annotation string when it
builds the models, on every run; evaluated where they stand, they come with the module's bytecode.
"""

import ast
import inspect
from functools import cache
from pathlib import Path
from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from orbitctl.profile.gpus import resolve_gpu, unknown_gpu_message
from orbitctl.units import GiB


class Section(BaseModel):
    """Every model of the profile: unknown keys are errors, assignments are validated.

    The fields' docstrings become their ``description`` on demand (:func:`describe_fields`), not at
    import: pydantic's ``use_attribute_docstrings`` reads and parses every class's source when the class
    is built, most of this module's import time, and only the profile reference reads them."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


@cache
def describe_fields() -> None:
    """Set every profile field's ``description`` to the docstring under it, as ``use_attribute_docstrings``
    would, parsing this file once; the profile reference (docs/profiles.md) calls it before reading them."""
    models = {name: obj for name, obj in globals().items() if isinstance(obj, type) and issubclass(obj, Section)}
    for node in ast.parse(Path(__file__).read_text(encoding="utf-8")).body:
        if isinstance(node, ast.ClassDef) and node.name in models:
            fields = models[node.name].model_fields
            for name, doc in _attribute_docs(node).items():
                if name in fields and fields[name].description is None:
                    fields[name].description = doc


def _attribute_docs(cls: ast.ClassDef) -> dict[str, str]:
    """``{field: docstring}`` of a class body: a string literal right after an annotated assignment."""
    docs = {}
    for before, node in zip(cls.body, cls.body[1:]):
        if (isinstance(before, ast.AnnAssign) and isinstance(before.target, ast.Name) and isinstance(node, ast.Expr)
                and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)):
            docs[before.target.id] = inspect.cleandoc(node.value.value)
    return docs


class ModelSection(Section):
    arch: str | None = None
    """Built-in architecture name (see `orbitctl plan --list-archs`), e.g. kimi-k2, llama-3.1-8b, tiny-llama."""
    config: str | None = None
    """Path to a Hugging Face config.json for an architecture not in the catalog; unset, the config.json in model.path is read."""
    path: str | None = None
    """Hugging Face checkpoint directory (safetensors) or .gguf file to quantize and train from, or pkg:PACKAGE/PATH inside an installed package; alone, its config.json (a GGUF: its metadata) gives the architecture."""
    quantized_path: str | None = None
    """Directory of the frozen quantized base written by `orbitctl quantize`."""
    dtype: Literal["bf16", "fp16", "fp32"] = "bf16"
    """Dtype of the weights that stay unquantized (embeddings, norms, router, lm_head)."""

    @model_validator(mode="after")
    def _one_source(self) -> "ModelSection":
        if self.arch and self.config:
            raise ValueError("set either model.arch or model.config, not both")
        if not self.arch and not self.config and not self.path:
            raise ValueError("set model.arch (a built-in name), model.config (path to config.json) "
                             "or model.path (a checkpoint directory with its config.json)")
        return self

    @field_validator("arch")
    @classmethod
    def _known_arch(cls, value: str | None) -> str | None:
        if value is None:
            return value
        from orbitctl.arch.catalog import builtin_names, resolve_name

        resolved = resolve_name(value)
        if resolved is None:
            import difflib

            close = difflib.get_close_matches(value.lower(), builtin_names(), n=1)
            hint = f"; did you mean '{close[0]}'?" if close else f"; known: {', '.join(builtin_names())}"
            raise ValueError(f"unknown architecture '{value}'{hint}")
        return resolved


class HardwareSection(Section):
    gpu: str = "h200"
    """GPU model from the catalog: a100-40g, a100-80g, h100-80g (SXM), h100-pcie, h100-nvl, h800, h20, h200, b200, mi300x, l4, a10g, l40s, rtx6000-ada, rtx4090, rtx3090, cpu; another card: the closest of them plus gpu_memory_gib."""
    gpus_per_node: int = Field(8, ge=1, le=16)
    """GPUs used on the node (ranks per node)."""
    nodes: int = Field(1, ge=1, le=1024)
    """Number of nodes."""
    host_ram_gib: float = Field(2048, gt=0)
    """Host RAM per node, GiB (offloaded activations and optimizer state live here)."""
    gpu_memory_gib: float | None = Field(None, gt=0)
    """Override the catalog's per-GPU memory (GiB), e.g. with the free memory seen right now."""
    price_per_gpu_hour: float | None = Field(None, ge=0)
    """USD per GPU-hour (optional): `orbitctl plan` prices a step and the run with it; unset gives GPU-hours only."""
    calibration: str | None = None
    """A calibration file (``orbitctl plan PROFILE --calibrate``): rates measured on this GPU kind, used by the time
    model instead of the published ones (docs/plan.md, "Calibration"). Checked when the profile loads."""

    @field_validator("calibration")
    @classmethod
    def _calibration_file(cls, value: str | None) -> str | None:
        if value is not None:
            from orbitctl.profile.calibration import read_calibration

            try:
                read_calibration(value)
            except ValueError as err:  # missing, unreadable or malformed
                raise ValueError(f"the calibration file {err}") from None
        return value

    def memory_bytes(self) -> int:
        """Per-GPU memory the plan budgets from: ``gpu_memory_gib`` when set, else the catalog's visible bytes."""
        if self.gpu_memory_gib:
            return int(self.gpu_memory_gib * GiB)
        return resolve_gpu(self.gpu).visible_bytes

    @field_validator("gpu")
    @classmethod
    def _known_gpu(cls, value: str) -> str:
        spec = resolve_gpu(value)
        if spec is None:
            raise ValueError(unknown_gpu_message(value))
        return spec.name


class QuantSection(Section):
    format: Literal["nf4", "fp4", "int4", "fp8", "none"] = "int4"
    """Storage format of the frozen base: nf4/fp4 (bitsandbytes), int4 (group-wise, compressed-tensors), fp8 (e4m3, 128x128 blocks), none (bf16)."""
    group_size: int = Field(64, ge=16, le=1024)
    """Weights per scale: bnb block size for nf4/fp4 (64), INT4 group (32/64/128). FP8 always uses 128x128 blocks."""
    double_quant: bool = True
    """nf4/fp4: quantize the absmax scales again to 8 bits (4.127 instead of 4.5 bits per weight)."""
    compute_dtype: Literal["bf16", "fp16", "fp32", "auto"] = "bf16"
    """Dtype the quantized weights are dequantized to for the matmul; auto = bf16 on a GPU, on the CPU bf16 if it runs bf16 natively (AVX512-BF16/AMX), else fp32."""
    storage_dtype: Literal["uint8", "bf16"] = "bf16"
    """nf4/fp4: dtype of the packed storage tensor; bf16 lets ZeRO-3 shard it like any parameter."""
    modules: Literal["all-linear", "experts"] = "all-linear"
    """Which linear layers are quantized: every linear layer, or only the routed experts (Kimi-K2-Thinking's layout)."""
    skip: list[str] = Field(default_factory=lambda: ["lm_head"])
    """Module-name substrings kept in bf16 in addition to embeddings, norms and router gates."""
    kernel: Literal["auto", "fused", "dequantize"] = "auto"
    """INT4 matmuls: fused runs PyTorch's weight-only INT4 kernel on the packed codes (bf16 activations, no dense weight written; the CPU's, or CUDA's tinygemm), and on an NVIDIA GPU with Triton the routed experts of a MoE layer as one grouped INT4 kernel per projection; dequantize writes each weight as a dense matrix first; auto = fused where a once-per-process probe finds the kernel's rows independent of the rows beside them. Every path (rollout, train, reference) computes with the same kernel; the backward always dequantizes."""

    @model_validator(mode="after")
    def _group(self) -> "QuantSection":
        if self.format == "int4" and self.group_size not in (32, 64, 128):
            raise ValueError("quant.group_size: int4 supports 32, 64 or 128")
        if self.kernel == "fused" and self.format != "int4":
            raise ValueError(f"quant.kernel: fused runs INT4 weights and quant.format is {self.format} "
                             "(set quant.kernel: auto, or quant.format: int4)")
        if self.format in ("nf4", "fp4") and self.group_size not in (32, 64, 128, 256, 512, 1024, 2048, 4096):
            raise ValueError("quant.group_size: bitsandbytes block size must be a power of two from 32 to 4096 (default 64)")
        return self


class AdapterSection(Section):
    kind: Literal["lora", "bottleneck"] = "lora"
    """LoRA through PEFT, or the bottleneck adapter up(relu(down(x))) + x after each layer's MLP."""
    rank: Union[int, Literal["auto"]] = 256
    """LoRA rank or bottleneck dim; 'auto' = hidden_size / 10."""
    alpha: float | None = Field(None, gt=0)
    """LoRA alpha; unset means 2 x rank."""
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    """LoRA dropout; > 0 keeps an extra copy of every adapted layer's input for backward."""
    targets: Union[Literal["all-linear", "attention", "attention+mlp", "attention+shared"], list[str]] = "attention+shared"
    """Modules that get adapters: a preset or a list of module-name suffixes (q_proj, o_proj, ...)."""
    dtype: Literal["bf16", "fp32", "auto"] = "bf16"
    """Adapter weight dtype (BF16 keeps activations small; optimizer master copy is fp32 either way); auto follows the same rule as quant.compute_dtype: auto."""
    experts: Literal["none", "shared", "shared-outer", "per-expert"] = "none"
    """LoRA on the routed experts over their frozen INT4/FP8 weights, computed on the routed tokens, never merged: per-expert factors, shared-outer (the hidden-side factor shared by a layer's experts, the expert-side one per expert) or one shared adapter per layer; none leaves them unadapted (docs/adapters.md)."""
    experts_rank: Union[int, Literal["auto"]] = "auto"
    """Rank of the routed-expert adapters; auto is adapter.rank."""
    last_layers: int | None = Field(None, ge=1)
    """Adapt only the last N decoder layers; unset = every layer. The update's backward stops at the first adapted layer: the layers below run forward only, keep no activations and get no gradient (docs/adapters.md)."""

    @model_validator(mode="after")
    def _experts_fit_the_kind(self) -> "AdapterSection":
        if self.experts != "none" and self.kind != "lora":
            raise ValueError(f"experts: {self.experts} adapts the routed experts with LoRA; kind is {self.kind} "
                             "(set adapter.experts: none, or adapter.kind: lora)")
        if self.experts != "none" and self.targets in ("attention+mlp", "all-linear"):
            raise ValueError(f"experts: {self.experts} gives the routed experts their own adapters, and targets: "
                             f"{self.targets} adapts them too (set adapter.targets: attention+shared)")
        if self.experts == "none" and self.experts_rank != "auto":
            raise ValueError(f"experts_rank: {self.experts_rank} is the rank of the routed experts' adapters, and "
                             "experts is none (set adapter.experts, or drop experts_rank)")
        return self

    @field_validator("rank", "experts_rank")
    @classmethod
    def _rank(cls, value: int | str) -> int | str:
        if isinstance(value, int) and value < 1:
            raise ValueError("must be >= 1 or 'auto'")
        return value


class MemorySection(Section):
    zero_stage: Literal[0, 1, 2, 3] = 3
    """DeepSpeed ZeRO stage: 1 shards optimizer state, 2 also gradients, 3 also parameters (the frozen base)."""
    gradient_checkpointing: bool = True
    """Recompute each layer in backward; keeps only the per-layer boundary tensor."""
    keep_frozen_outputs: bool = False
    """With gradient_checkpointing: also keep the outputs of the frozen base's matmuls, so a layer's recompute runs
    only its cheap ops (norms, attention, activations, the adapters) and not the base's GEMMs again; costs tokens x the
    frozen linear layers' output features x 2 bytes per checkpointed layer, which the plan counts."""
    offload_activations: Literal["none", "cpu"] = "none"
    """Move the checkpointed per-layer boundaries to host RAM (needs gradient_checkpointing): train saves each
    checkpointed layer's input in pinned host memory, copied on a side stream on CUDA, and brings it back for the
    layer's recompute; the bytes moved are the step metric offload_bytes."""
    offload_optimizer: Literal["none", "cpu"] = "none"
    """Keep fp32 master weights and Adam states in host RAM (ZeRO-Offload)."""
    offload_params: Literal["none", "cpu"] = "none"
    """Keep the ZeRO-3 parameter shards (the frozen base's packed storage) in pinned host RAM, copied to the GPU
    as each module is gathered (DeepSpeed's offload_param, ZeRO-Infinity); needs zero_stage 3."""
    micro_batch_size: int = Field(8, ge=1, le=4096)
    """Sequences per GPU per forward/backward."""
    gradient_accumulation_steps: int = Field(16, ge=1, le=65536)
    """Micro-batches accumulated per optimizer step."""
    seq_len: int = Field(4096, ge=8, le=1_048_576)
    """Tokens per training sequence (prompt + response)."""
    max_hbm_utilization: float = Field(0.90, gt=0.1, le=1.0)
    """Fraction of each GPU's memory the plan may use; the rest is allocator headroom."""
    flash_attention: bool = True
    """A flash-style attention kernel (no seq^2 score matrix kept): train loads the model with PyTorch SDPA;
    false loads eager attention, whose fp32 score matrix the plan then counts."""
    loss_chunk_size: int = Field(0, ge=0)
    """Tokens per chunk of the lm_head + loss; 0 computes the logits of the whole micro-batch at once. Train runs
    the output layer, log-softmax, sampled-token log-probs, entropy and every loss term this many positions at a
    time, each chunk recomputed in backward, so no [tokens, vocab] tensor larger than one chunk is alive."""
    expert_parallel: int = Field(1, ge=1)
    """Expert-parallel degree P: each rank of an EP group holds 1/P of every MoE layer's routed experts (never
    gathered) and tokens travel to their experts' owners by all-to-all; 1 = no expert parallelism."""
    dense_layout: Literal["auto", "replicated", "sharded"] = "auto"
    """Where the frozen base's dense part (attention, shared experts, dense layers, embeddings, lm_head) lives:
    a full copy per rank, or ZeRO-3 partitions gathered layer by layer; auto = sharded under zero_stage 3, else replicated."""
    prefetch_layers: int = Field(1, ge=0, le=8)
    """ZeRO-3 layers gathered ahead of the current one: train sets stage3_prefetch_bucket_size to N and
    stage3_max_live_parameters to 1 + N of its largest decoder layer's gathered elements; 0 = one layer at a time.
    Only zero_stage 3 gathers (train refuses another value below it)."""

    @model_validator(mode="after")
    def _consistent(self) -> "MemorySection":
        if self.offload_activations == "cpu" and not self.gradient_checkpointing:
            raise ValueError(
                "memory.offload_activations: 'cpu' needs memory.gradient_checkpointing: true "
                "(only checkpointed layer boundaries can be offloaded)"
            )
        if self.keep_frozen_outputs and not self.gradient_checkpointing:
            raise ValueError("memory.keep_frozen_outputs: true needs memory.gradient_checkpointing: true "
                             "(without checkpointing every output is kept already)")
        if self.keep_frozen_outputs and self.offload_activations == "cpu":
            raise ValueError("memory.keep_frozen_outputs: true keeps its outputs on the device; with "
                             "memory.offload_activations: 'cpu' use one or the other")
        if self.offload_params == "cpu" and self.zero_stage != 3:
            raise ValueError("memory.offload_params: 'cpu' needs memory.zero_stage: 3")
        if self.offload_optimizer == "cpu" and self.zero_stage == 0:
            raise ValueError("memory.offload_optimizer: 'cpu' needs memory.zero_stage >= 1")
        if self.dense_layout == "sharded" and self.zero_stage != 3:
            raise ValueError("memory.dense_layout: 'sharded' needs memory.zero_stage: 3 (ZeRO-3 partitions the parameters)")
        if self.dense_layout == "replicated" and self.zero_stage == 3:
            raise ValueError("memory.dense_layout: 'replicated' needs memory.zero_stage <= 2 (ZeRO-3 partitions every "
                             "parameter it is given); use auto or sharded with zero_stage 3")
        return self

    @property
    def resolved_dense_layout(self) -> str:
        """``dense_layout`` with auto resolved: sharded under ZeRO-3, else replicated."""
        if self.dense_layout != "auto":
            return self.dense_layout
        return "sharded" if self.zero_stage == 3 else "replicated"


class AlignLoss(Section):
    kind: Literal["kl", "none"] = "kl"
    """Penalty between the train-path and infer-path distributions."""
    weight: float = Field(0.1, ge=0.0)
    """Weight of the train/infer KL in the loss (the method's recommended 0.1)."""

    @property
    def active(self) -> bool:
        """The loss has the train/infer KL term."""
        return self.kind == "kl" and self.weight > 0


class ISCorrection(Section):
    kind: Literal["none", "tis", "icepop"] = "tis"
    """Importance-sampling correction for the rollout/train mismatch: truncated IS (cap) or IcePop masking."""
    cap: float = Field(2.0, gt=0.0)
    """TIS: importance ratios above this are truncated."""
    low: float = Field(0.5, gt=0.0)
    """IcePop: tokens with ratio below this get no gradient."""
    high: float = Field(5.0, gt=0.0)
    """IcePop: tokens with ratio above this get no gradient."""

    @model_validator(mode="after")
    def _band(self) -> "ISCorrection":
        if self.low >= self.high:
            raise ValueError("rl.is_correction.low must be below rl.is_correction.high")
        return self


class RLSection(Section):
    algorithm: Literal["grpo", "ppo"] = "grpo"
    """GRPO (group-normalised advantages) or PPO-clip."""
    group_size: int = Field(8, ge=1, le=1024)
    """Completions sampled per prompt (G)."""
    prompts_per_step: int = Field(32, ge=1)
    """Prompts per optimizer step (each gives group_size completions)."""
    steps: int = Field(1000, ge=1)
    """Optimizer steps in the run."""
    lr: float = Field(1.0e-5, gt=0.0, le=1.0)
    """Peak learning rate of the adapter AdamW."""
    weight_decay: float = Field(0.0, ge=0.0)
    """AdamW weight decay on adapter weights."""
    warmup_steps: int = Field(1000, ge=0)
    """Linear warmup steps."""
    lr_schedule: Literal["constant", "cosine"] = "constant"
    """Schedule after warmup."""
    grad_clip: float = Field(1.0, ge=0.0)
    """Clip the global gradient norm to this; 0 disables."""
    clip_eps: float = Field(0.2, gt=0.0, lt=1.0)
    """PPO/GRPO ratio clip epsilon."""
    ppo_epochs: int = Field(1, ge=1, le=64)
    """Inner epochs over each rollout batch."""
    minibatches: int = Field(1, ge=1, le=1024)
    """Minibatches per inner epoch."""
    std_normalize: bool = True
    """GRPO: divide group-centred rewards by the group standard deviation."""
    kl_ref_coef: float = Field(0.0, ge=0.0)
    """KL to the reference policy (the base with adapters disabled); 0 skips the reference pass."""
    align_loss: AlignLoss = Field(default_factory=AlignLoss)
    """Train/infer alignment loss."""
    is_correction: ISCorrection = Field(default_factory=ISCorrection)
    """Rollout/train mismatch correction."""
    max_nonfinite_steps: int = Field(3, ge=1)
    """Stop after this many consecutive updates with a non-finite loss or gradient."""
    router_replay: bool = False
    """MoE: the update runs each sampled token through the experts the rollout routed it to (R3); gate weights
    from the update's own router logits over that set. The step reports routing agreement either way."""

    @model_validator(mode="after")
    def _group(self) -> "RLSection":
        if self.algorithm == "grpo" and self.group_size < 2:
            raise ValueError("rl.group_size: GRPO needs at least 2 completions per prompt to normalise within a group")
        return self


class RolloutSection(Section):
    max_new_tokens: int = Field(1024, ge=1)
    """Longest completion sampled."""
    temperature: float = Field(1.0, ge=0.0, le=10.0)
    """Sampling temperature; 0 is greedy."""
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    """Nucleus sampling mass."""
    batch_size: Union[Annotated[int, Field(ge=1)], Literal["auto"], None] = None
    """Sequences decoded at once per GPU; unset = micro_batch_size x group_size; auto = the most whose rollout phase
    fits the GPU by the plan (KV cache, prefill, routing record), at most the step's sequences per GPU."""
    kv_dtype: Literal["bf16", "fp8"] = "bf16"
    """KV-cache dtype of the inference path: fp8 keeps K/V (MLA: the latent) in float8 e4m3 with one fp32 scale
    per token and KV head, on the infer path of train, verify-alignment, eval and serve."""
    decode_graphs: Union[bool, Literal["auto"]] = "auto"
    """true/auto: on a CUDA GPU the infer path decodes on a static KV cache and replays each step from a CUDA graph
    (one launch a token instead of one per op; needs kv_dtype bf16); false: eager decode. auto decodes eagerly where
    graphs do not apply (CPU, fp8 KV); true is refused there."""
    continuous_batching: Union[bool, Literal["auto"]] = "auto"
    """true/auto: the rollout (and eval's sampling) decodes at most batch_size sequences at once and gives a finished
    sequence's slot to the next waiting one, prefilled then, instead of decoding fixed batches until their longest
    row ends; auto streams wherever the decode is eager (not under rollout.decode_graphs), and true makes
    decode_graphs auto decode eagerly. Equal to fixed batches when every completion runs max_new_tokens."""
    engine: Literal["shared", "separate", "http"] = "shared"
    """shared: rollout uses the trainer's own weights (orbitctl's infer path); separate: a colocated engine holds its
    own copy (plan models it); http: an inference engine behind HTTP (vLLM, SGLang or ``orbitctl serve``) samples
    every rollout with the adapter hot-loaded each step."""
    engine_url: str | None = None
    """The http engine to attach to (``http://HOST:PORT``); unset = train starts ``orbitctl serve`` on loopback."""
    engine_api: Literal["vllm", "sglang"] = "vllm"
    """How the http engine is called: vLLM's OpenAI API and ``/v1/load_lora_adapter``, or SGLang's native
    ``/generate`` and ``/load_lora_adapter`` (``orbitctl serve`` speaks both)."""
    engine_timeout_s: float = Field(120.0, gt=0.0, le=3600.0)
    """Longest wait for one answer of the http engine."""
    engine_retries: int = Field(3, ge=0, le=10)
    """Retries of a failed http engine call (connection, timeout, 5xx, malformed answer), with backoff."""
    engine_tp: int = Field(1, ge=1)
    """Tensor-parallel size of a separate engine (MLA KV is replicated on every TP rank)."""
    engine_sleep: bool = True
    """A separate engine releases its weights and KV while the trainer updates (vLLM sleep mode)."""
    max_turns: int = Field(1, ge=1, le=64)
    """Actions per episode of a multi-turn rollout (data.train: env:NAME); 1 without an environment."""

    @model_validator(mode="after")
    def _http_engine(self) -> "RolloutSection":
        # values other than the defaults: a profile dumped whole (every field set) still loads
        given = [k for k in ("engine_url", "engine_api", "engine_timeout_s", "engine_retries")
                 if getattr(self, k) != type(self).model_fields[k].default]
        if self.engine != "http" and given:
            raise ValueError(f"rollout.{given[0]}: configures an http engine, and rollout.engine is {self.engine}; "
                             "set rollout.engine: http or remove it")
        url = self.engine_url
        if url is not None and not (url.startswith(("http://", "https://")) and len(url.split("://", 1)[1]) > 0):
            raise ValueError(f"rollout.engine_url: {url!r} is not an http(s) URL; e.g. http://127.0.0.1:8000")
        return self


class DataSection(Section):
    train: str = "builtin:digit-sum"
    """Training prompts: a data file (.jsonl, .jsonl.gz, .json, .parquet, .arrow or a save_to_disk directory),
    builtin:NAME, or env:NAME (episodes of an environment, rollout.max_turns turns: env:guess, env:textworld)."""
    eval: str | None = None
    """Held-out prompts (a data file or builtin:NAME); unset = a held-out split of train."""
    format: Literal["auto", "prompt", "gsm8k", "math", "humaneval", "messages"] = "auto"
    """Field layout of the data files; auto = detected from the first record's keys."""
    chat_template: bool = False
    """Apply the tokenizer's chat template to each prompt (a plain prompt becomes one user message)."""
    system_prompt: str | None = None
    """A system turn put before every prompt under the chat template (a chat record's own system turn wins); unset = the template's default, if it has one."""
    eval_fraction: float = Field(0.1, ge=0.0, lt=1.0)
    """Share of train held out for evaluation when eval is unset."""
    eval_size: int = Field(64, ge=1)
    """Held-out prompts scored per evaluation."""
    reward: str = "builtin"
    """Reward: math, code, builtin (the task's own) or python:module:function."""

    @model_validator(mode="after")
    def _system_prompt_needs_the_template(self) -> "DataSection":
        if self.system_prompt is not None and not self.chat_template:
            raise ValueError("system_prompt: a system turn goes through the tokenizer's chat template, and "
                             "chat_template is false (set data.chat_template: true, or remove data.system_prompt)")
        return self

    @model_validator(mode="after")
    def _format_needs_a_file(self) -> "DataSection":
        files = [value for value in (self.train, self.eval) if value and not value.startswith(("builtin:", "env:"))]
        if self.format != "auto" and not files:
            raise ValueError(f"data.format: '{self.format}' applies to data files, and data.train/data.eval name "
                             "builtin tasks or environments; remove data.format or set data.train to a data file")
        return self


class AlignmentSection(Section):
    js_max: float = Field(0.05, gt=0.0, le=0.7)
    """Gate: mean Jensen-Shannon divergence between train and infer distributions."""
    logit_l1_max: float = Field(0.1, gt=0.0)
    """Gate: mean L1 distance between train and infer log-softmax vectors."""
    entropy_window: int = Field(100, ge=2)
    """Steps over which entropy stability is judged."""
    entropy_fluctuation_max: float = Field(0.05, gt=0.0, le=1.0)
    """Gate: relative entropy fluctuation within the window."""
    top_k: int = Field(5, ge=1, le=1000)
    """k for top-k agreement."""
    top_k_agreement_min: float = Field(0.9, ge=0.0, le=1.0)
    """Gate: mean share of the top-k tokens the two paths have in common."""
    top1_agreement_min: float = Field(0.95, ge=0.0, le=1.0)
    """Gate: share of positions where both paths put the same token first."""
    k3_kl_warn: float = Field(1e-3, gt=0.0)
    """Warning level: mean sampled-token k3 estimate of KL(infer || train)."""
    prob_diff_warn: float = Field(0.005, gt=0.0)
    """Warning level: mean |p_train - p_infer| of the sampled token."""
    num_prompts: int = Field(32, ge=1)
    """Prompts used by verify-alignment."""


class RunSection(Section):
    dir: str | None = None
    """Run directory; unset = runs/<name>."""
    seed: int = Field(0, ge=0)
    """Seed for data order, sampling and adapter init."""
    save_every: int = Field(50, ge=1)
    """Optimizer steps between checkpoints."""
    keep_last: int = Field(3, ge=1)
    """Checkpoints kept."""
    log_every: int = Field(1, ge=1)
    """Steps between live-view updates."""
    eval_every: int = Field(50, ge=1)
    """Steps between held-out greedy evaluations."""
    loggers: list[Literal["tensorboard", "wandb", "mlflow"]] = Field(default_factory=list)
    """Experiment trackers train also sends each step's metrics to, offline, inside the run directory: tensorboard (event files), wandb (an offline run), mlflow (a local SQLite store); each needs its package (pip install 'orbitctl[loggers]')."""

    @field_validator("loggers")
    @classmethod
    def _each_logger_once(cls, value: list[str]) -> list[str]:
        twice = sorted({name for name in value if value.count(name) > 1})
        if twice:
            raise ValueError(f"{', '.join(twice)} listed more than once; name each logger once")
        return value


class Profile(Section):
    """One RL post-training setup: model, machine, method. Every command reads it."""

    name: str = Field("unnamed", min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._+-]+$")
    """Profile name; names the run directory."""
    model: ModelSection
    """What is trained."""
    hardware: HardwareSection = Field(default_factory=HardwareSection)
    """Where it runs."""
    quant: QuantSection = Field(default_factory=QuantSection)
    """How the frozen base is stored."""
    adapter: AdapterSection = Field(default_factory=AdapterSection)
    """What is trained on top of it."""
    memory: MemorySection = Field(default_factory=MemorySection)
    """Sharding, checkpointing, offload, batch."""
    rl: RLSection = Field(default_factory=RLSection)
    """The update."""
    rollout: RolloutSection = Field(default_factory=RolloutSection)
    """Sampling."""
    data: DataSection = Field(default_factory=DataSection)
    """Prompts and rewards."""
    alignment: AlignmentSection = Field(default_factory=AlignmentSection)
    """Train/infer alignment gates."""
    run: RunSection = Field(default_factory=RunSection)
    """Run directory, checkpoints, logging."""

    @model_validator(mode="after")
    def _cross(self) -> "Profile":
        if self.memory.offload_params == "cpu" and self.memory.offload_optimizer != "cpu":
            raise ValueError(
                "memory.offload_params: 'cpu' without memory.offload_optimizer: 'cpu' keeps optimizer state "
                "on the GPU while parameters are offloaded; set memory.offload_optimizer: cpu"
            )
        world = self.hardware.gpus_per_node * self.hardware.nodes
        if world % self.memory.expert_parallel:
            raise ValueError(f"memory.expert_parallel: {self.memory.expert_parallel} does not divide the "
                             f"{world} ranks (hardware.gpus_per_node x hardware.nodes); use a divisor of {world}")
        return self

    # Derived values: computed, never configured.
    @property
    def world_size(self) -> int:
        return self.hardware.gpus_per_node * self.hardware.nodes

    @property
    def global_batch_size(self) -> int:
        """Sequences per optimizer step across all ranks."""
        return self.memory.micro_batch_size * self.memory.gradient_accumulation_steps * self.world_size

    @property
    def run_dir(self) -> str:
        return self.run.dir or f"runs/{self.name}"

    @property
    def rollout_batch_size(self) -> int:
        """Sequences decoded at once per GPU; ``rollout.batch_size: auto`` is resolved by the plan first
        (:func:`orbitctl.plan.resolve_rollout_batch`)."""
        if self.rollout.batch_size == "auto":
            raise ValueError("rollout.batch_size: auto is resolved by orbitctl.plan.resolve_rollout_batch first")
        return self.rollout.batch_size or self.memory.micro_batch_size * self.rl.group_size

    def derived(self) -> dict:
        """Values that follow from the profile, shown by `orbitctl profile show`."""
        mem = self.hardware.memory_bytes()
        return {
            "world_size": self.world_size,
            "global_batch_size": self.global_batch_size,
            "rollout_batch_size": "auto (orbitctl plan computes it)" if self.rollout.batch_size == "auto"
            else self.rollout_batch_size,
            "adapter_alpha": self.adapter.alpha if self.adapter.alpha is not None else (
                2 * self.adapter.rank if isinstance(self.adapter.rank, int) else "2 x rank"),
            "gpu_memory_bytes": int(mem),
            "usable_bytes_per_gpu": int(mem * self.memory.max_hbm_utilization),
            "run_dir": self.run_dir,
        }
