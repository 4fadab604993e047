"""The planner's answer: MemoryPlan (per component, per phase, verdict) and Advice."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any
from orbitctl.units import GiB

PHASES = ("policy_update", "rollout", "adapter_sync")

# Components in the order the table shows them, with a one-line meaning (docs/plan.md has formulas).
COMPONENTS = {
    "cuda_context": "CUDA context, kernels and cuBLAS workspace",
    "cpu_runtime": "CPU rank: modules imported to build the model, DeepSpeed engine, gloo, thread pools, oneDNN kernels",
    "cpu_matmul_kernels": "CPU rank computing in bf16: oneDNN's and ideep's JIT kernel of every bf16 matmul shape a "
                          "run meets (weight shapes x the row counts each meets)",
    "nccl": "NCCL communicator buffers",
    "zero_buckets": "DeepSpeed reduce buckets (overlap_comm)",
    "base_weights": "frozen dense base (all but the routed experts), stored format: replicated or ZeRO-3 shard",
    "routed_experts": "routed experts this rank holds: E/P of every MoE layer under expert parallelism, "
                      "else their ZeRO-3 shard (or all, replicated)",
    "quant_state_replicated": "quantization metadata every rank keeps whole",
    "zero3_gather": "ZeRO-3 gathered units (current + prefetch); no routed experts under expert parallelism",
    "dequant_transient": "bf16 copy of the weight being dequantized",
    "dequant_workspace": "CPU rank, INT4: the dequantization workspace every matmul reuses (int32 codes, fp32 values, "
                         "result), sized by the largest quantized matrix",
    "int4_kernel_pack": "CPU rank, INT4 with quant.kernel fused: the kernel's own copy of every INT4 weight held "
                        "whole (4 bits and a bf16 scale and zero per group)",
    "all_to_all_buffers": "expert-parallel dispatch/combine buffers of the MoE layer in flight (send + receive)",
    "adapter_weights": "trainable adapter weights",
    "adapter_grads": "adapter gradients",
    "optimizer_master": "fp32 master copy of the adapters",
    "optimizer_adam": "Adam m and v (fp32)",
    "adapter_gathered": "ZeRO-3 gathered adapter weights + grads of one layer",
    "activations": "saved activations (checkpoints + one layer's recompute)",
    "logits_loss": "logits, fp32 log-softmax and its gradient",
    "rollout_kv_cache": "KV cache of the sequences being decoded",
    "rollout_activations": "prefill/decode working set",
    "infer_dist": "the infer path's full distribution kept for the align loss's KL",
    "loss_vocab_terms": "the kept distribution's copies, the KL's saved tensors and the entropy's temporaries",
    "engine_weights": "a separate inference engine's own weights",
    "adapter_sync": "full adapter gathered for the engine / checkpoint",
    "routing_record": "MoE: each token's experts per MoE layer (k int64 indices): recorded while decoding; in the "
                      "update the routing to replay, the router's own choice and the experts run (rl.router_replay)",
}


@dataclass(frozen=True)
class Advice:
    """One suggested change of the profile, with the peak bytes per GPU it gives and whether that fits."""

    change: dict[str, Any]
    """Dotted profile key -> new value, e.g. {'memory.micro_batch_size': 4}."""
    text: str
    peak_bytes: int
    fits: bool

    def set_values(self) -> list[str]:
        """The change as ``--set`` values, e.g. ['memory.micro_batch_size=4']."""
        return set_values(self.change)

    def to_dict(self) -> dict:
        return {"change": dict(self.change), "text": self.text, "peak_bytes": self.peak_bytes, "fits": self.fits,
                "set": self.set_values()}


def set_value(value: Any) -> str:
    """A value as ``--set`` takes it back: booleans lower case (YAML), everything else as ``str``."""
    return str(value).lower() if isinstance(value, bool) else str(value)


def set_values(change: dict[str, Any]) -> list[str]:
    """``{'memory.micro_batch_size': 4}`` -> ``['memory.micro_batch_size=4']``: what to paste after ``--set``."""
    return [f"{key}={set_value(value)}" for key, value in change.items()]


@dataclass
class MemoryPlan:
    """The plan of a profile: bytes per GPU by phase and component, host RAM, parameter counts, the largest
    micro-batch, notes and advice, and the predicted communication and time of one RL step."""

    phases: dict[str, dict[str, int]]
    """Phase -> component -> bytes per GPU."""
    peak_phase: str
    usable_bytes: int
    gpu_memory_bytes: int
    host_bytes: int
    host_components: dict[str, int]
    host_capacity_bytes: int
    params_total: int
    params_active: int
    params_trainable: int
    max_micro_batch: int
    notes: list[str] = field(default_factory=list)
    advice: list = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)
    communication: Any = None
    """orbitctl.plan.comm.Communication: the bytes one RL step sends per GPU in this layout."""
    timing_of: Any = field(default=None, repr=False)
    """A function of no argument giving the StepTime: the time model runs when ``timing`` is first read (the memory
    searches of advice and layouts plan many micro-batches whose time nobody reads)."""
    layouts: list[dict] = field(default_factory=list)
    """The base layouts compared (orbitctl.plan.layouts.compare_layouts), empty for a dense model or one GPU."""
    nodes: list[dict] = field(default_factory=list)
    """The run on its node(s) and on twice the nodes (orbitctl.plan.advice.compare_nodes): predicted time."""

    @property
    def timing(self):
        """orbitctl.plan.timing.StepTime: predicted seconds of one RL step by phase in this layout (None: not timed)."""
        if callable(self.timing_of):
            self.timing_of = self.timing_of()
        return self.timing_of

    @property
    def phase_peak_bytes(self) -> dict[str, int]:
        return {phase: sum(parts.values()) for phase, parts in self.phases.items()}

    @property
    def per_gpu_bytes(self) -> dict[str, int]:
        """Components of the peak phase."""
        return dict(self.phases[self.peak_phase])

    @property
    def peak_bytes(self) -> int:
        return self.phase_peak_bytes[self.peak_phase]

    @property
    def utilization(self) -> float:
        return self.peak_bytes / self.gpu_memory_bytes

    @property
    def host_fits(self) -> bool:
        return self.host_bytes <= self.host_capacity_bytes

    @property
    def fits(self) -> bool:
        return self.peak_bytes <= self.usable_bytes and self.host_fits

    @property
    def tight(self) -> bool:
        """Fits, but within 5% of the usable budget: fragmentation can tip it over."""
        return self.fits and self.peak_bytes > 0.95 * self.usable_bytes

    def verdict(self) -> str:
        gib = lambda n: f"{n / GiB:.1f} GiB"  # noqa: E731
        state = "FITS (tight)" if self.tight else ("FITS" if self.fits else "DOES NOT FIT")
        text = (f"{state}: peak {gib(self.peak_bytes)} per GPU in {self.peak_phase} = "
                f"{self.utilization:.0%} of {gib(self.gpu_memory_bytes)}, limit {gib(self.usable_bytes)}")
        if not self.host_fits:
            text += f"; host RAM {gib(self.host_bytes)} exceeds {gib(self.host_capacity_bytes)} per node"
        return text

    def to_dict(self) -> dict:
        return {
            "per_gpu_bytes": self.per_gpu_bytes,
            "phases": {p: dict(c) for p, c in self.phases.items()},
            "phase_peak_bytes": self.phase_peak_bytes,
            "peak_phase": self.peak_phase,
            "peak_bytes": self.peak_bytes,
            "gpu_memory_bytes": self.gpu_memory_bytes,
            "usable_bytes": self.usable_bytes,
            "utilization": round(self.utilization, 4),
            "fits": self.fits,
            "tight": self.tight,
            "max_micro_batch": self.max_micro_batch,
            "host_bytes": self.host_bytes,
            "host_components": dict(self.host_components),
            "host_capacity_bytes": self.host_capacity_bytes,
            "host_fits": self.host_fits,
            "params_total": self.params_total,
            "params_active": self.params_active,
            "params_trainable": self.params_trainable,
            "advice": [a.to_dict() for a in self.advice],
            "notes": list(self.notes),
            "details": dict(self.details),
            "communication": self.communication.to_dict() if self.communication is not None else None,
            "timing": self.timing.to_dict() if self.timing is not None else None,
            "layouts": [dict(row) for row in self.layouts],
            "nodes": [dict(row) for row in self.nodes],
        }
