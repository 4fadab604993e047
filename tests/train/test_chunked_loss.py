"""``memory.loss_chunk_size``: the output layer and the loss a chunk of positions at a time.

What it saves is measured at a real output width under FakeTensorMode (nothing is allocated); what it
computes is compared with the unchunked step on the tiny model, against the floor of the same step
split into two micro-batches (or the rounding bound of the compute dtype, whichever is larger).
"""

import importlib.util
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

# a Qwen-size output layer on one llama decoder layer
WIDE = {"vocab_size": 151_936, "hidden_size": 2048, "intermediate_size": 5504, "num_hidden_layers": 1,
        "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 128, "max_position_embeddings": 4096,
        "tie_word_embeddings": False, "rms_norm_eps": 1e-5, "rope_theta": 10000.0}
TOKENS, CHUNK = 2048, 256


def _wide_step_peak(chunk: int) -> int:
    """Peak bytes of one train step (forward, GRPO loss with the k3 align term, backward, AdamW) of the wide
    model with bf16 LoRA, through :func:`orbitctl.rl.update.completion_terms` as the trainer calls it."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker
    from transformers import AutoModelForCausalLM, LlamaConfig

    from orbitctl.arch import arch_from_config
    from orbitctl.model.policy import Policy
    from orbitctl.plan.adapters import plan_adapters
    from orbitctl.plan.shadow import attach_shadow_adapters, freeze_to_buffers, register_flash_style_attention
    from orbitctl.profile.schema import AdapterSection
    from orbitctl.rl.losses import k3, ppo_clip_terms
    from orbitctl.rl.update import completion_terms

    arch = arch_from_config({"model_type": "llama", **WIDE}, name="wide")
    section = AdapterSection(kind="lora", rank=16, targets="all-linear", dtype="bf16")
    config = LlamaConfig(**WIDE)
    config._attn_implementation = register_flash_style_attention()

    class Step(torch.nn.Module):
        # one parent module for the step: MemTracker takes a module called several times (the output
        # layer, once per chunk) only inside another module's call
        def __init__(self, policy):
            super().__init__()
            self.model, self.policy = policy.model, policy

        def forward(self, mb):
            terms = completion_terms(self.policy, mb, 1.0, chunk)
            pg, _, _ = ppo_clip_terms(terms.logp, terms.logp.detach(), mb["adv"], 0.2)
            return (pg + 0.1 * k3(terms.logp, mb["infer_logp"])).sum() / TOKENS

    with FakeTensorMode():
        with torch.device("cpu"):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
            attach_shadow_adapters(model, arch, plan_adapters(arch, section), section)
        freeze_to_buffers(model)
        policy = Policy(model, SimpleNamespace(eos_token_id=0, pad_token_id=0), None, hidden_size=WIDE["hidden_size"],
                        adapter_kind="lora")
        step = Step(policy)
        optimizer = torch.optim.AdamW(policy.trainable_parameters(), lr=1e-5)
        ones = torch.ones(1, 8, dtype=torch.long)
        mb = {"prompt_ids": ones, "prompt_mask": ones,
              "completion_ids": torch.randint(0, WIDE["vocab_size"], (1, TOKENS)),
              "attention": torch.ones(1, TOKENS, dtype=torch.long), "adv": torch.ones(1),
              "infer_logp": torch.zeros(1, TOKENS)}
        tracker = MemTracker()
        tracker.track_external(step, optimizer)
        with tracker:
            step(mb).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        peak = next(iter(tracker.get_tracker_snapshot("peak").values()))
    return max(int(v) for v in peak.values())  # the 'Total' entry


def test_chunked_loss_lowers_the_step_peak_by_the_plans_logits_term():
    """The measured peak of one step falls, from unchunked to chunks of 256 tokens, by what the plan's
    logits term (:func:`orbitctl.plan.activations.logits_peak`: 12 V bytes per token at the loss backward)
    falls over the same change, ``12 V (2048 - 256)``, within 10%. Both peaks are the step's total
    (parameters, frozen buffers, activations, gradients, optimizer state), so the difference is what
    chunking frees; V = 151,936, hidden 2048, 2048 completion tokens, one decoder layer."""
    from orbitctl.arch import arch_from_config
    from orbitctl.plan.activations import ActivationSettings, logits_peak

    arch = arch_from_config({"model_type": "llama", **WIDE}, name="wide")
    settings = ActivationSettings(tokens=TOKENS, seq_len=TOKENS, checkpointing=True, offload=False, flash=True,
                                  dropout=False, adapter_bytes=2, loss_chunk=0)
    planned = logits_peak(arch, settings) - logits_peak(arch, ActivationSettings(**{**settings.__dict__,
                                                                                     "loss_chunk": CHUNK}))
    whole, chunked = _wide_step_peak(0), _wide_step_peak(CHUNK)
    measured = whole - chunked
    print(f"peak unchunked {whole / 2**20:.1f} MiB, chunks of {CHUNK} {chunked / 2**20:.1f} MiB: "
          f"falls by {measured / 2**20:.1f} MiB; the plan's logits term falls by {planned / 2**20:.1f} MiB "
          f"(ratio {measured / planned:.3f})")
    assert abs(measured - planned) <= 0.10 * planned


# -- the same numbers ------------------------------------------------------------------------------------------

def _conftest():
    spec = importlib.util.spec_from_file_location("train_conftest", Path(__file__).with_name("conftest.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(profile, policy) of the tiny demo model with random adapters, every loss term switched on."""
    from orbitctl.builder import load_policy, prepare_frozen_base
    from orbitctl.model.adapters import randomize_adapters
    from orbitctl.data.prompts import load_prompts
    from orbitctl.profile import load_profile

    profile = load_profile(_conftest().small_profile_yaml(tmp_path_factory.mktemp("chunked"), "chunked", **{
        "rl.algorithm": "ppo", "rl.kl_ref_coef": 0.05, "rollout.temperature": 0.7}))
    split = load_prompts(profile.data, profile.run.seed)
    policy = load_policy(profile, prepare_frozen_base(profile, split.warm_task))
    randomize_adapters(policy.model, seed=0, std=0.05)
    return profile, policy, split


def _with_chunk(profile, chunk: int):
    return profile.model_copy(update={"memory": profile.memory.model_copy(update={"loss_chunk_size": chunk})})


def _batch(policy, split, rows: int = 6, length: int = 5):
    """A micro-batch with ragged completions, an infer distribution near the train one and a PPO pi_old."""
    from orbitctl.rl.update import old_logprobs

    gen = torch.Generator().manual_seed(1)
    prompt_ids, prompt_mask = policy.encode_prompts([it.prompt for it in split.train[:rows]])
    completion_ids = torch.randint(0, int(policy.model.config.vocab_size), (rows, length), generator=gen)
    lengths = torch.tensor([length, 1, 3, length, 2, 4])[:rows]
    completion_mask = (torch.arange(length)[None, :] < lengths[:, None]).long()
    with torch.no_grad():
        logits = policy.completion_logits(prompt_ids, prompt_mask, completion_ids, completion_mask, train=False)
    dist = torch.log_softmax(logits.float() / 0.7 + 0.3 * torch.randn(logits.shape, generator=gen), -1)
    batch = SimpleNamespace(size=rows, prompt_ids=prompt_ids, prompt_mask=prompt_mask, completion_ids=completion_ids,
                            completion_mask=completion_mask, completion_attention=None, routes=None)
    old = old_logprobs(policy, batch, rows, 0.7) + 0.05 * torch.randn(rows, length, generator=gen) * completion_mask
    return batch, {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids,
                   "completion_mask": completion_mask, "attention": completion_mask,
                   "infer_logp": dist.gather(-1, completion_ids[..., None]).squeeze(-1) * completion_mask,
                   "dist": dist, "adv": torch.randn(rows, generator=gen), "old_logp": old * completion_mask}


def _step(policy, profile, mb, splits):
    """micro_loss over ``splits`` (row slices) accumulated like the trainer: (loss, stats, adapter gradients)."""
    from orbitctl.rl.update import StepStats, micro_loss

    policy.model.zero_grad(set_to_none=True)
    stats, total, loss = StepStats(), float(mb["completion_mask"].sum()), 0.0
    for rows in splits:
        part = micro_loss(policy, {k: v[rows] if isinstance(v, torch.Tensor) else v for k, v in mb.items()},
                          profile, total, stats)
        part.backward()
        loss += float(part.detach())
    return loss, stats.means(), {n: p.grad.clone() for n, p in policy.named_trainable()}


def _gap(a, b) -> float:
    if isinstance(a, dict):
        return max(_gap(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        return float((a - b).abs().max())
    return abs(a - b)


def _size(a) -> float:
    if isinstance(a, dict):
        return max(_size(v) for v in a.values())
    return float(a.abs().max()) if isinstance(a, torch.Tensor) else abs(a)


def test_chunked_step_equals_the_unchunked_step(tiny):
    """Log-probs (pi_old pass), loss, every metric and the adapter gradients of chunks of 4 positions (the 30
    positions of the micro-batch split 4 + ... + 2) equal the unchunked step's within the larger of the floor
    (the unchunked step over the same rows as two micro-batches) and the rounding bound of a sum of H + N
    terms in the compute dtype (H: the output layer's dot products, N: the tokens a gradient sums over)."""
    from orbitctl.rl.update import old_logprobs

    profile, policy, split = tiny
    batch, mb = _batch(policy, split)
    whole, chunked = _with_chunk(profile, 0), _with_chunk(profile, 4)
    assert whole.rl.align_loss.kind == "kl" and whole.rl.kl_ref_coef > 0 and whole.rl.is_correction.kind == "tis"

    ref_loss, ref_stats, ref_grads = _step(policy, whole, mb, [slice(0, 6)])
    split_loss, split_stats, split_grads = _step(policy, whole, mb, [slice(0, 2), slice(2, 6)])
    loss, stats, grads = _step(policy, chunked, mb, [slice(0, 6)])
    ref_old, split_old = old_logprobs(policy, batch, 6, 0.7), old_logprobs(policy, batch, 2, 0.7)
    chunked_old = old_logprobs(policy, batch, 6, 0.7, chunk=4)

    assert set(stats) == set(ref_stats) >= {"policy_loss", "align_loss", "ref_kl", "entropy", "is_ratio_mean",
                                            "ppo_clipped_fraction", "mismatch_k3_kl"}
    dtype = policy.model.get_input_embeddings().weight.dtype
    terms = policy.hidden_size + int(mb["completion_mask"].sum())
    for name, ours, ref, other in [("loss", loss, ref_loss, split_loss), ("metrics", stats, ref_stats, split_stats),
                                   ("adapter gradients", grads, ref_grads, split_grads),
                                   ("pi_old log-probs", chunked_old, ref_old, split_old)]:
        floor = max(_gap(other, ref), terms * torch.finfo(dtype).eps * max(_size(ref), 1.0))
        print(f"{name}: chunked {_gap(ours, ref):.3g}, split {_gap(other, ref):.3g}, floor {floor:.3g}")
        assert _gap(ours, ref) <= floor, (name, _gap(ours, ref), floor)
    assert _size(ref_grads) > 0 and all(float(g.abs().sum()) > 0 for g in grads.values())


def test_reference_pass_disables_the_adapters_in_chunks_too(tiny):
    """The chunked reference log-probs are the base's: they equal the unchunked reference pass and differ
    from the adapted policy's."""
    from orbitctl.rl.chunked_loss import chunked_logprobs
    from orbitctl.rl.update import _reference_logp

    profile, policy, split = tiny
    _, mb = _batch(policy, split)
    ref = _reference_logp(policy, mb, 0.7, 0)
    chunked = chunked_logprobs(policy, mb, 0.7, 4, reference=True)
    adapted = chunked_logprobs(policy, mb, 0.7, 4)
    bound = policy.hidden_size * torch.finfo(ref.dtype).eps * float(ref.abs().max())
    assert float((chunked - ref).abs().max()) <= bound
    assert float((adapted - ref).abs().max()) > 1e3 * bound


def test_a_rank_with_fewer_chunks_runs_empty_ones_and_computes_the_same(tiny, monkeypatch):
    """Under ZeRO-3 every call of the output layer gathers its weight with all ranks, so a rank with fewer
    positions runs the largest rank's chunk count: its extra, empty chunks call the output layer in the forward
    and again in the backward's recompute, and change no value and no gradient."""
    import orbitctl.rl.chunked_loss as chunked_loss

    profile, policy, split = tiny
    _, mb = _batch(policy, split)
    calls = []
    hook = policy.output_layer.register_forward_hook(lambda module, args, out: calls.append(args[0].shape[0]))
    try:
        loss, stats, grads = _step(policy, _with_chunk(profile, 4), mb, [slice(0, 6)])
        own = len(calls)
        agreed = chunked_loss._agreed_chunk_count
        monkeypatch.setattr(chunked_loss, "_agreed_chunk_count", lambda count, device: agreed(count, device) + 2)
        calls.clear()
        padded = _step(policy, _with_chunk(profile, 4), mb, [slice(0, 6)])
    finally:
        hook.remove()
    # two empty chunks each in the policy's forward, in the reference pass and in the backward's recompute
    assert own == len(calls) - 6 and calls.count(0) == 6
    assert padded[0] == loss and padded[1] == stats and all(torch.equal(padded[2][n], g) for n, g in grads.items())


@pytest.mark.slow
def test_tiny_cpu_with_chunks_of_4_learns_like_the_default_run(small_profile):
    """One step of the demo profile with ``memory.loss_chunk_size: 4`` reports the default run's first-step
    loss and metrics within the floor: the default run with the step split into twice as many micro-batches."""
    from orbitctl.launch.api import train
    from orbitctl.kernels.cpu_dtype import compute_dtype_name, torch_dtype
    from orbitctl.rundir import read_metrics

    def first_step(name, **overrides):
        result = train(small_profile(name, **overrides), steps=1)
        (record,) = read_metrics(result.run_dir)
        assert record["update_applied"]
        return record

    default = first_step("default")
    split = first_step("split", **{"memory.micro_batch_size": 8})
    chunked = first_step("chunked", **{"memory.loss_chunk_size": 4})
    keys = ["policy_loss", "align_loss", "entropy", "mismatch_k3_kl", "mismatch_logp_abs_mean", "is_ratio_mean",
            "grad_norm"]
    # the rounding bound of the output layer's dot products (hidden 64) in the compute dtype of the run
    eps = 64 * torch.finfo(torch_dtype(compute_dtype_name(small_profile("dtype")))).eps
    for key in keys:
        floor = max(abs(split[key] - default[key]), eps * max(abs(default[key]), 1.0))
        assert abs(chunked[key] - default[key]) <= floor, (key, chunked[key], default[key], floor)
    print(json.dumps({k: [default[k], chunked[k]] for k in keys}))
