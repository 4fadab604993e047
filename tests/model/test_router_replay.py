"""Router replay (R3): the infer path records each sampled token's experts, the train path runs exactly those.

The infer path is made to differ from the train path by an fp8 KV cache (``rollout.kv_dtype: fp8``), which is
enough to flip some tokens' top-k experts on the tiny MoE: routing agreement falls below 1, and replay makes the
train path run the recorded experts (compared index by index) and brings the mismatch of the tokens a flip
reaches down to what the numerics alone leave.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from orbitctl.model.router_replay import NOT_RECORDED, RouterTape, gate_weights, routers_of, same_set

ROOT = Path(__file__).resolve().parents[2]


def _hf_moe(model_type: str, **overrides):
    from transformers import AutoModelForCausalLM

    from orbitctl.model.tiny import tiny_config

    torch.manual_seed(0)
    values = {"n_routed_experts": 8} if model_type == "deepseek_v3" else {"num_experts": 8}
    config = tiny_config(model_type, num_experts_per_tok=2, num_hidden_layers=3, **values, **overrides)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


@pytest.mark.parametrize("model_type, overrides", [
    ("deepseek_v3", {}),
    ("deepseek_v3", {"norm_topk_prob": True, "routed_scaling_factor": 2.5}),
    ("qwen3_moe", {}),
    ("qwen3_moe", {"norm_topk_prob": False}),
])
def test_the_recomputed_gate_weights_are_the_routers_own_on_its_own_choice(model_type, overrides):
    model = _hf_moe(model_type, **overrides)
    routers = routers_of(model)
    assert routers and all(r.top_k == 2 for r in routers)
    for router in routers:
        with torch.no_grad():
            router.weight.normal_(0.0, 0.3)
        hidden = torch.randn(64, router.weight.shape[1])
        logits, weights, indices = router(hidden)
        assert torch.equal(gate_weights(router, logits, indices), weights)


def test_replaying_the_models_own_routing_changes_nothing_and_another_routing_trains_the_router():
    model = _hf_moe("deepseek_v3")
    model.train()
    tape = RouterTape.attach(model)
    ids = torch.randint(0, 256, (3, 7))
    tape.follow(torch.full((3, 4, tape.layers, 2), NOT_RECORDED, dtype=torch.int16), 3, replay=True)
    plain = model(input_ids=ids).logits
    own = torch.stack([o.reshape(3, 7, 2)[:, 3:] for o in tape.own], dim=2)  # the router's choice, completion part
    tape.follow(own, 3, replay=True)
    assert torch.equal(model(input_ids=ids).logits, plain)
    # another routing: the completion runs it, the prompt keeps its own, and the router gets a gradient
    other = (own + 1) % 8
    for router in tape.routers:
        router.weight.requires_grad_(True)
        router.weight.grad = None
    tape.follow(other, 3, replay=True)
    replayed = model(input_ids=ids).logits
    # the prompt routes itself: before the first replayed token only the experts' row batching differs
    torch.testing.assert_close(replayed[:, :3], plain[:, :3], rtol=1e-5, atol=1e-6)
    assert not torch.allclose(replayed[:, 3:], plain[:, 3:])
    for layer, ran in enumerate(tape.replayed):
        assert torch.equal(ran.reshape(3, 7, 2)[:, 3:], other[:, :, layer].long())
    replayed.float().pow(2).mean().backward()
    assert all(r.weight.grad is not None and r.weight.grad.abs().sum() > 0 for r in tape.routers)


def test_a_checkpointed_layer_replays_the_same_experts_in_its_recomputation():
    model = _hf_moe("deepseek_v3")
    model.train()
    tape = RouterTape.attach(model)
    ids = torch.randint(0, 256, (2, 9))
    routes = torch.randint(0, 8, (2, 5, tape.layers, 2), generator=torch.Generator().manual_seed(1))
    routes[..., 1] = (routes[..., 0] + 1 + routes[..., 1] % 7) % 8  # two distinct experts per token
    params = [p for p in model.parameters() if p.dtype.is_floating_point]

    def grads(checkpointing: bool):
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_disable()
        model.zero_grad()
        tape.follow(routes.to(torch.int16), 4, replay=True)
        model(input_ids=ids).logits.float().pow(2).mean().backward()
        return [p.grad.clone() for p in params if p.grad is not None]

    plain, checkpointed = grads(False), grads(True)
    assert len(plain) == len(checkpointed) > 0
    for a, b in zip(plain, checkpointed):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


@pytest.fixture(scope="module")
def fp8_moe_policy(tmp_path_factory, model_cache):
    """The tiny MoE profile on one process, its infer path decoding through an fp8 KV cache, computing in fp32
    whatever the CPU: in bf16 (``auto`` on a CPU with native bf16) the paths' rounding differs as much as a flipped
    expert, and what replay removes is not seen apart from it."""
    from orbitctl.builder import load_policy, prepare_frozen_base
    from orbitctl.data.prompts import load_prompts
    from orbitctl.profile import load_profile

    run = tmp_path_factory.mktemp("r3")
    profile = load_profile(ROOT / "profiles" / "tiny-moe-cpu.yaml",
                           ["memory.expert_parallel=1", "hardware.gpus_per_node=1", "rollout.kv_dtype=fp8",
                            "quant.compute_dtype=fp32", "adapter.dtype=fp32", f"run.dir={run}"])
    split = load_prompts(profile.data, profile.run.seed)
    policy = load_policy(profile, prepare_frozen_base(profile, split.warm_task))
    items = (split.train + split.eval)[:600]
    ids, mask = policy.encode_prompts([item.prompt for item in items])
    samples = policy.sample(ids, mask, max_new_tokens=8, temperature=1.0, top_p=1.0,
                            generator=torch.Generator().manual_seed(3), keep_logits=True)
    return policy, samples


def _js(train_logits, infer_logits):
    from orbitctl.distances import js_divergence

    return js_divergence(torch.log_softmax(train_logits.double(), -1), torch.log_softmax(infer_logits.double(), -1))


def test_the_infer_path_records_every_fed_token_and_replay_runs_exactly_those_experts(fp8_moe_policy):
    policy, s = fp8_moe_policy
    batch, width = s.completion_ids.shape
    assert s.routes.shape == (batch, width, policy.routing.layers, 2) and s.routes.dtype == torch.int16
    recorded = (s.routes >= 0).all(-1).all(-1)
    # a token is recorded exactly when it was sampled and fed back: every sampled token but the last step's
    fed = s.completion_mask.bool().clone()
    fed[:, -1] = False
    assert torch.equal(recorded, fed) and fed.any()
    prompt = s.prompt_ids.shape[1]
    with torch.no_grad():
        own = policy.completion_logits(s.prompt_ids, s.prompt_mask, s.completion_ids, s.completion_mask,
                                       routes=s.routes, replay=False)
    agreement = policy.routing_agreement(s.routes, prompt, s.completion_mask)
    assert sum(agreement.compared) == int(fed.sum()) * policy.routing.layers
    assert 0.5 < agreement.overall < 1.0, agreement  # fp8 KV flips some tokens' experts, not most
    chosen = [o.reshape(batch, -1, 2)[:, prompt:].cpu() for o in policy.routing.own]
    flipped = torch.zeros(batch, width, dtype=torch.bool)
    for layer, mine in enumerate(chosen):
        flipped |= recorded & ~same_set(mine, s.routes[:, :, layer].long())
    with torch.no_grad():
        replayed = policy.completion_logits(s.prompt_ids, s.prompt_mask, s.completion_ids, s.completion_mask,
                                            routes=s.routes, replay=True)
    for layer, ran in enumerate(policy.routing.replayed):
        ran = ran.reshape(batch, -1, 2)[:, prompt:].cpu()
        assert torch.equal(ran[recorded], s.routes[:, :, layer].long()[recorded])
    # the tokens a flip reaches (after it in the same row): replay removes what the flip added
    reached = torch.zeros_like(flipped)
    reached[:, 1:] = flipped.long().cumsum(1)[:, :-1] > 0
    reached &= s.completion_mask.bool()
    assert reached.sum() > 0
    js_own, js_replayed = _js(own[reached], s.logits[reached]), _js(replayed[reached], s.logits[reached])
    assert js_replayed.mean() < 0.5 * js_own.mean(), (float(js_own.mean()), float(js_replayed.mean()))
    # elsewhere both paths ran the same experts: replay changes nothing there
    untouched = s.completion_mask.bool() & ~reached
    torch.testing.assert_close(replayed[untouched], own[untouched], rtol=0, atol=0)


def test_the_routing_of_a_finished_row_is_not_recorded(fp8_moe_policy):
    policy, s = fp8_moe_policy
    finished = ~s.completion_mask.bool()
    assert finished.any()
    assert (s.routes[finished] == NOT_RECORDED).all()


def test_the_prompts_routing_is_recorded_at_prefill_and_padding_is_not(fp8_moe_policy):
    policy, s = fp8_moe_policy
    batch, width = s.prompt_ids.shape
    assert s.prompt_routes.shape == (batch, width, policy.routing.layers, 2)
    real = s.prompt_mask.bool()
    assert ((s.prompt_routes[real] >= 0) & (s.prompt_routes[real] < 8)).all()
    ids, mask = policy.encode_prompts(["12", "1234567"])  # left padding on the shorter prompt
    padded = policy.sample(ids, mask, max_new_tokens=2, temperature=0.0, top_p=1.0, generator=None)
    assert (padded.prompt_routes[~mask.bool()] == NOT_RECORDED).all() and (~mask.bool()).any()
    assert (padded.prompt_routes[mask.bool()] >= 0).all()
    # the train path routes the prompt itself, and on this infer path's prompt almost always alike
    with torch.no_grad():
        policy.completion_logits(s.prompt_ids, s.prompt_mask, s.completion_ids, s.completion_mask, routes=s.routes,
                                 replay=False)
    for layer, own in enumerate(policy.routing.own):
        mine = own.reshape(batch, -1, 2)[:, :width].cpu()
        agree = same_set(mine, s.prompt_routes[:, :, layer].long())[real].float().mean()
        assert agree > 0.9, (layer, float(agree))


def test_the_plan_counts_the_routing_the_tape_holds(fp8_moe_policy):
    """Per token the plan's routing record is what the tape holds on the device: k int64 indices per MoE layer while
    decoding, and in the update the routing to replay, the router's own choice and the experts run."""
    from orbitctl.arch import model_arch
    from orbitctl.plan.budget import routing_record
    from orbitctl.profile import load_profile

    policy, s = fp8_moe_policy
    tape = policy.routing
    arch = model_arch(load_profile(ROOT / "profiles" / "tiny-moe-cpu.yaml").model)
    held = []
    take = tape.take

    def measured_take(*args, **kwargs):
        held.append((sum(c.numel() for calls in tape._recorded for c in calls) // (tape.layers * tape.top_k),
                     sum(c.nbytes for calls in tape._recorded for c in calls)))
        return take(*args, **kwargs)

    tape.take = measured_take
    try:
        ids, mask = policy.encode_prompts(["1234", "56"])
        policy.sample(ids, mask, max_new_tokens=6, temperature=1.0, top_p=1.0,
                      generator=torch.Generator().manual_seed(0))
    finally:
        del tape.take
    tokens, nbytes = held[0]
    assert tokens > 0 and nbytes == routing_record(arch, tokens)
    batch, width = s.completion_ids.shape
    with torch.no_grad():
        policy.completion_logits(s.prompt_ids, s.prompt_mask, s.completion_ids, s.completion_mask, routes=s.routes,
                                 replay=True)
    rows = batch * (s.prompt_ids.shape[1] + width)
    kept = sum(t.nbytes for group in (tape._replay, tape.own, tape.replayed) for t in group)
    assert kept == 3 * routing_record(arch, rows)


@pytest.mark.parametrize("profile, sets, refused", [
    ("tiny-cpu.yaml", [], True),                                                   # a dense model: nothing to replay
    ("tiny-cpu-http.yaml", ["model.arch=tiny-moe"], True),                         # vLLM returns no routed experts
    ("tiny-cpu-http.yaml", ["model.arch=tiny-moe", "rollout.engine_api=sglang"], False),
    ("tiny-moe-cpu.yaml", [], False),
])
def test_router_replay_is_refused_where_it_would_do_nothing(profile, sets, refused, tmp_path, one_error_line):
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "orbitctl.cli.app", "train", str(ROOT / "profiles" / profile),
                           "--dry-run", "--set", "rl.router_replay=true", *[a for s in sets for a in ("--set", s)]],
                          capture_output=True, text=True, cwd=tmp_path)
    if refused:
        assert done.returncode == 2
        one_error_line(done.stderr, "rl.router_replay")
    else:
        assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("replay", [False, True])
def test_the_update_reports_routing_agreement_and_replays_what_it_is_told(fp8_moe_policy, replay):
    """One micro-batch of the update's loss on the recorded batch: its step statistics carry the agreement of the
    train path's own routing with the rollout's (below 1 with fp8 KV on the infer path), and with
    ``rl.router_replay`` its forward ran the recorded experts."""
    from orbitctl.profile import load_profile
    from orbitctl.rl.update import StepStats, micro_loss

    policy, s = fp8_moe_policy
    profile = load_profile(ROOT / "profiles" / "tiny-moe-cpu.yaml",
                           ["memory.expert_parallel=1", "hardware.gpus_per_node=1", "rl.align_loss.weight=0",
                            f"rl.router_replay={str(replay).lower()}"])
    rows = slice(0, 256)
    mb = {"prompt_ids": s.prompt_ids[rows], "prompt_mask": s.prompt_mask[rows],
          "completion_ids": s.completion_ids[rows], "completion_mask": s.completion_mask[rows],
          "attention": s.completion_mask[rows], "infer_logp": s.logprobs[rows],
          "adv": torch.randn(256, generator=torch.Generator().manual_seed(0))[:, None].expand(-1, s.routes.shape[1]),
          "dist": None, "old_logp": None, "routes": s.routes[rows]}
    stats = StepStats()
    policy.router_replay = replay
    try:
        loss = micro_loss(policy, mb, profile, float(s.completion_mask[rows].sum()), stats)
        loss.backward()
    finally:
        policy.router_replay = False
        policy.model.zero_grad(set_to_none=True)
    means = stats.means()
    expected = policy.routing_agreement(s.routes[rows], s.prompt_ids.shape[1], s.completion_mask[rows])
    assert means["routing_agreement"] == expected.overall < 1.0
    assert means["routing_agreement_per_layer"] == expected.per_layer()
    assert means["routing_agreement_min_layer"] == min(expected.per_layer())
    ran = policy.routing.replayed
    if not replay:
        assert all(r is None for r in ran)
        return
    recorded = (s.routes[rows] >= 0).all(-1)
    for layer, experts in enumerate(ran):
        experts = experts.reshape(256, -1, 2)[:, s.prompt_ids.shape[1]:].cpu()
        assert torch.equal(experts[recorded[:, :, layer]], s.routes[rows][:, :, layer].long()[recorded[:, :, layer]])


@pytest.mark.parametrize("replay", [False, True])
def test_verify_alignment_splits_an_moes_mismatch_into_routing_and_numerics(model_cache, tmp_path, replay):
    """The internal check on the tiny MoE with fp8 KV: the routing agreement per layer, and the mismatch without
    and with replay beside each other; the comparison and its gates take the setting rl.router_replay trains with."""
    from orbitctl.align.api import verify_alignment
    from orbitctl.profile import load_profile

    profile = load_profile(ROOT / "profiles" / "tiny-moe-cpu.yaml",
                           ["memory.expert_parallel=1", "hardware.gpus_per_node=1", "rollout.kv_dtype=fp8",
                            "alignment.num_prompts=16", f"rl.router_replay={str(replay).lower()}",
                            f"run.dir={tmp_path / 'run'}"])
    report = verify_alignment(profile)
    routing = report.to_dict()["source"]["routing"]
    assert routing["replayed_in_comparison"] is replay
    assert routing["tokens_compared"] > 0 and len(routing["agreement_per_layer"]) == 2
    assert 0.0 < routing["agreement"] <= 1.0
    split = routing["mismatch"]
    for metric in ("js", "logsoftmax_l1"):
        parts = split[metric]
        assert parts["routing"] == parts["without_replay"] - parts["with_replay"]
        # the comparison the gates judge is the one the profile trains with
        assert report.summary[metric]["mean"] == parts["with_replay" if replay else "without_replay"]

