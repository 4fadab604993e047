"""Where each rate of the time model comes from, and the calibration file that replaces them with measurements.

Every efficiency factor and per-kernel constant :mod:`orbitctl.plan.timing` turns counts into seconds with is one
of three kinds:

- ``measured``: by orbitctl on a named device, read from a calibration file (``hardware.calibration``);
- ``published``: a figure with its source (a paper, a datasheet, a public benchmark or profile);
- ``assumption``: a stated guess, with its reasoning.

:data:`SOURCES` names each one; :func:`published_experts_hbm` and :func:`published_experts_compute` derive the two
grouped-expert factors from the published Kimi-K2 figures they rest on (the arithmetic is in their docstrings and
tested). A calibration file (orbitctl.profile.calibration) holds absolute rates measured by ``orbitctl plan
--calibrate`` or ``benchmarks/device_check.py``; :func:`calibrated` turns a GPU's into the factors that replace the
published ones, each then ``measured``. Imports no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

MEASURED, PUBLISHED, ASSUMED = "measured", "published", "assumption"


@dataclass(frozen=True)
class Rate:
    """One rate: its value, its kind (measured, published, assumption) and where it comes from."""

    value: float
    kind: str
    source: str
    unit: str = ""
    brief: str = ""
    """The source in a few words, for a table (``source`` in full in --json)."""

    def to_dict(self) -> dict[str, Any]:
        return {"value": self.value, "kind": self.kind, "source": self.source, "unit": self.unit, "brief": self.brief}


# ---- the published Kimi-K2 figures the grouped-expert factors rest on (docs/plan.md, "Anchors")
VLLM_K2_MOE_LAYER_S = 234e-6
"""vllm-project/vllm issue 32832 ("H200 Kimi K2 TP8 Triton MoE min-latency", 2026-01-22): an nsys profile of one
decode step of Kimi-K2-Instruct (W4A16 INT4, group 32) at TP8 on H200, 16 concurrent sequences: the two Triton
fused-MoE kernels of a layer take 234 us (DeepSeek-V3.1 FP8: 109 us)."""
VLLM_K2_CONCURRENCY = 16
VLLM_K2_TP = 8
K2_LORA_TRAIN_TOKENS_PER_S = 6600.0
"""workshoplabs.ai, "post-training 50x faster": LoRA on all weights of Kimi-K2-Thinking, one 8xH200 node, 6,600
training tokens per second."""
K2_LORA_TRAIN_GPUS = 8
K2_TRAIN_FLOPS_PER_PARAM = 6.0
"""FLOPs per active parameter and token credited to that figure: forward 2, recompute 2, input-gradient backward 2
(a frozen base computes no weight gradients; the adapters' own are under 1%)."""
K2_INT4_BYTES_PER_WEIGHT = 0.5 + 2 / 32
"""Kimi-K2's released INT4 experts: 4 bits a weight and one bf16 scale per group of 32 (4.5 bits)."""
H200_HBM_BYTES_PER_S = 4.8e12
H200_BF16_FLOPS = 989e12
"""NVIDIA H200 datasheet: 4.8 TB/s HBM3e, 989 dense BF16 TFLOPS (the catalog's figures, orbitctl/profile/gpus.py)."""


def touched(num_experts: int, top_k: int, tokens: float) -> float:
    """Distinct experts ``tokens`` tokens reach, each picking ``top_k`` of ``num_experts`` evenly: E (1 - (1-k/E)^t)."""
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** tokens)


def published_experts_hbm(num_experts: int = 384, top_k: int = 8, hidden: int = 7168, expert_width: int = 2048,
                          projections: int = 3) -> float:
    """Fraction of H200's HBM bandwidth vLLM's grouped INT4 MoE kernel reaches at decode (vLLM issue 32832).

    At 16 sequences the 384 experts of a layer see 16 x 8 routed slots, which reach 384 (1 - (1 - 8/384)^16) = 109.8
    distinct experts; at TP8 each GPU reads 1/8 of each: 109.8 x 3 x 7168 x 2048 weights x 4.5 bits / 8 = 340 MB
    per layer in 234 us, 1.45 TB/s: 0.30 of the 4.8 TB/s peak. Routing skew (fewer distinct experts) would put the
    figure higher; the kernel's own launch floor, lower."""
    experts = touched(num_experts, top_k, VLLM_K2_CONCURRENCY)
    weights = experts * projections * hidden * expert_width / VLLM_K2_TP
    return weights * K2_INT4_BYTES_PER_WEIGHT / VLLM_K2_MOE_LAYER_S / H200_HBM_BYTES_PER_S


def published_experts_compute(active_params: float = 32.9e9) -> float:
    """Fraction of H200's dense BF16 peak the best published LoRA update of Kimi-K2 reaches, end to end.

    6,600 tokens/s on 8 GPUs x 6 FLOPs x 32.9 B active parameters = 163 TFLOP/s per GPU: 0.165 of 989. A
    whole-system figure (attention, communication and offload included), so an upper bound on what its expert
    GEMMs sustain; no per-kernel figure for grouped INT4 training GEMMs is published."""
    per_gpu = K2_LORA_TRAIN_TOKENS_PER_S / K2_LORA_TRAIN_GPUS * K2_TRAIN_FLOPS_PER_PARAM * active_params
    return per_gpu / H200_BF16_FLOPS


EXPERTS_HBM = round(published_experts_hbm(), 3)
EXPERTS_COMPUTE = round(published_experts_compute(), 3)

SOURCES: dict[str, Rate] = {
    "compute": Rate(0.5, PUBLISHED, "dense-model training MFU 46-56% (Megatron-LM, Narayanan et al. 2021; PaLM, "
                    "Chowdhery et al. 2022: 46.2%)", "of BF16 peak", brief="training MFU 46-56%, Megatron-LM, PaLM"),
    "hbm": Rate(0.8, PUBLISHED, "streaming reads reach 80-90% of HBM peak (STREAM-type copy kernels on A100/H100); "
                "the low end", "of HBM peak", brief="STREAM-type reads 80-90% of peak"),
    "attention_hbm": Rate(0.8, PUBLISHED, "decode attention streams the KV cache: FlashMLA reaches 3,000 GB/s of "
                          "H800's 3.35 TB/s (deepseek-ai/FlashMLA README); the streaming figure 0.8 is taken",
                          "of HBM peak", brief="FlashMLA 3,000 GB/s of H800's 3.35 TB/s"),
    "experts_hbm": Rate(EXPERTS_HBM, PUBLISHED, "vLLM's Triton fused-MoE kernel, Kimi-K2 INT4, TP8 on H200, 16 "
                        "sequences: 234 us per layer (vllm-project/vllm issue 32832) = 1.45 TB/s", "of HBM peak",
                        brief="vLLM issue 32832: 234 us/layer, K2 INT4, TP8 H200"),
    "experts_compute": Rate(EXPERTS_COMPUTE, PUBLISHED, "LoRA update of Kimi-K2-Thinking on one 8xH200 node: 6,600 "
                            "tokens/s (workshoplabs.ai, 'post-training 50x faster') = 163 TFLOP/s per GPU",
                            "of BF16 peak", brief="workshoplabs.ai: K2 LoRA 6,600 tok/s on 8xH200"),
    "link": Rate(0.7, PUBLISHED, "NCCL bus bandwidth on large messages, 70-90% of one link direction (nccl-tests "
                 "busbw); the low end", "of link peak", brief="nccl-tests busbw 70-90%"),
    "nic_gbits_per_gpu": Rate(400.0, PUBLISHED, "one 400 Gb/s InfiniBand NDR adapter per GPU (DGX/HGX H100, H200, "
                              "B200 reference designs)", "Gb/s", brief="one 400 Gb/s NDR adapter per GPU"),
    "host_link": Rate(0.8, ASSUMED, "pinned-memory copies between host and GPU reach about 80% of the PCIe "
                      "link's peak per direction (PCIe 5.0 x16: 63 GB/s, PCIe 4.0 x16: 31.5 GB/s, PCI-SIG)",
                      "of host-link peak", brief="80% of PCIe per direction"),
    "launch_s": Rate(5e-6, PUBLISHED, "a CUDA kernel launch costs the host ~5 us (CUDA C++ Best Practices Guide); "
                     "eager PyTorch ~10 us per op (He 2022, 'Making Deep Learning Go Brrrr'); the low end", "s",
                     brief="CUDA Best Practices Guide; He 2022"),
    "kernel_floor_s": Rate(2e-6, ASSUMED, "the shortest a kernel runs on the GPU, whatever it "
                           "computes: a decode step's norms, rotaries and routing (tens of rows) run 1-3 us "
                           "(NVIDIA's 'Getting Started with CUDA Graphs', Gray 2019, times a 2.9 us kernel)", "s",
                           brief="a tiny kernel's 1-3 us"),
    "graph_gap_s": Rate(0.5e-6, PUBLISHED, "between kernels of a replayed CUDA graph: 3.4 us a node for a 2.9 us "
                        "kernel (Gray 2019, 'Getting Started with CUDA Graphs')", "s", brief="Gray 2019, CUDA Graphs"),
    "stream_gap_s": Rate(0.9e-6, PUBLISHED, "between stream-launched kernels the host keeps ahead of: 3.8 us for a "
                         "2.9 us kernel (Gray 2019)", "s", brief="Gray 2019, CUDA Graphs"),
    "allreduce_latency_s": Rate(10e-6, ASSUMED, "a small all-reduce within one NVLink node: 10-30 us on 8 GPUs "
                                "(NCCL's small-message latency); the low end", "s",
                                brief="NCCL small messages 10-30 us"),
    "host_sync_s": Rate(15e-6, ASSUMED, "the decode's one device-to-host read a step (done flags): a stream "
                        "synchronisation and an 8-byte copy, 10-20 us", "s", brief="a sync and an 8-byte copy"),
    "lockstep_s": Rate(25e-6, ASSUMED, "the expert-parallel lockstep's all-reduce of one integer per decode step "
                       "(NCCL small-message latency in a node, 10-30 us)", "s", brief="NCCL small messages 10-30 us"),
    "keyed_draw_s": Rate(2.5e-6, MEASURED, "host seconds per row and sampled token of the keyed uniform "
                         "(orbitctl.model.draws), 1.5-3.7 us on a 2-core AMD EPYC; --calibrate measures a CPU's", "s",
                         brief="2-core AMD EPYC"),
    "encode_token_s": Rate(1.0e-6, MEASURED, "host seconds per prompt token the tokenizer encodes (a batch, padded, "
                           "as tensors: orbitctl.model.policy.Policy.encode_prompts): 0.95 us with SmolLM2's byte-level "
                           "BPE (Rust tokenizers), 64 prompts of 80 words, on a 2-core AMD EPYC; --calibrate measures "
                           "a CPU profile's own tokenizer and prompts", "s", brief="SmolLM2 BPE, 2-core AMD EPYC"),
    "decode_token_s": Rate(0.3e-6, MEASURED, "host seconds per completion token turned back into text for the reward "
                           "(Policy.decode, one call a row): 0.21-0.33 us with SmolLM2's BPE at 16-1,024 tokens a row, "
                           "on a 2-core AMD EPYC; --calibrate measures a CPU profile's own", "s",
                           brief="SmolLM2 BPE, 2-core AMD EPYC"),
    "cpu_op_s": Rate(7e-6, MEASURED, "an eager op of transformers' modules at hidden 64, bf16, one thread, on a "
                     "2-core AVX512-BF16 AMD EPYC (6.8-7.3 us); --calibrate measures this machine's", "s",
                     brief="2-core AVX512-BF16 AMD EPYC"),
    "cpu_block_s": Rate(4e-6, MEASURED, "one attention work item (sequence x head) of ATen's CPU kernel on the same "
                        "machine (2.3-4.5 us); --calibrate measures this machine's", "s",
                        brief="2-core AVX512-BF16 AMD EPYC"),
}
"""The rates of the time model without a calibration file. ``compute``, ``hbm``, ``attention_hbm``, ``experts_hbm``,
``experts_compute`` and ``link`` are fractions of the catalog's peaks (orbitctl/profile/gpus.py, the vendors'
datasheets); the rest absolute."""

TUNED: dict[str, Rate] = {
    "experts_hbm": Rate(0.8, ASSUMED, "a grouped INT4 kernel tuned to stream its weights as fast as a dense "
                        "read (no published INT4 MoE kernel reaches it at decode rows)", "of HBM peak",
                        brief="assumption: as fast as a dense read"),
    "experts_compute": Rate(0.5, ASSUMED, "the routed experts' GEMMs at the dense-training MFU (no published MoE "
                            "LoRA update reaches it)", "of BF16 peak", brief="assumption: at the dense-training MFU"),
}
"""The faster figure ``plan`` prints beside the headline: the grouped experts at the dense kernels' rates."""

CALIBRATED = {
    # calibration key -> (the rate it replaces, the catalog peak it divides by: flops, hbm or link)
    "gemm_flops_per_s": ("compute", "flops"),
    "hbm_bytes_per_s": ("hbm", "hbm"),
    "attention_bytes_per_s": ("attention_hbm", "hbm"),
    "experts_decode_bytes_per_s": ("experts_hbm", "hbm"),
    "experts_update_flops_per_s": ("experts_compute", "flops"),
    "all_to_all_bytes_per_s": ("link", "link"),
}
"""What a GPU calibration's absolute rates replace: each divided by the catalog's peak becomes the factor."""


def calibrated(doc: dict[str, Any], peaks: dict[str, float], path: str) -> dict[str, Rate]:
    """The factors a GPU calibration replaces: each measured absolute rate over the catalog's ``peaks`` (``flops``,
    ``hbm``, ``link``, bytes or FLOP/s), as ``measured`` rates naming the file and the device."""
    where = f"{path}: {doc.get('device', 'an unnamed device')}, {doc.get('measured_at', 'undated')}"
    out = {}
    for key, (name, peak) in CALIBRATED.items():
        value = doc["rates"].get(key)
        if value and peaks.get(peak):
            out[name] = Rate(min(value / peaks[peak], 1.0), MEASURED, f"{where} ({key} {value:.4g})", SOURCES[name].unit,
                             brief=f"{key} {value:.3g} on {doc.get('device', '?')}")
    return out
