"""llama.cpp (through llama-cpp-python, optional) reading the exported GGUF files, against the train path.

Each sequence is fed as token ids (``Llama.eval``) with ``logits_all``, so the logits at every position
come back (``Llama.scores``) and are compared position for position with the train path's
(:func:`orbitctl.export.compare.train_path_logits`). llama.cpp computes in float32 but its Q4_0 matmul
on the CPU quantizes the activations to 8 bits (``Q8_0``), so it is not bit-equal to orbitctl; with
the adapter left out, the distance to the adapted train path shows what the adapter is worth.

llama.cpp runs in a child process (:func:`orbitctl.isolated.run_isolated`): a llama.cpp that dies
(SIGILL from a build for another CPU, issue 42) raises :class:`~orbitctl.isolated.NativeCrash`, one
line naming the signal and its cause, and the caller (a test, ``benchmarks/llama_cpp_check.py``) lives on.
The parent never imports ``llama_cpp``; importing this module imports no torch.
"""

from __future__ import annotations

from pathlib import Path

from orbitctl.isolated import run_isolated

SIGILL_FIX = ("Rebuild llama.cpp for the portable baseline: `make setup` builds llama-cpp-python with GGML_NATIVE=OFF "
              "(AVX2, FMA, F16C; no AVX-512, no AMX) into its own wheelhouse and installs it (docs/export.md, "
              "Building llama.cpp); `orbitctl doctor` shows the CPU's ISA and the kernel's AMX state")
"""What a llama.cpp that died of SIGILL tells the user to do."""


def llama_cpp_logits(model_path: str | Path, seqs: list[list[int]], *, lora_path: str | Path | None = None,
                     n_ctx: int = 128, timeout: float | None = 1800) -> list:
    """Per sequence, [len - 1, V] float32 logits (torch tensors) llama.cpp computes predicting tokens 1..len-1.

    Computed in a child process; :class:`~orbitctl.isolated.NativeCrash` if llama.cpp dies there."""
    import torch

    scores = run_isolated(llama_cpp_scores, str(model_path), seqs, lora_path=None if lora_path is None else str(lora_path),
                          n_ctx=n_ctx, what="llama.cpp", timeout=timeout, sigill_fix=SIGILL_FIX)
    return [torch.from_numpy(s) for s in scores]


def llama_cpp_scores(model_path: str, seqs: list[list[int]], *, lora_path: str | None = None, n_ctx: int = 128) -> list:
    """What the child computes: per sequence, [len - 1, V] float32 numpy logits (no torch in the child)."""
    import numpy as np
    from llama_cpp import Llama

    llm = Llama(model_path=model_path, lora_path=lora_path, logits_all=True, n_ctx=n_ctx, n_threads=2,
                vocab_only=False, verbose=False)
    out = []
    for seq in seqs:
        llm.reset()
        llm.eval(seq)
        out.append(np.array(llm.scores[: len(seq) - 1], dtype=np.float32))
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
