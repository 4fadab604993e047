"""Seconds one RL step takes per phase: compute, HBM traffic and communication, on one node or several.

The time model beside the memory model, from the same profile, ArchSpec, stored base and layout.
Each phase (``rollout``: prefill + decode on the shared weights; ``policy_update``: the
update's forwards, recompute and backwards; ``adapter_sync``: pushing the adapter to a
separate engine, zero for the shared one) gets three figures per GPU:

- ``flops``: 2 x active parameters per token, attention's sequence term, the no-grad log-prob
  forwards and the recompute of gradient checkpointing;
- ``hbm_bytes``: the weights each forward reads (of a MoE layer only the experts the batch
  touches, E (1 - (1 - k/E)^B)), the KV cache each decoded token reads and the bf16 copy plain-torch
  dequantization writes and reads back; on a CPU also the elementwise ops' activation traffic;
- ``comm_bytes``: comm.py's terms of the phase, split into intra-node and inter-node bytes;
- ``ops``: the eager operators the phase issues (ops.py: counted from the architecture), each
  costing ``Peaks.op_s`` (a CUDA kernel launch, or a CPU op's dispatch as measured).

Each figure becomes seconds at the catalog's peak times an efficiency factor (the module
constants below, sourced in docs/plan.md, "Time per RL step"); overridable by passing
``Efficiency``. Overlap rule: compute and HBM traffic overlap (roofline), communication does
not; a GPU's launches overlap its kernels (asynchronous): GPU seconds = max(compute, memory,
overhead) + communication. A CPU runs one op after another, each bound by its own FLOPs (a
GEMM) or bytes (an elementwise op), and pays each op's overhead: CPU seconds = compute + memory
+ overhead + communication. Imports no torch.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from orbitctl.arch.spec import EXPERT, ArchSpec
from orbitctl.plan.comm import (Communication, compute_dtype_bytes, decode_forwards, decoded_tokens, prefill_rows,
                               prompt_tokens, rollout_batch)
from orbitctl.plan.layout import Layout
from orbitctl.plan.ops import (BACKWARD_OPS, GRAPH_EAGER_STEPS, GRAPH_KERNELS_PER_OP, OPS_GRAPH_STEP, OPS_LOSS,
                               OPS_OPTIMIZER, OPS_SAMPLE, activation_bytes_per_token, adapter_active_params,
                               attention_blocks, experts_fused, fused_int4, grouped_experts, op_counts)
from orbitctl.plan.rates import SOURCES, Rate
from orbitctl.plan.storage import BaseStorage

COMPUTE_EFFICIENCY = SOURCES["compute"].value
"""Fraction of the dense BF16 peak large GEMMs sustain (training MFU, published: rates.SOURCES)."""
HBM_EFFICIENCY = SOURCES["hbm"].value
"""Fraction of the catalog's HBM bandwidth a streaming read of dense weights reaches (published)."""
ATTENTION_HBM_EFFICIENCY = SOURCES["attention_hbm"].value
"""Fraction of HBM bandwidth decode attention reaches streaming the KV cache (published)."""
EXPERTS_HBM_EFFICIENCY = SOURCES["experts_hbm"].value
"""Fraction of HBM bandwidth a grouped INT4 expert kernel reaches at decode rows (published: vLLM issue 32832)."""
EXPERTS_COMPUTE_EFFICIENCY = SOURCES["experts_compute"].value
"""Fraction of the BF16 peak the routed experts' GEMMs sustain in the update (published: the best Kimi-K2 LoRA
update's whole-system rate)."""
LINK_EFFICIENCY = SOURCES["link"].value
"""Fraction of one direction of the peer link NCCL's bus bandwidth reaches on large messages (nccl-tests)."""
NIC_GBITS_PER_GPU = SOURCES["nic_gbits_per_gpu"].value
"""Inter-node bandwidth per GPU, Gb/s: one 400 Gb/s InfiniBand NDR adapter per GPU (DGX/HGX H100, H200, B200)."""
DEQUANT_PASSES = 2
"""A plain-torch dequantization writes the bf16 copy of each weight it uses and the matmul reads it back."""
KERNEL_LAUNCH_S = SOURCES["launch_s"].value
"""Host seconds per eager op on a GPU: one CUDA kernel launch plus PyTorch's dispatch (published, low end). The host
runs ahead of the device: launches overlap the kernels queued before them (the one overlap of a GPU phase)."""
KERNEL_FLOOR_S = SOURCES["kernel_floor_s"].value
"""The shortest a GPU kernel runs, whatever it computes (an assumption: rates.SOURCES)."""
GRAPH_GAP_S = SOURCES["graph_gap_s"].value
"""Device seconds between two kernels of a replayed CUDA graph (published)."""
STREAM_GAP_S = SOURCES["stream_gap_s"].value
"""Device seconds between two stream-launched kernels (published)."""
ALLREDUCE_LATENCY_S = SOURCES["allreduce_latency_s"].value
"""Seconds of one small all-reduce within a node: a tensor-parallel engine's two per layer and decode step."""
GRAPH_KERNEL_S = KERNEL_FLOOR_S + GRAPH_GAP_S
"""What a replayed graph kernel costs at least: its floor and the gap after it."""
EXPERT_KERNELS = 3
"""Kernels of a grouped expert layer per forward: one per projection (gate, up, down)."""
ENGINE_LAYER_KERNELS = 8
"""Kernels of an inference engine's decode step per layer besides its GEMMs and attention: two fused residual +
RMSNorm, the rotary, the router's fused top-k, the fused SiLU-and-multiply and, under tensor parallelism, two
all-reduces and a copy (vLLM's fused CUDA ops; an assumption, counted, not profiled)."""
CPU_OP_S = SOURCES["cpu_op_s"].value
"""Seconds per eager op on the catalog's ``cpu`` entry when nothing is measured (``--calibrate`` measures it)."""
CPU_BLOCK_S = SOURCES["cpu_block_s"].value
"""Seconds per attention work item (one sequence x head) of ATen's CPU attention kernel when nothing is measured."""

HOST_SYNC_S = SOURCES["host_sync_s"].value
"""Seconds the device idles per decode step while the host reads whether every row is done. Serial."""
LOCKSTEP_S = SOURCES["lockstep_s"].value
"""Seconds per decode step of the expert-parallel lockstep's all-reduce of one integer over the EP group. Serial."""
KEYED_DRAW_S = SOURCES["keyed_draw_s"].value
"""Host seconds per row and sampled token to compute its keyed uniform; the inverse CDF runs on the device."""
ENCODE_TOKEN_S = SOURCES["encode_token_s"].value
"""Host seconds per prompt token the tokenizer encodes before the prefill. Serial."""
DECODE_TOKEN_S = SOURCES["decode_token_s"].value
"""Host seconds per completion token the tokenizer turns back into text after the decode (for the reward). Serial."""
KERNEL_CLASSES = ("experts", "dense", "attention")
"""The kernels a GPU phase is timed by, one after another: the routed experts' grouped GEMMs, the dense GEMMs
(attention projections, shared experts, dense layers, output layer, adapters) and attention over the context."""

BOUNDS = ("compute", "HBM", "interconnect", "overhead", "host")
TIME_PHASES = ("rollout", "policy_update", "adapter_sync")


@dataclass(frozen=True)
class Efficiency:
    """The factors applied to the catalog's peaks; the defaults are the published ones (rates.SOURCES)."""

    compute: float = COMPUTE_EFFICIENCY
    hbm: float = HBM_EFFICIENCY
    link: float = LINK_EFFICIENCY
    nic_gbits_per_gpu: float = NIC_GBITS_PER_GPU
    experts_hbm: float = EXPERTS_HBM_EFFICIENCY
    """A GPU's grouped INT4 experts streaming their weights (decode)."""
    experts_compute: float = EXPERTS_COMPUTE_EFFICIENCY
    """A GPU's routed experts' GEMMs at many rows (prefill, update)."""
    attention_hbm: float = ATTENTION_HBM_EFFICIENCY
    """A GPU's attention streaming the KV cache."""
    host_link: float = SOURCES["host_link"].value
    """Copies between host RAM and a GPU (activation offload)."""

    @classmethod
    def of(cls, rates: dict[str, Rate]) -> "Efficiency":
        """The factors of ``rates`` (rates.SOURCES' names); the defaults for the ones it lacks."""
        return cls(**{k: r.value for k, r in rates.items() if k in cls.__dataclass_fields__})


@dataclass(frozen=True)
class Peaks:
    """One GPU's peaks: FLOP/s, HBM bytes/s, peer-link and inter-node bytes/s (one direction), seconds per eager op."""

    flops: float
    hbm: float
    link: float
    nic: float
    op_s: float = KERNEL_LAUNCH_S
    """Seconds one eager op costs the host: a kernel launch (GPU), a CPU op's dispatch and framework overhead."""
    synchronous: bool = False
    """The host runs the ops itself (CPU): their overhead adds to the compute instead of hiding under it."""
    block_s: float = 0.0
    """Seconds per attention work item (sequence x head) of a CPU attention kernel; 0 on a GPU (one launch)."""
    adapter_flops: float = 0.0
    """FLOP/s of the adapters' thin matmuls (tokens x hidden x rank); 0: the same as ``flops``."""
    graph_kernel_s: float = GRAPH_KERNEL_S
    """Seconds per kernel of a replayed CUDA graph, floor and gap (a CPU's: unused)."""
    host_link: float = 31.5e9
    """Bytes/s one direction of the GPU's link to host RAM (the catalog's host link: PCIe 4.0 or 5.0 x16)."""
    keyed_draw_s: float = KEYED_DRAW_S
    """Host seconds per row and sampled token of the keyed uniform (orbitctl.model.draws)."""
    encode_token_s: float = ENCODE_TOKEN_S
    """Host seconds per prompt token through the tokenizer (its chat template included)."""
    decode_token_s: float = DECODE_TOKEN_S
    """Host seconds per completion token back to text."""
    kernel_flops: tuple[tuple[int, float], ...] = ()
    """FLOP/s of the fused INT4 kernel (``quant.kernel``) measured at a few row counts, ``(rows, FLOP/s)`` by rows;
    empty: the same as ``flops`` (the catalog's GPUs). A CPU's kernel runs its own loops, whose rate depends on the
    rows far more than a GEMM's (a decode step's tens of rows against an update's thousands)."""

    def kernel_rate(self, rows: float) -> float:
        """The fused kernel's FLOP/s at ``rows`` rows: interpolated in log rows between the measured points, the
        nearest one's outside them; ``flops`` when none is measured."""
        points = self.kernel_flops
        if not points:
            return self.flops
        if rows <= points[0][0]:
            return points[0][1]
        for (low, low_rate), (high, high_rate) in zip(points, points[1:]):
            if rows <= high:
                share = math.log(rows / low) / math.log(high / low)
                return math.exp(math.log(low_rate) + share * (math.log(high_rate) - math.log(low_rate)))
        return points[-1][1]


def peaks_of(profile, eff: Efficiency = Efficiency()) -> Peaks:
    """The catalog's peaks for hardware.gpu (the link: its bidirectional figure / 2; CPU ranks: the HBM figure)."""
    from orbitctl.profile.gpus import resolve_gpu

    spec = resolve_gpu(profile.hardware.gpu)
    link = spec.p2p_bandwidth_gbs * 1e9 / 2 or spec.hbm_bandwidth_gbs * 1e9  # CPU ranks talk through memory
    cpu = spec.vendor == "cpu"
    return Peaks(flops=spec.bf16_tflops * 1e12, hbm=spec.hbm_bandwidth_gbs * 1e9, link=link,
                 nic=eff.nic_gbits_per_gpu * 1e9 / 8, op_s=CPU_OP_S if cpu else KERNEL_LAUNCH_S, synchronous=cpu,
                 block_s=CPU_BLOCK_S if cpu else 0.0, host_link=host_link_bytes(spec.host_link),
                 keyed_draw_s=KEYED_DRAW_S, encode_token_s=ENCODE_TOKEN_S, decode_token_s=DECODE_TOKEN_S)


HOST_LINKS = {"PCIe5": 63e9, "PCIe4": 31.5e9, "PCIe3": 15.75e9}
"""Bytes/s per direction of an x16 link by PCIe generation (PCI-SIG: 32, 16, 8 GT/s per lane, 128b/130b)."""


def host_link_bytes(name: str) -> float:
    """One direction of the catalog's host link (``PCIe5 x16``): the x16 figure of its generation (PCIe 4.0's when
    the name says none)."""
    return next((rate for gen, rate in HOST_LINKS.items() if gen.lower() in name.lower()), HOST_LINKS["PCIe4"])


@dataclass
class Work:
    """One class of a GPU phase's kernels: the FLOPs they compute, the HBM bytes they read and how many run."""

    flops: float = 0.0
    bytes: float = 0.0
    kernels: float = 0.0

    def __add__(self, other: "Work") -> "Work":
        return Work(self.flops + other.flops, self.bytes + other.bytes, self.kernels + other.kernels)

    def __mul__(self, times: float) -> "Work":
        return Work(self.flops * times, self.bytes * times, self.kernels * times)


TERM_RATES = {
    "experts compute": ("experts_compute",), "experts HBM": ("experts_hbm",), "dense compute": ("compute",),
    "dense HBM": ("hbm",), "attention compute": ("compute",), "attention HBM": ("attention_hbm",),
    "kernel floors": ("kernel_floor_s",), "gaps": ("graph_gap_s", "stream_gap_s"), "launches": ("launch_s",),
    "comm": ("link", "nic_gbits_per_gpu", "allreduce_latency_s"),
    "host": ("host_sync_s", "lockstep_s", "keyed_draw_s", "encode_token_s", "decode_token_s"),
    "cpu host": ("keyed_draw_s", "encode_token_s", "decode_token_s"),
    "offload": ("host_link",),
    "cpu compute": ("cpu_flops",), "cpu memory": ("cpu_bytes",), "cpu overhead": ("cpu_op_s", "cpu_block_s"),
}
"""Which rates (rates.SOURCES' names; ``cpu_*``: the CPU's measured or catalog rates) each term of a phase rests on."""


@dataclass
class PhaseTime:
    """One phase per GPU: what it moves and computes, its floor and its predicted seconds."""

    flops: float
    hbm_bytes: float
    intra_bytes: float
    """Communication over the node's peer links."""
    inter_bytes: float
    """Communication that crosses nodes (InfiniBand)."""
    tokens: int
    """Tokens the phase processes over all GPUs (decoded tokens for the rollout)."""
    ops: float = 0.0
    """Eager operators the phase issues (ops.py)."""
    items: float = 0.0
    """Attention work items (sequence x head per layer) a CPU attention kernel loops over."""
    adapter_flops: float = 0.0
    """The part of ``flops`` in the adapters' thin matmuls."""
    graph_kernels: float = 0.0
    """Kernels replayed from CUDA graphs (the graphed decode steps)."""
    kernel_work: tuple[tuple[float, float], ...] = ()
    """The part of ``flops`` in the fused INT4 kernel (the frozen base's forward matmuls), as ``(FLOPs, rows per
    call)`` pairs: the dense weights meet a forward's tokens, a routed expert the tokens routed to it. Timed at
    ``Peaks.kernel_rate`` of those rows (a CPU)."""
    work: dict[str, Work] = field(default_factory=dict)
    """The same FLOPs and bytes by kernel class (KERNEL_CLASSES), for a GPU's serial sum."""
    latency_s: float = 0.0
    """Seconds of small collectives' latency (a tensor-parallel engine's all-reduces), serial."""
    offload_bytes: float = 0.0
    """Bytes copied between the GPU and host RAM on a side stream (the update's offloaded checkpoints, out in the
    forward and back in the backward): overlapped with the kernels, the phase takes the longer of the two."""
    compute_s: float = 0.0
    memory_s: float = 0.0
    comm_s: float = 0.0
    overhead_s: float = 0.0
    """CPU: ops x seconds per op + attention items x seconds per item. GPU: kernel floors and gaps, and the host's
    launches where they outlast the device's work."""
    host_s: float = 0.0
    """Serial host work the device waits for (a GPU's decode: the per-step read of the done flag, the expert-parallel
    lockstep, the keyed draws' uniforms); added to the phase's seconds, never overlapped."""
    synchronous: bool = False
    floor_s: float = 0.0
    """max(FLOPs / peak FLOP/s, bytes / peak HBM, comm bytes / peak links): no run can be faster."""
    terms: dict[str, float] = field(default_factory=dict)
    """The phase's seconds by term (``experts HBM``, ``dense compute``, ``kernel floors``, ``comm``, ...): they sum to
    ``seconds``; TERM_RATES names the rates each rests on."""
    parts: dict[str, PhaseTime] = field(default_factory=dict)
    """Sub-phases (rollout: prefill, decode), each timed on its own."""

    @property
    def kernel_flops(self) -> float:
        return sum(flops for flops, _ in self.kernel_work)

    @property
    def seconds(self) -> float:
        """The sum of its terms: a CPU's compute + memory + overhead, a GPU's kernels one after another (each class
        at the slowest of its FLOPs, bytes and kernel floors), + communication + host; with sub-phases, which run one
        after the other, the sum of theirs."""
        if self.parts:
            return sum(p.seconds for p in self.parts.values())
        return self.compute_s + self.memory_s + self.overhead_s + self.comm_s + self.host_s

    @property
    def bound(self) -> str:
        """The largest of the five terms: compute, HBM, interconnect, overhead or host ('-' for an empty phase)."""
        if not self.seconds:
            return "-"
        return max(zip((self.compute_s, self.memory_s, self.comm_s, self.overhead_s, self.host_s), BOUNDS))[1]

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    def all_terms(self) -> dict[str, float]:
        """Seconds by term, the sub-phases' summed."""
        if not self.parts:
            return dict(self.terms)
        out: dict[str, float] = {}
        for part in self.parts.values():
            for term, s in part.all_terms().items():
                out[term] = out.get(term, 0.0) + s
        return out

    def to_dict(self) -> dict[str, Any]:
        doc = {k: getattr(self, k) for k in self.__dataclass_fields__ if k not in ("parts", "work")}
        doc.update(seconds=self.seconds, bound=self.bound, tokens_per_s=self.tokens_per_s, kernel_flops=self.kernel_flops,
                   work={k: asdict(w) for k, w in self.work.items()}, terms=self.all_terms(),
                   parts={k: p.to_dict() for k, p in self.parts.items()})
        return doc


def _timed(phase: PhaseTime, peaks: Peaks, eff: Efficiency) -> PhaseTime:
    nic = peaks.nic if phase.inter_bytes else 1.0
    phase.synchronous = peaks.synchronous
    phase.comm_s = (phase.intra_bytes / peaks.link + phase.inter_bytes / nic) / eff.link + phase.latency_s
    phase.floor_s = max(phase.flops / peaks.flops, phase.hbm_bytes / peaks.hbm,
                        phase.intra_bytes / peaks.link + phase.inter_bytes / nic)
    if peaks.synchronous:
        _timed_cpu(phase, peaks, eff)
    else:
        _timed_gpu(phase, peaks, eff)
    phase.terms.update({"comm": phase.comm_s, host_term(peaks): phase.host_s})
    return phase


def host_term(peaks: Peaks) -> str:
    """The name of a phase's host term: ``cpu host`` where the host runs the ops too (no device to wait for: only the
    tokenizer and the draws), else ``host``."""
    return "cpu host" if peaks.synchronous else "host"


def _timed_cpu(phase: PhaseTime, peaks: Peaks, eff: Efficiency) -> None:
    """One op after another on the core that issues them: each bound by its own FLOPs (a GEMM) or bytes (an
    elementwise op), each paying its own dispatch: compute + memory + overhead."""
    thin = peaks.adapter_flops or peaks.flops
    kernel_s = sum(flops / peaks.kernel_rate(rows) for flops, rows in phase.kernel_work)
    phase.compute_s = ((phase.flops - phase.adapter_flops - phase.kernel_flops) / peaks.flops
                       + phase.adapter_flops / thin + kernel_s) / eff.compute
    phase.overhead_s = phase.ops * peaks.op_s + phase.items * peaks.block_s
    phase.memory_s = phase.hbm_bytes / (peaks.hbm * eff.hbm)
    phase.terms = {"cpu compute": phase.compute_s, "cpu memory": phase.memory_s, "cpu overhead": phase.overhead_s}


def _timed_gpu(phase: PhaseTime, peaks: Peaks, eff: Efficiency) -> None:
    """The kernels of one stream, one after another: each class at the slowest of its FLOPs at its efficiency, its
    bytes at its bandwidth and its kernels' floors; the kernels no class claims (norms, rotaries, routing,
    elementwise) at their floor; a gap after every kernel. The host launches eager kernels ahead of the device: the
    launches count only where they outlast all of that. Communication and host work add (docs/plan.md)."""
    rates = {"experts": (eff.experts_compute, eff.experts_hbm), "dense": (eff.compute, eff.hbm),
             "attention": (eff.compute, eff.attention_hbm)}
    floor = peaks.graph_kernel_s - GRAPH_GAP_S
    terms: dict[str, float] = {}
    compute = memory = 0.0
    claimed = 0.0
    for name, w in phase.work.items():
        flops_eff, bytes_eff = rates[name]
        c, m, f = w.flops / (peaks.flops * flops_eff), w.bytes / (peaks.hbm * bytes_eff), w.kernels * floor
        s, term = max((c, "compute"), (m, "HBM"), (f, "kernel floors"))
        key = f"{name} {term}" if term != "kernel floors" else term
        terms[key] = terms.get(key, 0.0) + s
        compute += s if term == "compute" else 0.0
        memory += s if term == "HBM" else 0.0
        claimed += w.kernels
    eager_kernels = phase.ops * GRAPH_KERNELS_PER_OP
    kernels = phase.graph_kernels + eager_kernels
    terms["kernel floors"] = terms.get("kernel floors", 0.0) + max(0.0, kernels - claimed) * floor
    terms["gaps"] = phase.graph_kernels * GRAPH_GAP_S + eager_kernels * STREAM_GAP_S
    device = sum(terms.values())
    launches = phase.ops * peaks.op_s
    terms["launches"] = max(0.0, launches - device)
    offload = phase.offload_bytes / (peaks.host_link * eff.host_link) if phase.offload_bytes else 0.0
    terms["offload"] = max(0.0, offload - max(device, launches))
    phase.compute_s, phase.memory_s = compute, memory
    phase.overhead_s = terms["kernel floors"] + terms["gaps"] + terms["launches"] + terms["offload"]
    phase.terms = terms


def _retime(phase: PhaseTime, peaks: Peaks, eff: Efficiency) -> PhaseTime:
    """A copy of ``phase`` timed at ``eff`` (its sub-phases each, their sums its own)."""
    if not phase.parts:
        return _timed(replace(phase, terms={}), peaks, eff)
    parts = {k: _retime(p, peaks, eff) for k, p in phase.parts.items()}
    out = replace(phase, parts=parts, terms={})
    for key in ("compute_s", "memory_s", "overhead_s", "comm_s", "host_s"):
        setattr(out, key, sum(getattr(p, key) for p in parts.values()))
    return out


HOST_RATES = ("keyed_draw_s", "encode_token_s", "decode_token_s")
"""The host's per-unit rates a CPU calibration measures (orbitctl.rl.steptime.host_rates); rates.SOURCES' where it
does not."""


def peaks_of_rates(rates: dict) -> Peaks:
    """The Peaks of rates measured on a CPU (``flops_per_s``, ``bytes_per_s``, ``op_s``, ``attention_block_s``,
    optionally ``adapter_flops_per_s``, ``kernel_flops_per_s``, the fused INT4 kernel's ``[rows, FLOP/s]`` pairs, and
    the host's :data:`HOST_RATES`): one op after another."""
    bandwidth = rates["bytes_per_s"]
    return Peaks(flops=rates["flops_per_s"], hbm=bandwidth, link=bandwidth, nic=bandwidth, op_s=rates["op_s"],
                 synchronous=True, block_s=rates["attention_block_s"],
                 adapter_flops=rates.get("adapter_flops_per_s", 0.0),
                 **{key: rates[key] for key in HOST_RATES if key in rates},
                 kernel_flops=tuple((int(rows), float(rate)) for rows, rate in rates.get("kernel_flops_per_s", ())))


FACTORS = ("compute", "hbm", "link", "attention_hbm", "experts_hbm", "experts_compute", "host_link")
"""The rates that are fractions of a peak (1 when the peaks are a CPU's measured rates)."""


def profile_rates(profile) -> tuple[dict[str, Rate], Peaks | None]:
    """The rates a plan of ``profile`` uses, and the peaks that replace the catalog's (None: the catalog's).

    Without ``hardware.calibration``: rates.SOURCES. With one: a GPU's measured rates over the catalog's peaks
    replace the factors they measure (rates.calibrated); a CPU's measured rates are the peaks, every factor 1."""
    from orbitctl.errors import UserError
    from orbitctl.plan.rates import ASSUMED, MEASURED, calibrated
    from orbitctl.profile.gpus import resolve_gpu

    rates = dict(SOURCES)
    spec = resolve_gpu(profile.hardware.gpu)
    path = profile.hardware.calibration
    if spec.vendor == "cpu":
        rates["cpu_flops"] = Rate(spec.bf16_tflops * 1e12, ASSUMED, "the catalog's cpu entry, a stand-in: "
                                  "orbitctl plan --calibrate measures this machine", "FLOP/s")
        rates["cpu_bytes"] = Rate(spec.hbm_bandwidth_gbs * 1e9, ASSUMED, rates["cpu_flops"].source, "bytes/s")
    if not path:
        return rates, None
    from orbitctl.profile.calibration import read_calibration

    doc = read_calibration(path)
    measured_on = doc.get("gpu")
    if measured_on != spec.name:
        raise UserError(f"hardware.calibration: {path} was measured on {measured_on!r}; the profile plans "
                        f"{spec.name!r}", fix=f"run orbitctl plan PROFILE --calibrate on a {spec.name} machine, "
                        "or remove hardware.calibration")
    where = f"{path}: {doc.get('device', 'an unnamed device')}, {doc.get('measured_at', 'undated')}"
    if spec.vendor == "cpu":
        got = doc["rates"]
        rates.update({k: replace(v, value=1.0, kind=MEASURED, source=f"{where}: absolute rates, factor 1")
                      for k, v in rates.items() if k in FACTORS})
        for key, name in (("flops_per_s", "cpu_flops"), ("bytes_per_s", "cpu_bytes"), ("op_s", "cpu_op_s"),
                          ("attention_block_s", "cpu_block_s"), *((k, k) for k in HOST_RATES if k in got)):
            rates[name] = Rate(got[key], MEASURED, where, rates[name].unit)
        return rates, peaks_of_rates(got)
    peaks = peaks_of(profile)
    rates.update(calibrated(doc, {"flops": peaks.flops, "hbm": peaks.hbm, "link": peaks.link}, path))
    return rates, None


@dataclass
class StepTime:
    """Predicted seconds of one RL step by phase, for the profile's layout and node count."""

    phases: dict[str, PhaseTime]
    world: int
    nodes: int
    efficiency: Efficiency
    steps: int = 1
    """RL steps of the run (rl.steps): one rollout batch and its updates each."""
    price_per_gpu_hour: float | None = None
    """hardware.price_per_gpu_hour, USD; None: no cost."""
    rates: dict[str, Rate] = field(default_factory=dict)
    """Every rate the prediction used, with its kind and source (rates.SOURCES, replaced by a calibration's)."""
    peaks: Peaks | None = None

    def retimed(self, rates: dict[str, Rate]) -> "StepTime":
        """The same counts at ``rates`` (replacing this prediction's by name): e.g. rates.TUNED, the faster figure."""
        merged = {**self.rates, **rates}
        eff = Efficiency.of(merged)
        phases = {name: _retime(p, self.peaks, eff) for name, p in self.phases.items()}
        return replace(self, phases=phases, efficiency=eff, rates=merged)

    def faster(self) -> "StepTime | None":
        """The step with the grouped experts at rates.TUNED (the dense kernels' rates), the ones not measured; None on
        a CPU, without routed experts, or when both are measured."""
        from orbitctl.plan.rates import MEASURED, TUNED

        changed = {k: r for k, r in TUNED.items() if self.rates.get(k, r).kind != MEASURED}
        experts = self.phases["rollout"].parts.get("decode")
        if self.peaks is None or self.peaks.synchronous or not changed or not (experts and "experts" in experts.work
                                                                               and experts.work["experts"].bytes):
            return None
        return self.retimed(changed)

    def confidence(self) -> str:
        """What the prediction rests on, in a line: measured, partly measured or published rates, or a stand-in."""
        from orbitctl.plan.rates import ASSUMED, MEASURED

        used = {k: r for row in self.dominant() for k, r in row["rates"].items()}
        measured = sorted(k for k, r in used.items() if r["kind"] == MEASURED)
        if self.peaks is not None and self.peaks.synchronous:
            cpu = self.rates.get("cpu_flops")
            if cpu is not None and cpu.kind == ASSUMED:
                return "a prediction at the catalog's stand-in CPU rates (plan --calibrate measures this machine)"
            return f"a prediction at this CPU's measured rates ({self.rates['cpu_op_s'].source})"
        if used and len(measured) == len(used):
            return "a prediction at rates measured on this GPU kind (hardware.calibration)"
        if measured:
            return (f"a prediction, {', '.join(measured)} measured on this GPU kind, the rest published or assumed "
                    "(see where the time goes)")
        return ("a prediction at published kernel rates, none measured on this GPU (plan --calibrate); "
                "docs/plan.md, Anchors")

    def _applies(self, rate: str) -> bool:
        """Whether ``rate`` entered this prediction: the NIC only across nodes, an engine's all-reduce latency only
        under tensor parallelism."""
        if rate == "nic_gbits_per_gpu":
            return self.nodes > 1
        if rate == "allreduce_latency_s":
            return any(p.latency_s for phase in self.phases.values() for p in (phase, *phase.parts.values()))
        return True

    def dominant(self, share: float = 0.1) -> list[dict[str, Any]]:
        """The terms that make up at least ``share`` of a phase, largest first, with the rates they rest on."""
        out = []
        for name, phase in self.phases.items():
            total = phase.seconds
            for term, seconds in sorted(phase.all_terms().items(), key=lambda kv: -kv[1]):
                if total and seconds >= share * total:
                    used = [k for k in TERM_RATES.get(term, ()) if k in self.rates and self._applies(k)]
                    out.append({"phase": name, "term": term, "seconds": seconds, "share": seconds / total,
                                "rates": {k: self.rates[k].to_dict() for k in used}})
        return out

    @property
    def seconds(self) -> float:
        return sum(p.seconds for p in self.phases.values())

    @property
    def gpu_hours(self) -> float:
        """GPU-hours of one step: seconds x GPUs / 3600."""
        return self.seconds * self.world / 3600

    @property
    def run_gpu_hours(self) -> float:
        return self.gpu_hours * self.steps

    @property
    def cost_per_step(self) -> float | None:
        return None if self.price_per_gpu_hour is None else self.gpu_hours * self.price_per_gpu_hour

    @property
    def cost_per_run(self) -> float | None:
        return None if self.price_per_gpu_hour is None else self.run_gpu_hours * self.price_per_gpu_hour

    def to_dict(self) -> dict[str, Any]:
        return {"seconds": self.seconds, "gpu_hours": self.gpu_hours, "world": self.world, "nodes": self.nodes,
                "steps": self.steps, "run_seconds": self.seconds * self.steps, "run_gpu_hours": self.run_gpu_hours,
                "price_per_gpu_hour": self.price_per_gpu_hour, "cost_per_step": self.cost_per_step,
                "cost_per_run": self.cost_per_run,
                "rollout_tokens_per_s": self.phases["rollout"].tokens_per_s,
                "update_tokens_per_s": self.phases["policy_update"].tokens_per_s,
                "efficiency": asdict(self.efficiency), "phases": {k: p.to_dict() for k, p in self.phases.items()},
                "rates": {k: r.to_dict() for k, r in self.rates.items()},
                "term_rates": {term: [k for k in keys if k in self.rates and self._applies(k)]
                               for term, keys in TERM_RATES.items()},
                "dominant": self.dominant(), "confidence": self.confidence(),
                "faster": self._faster_dict()}

    def _faster_dict(self) -> dict[str, Any] | None:
        fast = self.faster()
        if fast is None:
            return None
        from orbitctl.plan.rates import TUNED

        return {"seconds": fast.seconds, "phase_seconds": {k: p.seconds for k, p in fast.phases.items()},
                "rates": {k: fast.rates[k].to_dict() for k in TUNED}}


def attention_flops(arch: ArchSpec, tokens: float, context: float, decode: bool = False) -> float:
    """QK^T and AV of ``tokens`` queries over ``context`` keys, every layer: 2 x heads x (d_qk + d_v) x context. An
    MLA decode step attends on the cached latent (orbitctl.model.mla): QK^T over kv_lora + rope, AV over kv_lora."""
    if arch.attention == "mla" and decode:
        qk, v = arch.kv_lora_rank + arch.qk_rope_head_dim, arch.kv_lora_rank
    elif arch.attention == "mla":
        qk, v = arch.qk_nope_head_dim + arch.qk_rope_head_dim, arch.v_head_dim
    else:
        qk = v = arch.head_dim
    return 2.0 * arch.num_layers * arch.num_heads * (qk + v) * context * tokens


def touched_experts(num_experts: int, top_k: int, tokens: float) -> float:
    """Expected distinct experts ``tokens`` routed tokens reach: E (1 - (1 - k/E)^B) (even, independent routing)."""
    if num_experts <= 0:
        return 0.0
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** tokens)


@dataclass(frozen=True)
class WeightReads:
    """HBM bytes one forward of ``tokens`` tokens reads on one GPU, by where they live."""

    dense: float
    """Stored dense part (attention, shared experts, dense layers, lm_head, norms) + its dequantized copy."""
    per_expert: float
    """One routed expert of one layer, stored + its dequantized copy."""
    experts_held: int
    """Routed experts of one MoE layer this GPU computes: E/P under expert parallelism, else E."""
    moe_layers: int
    num_experts: int
    top_k: int
    group: int
    """Ranks whose tokens reach this GPU's experts: P under expert parallelism, else 1."""
    kernel_params: float = 0.0
    """Dense parameters a token multiplies through the fused INT4 kernel (0 when the forward dequantizes)."""
    kernel_expert_params: float = 0.0
    """Routed-expert parameters a token multiplies through it: its top-k experts', where they run it."""

    def kernel_work(self, tokens: float, passes: float = 1.0) -> tuple[tuple[float, float], ...]:
        """``(FLOPs, rows per call)`` of the fused kernel in ``passes`` forwards of ``tokens`` tokens each: the dense
        weights at ``tokens`` rows, each hit expert at the slots routed to it (from all ``group`` ranks)."""
        work = []
        if self.kernel_params:
            work.append((passes * 2.0 * self.kernel_params * tokens, tokens))
        if self.kernel_expert_params:
            hit = touched_experts(self.num_experts, self.top_k, tokens * self.group)
            work.append((passes * 2.0 * self.kernel_expert_params * tokens, tokens * self.group * self.top_k / hit))
        return tuple(work)

    def bytes(self, tokens: float) -> float:
        return self.dense + self.expert_bytes(tokens)

    def expert_bytes(self, tokens: float) -> float:
        """The routed experts' part: every MoE layer's held experts the tokens (from all ``group`` ranks) reach."""
        hit = touched_experts(self.num_experts, self.top_k, tokens * self.group) / max(self.num_experts, 1)
        return self.moe_layers * self.experts_held * hit * self.per_expert

    def on_engine(self, tp: int) -> "WeightReads":
        """The same weights on one GPU of a tensor-parallel engine of ``tp`` GPUs: every expert, 1/tp of each weight,
        the tokens of the engine's ``tp`` GPUs' sequences."""
        return replace(self, dense=self.dense / tp, per_expert=self.per_expert / tp, experts_held=self.num_experts,
                       group=tp)


def weight_reads(arch: ArchSpec, storage: BaseStorage, layout: Layout, fused: bool = False,
                 experts_fused: bool | None = None) -> WeightReads:
    """The weights a forward reads: the embedding is a lookup (unless tied to the head), dequantized weights twice more
    (``fused``: the INT4 kernel reads the 4-bit codes once and writes no copy, :mod:`orbitctl.kernels.int4_kernel`;
    ``experts_fused``: the same for the routed experts, when it differs: a GPU's ungrouped experts dequantize)."""
    dense_stored = storage.total_bytes - storage.expert_bytes - (storage.embedding_bytes if arch.lm_head else 0)
    dense_params = arch.params_total - arch.params_by_kind[EXPERT] - (arch.embedding.numel if arch.lm_head else 0)
    expert_params = arch.params_by_kind[EXPERT]
    moe = arch.moe_layers
    per_expert_stored = storage.expert_bytes / (moe * arch.num_experts) if moe else 0.0
    per_expert_bf16 = 2.0 * expert_params / (moe * arch.num_experts) if moe else 0.0
    # a weight stored well under bf16 is quantized: dequantized into a bf16 copy on every use
    copies = 0 if fused else DEQUANT_PASSES
    expert_copies = copies if experts_fused is None else (0 if experts_fused else DEQUANT_PASSES)
    quantized_experts = per_expert_stored < 0.75 * per_expert_bf16
    expert_deq = expert_copies * per_expert_bf16 if quantized_experts else 0.0
    dense_quantized = storage.quantized_params - (expert_params if quantized_experts else 0)
    dense_deq = copies * 2.0 * max(0, min(dense_quantized, dense_params))
    kernel_experts = expert_params * arch.experts_per_token / arch.num_experts \
        if fused and moe and quantized_experts and not expert_copies else 0.0
    kernel_params = max(0, min(dense_quantized, dense_params)) if fused else 0.0
    return WeightReads(dense=max(dense_stored, 0.0) + dense_deq, per_expert=per_expert_stored + expert_deq,
                       experts_held=layout.experts_per_rank, moe_layers=moe, num_experts=arch.num_experts,
                       top_k=arch.experts_per_token, group=layout.expert_parallel if layout.expert_parallel_on else 1,
                       kernel_params=kernel_params, kernel_expert_params=kernel_experts)


def kv_bytes_per_token(profile, arch: ArchSpec) -> float:
    """KV-cache bytes one cached token keeps, every layer (kv_dtype fp8: 1 byte an element and its scales, else 2)."""
    return arch.num_layers * arch.kv_bytes_per_token_layer(profile.rollout.kv_dtype)


def _split(profile, layout: Layout, ring_bytes: float, a2a_bytes: float) -> tuple[float, float]:
    """(intra-node, inter-node) bytes: ring collectives over all ranks cross nodes when there are several
    (the NIC is their slowest hop); an expert group's all-to-all crosses for its peers on other nodes."""
    gpn, nodes = profile.hardware.gpus_per_node, profile.hardware.nodes
    intra, inter = (0.0, ring_bytes) if nodes > 1 else (ring_bytes, 0.0)
    p = layout.expert_parallel
    remote = max(0, p - gpn) / (p - 1) if p > 1 else 0.0
    return intra + a2a_bytes * (1 - remote), inter + a2a_bytes * remote


_GEMM_KERNELS: dict[int, tuple[ArchSpec, int]] = {}


def gemm_kernels(arch: ArchSpec) -> float:
    """Dense GEMM kernels of one forward: every non-expert matrix of the layers and the output layer (counted once
    per ArchSpec: the plan's searches time one architecture many times)."""
    held = _GEMM_KERNELS.get(id(arch))
    if held is None or held[0] is not arch:
        count = sum(1 for layer in arch.layers for w in layer.weights if w.linear and w.kind != EXPERT and w.copies == 1)
        held = _GEMM_KERNELS[id(arch)] = (arch, count + 1)
    return held[1]


def step_time(profile, arch: ArchSpec, storage: BaseStorage, layout: Layout, comm: Communication,
              adapter_bytes: float = 0.0, eff: Efficiency | None = None, peaks: Peaks | None = None,
              adapters=None, rates: dict[str, Rate] | None = None, offload_bytes: float = 0.0) -> StepTime:
    """The three phases of one RL step per GPU (docs/plan.md, "Time per RL step"). Its rates: ``rates`` or the
    profile's (:func:`profile_rates`: published, or hardware.calibration's); ``eff`` replaces their factors and
    ``peaks`` the catalog's (``plan --measure-time`` passes the rates it measured, with efficiency 1); ``adapters``
    (plan.adapters' AdapterPlan) adds the adapters' matmuls, ops and optimizer step; ``offload_bytes`` are the
    checkpoints one micro-batch offloads to host RAM (memory.offload_activations: cpu)."""
    if rates is None:
        rates, calibrated_peaks = profile_rates(profile)
        peaks = peaks or calibrated_peaks
    eff = eff or Efficiency.of(rates)
    peaks = peaks or peaks_of(profile, eff)
    shape, world, ro = comm.shape, profile.world_size, profile.rollout
    separate = ro.engine == "separate"
    tp = ro.engine_tp if separate else 1
    reads = weight_reads(arch, storage, layout)  # the backward dequantizes, whatever the forward's kernel
    fused = fused_int4(profile.quant, profile.hardware.gpu)
    forward_reads = weight_reads(arch, storage, layout, fused=fused, experts_fused=experts_fused(
        fused, grouped_experts(profile, adapters), profile.hardware.gpu))
    # a separate engine (vLLM, SGLang) runs its own fused INT4 kernels on its own copy, split over engine_tp GPUs
    engine_reads = weight_reads(arch, storage, layout, fused=True).on_engine(tp) if separate else forward_reads
    active = arch.params_active
    expert_active = arch.params_by_kind[EXPERT] * arch.experts_per_token / arch.num_experts if arch.num_experts else 0.0
    share = expert_active / active  # the routed experts' part of a token's matmul FLOPs
    terms = comm.terms
    counts = op_counts(profile, arch, adapters)
    lora = adapter_active_params(arch, adapters)
    # the elementwise ops' activation traffic: counted on the CPU, where it is the time of a small model; left out
    # on a GPU (docs/plan.md: decode's activations are batch x hidden, small against the weights, and L2-resident)
    act = activation_bytes_per_token(profile, arch, adapters) if peaks.synchronous else 0.0
    dense_kernels, attention_kernels = gemm_kernels(arch), arch.num_layers
    expert_kernels = arch.moe_layers * EXPERT_KERNELS
    engine_kernels = dense_kernels + attention_kernels + expert_kernels + ENGINE_LAYER_KERNELS * arch.num_layers

    def hit(tokens: float) -> float:
        """Experts a forward of ``tokens`` tokens hits, summed over the MoE layers (of the E/P held under expert
        parallelism, whose tokens come from all P ranks)."""
        return reads.experts_held * touched_experts(arch.num_experts, arch.experts_per_token, tokens * reads.group) \
            / max(arch.num_experts, 1) * arch.moe_layers

    def ops(tokens: float) -> float:
        """Ops of one forward of ``tokens`` tokens: the dense part and the experts they hit."""
        return counts.forward(hit(tokens))

    def forward_work(w: WeightReads, tokens: float, attn: float, kv_bytes: float) -> dict[str, Work]:
        """One forward of ``tokens`` tokens by kernel class: FLOPs, bytes read (``w``) and kernels."""
        return {"experts": Work(2.0 * expert_active * tokens, w.expert_bytes(tokens), expert_kernels),
                "dense": Work(2.0 * (active - expert_active + lora) * tokens, w.dense + tokens * act, dense_kernels),
                "attention": Work(attn, kv_bytes, attention_kernels)}

    def scaled(work: dict[str, Work], times: float) -> dict[str, Work]:
        return {k: w * times for k, w in work.items()}

    # ---- rollout: per round one prefill of the prompts, then max_new_tokens x max_turns sampling steps, each but a
    # turn's last feeding its token back through the model (a decode forward)
    batch = min(rollout_batch(profile, shape.tokens_per_micro_batch // profile.memory.seq_len), shape.sequences)
    prompt, new, steps = prompt_tokens(profile), decoded_tokens(profile), decode_forwards(profile)
    rounds = shape.rollout_rounds
    kv = kv_bytes_per_token(profile, arch)
    # a tensor-parallel engine: MLA's latent is replicated on every TP rank, other KV heads split over it
    kv_copies = (tp if arch.attention == "mla" else tp / min(tp, arch.num_kv_heads)) if separate else 1
    intra, inter = _split(profile, layout, terms["zero3_gather_rollout"], terms["all_to_all_rollout"])
    first = 1 / shape.rollout_forwards  # the prefill's share of the per-forward traffic
    rows = prefill_rows(profile, batch)  # a group's prompt is prefilled once, its cache copied to each sequence
    # a tensor-parallel engine all-reduces each layer's attention and MLP output: 2 per layer, every forward
    ring = 2 * (tp - 1) / tp * 2 * arch.num_layers * arch.hidden_size * compute_dtype_bytes(profile) * tp
    prefill_attn = attention_flops(arch, rows * prompt, prompt / 2)
    prefill = _timed(PhaseTime(
        flops=rounds * (2.0 * (active + lora) * rows * prompt + prefill_attn),
        hbm_bytes=rounds * (engine_reads.bytes(rows * prompt) + rows * prompt * act + batch * prompt * kv * kv_copies),
        intra_bytes=intra * first + rounds * rows * prompt * ring, inter_bytes=inter * first, tokens=0,
        ops=rounds * (ops(rows * prompt) + OPS_SAMPLE), items=rounds * attention_blocks(arch, rows),
        adapter_flops=rounds * 2.0 * lora * rows * prompt,
        kernel_work=forward_reads.kernel_work(rows * prompt, rounds),
        work=scaled(forward_work(engine_reads, rows * prompt, prefill_attn, batch * prompt * kv * kv_copies), rounds),
        latency_s=rounds * 2 * arch.num_layers * ALLREDUCE_LATENCY_S if tp > 1 else 0.0),
        peaks, eff)
    # graphed decode (orbitctl.model.graph_decode): a batch's first steps eager, every later one a replay of its
    # kernels; attention runs over the static cache's whole length, its unwritten slots masked. A separate engine
    # replays graphs too (vLLM's default) and attends over the written context only (paged)
    graphs = comm.decode_graphs or separate
    eager = 0 if separate else min(steps, GRAPH_EAGER_STEPS) if graphs else steps
    step_ops = ops(batch) + counts.decode_extra
    context = prompt + new - 1 if graphs and not separate else prompt + (new + 1) / 2
    decode_attn = attention_flops(arch, batch, context, decode=True)
    decode_kv = batch * context * kv * kv_copies
    decode = _timed(PhaseTime(
        flops=rounds * steps * (2.0 * (active + lora) * batch + decode_attn),
        hbm_bytes=rounds * steps * (engine_reads.bytes(batch) + decode_kv + batch * act),
        intra_bytes=intra * (1 - first) + rounds * steps * batch * ring, inter_bytes=inter * (1 - first),
        tokens=shape.decode_tokens * world,
        ops=rounds * (eager * step_ops + (steps - eager) * OPS_GRAPH_STEP + new * OPS_SAMPLE),
        graph_kernels=rounds * (steps - eager) * (engine_kernels if separate else step_ops * GRAPH_KERNELS_PER_OP),
        items=rounds * steps * attention_blocks(arch, batch),
        adapter_flops=rounds * steps * 2.0 * lora * batch,
        kernel_work=forward_reads.kernel_work(batch, rounds * steps),
        work=scaled(forward_work(engine_reads, batch, decode_attn, decode_kv), rounds * steps),
        latency_s=rounds * steps * 2 * arch.num_layers * ALLREDUCE_LATENCY_S if tp > 1 else 0.0),
        peaks, eff)
    # the host's own work, serial on any device: each prompt encoded once (a group shares it), each completion
    # turned back into text for its reward, and (orbitctl's sampler) each row's keyed uniform at each sampled token
    prefill.host_s = shape.sequences / profile.rl.group_size * prompt * peaks.encode_token_s
    sampled = shape.sequences * new
    draws = 0.0 if separate else sampled * peaks.keyed_draw_s  # an engine samples with its own generator
    decode.host_s = sampled * peaks.decode_token_s + draws
    if not peaks.synchronous:  # a CPU's ops already wait for each other; a GPU's decode waits for its host each step
        lockstep = LOCKSTEP_S if layout.expert_parallel_on and layout.expert_parallel > 1 and not separate else 0.0
        decode.host_s += rounds * steps * (HOST_SYNC_S + lockstep)
    for part in (prefill, decode):
        part.terms[host_term(peaks)] = part.host_s
    rollout = PhaseTime(flops=prefill.flops + decode.flops, hbm_bytes=prefill.hbm_bytes + decode.hbm_bytes,
                        intra_bytes=prefill.intra_bytes + decode.intra_bytes, inter_bytes=inter,
                        tokens=shape.decode_tokens * world,
                        ops=prefill.ops + decode.ops, items=prefill.items + decode.items,
                        graph_kernels=decode.graph_kernels,
                        adapter_flops=prefill.adapter_flops + decode.adapter_flops,
                        kernel_work=prefill.kernel_work + decode.kernel_work)
    _timed(rollout, peaks, eff)  # its floor from the totals; its terms and seconds are the sub-phases' sums
    for key in ("compute_s", "memory_s", "overhead_s", "comm_s", "host_s"):
        setattr(rollout, key, getattr(prefill, key) + getattr(decode, key))
    rollout.parts = {"prefill": prefill, "decode": decode}

    # ---- policy update: forward, recompute and backward of every micro-batch, plus the no-grad forwards
    seq = profile.memory.seq_len
    t = min(shape.tokens_per_micro_batch // seq, shape.sequences) * seq  # a micro-batch is no larger than the rank's share
    linear, attn = 2.0 * active * t, attention_flops(arch, t, seq / 2)
    forward = linear + attn + 2.0 * lora * t
    # the backward (and a checkpointed layer's recompute) reaches down to the first adapted layer only
    first = adapters.first_layer if adapters is not None else 0
    reach, reach_layers = backward_reach(arch, first), (arch.num_layers - first) / arch.num_layers
    # frozen base: input gradients only (no weight-gradient GEMM); attention 2x; the adapters both gradients
    backward = reach * linear + 2 * reach_layers * attn + 4.0 * lora * t
    # memory.keep_frozen_outputs: the recompute takes the frozen matmuls' outputs the forward kept, reading no weight
    keep = profile.memory.keep_frozen_outputs
    recompute = (0.0 if keep else reach * linear) + reach_layers * attn + 2.0 * lora * t
    forward_passes = shape.micro_batches * (1 + (0 if keep else reach * shape.recompute)) + shape.no_grad_passes
    passes = forward_passes + shape.micro_batches * reach
    intra, inter = _split(profile, layout, terms["zero3_gather_train"] + terms["adapter_allreduce"],
                          terms["all_to_all_train"])
    fwd_ops, fwd_items = ops(t), attention_blocks(arch, t / seq)
    flops = shape.micro_batches * (forward + recompute * shape.recompute + backward) + shape.no_grad_passes * forward
    linear_all = linear * (forward_passes + shape.micro_batches * reach)  # every frozen matmul the update runs
    attn_all = attn * (shape.micro_batches * (1 + reach_layers * (shape.recompute + 2)) + shape.no_grad_passes)
    expert_bytes = forward_passes * forward_reads.expert_bytes(t) + shape.micro_batches * reach * reads.expert_bytes(t)
    hbm_bytes = (forward_passes * forward_reads.bytes(t) + shape.micro_batches * reach * reads.bytes(t)
                 + passes * t * act)
    kernel_passes = forward_passes + 2 * shape.micro_batches * reach  # a backward runs about two kernels per forward's
    update = _timed(PhaseTime(
        flops=flops, hbm_bytes=hbm_bytes, intra_bytes=intra, inter_bytes=inter,
        tokens=shape.micro_batches * t * world,
        ops=shape.micro_batches * (fwd_ops * (1 + reach * (shape.recompute + BACKWARD_OPS))
                                   + reach * counts.backward_extra(hit(t)) + OPS_LOSS)
        + shape.no_grad_passes * fwd_ops + shape.optimizer_steps * OPS_OPTIMIZER * counts.trainable_tensors,
        # the attention backward loops over the same items twice (dq, then dk and dv)
        items=(shape.micro_batches * (1 + reach_layers * (shape.recompute + 2)) + shape.no_grad_passes) * fwd_items,
        adapter_flops=(shape.micro_batches * (2 + 2 * shape.recompute + 4) + 2 * shape.no_grad_passes) * lora * t,
        # the forward passes' frozen matmuls run the fused kernel; the backward dequantizes (the GEMM's rate)
        kernel_work=forward_reads.kernel_work(t, forward_passes),
        offload_bytes=2.0 * offload_bytes * shape.micro_batches,  # out in the forward, back in the backward
        work={"experts": Work(share * linear_all, expert_bytes, expert_kernels * kernel_passes),
              "dense": Work(flops - share * linear_all - attn_all, hbm_bytes - expert_bytes,
                            dense_kernels * kernel_passes),
              "attention": Work(attn_all, 0.0, attention_kernels * kernel_passes)}),
        peaks, eff)

    if not peaks.synchronous:
        # the host waits on its device per micro-batch (orbitctl.rl.update: the loss's finiteness read; the chunked
        # loss's agreed chunk count, an all-reduce of one integer across ranks) and per optimizer step (the token
        # total's all-reduce, the gradient norm's read)
        small = LOCKSTEP_S if world > 1 else 0.0
        update.host_s = (shape.micro_batches + shape.optimizer_steps) * (HOST_SYNC_S + small)
        update.terms["host"] = update.host_s

    # ---- adapter sync: a separate engine receives the whole adapter once per step; the shared one nothing
    sync_bytes = adapter_bytes if separate else 0.0
    intra, inter = _split(profile, layout, sync_bytes, 0.0)
    sync = _timed(PhaseTime(flops=0, hbm_bytes=0, intra_bytes=intra, inter_bytes=inter, tokens=0), peaks, eff)
    return StepTime({"rollout": rollout, "policy_update": update, "adapter_sync": sync}, world,
                    profile.hardware.nodes, eff, steps=rl_steps(profile),
                    price_per_gpu_hour=profile.hardware.price_per_gpu_hour, rates=rates, peaks=peaks)


def backward_reach(arch: ArchSpec, first_layer: int) -> float:
    """Share of a forward's matmul work the update's backward runs again (input gradients, a checkpointed layer's
    recompute): the layers from ``first_layer`` (the first adapted one) up and the output layer; 1 from layer 0."""
    if first_layer == 0:
        return 1.0
    share = arch.experts_per_token / arch.num_experts if arch.num_experts else 1.0
    reached = sum(w.numel * (share if w.kind == EXPERT else 1.0) for layer in arch.layers[first_layer:]
                  for w in layer.weights if w.parameter)
    output = arch.lm_head or arch.embedding  # a tied model's output layer is its embedding
    return min(1.0, (reached + output.numel + arch.final_norm.numel) / arch.params_active)


def rl_steps(profile) -> int:
    """RL steps of the run: rl.steps optimizer steps, ppo_epochs x minibatches of them per rollout batch."""
    return -(-profile.rl.steps // (profile.rl.ppo_epochs * profile.rl.minibatches))


def cost_text(usd: float | None) -> str:
    """'$1,234', '$12.3', '$0.042'; '-' without a price."""
    if usd is None:
        return "-"
    return f"${usd:,.0f}" if usd >= 1000 else f"${usd:.3g}"


def seconds_text(s: float | None) -> str:
    """'28.1 s', '5.4 min', '7.9 h', '12 ms'; '0' for nothing, '-' when unknown."""
    if s is None:
        return "-"
    if s == 0:
        return "0"
    if s >= 3600:
        return f"{s / 3600:.1f} h"
    if s >= 100:
        return f"{s / 60:.0f} min"
    return f"{s:.1f} s" if s >= 1 else f"{s * 1e3:.0f} ms" if s >= 1e-3 else f"{s * 1e6:.0f} µs"


def nodes_change(profile) -> dict[str, Any] | None:
    """The same run on twice the nodes (equal global batch), or None when it already spans nodes."""
    if profile.hardware.nodes > 1 or profile.world_size == 1:
        return None
    return {"hardware.nodes": 2}
