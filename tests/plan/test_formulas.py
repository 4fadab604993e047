"""The planner's terms against the reference arithmetic and against each other."""

from __future__ import annotations

import pytest

from orbitctl.arch import builtin_arch
from orbitctl.plan import apply_changes, plan_profile
from orbitctl.plan.adapters import plan_adapters
from orbitctl.plan.storage import base_storage, quant_format

GB, GiB = 1e9, 2**30


def _quant(make_profile, **quant):
    return make_profile(quant=quant).quant


@pytest.mark.parametrize("fmt,extra,bits", [
    ("nf4", {"double_quant": False, "group_size": 64}, 4.5),
    ("nf4", {"double_quant": True, "group_size": 64}, 4 + 8 / 64 + 32 / (64 * 256)),
    ("int4", {"group_size": 32}, 4.5),
    ("int4", {"group_size": 128}, 4.125),
    ("fp8", {}, 8 + 32 / 16384),
    ("none", {}, 16),
])
def test_bits_per_weight(make_profile, fmt, extra, bits):
    assert quant_format(_quant(make_profile, format=fmt, **extra)).bits == pytest.approx(bits)


def test_bnb_metadata_is_replicated_int4_scales_are_sharded(make_profile):
    assert quant_format(_quant(make_profile, format="nf4")).replicated_bits > 0
    assert quant_format(_quant(make_profile, format="int4", group_size=32)).replicated_bits == 0


@pytest.mark.parametrize("arch,total_gb", [("kimi-k2", 594.2), ("deepseek-v3", 402.1)])
def test_int4_g32_experts_only_checkpoint_size(make_profile, arch, total_gb):
    quant = _quant(make_profile, format="int4", group_size=32, modules="experts")
    spec = builtin_arch(arch)
    # the reference counts the router in bf16; the model keeps it in fp32 (2 more bytes each)
    router_upcast = 2 * spec.params_by_kind["router"] / GB
    assert base_storage(spec, quant).total_bytes / GB == pytest.approx(total_gb + router_upcast, abs=0.05)


@pytest.mark.parametrize("arch,targets,millions", [
    ("kimi-k2", "attention", 244), ("kimi-k2", "attention+shared", 355), ("kimi-k2", "attention+mlp", 41_100),
    ("deepseek-v3", "attention", 388), ("deepseek-v3", "attention+shared", 505), ("deepseek-v3", "attention+mlp", 26_800),
])
def test_lora_r64_trainable_parameters(make_profile, arch, targets, millions):
    adapter = make_profile(adapter={"rank": 64, "targets": targets}).adapter
    assert plan_adapters(builtin_arch(arch), adapter).trainable_params / 1e6 == pytest.approx(millions, rel=0.01)


def test_rank_auto_is_hidden_over_ten_and_explicit_targets(make_profile):
    arch = builtin_arch("llama-3.1-8b")
    auto = plan_adapters(arch, make_profile(adapter={"rank": "auto", "targets": ["q_proj", "v_proj"]}).adapter)
    assert auto.rank == 409
    # q: 4096 -> 4096, v: 4096 -> 1024, 32 layers
    assert auto.trainable_params == 32 * 409 * ((4096 + 4096) + (4096 + 1024))


def test_bottleneck_adapter_counts_down_up_and_biases(make_profile):
    arch = builtin_arch("llama-3.1-8b")
    ad = plan_adapters(arch, make_profile(adapter={"kind": "bottleneck", "rank": 256}).adapter)
    assert ad.trainable_params == 32 * (256 * 4096 + 256 + 4096 * 256 + 4096)


def test_unknown_explicit_target_is_a_user_error(make_profile):
    from orbitctl.errors import UserError

    with pytest.raises(UserError, match="no linear module named w9"):
        plan_profile(make_profile(adapter={"targets": ["w9"]}))


def _k2(make_profile, **memory):
    return make_profile(model={"arch": "kimi-k2"}, hardware={"gpu": "b200"},
                        quant={"format": "int4", "group_size": 32, "modules": "experts"},
                        adapter={"rank": 64}, memory={"micro_batch_size": 1, "loss_chunk_size": 4096, **memory})


def test_mla_kv_cache_is_latent_and_replicated_per_tp_rank(make_profile):
    profile = _k2(make_profile)
    base = plan_profile(apply_changes(profile, {"rollout.batch_size": 1, "memory.seq_len": 1000,
                                                "rollout.max_new_tokens": 1000}), with_advice=False)
    assert base.phases["rollout"]["rollout_kv_cache"] == 1000 * 70_272
    tp = plan_profile(apply_changes(profile, {"rollout.batch_size": 1, "memory.seq_len": 1000, "rollout.max_new_tokens": 1000,
                                              "rollout.engine": "separate", "rollout.engine_tp": 8}), with_advice=False)
    assert tp.phases["rollout"]["rollout_kv_cache"] == 8 * 1000 * 70_272


def test_gqa_kv_cache_splits_over_tp(make_profile):
    profile = make_profile(memory={"seq_len": 1000}, rollout={"batch_size": 1, "max_new_tokens": 10,
                                                              "engine": "separate", "engine_tp": 8})
    plan = plan_profile(profile, with_advice=False)
    # 32 layers x 2 x 8 kv heads x 128 x 2 bytes; 8 ranks decode 8 sequences, each keeps 1 head
    assert plan.phases["rollout"]["rollout_kv_cache"] == 1000 * 32 * 2 * 8 * 128 * 2


def test_episodes_keep_every_cache_of_the_step_across_turns(make_profile):
    """A multi-turn rollout keeps each episode's cache for its next turn: 32 episodes per rank (32 prompts x 8 over 8
    ranks) decoded 8 at a time hold 32 caches; a single-turn rollout holds the batch's."""
    per_sequence = 1000 * 32 * 2 * 8 * 128 * 2  # seq_len x layers x K and V x kv heads x head_dim x bf16
    base = {"memory": {"seq_len": 1000}, "rl": {"prompts_per_step": 32, "group_size": 8},
            "data": {"train": "env:guess"}}
    kv = lambda **rollout: plan_profile(make_profile(**base, rollout={"batch_size": 8, "max_new_tokens": 10, **rollout}),  # noqa: E731
                                        with_advice=False).phases["rollout"]["rollout_kv_cache"]
    assert kv(max_turns=4) == 32 * per_sequence
    assert kv(max_turns=1) == 8 * per_sequence


def test_expert_parallel_and_prefetch_shrink_the_gather(make_profile):
    gather = lambda **m: plan_profile(_k2(make_profile, **m), with_advice=False).phases["policy_update"]["zero3_gather"]  # noqa: E731
    full = gather()
    assert gather(expert_parallel=8) < full / 4
    assert gather(prefetch_layers=0) == pytest.approx(full / 2, rel=0.02)


def test_zero_stages_place_the_base(make_profile):
    per_stage = {s: plan_profile(make_profile(hardware={"gpu": "h100", "gpus_per_node": 8},
                                              quant={"format": "int4", "group_size": 128},
                                              memory={"zero_stage": s}), with_advice=False) for s in (0, 2, 3)}
    assert per_stage[0].per_gpu_bytes["base_weights"] == per_stage[2].per_gpu_bytes["base_weights"]
    assert per_stage[3].per_gpu_bytes["base_weights"] == pytest.approx(per_stage[0].per_gpu_bytes["base_weights"] / 8, rel=1e-6)
    assert per_stage[0].phases["policy_update"]["zero3_gather"] == 0 < per_stage[3].phases["policy_update"]["zero3_gather"]


def test_offloads_move_bytes_to_host(make_profile):
    base = _k2(make_profile)
    plan = plan_profile(base, with_advice=False)
    acts = plan_profile(apply_changes(base, {"memory.offload_activations": "cpu"}), with_advice=False)
    assert acts.phases["policy_update"]["activations"] < plan.phases["policy_update"]["activations"]
    assert acts.host_components["offloaded_activations"] > 0 == plan.host_components["offloaded_activations"]
    opt = plan_profile(apply_changes(base, {"memory.offload_optimizer": "cpu"}), with_advice=False)
    assert opt.phases["policy_update"]["optimizer_adam"] == 0 and opt.host_components["offloaded_optimizer"] > 0


def test_activation_switches_move_the_right_terms(make_profile):
    base = make_profile(memory={"micro_batch_size": 2, "seq_len": 2048})
    plan = lambda **c: plan_profile(apply_changes(base, c), with_advice=False).phases["policy_update"]  # noqa: E731
    ref = plan()
    no_ckpt = plan(**{"memory.gradient_checkpointing": False})
    assert no_ckpt["activations"] > 3 * ref["activations"]
    eager = plan(**{"memory.flash_attention": False, "memory.gradient_checkpointing": False})
    assert eager["activations"] > no_ckpt["activations"]
    chunked = plan(**{"memory.loss_chunk_size": 512})
    assert chunked["logits_loss"] < ref["logits_loss"] / 4 or ref["logits_loss"] == 0
    dropout = plan(**{"adapter.dropout": 0.1, "memory.gradient_checkpointing": False})
    assert dropout["activations"] > no_ckpt["activations"]


def test_unchunked_logits_are_twelve_bytes_per_vocab_entry(make_profile):
    profile = make_profile(memory={"micro_batch_size": 1, "seq_len": 1024}, adapter={"targets": "attention"})
    plan = plan_profile(profile, with_advice=False)
    assert plan.phases["policy_update"]["logits_loss"] == 12 * 128_256 * 1024


def test_separate_engine_without_sleep_adds_its_copy_to_the_update(make_profile):
    base = _k2(make_profile)
    shared = plan_profile(base, with_advice=False)
    asleep = plan_profile(apply_changes(base, {"rollout.engine": "separate"}), with_advice=False)
    awake = plan_profile(apply_changes(base, {"rollout.engine": "separate", "rollout.engine_sleep": False}),
                         with_advice=False)
    assert "engine_weights" not in asleep.phases["policy_update"]
    assert asleep.host_components["sleeping_engine"] > 0
    base_shard = shared.per_gpu_bytes["base_weights"] + shared.per_gpu_bytes["routed_experts"]
    assert awake.phases["policy_update"]["engine_weights"] == pytest.approx(base_shard * 8, rel=0.01)
    assert not awake.fits


def test_max_micro_batch_is_the_boundary(make_profile):
    profile = _k2(make_profile, seq_len=4096)
    plan = plan_profile(profile, with_advice=False)
    best = plan.max_micro_batch
    assert best >= 1
    at = plan_profile(apply_changes(profile, {"memory.micro_batch_size": best}), with_advice=False)
    over = plan_profile(apply_changes(profile, {"memory.micro_batch_size": best + 1}), with_advice=False)
    assert at.fits and not over.fits


def test_gpu_memory_override_changes_the_verdict(kimi_b200):
    assert plan_profile(kimi_b200).fits
    small = plan_profile(kimi_b200, gpu_memory_bytes=80 * GiB)
    assert not small.fits and small.usable_bytes == int(80 * GiB * 0.9)


def test_every_advice_is_its_own_replan(make_profile):
    profile = _k2(make_profile, micro_batch_size=16, seq_len=8192, gradient_checkpointing=False)
    plan = plan_profile(profile)
    assert not plan.fits and plan.advice
    assert plan.advice[0].fits
    for advice in plan.advice:
        replanned = plan_profile(apply_changes(profile, advice.change), with_advice=False)
        assert replanned.peak_bytes == advice.peak_bytes and replanned.fits == advice.fits
    fits = [a.fits for a in plan.advice]
    assert fits == sorted(fits, reverse=True), "fitting advice comes first"


def test_json_document_has_the_documented_keys(kimi_b200):
    doc = plan_profile(kimi_b200).to_dict()
    for key in ("per_gpu_bytes", "phase_peak_bytes", "peak_bytes", "usable_bytes", "utilization", "fits",
                "max_micro_batch", "host_bytes", "params_total", "params_active", "params_trainable", "advice"):
        assert key in doc
    assert set(doc["phase_peak_bytes"]) == {"policy_update", "rollout", "adapter_sync"}
    assert doc["peak_bytes"] == sum(doc["per_gpu_bytes"].values())


def test_cpu_ranks_plan_their_runtime_and_the_int4_workspace(make_profile, repo):
    """A CPU rank: the runtime term in every phase, the INT4 dequantization workspace as the code allocates it
    (int32 codes + fp32 values + the result, per element of the largest quantized matrix), no per-matmul transient.
    A GPU rank of the same model keeps the fresh bf16 weight and no CPU terms."""
    from orbitctl.plan.budget import CPU_RANK_RUNTIME, INT4_WORKSPACE_BYTES
    from orbitctl.profile import load_profile

    cpu = load_profile(repo / "profiles" / "tiny-moe-cpu.yaml")
    plan = plan_profile(cpu, with_advice=False)
    spec = builtin_arch("tiny-moe")
    largest = base_storage(spec, cpu.quant).largest_dequant_bytes // 2
    assert largest == max(w.numel // w.copies for layer in spec.layers for w in layer.weights if w.kind == "expert")
    for phase in ("rollout", "policy_update", "adapter_sync"):
        assert plan.phases[phase]["cpu_runtime"] == CPU_RANK_RUNTIME
        assert plan.phases[phase]["dequant_workspace"] == largest * (INT4_WORKSPACE_BYTES + 2)  # bf16 result
        assert plan.phases[phase].get("dequant_transient", 0) == 0
    fp32 = plan_profile(apply_changes(cpu, {"quant.compute_dtype": "fp32"}), with_advice=False)
    assert fp32.phases["rollout"]["dequant_workspace"] == largest * INT4_WORKSPACE_BYTES  # the values are the result
    gpu = plan_profile(apply_changes(cpu, {"hardware.gpu": "h100"}), with_advice=False)
    for phase in ("rollout", "policy_update"):
        assert gpu.phases[phase]["cpu_runtime"] == gpu.phases[phase]["dequant_workspace"] == 0
        assert gpu.phases[phase]["dequant_transient"] == 2 * largest
