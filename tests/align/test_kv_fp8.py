"""verify-alignment with ``rollout.kv_dtype: fp8``: the internal check's infer path decodes through the float8
KV cache, the floor is measured beside it through the compute-dtype cache, and the gates still judge it.

What fp8 KV may cost is bounded by a coarser cache measured in the same test: the same policy's
decode through float8 e5m2 (2 mantissa bits against e4m3's 3) on the same prompts, against the same
full-sequence forward.
"""

from __future__ import annotations

import torch

from orbitctl.align.api import verify_alignment
from orbitctl.align.tokens import TokenTable

TINY = 1e-300


def _cache_costs(profile, kv_dtypes):
    """Per KV-cache dtype: the summary of its teacher-forced decode against the train path, on completions the
    policy samples from the profile's held-out prompts (the ones the internal check uses)."""
    from orbitctl.builder import load_policy, prepare_frozen_base
    from orbitctl.data.prompts import load_prompts

    split = load_prompts(profile.data, profile.run.seed)
    policy = load_policy(profile, prepare_frozen_base(profile, split.warm_task))
    ids, mask = policy.encode_prompts([item.prompt for item in split.eval[:profile.alignment.num_prompts]])
    samples = policy.sample(ids, mask, max_new_tokens=profile.rollout.max_new_tokens, temperature=1.0, top_p=1.0,
                            generator=torch.Generator().manual_seed(3), kv_dtype="bf16")
    with torch.no_grad():
        train = policy.completion_logits(samples.prompt_ids, samples.prompt_mask, samples.completion_ids,
                                         samples.completion_mask).float()
    keep = samples.completion_mask.bool()
    costs = {}
    for kv in kv_dtypes:
        own = policy.sample(samples.prompt_ids, samples.prompt_mask, max_new_tokens=0, temperature=1.0, top_p=1.0,
                            generator=None, keep_logits=True, kv_dtype=kv,
                            forced=(samples.completion_ids, samples.completion_mask))
        table = TokenTable(k=profile.alignment.top_k)
        table.add(train[keep], own.logits[keep], samples.completion_ids[keep])
        costs[kv] = table.summary()
    return costs


def test_fp8_kv_is_reported_over_the_floor_and_bounded_by_a_coarser_cache(align_profile):
    _, profile = align_profile(**{"rollout.kv_dtype": "fp8"})
    report = verify_alignment(profile)
    assert report.source["kv_dtype"] == "fp8" and "KV cache in fp8" in report.source["infer_path"]
    # the floor was measured beside it, through the compute-dtype cache
    floor = report.floor
    assert not floor.is_the_comparison and "compute-dtype KV cache" in floor.measured_as
    times = report.to_dict()["floor_times"]
    for metric in ("js", "logsoftmax_l1"):
        # the fp8 cache takes effect: every figure stands above the floor (which may be exactly 0)
        assert report.summary[metric]["mean"] > floor.summary[metric]["mean"], metric
        assert times[metric] == "inf" or times[metric] > 1.0, (metric, times[metric])
    costs = _cache_costs(profile, ("fp8", "fp8_e5m2", "bf16"))
    for metric in ("js", "logsoftmax_l1"):
        e4m3, e5m2, same = (costs[kv][metric]["mean"] for kv in ("fp8", "fp8_e5m2", "bf16"))
        assert same < e4m3 < e5m2, (metric, same, e4m3, e5m2)
        # what the report measured on its own samples is of the e4m3 cache's size, not the coarser one's
        assert report.summary[metric]["mean"] < e5m2, (metric, report.summary[metric]["mean"], e5m2)


def test_the_gates_judge_the_fp8_kv_infer_path(align_profile):
    _, profile = align_profile(**{"rollout.kv_dtype": "fp8"})
    fp8 = verify_alignment(profile)
    # a gate between the floor and the fp8 cache's cost fails fp8 KV and passes the compute-dtype cache
    gate = 0.5 * fp8.summary["logsoftmax_l1"]["mean"]
    assert gate > fp8.floor.summary["logsoftmax_l1"]["mean"]
    _, strict_fp8 = align_profile(**{"rollout.kv_dtype": "fp8", "alignment.logit_l1_max": gate})
    strict = verify_alignment(strict_fp8)
    assert strict.verdict == "FAIL" and "logsoftmax_l1" in {g.metric for g in strict.gates if g.status == "FAIL"}
    _, strict_bf16 = align_profile(**{"alignment.logit_l1_max": gate})
    assert verify_alignment(strict_bf16).verdict == "PASS"


def test_greedy_decoding_with_fp8_kv_runs_end_to_end(align_profile):
    from orbitctl.builder import load_policy, prepare_frozen_base
    from orbitctl.data.prompts import load_prompts

    _, profile = align_profile(**{"rollout.kv_dtype": "fp8"})
    split = load_prompts(profile.data, profile.run.seed)
    policy = load_policy(profile, prepare_frozen_base(profile, split.warm_task))
    assert policy.kv_dtype == "fp8"
    ids, mask = policy.encode_prompts([item.prompt for item in split.eval[:16]])
    greedy = {kv: policy.sample(ids, mask, max_new_tokens=4, temperature=0.0, top_p=1.0, generator=None,
                                keep_logits=True, kv_dtype=kv) for kv in ("fp8", "bf16")}
    fp8 = greedy["fp8"]
    texts = policy.decode(fp8.completion_ids, fp8.completion_mask)
    assert len(texts) == 16 and all(fp8.completion_mask[:, 0] == 1)
    assert bool(torch.isfinite(fp8.logprobs).all()) and bool((fp8.logprobs <= 0).all())
    # the fp8 cache was read: the first step's logits (the prefill over the rounded K/V) are not the compute-dtype ones
    assert float((fp8.logits[:, 0] - greedy["bf16"].logits[:, 0]).abs().max()) > 0
