"""The compute kernels and their build: what the model's layers call to multiply, attend and cache.

``int4_kernel`` (the fused INT4 weight-only matmul over a pack made once at load: PyTorch's CPU kernel or
CUDA's tinygemm), ``bf16_cpu`` (with ``csrc/bf16_cpu.cpp``: orbitctl's AVX512-BF16 CPU kernels, compiled at
first use, and which ISA this process may use), ``cpu_state`` (what the OS lets a process run; standard
library only), ``cpu_dtype`` (what the host CPU runs natively, what ``auto`` dtypes mean),
``decode_attention`` (one query position against the KV cache on the CPU), ``grouped_int4`` (a MoE
layer's routed INT4 experts as one Triton kernel per projection), ``kv_cache`` (the bf16 cache with room
for the decode, the fp8 cache), ``graph_capture`` (the static-shape switch and when decode graphs apply),
``eager`` (whether a tensor is a real one in eager mode, where the kernels run).

A floor of its own in :mod:`orbitctl.layers`, below ``model``: a kernel takes tensors and plain values and
imports nothing of the model (nor of anything above it). Nothing is imported here.
"""
