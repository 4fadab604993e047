"""The policy on the frozen NF4 base: what trains, what stays frozen, and the two paths agreeing."""

import pytest

torch = pytest.importorskip("torch")


def _same_bytes(a, b) -> bool:
    # packed NF4 data stored as bf16 holds NaN bit patterns, so compare bytes, not values
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def _compute_dtype(policy):
    """The dtype the policy's base computes in (``quant.compute_dtype`` as resolved here)."""
    return policy.model.get_input_embeddings().weight.dtype


def _one_kernel(model) -> bool:
    """Every bitsandbytes 4-bit layer of ``model`` has its repacking CPU kernel switched off (and there are some)."""
    flags = [m.support_avx512bf16_for_cpu for m in model.modules() if hasattr(m, "support_avx512bf16_for_cpu")]
    return bool(flags) and not any(flags)


def _policy(profile):
    from orbitctl.builder import load_policy, prepare_frozen_base
    from orbitctl.data.prompts import load_prompts

    split = load_prompts(profile.data, profile.run.seed)
    base = prepare_frozen_base(profile, split.warm_task)
    return load_policy(profile, base), base, split


def _train_steps(profile, policy, split, steps):
    from orbitctl.rl.engine import build_engine, close_process_group, ensure_process_group
    from orbitctl.rl.losses import group_advantages
    from orbitctl.rl.rewards import make_reward
    from orbitctl.rl.rollout import collect
    from orbitctl.rl.trainer import _accumulation
    from orbitctl.rl.update import run_update

    ensure_process_group()
    try:
        engine, _ = build_engine(policy, profile, _accumulation(profile, 1), steps)
        reward = make_reward(profile.data.reward, split.task)
        generator = torch.Generator().manual_seed(0)
        applied = []
        for step in range(steps):
            items = split.train[step * 8:(step + 1) * 8]
            batch = collect(policy, items, reward, group_size=profile.rl.group_size, batch_size=32,
                            max_new_tokens=profile.rollout.max_new_tokens, temperature=1.0, top_p=1.0,
                            generator=generator, keep_dist=True)
            adv = group_advantages(batch.rewards, profile.rl.group_size, True)
            run_update(engine, policy, batch, adv, profile, lambda s, t, ok, g: applied.append(ok))
        return applied
    finally:
        close_process_group()


def test_short_run_trains_every_adapter_parameter_and_nothing_else(small_profile):
    profile = small_profile(**{"rl.group_size": 8, "memory.micro_batch_size": 32, "rollout.batch_size": 64})
    policy, _, split = _policy(profile)
    before = {n: p.detach().clone() for n, p in policy.model.named_parameters()}
    base_before = {n: t.clone() for n, t in policy.model.state_dict().items() if "lora_" not in n}
    applied = _train_steps(profile, policy, split, steps=3)
    assert applied and all(applied)
    adapter = dict(policy.named_trainable())
    assert adapter and all("lora_" in n for n in adapter)
    unchanged = [n for n, p in adapter.items() if torch.equal(p.detach(), before[n])]
    assert not unchanged, f"adapter parameters that never moved: {unchanged}"
    for name, param in policy.model.named_parameters():
        if name not in adapter:
            assert not param.requires_grad and param.grad is None, name
    # the quantized base (packed NF4 data, absmax, norms, embeddings) is bit-identical
    for name, tensor in policy.model.state_dict().items():
        if "lora_" not in name:
            assert _same_bytes(tensor, base_before[name]), name


def test_adapters_disabled_equal_the_base_model(small_profile):
    from orbitctl.model.frozen_base import load_frozen_base

    profile = small_profile()
    policy, base, split = _policy(profile)
    with torch.no_grad():
        for name, param in policy.named_trainable():
            param.normal_(0.0, 0.05)  # adapters that visibly change the output
    ids, mask = policy.encode_prompts([it.prompt for it in split.train[:6]])
    completion = torch.full((6, 2), 7)
    completion_mask = torch.ones_like(completion)
    reference = policy.reference_logits(ids, mask, completion, completion_mask)
    adapted = policy.completion_logits(ids, mask, completion, completion_mask, train=False).detach()
    plain = load_frozen_base(str(base.quantized_dir), compute_dtype=_compute_dtype(policy))
    assert _one_kernel(plain)  # the loader pins the bitsandbytes kernel the policy uses
    from orbitctl.model.policy import _contiguous_input, position_ids_for

    # the policy hands its output layer a contiguous input (a 2-D GEMM, not a batched one over a strided view): the
    # plain model the same, or an fp32 GEMM on AVX2 rounds the two differently
    plain.get_output_embeddings().register_forward_pre_hook(_contiguous_input)
    with torch.no_grad():

        full = torch.cat([ids, completion], 1)
        full_mask = torch.cat([mask, completion_mask], 1)
        logits = plain(input_ids=full, attention_mask=full_mask, position_ids=position_ids_for(full_mask),
                       logits_to_keep=completion.shape[1] + 1).logits
    expected = logits[:, :completion.shape[1]]
    # equal by construction: a disabled LoRA layer calls only its base layer, so both sides run the
    # same modules, kernels and dtype on the same full sequence, the output layer on the same positions
    assert torch.equal(reference, expected)
    assert not torch.allclose(adapted, expected, atol=1e-3)


def test_every_load_path_pins_one_bitsandbytes_kernel(small_profile, tmp_path):
    """The policy (train, verify-alignment), a plain frozen base (quantize report) and a LoRA reloaded
    on one (load_lora, PEFT) all come out of load_frozen_base with bitsandbytes' repacking CPU kernel
    off, and an infer-path forward leaves every 4-bit weight unpacked."""
    from orbitctl.model.adapters import load_lora, save_adapter
    from orbitctl.model.frozen_base import load_frozen_base

    profile = small_profile()
    policy, base, split = _policy(profile)
    save_adapter(policy.model, tmp_path / "adapter", "lora", policy.hidden_size)
    plain = load_frozen_base(str(base.quantized_dir), compute_dtype=_compute_dtype(policy))
    reloaded = load_lora(load_frozen_base(str(base.quantized_dir), compute_dtype=_compute_dtype(policy)),
                         tmp_path / "adapter", dtype=profile.adapter.dtype)
    ids, mask = policy.encode_prompts([it.prompt for it in split.train[:2]])
    for model in (policy.model, plain, reloaded):
        assert _one_kernel(model)
        model.eval()
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask)
        packed = [n for n, m in model.named_modules()
                  if hasattr(m, "support_avx512bf16_for_cpu") and getattr(m.weight.quant_state, "packing_format_for_cpu", False)]
        assert not packed, packed


def test_lora_adapter_loads_with_peft_on_the_quantized_base(small_profile, tmp_path):
    from peft import PeftModel

    from orbitctl.model.adapters import save_adapter
    from orbitctl.model.frozen_base import load_frozen_base

    profile = small_profile()
    policy, base, split = _policy(profile)
    with torch.no_grad():
        for _, param in policy.named_trainable():
            param.normal_(0.0, 0.05)
    save_adapter(policy.model, tmp_path / "adapter", "lora", policy.hidden_size)
    assert (tmp_path / "adapter" / "adapter_config.json").exists()
    loaded = PeftModel.from_pretrained(load_frozen_base(str(base.quantized_dir), compute_dtype=_compute_dtype(policy)),
                                       str(tmp_path / "adapter"), autocast_adapter_dtype=False)
    assert _one_kernel(loaded)  # PEFT wraps the loader's Linear4bit modules, pinned kernel and all
    ids, mask = policy.encode_prompts([it.prompt for it in split.train[:4]])
    policy.model.eval()
    loaded.eval()
    with torch.no_grad():
        ours = policy.model(input_ids=ids, attention_mask=mask).logits
        theirs = loaded(input_ids=ids, attention_mask=mask).logits
    ours_lora = {n: p for n, p in policy.model.named_parameters() if "lora_" in n}
    theirs_lora = {n: p for n, p in loaded.named_parameters() if "lora_" in n}
    assert ours_lora.keys() == theirs_lora.keys()
    assert all(ours_lora[n].dtype == theirs_lora[n].dtype and torch.equal(ours_lora[n], theirs_lora[n])
               for n in ours_lora)
    # equal by construction: the same modules with the same weights, dtype and kernel on the same input
    assert torch.equal(ours, theirs)


def test_bottleneck_adapter_trains_saves_and_reloads(small_profile, tmp_path):
    from orbitctl.model.adapters import bottleneck_modules, load_bottleneck, save_adapter

    profile = small_profile(**{"adapter.kind": "bottleneck", "adapter.rank": "auto", "rl.group_size": 8,
                               "memory.micro_batch_size": 32, "rollout.batch_size": 64})
    policy, _, split = _policy(profile)
    modules = bottleneck_modules(policy.model)
    assert len(modules) == 2 and modules[0].down.out_features == 6  # auto = hidden 64 // 10
    _train_steps(profile, policy, split, steps=2)
    assert float(modules[0].up.weight.abs().sum()) > 0
    save_adapter(policy.model, tmp_path / "bn", "bottleneck", policy.hidden_size)
    fresh, _, _ = _policy(profile)
    load_bottleneck(fresh.model, tmp_path / "bn")
    for a, b in zip(bottleneck_modules(policy.model), bottleneck_modules(fresh.model)):  # a file round trip
        assert torch.equal(a.up.weight, b.up.weight) and torch.equal(a.down.bias, b.down.bias)


def test_infer_and_train_paths_agree_under_left_padding(small_profile):
    profile = small_profile()
    policy, _, _ = _policy(profile)
    with torch.no_grad():
        for _, param in policy.named_trainable():
            param.normal_(0.0, 0.05)
    prompts = ["+-M5:", "M2:", "()M7:", "5:"]  # different lengths: rows get left padding
    ids, mask = policy.encode_prompts(prompts)
    assert (mask == 0).any()
    out = policy.sample(ids, mask, max_new_tokens=3, temperature=1.0, top_p=1.0,
                        generator=torch.Generator().manual_seed(0), keep_dist=True)
    with torch.no_grad():
        logits = policy.completion_logits(ids, mask, out.completion_ids, out.completion_mask, train=False)
    train_logp = torch.log_softmax(logits.float(), -1).gather(-1, out.completion_ids[..., None]).squeeze(-1)
    delta = ((train_logp - out.logprobs) * out.completion_mask).abs().max()
    assert float(delta) < 1e-3


@pytest.mark.parametrize("fmt", ["int4", "fp8"])
def test_lora_on_our_int4_and_fp8_layers_reloads_exactly(small_profile, tmp_path, fmt):
    from orbitctl.model.adapters import load_lora, save_adapter
    from orbitctl.model.frozen_base import load_frozen_base, use_fused_int4

    profile = small_profile(**{"quant.format": fmt, "quant.group_size": 32})
    policy, base, split = _policy(profile)
    wrapped = [type(m).__name__ for m in policy.model.modules() if type(m).__name__ == "QuantLinearLora"]
    assert len(wrapped) == len(policy.report.modules)  # every LoRA target is a quantized layer here
    with torch.no_grad():
        for _, param in policy.named_trainable():
            param.normal_(0.0, 0.05)
    save_adapter(policy.model, tmp_path / "adapter", "lora", policy.hidden_size)
    frozen = load_frozen_base(str(base.quantized_dir), compute_dtype=_compute_dtype(policy))
    if any(getattr(m, "kernel_pack", None) is not None for m in policy.model.modules()):
        use_fused_int4(frozen)  # the INT4 kernel the policy's layers run (quant.kernel: auto on the CPU)
    loaded = load_lora(frozen, tmp_path / "adapter", dtype=profile.adapter.dtype)
    ours = {n: p for n, p in policy.model.named_parameters() if "lora_" in n}
    theirs = {n: p for n, p in loaded.named_parameters() if "lora_" in n}
    assert ours.keys() == theirs.keys()
    # bit-equal: the adapter is never cast through the base's float8 on the way in
    assert all(theirs[n].dtype == ours[n].dtype and torch.equal(ours[n], theirs[n]) for n in ours)
    ids, mask = policy.encode_prompts([it.prompt for it in split.train[:4]])
    policy.model.eval()
    loaded.eval()
    with torch.no_grad():  # equal by construction: the same QuantLinearLora modules, weights and input
        assert torch.equal(policy.model(input_ids=ids, attention_mask=mask).logits,
                           loaded(input_ids=ids, attention_mask=mask).logits)


def test_train_path_computes_the_output_layer_for_the_completion_only(small_profile):
    """With ``logits_to_keep`` the train path's logits are the completion positions' alone, and equal those of a
    forward that computes every position's and slices (the same rows of the same matmul inputs)."""
    policy, _, _ = _policy(small_profile())
    assert policy._keeps_logits  # transformers' llama takes logits_to_keep
    ids, mask = policy.encode_prompts(["+-M5:", "M2:", "()M7:"])
    out = policy.sample(ids, mask, max_new_tokens=4, temperature=1.0, top_p=1.0,
                        generator=torch.Generator().manual_seed(0))
    calls = []
    hook = policy.model.get_base_model().lm_head.register_forward_hook(lambda m, a, o: calls.append(a[0].shape[1]))
    try:
        with torch.no_grad():
            kept = policy.completion_logits(ids, mask, out.completion_ids, out.completion_mask, train=False)
            policy._keeps_logits = False
            full = policy.completion_logits(ids, mask, out.completion_ids, out.completion_mask, train=False)
    finally:
        policy._keeps_logits = True
        hook.remove()
    length = out.completion_ids.shape[1]
    assert calls == [length + 1, ids.shape[1] + length]
    assert kept.shape == full.shape == (ids.shape[0], length, policy.model.config.vocab_size)
    # a matmul over fewer rows may block differently: a few units in the last place of the largest logit
    ulp = torch.finfo(kept.dtype).eps * float(full.abs().max())
    assert float((kept.float() - full.float()).abs().max()) <= 4 * ulp
