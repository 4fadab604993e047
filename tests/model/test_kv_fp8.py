"""The fp8 KV cache (``rollout.kv_dtype: fp8``): what it stores, how close it gives K/V back, what it costs a decode.

Bounds come from the formats: float8 e4m3 keeps 3 mantissa bits, so a normal number is rounded to
within half a step, ``2^-4`` of its magnitude, and the subnormals (below ``2^-6``, spaced ``2^-9``)
to within ``2^-10`` in units of the group's scale; e5m2 keeps 2 (``2^-3`` and ``2^-17``). The
decode's cost is held between the floor (the same decode through the compute-dtype cache) and the
same decode through the coarser e5m2 cache, all against the full-sequence forward of the same
tokens, measured in the same test.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from orbitctl.distances import js_divergence, logsoftmax_l1  # noqa: E402
from orbitctl.kernels.kv_cache import Fp8KVCache, dequantize_groups, new_kv_cache  # noqa: E402

FORMATS = {"e4m3": (torch.float8_e4m3fn, 3, -6), "e5m2": (torch.float8_e5m2, 2, -14)}
"""float8 format -> (dtype, mantissa bits, smallest normal exponent)."""


def _states(batch=3, heads=2, positions=5, dim=16, seed=0):
    """K/V-like states whose magnitude differs by orders between heads and positions, one all-zero group."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, heads, positions, dim, generator=g)
    x = x * torch.logspace(-3, 2, heads * positions).view(1, heads, positions, 1)
    x[0, 0, 0] = 0.0
    return x


def test_new_kv_cache_builds_the_float8_cache_or_leaves_the_models_own():
    assert new_kv_cache("bf16") is None
    assert new_kv_cache("fp8").fp8_dtype == torch.float8_e4m3fn
    assert new_kv_cache("fp8_e5m2").fp8_dtype == torch.float8_e5m2
    with pytest.raises(ValueError):
        new_kv_cache("int8")


def test_the_cache_stores_one_byte_per_element_plus_one_scale_per_token_and_head():
    cache = Fp8KVCache()
    keys, values = _states(), _states(dim=8, seed=1)
    cache.update(keys, values, 0)
    cache.update(keys[:, :, :1], values[:, :, :1], 0)  # one decoded position
    cache.update(keys, values, 1)
    layer = cache.layers[0]
    assert layer.keys.dtype == layer.values.dtype == torch.float8_e4m3fn and layer.keys.element_size() == 1
    assert layer.keys.shape == (3, 2, 6, 16) and layer.values.shape == (3, 2, 6, 8)
    assert layer.key_scales.shape == layer.value_scales.shape == (3, 2, 6, 1)
    assert layer.key_scales.dtype == torch.float32 and cache.get_seq_length(0) == 6 and cache.get_seq_length(1) == 5
    elements = (keys.numel() + values.numel()) * (6 + 5) // 5
    groups = 2 * 3 * 2 * (6 + 5)
    assert cache.stored_bytes() == (elements, 4 * groups)
    # what attention reads comes back in the dtype it was given
    out_k, out_v = Fp8KVCache().update(keys.bfloat16(), values.bfloat16(), 0)
    assert out_k.dtype == out_v.dtype == torch.bfloat16 and out_k.shape == keys.shape


@pytest.mark.parametrize("name", FORMATS)
def test_round_trip_is_within_the_formats_rounding(name):
    fp8, mantissa, min_exp = FORMATS[name]
    cache = Fp8KVCache(fp8)
    x = _states()
    k, _ = cache.update(x, x, 0)
    scale = cache.layers[0].key_scales
    err = (k - x).abs()
    # half a step of the mantissa, relative to the value; half a subnormal step, in units of the scale;
    # and float32 rounding of the division and the product (a few ulps of the value)
    half_step = 2.0 ** -(mantissa + 1)
    bound = half_step * x.abs() + 2.0 ** (min_exp - mantissa - 1) * scale + 4 * torch.finfo(torch.float32).eps * x.abs()
    assert bool((err <= bound).all()), float((err - bound).max())
    # the coarser statement: at most half a step of the group's amax
    amax = x.abs().amax(-1, keepdim=True)
    assert bool((err <= half_step * amax * (1 + 1e-6)).all())
    assert bool((k[0, 0, 0] == 0).all())  # an all-zero group stays zero
    # and the rounding is real: the stored values are not the inputs
    assert float(err.max()) > 0


def test_appending_never_rescales_what_is_stored():
    cache = Fp8KVCache()
    x = _states(positions=4)
    cache.update(x, x, 0)
    before = cache.layers[0].keys.clone(), cache.layers[0].key_scales.clone()
    k, _ = cache.update(1000.0 * x[:, :, :1], x[:, :, :1], 0)  # a token far larger than the history
    assert torch.equal(cache.layers[0].keys[:, :, :4].view(torch.uint8), before[0].view(torch.uint8))
    assert torch.equal(cache.layers[0].key_scales[:, :, :4], before[1])
    big = 1000.0 * x[:, :, :1]
    assert bool(((k[:, :, 4:] - big).abs() <= 2.0 ** -4 * big.abs().amax(-1, keepdim=True) * (1 + 1e-6)).all())
    assert torch.equal(dequantize_groups(cache.layers[0].keys, cache.layers[0].key_scales, torch.float32), k)


def _decode_logits(model, ids, prompt_len: int, cache):
    """Prefill ``prompt_len`` tokens through ``cache`` (None: the model's own), then one token at a time."""
    kw = {} if cache is None else {"cache": cache}
    out = model(input_ids=ids[:, :prompt_len], use_cache=True, **kw)
    logits = [out.logits]
    for t in range(prompt_len, ids.shape[1]):
        out = model(input_ids=ids[:, t:t + 1], cache=out.cache, use_cache=True)
        logits.append(out.logits)
    return torch.cat(logits, 1), out.cache


def _distances(full, decoded):
    a, b = torch.log_softmax(full.double(), -1), torch.log_softmax(decoded.double(), -1)
    return float(js_divergence(a, b).mean()), float(logsoftmax_l1(a, b).mean())


@pytest.mark.parametrize("model_type", ["llama", "deepseek_v3"])
def test_fp8_decode_stands_between_the_floor_and_a_coarser_cache(model_type):
    from transformers import AutoModelForCausalLM

    from orbitctl.model.tiny import tiny_config

    torch.manual_seed(0)
    config = tiny_config(model_type)
    model = AutoModelForCausalLM.from_config(config).eval()
    ids = torch.randint(0, config.vocab_size, (4, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(input_ids=ids, use_cache=False).logits  # the train path: no cache
        floor = _distances(full, _decode_logits(model, ids, 8, None)[0])
        e4m3_logits, cache = _decode_logits(model, ids, 8, new_kv_cache("fp8"))
        e4m3 = _distances(full, e4m3_logits)
        e5m2 = _distances(full, _decode_logits(model, ids, 8, new_kv_cache("fp8_e5m2"))[0])
    for metric, f, a, b in zip(("js", "logsoftmax_l1"), floor, e4m3, e5m2):
        assert f < a < b, (metric, f, a, b)
        # one mantissa bit more halves every rounding error: L1 about halves, JS (second order) quarters
        assert a <= (0.25 if metric == "js" else 0.5) * 2 * b, (metric, a, b)
    payload, scales = cache.stored_bytes()
    if model_type == "deepseek_v3":
        # MLA: the cache holds the latent (kv_lora_rank) and the shared RoPE key, one "head" each, per layer
        layer = cache.layers[0]
        assert layer.keys.shape[1:] == (1, 24, config.kv_lora_rank)
        assert layer.values.shape[1:] == (1, 24, config.qk_rope_head_dim)
        per_token = config.kv_lora_rank + config.qk_rope_head_dim
        assert payload == ids.numel() * config.num_hidden_layers * per_token
        assert scales == ids.numel() * config.num_hidden_layers * 2 * 4
    else:
        heads, dim = config.num_key_value_heads, config.hidden_size // config.num_attention_heads
        assert payload == ids.numel() * config.num_hidden_layers * 2 * heads * dim
        assert scales == ids.numel() * config.num_hidden_layers * 2 * heads * 4


def test_fp8_kv_bytes_are_what_the_plan_counts_per_token(int4_moe):
    """The MLA latent the cache stores is the plan's per-token KV element count (1 byte each for fp8), and with its
    scales exactly the bytes the plan counts per token and layer."""
    from orbitctl.arch.parse import arch_from_config
    from orbitctl.model.frozen_base import load_frozen_base

    model = load_frozen_base(str(int4_moe), compute_dtype=torch.float32)
    arch = arch_from_config(json.loads((Path(int4_moe) / "config.json").read_text()))
    ids = torch.randint(0, model.config.vocab_size, (2, 6), generator=torch.Generator().manual_seed(3))
    cache = new_kv_cache("fp8")
    with torch.no_grad():
        model(input_ids=ids, use_cache=True, cache=cache)
    payload, scales = cache.stored_bytes()
    assert payload == ids.numel() * arch.num_layers * arch.kv_elements_per_token_layer()
    assert payload + scales == ids.numel() * arch.num_layers * arch.kv_bytes_per_token_layer("fp8")


def test_every_command_that_samples_through_the_policy_builds_fp8_kv():
    from orbitctl.profile import load_profile
    from orbitctl.profile.support import EVAL, SERVE, TRAIN, VERIFY_INTERNAL, unsupported_for

    tiny = Path(__file__).resolve().parents[2] / "profiles" / "tiny-cpu.yaml"
    profile = load_profile(tiny, ["rollout.kv_dtype=fp8"])
    for command in (TRAIN, VERIFY_INTERNAL, EVAL, SERVE):
        assert unsupported_for(command, profile) == [], command
    # the loopback orbitctl serve that train starts for an http engine gets this profile; an attached engine does not
    http = ["rollout.kv_dtype=fp8", "rollout.engine=http", "rollout.engine_sleep=false"]
    assert unsupported_for(TRAIN, load_profile(tiny, http)) == []
    attached = unsupported_for(TRAIN, load_profile(tiny, http + ["rollout.engine_url=http://127.0.0.1:8000"]))
    assert [u.key for u in attached] == ["rollout.kv_dtype"]


WORLD = 2


def _ep_worker(rank: int, path: str, store: str, out: str) -> None:
    """Rank ``rank`` of an EP-2 run: the split model decodes its own batch through the fp8 cache in lockstep with the
    other rank (whose rows run longer), against the whole model decoding the same batch alone."""
    import torch.distributed as dist

    from orbitctl.model.charset import build_char_tokenizer
    from orbitctl.model.expert_parallel import ExpertGroup, Lockstep
    from orbitctl.model.frozen_base import load_frozen_base
    from orbitctl.model.policy import Policy

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    try:
        tokenizer = build_char_tokenizer()
        tokenizer.padding_side = "left"
        tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token

        def policy(experts, lockstep):
            model = load_frozen_base(path, compute_dtype=torch.float32, experts=experts)
            return Policy(model, tokenizer, None, hidden_size=int(model.config.hidden_size), adapter_kind="lora",
                          gradient_checkpointing=False, lockstep=lockstep, kv_dtype="fp8")

        split, whole = policy(ExpertGroup.of_world(WORLD), Lockstep()), policy(None, None)
        g = torch.Generator().manual_seed(11 + rank)
        prompt = torch.randint(1, 90, (3, 5), generator=g)
        completion = torch.randint(1, 90, (3, 6), generator=g)
        keep = torch.ones_like(completion)
        if rank == 0:
            keep[:, 2:] = 0  # this rank's rows end after 2 tokens; the other rank's run 6
        forced = (completion, keep)
        kw = dict(max_new_tokens=0, temperature=1.0, top_p=1.0, generator=None, keep_logits=True, forced=forced)
        ep = split.sample(prompt, torch.ones_like(prompt), **kw)
        ep_bf16 = split.sample(prompt, torch.ones_like(prompt), kv_dtype="bf16", **kw)
        alone = whole.sample(prompt, torch.ones_like(prompt), **kw)
        alone_bf16 = whole.sample(prompt, torch.ones_like(prompt), kv_dtype="bf16", **kw)
        n = alone.logits.shape[1]  # alone, a rank stops where its own rows end
        rows = keep[:, :n].bool()
        Path(out, f"rank{rank}.json").write_text(json.dumps({
            "steps": ep.completion_ids.shape[1], "alone_steps": n, "kept": ep.completion_mask.sum(-1).tolist(),
            "err": float((ep.logits[:, :n][rows] - alone.logits[rows]).abs().max()),
            "floor": float((ep_bf16.logits[:, :n][rows] - alone_bf16.logits[rows]).abs().max()),
            "fp8_cost": float((alone.logits[rows] - alone_bf16.logits[rows]).abs().max()),
            "logit_absmax": float(alone.logits[rows].abs().max())}))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_expert_parallel_ranks_decode_through_fp8_in_lockstep(tmp_path, int4_moe):
    import torch.multiprocessing as mp

    mp.start_processes(_ep_worker, args=(str(int4_moe), str(tmp_path / "store"), str(tmp_path)), nprocs=WORLD,
                       start_method="spawn")
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]
    # rank 0's rows end after 2 tokens, yet it kept calling the model until rank 1's were done
    assert results[0]["steps"] == results[1]["steps"] == 6 and results[0]["alone_steps"] == 2
    assert results[0]["kept"] == [2, 2, 2] and results[1]["kept"] == [6, 6, 6]
    eps = torch.finfo(torch.float32).eps
    for r in results:
        # EP changes the experts' arithmetic by the floor only; the fp8 cache then rounds the same K/V alike
        tol = 4 * max(r["floor"], 4 * eps * r["logit_absmax"])
        assert r["err"] <= tol, r
        assert r["fp8_cost"] > tol, r  # and the fp8 cache was read on both
