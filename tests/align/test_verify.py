"""verify-alignment end to end on the tiny quantized model: agreement passes, injected mismatches fail."""

from __future__ import annotations

import json

import pytest
import torch

from orbitctl.align.internal import Perturbation
from orbitctl.align.verify import verify_alignment


def _failed(report) -> set[str]:
    return {g.metric for g in report.gates if g.status == "FAIL"}


def test_same_format_on_both_paths_passes_with_js_near_zero(align_profile):
    _, profile = align_profile()
    report = verify_alignment(profile, per_layer=True)
    assert report.verdict == "PASS", [g.to_dict() for g in report.gates]
    assert report.tokens >= 24  # every prompt gives at least one token
    assert report.summary["js"]["max"] < 1e-9
    assert report.summary["top1_agree"]["mean"] == 1.0
    assert report.summary["k3"]["max"] < 1e-9
    assert [e.name for e in report.layers] == ["embeddings", "layers.0", "layers.1"]
    assert max(e.rel_error for e in report.layers) < 1e-6 and report.source["first_jump"] is None


@pytest.mark.parametrize("layer", [0, 1])
def test_perturbed_infer_weights_fail_the_gate_and_per_layer_names_the_layer(align_profile, layer):
    _, profile = align_profile()
    report = verify_alignment(profile, per_layer=True, perturb=Perturbation(layer, 1.0))
    assert report.verdict == "FAIL"
    assert "logsoftmax_l1" in _failed(report)
    assert report.source["first_jump"]["name"] == f"layers.{layer}"
    assert report.source["first_jump"]["likely_cause"].startswith("weights")
    # everything before the perturbed layer is untouched on the infer copy
    assert all(e.rel_error < 1e-6 for e in report.layers[:layer + 1])
    assert report.layers[layer + 1].rel_error > 0.01


def test_serving_fp4_against_an_nf4_trainer_is_detected(align_profile):
    _, profile = align_profile()
    same = verify_alignment(profile)
    fp4 = verify_alignment(profile, infer_quant="fp4", per_layer=True)
    assert fp4.source["infer_path"].startswith("fp4")
    # orders of magnitude above the same-format floor on every distance
    for metric in ("js", "logsoftmax_l1", "k3", "sampled_dp_abs"):
        assert fp4.summary[metric]["mean"] > 1e4 * max(same.summary[metric]["mean"], 1e-15), metric
    # the error starts at the first quantized layer (the embeddings are not quantized)
    assert fp4.layers[0].rel_error < 1e-6 and fp4.source["first_jump"]["name"] == "layers.0"
    assert fp4.source["first_jump"]["likely_cause"].startswith("quantization: fp4 on the infer path vs nf4")
    # a profile whose L1 gate sits between the two measured levels fails fp4 serving and passes nf4
    gate = 0.5 * fp4.summary["logsoftmax_l1"]["mean"]
    _, strict = align_profile(**{"alignment.logit_l1_max": gate})
    assert "logsoftmax_l1" in _failed(verify_alignment(strict, infer_quant="fp4"))
    assert verify_alignment(strict).verdict == "PASS"


def _engine_rollouts(profile, path, shape: str, temperature: float = 1.0, n: int = 8) -> None:
    """Write the tiny policy's own infer-path samples as an engine would return them (top-5 logprobs)."""
    from orbitctl.model.prepare import load_policy, prepare_frozen_base
    from orbitctl.rl.data import load_prompts

    policy = load_policy(profile, prepare_frozen_base(profile))
    prompts = [item.prompt for item in load_prompts(profile.data, 0).eval[:n]]
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
    assert report.summary["sampled_dlogp_abs"]["max"] < 1e-5  # engine log-probs are float32-rounded in JSON
    assert report.summary["js"]["max"] < 1e-9
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
    assert matched.summary["sampled_dlogp_abs"]["max"] < 1e-5


def test_trained_adapter_is_loaded_on_both_paths(align_profile, tmp_path):
    from orbitctl.rl.trainer import train

    overrides = {"rl.steps": 2, "rl.prompts_per_step": 4, "rl.group_size": 4, "memory.micro_batch_size": 16,
                 "rollout.batch_size": 16, "data.eval_size": 8, "run.eval_every": 100, "run.save_every": 100}
    _, profile = align_profile(**overrides)
    result = train(profile)
    report = verify_alignment(profile)
    assert report.source["adapter"] == str(result.adapter_dir)
    assert report.verdict == "PASS" and report.summary["js"]["max"] < 1e-9
