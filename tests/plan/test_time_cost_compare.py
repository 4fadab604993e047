"""The CPU overhead terms, the price per GPU-hour, `plan --compare` and the sweep's time columns."""

from __future__ import annotations

import json

import pytest

from orbitctl.cli.app import main
from orbitctl.plan import apply_changes, compare_profile, plan_profile, plan_sweep
from orbitctl.plan.ops import op_counts
from orbitctl.plan.timing import GRAPH_KERNEL_S, KERNEL_LAUNCH_S, Peaks
from orbitctl.profile import load_profile


def _profile(repo, name, **change):
    profile = load_profile(str(repo / "profiles" / f"{name}.yaml"))
    return apply_changes(profile, change) if change else profile


def _measured_step(profile, peaks):
    from orbitctl.plan.measure_time import predict_at

    return predict_at(profile, peaks)


@pytest.mark.parametrize("name,change", [("tiny-cpu", {}),
                                         ("tiny-moe-cpu", {"hardware.gpus_per_node": 1, "memory.expert_parallel": 1})])
def test_cpu_prediction_terms_are_non_negative_and_add_up(repo, name, change):
    """The CPU rule: compute + memory + overhead + comm + host (one op after another, then the host's own work);
    overhead = ops x op_s + items x block_s."""
    peaks = Peaks(flops=2e11, hbm=2e10, link=2e10, nic=2e10, op_s=6e-6, synchronous=True, block_s=2e-6,
                  adapter_flops=5e10)
    step = _measured_step(_profile(repo, name, **change), peaks)
    for phase in (step.phases["policy_update"], *step.phases["rollout"].parts.values()):
        for term in (phase.compute_s, phase.memory_s, phase.comm_s, phase.overhead_s, phase.host_s, phase.ops,
                     phase.items):
            assert term >= 0
        assert phase.overhead_s == pytest.approx(phase.ops * 6e-6 + phase.items * 2e-6)
        assert phase.seconds == pytest.approx(phase.compute_s + phase.memory_s + phase.overhead_s + phase.comm_s
                                              + phase.host_s)
        assert phase.ops > 0 and phase.overhead_s > 0
    rollout = step.phases["rollout"]
    assert rollout.seconds == pytest.approx(sum(p.seconds for p in rollout.parts.values()))
    assert step.seconds == pytest.approx(sum(p.seconds for p in step.phases.values()))


def test_gpu_launch_overhead_overlaps_the_kernels(repo):
    """A GPU's host launches eager kernels ahead of the device: the launches count only where they outlast the
    kernels' own time (the serial sum of the classes, floors and gaps); communication and host work add."""
    timing = plan_profile(_profile(repo, "llama-3.1-8b_grpo_qlora-nf4_1x24g"), with_advice=False).timing
    for phase in (timing.phases["policy_update"], *timing.phases["rollout"].parts.values()):
        assert not phase.synchronous
        device = sum(s for term, s in phase.terms.items() if term not in ("launches", "comm", "host"))
        assert phase.terms["launches"] == pytest.approx(max(0.0, phase.ops * KERNEL_LAUNCH_S - device))
        assert phase.seconds == pytest.approx(max(device, phase.ops * KERNEL_LAUNCH_S) + phase.comm_s + phase.host_s)
        assert phase.overhead_s == pytest.approx(phase.terms["kernel floors"] + phase.terms["gaps"]
                                                 + phase.terms["launches"])


def test_graphed_decode_replays_the_eager_steps_kernels_over_the_whole_static_cache(repo):
    """rollout.decode_graphs: a batch's first two decode steps eager, every later step OPS_GRAPH_STEP eager ops and
    the step's kernels replayed; attention over the static cache's whole length. The Kimi-K2 profile's graphed rollout
    faster than its eager one, each phase at or above its floor."""
    from orbitctl.plan import resolve_rollout_batch
    from orbitctl.plan.comm import decode_forwards, decoded_tokens, step_shape
    from orbitctl.plan.ops import GRAPH_EAGER_STEPS, GRAPH_KERNELS_PER_OP, OPS_GRAPH_STEP, OPS_SAMPLE

    profile = resolve_rollout_batch(_profile(repo, "kimi-k2_grpo_int4_8xh200"))
    graphed = plan_profile(profile, with_advice=False).timing
    eager = plan_profile(apply_changes(profile, {"rollout.decode_graphs": False}), with_advice=False).timing
    g, e = graphed.phases["rollout"].parts["decode"], eager.phases["rollout"].parts["decode"]
    rounds, steps, new = step_shape(profile).rollout_rounds, decode_forwards(profile), decoded_tokens(profile)
    step_ops = (e.ops / rounds - new * OPS_SAMPLE) / steps  # eager: every step's ops, and the sampling
    assert e.graph_kernels == 0
    replayed = rounds * (steps - GRAPH_EAGER_STEPS)
    assert g.graph_kernels == pytest.approx(replayed * step_ops * GRAPH_KERNELS_PER_OP)
    assert g.ops == pytest.approx(e.ops - replayed * (step_ops - OPS_GRAPH_STEP))
    assert g.hbm_bytes > e.hbm_bytes and g.flops > e.flops  # the whole static length attended every step
    assert graphed.phases["rollout"].seconds < eager.phases["rollout"].seconds
    for phase in graphed.phases.values():
        assert phase.seconds >= phase.floor_s
    # fp8 KV, a CPU, or an http engine decode eagerly: the same plan as decode_graphs false
    for change in ({"rollout.kv_dtype": "fp8"}, {"rollout.decode_graphs": "auto", "hardware.gpu": "cpu"}):
        other = plan_profile(apply_changes(profile, change), with_advice=False).timing
        assert other.phases["rollout"].parts["decode"].graph_kernels == 0, change


def test_op_counts_grow_with_quantization_adapters_and_experts(repo):
    from orbitctl.plan import _arch
    from orbitctl.plan.adapters import plan_adapters

    plain = _profile(repo, "tiny-moe-cpu", **{"quant.format": "none"})
    quantized = _profile(repo, "tiny-moe-cpu")
    arch = _arch(quantized)
    bare = op_counts(plain, arch)
    counts = op_counts(quantized, arch, plan_adapters(arch, quantized.adapter))
    assert counts.per_expert > bare.per_expert > 0  # INT4 experts dequantize on every use
    assert counts.dense > bare.dense  # LoRA on attention and the shared expert
    assert counts.forward(8) - counts.forward(0) == pytest.approx(8 * counts.per_expert)
    assert counts.trainable_tensors > 0 and bare.trainable_tensors == 0


def test_price_gives_cost_per_step_and_run(repo):
    profile = _profile(repo, "kimi-k2_grpo_int4_8xh200", **{"hardware.price_per_gpu_hour": 2.5})
    timing = plan_profile(profile, with_advice=False).timing
    assert timing.gpu_hours == pytest.approx(timing.seconds * 8 / 3600)
    assert timing.steps == profile.rl.steps  # one optimizer step per rollout batch
    assert timing.cost_per_step == pytest.approx(2.5 * timing.gpu_hours)
    assert timing.cost_per_run == pytest.approx(timing.cost_per_step * timing.steps)
    doc = timing.to_dict()
    assert doc["cost_per_run"] == pytest.approx(timing.cost_per_run) and doc["run_gpu_hours"] > doc["gpu_hours"]
    unpriced = plan_profile(_profile(repo, "kimi-k2_grpo_int4_8xh200"), with_advice=False).timing
    assert unpriced.cost_per_step is None and unpriced.to_dict()["cost_per_run"] is None


def test_price_is_validated(repo, capsys):
    path = str(repo / "profiles" / "tiny-cpu.yaml")
    assert main(["plan", path, "--set", "hardware.price_per_gpu_hour=-1"]) == 2
    assert "price_per_gpu_hour" in capsys.readouterr().err
    assert main(["plan", path, "--set", "hardware.price_per_gpu_hour=1.2"]) == 0
    out = capsys.readouterr().out
    assert "GPU-hours:" in out and "per run" in out and "$" in out


def test_compare_ranks_layouts_engines_and_nodes(repo):
    doc = compare_profile(_profile(repo, "kimi-k2_grpo_int4_8xh200"), ["all"])
    assert doc["axes"] == ["layout", "engine", "nodes"]
    by_axis: dict[str, list[dict]] = {}
    for row in doc["rows"]:
        by_axis.setdefault(row["axis"], []).append(row)
    for rows in by_axis.values():
        assert [r["rank"] for r in rows] == list(range(1, len(rows) + 1))
        assert [r["seconds"] for r in rows] == sorted(r["seconds"] for r in rows)
        assert sum(r["current"] for r in rows) == 1
        own = next(r for r in rows if r["current"])
        assert own["change"] == {} and own["vs_current"] == pytest.approx(1)
    layout = {r["option"]: r for r in by_axis["layout"]}
    assert layout["ZeRO-3 gathers, EP 1"]["seconds"] > 3 * layout["EP 8, replicated"]["seconds"]
    nodes = {r["option"]: r for r in by_axis["nodes"]}
    assert nodes["2 nodes"]["world"] == 16 and nodes["2 nodes"]["seconds"] < nodes["1 node"]["seconds"]
    engine = {r["option"]: r for r in by_axis["engine"]}
    assert engine["separate"]["phase_seconds"]["adapter_sync"] > 0
    assert engine["shared engine"]["phase_seconds"]["adapter_sync"] == 0
    assert any("separate engine" in n for n in doc["notes"])


def test_compare_refuses_axes_that_do_not_apply(repo, capsys):
    dense = str(repo / "profiles" / "llama-3.1-8b_grpo_qlora-nf4_1x24g.yaml")
    assert main(["plan", dense, "--compare", "layout,nodes"]) == 2
    err = capsys.readouterr().err
    assert "layout does not apply" in err and "nodes does not apply" in err and "Traceback" not in err
    assert main(["plan", dense, "--compare", "speed"]) == 2
    assert main(["plan", dense, "--compare", "all", "--sweep", "memory.seq_len=1024,2048"]) == 2
    assert "--sweep" in capsys.readouterr().err
    assert main(["plan", dense, "--compare", "all", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)["comparison"]
    assert doc["axes"] == ["engine"] and any("layout: not compared" in n for n in doc["notes"])


def test_compare_table(repo, capsys):
    assert main(["plan", str(repo / "profiles" / "kimi-k2_grpo_int4_8xb200.yaml"), "--compare", "nodes"]) == 0
    out = capsys.readouterr().out
    assert "--compare" in out and "2 nodes" in out and "1 node*" in out


def test_sweep_rows_carry_gpu_hours_and_cost(repo, capsys):
    profile = _profile(repo, "kimi-k2_grpo_int4_8xh200", **{"hardware.price_per_gpu_hour": 3.0})
    rows = plan_sweep(profile, [("memory.micro_batch_size", [2, 4])])
    for row in rows:
        assert row["gpu_hours"] == pytest.approx(row["step_seconds"] * 8 / 3600)
        assert row["cost_per_step"] == pytest.approx(3.0 * row["gpu_hours"])
    assert main(["plan", str(repo / "profiles" / "kimi-k2_grpo_int4_8xh200.yaml"), "--sweep",
                 "memory.micro_batch_size=2,4"]) == 0
    out = capsys.readouterr().out
    assert "step" in out and "GPU-h" in out


@pytest.mark.parametrize("name, graphs", [("kimi-k2_grpo_int4_8xh200", True),  # launch-bound eager: graphs win
                                          ("llama-3.1-8b_grpo_qlora-nf4_1x24g", False),  # HBM-bound eager already
                                          ("tiny-cpu", False)])  # a CPU decodes eagerly
def test_decode_graphs_auto_takes_the_faster_rollout_the_plan_predicts(repo, name, graphs):
    from orbitctl.plan import graphed_rollout_seconds, resolve_decode_graphs, resolve_rollout_batch

    profile = _profile(repo, name)
    assert profile.rollout.decode_graphs == "auto"
    resolved = resolve_decode_graphs(profile)
    assert resolved.rollout.decode_graphs is graphs
    graphed, eager = graphed_rollout_seconds(resolve_rollout_batch(profile))
    assert (graphed < eager) is graphs and (graphed == eager) is (name == "tiny-cpu")
    plan = plan_profile(profile, with_advice=False)
    assert plan.timing.phases["rollout"].seconds == pytest.approx(min(graphed, eager))
    assert resolve_decode_graphs(apply_changes(profile, {"rollout.decode_graphs": False})).rollout.decode_graphs is False


def test_kernel_rate_interpolates_in_log_rows_between_measured_points():
    peaks = Peaks(flops=1e11, hbm=1e10, link=1e10, nic=1e10, kernel_flops=((1, 1e9), (16, 16e9), (1024, 64e9)))
    assert peaks.kernel_rate(1) == pytest.approx(1e9) and peaks.kernel_rate(0.5) == pytest.approx(1e9)
    assert peaks.kernel_rate(4) == pytest.approx(4e9)  # halfway in log rows: the geometric mean
    assert peaks.kernel_rate(1024) == pytest.approx(64e9) and peaks.kernel_rate(1e6) == pytest.approx(64e9)
    assert Peaks(flops=1e11, hbm=1e10, link=1e10, nic=1e10).kernel_rate(32) == 1e11  # nothing measured: the GEMM's


def test_fused_int4_matmuls_are_timed_at_the_kernels_rate_at_each_phases_rows(repo):
    """quant.kernel fused on a CPU: the frozen base's forward matmuls (all decoder linears of an INT4 tiny-cpu, the
    lm_head and the backward left to the GEMM) cost kernel FLOPs at the kernel's measured rate at the phase's rows."""
    profile = _profile(repo, "tiny-cpu", **{"quant.format": "int4", "quant.kernel": "fused"})
    base = dict(flops=2e11, hbm=2e10, link=2e10, nic=2e10, op_s=6e-6, synchronous=True, block_s=2e-6)
    plain = _measured_step(profile, Peaks(**base))
    slow = _measured_step(profile, Peaks(**base, kernel_flops=((1, 1e9), (100000, 1e9))))
    dequantized = _measured_step(apply_changes(profile, {"quant.kernel": "dequantize"}),
                                 Peaks(**base, kernel_flops=((1, 1e9), (100000, 1e9))))
    for name in ("policy_update", "rollout"):
        fast, kernel = plain.phases[name], slow.phases[name]
        assert 0 < kernel.kernel_flops < kernel.flops
        assert kernel.compute_s == pytest.approx(fast.compute_s + kernel.kernel_flops * (1 / 1e9 - 1 / 2e11))
        assert dequantized.phases[name].kernel_flops == 0
    # a decode step's rows are its batch; an update forward's, the micro-batch's tokens
    decode, update = slow.phases["rollout"].parts["decode"], slow.phases["policy_update"]
    (_, decode_rows), = decode.kernel_work
    (_, update_rows), = update.kernel_work
    assert 1 <= decode_rows < update_rows and update_rows % profile.memory.seq_len == 0


def test_routed_experts_run_the_kernel_at_the_rows_routed_to_each(repo):
    """On an INT4 MoE the experts' kernel FLOPs are timed at the slots an expert meets (tokens x top-k / experts
    hit), far fewer rows than the dense weights' tokens: at a kernel slow on few rows they cost more."""
    profile = _profile(repo, "tiny-moe-cpu", **{"hardware.gpus_per_node": 1, "memory.expert_parallel": 1,
                                                "quant.kernel": "fused", "quant.modules": "all-linear"})
    base = dict(flops=2e11, hbm=2e10, link=2e10, nic=2e10, op_s=6e-6, synchronous=True, block_s=2e-6)
    flat = _measured_step(profile, Peaks(**base, kernel_flops=((1, 1e10), (4096, 1e10))))
    rising = _measured_step(profile, Peaks(**base, kernel_flops=((1, 1e9), (4096, 1e10))))
    decode = flat.phases["rollout"].parts["decode"]
    (dense_flops, dense_rows), (expert_flops, expert_rows) = decode.kernel_work
    assert expert_rows < dense_rows and dense_flops > 0 and expert_flops > 0
    assert rising.phases["rollout"].seconds > flat.phases["rollout"].seconds


def test_fp8_kv_advice_says_it_turns_the_graphed_decode_off(repo):
    """The fp8 KV cache is advised where the rollout phase peaks; on a GPU whose decode replays CUDA graphs the advice
    says the fp8 decode runs eagerly (the static step keeps a bf16 cache), and not where it never graphs."""
    # a fixed rollout batch: under rollout.batch_size auto the cache an fp8 KV saves goes to more sequences
    fixed = {"rollout.batch_size": 36}
    graphed = plan_profile(_profile(repo, "kimi-k2_grpo_int4_8xh200", **fixed)).advice
    eager = plan_profile(_profile(repo, "kimi-k2_grpo_int4_8xh200", **fixed, **{"rollout.decode_graphs": False})).advice
    line = next(a.text for a in graphed if a.change == {"rollout.kv_dtype": "fp8"})
    assert "runs eagerly" in line
    assert "runs eagerly" not in next(a.text for a in eager if a.change == {"rollout.kv_dtype": "fp8"})
