"""Held-out sequences and the train path's logits on them: what an exported model is measured against.

A sequence is a held-out prompt with its reference answer, as the model reads it: BOS (when the
tokenizer adds one), the prompt, the answer, EOS. The train path is orbitctl's own forward of the
frozen quantized base with the unmerged adapter (:meth:`~orbitctl.model.policy.Policy.completion_logits`:
one full-sequence forward, positions from the first token), and its logits predict every token
after the first. Distances are :mod:`orbitctl.distances` on the log-softmax, in float64.
"""

from __future__ import annotations

import torch

from orbitctl.distances import js_divergence, logsoftmax_l1, topk_agreement


def held_out_sequences(profile, policy, count: int) -> list[list[int]]:
    """Token ids of the first ``count`` held-out prompts with their answers (the training prompts if none are held out)."""
    from orbitctl.data.prompts import load_prompts

    split = load_prompts(profile.data, profile.run.seed)
    items = (split.eval or split.train)[:count]
    tok = policy.tokenizer
    out = []
    for item in items:
        ids = tok(item.prompt + (item.answer or ""))["input_ids"]
        out.append(list(ids) + ([policy.eos_id] if policy.eos_id is not None else []))
    return out


def _right_padded(seqs: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    length = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), length), pad, dtype=torch.long)
    mask = torch.zeros((len(seqs), length), dtype=torch.long)
    for row, seq in enumerate(seqs):
        ids[row, : len(seq)] = torch.tensor(seq)
        mask[row, : len(seq)] = 1
    return ids, mask


def train_path_logits(policy, seqs: list[list[int]]) -> list[torch.Tensor]:
    """Per sequence, [len - 1, V] float32 logits of the train path predicting tokens 1..len-1."""
    ids, mask = _right_padded(seqs, policy.pad_id)
    with torch.no_grad():
        logits = policy.completion_logits(ids[:, :1], mask[:, :1], ids[:, 1:], mask[:, 1:], train=False)
    return [logits[row, : len(seq) - 1].float().cpu() for row, seq in enumerate(seqs)]


def model_logits(model, seqs: list[list[int]], pad: int) -> list[torch.Tensor]:
    """The same positions from a plain Hugging Face model (a merged checkpoint), same position ids."""
    from orbitctl.model.policy import position_ids_for

    ids, mask = _right_padded(seqs, pad)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=position_ids_for(mask), use_cache=False).logits
    return [logits[row, : len(seq) - 1].float() for row, seq in enumerate(seqs)]


def distances(reference: list[torch.Tensor], other: list[torch.Tensor]) -> dict:
    """Max abs logit difference, log-softmax L1, JS and top-1 agreement over every compared position."""
    a = torch.cat([t.double() for t in reference])
    b = torch.cat([t.double() for t in other])
    la, lb = torch.log_softmax(a, -1), torch.log_softmax(b, -1)
    l1, js = logsoftmax_l1(la, lb), js_divergence(la, lb)
    return {"positions": int(a.shape[0]), "max_abs_logit_diff": float((a - b).abs().max()),
            "logsoftmax_l1_mean": float(l1.mean()), "logsoftmax_l1_max": float(l1.max()),
            "js_mean": float(js.mean()), "js_max": float(js.max()),
            "top1_agreement": float(topk_agreement(la, lb, 1).mean()), "logit_absmax": float(a.abs().max())}
