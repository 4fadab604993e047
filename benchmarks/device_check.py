"""The GPU paths checked on a bare one-GPU box, each step on its own, its verdict on disk as soon as it ends.

    bash benchmarks/device_wheels.sh                               # here: .whl/ with pydantic + PyYAML for the box
    python3 benchmarks/device_check.py --out DIR                   # there (the command device_wheels.sh prints)
    python3 benchmarks/device_check.py --out DIR --cpu-rehearsal   # here, on a CPU: what can be checked without a GPU
    python3 benchmarks/device_check.py --out DIR --only sampling,collectives

Made for the box a session is lent: Python 3.12 with torch (CUDA 13), transformers, Triton and PEFT, no pydantic,
DeepSpeed or bitsandbytes, no internet, at most 64 MiB carried to it, 10 minutes a command. So this file imports
nothing but the standard library at its top (torch, Triton and numpy are imported by the steps), every step imports
the orbitctl modules it needs itself (an ImportError is the step's skip, with the reason), and every step runs in its
own child process under a timeout (a CUDA fault, an NCCL hang or a kill stops that step only). After each step
``DIR/<step>.json`` and ``DIR/summary.json`` are written (a temporary file renamed into place: a kill leaves every
finished step's file whole) and one line is printed. A step's record::

    {"step", "status": "pass" | "fail" | "skip", "reason", "criterion", "figures": {...}, "seconds", "device"}

A step that raises is a fail with the exception's last line; the next step still runs. Exit code 0 when no step
failed. The whole run keeps within ``--budget`` seconds (420 by default: under 8 minutes with the processes' start).

Steps (GPU; ``--cpu-rehearsal`` runs the variant in brackets):

- ``grouped``: the grouped INT4 Triton kernel (orbitctl.kernels.grouped_int4) at one GPU's share of a Kimi-K2 MoE layer:
  48 local experts (384 / expert parallelism 8), hidden 7168, expert width 2048 (gate and up stacked: N = 4096 over
  K = 7168; down: N = 7168 over K = 2048), INT4 groups of 32; rows of a decode step (36 sequences x top-8 = 288
  slots) and of an update (4,096 tokens x 8). Pass: max|kernel - dequantized reference| / max|reference| <= 2^-7 for
  both projections at both row counts. Figures: ms per call (CUDA events, median after warm-up), the HBM bandwidth
  the packed weights and scales of the experts hit need at that time, and its fraction of the device's peak (H100
  SXM 3.35 TB/s, H200 4.8 TB/s). [Triton's interpreter on CPU tensors at toy widths; fp16.]
- ``graphed_layer``: a stand-in decoder layer at K2 widths (GQA attention over a static 4,096-slot KV cache, batch
  36, the routed experts through ExpertStack, a shared expert, bf16), captured in a torch.cuda.CUDAGraph and replayed.
  Pass: it captures and replays and the replay equals the eager step within bf16 (relative 2^-7). Figures: ms per
  layer-step eager and replayed, kernels per layer (a profiler over one replay; the graph's DOT dump where torch
  has it), and the plan's kernels per graphed layer for the Kimi-K2 H200 profile (needs pydantic + PyYAML).
  [The stand-in's eager step at toy widths; skip: capture needs a GPU.]
- ``sampling``: KeyedDraws.sample at [36, 163840] on the device. Pass: tokens equal the same call on the CPU copy
  of the probabilities, every step, and no device-to-host copy over 1 KiB while sampling (torch.profiler); figures:
  ms per step. [On the CPU against a numpy inverse CDF.]
- ``collectives``: NCCL at world size 1 (a FileStore): orbitctl.dist.collectives.reduce_scalars through a CUDA
  tensor, an all_reduce captured in a CUDA graph and replayed, and an all_reduce of a CPU tensor refused with "No
  backend type associated with device type cpu", as orbitctl.dist.rehearsal predicts. [Under the rehearsal's
  8-rank fake cuda-only group.]
- ``tinygemm``: CUDA's weight-only INT4 kernel (aten._weight_int4pack_mm, orbitctl.kernels.int4_kernel.Int4Pack) on a
  K2 expert weight (N = 2048, K = 7168, group 32) at 36 and 4,096 rows, against its CPU twin (the same pack on the
  CPU: PyTorch's CPU kernel or orbitctl's AVX512-BF16 one, which compute the same function) and beside a dense bf16
  GEMM. Pass: relative difference <= 2^-7 (each side rounds its float32 sum of exact products once to bf16, at most
  half a bf16 ulp, 2^-8 of the value: two sides 2^-7). [The CPU kernel at a reduced width against float64.]

- ``calibration``: ``orbitctl plan --calibrate``'s measurements (orbitctl.plan.kernel_calibration, through its
  child orbitctl.rl.kernelrates) of the Kimi-K2 profile's kernels on this device, its ``hardware.gpu`` set to the
  device's catalog entry: the grouped INT4 experts at the decode's and the update's rows, a dense bf16 GEMM, decode
  attention over the cache, a device copy. Written as ``DIR/calibration-GPU.json``, the file a profile names as
  ``hardware.calibration``. Pass: the file is written and every rate is positive. [tiny-cpu's CPU rates.]

The old device check's train, vLLM and memory steps (DeepSpeed, a 9.5 GB synthetic slice) moved out: see
docs/benchmarks.md ("Device check").
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

if "--cpu-rehearsal" in sys.argv:  # Triton reads it when first imported: before torch or triton is
    os.environ.setdefault("TRITON_INTERPRET", "1")

ROOT = Path(__file__).resolve().parents[1]
for _path in (ROOT / ".whl" / "site", ROOT):  # the checkout's orbitctl first, then the wheels device_wheels.sh lists
    if _path.is_dir() and str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

if "--cpu-rehearsal" in sys.argv and "--step" in sys.argv:  # a step's child on a CPU: the rehearsal's fake CUDA
    try:  # (a device guard and hooks, so fake cuda tensors index and differentiate) must load before torch
        from orbitctl.dist import fake_cuda

        fake_cuda.load()
    except (ImportError, OSError, RuntimeError):
        pass  # the steps that need it report what failed

STEPS = ("grouped", "graphed_layer", "sampling", "collectives", "tinygemm", "calibration")
TIMEOUT_S = {"grouped": 150, "graphed_layer": 150, "sampling": 60, "collectives": 90, "tinygemm": 90,
             "calibration": 150}
"""Each step's own limit on a GPU (its process's start included); under --cpu-rehearsal 240 each."""
BOUND = 2.0 ** -7
"""bf16 agreement: two results that each round a float32 sum of exact products once to bf16 differ by at most half
an ulp each (2^-8 of the value), so by 2^-7 of the largest; float32 accumulation order adds ~1e-6 relative."""
PEAK_HBM = (("H200", 4.8e12), ("H100", 3.35e12))
"""HBM peak bytes/s by device name (an H100 counts only as SXM: its name says HBM3 and not NVL/PCIe)."""
KIMI_K2 = dict(experts=384, expert_parallel=8, hidden=7168, width=2048, top_k=8, group=32, batch=36, heads=64,
               head_dim=128, vocab=163840, cache=4096, update_tokens=4096)


class Skip(Exception):
    """The step cannot run here; its message is the reason."""


class Context:
    """What a step fills in: its criterion, figures (kept when it raises) and a one-line headline."""

    def __init__(self, name: str, rehearsal: bool, out: Path | None = None) -> None:
        self.name, self.rehearsal, self.out = name, rehearsal, out
        self.criterion = ""
        self.figures: dict = {}
        self.headline = ""


# ----------------------------------------------------------------------------- files


def write_json(path: Path, data) -> None:
    """``data`` as JSON at ``path``, whole or not at all: written to a temporary file, then renamed over it."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w") as out:
            json.dump(data, out, indent=2, default=str)
            out.write("\n")
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


# ----------------------------------------------------------------------------- measuring


def cuda_required() -> None:
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("no CUDA device visible (torch.cuda.is_available() is False); off a GPU use --cpu-rehearsal")


def device_text(rehearsal: bool) -> str:
    import platform

    import torch

    if not rehearsal and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        return f"{props.name}, {props.total_memory / 2**30:.0f} GiB (torch {torch.__version__})"
    return f"cpu, {os.cpu_count()} cores, {platform.machine()} (torch {torch.__version__})"


def timed_ms(fn, cuda: bool, reps: int = 20, warmup: int = 3, cap_s: float = 6.0) -> float:
    """Median milliseconds of ``fn()`` over ``reps`` calls after ``warmup`` (CUDA events on a GPU), fewer calls
    once ``cap_s`` seconds are spent (orbitctl.rl.kernelrates.median_s, what plan --calibrate times with)."""
    from orbitctl.rl.kernelrates import median_s

    return median_s(fn, cuda, reps, warmup, cap_s) * 1e3


def rel_err(got, ref) -> float:
    """max |got - ref| / max |ref|."""
    ref = ref.float()
    top = ref.abs().max().item()
    diff = (got.float() - ref).abs().max().item()
    return diff / top if top else diff


def peak_hbm(name: str) -> float | None:
    upper = name.upper()
    for key, peak in PEAK_HBM:
        if key in upper and (key != "H100" or ("HBM3" in upper and "NVL" not in upper and "PCIE" not in upper)):
            return peak
    return None


def trace_events(fn) -> list[dict]:
    """The Chrome-trace events torch.profiler records over ``fn()`` (CPU and CUDA activities)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as src:
            return json.load(src).get("traceEvents", [])


def kernels_in(events: list[dict]) -> int:
    return sum(1 for e in events if str(e.get("cat", "")).lower() == "kernel")


def random_int4(experts: int, n: int, k: int, group: int, device, generator):
    """Seeded random INT4 experts in the checkpoint layout: int32 words [E, N, K/8] (codes uniform) and bf16 group
    scales [E, N, K/group] of at most 5 significant bits (exact products in bf16, as orbitctl quantize writes)."""
    import torch

    from orbitctl.codec.formats import round_scales

    words = torch.randint(-2**31, 2**31 - 1, (experts, n, k // 8), dtype=torch.int32, device=device,
                          generator=generator)
    scales = round_scales(torch.rand(experts, n, k // group, device=device, generator=generator) * 0.01 + 0.001)
    return words, scales


def expert_reference(a, words, scales, experts, row_div: int):
    """What grouped_int4_mm computes, one expert at a time (grouped_reference's function without its per-slot loop,
    which would dequantize an expert once per slot): each slot's row times its expert's weight dequantized in ``a``'s
    dtype, accumulated in float32, rounded to ``a``'s dtype."""
    import torch

    from orbitctl.codec.formats import dequantize_int4

    k = a.shape[-1]
    out = torch.empty(experts.shape[0], words.shape[1], dtype=a.dtype, device=a.device)
    for e in torch.unique(experts).tolist():
        slots = torch.nonzero(experts == e).squeeze(-1)
        w = dequantize_int4(words[e], scales[e], k, a.dtype).float()
        out[slots] = (a[torch.div(slots, row_div, rounding_mode="floor")].float() @ w.t()).to(a.dtype)
    return out


def routing(tokens: int, experts: int, top_k: int, generator, device):
    """Each token's ``top_k`` distinct experts, uniformly at random, flattened to slots [tokens x top_k]."""
    import torch

    return torch.rand(tokens, experts, generator=generator, device=device).argsort(-1)[:, :top_k].reshape(-1)


# ----------------------------------------------------------------------------- (a) grouped


def step_grouped(ctx: Context) -> tuple[bool, str]:
    import torch
    import torch.nn.functional as F

    from orbitctl.kernels.grouped_int4 import ExpertStack, align_blocks, grouped_int4_mm, grouped_reference, triton_present

    ctx.criterion = ("max|grouped kernel - dequantized reference| / max|reference| <= 2^-7 for gate_up and down, at the "
                     "decode and the update rows")
    if not triton_present():
        raise Skip("triton does not import here")
    if ctx.rehearsal:
        device, dtype, cuda = torch.device("cpu"), torch.float16, False
        E, H, I, G, k, rows = 6, 64, 32, 32, 2, {"decode": 5, "update": 24}
    else:
        cuda_required()
        device, dtype, cuda = torch.device("cuda"), torch.bfloat16, True
        E, H, I, G, k = KIMI_K2["experts"] // KIMI_K2["expert_parallel"], KIMI_K2["hidden"], KIMI_K2["width"], \
            KIMI_K2["group"], KIMI_K2["top_k"]
        rows = {"decode": KIMI_K2["batch"], "update": KIMI_K2["update_tokens"]}
    gen = torch.Generator(device=device).manual_seed(0)
    gate_up, down = random_int4(E, 2 * I, H, G, device, gen), random_int4(E, H, I, G, device, gen)
    stack = ExpertStack(gate_up, down, I, dtype=dtype)
    per_expert = stack.nbytes() / E
    name = torch.cuda.get_device_name(0) if cuda else "cpu"
    peak = peak_hbm(name) if cuda else None
    ctx.figures.update(experts=E, hidden=H, width=I, group=G, top_k=k, dtype=str(dtype).split(".")[-1],
                       interpreted=os.environ.get("TRITON_INTERPRET") == "1", bytes_per_expert=int(per_expert),
                       peak_hbm_TB_per_s=peak / 1e12 if peak else None)
    ok, heads = True, []
    with torch.no_grad():
        for label, tokens in rows.items():
            hidden = torch.randn(tokens, H, generator=gen, device=device).to(dtype)
            experts = routing(tokens, E, k, gen, device)
            slots = experts.shape[0]
            fig = ctx.figures[label] = {"tokens": tokens, "slots": slots,
                                        "experts_hit": int(torch.unique(experts).numel())}
            blocks = align_blocks(experts, E)
            gu = grouped_int4_mm(hidden, *gate_up, *blocks, slots, k)
            ref_gu = expert_reference(hidden, *gate_up, experts, k)
            act = F.silu(ref_gu[:, :I]) * ref_gu[:, I:]  # the down projection's input, as the layer forms it
            dn = grouped_int4_mm(act, *down, *blocks, slots, 1)
            ref_dn = expert_reference(act, *down, experts, 1)
            fig["rel_err_gate_up"], fig["rel_err_down"] = rel_err(gu, ref_gu), rel_err(dn, ref_dn)
            fig["rel_err_layer"] = rel_err(stack.forward(hidden, experts, k, F.silu), ref_dn)  # a figure, no criterion
            if ctx.rehearsal:  # the per-expert reference is grouped_reference's function
                fig["reference_equals_grouped_reference"] = bool(
                    torch.equal(ref_gu, grouped_reference(hidden, *gate_up, experts, k)))
            ok = ok and fig["rel_err_gate_up"] <= BOUND and fig["rel_err_down"] <= BOUND
            reps = 3 if ctx.rehearsal else 20
            t_gu = timed_ms(lambda: grouped_int4_mm(hidden, *gate_up, *blocks, slots, k), cuda, reps)
            t_dn = timed_ms(lambda: grouped_int4_mm(act, *down, *blocks, slots, 1), cuda, reps)
            t_layer = timed_ms(lambda: stack.forward(hidden, experts, k, F.silu), cuda, reps)
            hit_bytes = fig["experts_hit"] * per_expert
            flops = 2.0 * slots * (H * 2 * I + I * H)
            fig.update(ms_gate_up=t_gu, ms_down=t_dn, ms_layer=t_layer, hit_bytes=int(hit_bytes),
                       GB_per_s_kernels=hit_bytes / (t_gu + t_dn) / 1e6, GB_per_s_layer=hit_bytes / t_layer / 1e6,
                       TFLOP_per_s_layer=flops / t_layer / 1e9)
            if peak:
                fig["hbm_fraction_kernels"] = fig["GB_per_s_kernels"] * 1e9 / peak
                fig["hbm_fraction_layer"] = fig["GB_per_s_layer"] * 1e9 / peak
            heads.append(f"{label} {slots} slots: err {max(fig['rel_err_gate_up'], fig['rel_err_down']):.2e}, "
                         f"layer {t_layer:.3f} ms" + ("" if not cuda else f", {fig['GB_per_s_layer']:.0f} GB/s")
                         + (f" ({fig['hbm_fraction_layer']:.0%} of peak)" if peak else ""))
    ctx.headline = "; ".join(heads)
    return ok, "" if ok else f"a relative error above 2^-7: {ctx.figures}"


# ----------------------------------------------------------------------------- (b) graphed_layer


class StandInLayer:
    """One decoder layer's decode step at static shapes, built from plain tensors: RMSNorm, GQA attention over a
    static KV cache (RoPE, the new key and value written at a device-side position), the output projection, RMSNorm,
    a sigmoid top-k router over the rank's local experts, the routed experts through ExpertStack (the grouped INT4
    kernel), a shared SwiGLU expert, the residuals. No host reads: the step can be captured in a CUDA graph. Not
    orbitctl's model (MLA's latent cache and absorbed projections are not here): the kernels a graphed MoE layer
    runs, at Kimi-K2's widths."""

    def __init__(self, *, hidden, heads, kv_heads, head_dim, experts, top_k, width, shared, batch, cache, group,
                 dtype, expert_dtype, device) -> None:
        import torch

        from orbitctl.kernels.grouped_int4 import ExpertStack

        gen = torch.Generator(device=device).manual_seed(1)

        def weight(out_f: int, in_f: int):
            return (torch.randn(out_f, in_f, generator=gen, device=device) * in_f ** -0.5).to(dtype)

        self.heads, self.kv_heads, self.head_dim, self.top_k, self.dtype = heads, kv_heads, head_dim, top_k, dtype
        self.norm1 = torch.ones(hidden, dtype=dtype, device=device)
        self.norm2 = torch.ones(hidden, dtype=dtype, device=device)
        self.q, self.k, self.v = weight(heads * head_dim, hidden), weight(kv_heads * head_dim, hidden), \
            weight(kv_heads * head_dim, hidden)
        self.o = weight(hidden, heads * head_dim)
        self.router = weight(experts, hidden).float()
        self.shared_gate, self.shared_up, self.shared_down = weight(shared, hidden), weight(shared, hidden), \
            weight(hidden, shared)
        self.stack = ExpertStack(random_int4(experts, 2 * width, hidden, group, device, gen),
                                 random_int4(experts, hidden, width, group, device, gen), width, dtype=expert_dtype)
        self.cache_k = torch.randn(batch, kv_heads, cache, head_dim, generator=gen, device=device).to(dtype)
        self.cache_v = torch.randn(batch, kv_heads, cache, head_dim, generator=gen, device=device).to(dtype)
        self.bias = torch.zeros(batch, 1, 1, cache, dtype=torch.float32, device=device)  # every slot open
        self.position = torch.full((1,), cache - 1, dtype=torch.long, device=device)   # the slot written
        half = head_dim // 2
        self.inv_freq = 1.0 / 10000 ** (torch.arange(half, device=device, dtype=torch.float32) / half)

    def _rope(self, t):
        import torch

        angle = self.position.float()[:, None] * self.inv_freq  # [1, D/2]
        cos, sin = angle.cos(), angle.sin()
        half = self.head_dim // 2
        a, b = t[..., :half].float(), t[..., half:].float()
        return torch.cat([a * cos - b * sin, a * sin + b * cos], -1).to(t.dtype)

    @staticmethod
    def _norm(x, weight):
        import torch

        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype) * weight

    def step(self, x):
        import torch
        import torch.nn.functional as F

        batch = x.shape[0]
        h = self._norm(x, self.norm1)
        q = self._rope((h @ self.q.t()).view(batch, self.heads, self.head_dim))
        k_new = self._rope((h @ self.k.t()).view(batch, self.kv_heads, self.head_dim))
        v_new = (h @ self.v.t()).view(batch, self.kv_heads, self.head_dim)
        self.cache_k.index_copy_(2, self.position, k_new[:, :, None])
        self.cache_v.index_copy_(2, self.position, v_new[:, :, None])
        group = self.heads // self.kv_heads
        qg = q.view(batch, self.kv_heads, group, self.head_dim)
        scores = (qg @ self.cache_k.transpose(-1, -2)).float() * self.head_dim ** -0.5 + self.bias
        attn = (torch.softmax(scores, -1).to(self.dtype) @ self.cache_v).reshape(batch, self.heads * self.head_dim)
        x = x + attn @ self.o.t()
        h = self._norm(x, self.norm2)
        weights, chosen = torch.sigmoid(h.float() @ self.router.t()).topk(self.top_k, -1)
        weights = weights / weights.sum(-1, keepdim=True)
        routed = self.stack.forward(h, chosen.reshape(-1), self.top_k, F.silu)
        routed = (routed.view(batch, self.top_k, -1).float() * weights[..., None]).sum(1).to(x.dtype)
        shared = (F.silu(h @ self.shared_gate.t()) * (h @ self.shared_up.t())) @ self.shared_down.t()
        return x + routed + shared


def plan_layer_figures() -> dict:
    """The plan's kernels per graphed decode layer for the Kimi-K2 H200 profile (grouped experts): the ops of one
    decode step per layer (orbitctl.plan.ops.op_counts) times GRAPH_KERNELS_PER_OP. Needs the profile loader
    (pydantic, PyYAML): an ImportError says which is missing."""
    from orbitctl.plan import _arch
    from orbitctl.plan.budget import prepare
    from orbitctl.plan.ops import GRAPH_KERNELS_PER_OP, grouped_experts, op_counts
    from orbitctl.profile import load_profile

    path = ROOT / "profiles" / "kimi-k2_grpo_int4_8xh200.yaml"
    profile = load_profile(str(path), ["rollout.batch_size=36"])
    arch = _arch(profile)
    adapters = prepare(profile, arch).adapters

    def per_layer(counts) -> float:
        return (counts.forward(0.0) + counts.decode_extra) / arch.num_layers

    base, adapted = per_layer(op_counts(profile, arch, None)), per_layer(op_counts(profile, arch, adapters))
    return {"profile": path.name, "grouped_experts": grouped_experts(profile, adapters),
            "ops_per_layer_base": round(base, 1), "ops_per_layer_with_adapters": round(adapted, 1),
            "graph_kernels_per_op": GRAPH_KERNELS_PER_OP,
            "kernels_per_layer_base": round(base * GRAPH_KERNELS_PER_OP, 1),
            "kernels_per_layer_with_adapters": round(adapted * GRAPH_KERNELS_PER_OP, 1),
            "note": "the plan's layer is MLA with the profile's LoRA; the stand-in is GQA without adapters: compare "
                    "with kernels_per_layer_base, expecting the MLA terms' difference"}


def graph_dot_counts(graph) -> dict:
    """Nodes of a captured graph from its DOT dump (torch.cuda.CUDAGraph.debug_dump, capture in debug mode)."""
    import re

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "graph.dot")
        graph.debug_dump(path)
        text = Path(path).read_text(errors="replace")
    nodes = re.findall(r'^\s*"?([\w.]+)"?\s*\[', text, flags=re.M)
    return {"dot_nodes": len(set(nodes)), "dot_kernel_mentions": len(re.findall(r"\bKERNEL\b", text))}


def step_graphed_layer(ctx: Context) -> tuple[bool, str]:
    import torch

    ctx.criterion = ("the stand-in K2 layer step captures in a CUDA graph, replays, and the replay equals the eager "
                     "step within bf16 (max|replay - eager| / max|eager| <= 2^-7)")
    try:
        ctx.figures["plan"] = plan_layer_figures()
    except ImportError as err:
        ctx.figures["plan"] = f"skipped: the profile loader needs {err} (bash benchmarks/device_wheels.sh, then its " \
                              "install command)"
    except Exception as err:  # noqa: BLE001 - a figure, not the step's criterion
        ctx.figures["plan"] = f"skipped: the plan raised {_last_line(err)}"
    if ctx.rehearsal:
        from orbitctl.kernels.grouped_int4 import triton_present

        if not triton_present():
            raise Skip("CUDA graph capture needs a GPU, and Triton (for the stand-in's eager step) does not import")
        widths = dict(hidden=64, heads=4, kv_heads=2, head_dim=16, experts=6, top_k=2, width=32, shared=32, batch=3,
                      cache=16, group=32)
        layer = StandInLayer(**widths, dtype=torch.float32, expert_dtype=torch.float16, device=torch.device("cpu"))
        x = torch.randn(widths["batch"], widths["hidden"], generator=torch.Generator().manual_seed(2))
        with torch.no_grad():
            first = layer.step(x)
            again = layer.step(x)
        ctx.figures.update(widths=widths, eager_steps_equal=bool(torch.equal(first, again)),
                           finite=bool(torch.isfinite(first).all()))
        if not (ctx.figures["eager_steps_equal"] and ctx.figures["finite"]):
            return False, "the stand-in's eager step is not repeatable or not finite"
        raise Skip("CUDA graph capture and replay need a GPU; the stand-in layer's eager step ran here at toy widths "
                   "(hidden 64, the grouped kernel interpreted): finite and repeatable")
    cuda_required()
    b = KIMI_K2
    widths = dict(hidden=b["hidden"], heads=b["heads"], kv_heads=8, head_dim=b["head_dim"],
                  experts=b["experts"] // b["expert_parallel"], top_k=b["top_k"], width=b["width"], shared=b["width"],
                  batch=b["batch"], cache=b["cache"], group=b["group"])
    ctx.figures["widths"] = widths
    layer = StandInLayer(**widths, dtype=torch.bfloat16, expert_dtype=torch.bfloat16, device=torch.device("cuda"))
    x = torch.randn(widths["batch"], widths["hidden"], device="cuda").to(torch.bfloat16)  # the static input
    with torch.no_grad():
        eager = layer.step(x).clone()
        torch.cuda.synchronize()
        ctx.figures["ms_eager"] = timed_ms(lambda: layer.step(x), True)
        ctx.figures["kernels_eager"] = kernels_in(trace_events(lambda: layer.step(x)))
        side = torch.cuda.Stream()  # warm-up on a side stream, as capture wants
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                layer.step(x)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        debug = hasattr(graph, "enable_debug_mode")
        if debug:
            graph.enable_debug_mode()
        with torch.cuda.graph(graph):
            static_out = layer.step(x)
        graph.replay()
        torch.cuda.synchronize()
        err = rel_err(static_out, eager)
        ctx.figures.update(captured=True, rel_err_replay_vs_eager=err,
                           replay_equals_eager_bitwise=bool(torch.equal(static_out, eager)))
        ctx.figures["ms_replay"] = timed_ms(graph.replay, True)
        ctx.figures["kernels_per_replay"] = kernels_in(trace_events(graph.replay))
        if debug:
            try:
                ctx.figures.update(graph_dot_counts(graph))
            except Exception as dump_err:  # a figure only
                ctx.figures["dot"] = f"no dump: {str(dump_err).splitlines()[-1] if str(dump_err) else dump_err!r}"
    plan = ctx.figures["plan"]
    if isinstance(plan, dict) and ctx.figures["kernels_per_replay"]:
        ctx.figures["measured_over_plan_base"] = ctx.figures["kernels_per_replay"] / plan["kernels_per_layer_base"]
    ctx.headline = (f"eager {ctx.figures['ms_eager']:.3f} ms, replayed {ctx.figures['ms_replay']:.3f} ms per layer; "
                    f"{ctx.figures['kernels_per_replay']} kernels per replay (eager {ctx.figures['kernels_eager']})"
                    + (f", plan {plan['kernels_per_layer_base']}" if isinstance(plan, dict) else "")
                    + f"; replay vs eager {err:.1e}")
    ok = err <= BOUND
    return ok, "" if ok else f"the replay differs from the eager step by {err:.3e} of its largest value (> 2^-7)"


# ----------------------------------------------------------------------------- (c) sampling


def step_sampling(ctx: Context) -> tuple[bool, str]:
    import torch

    from orbitctl.model.draws import KeyedDraws

    b, v = KIMI_K2["batch"], KIMI_K2["vocab"]
    steps = 8
    draws = KeyedDraws(seed=1234, keys=tuple(range(1000, 1000 + b)))
    ctx.figures.update(batch=b, vocab=v, steps=steps)
    if ctx.rehearsal:
        import numpy as np

        ctx.criterion = ("on the CPU at [36, 163840]: KeyedDraws.sample's tokens equal a numpy float64 inverse CDF at "
                         "the same uniforms, every step; ms per step reported")
        gen = torch.Generator().manual_seed(0)
        probs = torch.softmax(torch.randn(b, v, generator=gen) * 3, -1)
        cdf = np.cumsum(probs.double().numpy(), axis=-1)
        mismatched = 0
        for t in range(steps):
            got = draws.sample(probs, t)
            target = draws.uniforms(t).numpy() * cdf[:, -1]
            want = [min(int(np.searchsorted(cdf[i], target[i], side="left")), v - 1) for i in range(b)]
            mismatched += int((got.numpy() != np.array(want)).sum())
        ms = timed_ms(lambda: draws.sample(probs, 0), False, reps=10)
        ctx.figures.update(ms_per_step=ms, mismatched_tokens=mismatched, device_to_host_copies="no device here")
        ctx.figures["rehearsal"] = _sampling_rehearsal(draws, b, v)
        ctx.headline = f"{ms:.1f} ms per step on the CPU; {mismatched} of {b * steps} tokens differ from numpy"
        return mismatched == 0, "" if mismatched == 0 else f"{mismatched} tokens differ from the numpy inverse CDF"
    ctx.criterion = ("at [36, 163840] on the GPU: tokens equal the same call on the CPU copy of the probabilities, "
                     "every step (float64 CDF), no device-to-host copy over 1 KiB while sampling; ms per step reported")
    cuda_required()
    gen = torch.Generator(device="cuda").manual_seed(0)
    probs = torch.softmax(torch.randn(b, v, generator=gen, device="cuda") * 3, -1)
    host = probs.cpu()
    mismatched = 0
    for t in range(steps):
        mismatched += int((draws.sample(probs, t).cpu() != draws.sample(host, t)).sum())
    ctx.figures["mismatched_tokens"] = mismatched
    ctx.figures["cdf_max_diff_device_vs_cpu"] = (probs.double().cumsum(-1).cpu() - host.double().cumsum(-1)).abs() \
        .max().item()
    ctx.figures["token_device"] = str(draws.sample(probs, 0).device)
    ms = ctx.figures["ms_per_step"] = timed_ms(lambda: draws.sample(probs, 0), True)
    copies = [e for e in trace_events(lambda: draws.sample(probs, 1)) if str(e.get("cat", "")).lower() == "gpu_memcpy"]

    def nbytes(event) -> int:  # -1: the trace did not say
        return int((event.get("args") or {}).get("bytes", -1))

    def kind(event, which: str) -> bool:
        return which in str(event.get("name", "")) or which in str((event.get("args") or {}).get("copy kind", ""))

    to_host = [e for e in copies if kind(e, "DtoH")]
    big = [e for e in to_host if nbytes(e) > 1024]
    ctx.figures.update(memcpy_device_to_host=[(e.get("name"), nbytes(e)) for e in to_host],
                       memcpy_host_to_device_bytes=sum(max(nbytes(e), 0) for e in copies if kind(e, "HtoD")),
                       memcpy_events_seen=len(copies))
    ok = mismatched == 0 and not big
    ctx.headline = f"{ms:.3f} ms per step; {mismatched} of {b * steps} tokens differ from the CPU; " \
                   f"{len(to_host)} device-to-host copies ({len(big)} over 1 KiB)"
    reasons = ([f"{mismatched} tokens differ from the CPU copy's"] if mismatched else []) + \
        ([f"{len(big)} device-to-host copies over 1 KiB while sampling"] if big else [])
    return ok, "; ".join(reasons)


def _sampling_rehearsal(draws, b: int, v: int) -> str:
    """Whether the sampler runs under the CUDA rehearsal as capturable (no host read): a figure, no criterion."""
    import torch

    from orbitctl.dist.rehearsal import rehearsal

    try:
        with rehearsal(world=1) as r:
            probs = torch.rand(b, v, device="cuda")
            with r.capturable("sampling"):
                draws.sample(probs, 0)
        return "capturable under the rehearsal"
    except Exception as err:  # noqa: BLE001 - reported, not judged
        where = traceback.extract_tb(err.__traceback__)
        site = next((f"{Path(f.filename).name}:{f.lineno}" for f in reversed(where) if "orbitctl" in f.filename), "?")
        return f"not rehearsed: {type(err).__name__} at {site}: {str(err).splitlines()[0] if str(err) else ''}"


# ----------------------------------------------------------------------------- (d) collectives

CPU_REFUSAL = "No backend type associated with device type cpu"


def _rehearsed_collectives() -> dict:
    """orbitctl.dist.rehearsal's 8-rank fake cuda-only group: reduce_scalars through it, and a CPU tensor refused."""
    import torch
    import torch.distributed as dist

    from orbitctl.dist import collectives as coll
    from orbitctl.dist.rehearsal import RehearsalError, rehearsal

    out: dict = {}
    with rehearsal(world=8) as r:
        out["sum_ints"] = coll.reduce_scalars([3, 5], "sum")
        out["max_floats"] = coll.reduce_scalars([1.5, -2.0], "max")
        out["group_device"] = str(coll.group_device())
        try:
            dist.all_reduce(torch.ones(2))
            out["cpu_refused"] = "not refused"
        except RehearsalError as err:
            out["cpu_refused"] = str(err)
        out["collectives_seen"] = [c.op for c in r.collectives]
    out["ok"] = (out["sum_ints"] == [24, 40] and out["max_floats"] == [1.5, -2.0]
                 and out["group_device"].startswith("cuda") and CPU_REFUSAL in out["cpu_refused"])
    return out


def step_collectives(ctx: Context) -> tuple[bool, str]:
    import torch

    if ctx.rehearsal:
        ctx.criterion = ("under orbitctl.dist.rehearsal (world 8, cuda-only fake group): reduce_scalars gives 8x the "
                         "sum and the max on a cuda tensor, and an all_reduce of a CPU tensor is refused with "
                         f"'{CPU_REFUSAL}'")
        ctx.figures.update(_rehearsed_collectives())
        ok = ctx.figures.pop("ok")
        ctx.headline = f"reduce_scalars {ctx.figures['sum_ints']} on {ctx.figures['group_device']}; CPU tensor " \
                       + ("refused" if CPU_REFUSAL in ctx.figures["cpu_refused"] else "NOT refused")
        return ok, "" if ok else f"the rehearsal did not behave as NCCL does: {ctx.figures}"
    ctx.criterion = ("NCCL at world size 1: reduce_scalars returns the values through a CUDA tensor; an all_reduce "
                     f"captured in a CUDA graph and replayed 3 times gives 3; a CPU tensor refused with '{CPU_REFUSAL}'")
    cuda_required()
    import datetime

    import torch.distributed as dist

    from orbitctl.dist import collectives as coll

    try:  # what the rehearsal predicts (it needs no process group: run it before NCCL's)
        ctx.figures["rehearsal"] = _rehearsed_collectives()
    except Exception as err:  # noqa: BLE001 - a figure
        ctx.figures["rehearsal"] = f"did not run: {type(err).__name__}: {err}"
    with tempfile.TemporaryDirectory() as tmp:
        torch.cuda.set_device(0)
        dist.init_process_group("nccl", store=dist.FileStore(os.path.join(tmp, "store"), 1), rank=0, world_size=1,
                                timeout=datetime.timedelta(seconds=60))
        try:
            checks = {}
            # 1. reduce_scalars: at world 1 it returns the values without a collective (collectives.active); with
            # active() made to answer True, it takes the multi-rank path: a tensor on group_device through NCCL
            plain = coll.reduce_scalars([3, 5], "sum")
            seen: list[str] = []
            real_all_reduce, real_active = dist.all_reduce, coll.active

            def recording(tensor, *args, **kwargs):
                seen.append(str(tensor.device))
                return real_all_reduce(tensor, *args, **kwargs)

            dist.all_reduce, coll.active = recording, (lambda group=None: dist.is_initialized())
            try:
                summed = coll.reduce_scalars([3, 5], "sum")
                maxed = coll.reduce_scalars([1.5, -2.0], "max")
            finally:
                dist.all_reduce, coll.active = real_all_reduce, real_active
            ctx.figures.update(group_device=str(coll.group_device()), world_1_no_collective=plain,
                               through_nccl_sum=summed, through_nccl_max=maxed, tensor_devices=seen)
            checks["reduce_scalars"] = (plain == [3, 5] and summed == [3, 5] and maxed == [1.5, -2.0]
                                        and len(seen) == 2 and all(d.startswith("cuda") for d in seen))
            # 2. an all_reduce captured in a CUDA graph, replayed
            x = torch.zeros(1024, device="cuda")
            dist.all_reduce(x)  # the communicator is up before the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                x.add_(1.0)
                dist.all_reduce(x)
            for _ in range(3):
                graph.replay()
            torch.cuda.synchronize()
            ctx.figures["graph_all_reduce_after_3_replays"] = x[:4].tolist()
            checks["graph_all_reduce"] = bool(torch.all(x == 3.0))
            # 3. a CPU tensor refused
            try:
                dist.all_reduce(torch.ones(2))
                refusal = "not refused"
            except Exception as err:  # noqa: BLE001 - its message is the check
                refusal = f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}"
            ctx.figures["cpu_tensor"] = refusal
            checks["cpu_refused"] = CPU_REFUSAL in refusal
            rehearsed = ctx.figures["rehearsal"]
            ctx.figures["rehearsal_predicted_it"] = isinstance(rehearsed, dict) and CPU_REFUSAL in rehearsed.get(
                "cpu_refused", "")
        finally:
            dist.destroy_process_group()
    ctx.figures["checks"] = checks
    ok = all(checks.values())
    ctx.headline = ", ".join(f"{name} {'ok' if good else 'FAILED'}" for name, good in checks.items())
    return ok, "" if ok else "failed: " + ", ".join(name for name, good in checks.items() if not good)


# ----------------------------------------------------------------------------- (e) tinygemm


def step_tinygemm(ctx: Context) -> tuple[bool, str]:
    import torch

    from orbitctl.codec.formats import dequantize_int4, pack_int4, quantize_int4
    from orbitctl.kernels.int4_kernel import Int4Pack, cuda_kernel_present, rows_are_independent

    n, k, group = KIMI_K2["width"], KIMI_K2["hidden"], KIMI_K2["group"]
    if ctx.rehearsal:
        ctx.criterion = ("on the CPU at a reduced width: the CPU INT4 kernel (tinygemm's twin) against the float64 "
                         "product of the dequantized weight, relative difference <= 2^-7 at 36 and 256 rows")
        n, k, row_counts = 512, 1024, (36, 256)
        device = torch.device("cpu")
    else:
        ctx.criterion = ("tinygemm (aten._weight_int4pack_mm) against its CPU twin on the same INT4 weight, relative "
                         "difference <= 2^-7 at 36 and 4,096 rows (compared on the first 256)")
        cuda_required()
        if not cuda_kernel_present():
            raise Skip("this torch has no aten._weight_int4pack_mm / _convert_weight_to_int4pack")
        row_counts = (KIMI_K2["batch"], KIMI_K2["update_tokens"])
        device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(3)
    codes, scale = quantize_int4(torch.randn(n, k, generator=gen, device=device) * 0.02, group)
    words = pack_int4(codes)
    dense = dequantize_int4(words, scale, k, torch.bfloat16)
    twin = Int4Pack.of(words.cpu(), scale.cpu())
    ctx.figures.update(out_features=n, in_features=k, group=group, cpu_twin_kind=twin.kind)
    pack = twin if ctx.rehearsal else Int4Pack.of(words, scale)
    if not ctx.rehearsal:
        ctx.figures["rows_independent_probe"] = rows_are_independent("cuda")
    cuda = device.type == "cuda"
    ok, heads = True, []
    with torch.no_grad():
        for rows in row_counts:
            x = torch.randn(rows, k, generator=gen, device=device).to(torch.bfloat16)
            y = pack.matmul(x)
            compare = min(rows, 256)
            ref64 = (x[:compare].double() @ dense.double().t())
            fig = ctx.figures[f"rows_{rows}"] = {"compared_rows": compare}
            if ctx.rehearsal:
                fig["rel_err_vs_float64"] = err = rel_err(y[:compare], ref64)
            else:
                y_twin = twin.matmul(x[:compare].cpu())
                fig["rel_diff_vs_cpu_twin"] = err = rel_err(y[:compare].cpu(), y_twin)
                fig["rel_err_vs_float64"] = rel_err(y[:compare], ref64)
                fig["cpu_twin_rel_err_vs_float64"] = rel_err(y_twin, ref64.cpu())
                fig["dense_bf16_rel_err_vs_float64"] = rel_err((x[:compare] @ dense.t()), ref64)
                if rows > KIMI_K2["batch"]:  # each row alone: the first 36 rows of the big product
                    fig["rows_equal_in_smaller_batch"] = bool(torch.equal(pack.matmul(x[:36]), y[:36]))
            flops = 2.0 * rows * n * k
            reps = 5 if ctx.rehearsal else 20
            t_int4 = timed_ms(lambda: pack.matmul(x), cuda, reps)
            t_dense = timed_ms(lambda: x @ dense.t(), cuda, reps)
            fig.update(ms_int4=t_int4, ms_dense_bf16=t_dense, GFLOP_per_s_int4=flops / t_int4 / 1e6,
                       GFLOP_per_s_dense_bf16=flops / t_dense / 1e6)
            ok = ok and err <= BOUND
            heads.append(f"{rows} rows: diff {err:.2e}, int4 {t_int4:.3f} ms ({fig['GFLOP_per_s_int4']:.0f} GFLOP/s) "
                         f"vs bf16 {t_dense:.3f} ms")
    ctx.headline = "; ".join(heads)
    return ok, "" if ok else "a relative difference above 2^-7"


# ----------------------------------------------------------------------------- (f) calibration

CATALOG_OF = (("H200", "h200"), ("H100", "h100-80g"), ("B200", "b200"), ("A100", "a100-80g"))
"""The catalog entry (orbitctl/profile/gpus.py) a device name maps to, first match."""


def step_calibration(ctx: Context) -> tuple[bool, str]:
    """What `orbitctl plan --calibrate` writes, through the same code: the Kimi-K2 H200 profile's kernels (its
    hardware.gpu set to this device's catalog entry) measured here, written as DIR/calibration-GPU.json."""
    import torch

    from orbitctl.plan.kernel_calibration import calibrate
    from orbitctl.profile import load_profile

    ctx.criterion = "the calibration file is written and every rate in it is positive"
    if ctx.rehearsal:
        profile = load_profile(str(ROOT / "profiles" / "tiny-cpu.yaml"))
        gpu = "cpu"
    else:
        cuda_required()
        name = torch.cuda.get_device_name(0).upper()
        gpu = next((entry for key, entry in CATALOG_OF if key in name), None)
        if gpu is None:
            raise Skip(f"{name}: no catalog entry to calibrate")
        profile = load_profile(str(ROOT / "profiles" / "kimi-k2_grpo_int4_8xh200.yaml"), [f"hardware.gpu={gpu}"])
    path = calibrate(profile, ctx.out / f"calibration-{gpu}.json")
    doc = json.loads(path.read_text())
    ctx.figures.update(file=str(path), rates=doc["rates"], skipped=doc.get("skipped", {}), device=doc["device"])
    numbers = [v for v in doc["rates"].values() if not isinstance(v, list)]
    ok = bool(numbers) and all(v > 0 for v in numbers)
    ctx.headline = ", ".join(f"{k} {v:.3g}" for k, v in doc["rates"].items() if not isinstance(v, list))
    return ok, "" if ok else f"a rate is not positive: {doc['rates']}"


STEP_FUNCTIONS = {"grouped": step_grouped, "graphed_layer": step_graphed_layer, "sampling": step_sampling,
                  "collectives": step_collectives, "tinygemm": step_tinygemm, "calibration": step_calibration}


# ----------------------------------------------------------------------------- running


def _last_line(err: BaseException) -> str:
    lines = traceback.format_exception_only(type(err), err)
    text = "".join(lines).strip().splitlines()
    return text[-1] if text else type(err).__name__


def run_step(name: str, out: Path, rehearsal: bool) -> int:
    """The child: run one step and write its record."""
    started = time.perf_counter()
    ctx = Context(name, rehearsal, out)
    record = {"step": name, "status": "fail", "reason": "", "criterion": "", "figures": ctx.figures, "seconds": 0.0,
              "device": "?"}
    try:
        record["device"] = device_text(rehearsal)
        passed, reason = STEP_FUNCTIONS[name](ctx)
        record.update(status="pass" if passed else "fail", reason=reason)
    except Skip as why:
        record.update(status="skip", reason=str(why))
    except ImportError as err:
        record.update(status="skip", reason=f"an import failed: {_last_line(err)}")
    except Exception as err:  # noqa: BLE001 - a step's failure is its record
        traceback.print_exc()
        record.update(status="fail", reason=_last_line(err))
    record.update(criterion=ctx.criterion, headline=ctx.headline, seconds=round(time.perf_counter() - started, 2))
    write_json(out / f"{name}.json", record)
    return 0


def _die_with_parent() -> None:
    """In the child: killed when the parent dies (Linux), so a killed run leaves no step running on."""
    try:
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:  # noqa: BLE001 - best effort off Linux
        pass


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="directory for <step>.json, <step>.log and summary.json")
    parser.add_argument("--cpu-rehearsal", action="store_true", help="the CPU variants, on a machine without a GPU")
    parser.add_argument("--only", default="", help=f"comma-separated steps, run in that order (of {', '.join(STEPS)})")
    parser.add_argument("--budget", type=float, default=420.0, help="seconds for the whole run (steps left over skip)")
    parser.add_argument("--step", help=argparse.SUPPRESS)  # the child's: run this one step in this process
    args = parser.parse_args(argv)
    out = Path(args.out).resolve()  # the steps' processes run from the repository root
    out.mkdir(parents=True, exist_ok=True)
    if args.step:
        return run_step(args.step, out, args.cpu_rehearsal)

    chosen = [s.strip() for s in args.only.split(",") if s.strip()] or list(STEPS)
    unknown = [s for s in chosen if s not in STEPS]
    if unknown:
        parser.error(f"unknown step(s) {', '.join(unknown)}; the steps: {', '.join(STEPS)}")
    mode = "cpu-rehearsal" if args.cpu_rehearsal else "gpu"
    started = time.monotonic()
    deadline = started + args.budget
    summary = {"mode": mode, "steps": chosen, "results": {}, "finished": False, "wall_seconds": 0.0,
               "python": sys.version.split()[0], "argv": sys.argv[1:]}
    write_json(out / "summary.json", summary)
    print(f"device_check: {mode}, steps {', '.join(chosen)}, files in {out}", flush=True)
    env = dict(os.environ)
    if args.cpu_rehearsal:
        env["TRITON_INTERPRET"] = "1"
    for name in chosen:
        (out / f"{name}.json").unlink(missing_ok=True)
        left = deadline - time.monotonic()
        limit = min(240.0 if args.cpu_rehearsal else TIMEOUT_S[name], left)
        begun = time.perf_counter()
        record = None
        if limit < 20:
            record = {"step": name, "status": "skip", "reason": f"the run's --budget of {args.budget:.0f} s is spent",
                      "criterion": "", "figures": {}, "seconds": 0.0, "device": "?"}
        else:
            cmd = [sys.executable, str(Path(__file__).resolve()), "--step", name, "--out", str(out)]
            if args.cpu_rehearsal:
                cmd.append("--cpu-rehearsal")
            log_path = out / f"{name}.log"
            with open(log_path, "w") as log:
                child = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=str(ROOT),
                                         preexec_fn=_die_with_parent)
                try:
                    code = child.wait(timeout=limit)
                    why = f"its process ended with exit code {code} before writing its record"
                except subprocess.TimeoutExpired:
                    child.kill()
                    child.wait()
                    code, why = None, f"timed out after {limit:.0f} s (killed)"
            record = read_json(out / f"{name}.json")
            if record is None:
                tail = [line for line in log_path.read_text(errors="replace").splitlines() if line.strip()][-1:]
                record = {"step": name, "status": "fail", "reason": why + (f"; last log line: {tail[0]}" if tail else ""),
                          "criterion": "", "figures": {}, "seconds": round(time.perf_counter() - begun, 2),
                          "device": "?"}
            elif code not in (0, None):
                record["exit_code"] = code  # it wrote its record, then its process failed (at exit)
        record["wall_seconds"] = round(time.perf_counter() - begun, 2)
        write_json(out / f"{name}.json", record)
        summary["results"][name] = {key: record.get(key) for key in ("status", "reason", "seconds", "headline")}
        summary["device"] = record.get("device") if record.get("device") != "?" else summary.get("device")
        summary["wall_seconds"] = round(time.monotonic() - started, 1)
        write_json(out / "summary.json", summary)
        detail = record.get("reason") if record["status"] != "pass" else record.get("headline", "")
        print(f"{name:<14} {record['status'].upper():<4} {record['wall_seconds']:6.1f} s  {detail}", flush=True)
    counts = {s: sum(1 for r in summary["results"].values() if r["status"] == s) for s in ("pass", "fail", "skip")}
    summary.update(finished=True, counts=counts, wall_seconds=round(time.monotonic() - started, 1))
    write_json(out / "summary.json", summary)
    print(f"device_check: {counts['pass']} pass, {counts['fail']} fail, {counts['skip']} skip in "
          f"{summary['wall_seconds']:.0f} s ({summary.get('device') or 'no device'})", flush=True)
    return 1 if counts["fail"] else 0


if __name__ == "__main__":
    sys.exit(main())
