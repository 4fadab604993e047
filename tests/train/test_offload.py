"""``memory.offload_activations: cpu`` and ``memory.flash_attention: false`` as train builds them.

The offload is measured against the plan: the bytes the hooks send to the host are the plan's
``saved_boundaries_host``, and on a fake accelerator (``FakeTensorMode`` tensors on the meta device,
``MemTracker``) the device-side peak falls by the boundaries the plan moves.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from orbitctl.kernels.decode_attention import DECODE_SDPA  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def _policy(profile):
    from orbitctl.builder import load_policy, prepare_frozen_base
    from orbitctl.data.prompts import load_prompts

    split = load_prompts(profile.data, profile.run.seed)
    return load_policy(profile, prepare_frozen_base(profile, split.warm_task)), split


def _micro_batch(policy, split, rows: int):
    """A micro-batch as the update sees it: prompts and the completions the infer path sampled for them."""
    ids, mask = policy.encode_prompts([item.prompt for item in split.train[:rows]])
    out = policy.sample(ids, mask, max_new_tokens=3, temperature=1.0, top_p=1.0,
                        generator=torch.Generator().manual_seed(0))
    return ids, mask, out.completion_ids, out.completion_mask


def _adapter_grads(policy, batch, offload: bool):
    """The adapters' gradients of one train-path forward + backward, and what the forward sent to the host."""
    from orbitctl.model.offload import offloaded_boundaries

    policy.model.zero_grad(set_to_none=True)
    ids, mask, completion_ids, completion_mask = batch
    with offloaded_boundaries(policy.model, offload) as moved:
        logits = policy.completion_logits(ids, mask, completion_ids, completion_mask)
    logp = torch.log_softmax(logits.float(), -1).gather(-1, completion_ids[..., None]).squeeze(-1)
    (logp * completion_mask).sum().backward()
    return {n: p.grad.clone() for n, p in policy.named_trainable()}, moved


def _max_gap(a: dict, b: dict) -> float:
    assert a.keys() == b.keys() and a
    return max(float((a[n] - b[n]).abs().max()) for n in a)


def test_offload_moves_the_plans_boundary_bytes_and_leaves_gradients_equal(small_profile):
    from orbitctl.plan import _arch
    from orbitctl.plan.activations import ActivationSettings, train_activations
    from orbitctl.plan.adapters import plan_adapters

    profile = small_profile(**{"memory.offload_activations": "cpu"})
    policy, split = _policy(profile)
    with torch.no_grad():  # adapters away from their zero start, so every gradient is non-trivial
        for _, param in policy.named_trainable():
            param.normal_(0.0, 0.05)
    batch = _micro_batch(policy, split, rows=16)
    kept, nothing = _adapter_grads(policy, batch, offload=False)
    offloaded, moved = _adapter_grads(policy, batch, offload=True)

    # (a) one boundary per decoder layer, each the layer's input hidden state [B, T, H]
    layers = policy.model.config.num_hidden_layers
    assert nothing.bytes == 0 and moved.tensors == layers
    rows, seq = batch[0].shape[0], batch[0].shape[1] + batch[2].shape[1]
    arch = _arch(profile)
    settings = ActivationSettings(tokens=rows * seq, seq_len=seq, checkpointing=True, offload=True, flash=True,
                                  dropout=False, adapter_bytes=2, loss_chunk=0)
    planned = train_activations(arch, plan_adapters(arch, profile.adapter), settings).saved_boundaries_host
    # the plan counts bf16 boundaries (2 bytes an element); this CPU may compute in fp32 (quant.compute_dtype:
    # auto), so the bytes are compared per element of the dtype the model really runs in
    element = policy.model.get_input_embeddings().weight.element_size()
    assert moved.bytes * 2 / element == pytest.approx(planned, rel=0.05)

    # (c) the floor: the same gradients computed an equivalent way, without checkpointing (no recompute)
    policy.model.activation_checkpointing_disable()
    try:
        plain, _ = _adapter_grads(policy, batch, offload=False)
    finally:
        policy.model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    floor = _max_gap(plain, kept)
    assert _max_gap(offloaded, kept) <= floor, (_max_gap(offloaded, kept), floor)
    assert max(float(g.abs().max()) for g in offloaded.values()) > 0


def _fake_device_step(offload: bool, config, arch, adapters, section, rows: int, seq: int):
    """Peak bytes by category on the meta device (a stand-in accelerator: FakeTensorMode allocates nothing)
    and what was sent to the host, for one checkpointed forward + backward of a bf16 model with bf16 LoRA."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker
    from transformers import AutoModelForCausalLM

    from orbitctl.model.offload import offloaded_boundaries
    from orbitctl.plan.shadow import attach_shadow_adapters, freeze_to_buffers

    with FakeTensorMode():
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
            attach_shadow_adapters(model, arch, adapters, section)
        freeze_to_buffers(model)
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        ids = torch.randint(0, config.vocab_size, (rows, seq), device="meta")
        positions = torch.arange(seq, device="meta")[None].expand(rows, seq)
        tracker = MemTracker()
        tracker.track_external(model)
        with tracker:
            with offloaded_boundaries(model, offload) as moved:
                logits = model(input_ids=ids, position_ids=positions).logits
            loss = logits.float().log_softmax(-1).gather(-1, ids[..., None]).mean()
            del logits
            loss.backward()
        peak = tracker.get_tracker_snapshot("peak")
    by_device = {str(device): {str(getattr(k, "value", k)): v for k, v in cats.items()} for device, cats in peak.items()}
    return by_device, moved


def test_offload_lowers_the_device_peak_by_the_boundaries_the_plan_moves():
    from orbitctl.arch import arch_from_config
    from orbitctl.model.tiny import tiny_config
    from orbitctl.plan.activations import ActivationSettings, train_activations
    from orbitctl.plan.adapters import plan_adapters
    from orbitctl.profile.schema import AdapterSection

    layers, hidden, rows, seq = 6, 256, 2, 256
    config = tiny_config("llama", num_hidden_layers=layers, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_attention_heads=4, num_key_value_heads=4, vocab_size=128, max_position_embeddings=seq)
    config._attn_implementation, config.use_cache = "sdpa", False
    arch = arch_from_config({**config.to_dict(), "model_type": "llama"}, name="offload-test")
    section = AdapterSection(kind="lora", rank=8, alpha=16, dropout=0.0, targets="all-linear", dtype="bf16")
    adapters = plan_adapters(arch, section)
    kept, nothing = _fake_device_step(False, config, arch, adapters, section, rows, seq)
    offloaded, moved = _fake_device_step(True, config, arch, adapters, section, rows, seq)

    def activations(peak):  # what the plan's activation term counts (as `orbitctl plan --measure` reads it)
        return peak["meta"]["Activation"] + peak["meta"]["Temp"]

    def plan(offload):
        st = ActivationSettings(tokens=rows * seq, seq_len=seq, checkpointing=True, offload=offload, flash=True,
                                dropout=False, adapter_bytes=2, loss_chunk=0)
        return train_activations(arch, adapters, st)

    assert nothing.bytes == 0 and "cpu" not in kept
    assert moved.bytes == pytest.approx(plan(True).saved_boundaries_host, rel=0.05)
    assert offloaded["cpu"]["Total"] == moved.bytes  # the host holds exactly what was moved
    planned_fall = plan(False).activations - plan(True).activations
    measured_fall = activations(kept) - activations(offloaded)
    # at least what the plan takes off the device (it keeps two boundaries there: the one being recomputed and
    # the next, which CUDA copies back early on its side stream), and no more than what went to the host
    assert planned_fall * 0.95 <= measured_fall <= moved.bytes, (measured_fall, planned_fall, moved.bytes)


def _cmd(profile, *extra):
    return [sys.executable, "-m", "orbitctl.cli.app", "train", str(profile), "--json", "--fresh", "--steps", "1",
            *extra]


def _first_record(run_dir: Path) -> dict:
    return json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])


@pytest.mark.slow
def test_train_with_offloaded_boundaries_learns_like_the_default_run(tmp_path, profile_yaml):
    runs = {}
    for name, extra in (("default", ()), ("offload", ("--set", "memory.offload_activations=cpu"))):
        done = subprocess.run(_cmd(profile_yaml(name), *extra), capture_output=True, text=True, cwd=ROOT, timeout=600)
        assert done.returncode == 0, done.stderr[-2000:]
        runs[name] = _first_record(tmp_path / name)
    default, offload = runs["default"], runs["offload"]
    assert default["offload_bytes"] == 0 and offload["offload_bytes"] > 0
    assert offload["update_applied"]
    # the same seed, data and kernels: the same first-step loss up to a few float32 ulps of its size
    ulps = 4 * torch.finfo(torch.float32).eps * max(abs(default["policy_loss"]), 1e-6)
    assert abs(offload["policy_loss"] - default["policy_loss"]) <= ulps
    assert abs(offload["grad_norm"] - default["grad_norm"]) <= 4 * torch.finfo(torch.float32).eps * default["grad_norm"]


def _train_infer_gap(policy) -> float:
    """Largest |train-path log-prob - infer-path log-prob| of sampled tokens, under left padding."""
    generator = torch.Generator().manual_seed(1)  # the same adapter weights on every model this is given
    with torch.no_grad():
        for _, param in policy.named_trainable():
            param.normal_(0.0, 0.05, generator=generator)
    ids, mask = policy.encode_prompts(["+-M5:", "M2:", "()M7:", "5:"])
    out = policy.sample(ids, mask, max_new_tokens=3, temperature=1.0, top_p=1.0,
                        generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = policy.completion_logits(ids, mask, out.completion_ids, out.completion_mask, train=False)
    train_logp = torch.log_softmax(logits.float(), -1).gather(-1, out.completion_ids[..., None]).squeeze(-1)
    return float(((train_logp - out.logprobs) * out.completion_mask).abs().max())


def _one_update(profile, policy, split) -> list[bool]:
    """One rollout and optimizer step through the DeepSpeed engine; whether it was applied."""
    from orbitctl.rl.engine import build_engine, close_process_group, ensure_process_group
    from orbitctl.rl.losses import group_advantages
    from orbitctl.rl.rewards import make_reward
    from orbitctl.rl.rollout import collect
    from orbitctl.rl.trainer import _accumulation
    from orbitctl.rl.update import run_update

    ensure_process_group()
    try:
        engine, _ = build_engine(policy, profile, _accumulation(profile, 1), 1)
        batch = collect(policy, split.train[:8], make_reward(profile.data.reward, split.task),
                        group_size=profile.rl.group_size, batch_size=32, max_new_tokens=profile.rollout.max_new_tokens,
                        temperature=1.0, top_p=1.0, generator=torch.Generator().manual_seed(0), keep_dist=True)
        applied = []
        run_update(engine, policy, batch, group_advantages(batch.rewards, profile.rl.group_size, True), profile,
                   lambda stats, seconds, ok, norm: applied.append(ok and stats.finite))
        return applied
    finally:
        close_process_group()


def test_eager_attention_is_loaded_agrees_across_paths_and_trains(small_profile):
    fused, _ = _policy(small_profile())
    assert fused.model.config._attn_implementation == DECODE_SDPA  # SDPA, the CPU decode written out
    profile = small_profile("eager", **{"memory.flash_attention": False})
    eager, split = _policy(profile)
    assert eager.model.config._attn_implementation == "eager"
    ids, mask = eager.encode_prompts(["M2:"])
    with torch.no_grad():  # only the eager kernel materialises the [heads, seq, seq] probabilities
        attentions = eager.model(input_ids=ids, attention_mask=mask, output_attentions=True).attentions
    assert attentions is not None and attentions[0].shape[-2:] == (ids.shape[1], ids.shape[1])

    # the floor: the same train/infer comparison on the default (SDPA) model; then a few ulps of a log-prob
    floor = _train_infer_gap(fused)
    ulps = 4 * torch.finfo(torch.float32).eps * 10
    assert _train_infer_gap(eager) <= 4 * max(floor, ulps)
    assert _one_update(profile, eager, split) == [True]
