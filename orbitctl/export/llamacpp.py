"""llama.cpp (through llama-cpp-python, optional) reading the exported GGUF files, against the train path.

Each sequence is fed as token ids (``Llama.eval``) with ``logits_all``, so the logits at every position
come back (``Llama.scores``) and are compared position for position with the train path's
(:func:`orbitctl.export.compare.train_path_logits`). llama.cpp computes in float32 but its Q4_0 matmul
on the CPU quantizes the activations to 8 bits (``Q8_0``), so it is not bit-equal to orbitctl; with
the adapter left out, the distance to the adapted train path shows what the adapter is worth.
"""

from __future__ import annotations

from pathlib import Path

import torch


def llama_cpp_logits(model_path: str | Path, seqs: list[list[int]], *, lora_path: str | Path | None = None,
                     n_ctx: int = 128) -> list[torch.Tensor]:
    """Per sequence, [len - 1, V] float32 logits llama.cpp computes predicting tokens 1..len-1."""
    import numpy as np
    from llama_cpp import Llama

    llm = Llama(model_path=str(model_path), lora_path=None if lora_path is None else str(lora_path), logits_all=True,
                n_ctx=n_ctx, n_threads=2, vocab_only=False, verbose=False)
    out = []
    for seq in seqs:
        llm.reset()
        llm.eval(seq)
        out.append(torch.from_numpy(np.array(llm.scores[: len(seq) - 1], dtype=np.float32)))
    llm.close() if hasattr(llm, "close") else None
    return out


def llama_cpp_agreement(policy, seqs: list[list[int]], model_path: str | Path, lora_path: str | Path) -> dict:
    """llama.cpp on the exported files against the train path, as three distances (:func:`distances`):

    * ``floor``: both sides without the adapter, the same integers: only the kernels differ;
    * ``with_adapter``: the adapted train path against llama.cpp with the LoRA GGUF;
    * ``without_adapter``: the adapted train path against llama.cpp without it (what the adapter is worth).
    """
    from orbitctl.export.compare import distances, train_path_logits
    from orbitctl.model.adapters import adapters_disabled

    train = train_path_logits(policy, seqs)
    with adapters_disabled(policy.model):
        train_base = train_path_logits(policy, seqs)
    plain = llama_cpp_logits(model_path, seqs)
    return {"floor": distances(train_base, plain),
            "with_adapter": distances(train, llama_cpp_logits(model_path, seqs, lora_path=lora_path)),
            "without_adapter": distances(train, plain)}
