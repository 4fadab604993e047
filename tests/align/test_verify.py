"""verify-alignment end to end on the tiny quantized model: agreement passes, injected mismatches fail.

No test assumes the two paths agree bit for bit: that holds on some CPUs only. Agreement is held to
a bound derived from the compute dtype (AGREEMENT_ULPS units in the last place of the largest
logit, :func:`dtype_bound`), and
detection to a ratio over the kernel floor measured in the same test on the same machine.
DETECTION holds, per metric, a few times less than the smallest planted/floor ratio measured with
bf16 compute on two ISAs (benchmarks/alignment_floor.py; fp4 serving, the weakest planted
difference, on a Zen 4 EPYC with its kernels capped to AVX2: JS 466-529x, KL 471-534x, k3 29-52x,
log-softmax L1 14-18x; the floor is exactly 0 with the same CPU's AVX512-BF16 kernels).
"""

from __future__ import annotations

import json

import pytest
import torch

from orbitctl.align.floor import FLOOR_MARGIN, dtype_bound
from orbitctl.align.selfcheck import JUMP_FLOOR, Perturbation
from orbitctl.align.api import verify_alignment

DETECTION = {"js": 50.0, "kl_train_infer": 50.0, "k3": 5.0, "logsoftmax_l1": 3.0}
"""How many times above the floor measured beside it a planted difference must stand, per metric."""
TINY = 1e-300
AGREEMENT_ULPS = 4.0
"""Measured: the same-model floor reaches 1.15 eps-units of the largest logit with fp32 compute
(kernels capped to AVX2), at most 1 with bf16 (its per-layer rounding hides reduction order)."""


def _engine_bound(report, metric: str) -> float:
    """What an engine sampled on the trainer's own infer path may differ by: the floor measured beside
    it (another batch shape than the engine's, so FLOOR_MARGIN of it) plus float32 rounding of its log-probs."""
    floor = report.floor
    return FLOOR_MARGIN * floor.summary[metric]["max"] + dtype_bound("float32", floor.logit_absmax, ulps=4)[metric]


def _failed(report) -> set[str]:
    return {g.metric for g in report.gates if g.status == "FAIL"}


def test_same_format_on_both_paths_passes_with_js_near_zero(align_profile):
    _, profile = align_profile()
    report = verify_alignment(profile, per_layer=True)
    assert report.verdict == "PASS", [g.to_dict() for g in report.gates]
    assert report.tokens >= 24  # every prompt gives at least one token
    # one model on both paths: the comparison is the floor, and the floor is what the dtype explains
    floor = report.floor
    assert floor.is_the_comparison and floor.summary["js"]["max"] == report.summary["js"]["max"]
    assert floor.compute_dtype in ("bfloat16", "float32") and floor.logit_absmax > 0
    bound = dtype_bound(floor.compute_dtype, floor.logit_absmax, ulps=AGREEMENT_ULPS)
    for metric in ("js", "sampled_dlogp_abs", "logsoftmax_l1"):
        assert report.summary[metric]["max"] <= bound[metric], (metric, report.summary[metric]["max"], bound[metric])
    assert [e.name for e in report.layers] == ["embeddings", "layers.0", "layers.1"]
    assert report.layers[0].rel_error == 0.0  # an embedding lookup is exact on every machine
    assert max(e.rel_error for e in report.layers) < JUMP_FLOOR and report.source["first_jump"] is None
    doc = report.to_dict()
    assert doc["floor"]["measured_as"] == floor.measured_as and doc["floor_times"]["js"] == 1.0
    assert "routing" not in doc["source"]  # a dense model: no routing agreement, no split


@pytest.mark.parametrize("layer", [0, 1])
def test_perturbed_infer_weights_fail_the_gate_and_per_layer_names_the_layer(align_profile, layer):
    _, profile = align_profile()
    report = verify_alignment(profile, per_layer=True, perturb=Perturbation(layer, 1.0))
    assert report.verdict == "FAIL"
    assert "logsoftmax_l1" in _failed(report)
    assert report.source["first_jump"]["name"] == f"layers.{layer}"
    assert report.source["first_jump"]["likely_cause"].startswith("weights")
    # a separate copy: the floor was measured beside it with the trainer's own weights
    floor = report.floor
    assert not floor.is_the_comparison and len(floor.layers) == len(report.layers)
    # before the perturbed layer the copy's weights are the trainer's: its error is the floor's
    for e, f in zip(report.layers[:layer + 1], floor.layers[:layer + 1]):
        assert e.rel_error <= f * (1 + 1e-6) + TINY, (e.name, e.rel_error, f)
    planted = report.layers[layer + 1]
    assert planted.rel_error > JUMP_FLOOR and planted.rel_error >= FLOOR_MARGIN * floor.layers[layer + 1]
    for metric, times in DETECTION.items():
        assert report.summary[metric]["mean"] >= times * max(floor.summary[metric]["mean"], TINY), metric


def test_serving_fp4_against_an_nf4_trainer_is_detected(align_profile):
    _, profile = align_profile()
    same = verify_alignment(profile)
    fp4 = verify_alignment(profile, infer_quant="fp4", per_layer=True)
    assert fp4.source["infer_path"].startswith("fp4")
    # well above the same-format floor on every distance: the floor measured beside the fp4 copy,
    # and the same-model comparison (which is the floor) for the metrics the floor does not report
    for metric, times in DETECTION.items():
        assert fp4.summary[metric]["mean"] >= times * max(fp4.floor.summary[metric]["mean"], TINY), metric
        assert fp4.summary[metric]["mean"] >= times * max(same.summary[metric]["mean"], TINY), metric
    # the error starts at the first quantized layer (the embeddings are not quantized)
    assert fp4.layers[0].rel_error == 0.0 and fp4.source["first_jump"]["name"] == "layers.0"
    assert fp4.source["first_jump"]["likely_cause"].startswith("quantization: fp4 on the infer path vs nf4")
    # a profile whose L1 gate sits between the two measured levels fails fp4 serving and passes nf4
    gate = 0.5 * fp4.summary["logsoftmax_l1"]["mean"]
    _, strict = align_profile(**{"alignment.logit_l1_max": gate})
    assert "logsoftmax_l1" in _failed(verify_alignment(strict, infer_quant="fp4"))
    assert verify_alignment(strict).verdict == "PASS"


def _engine_rollouts(profile, path, shape: str, temperature: float = 1.0, n: int = 8) -> None:
    """Write the tiny policy's own infer-path samples as an engine would return them (top-5 logprobs)."""
    from orbitctl.builder import load_policy, prepare_frozen_base
    from orbitctl.data.prompts import load_prompts

    split = load_prompts(profile.data, 0)
    policy = load_policy(profile, prepare_frozen_base(profile, split.warm_task))
    prompts = [item.prompt for item in split.eval[:n]]
    ids, mask = policy.encode_prompts(prompts)
    samples = policy.sample(ids, mask, max_new_tokens=4, temperature=1.0, top_p=1.0,
                            generator=torch.Generator().manual_seed(1), keep_logits=True)
    # an engine that samples at another temperature reports log-probs of another distribution
    logdist = torch.log_softmax(samples.logits / temperature, dim=-1)
    lines = []
    for b in range(len(prompts)):
        keep = samples.completion_mask[b].bool()
        tokens = samples.completion_ids[b][keep].tolist()
        dist = logdist[b][keep]
        entries = []
        for j, token in enumerate(tokens):
            top = dist[j].topk(5)
            entries.append((f"token_id:{token}", float(dist[j, token]),
                            [(f"token_id:{i}", float(lp)) for lp, i in zip(top.values.tolist(), top.indices.tolist())]))
        prompt_ids = ids[b][mask[b].bool()].tolist()
        if shape == "completions":
            logprobs = {"tokens": [e[0] for e in entries], "token_logprobs": [e[1] for e in entries],
                        "top_logprobs": [dict(e[2]) for e in entries]}
            line = {"prompt": prompts[b], "prompt_token_ids": prompt_ids,
                    "choices": [{"index": 0, "logprobs": logprobs, "finish_reason": "stop"}]}
        else:
            content = [{"token": e[0], "logprob": e[1], "bytes": None,
                        "top_logprobs": [{"token": t, "logprob": lp, "bytes": None} for t, lp in e[2]]} for e in entries]
            line = {"messages": [{"role": "user", "content": prompts[b]}],
                    "response": {"prompt_token_ids": prompt_ids,
                                 "choices": [{"index": 0, "logprobs": {"content": content}, "finish_reason": "stop"}]}}
        lines.append(json.dumps(line))
    path.write_text("\n".join(lines) + "\n")


@pytest.mark.parametrize("shape", ["completions", "chat"])
def test_engine_rollouts_that_match_the_trainer_pass(align_profile, tmp_path, shape):
    _, profile = align_profile()
    rollouts = tmp_path / f"{shape}.jsonl"
    _engine_rollouts(profile, rollouts, shape)
    report = verify_alignment(profile, rollouts=str(rollouts))
    assert report.verdict == "PASS", [g.to_dict() for g in report.gates]
    assert report.source["source"] == "rollouts" and report.source["engine_top_k"] == 5
    # the engine is the trainer's own infer path: it differs from the train path by the floor only
    assert not report.floor.is_the_comparison
    for metric in ("sampled_dlogp_abs", "js"):
        assert report.summary[metric]["max"] <= _engine_bound(report, metric), metric
    assert any("lower bounds" in note for note in report.notes)


def test_engine_rollouts_at_another_temperature_fail(align_profile, tmp_path):
    _, profile = align_profile()
    rollouts = tmp_path / "hot.jsonl"
    _engine_rollouts(profile, rollouts, "completions", temperature=2.0)
    report = verify_alignment(profile, rollouts=str(rollouts))
    assert report.verdict == "FAIL"
    assert report.summary["k3"]["mean"] > 1e-3
    assert _failed(report) & {"js", "logsoftmax_l1", "top1_agree", "topk_overlap"}
    # told the engine's temperature, the trainer scales its logits the same way and the paths agree
    matched = verify_alignment(profile, rollouts=str(rollouts), engine_temperature=2.0)
    assert matched.summary["sampled_dlogp_abs"]["max"] <= _engine_bound(matched, "sampled_dlogp_abs")
    assert report.summary["k3"]["mean"] >= DETECTION["k3"] * max(matched.summary["k3"]["mean"], TINY)


def test_trained_adapter_is_loaded_on_both_paths(align_profile, tmp_path):
    from orbitctl.rl.api import train

    overrides = {"rl.steps": 2, "rl.prompts_per_step": 4, "rl.group_size": 4, "memory.micro_batch_size": 16,
                 "rollout.batch_size": 16, "data.eval_size": 8, "run.eval_every": 100, "run.save_every": 100}
    _, profile = align_profile(**overrides)
    result = train(profile)
    report = verify_alignment(profile)
    assert report.source["adapter"] == str(result.adapter_dir)
    bound = dtype_bound(report.floor.compute_dtype, report.floor.logit_absmax, ulps=AGREEMENT_ULPS)
    assert report.verdict == "PASS" and report.summary["js"]["max"] <= bound["js"]
