"""The chunked loss and the activation offload, measured against the plan on a real device.

    python benchmarks/memory_mechanics.py            # on a CUDA GPU: Kimi-K2's output width, real peaks
    python benchmarks/memory_mechanics.py --smoke    # the same code on this CPU at toy widths (bytes moved only)

1. Chunked loss (``memory.loss_chunk_size``): one llama decoder layer with Kimi-K2's output layer
   (vocabulary 163,840, hidden 7168), bf16 with bf16 LoRA, one GRPO step (forward, PPO-clip + k3
   align loss, backward, AdamW) over 4096 completion tokens through the trainer's own
   ``orbitctl.rl.update.completion_terms``, unchunked and in chunks of 1024. The peak of each
   (torch.cuda.max_memory_allocated) and how much it falls, against how much the plan's logits term
   (``orbitctl.plan.activations.logits_peak``) falls over the same change.
2. Activation offload (``memory.offload_activations: cpu``): a few llama layers with gradient
   checkpointing, one step with and without ``orbitctl.model.offload.offloaded_boundaries``: the
   bytes sent to host against the plan's ``saved_boundaries_host``, and the device peak with and
   without against the plan's kept boundaries (L x 2h x T -> 2 x 2h x T).

Each measurement is the median of ``--reps`` steps (the first, warm-up step not counted), with the
range. On a GPU, run it there standalone (docs/benchmarks.md, "Device check"); never part of the test suite.
"""

from __future__ import annotations

import argparse
import statistics
from types import SimpleNamespace

KIMI_OUTPUT = {"vocab_size": 163_840, "hidden_size": 7168, "intermediate_size": 18_432, "num_hidden_layers": 1,
               "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 112}
SMOKE_OUTPUT = {"vocab_size": 4096, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 1,
                "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64}
OFFLOAD = {"vocab_size": 32_000, "hidden_size": 4096, "intermediate_size": 11_008, "num_hidden_layers": 8,
           "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128}
SMOKE_OFFLOAD = {**SMOKE_OUTPUT, "num_hidden_layers": 4}


def _config(width: dict, tokens: int):
    from transformers import LlamaConfig

    config = LlamaConfig(**width, max_position_embeddings=tokens + 16, tie_word_embeddings=False, rms_norm_eps=1e-5)
    config._attn_implementation = "sdpa"
    return config


def _policy(width: dict, tokens: int, device: str):
    """A bf16 llama of ``width`` on ``device`` with bf16 LoRA on every linear (the planner's shadow adapters), as
    a Policy with gradient checkpointing on: what the trainer's loss functions take."""
    import torch
    from transformers import AutoModelForCausalLM

    from orbitctl.arch import arch_from_config
    from orbitctl.model.policy import Policy
    from orbitctl.plan.adapters import plan_adapters
    from orbitctl.plan.shadow import attach_shadow_adapters, freeze_to_buffers
    from orbitctl.profile.schema import AdapterSection

    arch = arch_from_config({"model_type": "llama", **width}, name="bench")
    section = AdapterSection(kind="lora", rank=16, targets="all-linear", dtype="bf16")
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(_config(width, tokens), dtype=torch.bfloat16)
        attach_shadow_adapters(model, arch, plan_adapters(arch, section), section)
    freeze_to_buffers(model)
    model.to(device)
    policy = Policy(model, SimpleNamespace(eos_token_id=0, pad_token_id=0), None, hidden_size=width["hidden_size"],
                    adapter_kind="lora")
    return policy, arch


def _batch(width: dict, tokens: int, device: str) -> dict:
    import torch

    ones = torch.ones(1, 8, dtype=torch.long, device=device)
    return {"prompt_ids": ones, "prompt_mask": ones,
            "completion_ids": torch.randint(0, width["vocab_size"], (1, tokens), device=device),
            "attention": torch.ones(1, tokens, dtype=torch.long, device=device),
            "adv": torch.ones(1, device=device), "infer_logp": torch.zeros(1, tokens, device=device)}


def _step(policy, mb, optimizer, *, chunk: int, offload: bool) -> int:
    """One GRPO step as the trainer computes it; returns the bytes the offload sent to host."""
    from orbitctl.model.offload import offloaded_boundaries
    from orbitctl.rl.losses import k3, ppo_clip_terms
    from orbitctl.rl.update import completion_terms

    with offloaded_boundaries(policy.model, offload) as moved:
        terms = completion_terms(policy, mb, 1.0, chunk)
    pg, _, _ = ppo_clip_terms(terms.logp, terms.logp.detach(), mb["adv"], 0.2)
    loss = (pg + 0.1 * k3(terms.logp, mb["infer_logp"])).sum() / mb["completion_ids"].numel()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return moved.bytes


def _measure(policy, mb, reps: int, **how) -> tuple[list[int], list[int]]:
    """(peak bytes per step, bytes sent to host per step) over ``reps`` steps after one warm-up step."""
    import torch

    cuda = mb["completion_ids"].is_cuda
    optimizer = torch.optim.AdamW(policy.trainable_parameters(), lr=1e-6)
    _step(policy, mb, optimizer, **how)
    peaks, moved = [], []
    for _ in range(reps):
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        moved.append(_step(policy, mb, optimizer, **how))
        if cuda:
            torch.cuda.synchronize()
            peaks.append(torch.cuda.max_memory_allocated())
    return peaks, moved


def _fig(values: list[int], unit: float = 2**30, spec: str = ".3f") -> str:
    if not values:
        return "n/a"
    return f"{statistics.median(values) / unit:{spec}} ({min(values) / unit:{spec}}-{max(values) / unit:{spec}})"


def chunked_loss_rows(device: str, smoke: bool, reps: int = 3) -> list[tuple[str, str, str]]:
    """Step 1: the peak with and without chunking, its fall against the plan's."""
    import torch

    from orbitctl.plan.activations import ActivationSettings, logits_peak

    width, tokens, chunk = (SMOKE_OUTPUT, 256, 64) if smoke else (KIMI_OUTPUT, 4096, 1024)
    policy, arch = _policy(width, tokens, device)
    mb = _batch(width, tokens, device)
    whole, _ = _measure(policy, mb, reps, chunk=0, offload=False)
    chunked, _ = _measure(policy, mb, reps, chunk=chunk, offload=False)
    settings = ActivationSettings(tokens=tokens, seq_len=tokens, checkpointing=True, offload=False, flash=True,
                                  dropout=False, adapter_bytes=2, loss_chunk=0)
    planned = logits_peak(arch, settings) - logits_peak(arch, ActivationSettings(**{**settings.__dict__,
                                                                                     "loss_chunk": chunk}))
    label = f"chunked loss (V {width['vocab_size']:,}, {tokens} tokens, chunks of {chunk})"
    if not whole:
        return [(label, f"ran on {device}; peaks are measured on a CUDA device only", "ok")]
    falls = [w - c for w, c in zip(whole, chunked)]
    ratio = statistics.median(falls) / planned
    del policy
    torch.cuda.empty_cache()
    return [(label, f"peak GiB unchunked {_fig(whole)}, chunked {_fig(chunked)}; falls {_fig(falls)} against the "
                    f"plan's logits term {planned / 2**30:.3f}: x{ratio:.3f}", "ok" if abs(ratio - 1) <= 0.10 else "CHECK")]


def offload_rows(device: str, smoke: bool, reps: int = 3) -> list[tuple[str, str, str]]:
    """Step 2: the bytes sent to host and the device peak with and without the offload, against the plan."""
    import torch

    from orbitctl.plan.activations import ActivationSettings, train_activations
    from orbitctl.plan.adapters import plan_adapters
    from orbitctl.profile.schema import AdapterSection

    width, tokens = (SMOKE_OFFLOAD, 256) if smoke else (OFFLOAD, 4096)
    policy, arch = _policy(width, tokens, device)
    mb = _batch(width, tokens, device)
    kept, _ = _measure(policy, mb, reps, chunk=1024 if not smoke else 64, offload=False)
    offloaded, moved = _measure(policy, mb, reps, chunk=1024 if not smoke else 64, offload=True)
    ad = plan_adapters(arch, AdapterSection(kind="lora", rank=16, targets="all-linear", dtype="bf16"))
    settings = ActivationSettings(tokens=tokens, seq_len=tokens, checkpointing=True, offload=True, flash=True,
                                  dropout=False, adapter_bytes=2, loss_chunk=0)
    planned_host = train_activations(arch, ad, settings).saved_boundaries_host
    planned_fall = planned_host - 2 * 2 * width["hidden_size"] * tokens  # L boundaries kept -> 2
    ratio = statistics.median(moved) / planned_host
    rows = [(f"activation offload ({width['num_hidden_layers']} layers, hidden {width['hidden_size']}, {tokens} tokens)",
             f"sent to host {_fig(moved, 2**20, '.1f')} MiB per step against the plan's boundaries "
             f"{planned_host / 2**20:.1f} MiB: x{ratio:.3f}", "ok" if abs(ratio - 1) <= 0.05 else "CHECK")]
    if kept:
        falls = [k - o for k, o in zip(kept, offloaded)]
        rows.append(("activation offload: device peak", f"GiB without {_fig(kept)}, with {_fig(offloaded)}; falls "
                                                         f"{_fig(falls, 2**20, '.1f')} MiB against the plan's "
                                                         f"{planned_fall / 2**20:.1f} MiB", ""))
    del policy
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="toy widths on this CPU (bytes moved only, no peaks)")
    parser.add_argument("--reps", type=int, default=3, help="measured steps per setting, after one warm-up")
    args = parser.parse_args()
    import torch

    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    for label, figure, verdict in chunked_loss_rows(device, args.smoke, args.reps) + \
            offload_rows(device, args.smoke, args.reps):
        print(f"{label}: {figure}  [{verdict}]")


if __name__ == "__main__":
    main()
