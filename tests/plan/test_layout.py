"""The base layout (expert parallelism x dense layout) and the communication of one RL step, by hand."""

from __future__ import annotations

from pathlib import Path

import pytest

from orbitctl.arch import builtin_arch
from orbitctl.plan import COMM_TERMS, COMPONENTS, apply_changes, plan_profile
from orbitctl.profile import load_profile

REPO = Path(__file__).resolve().parents[2]
KIMI = [REPO / "profiles" / "kimi-k2_grpo_int4_8xb200.yaml", REPO / "profiles" / "kimi-k2_grpo_int4_8xh200.yaml"]


def _plan(profile, **change):
    return plan_profile(apply_changes(profile, change) if change else profile, with_advice=False)


# ---- memory: what each rank holds ---------------------------------------------------------------

@pytest.mark.parametrize("path", KIMI, ids=lambda p: p.stem)
def test_kimi_routed_experts_per_gpu_under_ep8_are_exactly_an_eighth(path):
    profile = load_profile(path)
    assert profile.memory.expert_parallel == 8
    arch = builtin_arch("kimi-k2")
    routed = sum(w.numel for layer in arch.layers for w in layer.weights if w.kind == "expert")
    assert routed == arch.params_by_kind["expert"]
    total = routed * (4 + 16 / 32) / 8  # INT4 g32: 4 bits + a bf16 scale per 32 weights
    plan = _plan(profile)
    for phase in plan.phases.values():
        assert phase["routed_experts"] == int(total / 8)
    assert plan.details["routed_experts_per_gpu"] == 384 // 8 and plan.details["routed_expert_total_bytes"] == int(total)


@pytest.mark.parametrize("path", KIMI, ids=lambda p: p.stem)
def test_no_expert_gather_under_expert_parallelism(path):
    profile = load_profile(path)
    arch = builtin_arch("kimi-k2")
    assert all(p.get("zero3_gather", 0) == 0 for p in _plan(profile).phases.values())  # the dense part is replicated
    sharded = {"memory.zero_stage": 3, "memory.dense_layout": "sharded", "memory.prefetch_layers": 0}
    ep8 = _plan(profile, **sharded)
    ep1 = _plan(profile, **sharded, **{"memory.expert_parallel": 1})
    # EP 8: the largest gathered unit is the bf16 embedding (lm_head is as large), not a MoE layer
    assert ep8.phases["policy_update"]["zero3_gather"] == arch.vocab_size * arch.hidden_size * 2
    assert ep8.phases["rollout"]["zero3_gather"] == arch.vocab_size * arch.hidden_size * 2
    # EP 1: a MoE layer with all 384 experts, INT4 g32
    one_layer_experts = max(sum(w.numel for w in layer.weights if w.kind == "expert") for layer in arch.layers)
    assert ep1.phases["policy_update"]["zero3_gather"] > one_layer_experts * 4.5 / 8
    # the same bytes resident either way: an eighth of the experts and of the dense part
    for plan in (ep1, ep8):
        assert plan.per_gpu_bytes["routed_experts"] == pytest.approx(_plan(profile).per_gpu_bytes["routed_experts"], rel=1e-9)


def test_dense_layout_replicated_keeps_the_whole_dense_part(kimi_b200):
    replicated = _plan(kimi_b200)
    sharded = _plan(kimi_b200, **{"memory.zero_stage": 3, "memory.dense_layout": "sharded"})
    assert replicated.details["dense_layout"] == "replicated" and sharded.details["dense_layout"] == "sharded"
    assert replicated.per_gpu_bytes["base_weights"] == pytest.approx(8 * sharded.per_gpu_bytes["base_weights"], rel=1e-9)
    assert replicated.per_gpu_bytes["routed_experts"] == sharded.per_gpu_bytes["routed_experts"]
    auto = _plan(kimi_b200, **{"memory.dense_layout": "auto"})  # auto under zero_stage 2 = replicated
    assert auto.peak_bytes == replicated.peak_bytes


def test_bnb_absmax_of_the_experts_is_divided_by_ep(make_profile):
    arch = builtin_arch("qwen3-30b-a3b")
    profile = make_profile(model={"arch": "qwen3-30b-a3b"}, hardware={"gpu": "h100", "gpus_per_node": 8},
                           quant={"format": "nf4", "group_size": 64, "double_quant": True})
    meta = (8 / 64 + 32 / (64 * 256)) / 8  # bytes of absmax per quantized weight
    ep1, ep8 = _plan(profile), _plan(profile, **{"memory.expert_parallel": 8})
    drop = ep1.per_gpu_bytes["quant_state_replicated"] - ep8.per_gpu_bytes["quant_state_replicated"]
    assert drop == pytest.approx(arch.params_by_kind["expert"] * meta * 7 / 8, rel=1e-6)


def test_uneven_experts_round_up_and_dense_models_ignore_ep(make_profile):
    profile = make_profile(model={"arch": "mixtral-8x7b"}, hardware={"gpu": "h100", "gpus_per_node": 6},
                           quant={"format": "int4", "group_size": 128}, memory={"expert_parallel": 3})
    plan = _plan(profile)
    assert plan.details["routed_experts_per_gpu"] == 3  # ceil(8 / 3)
    assert plan.per_gpu_bytes["routed_experts"] == int(plan.details["routed_expert_total_bytes"] * 3 / 8)
    assert any("up to 3 per rank" in n for n in plan.notes)
    dense = _plan(make_profile(hardware={"gpu": "h100", "gpus_per_node": 2}, memory={"expert_parallel": 2}))
    assert dense.per_gpu_bytes["routed_experts"] == 0 and "all_to_all_buffers" not in {
        k for k, v in dense.per_gpu_bytes.items() if v}
    assert any("without routed experts" in n for n in dense.notes)


def test_new_components_and_terms_are_documented(repo):
    doc = (repo / "docs" / "plan.md").read_text()
    for name in ("routed_experts", "all_to_all_buffers", *COMM_TERMS):
        assert f"`{name}`" in doc, name
    assert {"routed_experts", "all_to_all_buffers"} <= set(COMPONENTS)


# ---- communication of one RL step, against hand-derived formulas -----------------------------------

def _small(make_profile, **memory):
    """tiny-qwen3-moe (2 MoE layers, h 64, 8 experts top-2, V 32) in bf16 on 4 GPUs; LoRA r16 on attention."""
    return make_profile(
        model={"arch": "tiny-qwen3-moe"}, hardware={"gpu": "h100", "gpus_per_node": 4},
        quant={"format": "none"}, adapter={"rank": 16, "targets": "attention"},
        memory={"micro_batch_size": 2, "gradient_accumulation_steps": 4, "seq_len": 64, **memory},
        rl={"prompts_per_step": 8, "group_size": 4},
        rollout={"max_new_tokens": 16, "batch_size": 4})


# By hand: 8 x 4 = 32 completions, 8 per GPU, 2 rollout rounds of 1 prefill + 15 decode forwards (16 tokens
# sampled, the last never fed back), 48 prompt tokens each; 4 micro-batches of 2 x 64 = 128 tokens; G = 4.
G, RING = 4, 3 / 4
BASE = 2 * (128_384 - 64)           # every parameter in bf16 but the final norm (not a gather unit)
EXPERTS = 2 * 8 * 3 * 32 * 64 * 2   # 2 layers x 8 experts x gate/up/down 32 x 64, bf16
LORA = 2 * 16 * (128 + 96 + 96 + 128)   # r (in + out) for q, k, v, o, 2 layers: 14,336
LORA_PERSISTENT = 2 * 2 * 16 * 32   # k_proj and v_proj's B (32 x 16 < 10 h = 640 elements) stay whole
ROLLOUT_FORWARDS, MICRO, TOKENS = 2 * (1 + 15), 4, 2 * 64
PER_TOKEN_EXCHANGE = 2 * 2 * 64 * 2  # MoE layers x k x h x bf16


def test_comm_zero3_ep1_by_hand(make_profile):
    comm = _plan(_small(make_profile)).communication
    gathered = (BASE + 2 * (LORA - LORA_PERSISTENT)) * RING
    assert comm.shape.sequences == 8 and comm.shape.rollout_rounds == 2 and comm.shape.micro_batches == MICRO
    assert comm.terms == {
        "zero3_gather_rollout": int(ROLLOUT_FORWARDS * gathered),
        "zero3_gather_train": int(2 * MICRO * gathered),  # forward + backward; the recompute reuses the backward's
        "all_to_all_rollout": 0, "all_to_all_train": 0,
        "adapter_allreduce": int(MICRO * RING * 2 * LORA),  # ZeRO-3: reduce-scatter per micro-batch
    }
    assert comm.link_seconds == pytest.approx(comm.total_bytes / (900e9 / 2))


@pytest.mark.parametrize("p", [2, 4])
def test_comm_expert_parallel_by_hand(make_profile, p):
    plan = _plan(_small(make_profile, expert_parallel=p))
    comm, local = plan.communication, (p - 1) / p
    gathered = (BASE - EXPERTS + 2 * (LORA - LORA_PERSISTENT)) * RING  # no expert is ever gathered
    assert comm.terms["zero3_gather_rollout"] == int(ROLLOUT_FORWARDS * gathered)
    assert comm.terms["zero3_gather_train"] == int(2 * MICRO * gathered)
    # every token's k vectors out and back (dispatch + combine), 1/P of them to this rank's own experts
    assert comm.terms["all_to_all_rollout"] == int(2 * PER_TOKEN_EXCHANGE * local * 8 * (48 + 15))
    # forward, recompute and backward: three passes of two exchanges per micro-batch
    assert comm.terms["all_to_all_train"] == int(2 * PER_TOKEN_EXCHANGE * local * TOKENS * 3 * MICRO)
    # buffers: one MoE layer in flight, tokens x k x h x bf16, send + receive, dispatch + combine
    assert plan.phases["policy_update"]["all_to_all_buffers"] == 4 * TOKENS * 2 * 64 * 2
    assert plan.phases["rollout"]["all_to_all_buffers"] == 4 * (4 * 48) * 2 * 64 * 2
    assert plan.phases["policy_update"]["routed_experts"] == int(EXPERTS / p)


def test_comm_replicated_dense_gathers_nothing_and_zero2_reduces_per_micro_batch(make_profile):
    comm = _plan(_small(make_profile, expert_parallel=4, zero_stage=2)).communication
    assert comm.terms["zero3_gather_rollout"] == comm.terms["zero3_gather_train"] == 0
    assert comm.terms["adapter_allreduce"] == int((MICRO + 1) * RING * 2 * LORA)  # + the updated weights' all-gather
    stage0 = _plan(_small(make_profile, expert_parallel=4, zero_stage=0)).communication
    assert stage0.terms["adapter_allreduce"] == int(2 * RING * 2 * LORA)  # one all-reduce per optimizer step


def test_comm_counts_ppo_epochs_log_prob_and_reference_passes(make_profile):
    base = _small(make_profile, expert_parallel=2, gradient_checkpointing=False)
    profile = apply_changes(base, {"rl.ppo_epochs": 2, "rl.minibatches": 2, "rl.kl_ref_coef": 0.1})
    comm = _plan(profile).communication
    micro, no_grad = 2 * 4, 4 + 2 * 4  # epochs x micro-batches; old log-probs once + a reference pass each
    assert (comm.shape.micro_batches, comm.shape.no_grad_passes, comm.shape.optimizer_steps) == (micro, no_grad, 4)
    gathered = (BASE - EXPERTS + 2 * (LORA - LORA_PERSISTENT)) * RING
    assert comm.terms["zero3_gather_train"] == int((2 * micro + no_grad) * gathered)
    assert comm.terms["all_to_all_train"] == int(2 * PER_TOKEN_EXCHANGE / 2 * TOKENS * (2 * micro + no_grad))


def test_separate_engine_and_one_gpu_send_nothing_from_the_trainer_in_rollout(make_profile):
    separate = _plan(_small(make_profile, expert_parallel=2), **{"rollout.engine": "separate"}).communication
    assert separate.terms["zero3_gather_rollout"] == separate.terms["all_to_all_rollout"] == 0
    alone = _plan(make_profile(hardware={"gpu": "h100", "gpus_per_node": 1})).communication
    assert alone.total_bytes == 0


# ---- the layouts compared -------------------------------------------------------------------------

def test_layout_comparison_rows_are_replans(kimi_b200):
    plan = plan_profile(kimi_b200)
    assert [r["current"] for r in plan.layouts] == [True, False, False, False]
    for row in plan.layouts[1:]:
        other = plan_profile(apply_changes(kimi_b200, row["change"]), with_advice=False)
        assert (other.peak_bytes, other.fits, other.max_micro_batch) == (row["peak_bytes"], row["fits"],
                                                                          row["max_micro_batch"])
        assert other.communication.total_bytes == row["total_bytes"] == sum(row["bytes"].values())
    assert sum(r["best"] for r in plan.layouts) == 1


def test_a_slower_layout_gets_a_note_naming_the_faster_one(kimi_b200):
    slow = plan_profile(apply_changes(kimi_b200, {"memory.expert_parallel": 1, "memory.zero_stage": 3,
                                                  "memory.dense_layout": "sharded"}))
    note = next(n for n in slow.notes if n.startswith("layout "))
    assert "EP 8, dense replicated" in note and "--set memory.expert_parallel=8" in note
    assert slow.communication.total_bytes > 100 * plan_profile(kimi_b200).communication.total_bytes
