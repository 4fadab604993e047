"""`orbitctl export`: the frozen base and its adapter in the files other runtimes read.

``base`` (the quantized base on disk read tensor by tensor, each weight as orbitctl decodes it),
``q4_0`` (INT4 codes and scales repacked into llama.cpp's Q4_0 blocks, the same integers),
``archs`` (the architectures llama.cpp loads in this layout: names, metadata, the Q/K row order),
``vocab`` (the tokenizer as llama.cpp's loader reads it), ``gguf_base`` and ``gguf_lora`` (the
two GGUF files), ``merged`` (a bf16 Hugging Face checkpoint with the adapter merged, and what
merging costs), ``report`` (the per-tensor report) and ``api`` (the command's entry point).
Above ``builder`` and ``align``; importing this package imports no torch.
"""
