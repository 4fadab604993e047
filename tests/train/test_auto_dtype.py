"""dtype auto on the tiny NF4 policy: everything computes in the resolved dtype, train and infer path alike."""

import pytest

torch = pytest.importorskip("torch")

from orbitctl.kernels import cpu_dtype  # noqa: E402
from orbitctl.kernels.cpu_dtype import Bf16Verdict  # noqa: E402

NATIVE = Bf16Verdict(True, "fake: a CPU with AVX512-BF16")
EMULATED = Bf16Verdict(False, "fake: an AVX2-only CPU")


def _fake_host(monkeypatch, verdict):
    monkeypatch.setattr(cpu_dtype, "host_bf16", lambda: verdict)


def _base(profile):
    from orbitctl.builder import prepare_frozen_base
    from orbitctl.data.prompts import load_prompts

    split = load_prompts(profile.data, profile.run.seed)
    return prepare_frozen_base(profile, split.warm_task), split


def _float_dtypes(model):
    """Dtypes of every float parameter but the packed NF4 data, and what the NF4 layers dequantize to."""
    params = {p.dtype for p in model.parameters() if p.is_floating_point() and type(p).__name__ != "Params4bit"}
    nf4 = {m.compute_dtype for m in model.modules() if hasattr(m, "compute_type_is_set")}
    return params, nf4


def test_the_demo_profile_asks_for_auto(small_profile):
    profile = small_profile()
    assert profile.quant.compute_dtype == "auto" and profile.adapter.dtype == "auto"


@pytest.mark.parametrize("verdict, expected", [(NATIVE, torch.bfloat16), (EMULATED, torch.float32)],
                         ids=["native-bf16", "no-native-bf16"])
def test_policy_with_auto_computes_in_the_resolved_dtype(small_profile, monkeypatch, verdict, expected):
    from orbitctl.builder import load_policy
    from orbitctl.kernels.cpu_dtype import compute_dtype_name

    profile = small_profile()
    base, split = _base(profile)  # one cached base: the load, not the build, applies the dtype
    _fake_host(monkeypatch, verdict)
    assert compute_dtype_name(profile) == ("bf16" if expected == torch.bfloat16 else "fp32")
    policy = load_policy(profile, base)
    params, nf4 = _float_dtypes(policy.model)
    assert params == {expected} and nf4 == {expected}
    lora = {p.dtype for n, p in policy.model.named_parameters() if "lora_" in n}
    assert lora == {expected}
    name = "bf16" if expected == torch.bfloat16 else "fp32"
    assert f"compute and adapter {name} (auto: fake:" in policy.report.summary()

    ids = policy.tokenizer([split.eval[0].prompt], return_tensors="pt")["input_ids"]
    policy.model.train()  # the train path: full-sequence forward with gradients
    train_logits = policy.model(input_ids=ids).logits
    assert train_logits.dtype == expected
    train_logits.float().logsumexp(-1).sum().backward()
    grads = [p.grad for p in policy.trainable_parameters()]
    assert grads and all(g is not None and g.dtype == expected and torch.isfinite(g).all() for g in grads)
    policy.model.eval()  # the infer path: no-grad, KV-cache decoding over the same weights
    with torch.no_grad():
        out = policy.model(input_ids=ids, use_cache=True)
    assert out.logits.dtype == expected and out.past_key_values is not None
    tolerance = 1e-2 if expected == torch.bfloat16 else 1e-5
    assert torch.allclose(out.logits.float(), train_logits.detach().float(), atol=tolerance)


def test_fp32_adapters_train_through_deepspeed(small_profile, monkeypatch):
    from orbitctl.builder import load_policy
    from orbitctl.rl.engine import build_engine, close_process_group, ensure_process_group
    from orbitctl.rl.losses import group_advantages
    from orbitctl.rl.rewards import make_reward
    from orbitctl.rl.rollout import collect
    from orbitctl.rl.trainer import _accumulation
    from orbitctl.rl.update import run_update

    profile = small_profile()
    base, split = _base(profile)
    _fake_host(monkeypatch, EMULATED)
    policy = load_policy(profile, base)
    ensure_process_group()
    try:
        engine, _ = build_engine(policy, profile, _accumulation(profile, 1), 1)
        assert not engine.bfloat16_enabled()  # derived from the fp32 adapter parameters
        before = {n: p.detach().clone() for n, p in policy.named_trainable()}
        batch = collect(policy, split.train[:8], make_reward(profile.data.reward, split.task),
                        group_size=profile.rl.group_size, batch_size=32, max_new_tokens=profile.rollout.max_new_tokens,
                        temperature=1.0, top_p=1.0, generator=torch.Generator().manual_seed(0), keep_dist=True)
        applied = []
        run_update(engine, policy, batch, group_advantages(batch.rewards, profile.rl.group_size, True), profile,
                   lambda stats, seconds, ok, grad_norm: applied.append(ok and stats.finite))
    finally:
        close_process_group()
    assert applied == [True]
    after = dict(policy.named_trainable())
    assert all(p.dtype == torch.float32 for p in after.values())
    assert any(not torch.equal(after[n].detach(), before[n]) for n in before)
