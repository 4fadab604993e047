"""`orbitctl plan --measure`: calibrate the activation and logit terms on a scaled-down copy.

The copy keeps the real width (hidden, heads, experts, vocabulary) and 1-2 layers (one dense
and one MoE layer when the model has both). One training step (forward, loss, backward,
AdamW step) of a frozen bf16 base with bf16 LoRA adapters runs under ``FakeTensorMode``, so
no memory is allocated, while ``MemTracker`` (fake device "cpu") records every tensor by
category. The analytic estimate for the same copy is compared per component; the ratio of
the activation+logit terms scales the full-depth plan's terms.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from orbitctl.arch import arch_from_config
from orbitctl.arch.spec import ArchSpec
from orbitctl.plan.activations import ActivationSettings, train_activations
from orbitctl.plan.adapters import plan_adapters
from orbitctl.plan.profile_arch import profile_arch

HF_MODEL_TYPE = {"kimi_k2": "deepseek_v3"}


@dataclass
class Measurement:
    layers: int
    tokens: int
    rows: list[dict] = field(default_factory=list)
    """{component, predicted_bytes, measured_bytes} for the scaled-down copy."""
    activation_ratio: float = 1.0
    """measured / predicted activation+logit bytes."""
    calibrated_bytes: dict[str, int] = field(default_factory=dict)
    """The full plan's activations and logits_loss after scaling by the ratio."""
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"layers": self.layers, "tokens": self.tokens, "rows": self.rows,
                "activation_ratio": round(self.activation_ratio, 4), "calibrated_bytes": self.calibrated_bytes,
                "notes": self.notes}


def scaled_config(arch: ArchSpec, layers: int = 2) -> dict:
    """The arch's config with 1-2 layers at real width; a MoE model keeps one dense and one MoE layer."""
    cfg = dict(arch.config)
    cfg["num_hidden_layers"] = layers
    if arch.attention == "mla":
        cfg["num_nextn_predict_layers"] = 0
        if arch.is_moe:
            cfg["first_k_dense_replace"] = 1 if (arch.moe_layers < arch.num_layers and layers > 1) else 0
            cfg["moe_layer_freq"] = 1
    if arch.model_type == "qwen3_moe":
        cfg["mlp_only_layers"] = [0] if (arch.moe_layers < arch.num_layers and layers > 1) else []
        cfg["decoder_sparse_step"] = 1
    return cfg


def settings_for(profile) -> ActivationSettings:
    mem = profile.memory
    return ActivationSettings(
        tokens=mem.micro_batch_size * mem.seq_len, seq_len=mem.seq_len, checkpointing=mem.gradient_checkpointing,
        offload=False, flash=mem.flash_attention, dropout=profile.adapter.dropout > 0,
        adapter_bytes=2 if profile.adapter.dtype == "bf16" else 4, loss_chunk=mem.loss_chunk_size,
        keep_frozen=mem.keep_frozen_outputs)


def predicted_activation_bytes(arch: ArchSpec, profile) -> int:
    acts = train_activations(arch, plan_adapters(arch, profile.adapter), settings_for(profile))
    return int(acts.activations + acts.logits)


def measure_profile(profile, *, layers: int = 2) -> Measurement:
    """Run one fake training step of the scaled copy and compare with the analytic terms."""
    arch = profile_arch(profile)
    small = arch_from_config(scaled_config(arch, layers), name=f"{arch.name}-{layers}L")
    adapters = plan_adapters(small, profile.adapter)
    mem = profile.memory
    measured, notes = _run_fake_step(small, profile, adapters)
    predicted_acts = predicted_activation_bytes(small, profile)
    weight_bytes = 2 if profile.adapter.dtype == "bf16" else 4
    base_bytes = sum(w.numel * (4 if w.dtype == "fp32" else 2) for _, w in small.all_weights() if w.parameter)
    trained = measured["trainable_params"]
    rows = [
        {"component": "activations+logits", "predicted_bytes": predicted_acts, "measured_bytes": measured["activations"]},
        {"component": "base_weights (bf16 copy)", "predicted_bytes": base_bytes, "measured_bytes": measured["base"]},
        {"component": "adapter_weights", "predicted_bytes": trained * weight_bytes, "measured_bytes": measured["params"]},
        {"component": "optimizer (torch AdamW m, v)", "predicted_bytes": 2 * trained * weight_bytes,
         "measured_bytes": measured["optimizer"]},
    ]
    if adapters.trainable_params != trained:
        notes.append(f"adapters measured on {trained:,} parameters; the plan counts {adapters.trainable_params:,}")
    ratio = measured["activations"] / predicted_acts if predicted_acts else 1.0
    full = train_activations(arch, plan_adapters(arch, profile.adapter), ActivationSettings(
        **{**settings_for(profile).__dict__, "offload": mem.offload_activations == "cpu"}))
    return Measurement(layers=layers, tokens=mem.micro_batch_size * mem.seq_len, rows=rows, activation_ratio=ratio,
                       calibrated_bytes={"activations": int(full.activations * ratio),
                                         "logits_loss": int(full.logits * ratio)}, notes=notes)


def _run_fake_step(small: ArchSpec, profile, adapters) -> tuple[dict, list[str]]:
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker
    from transformers import AutoConfig, AutoModelForCausalLM

    from orbitctl.plan.recompute import checkpoint_kwargs
    from orbitctl.plan.shadow import attach_shadow_adapters, freeze_to_buffers, register_flash_style_attention

    mem = profile.memory
    cfg_dict = dict(small.config)
    model_type = HF_MODEL_TYPE.get(cfg_dict.pop("model_type"), small.model_type)
    for key in ("architectures", "auto_map", "quantization_config", "transformers_version", "torch_dtype", "dtype"):
        cfg_dict.pop(key, None)
    config = AutoConfig.for_model(model_type, **cfg_dict)
    config._attn_implementation = register_flash_style_attention() if mem.flash_attention else "eager"
    config.use_cache = False
    notes: list[str] = []
    ids_shape = (mem.micro_batch_size, mem.seq_len)
    with FakeTensorMode():
        with torch.device("cpu"):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
            skipped = attach_shadow_adapters(model, small, adapters, profile.adapter)
        freeze_to_buffers(model)
        if skipped:
            notes.append(f"routed-expert adapters not measured ({skipped} weights): no fake-tensor LoRA on stacked experts")
        if mem.gradient_checkpointing:
            kwargs = checkpoint_kwargs(keep_frozen_outputs=mem.keep_frozen_outputs)
            if hasattr(model, "activation_checkpointing_enable"):
                model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
            else:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        model.train()
        trainable = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(trainable, lr=1e-5)
        ids = torch.randint(0, small.vocab_size, ids_shape)
        tracker = MemTracker()
        tracker.track_external(model, optimizer)
        with tracker:
            for iteration in range(2):  # the second step has optimizer state, like every step after
                _train_step(model, optimizer, ids, mem.loss_chunk_size)
                if iteration == 0:
                    tracker.reset_mod_stats()
        peak = next(iter(tracker.get_tracker_snapshot("peak").values()))
    by_name = {str(getattr(k, "value", k)): v for k, v in peak.items()}
    result = {"activations": by_name.get("Activation", 0) + by_name.get("Temp", 0),
              "base": by_name.get("Buffer", 0), "params": by_name.get("Parameter", 0),
              "grads": by_name.get("Gradient", 0), "optimizer": by_name.get("Optstate", 0),
              "trainable_params": sum(p.numel() for p in trainable)}
    return result, notes


def _train_step(model, optimizer, ids, loss_chunk: int) -> None:
    """One policy-gradient step: fp32 log-softmax of the sampled tokens, backward, AdamW."""
    import torch

    def token_logprobs(hidden, targets):
        # functional: MemTracker refuses a module called more than once per step (one per chunk)
        logits = torch.nn.functional.linear(hidden, model.lm_head.weight)
        return logits.float().log_softmax(-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)

    if loss_chunk and loss_chunk < ids.numel():
        hidden = model.model(input_ids=ids).last_hidden_state.flatten(0, 1)
        flat = ids.flatten()
        total = 0
        for start in range(0, flat.numel(), loss_chunk):
            logp = torch.utils.checkpoint.checkpoint(token_logprobs, hidden[start:start + loss_chunk],
                                                     flat[start:start + loss_chunk], use_reentrant=False)
            total = total + logp.sum()
        loss = -total / flat.numel()
        del hidden, logp
    else:
        logp = token_logprobs(model.model(input_ids=ids).last_hidden_state, ids)
        loss = -logp.mean()
        del logp
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def calibrate(plan, measurement: Measurement) -> None:
    """Replace the plan's analytic activation and logit terms by the calibrated ones."""
    update = plan.phases["policy_update"]
    update.update(measurement.calibrated_bytes)
    plan.peak_phase = max(plan.phases, key=lambda p: sum(plan.phases[p].values()))
    plan.notes.append(f"activations and logits calibrated by --measure (x{measurement.activation_ratio:.2f})")
