"""`orbitctl profile init MODEL --gpu NAME --gpus N --out FILE`: a commented profile the plan says fits.

    from orbitctl.plan.profile_init import init_profile
    done = init_profile("/models/Qwen2.5-7B-Instruct", gpu="h100", gpus=8, out="qwen7b.yaml",
                        data="data/gsm8k_train.jsonl")
    done.verdict, done.choices      # 'FITS: ...', {"quant.format": ("fp8", "why"), ...}

MODEL is what train would read: a Hugging Face checkpoint directory, its config.json (the directory holding it is
the checkpoint), a GGUF file, or ``pkg:PACKAGE/PATH``. A Hub id (``org/name`` that is not a local path) is refused
with the download to run first: orbitctl reads local files only.

Every choice comes from the plan of the profile being written, in this order, each with the reason written beside
it in the file:

1. ``adapter.rank``: the largest of :data:`RANKS` whose trainable parameters stay within :data:`TRAINABLE_SHARE` of
   the model's (the smallest otherwise);
2. the layout: one GPU trains with plain AdamW (``zero_stage: 0``); several shard the frozen base, gradients and
   optimizer state (ZeRO-3), and a mixture-of-experts model splits its routed experts over the ranks
   (``expert_parallel``, the most ranks that divide the experts evenly);
3. ``quant.format``: the first of :data:`FORMATS` (most precise and fastest first) whose largest fitting
   micro-batch reaches :data:`GOOD_MICRO_BATCH`, else the one that fits most; with none fitting one sequence,
   optimizer state and activations move to host RAM, and a model that fits in no way is refused naming the plan's
   peak;
4. ``memory.micro_batch_size``: the plan's largest fitting micro-batch, a power of two, at most
   :data:`MAX_MICRO_BATCH`; accumulation follows from :data:`PROMPTS_PER_STEP` prompts x :data:`GROUP_SIZE`
   completions as train derives it;
5. ``rollout.batch_size``: the plan's ``auto`` number (the most sequences whose rollout fits per GPU).

Imports no torch.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from orbitctl.errors import UserError
from orbitctl.units import GiB

RANKS = (64, 32, 16, 8)
TRAINABLE_SHARE = 0.01
"""Trainable parameters at most this share of the model's: a LoRA budget that keeps the fp32 Adam state small."""
GOOD_MICRO_BATCH = 4
MAX_MICRO_BATCH = 8
GROUP_SIZE = 8
PROMPTS_PER_STEP = 32
SEQ_LEN = 2048
"""Tokens per sequence (prompt + completion), at most the model's context."""
LOGITS_CHUNK_ABOVE_BYTES = 1 * GiB
"""A micro-batch's fp32 logits above this are computed in chunks of :data:`LOSS_CHUNK` tokens."""
LOSS_CHUNK = 2048
FORMATS: dict[str, dict[str, Any]] = {
    "fp8": {"quant.format": "fp8"},
    "int4": {"quant.format": "int4"},
    "int4 (dequantized)": {"quant.format": "int4", "quant.kernel": "dequantize"},
    "nf4": {"quant.format": "nf4"},
}
"""The base formats tried, most precise and fastest first: FP8; INT4 with the fused kernel (which keeps a packed copy
of each weight beside it); INT4 dequantized per matmul (no copy, slower); NF4 (bitsandbytes)."""
KERNEL_WHY = "the fused INT4 kernel's packed copy of the weights does not fit beside them"
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
COMMENT_COLUMN = 30


@dataclass
class InitResult:
    """What ``orbitctl profile init`` wrote: the file, the plan's verdict and each chosen value with its reason."""

    path: str
    name: str
    verdict: str
    fits: bool
    choices: dict[str, tuple[Any, str]] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"path": self.path, "name": self.name, "verdict": self.verdict, "fits": self.fits,
                "choices": {key: {"value": value, "why": why} for key, (value, why) in self.choices.items()}}


def init_profile(model: str, *, gpu: str, gpus: int, out: str, nodes: int = 1, data: str | None = None,
                 name: str | None = None) -> InitResult:
    """Write a profile for ``model`` on ``nodes`` x ``gpus`` x ``gpu`` to ``out`` and return what was chosen and why.

    Raises UserError (exit 2) for a Hub id, a missing model, an unknown GPU, an existing ``out`` or a model that
    fits in no layout the plan tries."""
    from orbitctl.profile.gpus import resolve_gpu, unknown_gpu_message

    spec = resolve_gpu(gpu)
    if spec is None:
        raise UserError(f"--gpu: {unknown_gpu_message(gpu)}")
    target = Path(out)
    if target.exists():
        raise UserError(f"--out: {out} exists", fix="Remove it or name another file")
    model_path, arch = _model(model)
    name = name or _name(model_path, arch, spec.name, gpus, nodes)
    chooser = _Chooser(model_path, arch, spec, gpus, nodes, data, name)
    document = chooser.choose()
    from orbitctl.rundir import atomic_write_text

    target.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(target, chooser.render(document, model, out), fsync=False)
    from orbitctl.plan import plan_profile
    from orbitctl.profile import load_profile

    plan = plan_profile(load_profile(target), with_advice=False)  # the file as written, read back
    return InitResult(str(target), document["name"], plan.verdict(), plan.fits, chooser.why)


def _model(model: str) -> tuple[str, Any]:
    """(model.path as the profile writes it, its ArchSpec); a Hub id or a missing path is a UserError."""
    from orbitctl.arch import model_arch
    from orbitctl.arch.model_source import PKG_PREFIX, resolve_model_path
    from orbitctl.profile.schema import ModelSection

    if model.startswith(PKG_PREFIX):
        resolve_model_path(model, key="MODEL")
        path = model
    else:
        local = Path(model).expanduser()
        if not local.exists():
            if HUB_ID.fullmatch(model) and not model.startswith((".", "/", "~")) \
                    and local.suffix.lower() not in (".gguf", ".json", ".safetensors"):
                where = f"/models/{model.split('/')[1]}"
                raise UserError(f"MODEL: {model} is a Hugging Face Hub id, and orbitctl reads local files only",
                                fix=f"Download it (hf download {model} --local-dir {where}) and run orbitctl "
                                    f"profile init {where} with the same options")
            raise UserError(f"MODEL: {model} does not exist",
                            fix="Give a Hugging Face checkpoint directory, its config.json or a GGUF file")
        local = local.resolve()
        path = str(local.parent if local.name == "config.json" else local)
    return path, model_arch(ModelSection(path=path))


def _model_name(model_path: str) -> str:
    """The model's own name: the checkpoint directory's, or the GGUF file's without its suffix."""
    last = model_path.split("/")[-1]
    return Path(last).stem if last.endswith(".gguf") else last


def _name(model_path: str, arch, gpu: str, gpus: int, nodes: int) -> str:
    """model_method_quant_hardware, as the shipped profiles are named; the quant part is filled in by the chooser."""
    stem = re.sub(r"[^A-Za-z0-9.+-]+", "-", _model_name(model_path)).strip("-").lower() or arch.model_type
    nodes_part = f"{nodes}x" if nodes > 1 else ""
    return f"{stem}_grpo_{{quant}}_{nodes_part}{gpus}x{gpu}"


def _power_of_two_at_most(n: int) -> int:
    return 1 << (max(n, 1).bit_length() - 1)


class _Chooser:
    """The choices, made one after another on the plan of the profile as chosen so far."""

    def __init__(self, model_path: str, arch, spec, gpus: int, nodes: int, data: str | None, name: str) -> None:
        self.arch, self.spec, self.gpus, self.nodes = arch, spec, gpus, nodes
        self.model_name = _model_name(model_path)
        self.world = gpus * nodes
        self.name = name
        self.data_given = data is not None
        self.why: dict[str, tuple[Any, str]] = {}
        seq = min(SEQ_LEN, arch.max_position_embeddings or SEQ_LEN)
        self.doc: dict[str, Any] = {
            "name": name,
            "model": {"path": model_path},
            "hardware": {"gpu": spec.name, "gpus_per_node": gpus, "nodes": nodes, "host_ram_gib": 2048},
            "quant": {"format": "int4"},
            "adapter": {"kind": "lora", "rank": RANKS[-1], "dropout": 0.0,
                        "targets": "attention+shared" if arch.is_moe else "attention+mlp"},
            "memory": {"zero_stage": 0 if self.world == 1 else 3, "micro_batch_size": 1,
                       "gradient_accumulation_steps": 1, "seq_len": seq},
            "rl": {"algorithm": "grpo", "group_size": GROUP_SIZE, "prompts_per_step": self._prompts(),
                   "steps": 200, "warmup_steps": 10},
            "rollout": {"max_new_tokens": seq * 3 // 4},
            "data": {"train": _data_path(data),
                     # a builtin task grades with its own checker; a file's records with the final-answer check
                     "reward": "builtin" if str(data or "").startswith("builtin:") else "math"},
        }

    def _prompts(self) -> int:
        """Prompts per step: PROMPTS_PER_STEP rounded up to a multiple of the ranks (each samples the same number)."""
        return -(-PROMPTS_PER_STEP // self.world) * self.world

    def _profile(self, changes: dict[str, Any] | None = None):
        import copy

        from orbitctl.profile.loader import validate_profile

        doc = copy.deepcopy(self.doc)
        for key, value in (changes or {}).items():
            section, leaf = key.split(".")
            doc[section][leaf] = value
        doc["name"] = doc["name"].replace("{quant}", doc["quant"]["format"])
        return validate_profile(doc, f"profile init {self.name}")

    def _plan(self, changes: dict[str, Any] | None = None):
        from orbitctl.plan import plan_profile

        return plan_profile(self._profile(changes), with_advice=False)

    def choose(self) -> dict[str, Any]:
        self._rank()
        self._layout()
        self._format_and_micro_batch()
        self._rollout_batch()
        self.doc["name"] = self.doc["name"].replace("{quant}", self.doc["quant"]["format"])
        return self.doc

    def _rank(self) -> None:
        total = self.arch.params_total
        for rank in RANKS:
            trainable = self._plan({"adapter.rank": rank}).params_trainable
            if trainable <= TRAINABLE_SHARE * total or rank == RANKS[-1]:
                break
        share = trainable / total
        within = "within" if share <= TRAINABLE_SHARE else "the smallest offered; above"
        self._set("adapter.rank", rank, f"{_count(trainable)} trainable parameters, {share:.2%} of the model's "
                                        f"{_count(total)} ({within} {TRAINABLE_SHARE:.0%})")
        self._set("adapter.targets", self.doc["adapter"]["targets"],
                  "attention and the shared experts; the routed experts stay frozen (split over ranks)"
                  if self.arch.is_moe else "every linear layer of attention and the MLP")

    def _layout(self) -> None:
        mem = self.doc["memory"]
        if self.world == 1:
            self._set("memory.zero_stage", 0, "one GPU: plain AdamW, nothing to shard")
            return
        self._set("memory.zero_stage", 3, f"{self.world} GPUs: the frozen base, gradients and optimizer state "
                                          f"sharded over them")
        if self.arch.is_moe:
            ep = max(d for d in range(1, self.world + 1) if self.world % d == 0 and self.arch.num_experts % d == 0)
            if ep > 1:
                mem["expert_parallel"] = ep
                self._set("memory.expert_parallel", ep, f"{self.arch.num_experts} routed experts, "
                                                        f"{self.arch.num_experts // ep} on each rank of a group of {ep}")

    def _format_and_micro_batch(self) -> None:
        candidates = dict(FORMATS)
        if self.doc["memory"].get("expert_parallel", 1) > 1:  # train splits only INT4/FP8 experts over ranks
            candidates.pop("nf4")
        offload: dict[str, Any] = {}
        tried = {label: self._plan(changes).max_micro_batch for label, changes in candidates.items()}
        if max(tried.values()) < 1:
            offload = {"memory.offload_optimizer": "cpu", "memory.offload_activations": "cpu"}
            if self.world == 1:
                offload["memory.zero_stage"] = 2  # ZeRO-Offload: the optimizer step in host RAM needs a ZeRO stage
            tried = {label: self._plan({**changes, **offload}).max_micro_batch for label, changes in candidates.items()}
        if max(tried.values()) < 1:
            plan = self._plan({**FORMATS["int4 (dequantized)"], **offload})
            raise UserError(f"MODEL: {self.model_name} does not fit on {self.world} x {self.spec.name} in any format "
                            f"with optimizer state and activations in host RAM (the plan's peak "
                            f"{plan.peak_bytes / GiB:.1f} GiB per GPU, usable {plan.usable_bytes / GiB:.1f} GiB)",
                            fix="Use more GPUs (--gpus, --nodes) or a card with more memory (--gpu)")
        label = next((label for label, n in tried.items() if n >= GOOD_MICRO_BATCH),
                     max(tried, key=lambda key: tried[key]))
        listed = ", ".join(f"{key} {n}" for key, n in tried.items())
        why = (f"the largest micro-batch per format: {listed}; the first to reach {GOOD_MICRO_BATCH} in that order of "
               f"precision and speed" if tried[label] >= GOOD_MICRO_BATCH
               else f"the largest micro-batch per format: {listed}; none reaches {GOOD_MICRO_BATCH}, this fits most")
        for key, value in FORMATS[label].items():
            self._set(key, value, why if key == "quant.format" else f"{label}: {KERNEL_WHY}")
        for key, value in offload.items():
            self._set(key, value, "without it not one sequence per micro-batch fits" if key != "memory.zero_stage"
                      else "one GPU: ZeRO stage 2 moves the optimizer step to host RAM")
        micro = min(_power_of_two_at_most(tried[label]), MAX_MICRO_BATCH)
        self._set("memory.micro_batch_size", micro, f"the plan's largest fitting micro-batch is {tried[label]}; "
                                                    f"a power of two, at most {MAX_MICRO_BATCH}")
        per_rank = self.doc["rl"]["prompts_per_step"] * GROUP_SIZE // self.world
        self._set("memory.gradient_accumulation_steps", per_rank // micro,
                  f"rl.prompts_per_step x rl.group_size / {self.world} rank(s) / micro-batch, as train derives it")
        self._set("rl.prompts_per_step", self.doc["rl"]["prompts_per_step"],
                  f"{per_rank} sequences per rank and step")
        seq = self.doc["memory"]["seq_len"]
        logits = micro * seq * self.arch.vocab_size * 4
        if logits > LOGITS_CHUNK_ABOVE_BYTES:
            self._set("memory.loss_chunk_size", LOSS_CHUNK, f"a micro-batch's fp32 logits over {self.arch.vocab_size:,}"
                                                            f" tokens would be {logits / GiB:.1f} GiB at once")

    def _rollout_batch(self) -> None:
        from orbitctl.plan import auto_rollout_batch

        n = auto_rollout_batch(self._profile())
        self._set("rollout.batch_size", n, "the most sequences whose rollout (KV cache, prefill) fits per GPU, by "
                                           "the plan, at most the step's sequences per GPU")

    def _set(self, key: str, value: Any, why: str) -> None:
        section, leaf = key.split(".")
        self.doc[section][leaf] = value
        self.why[key] = (value, why)

    def render(self, doc: dict[str, Any], model: str, out: str) -> str:
        """The profile as commented YAML: a header with the commands, each chosen value with its reason."""
        doc_data = doc["data"]["train"]
        world = f"{self.nodes} nodes x {self.gpus}" if self.nodes > 1 else str(self.gpus)
        plan = self._plan()
        lines = [
            f"# {self.model_name} ({self.arch.model_type}, {_count(self.arch.params_total)} parameters): GRPO with "
            f"LoRA on a frozen {doc['quant']['format'].upper()} base, {world} x {self.spec.marketing}.",
            "# Written by",
            f"#   orbitctl profile init {model} --gpu {self.spec.name} --gpus {self.gpus}"
            f"{f' --nodes {self.nodes}' if self.nodes > 1 else ''}"
            f"{f' --data {doc_data}' if self.data_given else ''} --out {out}",
            f"# and planned then: {plan.verdict()}.",
            "#",
            f"#   orbitctl plan {out}",
            f"#   orbitctl train {out} --dry-run",
            f"#   orbitctl train {out}          # quantizes model.path once into orbitctl's cache, then trains",
        ]
        notes = {
            "model.path": "what train reads (and quantizes once)",
            "hardware.gpu": f"{self.spec.marketing}: {self.spec.visible_bytes / GiB:.1f} GiB visible per GPU",
            "hardware.host_ram_gib": "the node's RAM (free -g): offloads are checked against it",
            "adapter.dropout": "dropout makes the train path differ from the infer path",
            "memory.seq_len": "tokens per sequence: prompt + completion",
            "rollout.max_new_tokens": "the longest completion; the rest of seq_len is the prompt",
            "rl.steps": "optimizer steps; set to your budget",
            "data.train": "one JSON record per line: GSM8K's question/answer or MATH's problem/solution "
                          "(docs/train.md, \"Data files\")" + ("" if self.data_given else "; bring it (--data FILE)"),
            "data.reward": "the final answer against the record's",
        }
        train = doc["data"]["train"]
        if str(train).startswith(("builtin:", "env:")):  # not a file: say what it is instead
            notes["data.train"] = ("an environment, played turn by turn (docs/train.md)" if str(train).startswith("env:")
                                   else "a task built into orbitctl (docs/train.md)")
            if doc["data"]["reward"] == "builtin":
                notes["data.reward"] = "the builtin task's own checker"
        for section, values in doc.items():
            if not isinstance(values, dict):
                lines.append(f"{section}: {_scalar(values)}")
                continue
            lines.append(f"{section}:")
            for key, value in values.items():
                text = f"  {key}: {_scalar(value)}"
                why = self.why.get(f"{section}.{key}", (None, notes.get(f"{section}.{key}")))[1]
                lines.append(f"{text.ljust(COMMENT_COLUMN)}  # {why}" if why else text)
        return "\n".join(lines) + "\n"


def _count(n: int) -> str:
    """A parameter count: '134.5 M', '8.03 B'."""
    return f"{n / 1e9:,.2f} B" if n >= 1e9 else f"{n / 1e6:,.1f} M"


def _scalar(value: Any) -> str:
    """One YAML scalar as it reads back (a path, a number, a word)."""
    import yaml

    text = yaml.safe_dump(value, default_flow_style=True, width=10_000).strip()
    return text[:-4].strip() if text.endswith("\n...") else text


def _data_path(data: str | None) -> str:
    """data.train as written: a file made absolute (the profile may be used from elsewhere); a builtin task or an
    environment (``builtin:NAME``, ``env:NAME``) as given; none: the file train then asks for."""
    if not data:
        return "data/train.jsonl"
    if data.startswith(("builtin:", "env:")):
        return data
    return str(Path(data).expanduser().resolve())
