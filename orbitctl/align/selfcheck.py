"""The internal check: the profile's own policy on its infer path against its train path.

The infer path (:meth:`Policy.sample`: eval mode, KV cache, one token at a time) generates
completions for the prompts and records, for every generated token, the full distribution
it sampled from. The train path (:meth:`Policy.completion_logits`: the trainer's
full-sequence forward, checkpointing on) then recomputes the same tokens in one pass. Both
sides are temperature-scaled the way the trainer scales them, so what is compared is the
distribution the rollout sampled from against the one the loss differentiates.

By default the two paths share one model: the adapter-first premise (same quantized weights,
same unmerged adapter), and then the comparison is the kernel floor itself
(:mod:`orbitctl.align.floor`). ``infer_quant`` serves the infer path from a copy of the same
source weights stored in another format, and ``perturb`` scales one layer's norm weights on that
copy: the what-if and the injected fault the gates must catch. ``rollout.kv_dtype: fp8`` keeps the
infer path's KV cache in float8 (:mod:`orbitctl.kernels.kv_cache`), as the rollout does; the train path
has no cache, so this is the what-if of an fp8 cache on the same weights. With a separate copy or an
fp8 cache the trainer's own weights also decode the sampled tokens through a KV cache in the compute
dtype (teacher-forced), which measures the floor beside the comparison; ``--per-layer`` names a layer
only where its error stands clear of that floor.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from orbitctl.align.floor import SAME_MODEL, KernelFloor, clear_of_floor, floor_from_table
from orbitctl.errors import InputFileError, UserError
from orbitctl.rundir import RunDir

INFER_FORMATS = ("nf4", "fp4", "int4", "fp8", "bf16")
LOGITS_BUDGET_BYTES = 1 << 30
"""Prompts per batch shrink so the two paths' logits of one batch stay under 1 GiB (160k vocabularies)."""
JUMP_FLOOR = 0.01
"""A layer is named as where the paths part only when its relative error reaches 1%."""


@dataclass(frozen=True)
class Perturbation:
    """Multiply one decoder layer's input-norm weights by (1 + scale * N(0, 1)) on the infer copy."""

    layer: int
    scale: float
    seed: int = 0


@dataclass
class LayerError:
    index: int
    name: str
    rel_error: float
    """||h_train - h_infer|| / ||h_train|| over every compared token."""


@dataclass
class InternalComparison:
    table: object                    # orbitctl.align.metrics.TokenTable
    train_path: str
    infer_path: str
    adapter: str
    prompts: int
    completions: int
    layers: list[LayerError] | None = None
    jump: LayerError | None = None
    notes: list[str] = field(default_factory=list)
    infer_token_logp: "object | None" = None
    """Infer-path log-prob of each compared sampled token (float64 [N]), for the plot."""
    jump_cause: str | None = None
    """What differs between the paths at the first jump, from how the infer path was built."""
    floor: KernelFloor | None = None
    """The same-weights residual of the two paths on this machine (this comparison, or a second pass)."""
    kv_dtype: str = "bf16"
    """How the infer path kept its KV cache (``rollout.kv_dtype``)."""
    routing: "RoutingSplit | None" = None
    """An MoE's routing agreement and its mismatch with and without router replay."""

    def describe(self) -> dict:
        doc = {"source": "internal", "train_path": self.train_path, "infer_path": self.infer_path,
               "kv_dtype": self.kv_dtype, "adapter": self.adapter, "prompts": self.prompts,
               "completions": self.completions}
        if self.routing is not None:
            doc["routing"] = self.routing.to_dict()
        if self.layers is not None:
            doc["per_layer"] = [{"index": e.index, "name": e.name, "rel_error": e.rel_error} for e in self.layers]
            doc["first_jump"] = None if self.jump is None else {"index": self.jump.index, "name": self.jump.name,
                                                               "rel_error": self.jump.rel_error,
                                                               "likely_cause": self.jump_cause}
        return doc


@dataclass
class RoutingSplit:
    """An MoE's train/infer mismatch split into routing and numerics: the train path recomputes the sampled tokens
    once routing them itself and once running the experts the infer path recorded (router replay). Replayed, what
    is left is numerics; the difference is what routing flips add."""

    replayed_in_comparison: bool
    """Whether the comparison (and its gates) replays the routing, as ``rl.router_replay`` trains."""
    agreement: object
    """:class:`~orbitctl.model.router_replay.Agreement` of the train path's own routing with the recorded one."""
    without_replay: object
    """TokenTable of the train path routing itself against the infer path."""
    with_replay: object
    """TokenTable of the train path replaying the recorded routing against the infer path."""

    def add(self, agreement, without_replay, with_replay, infer, ids) -> None:
        """One batch: its agreement, and the train path's logits of its compared tokens routed by itself and
        replayed, against the infer path's ``infer`` on the tokens ``ids``."""
        self.agreement = agreement if self.agreement is None else self.agreement + agreement
        self.without_replay.add(without_replay, infer, ids)
        self.with_replay.add(with_replay, infer, ids)

    def to_dict(self) -> dict:
        without, with_ = self.without_replay.summary(), self.with_replay.summary()
        split = {}
        for metric in ("js", "logsoftmax_l1"):
            total, numerics = without[metric]["mean"], with_[metric]["mean"]
            split[metric] = {"without_replay": total, "with_replay": numerics, "routing": total - numerics}
        return {"agreement": self.agreement.overall, "agreement_per_layer": self.agreement.per_layer(),
                "tokens_compared": sum(self.agreement.compared), "replayed_in_comparison": self.replayed_in_comparison,
                "mismatch": split}


def resolve_adapter(profile, adapter: str | Path | None) -> Path | None:
    """The adapter to load: ``adapter``, else the run's final adapter, else its newest checkpoint's."""
    if adapter is not None:
        path = Path(adapter)
        if not path.is_dir():
            raise InputFileError(f"{path}: no such adapter directory",
                                 fix="pass --adapter runs/NAME/adapter (written by orbitctl train)")
        return path
    return RunDir(profile.run_dir).trained_adapter()


def load_adapter_into(policy, path: Path, kind: str) -> None:
    from orbitctl.model.adapters import load_adapter_weights

    expected = "adapter_model.safetensors" if kind == "lora" else "bottleneck.safetensors"
    if not (path / expected).exists():
        raise InputFileError(f"{path}: no {expected} (adapter.kind is {kind})",
                             fix="point --adapter at the adapter/ directory of a run of this profile")
    try:
        load_adapter_weights(policy.model, path, kind)
    except (RuntimeError, KeyError, ValueError) as exc:
        raise InputFileError(f"{path}: does not fit this profile's adapter ({str(exc).splitlines()[0]})",
                             fix="use the adapter of a run of this profile (same arch, adapter.kind, rank, targets)") from exc


def _with_format(profile, fmt: str):
    quant = profile.quant.model_copy(update={"format": "none" if fmt == "bf16" else fmt})
    if fmt in ("int4", "nf4", "fp4") and quant.group_size not in (32, 64, 128):
        quant = quant.model_copy(update={"group_size": 64})
    return profile.model_copy(update={"quant": quant})


def _perturb(policy, perturbation: Perturbation) -> None:
    import torch

    from orbitctl.model.adapters import decoder_layers

    layers = decoder_layers(policy.model.get_base_model() if hasattr(policy.model, "get_base_model") else policy.model)
    if not 0 <= perturbation.layer < len(layers):
        raise UserError(f"--perturb-layer {perturbation.layer}: the model has layers 0..{len(layers) - 1}",
                        fix="pick a layer index in range")
    norm = layers[perturbation.layer].input_layernorm.weight
    noise = torch.randn(norm.shape, generator=torch.Generator().manual_seed(perturbation.seed))
    with torch.no_grad():
        norm.mul_(1 + perturbation.scale * noise.to(norm.dtype))


def _layer_names(n_states: int) -> list[str]:
    # hidden_states[0] is the embedding output, [i] the output of decoder layer i-1
    return ["embeddings"] + [f"layers.{i}" for i in range(n_states - 1)]


def first_jump(errors: list[LayerError], floor: float = JUMP_FLOOR,
               kernel_floor: list[float] | None = None) -> LayerError | None:
    """The first layer whose error reaches ``floor``, at least doubles the layer before's and, where
    the same-weights error of each layer (``kernel_floor``) was measured, stands clear of it."""
    previous = 0.0
    for i, e in enumerate(errors):
        layer_floor = kernel_floor[i] if kernel_floor is not None else None
        if e.rel_error >= floor and e.rel_error >= 2 * previous and clear_of_floor(e.rel_error, layer_floor):
            return e
        previous = e.rel_error
    return None


def jump_cause(jump: LayerError, infer_quant: str | None, train_fmt: str, perturb: Perturbation | None,
               kv_dtype: str = "bf16") -> str:
    """Name the difference the two paths can have at this layer, given how the infer path was built."""
    if perturb is not None and jump.name == f"layers.{perturb.layer}":
        return "weights: the infer copy's weights differ from the trainer's here"
    if infer_quant is not None and infer_quant != train_fmt:
        if jump.name == "embeddings":
            return "embeddings stored differently on the two paths"
        return (f"quantization: {infer_quant} on the infer path vs {train_fmt} in training; the error "
                f"starts at the first quantized layer")
    if jump.name == "embeddings":
        return "embedding lookup: the paths read different embedding weights"
    if kv_dtype != "bf16":
        return (f"the KV cache: the infer path's attention reads K/V rounded to {kv_dtype} (rollout.kv_dtype), "
                f"the full-sequence forward reads them unrounded")
    return ("the forward path: the weights and adapter are the same objects, so the KV-cache decode "
            "or the attention kernel differs from the full-sequence forward at this layer")


def compare_internal(profile, *, adapter: str | Path | None = None, prompts: list[str] | None = None,
                     infer_quant: str | None = None, per_layer: bool = False,
                     perturb: Perturbation | None = None, batch_size: int = 16,
                     on_progress: Callable[[int, int], None] | None = None) -> InternalComparison:
    """Generate on the infer path, recompute on the train path, compare every generated token."""
    import torch

    from orbitctl.align.tokens import TokenTable
    from orbitctl.builder import load_policy, prepare_frozen_base
    from orbitctl.data.prompts import load_prompts

    if infer_quant is not None and infer_quant not in INFER_FORMATS:
        raise UserError(f"--infer-quant {infer_quant}: unknown format", fix=f"use one of {', '.join(INFER_FORMATS)}")
    notes: list[str] = []
    split = load_prompts(profile.data, profile.run.seed)
    if prompts is None:
        prompts = [item.prompt for item in split.eval[:profile.alignment.num_prompts]]
    if not prompts:
        raise UserError("no prompts to compare", fix="pass --prompts FILE.jsonl or set data.eval")
    torch.manual_seed(profile.run.seed)
    base = prepare_frozen_base(profile, split.warm_task)
    train_policy = load_policy(profile, base)
    adapter_dir = resolve_adapter(profile, adapter)
    if adapter_dir is None:
        notes.append("no trained adapter found (run dir has none): the adapters are freshly initialised")
    else:
        load_adapter_into(train_policy, adapter_dir, profile.adapter.kind)
    train_fmt = profile.quant.format if profile.quant.format != "none" else "bf16"
    kv_dtype = profile.rollout.kv_dtype
    infer_policy, infer_desc = train_policy, f"{train_fmt}, same weights (KV-cache decoding)"
    if infer_quant is not None or perturb is not None:
        infer_profile = _with_format(profile, infer_quant or train_fmt)
        if infer_quant is not None and profile.model.quantized_path and not profile.model.path:
            raise UserError("--infer-quant: the profile names only model.quantized_path",
                            fix="set model.path to the unquantized checkpoint so it can be stored in another format")
        infer_base = prepare_frozen_base(infer_profile, split.warm_task)
        infer_policy = load_policy(infer_profile, infer_base)
        if adapter_dir is not None:
            load_adapter_into(infer_policy, adapter_dir, profile.adapter.kind)
        infer_desc = f"{infer_quant or train_fmt}, a separate copy"
        if perturb is not None:
            _perturb(infer_policy, perturb)
            infer_desc += f", layer {perturb.layer} norm perturbed x(1 + {perturb.scale:g}*N(0,1))"
    if kv_dtype != "bf16":
        infer_desc = (f"{train_fmt}, same weights" if infer_policy is train_policy else infer_desc) + \
            ", KV cache in fp8 (float8 e4m3, one scale per token and KV head)"

    temperature = profile.rollout.temperature
    # both paths hold [batch, new tokens, vocab] float32 logits at once: keep that under the budget
    vocab = int(train_policy.model.config.vocab_size)
    batch_size = max(1, min(batch_size, LOGITS_BUDGET_BYTES // (2 * 4 * vocab * profile.rollout.max_new_tokens)))
    table = TokenTable(k=profile.alignment.top_k)
    # a separate copy or an fp8 cache: the floor is measured beside the comparison
    separate = infer_policy is not train_policy or kv_dtype != "bf16"
    floor_table = TokenTable(k=profile.alignment.top_k) if separate else table
    generator = torch.Generator().manual_seed(profile.run.seed * 7919 + 17)
    sq_diff = sq_norm = floor_sq_diff = None
    infer_logp = []
    completions = 0
    logit_absmax, compute_dtype = 0.0, None
    replay = profile.rl.router_replay
    routing = None
    if train_policy.routing is not None:  # an MoE: the other replay setting beside the comparison
        routing = RoutingSplit(replay, None, TokenTable(k=profile.alignment.top_k),
                               TokenTable(k=profile.alignment.top_k))
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start:start + batch_size]
        ids, mask = infer_policy.encode_prompts(chunk)
        samples = infer_policy.sample(ids, mask, max_new_tokens=profile.rollout.max_new_tokens,
                                      temperature=temperature, top_p=profile.rollout.top_p, generator=generator,
                                      keep_logits=True, keep_hidden=per_layer)
        def train_forward(replayed: bool, hidden: bool = False):
            with torch.no_grad():
                out = train_policy.completion_logits(samples.prompt_ids, samples.prompt_mask, samples.completion_ids,
                                                     samples.completion_mask, train=True, with_hidden=hidden,
                                                     routes=samples.routes, replay=replayed)
            return out if hidden else (out, None)

        def scaled(logits):
            return logits.float().cpu() / (temperature if temperature > 0 else 1.0)

        keep = samples.completion_mask.bool()
        train_logits, train_hidden = train_forward(replay, per_layer)
        compute_dtype = str(train_logits.dtype).removeprefix("torch.")
        train_logits = scaled(train_logits)
        train_hidden = train_hidden.cpu() if train_hidden is not None else None
        table.add(train_logits[keep], samples.logits[keep], samples.completion_ids[keep])
        if routing is not None:  # the agreement is read after the forward that routes itself
            unreplayed = scaled(train_forward(False)[0]) if replay else train_logits
            agreement = train_policy.routing_agreement(samples.routes, samples.prompt_ids.shape[1],
                                                       samples.completion_mask)
            replayed = train_logits if replay else scaled(train_forward(True)[0])
            routing.add(agreement, unreplayed[keep], replayed[keep], samples.logits[keep],
                        samples.completion_ids[keep])
        logit_absmax = max(logit_absmax, float(train_logits[keep].abs().max()))
        infer_logp.append(samples.logprobs[keep].double())
        completions += len(chunk)
        own = None
        if separate:  # the trainer's weights through a compute-dtype KV cache on the same tokens: the floor
            own = train_policy.sample(samples.prompt_ids, samples.prompt_mask, max_new_tokens=0,
                                      temperature=temperature, top_p=1.0, generator=None, keep_logits=True,
                                      keep_hidden=per_layer, forced=(samples.completion_ids, samples.completion_mask),
                                      kv_dtype="bf16")
            floor_table.add(train_logits[keep], own.logits[keep], samples.completion_ids[keep])
        if per_layer:
            diff = _sq_error(train_hidden, samples.hidden, keep)
            norm = (train_hidden[keep].double() ** 2).sum(dim=(0, 2))
            sq_diff = diff if sq_diff is None else sq_diff + diff
            sq_norm = norm if sq_norm is None else sq_norm + norm
            if own is not None:
                own_diff = _sq_error(train_hidden, own.hidden, keep)
                floor_sq_diff = own_diff if floor_sq_diff is None else floor_sq_diff + own_diff
        if on_progress:
            on_progress(min(start + batch_size, len(prompts)), len(prompts))
    result = InternalComparison(table, f"{train_fmt}, full-sequence forward (train mode, checkpointing "
                                       f"{'on' if profile.memory.gradient_checkpointing else 'off'})",
                                infer_desc, str(adapter_dir) if adapter_dir else "fresh (untrained)",
                                len(prompts), completions, notes=notes, infer_token_logp=torch.cat(infer_logp),
                                kv_dtype=kv_dtype, routing=routing)
    floor_layers = None
    if per_layer:
        rel = _relative(sq_diff, sq_norm)
        result.layers = [LayerError(i, name, float(e)) for i, (name, e) in enumerate(zip(_layer_names(len(rel)), rel))]
        floor_layers = _relative(floor_sq_diff, sq_norm) if separate else rel
        result.jump = first_jump(result.layers, kernel_floor=floor_layers if separate else None)
        if result.jump is not None:
            result.jump_cause = jump_cause(result.jump, infer_quant, train_fmt, perturb, kv_dtype)
    result.floor = floor_from_table(
        floor_table, compute_dtype=compute_dtype or "bfloat16", logit_absmax=logit_absmax, layers=floor_layers,
        measured_as=("the trainer's weights decoded through a compute-dtype KV cache on the same tokens vs its "
                     "full-sequence forward") if separate else SAME_MODEL)
    return result


def _sq_error(train_hidden, infer_hidden, keep):
    """Per-layer sum of squared differences over the kept positions, float64 [L+1]."""
    return ((train_hidden - infer_hidden)[keep].double() ** 2).sum(dim=(0, 2))


def _relative(sq_diff, sq_norm) -> list[float]:
    return (sq_diff / sq_norm.clamp_min(1e-300)).sqrt().tolist()
