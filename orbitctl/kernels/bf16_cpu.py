"""orbitctl's CPU kernels for AVX512-BF16: the INT4 matmul, its dequantizer and the one-position decode attention.

    if bf16_cpu.available():                                          # AVX512-BF16, uncapped, the library built
        packed, scales = bf16_cpu.pack(weight_packed, weight_scale)   # once, at load
        y = bf16_cpu.matmul(x_bf16_2d, packed, scales, group_size)    # [M, K] -> [M, N] bf16
        w = bf16_cpu.dequantize_into(packed, scales, group_size, out) # the dense bf16 weight, one pass
        o = bf16_cpu.decode_attention(q, k, v, mask, scaling)         # [B, H, 1, D] against the cache's views

**INT4 matmul.** PyTorch's CPU INT4 kernel (``aten._weight_int4pack_mm_for_cpu``) dequantizes to float32 and
multiplies in float32 FMAs: about 170 GFLOP/s on two AVX512-BF16 cores at any number of rows, half what a bf16
GEMM over the dense weight reaches. This one (``csrc/bf16_cpu.cpp``) dequantizes a block of four output rows at a
time into a bf16 buffer (a 16-entry table per group, one ``vpermw`` per 32 weights) and multiplies it against
every row of x with ``vdpbf16ps``: 2.0x the float32 kernel at 8-64 rows, 1.3x at one row
(``benchmarks/int4_kernels.py``). It computes the function the other paths compute: only for weights whose every
value is exactly a bf16 number (scales of at most :data:`~orbitctl.codec.formats.SCALE_BITS` significant bits,
what ``orbitctl quantize`` writes), the products of the bf16 activations and weights are exact in float32,
accumulated in float32, the result rounded once to bf16; each output row depends only on its own input row, bit
for bit, whatever the number of rows.

**Decode attention.** :func:`orbitctl.kernels.decode_attention.decode_attention` in bf16, reading K and V where the
cache holds them (strided views) instead of converting the whole history to float32 every step: float32 scores
from ``vdpbf16ps``, the masked softmax in float32 (a vectorised exp: Cephes' polynomial), the exponentials rounded
to bf16 for the product with V, float32 accumulation and one rounding.

The library is compiled at first use (``g++ -O3 -fopenmp``, about a second) into ``$ORBITCTL_CACHE/kernels``
under a name that hashes the source and the compiler, written under a temporary name and renamed into place. Its
parallel loops run on the OpenMP runtime torch already loaded (same soname), on ``torch.get_num_threads()``
threads.

**Which ISA, asked of the CPU and of the OS** (:func:`host_isa`, the rule in :func:`choose_isa`). CPUID's flags are
not enough: an AVX-512 instruction whose registers the OS did not enable in XCR0, or an AMX tile instruction before
the kernel granted this process the tile data, raises SIGILL like one the CPU lacks
(:mod:`orbitctl.kernels.cpu_state`). So the AVX512-BF16 kernels run only where the CPU has the flags, XCR0 holds the
opmask and ZMM states, and nothing caps the kernels below them (``ATEN_CPU_CAPABILITY``, ``ONEDNN_MAX_CPU_ISA``);
and a compiler built the library, whose first calls ran in a child process once (:func:`first_calls`, through
:func:`orbitctl.isolated.run_isolated`; a stamp beside the library, keyed by the CPU and XCR0, records it): a
kernel that dies there is one log line naming the signal and its cause, and this process keeps PyTorch's kernels.
Where any of that fails, :func:`available` is False and the callers keep PyTorch's kernels.

AMX is asked for where the CPU has AMX-TILE and AMX-BF16: ``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)``
in this process. Granted (and oneDNN not capped below AMX), the INT4 layers' many-row products run oneDNN's bf16
GEMM over the dequantized weight, which oneDNN then runs on AMX tiles, from fewer rows than on AVX512-BF16
(:func:`orbitctl.model.quant_linear.dense_rows`); refused, one log line says why and the AVX512-BF16 thresholds hold.
The kernels in this library use no AMX instruction.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import torch

from orbitctl.kernels import cpu_state

SOURCE = Path(__file__).with_name("csrc") / "bf16_cpu.cpp"
CPU_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16")
"""What the kernel's instructions need, as /proc/cpuinfo spells them."""
ROWS_PER_BLOCK = 4
"""Output features are dequantized four at a time: a weight takes the kernel when its rows are a multiple of this."""
CHUNK = 32
"""Input features are read 32 at a time: the input width and the group size must be multiples of this."""

log = logging.getLogger(__name__)


def unsupported_shape(out_features: int, in_features: int, group_size: int) -> str | None:
    """Why the kernel cannot take an [out, in] weight in groups of ``group_size`` (None: it can)."""
    if out_features % ROWS_PER_BLOCK:
        return f"{out_features} output features (the kernel takes them {ROWS_PER_BLOCK} at a time)"
    if group_size % CHUNK or in_features % group_size:
        return f"{in_features} input features in groups of {group_size} (multiples of {CHUNK})"
    return None


@dataclass(frozen=True)
class IsaChoice:
    """What orbitctl's CPU kernels may use in this process, each with why not."""

    avx512_bf16: str | None
    """Why the AVX512-BF16 kernels may not run here (None: they may)."""
    amx: str | None
    """Why many-row bf16 GEMMs do not run on AMX tiles here (None: the CPU has AMX-TILE and AMX-BF16, the kernel
    granted this process the tile data and nothing caps oneDNN below AMX)."""


def choose_isa(flags, answers: cpu_state.KernelAnswers, bf16, env) -> IsaChoice:
    """The rule: ``flags`` (/proc/cpuinfo's), the kernel's ``answers`` (XCR0, the tile-data request), the bf16
    verdict (:func:`orbitctl.kernels.cpu_dtype.host_bf16`: torch's kernel capability and the caps) and ``env`` (the
    oneDNN cap) -> what may run. A CPUID flag alone never selects an ISA."""
    from orbitctl.kernels import cpu_dtype

    missing = [flag for flag in CPU_FLAGS if flag not in flags]
    avx512 = (f"the CPU lacks {', '.join(missing)}" if missing
              else cpu_state.avx512_state_missing(flags, answers) or (None if bf16.native else bf16.reason))
    amx = cpu_state.amx_refusal(flags, answers)
    if amx is None and not bf16.native:
        amx = bf16.reason
    if amx is None and not cpu_dtype.onednn_allows(cpu_dtype.onednn_cap(env), "avx10_1_512_amx"):
        amx = f"oneDNN is capped below AMX (ONEDNN_MAX_CPU_ISA={cpu_dtype.onednn_cap(env)})"
    return IsaChoice(avx512, amx)


@functools.cache
def host_isa() -> IsaChoice:
    """:func:`choose_isa` on this machine, asked once per process: the CPU's flags, XCR0 and (where the CPU has AMX)
    the tile-data request made by this process; where AMX is not used, one log line says why."""
    from orbitctl.kernels import cpu_dtype

    info = cpu_dtype.read_host_cpu()
    flags = info.flags if info is not None else frozenset()
    answers = cpu_state.ask_kernel(request_amx=all(flag in flags for flag in cpu_state.AMX_FLAGS))
    choice = choose_isa(flags, answers, cpu_dtype.host_bf16(), os.environ)
    if choice.amx is not None:
        log.info("AMX not used for the INT4 layers' many-row GEMMs (the AVX512-BF16 thresholds hold): %s", choice.amx)
    return choice


def cpu_unsupported() -> str | None:
    """Why this process may not run the kernel on its CPU (None: it may): a missing instruction set, registers the
    OS did not enable, or a cap."""
    return host_isa().avx512_bf16


def amx_granted() -> bool:
    """Whether many-row bf16 GEMMs run on AMX tiles in this process (see :class:`IsaChoice`)."""
    return host_isa().amx is None


def _compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")


def _library_path(compiler: str) -> Path:
    from orbitctl.rundir import cache_root

    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=False).stdout
    digest = hashlib.sha256(SOURCE.read_bytes() + version.encode()).hexdigest()[:16]
    return cache_root() / "kernels" / f"bf16_cpu-{digest}.so"


def build(compiler: str | None = None) -> Path:
    """Compile the kernel into the cache (once per source and compiler) and return the library's path."""
    compiler = compiler or _compiler()
    if compiler is None:
        raise RuntimeError("no C++ compiler (g++) on PATH; set CXX")
    path = _library_path(compiler)
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    cmd = [compiler, "-O3", "-std=c++17", "-fopenmp", "-shared", "-fPIC", str(SOURCE), "-o", str(tmp)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"{' '.join(cmd[:2])} ... failed: {done.stderr.strip()[-400:]}")
    os.replace(tmp, path)  # concurrent builders (ranks) each rename a whole library into place
    return path


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    lib.orbitctl_int4_bf16_mm.restype = ctypes.c_int
    lib.orbitctl_int4_bf16_mm.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 4
    lib.orbitctl_int4_bf16_dequantize.restype = ctypes.c_int
    lib.orbitctl_int4_bf16_dequantize.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3
    lib.orbitctl_decode_attention.restype = ctypes.c_int
    lib.orbitctl_decode_attention.argtypes = (
        [ctypes.c_void_p] + [ctypes.c_int64] * 2 + ([ctypes.c_void_p] + [ctypes.c_int64] * 3) * 2
        + [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p] + [ctypes.c_int64] * 6 + [ctypes.c_float])
    return lib


def first_calls(path: str) -> None:
    """Load the library at ``path`` and call each kernel once on small inputs, raising if one reports a failure:
    what a child process runs before the first process on a machine loads it (:func:`library`)."""
    lib = _bind(ctypes.CDLL(path))
    generator = torch.Generator().manual_seed(0)
    packed = torch.randint(0, 256, (ROWS_PER_BLOCK, CHUNK // 2), generator=generator, dtype=torch.uint8)
    scales = torch.ones(ROWS_PER_BLOCK, 1)
    x = torch.randn(3, CHUNK, generator=generator).to(torch.bfloat16)
    out = torch.empty(3, ROWS_PER_BLOCK, dtype=torch.bfloat16)
    dense = torch.empty(ROWS_PER_BLOCK, CHUNK, dtype=torch.bfloat16)
    q = torch.randn(1, 1, 1, CHUNK, generator=generator).to(torch.bfloat16)
    kv = torch.randn(1, 1, 2, CHUNK, generator=generator).to(torch.bfloat16)
    attended = torch.empty(1, 1, 1, CHUNK, dtype=torch.bfloat16)
    failed = [
        lib.orbitctl_int4_bf16_mm(x.data_ptr(), packed.data_ptr(), scales.data_ptr(), out.data_ptr(), 3,
                                  ROWS_PER_BLOCK, CHUNK, CHUNK),
        lib.orbitctl_int4_bf16_dequantize(packed.data_ptr(), scales.data_ptr(), dense.data_ptr(), ROWS_PER_BLOCK,
                                          CHUNK, CHUNK),
        lib.orbitctl_decode_attention(q.data_ptr(), q.stride(0), q.stride(1), kv.data_ptr(), kv.stride(0),
                                      kv.stride(1), kv.stride(2), kv.data_ptr(), kv.stride(0), kv.stride(1),
                                      kv.stride(2), None, 0, attended.data_ptr(), 1, 1, 1, 2, CHUNK, CHUNK, 1.0)]
    if any(failed):
        raise RuntimeError(f"the kernels' first calls reported failures {failed} (int4 mm, dequantize, attention)")


def _host_key() -> str:
    """The CPU and the OS state a library's first calls were tried on: its model, flags and XCR0."""
    from orbitctl.kernels import cpu_dtype

    info = cpu_dtype.read_host_cpu()
    xcr0 = cpu_state.ask_kernel(request_amx=False).xcr0
    text = f"{info.model if info else None}|{sorted(info.flags) if info else []}|{xcr0}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def first_load_refusal(path: Path) -> str | None:
    """Why the library at ``path`` may not be loaded here (None: it may): its first calls ran in a child process
    on this machine before (a stamp beside it), or they run there now; a child that died names the signal."""
    from orbitctl.errors import OrbitError
    from orbitctl.isolated import run_isolated

    stamp = path.with_name(f"{path.name}.{_host_key()}.ok")
    if stamp.exists():
        return None
    try:
        run_isolated(first_calls, str(path), what="orbitctl's AVX512-BF16 kernels (their first calls, in a child)",
                     timeout=300)
    except OrbitError as err:  # a crash (NativeCrash: the signal and its cause), or a child that returned nothing
        return err.render()
    except Exception as err:  # noqa: BLE001 - a call that reported a failure, raised in the child
        return f"their first calls failed in a child process: {err}"
    stamp.touch()
    return None


@functools.cache
def library() -> ctypes.CDLL | None:
    """The loaded kernel, built and tried in a child on first use; None (with the reason logged once) where it cannot
    run here."""
    why = cpu_unsupported()
    if why is None:
        try:
            path = build()
            why = first_load_refusal(path)
            if why is None:
                return _bind(ctypes.CDLL(str(path)))
        except (OSError, RuntimeError) as err:
            why = f"the kernel did not build or load: {err}"
    log.info("orbitctl's AVX512-BF16 kernels not used (PyTorch's run instead): %s", why)
    return None


def available() -> bool:
    """Whether this process runs these kernels: fused INT4 layers exact in bf16 and the bf16 decode attention."""
    return library() is not None


def pack(weight_packed: torch.Tensor, weight_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A checkpoint INT4 weight (int32 words [out, in/8], scales [out, in/group]) in the kernel's layout:
    (uint8 codes [out, in/2], float32 scales [out, in/group]); see ``csrc/bf16_cpu.cpp``."""
    from orbitctl.codec.formats import unpack_int4

    out_features, words = weight_packed.shape
    in_features = words * 8
    with torch.no_grad():
        codes = unpack_int4(weight_packed, in_features).add_(8).reshape(out_features, in_features // CHUNK, 2, 16)
        packed = (codes[:, :, 0] | (codes[:, :, 1] << 4)).to(torch.uint8).reshape(out_features, in_features // 2)
    return packed.contiguous(), weight_scale.to(torch.float32).contiguous()


# the kernels as dispatcher ops (an op counter, a profiler and fake tensors see them), defined with their schemas and
# a CPU kernel each: about half the per-call cost of torch.library.custom_op's Python wrapper (12 against 19 us)
_OPS = torch.library.Library("orbitctl", "FRAGMENT")
_OPS.define("int4_bf16_mm(Tensor x, Tensor packed, Tensor scales, int group_size) -> Tensor")
_OPS.define("int4_bf16_dequantize(Tensor packed, Tensor scales, int group_size, Tensor(a!) out) -> ()")
_OPS.define("decode_attention(Tensor query, Tensor key, Tensor value, Tensor? mask, float scaling) -> Tensor")


def _mm(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, group_size: int) -> torch.Tensor:
    rows, in_features = x.shape
    out = torch.empty(rows, packed.shape[0], dtype=torch.bfloat16)
    failed = library().orbitctl_int4_bf16_mm(x.data_ptr(), packed.data_ptr(), scales.data_ptr(), out.data_ptr(),
                                            rows, packed.shape[0], in_features, group_size)
    if failed:
        raise ValueError(f"the INT4 bf16 kernel cannot take a [{packed.shape[0]}, {in_features}] weight in groups "
                         f"of {group_size}")
    return out


def _mm_fake(x, packed, scales, group_size):
    return x.new_empty(x.shape[0], packed.shape[0])


def _dequantize(packed: torch.Tensor, scales: torch.Tensor, group_size: int, out: torch.Tensor) -> None:
    rows, in_features = out.shape
    if library().orbitctl_int4_bf16_dequantize(packed.data_ptr(), scales.data_ptr(), out.data_ptr(), rows,
                                               in_features, group_size):
        raise ValueError(f"the INT4 bf16 kernel cannot take a [{rows}, {in_features}] weight in groups of {group_size}")


def dequantize_into(packed: torch.Tensor, scales: torch.Tensor, group_size: int, out: torch.Tensor) -> torch.Tensor:
    """The dense weight, written into ``out`` (contiguous bf16 [out, in]): every value exactly
    :func:`~orbitctl.codec.formats.dequantize_int4`'s, in one pass (a table lookup per 32 weights) where the
    float32 route makes five over int32 and float32 copies. Only where :func:`available`.

    Numerics: int4 codes and scales exact in bf16 in, bf16 out, no sum: ``(code - 8) x scale`` is exact in bf16, so
    it equals :func:`~orbitctl.codec.formats.dequantize_int4` in bf16 bit for bit."""
    if out.dtype != torch.bfloat16 or not out.is_contiguous():
        raise ValueError("dequantize_into writes a contiguous bf16 tensor")
    torch.ops.orbitctl.int4_bf16_dequantize(packed, scales, group_size, out)
    return out


def matmul(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, group_size: int) -> torch.Tensor:
    """x W^T for bf16 x [M, in] (made contiguous): [M, out] bf16. Only where :func:`available`.

    Numerics: bf16 x times weights exact in bf16 (:func:`pack` takes only scales exact in bf16), each product exact in
    float32, accumulated in float32, rounded once to bf16. Rows independent: an output row is the same bits whatever
    the rows beside it (M = 1 or 600). Equals the exact sum ``x.double() @ dequantize_int4(...).double().T`` within
    one bf16 rounding and float32 accumulation; PyTorch's ``_weight_int4pack_mm_for_cpu`` sums the same products
    in another order (at most a bf16 step apart)."""
    return torch.ops.orbitctl.int4_bf16_mm(x.to(torch.bfloat16).contiguous(), packed, scales, group_size)


def _attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
            scaling: float) -> torch.Tensor:
    batch, heads, _, dim = query.shape
    kv_heads, length, dim_v = key.shape[1], key.shape[2], value.shape[-1]
    out = torch.empty(batch, heads, 1, dim_v, dtype=torch.bfloat16)
    failed = library().orbitctl_decode_attention(
        query.data_ptr(), query.stride(0), query.stride(1), key.data_ptr(), key.stride(0), key.stride(1),
        key.stride(2), value.data_ptr(), value.stride(0), value.stride(1), value.stride(2),
        mask.data_ptr() if mask is not None else None, mask.stride(0) if mask is not None else 0, out.data_ptr(),
        batch, heads, kv_heads, length, dim, dim_v, scaling)
    if failed:
        raise ValueError(f"the decode attention kernel cannot take heads {heads}/{kv_heads} of {dim}/{dim_v}")
    return out


def _attend_fake(query, key, value, mask, scaling):
    return query.new_empty(*query.shape[:3], value.shape[-1])


for _name, _kernel in (("int4_bf16_mm", _mm), ("int4_bf16_dequantize", _dequantize), ("decode_attention", _attend)):
    _OPS.impl(_name, _kernel, "CPU")
torch.library.register_fake("orbitctl::int4_bf16_mm", _mm_fake, lib=_OPS)
torch.library.register_fake("orbitctl::decode_attention", _attend_fake, lib=_OPS)


def decode_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
                     scaling: float) -> torch.Tensor | None:
    """:func:`orbitctl.kernels.decode_attention.decode_attention` for bf16 tensors on a CPU where :func:`available`,
    reading the cache's strided views in place (no float32 copy of K and V); None where it does not apply (the
    caller's torch path then runs): other dtypes, head sizes not a multiple of 32 (values: 16, at most 128), a
    mask per head.

    Numerics: bf16 Q, K, V; scores summed in float32 from exact products, the masked softmax in float32, the
    exponentials rounded to bf16 for the product with V, accumulated in float32, one rounding to bf16. Each (row,
    head) independent of the others. Equals the torch path of
    :func:`orbitctl.kernels.decode_attention.decode_attention` but for the order of the float32 sums and the
    vectorised exponential."""
    batch, heads, positions, dim = query.shape
    dim_v = value.shape[-1]
    if (positions != 1 or not available() or dim % CHUNK or dim_v % 16 or dim_v > 128
            or any(t.dtype != torch.bfloat16 or t.stride(-1) != 1 for t in (query, key, value))):
        return None
    additive = None
    if mask is not None:
        if mask.dim() != 4 or mask.shape[1] != 1 or mask.shape[2] != 1:
            return None
        rows = mask[:, 0, 0, :]
        additive = (torch.zeros(rows.shape, dtype=torch.float32).masked_fill_(~rows, float("-inf"))
                    if rows.dtype == torch.bool else rows.to(torch.float32))
        additive = additive.expand(batch, key.shape[2]).contiguous()
    return torch.ops.orbitctl.decode_attention(query, key, value, additive, float(scaling))
