"""Build the CPU demo's base model: a real Hugging Face checkpoint, made by code, reproducibly.

The architecture is the catalog's tiny config; the weights are a seeded random init followed
by a short supervised warm start on the task's answer *format* (the completions are random
digits, so the warm-started model knows the shape of an answer but not which answer is right).
Everything is a pure function of (config, task, seed, warm-start settings), so the cache key
covers the whole recipe.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path

from orbitctl.model.charset import VOCAB_SIZE, save_char_tokenizer

# Filled in when the catalog config leaves them out; sized so 2 cores train it in minutes.
_TINY_DEFAULTS = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "vocab_size": VOCAB_SIZE, "max_position_embeddings": 64, "bos_token_id": 1, "eos_token_id": 2,
    "pad_token_id": 0, "tie_word_embeddings": False, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
    "hidden_act": "silu",
}


RECIPE = 4


@dataclass(frozen=True)
class WarmStart:
    steps: int = 300
    batch_size: int = 64
    lr: float = 3e-3
    seed: int = 0


def demo_config(arch: str) -> dict:
    """The catalog's config with the fields a tiny model needs filled in (a llama unless the catalog names
    another model type); vocab must match the charset."""
    from orbitctl.arch.catalog import builtin_config
    from orbitctl.errors import UserError

    config = {**_TINY_DEFAULTS, **builtin_config(arch)}
    if config.get("vocab_size") != VOCAB_SIZE:
        raise UserError(f"model.arch: {arch} has vocab_size {config.get('vocab_size')}; the demo tokenizer has {VOCAB_SIZE}",
                        fix=f"use a tiny catalog architecture with vocab_size {VOCAB_SIZE} or set model.path to a real checkpoint")
    return config


def recipe_key(config: dict, task, warm: WarmStart, extra: dict | None = None) -> str:
    """Changes whenever anything that shapes the built weights changes (bump RECIPE on code changes)."""
    prompts = hashlib.sha256("\n".join(it.prompt for it in task.items()).encode()).hexdigest()
    blob = json.dumps({"config": config, "task": task.name, "prompts": prompts, "warm": asdict(warm),
                       "reading": [task.reading_example is not None, task.reading_share], "extra": extra or {},
                       "recipe": RECIPE}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def build_demo_checkpoint(out_dir: str | Path, config: dict, task, warm: WarmStart) -> dict:
    """Write config.json, model.safetensors (bf16) and tokenizer.json to ``out_dir``; return warm-start stats."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from orbitctl.model.charset import build_char_tokenizer

    out_dir = Path(out_dir)
    torch.manual_seed(warm.seed)
    fields = {k: v for k, v in config.items() if k not in ("architectures", "model_type", "torch_dtype")}
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(config["model_type"], **fields), dtype=torch.float32)
    # The output layer stays at a wide random init through the warm start. Trained on random
    # answers, it would pull every digit's row together; the frozen lm_head then leaves the
    # adapters no direction that separates one digit from another, and RL cannot move the
    # answer distribution (measured: a LoRA could not even fit a constant answer).
    with torch.no_grad():
        model.lm_head.weight.normal_(0.0, 0.1)
    model.lm_head.weight.requires_grad_(False)
    tokenizer = build_char_tokenizer()
    train_items = [it for it in task.items() if not task.is_eval(it)]
    rng = random.Random(warm.seed)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=warm.lr, weight_decay=0.0)
    model.train()
    loss_value = float("nan")
    for step in range(warm.steps):
        pairs = []
        for _ in range(warm.batch_size):
            if task.reading_example is not None and rng.random() < task.reading_share:
                pairs.append(task.reading_example(rng))
            else:
                item = train_items[rng.randrange(len(train_items))]
                pairs.append((item.prompt, task.format_example(item, rng)))
        prompts = tokenizer([p for p, _ in pairs], add_special_tokens=True)["input_ids"]
        answers = [tokenizer(a, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] for _, a in pairs]
        ids, labels = _right_padded(prompts, answers, tokenizer.pad_token_id)
        loss = model(input_ids=ids, attention_mask=(labels != -200).long(), labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        loss_value = float(loss.detach())
    out_dir.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(str(out_dir), safe_serialization=True)
    save_char_tokenizer(out_dir)
    return {"warm_start_loss": loss_value, "warm_start_steps": warm.steps}


def _right_padded(prompts, answers, pad_id):
    """Input ids and labels (-100 on prompt and padding) for teacher forcing on the answer only."""
    import torch

    length = max(len(p) + len(a) for p, a in zip(prompts, answers))
    ids = torch.full((len(prompts), length), pad_id, dtype=torch.long)
    labels = torch.full((len(prompts), length), -100, dtype=torch.long)
    for row, (p, a) in enumerate(zip(prompts, answers)):
        seq = p + a
        ids[row, : len(seq)] = torch.tensor(seq)
        labels[row, len(p): len(seq)] = torch.tensor(a)
    # every prompt has the same length here, so right padding only follows the answer
    return ids, labels
