"""The time model (orbitctl/plan/timing.py): floors, scaling in tokens and batch, layouts and nodes."""

from __future__ import annotations

import pytest

from orbitctl.plan import apply_changes, plan_profile
from orbitctl.plan.timing import Efficiency, attention_flops, touched_experts
from orbitctl.profile import load_profile
from orbitctl.profile.gpus import resolve_gpu

PROFILES = ["deepseek-v3_grpo_int4_8xh200", "kimi-k2_grpo_int4_8xb200", "kimi-k2_grpo_int4_8xh200",
            "llama-3.1-70b_grpo_qlora-nf4_2x24g", "llama-3.1-8b_grpo_qlora-nf4_1x24g",
            "qwen3-235b-a22b_grpo_int4_8xh100", "smollm2-135m-agent-cpu", "smollm2-135m-cpu",
            "tiny-cpu", "tiny-cpu-http", "tiny-moe-cpu"]


def _profile(repo, name, **change):
    profile = load_profile(str(repo / "profiles" / f"{name}.yaml"))
    return apply_changes(profile, change) if change else profile


def _timing(profile):
    return plan_profile(profile, with_advice=False).timing


def test_every_shipped_profile_is_listed(repo):
    assert sorted(p.stem for p in (repo / "profiles").glob("*.yaml")) == sorted(PROFILES)


@pytest.mark.parametrize("name", PROFILES)
def test_every_phase_is_at_least_its_physical_floor(repo, name):
    profile = _profile(repo, name)
    timing = _timing(profile)
    spec = resolve_gpu(profile.hardware.gpu)
    flops, hbm = spec.bf16_tflops * 1e12, spec.hbm_bandwidth_gbs * 1e9
    link = spec.p2p_bandwidth_gbs * 1e9 / 2 or hbm
    nic = Efficiency().nic_gbits_per_gpu * 1e9 / 8
    assert timing.seconds > 0
    for phase in timing.phases.values():
        for part in (phase, *phase.parts.values()):
            floor = max(part.flops / flops, part.hbm_bytes / hbm, part.intra_bytes / link + part.inter_bytes / nic)
            assert part.floor_s == pytest.approx(floor)
            assert part.seconds >= floor * (1 - 1e-12)
            # the terms sum to the phase; a GPU's kernel classes each at least their FLOPs and bytes at the peaks
            assert sum(part.all_terms().values()) == pytest.approx(part.seconds)
            for w in part.work.values():
                assert part.seconds >= w.flops / flops and part.seconds >= w.bytes / hbm


def _decode(repo, name, **change):
    return _timing(_profile(repo, name, **change)).phases["rollout"].parts["decode"]


@pytest.mark.parametrize("name", ["kimi-k2_grpo_int4_8xh200", "llama-3.1-8b_grpo_qlora-nf4_1x24g"])
def test_decode_time_is_linear_in_max_new_tokens(repo, name):
    """Each decoded token reads the same weights; only the KV read grows with the context (seq_len and the batch stay:
    ``auto`` fits more sequences where they are shorter). The link time is left out: it carries the prompts' exchange
    too (the prefill's share of the all-to-all is counted per forward), a constant that matters once decoding is fast."""
    decodes = [_decode(repo, name, **{"rollout.max_new_tokens": n, "memory.seq_len": 4096, "rollout.batch_size": 16})
               for n in (256, 512, 1024)]
    times = [d.seconds - d.comm_s for d in decodes]
    for n, shorter, longer in zip((256, 512), times, times[1:]):
        # n - 1 decode forwards (the last sampled token is not fed back): at most (2n - 1) / (n - 1) times
        assert 1.9 < longer / shorter <= (2 * n - 1) / (n - 1) + 1e-9


def test_turns_decode_max_new_tokens_each(repo):
    """rollout.max_turns: every turn decodes max_new_tokens policy tokens; 4 turns of 256 are 1024 decoded tokens, fed
    back by 4 x 255 decode forwards (a turn's last token is not fed back) against one turn's 1023."""
    from orbitctl.plan.comm import decode_forwards, step_shape

    base = {"rollout.max_new_tokens": 256, "memory.seq_len": 4096}
    one = _profile(repo, "llama-3.1-8b_grpo_qlora-nf4_1x24g", **{**base, "rollout.max_new_tokens": 1024})
    turns = _profile(repo, "llama-3.1-8b_grpo_qlora-nf4_1x24g", **{**base, "rollout.max_turns": 4})
    assert step_shape(turns).decode_tokens == step_shape(one).decode_tokens
    assert step_shape(turns).prefill_tokens == step_shape(one).prefill_tokens
    assert (decode_forwards(turns), decode_forwards(one)) == (4 * 255, 1023)
    assert step_shape(turns).rollout_forwards == 1 + 4 * 255
    several, single = (_timing(p).phases["rollout"].parts for p in (turns, one))
    assert several["decode"].seconds < single["decode"].seconds
    assert several["decode"].seconds == pytest.approx(single["decode"].seconds, rel=4 / 1023)
    # one turn prefills a group's prompt once; an episode's turns are its own (plan.comm.prefill_rows)
    assert several["prefill"].flops > single["prefill"].flops


def test_decode_time_is_sublinear_in_batch_until_compute_bound(repo):
    """Two rounds of decoding a batch each: doubling the batch costs less than double while HBM-bound, about double once
    compute-bound."""
    name = "llama-3.1-8b_grpo_qlora-nf4_1x24g"
    rows = []
    for batch in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096):
        decode = _decode(repo, name, **{"rollout.batch_size": batch, "rl.prompts_per_step": batch,
                                        "rl.group_size": 2, "memory.seq_len": 1024, "rollout.max_new_tokens": 512})
        rows.append((batch, decode.seconds, decode.bound))
    assert rows[0][2] == "HBM" and rows[-1][2] == "compute"
    for (b1, t1, bound), (b2, t2, _) in zip(rows, rows[1:]):
        assert t2 >= t1
        if bound == "HBM":
            assert t2 < 2 * t1
    compute = [(t1, t2) for (_, t1, b1), (_, t2, b2) in zip(rows, rows[1:]) if b1 == b2 == "compute"]
    assert compute and all(t2 / t1 == pytest.approx(2, rel=0.1) for t1, t2 in compute)


def test_touched_experts_and_attention_terms():
    assert touched_experts(384, 8, 1) == pytest.approx(8)
    assert touched_experts(384, 8, 10_000) == pytest.approx(384)
    assert touched_experts(0, 0, 5) == 0
    assert touched_experts(8, 2, 3) == pytest.approx(8 * (1 - 0.75 ** 3))


def test_attention_flops_grow_with_context(repo):
    from orbitctl.plan import _arch

    arch = _arch(_profile(repo, "kimi-k2_grpo_int4_8xh200"))
    assert attention_flops(arch, 10, 2000) == pytest.approx(2 * attention_flops(arch, 10, 1000))
    assert attention_flops(arch, 10, 1000) == pytest.approx(
        2 * arch.num_layers * arch.num_heads * (arch.qk_nope_head_dim + arch.qk_rope_head_dim + arch.v_head_dim)
        * 1000 * 10)


def test_efficiency_factors_are_overridable(repo):
    from orbitctl.plan import _arch
    from orbitctl.plan.budget import prepare
    from orbitctl.plan.comm import communication
    from orbitctl.plan.layout import layout_of
    from orbitctl.plan.timing import step_time

    profile = _profile(repo, "kimi-k2_grpo_int4_8xh200", **{"rollout.batch_size": 16})  # the formulas take a number
    inp = prepare(profile, _arch(profile))
    layout = layout_of(profile, inp.arch.num_experts)
    comm = communication(profile, inp.arch, inp.storage, layout, inp.adapters)
    base = step_time(profile, inp.arch, inp.storage, layout, comm)
    halved = {k: getattr(base.efficiency, k) / 2 for k in ("compute", "hbm", "link", "experts_hbm", "experts_compute",
                                                            "attention_hbm")}
    half = step_time(profile, inp.arch, inp.storage, layout, comm, eff=Efficiency(**halved))
    # each kernel class's FLOP- or byte-bound time doubles, and the communication; kernel floors and gaps are counts
    # x seconds, no efficiency factor
    for name, part in (("decode", "rollout"), ("policy_update", None)):
        fast = base.phases[part].parts[name] if part else base.phases[name]
        slow = half.phases[part].parts[name] if part else half.phases[name]
        for term in ("experts HBM", "experts compute", "dense compute", "attention compute", "comm"):
            if fast.terms.get(term):
                assert slow.terms[term] == pytest.approx(2 * fast.terms[term]), (name, term)
        assert slow.terms["gaps"] == pytest.approx(fast.terms["gaps"]) and fast.terms["gaps"] > 0
    assert base.phases["rollout"].parts["decode"].terms["experts HBM"] > 0
    assert base.phases["policy_update"].terms["experts compute"] > 0


def test_kimi_rollout_under_zero3_gathers_is_slower_than_under_expert_parallelism(repo):
    plan = plan_profile(_profile(repo, "kimi-k2_grpo_int4_8xh200"))
    rows = {row["layout"]: row for row in plan.layouts}
    ep, zero3 = rows["EP 8, dense replicated"], rows["EP 1, dense sharded"]
    assert zero3["rollout_seconds"] > 3 * ep["rollout_seconds"]
    # EP's decode replays CUDA graphs over grouped experts: it reads the weights once a step (HBM-bound); ZeRO-3's
    # gathers keep it eager, its experts looping over the 105 of 384 a batch hits per layer (launch-bound, ops.py),
    # and add hours of interconnect on top
    assert ep["bound"]["rollout"] == "HBM" and zero3["bound"]["rollout"] == "overhead"
    gathers = _timing(_profile(repo, "kimi-k2_grpo_int4_8xh200", **zero3["change"]))
    assert gathers.phases["rollout"].comm_s > 3600
    assert ep["fastest"] and sum(r["fastest"] for r in plan.layouts) == 1


def test_kimi_on_two_nodes_halves_the_step_at_equal_gpu_hours(repo):
    """EP stays inside a node and the dense part is replicated: only the adapter reduction crosses nodes."""
    plan = plan_profile(_profile(repo, "kimi-k2_grpo_int4_8xh200"))
    one, two = plan.nodes
    assert (one["nodes"], two["nodes"], two["world"]) == (1, 2, 16)
    assert two["seconds"] == pytest.approx(one["seconds"] / 2, rel=0.05)
    assert two["gpu_hours"] == pytest.approx(one["gpu_hours"], rel=0.05) and two["gpu_hours"] >= one["gpu_hours"]


def test_zero3_layout_across_nodes_pays_the_nic(repo):
    profile = _profile(repo, "kimi-k2_grpo_int4_8xh200", **{"memory.expert_parallel": 1, "memory.zero_stage": 3,
                                                                  "memory.dense_layout": "sharded"})
    one = _timing(profile)
    two = _timing(apply_changes(profile, {"hardware.nodes": 2}))
    assert two.phases["rollout"].inter_bytes > 0 and two.gpu_hours > 2 * one.gpu_hours


def test_json_has_the_timing(repo):
    doc = plan_profile(_profile(repo, "tiny-moe-cpu")).to_dict()
    timing = doc["timing"]
    assert set(timing["phases"]) == {"rollout", "policy_update", "adapter_sync"}
    assert timing["phases"]["adapter_sync"]["seconds"] == 0  # the shared engine: nothing to push
    assert timing["rollout_tokens_per_s"] > 0 and timing["update_tokens_per_s"] > 0 and timing["gpu_hours"] > 0
    assert {"step_seconds", "rollout_seconds", "fastest"} <= set(doc["layouts"][0])


def test_measure_time_refuses_more_than_one_rank_before_importing_torch(repo):
    import subprocess
    import sys

    script = ("import sys\nfrom orbitctl.cli.app import main\n"
              f"code = main(['plan', r'{repo / 'profiles' / 'tiny-moe-cpu.yaml'}', '--measure-time'])\n"
              "print(code, 'torch' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=repo, timeout=120)
    assert proc.stdout.split()[-2:] == ["2", "False"], proc.stdout + proc.stderr


def test_measure_time_times_one_real_step_of_tiny_cpu(repo):
    from orbitctl.plan.measure_time import measure_time

    m = measure_time(_profile(repo, "tiny-cpu"))
    rows = {row["phase"]: row for row in m.rows}
    assert set(rows) == {"rollout", "policy_update"}
    assert all(row["measured_s"] > 0 and row["predicted_s"] > 0 for row in rows.values())
    assert m.flops_per_s > 0 and m.bytes_per_s > 0
    assert set(m.to_dict()) == {"flops_per_s", "bytes_per_s", "rates", "rows", "predicted", "notes"}
    assert m.rates["op_s"] > 0 and m.rates["attention_block_s"] > 0 and m.rates["threads"] == 1
    # the host's rates, with the demo's own character tokenizer and prompts
    assert all(m.rates[key] > 0 for key in ("encode_token_s", "decode_token_s", "keyed_draw_s"))
    assert m.predicted.phases["rollout"].host_s > 0


def test_sweep_rows_carry_the_predicted_time(repo):
    from orbitctl.plan import plan_sweep

    rows = plan_sweep(_profile(repo, "kimi-k2_grpo_int4_8xh200"), [("rollout.batch_size", [8, 32])])
    assert rows[0]["phase_seconds"]["rollout"] > rows[1]["phase_seconds"]["rollout"]  # fewer weight reads per token
    assert all(row["step_seconds"] == pytest.approx(sum(row["phase_seconds"].values())) for row in rows)


@pytest.mark.parametrize("batch, group, rows", [(64, 8, 8), (4, 8, 1), (12, 8, 3), (16, 16, 1)])
def test_a_groups_prompt_is_prefilled_once(repo, batch, group, rows):
    """The sampler prefills each distinct prompt of a rollout batch once (Policy.sample); the plan counts those rows."""
    from orbitctl.plan.comm import prefill_rows

    change = {"rollout.batch_size": batch, "rl.group_size": group, "rl.prompts_per_step": 64 // group}
    profile = _profile(repo, "llama-3.1-8b_grpo_qlora-nf4_1x24g", **change)
    assert prefill_rows(profile, batch) == rows
    # 12 rows in groups of 8 hold at most 3 prompts; the time is the prefill of those rows, not of every sequence
    assert rows >= -(-batch // group)


def test_the_rollout_counts_its_serial_host_work(repo, monkeypatch):
    """The host's work in a rollout, added to its seconds and never overlapped: each prompt's tokens encoded once
    before the prefill (a group shares its prompt), each completion's tokens turned back into text after the decode,
    each row's keyed uniform at each sampled token (the inverse CDF runs on the device); on a GPU also each decode
    step's read of the done flag and the expert-parallel lockstep's all-reduce. A CPU has no device to wait for, but
    the same tokenizer and draws."""
    from orbitctl.plan import timing
    from orbitctl.plan.comm import completions_per_gpu, decode_forwards, decoded_tokens, prompt_tokens

    def host_s(profile, sync=0.0, lockstep=0.0, draw=0.0, encode=0.0, decode=0.0):
        for name, value in (("HOST_SYNC_S", sync), ("LOCKSTEP_S", lockstep), ("KEYED_DRAW_S", draw),
                            ("ENCODE_TOKEN_S", encode), ("DECODE_TOKEN_S", decode)):
            monkeypatch.setattr(timing, name, value)
        rollout = plan_profile(profile, with_advice=False).timing.phases["rollout"]
        return rollout.parts["prefill"].host_s, rollout.parts["decode"].host_s

    kimi = _profile(repo, "kimi-k2_grpo_int4_8xh200")
    sequences, new = completions_per_gpu(kimi), decoded_tokens(kimi)
    assert (new, decode_forwards(kimi)) == (3072, 3071)
    rounds = 4  # of sequences / 4 rows each
    assert host_s(kimi, sync=1.0) == (0.0, rounds * 3071)  # every decode forward of every round, once
    assert host_s(kimi, lockstep=1.0) == (0.0, rounds * 3071)  # EP 8: one lockstep a forward
    assert host_s(kimi, draw=1.0) == (0.0, sequences * new)  # one uniform per row and sampled token
    assert host_s(kimi, encode=1.0) == (sequences / 8 * prompt_tokens(kimi), 0.0)  # groups of 8 share a prompt
    assert host_s(kimi, decode=1.0) == (0.0, sequences * new)
    monkeypatch.undo()
    rollout = plan_profile(kimi, with_advice=False).timing.phases["rollout"]
    prefill, decode = rollout.parts["prefill"], rollout.parts["decode"]
    assert decode.host_s == pytest.approx(rounds * 3071 * (timing.HOST_SYNC_S + timing.LOCKSTEP_S)
                                          + sequences * new * (timing.KEYED_DRAW_S + timing.DECODE_TOKEN_S))
    assert decode.terms["host"] == decode.host_s and prefill.terms["host"] == prefill.host_s > 0
    assert decode.seconds == pytest.approx(sum(decode.terms.values()))
    assert rollout.host_s == pytest.approx(prefill.host_s + decode.host_s)
    # the CPU demo: 32 prompts, 256 completions of 2 tokens, no done flag to wait for
    tiny = _profile(repo, "tiny-cpu")
    assert host_s(tiny, sync=1.0, lockstep=1.0) == (0.0, 0.0)
    assert host_s(tiny, draw=1.0) == (0.0, 256 * 2)
    assert host_s(tiny, encode=1.0) == (32 * prompt_tokens(tiny), 0.0)
    assert host_s(tiny, decode=1.0) == (0.0, 256 * 2)
    monkeypatch.undo()
    decode = plan_profile(tiny, with_advice=False).timing.phases["rollout"].parts["decode"]
    # named for what it is on a CPU: no device to wait for, its rates the tokenizer's and the draws'
    assert decode.terms["cpu host"] == decode.host_s > 0 and "host" not in decode.terms
    assert timing.TERM_RATES["cpu host"] == ("keyed_draw_s", "encode_token_s", "decode_token_s")
