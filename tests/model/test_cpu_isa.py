"""orbitctl's CPU kernels ask the OS, not only CPUID (issue 42): which ISA each path runs on, from stubbed answers.

Stubbed: the CPU's flags (/proc/cpuinfo), the kernel's answers (XCR0, the AMX tile-data request) and torch's
CPUID-derived kernel capability, so a Sapphire Rapids with and without the tile permission, and a CPU whose OS left
the AVX-512 state off, can be played on any machine. Everything else is real: the layers below run this machine's
kernels and GEMMs (bf16 arithmetic emulated where the CPU has none: small shapes).
"""

from __future__ import annotations

import errno
import logging

import pytest
import torch

from orbitctl.codec.formats import pack_int4, quantize_int4
from orbitctl.kernels import bf16_cpu, cpu_dtype, cpu_state
from orbitctl.model import quant_linear
from orbitctl.kernels.cpu_state import KernelAnswers
from orbitctl.kernels.int4_kernel import ran_kernel
from orbitctl.model.quant_linear import QuantLinear
from orbitctl.rl.steptime import dispatched_ops

pytestmark = pytest.mark.skipif(not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"),
                                reason="this torch has no CPU INT4 kernel")

AVX512 = frozenset({"avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16",
                    "avx512_vnni"})
SPR = AVX512 | {"avx512_fp16", "amx_tile", "amx_bf16", "amx_int8"}
"""A Sapphire Rapids Xeon's flags (the issue's machine)."""
XCR0_SPR, XCR0_ZEN4, XCR0_NO_AVX512 = 0x602E7, 0x2E7, 0x207
"""XCR0 with the tile states, without them (an AMD Zen 4), and with AVX's YMM state only."""
GRANTED, EOPNOTSUPP, EINVAL = 0, errno.EOPNOTSUPP, errno.EINVAL


@pytest.fixture
def host(monkeypatch):
    """``host(flags, xcr0, amx_errno)``: this process's :func:`bf16_cpu.host_isa` as a CPU with ``flags`` whose
    kernel answers XCR0 ``xcr0`` (None: a kernel before 5.16) and the tile-data request ``amx_errno`` (0: granted).
    ``host.requests`` records whether each question asked for AMX."""
    bf16_cpu.available()  # the library is loaded (or not) on this machine's real answers, before any stub
    # the played machine's kernels are capped by nothing (a test of the caps sets them itself): the suite's run under
    # ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 plays the same machines
    for cap in cpu_dtype.CAP_ENV:
        monkeypatch.delenv(cap, raising=False)

    def play(flags, xcr0=XCR0_SPR, amx_errno=GRANTED):
        def ask_kernel(request_amx):
            play.requests.append(request_amx)
            answers = KernelAnswers(xcr0, None if xcr0 is not None else EINVAL)
            return KernelAnswers(answers.xcr0, answers.xcr0_errno, amx_errno, amx_errno == GRANTED) \
                if request_amx else answers

        monkeypatch.setattr(cpu_state, "ask_kernel", ask_kernel)
        monkeypatch.setattr(cpu_dtype, "read_host_cpu", lambda path="/proc/cpuinfo": cpu_dtype.CpuInfo(
            "stub", frozenset(flags), "x86_64"))
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
        cpu_dtype.host_bf16.cache_clear()
        bf16_cpu.host_isa.cache_clear()
        return bf16_cpu.host_isa()

    play.requests = []
    yield play
    cpu_dtype.host_bf16.cache_clear()  # the next caller asks this machine again
    bf16_cpu.host_isa.cache_clear()


def _layer(out_f: int = 64, in_f: int = 128) -> QuantLinear:
    w = torch.randn(out_f, in_f, generator=torch.Generator().manual_seed(0)) * 0.05
    codes, scale = quantize_int4(w, 32)  # scales of 5 significant bits: every weight exact in bf16
    layer = QuantLinear(in_f, out_f, "int4", group_size=32)
    layer.weight_packed.data, layer.weight_scale.data = pack_int4(codes), scale
    layer.use_fused_kernel()
    assert layer.exact_in_bf16
    return layer


def _paths(layer: QuantLinear) -> dict[str, bool]:
    """Which inputs went through the dequantized GEMM (True) rather than the INT4 kernel (False)."""
    g = torch.Generator().manual_seed(1)
    inputs = {"64 expert rows": torch.randn(64, 128, generator=g), "63 expert rows": torch.randn(63, 128, generator=g),
              "256 expert rows": torch.randn(256, 128, generator=g),
              "prefill, 2 x 5 positions": torch.randn(2, 5, 128, generator=g),
              "decode, 32 x 1 position": torch.randn(32, 1, 128, generator=g)}
    paths = {}
    with torch.no_grad():
        for name, x in inputs.items():
            ops = dispatched_ops(torch, lambda: layer(x))
            assert ran_kernel(ops) != (ops.get("mm", 0) == 1), (name, ops)  # one or the other, never both
            paths[name] = not ran_kernel(ops)
    return paths


AVX512_PATHS = {"64 expert rows": False, "63 expert rows": False, "256 expert rows": True,
                "prefill, 2 x 5 positions": True, "decode, 32 x 1 position": False}
AMX_PATHS = {**AVX512_PATHS, "64 expert rows": True}


@pytest.mark.parametrize("flags, amx_errno, refusal", [
    (SPR, EOPNOTSUPP, "errno 95 (EOPNOTSUPP): the kernel did not enable the tile state"),
    (SPR, EINVAL, "errno 22 (EINVAL): this kernel has no AMX permission call (Linux before 5.16)"),
    (AVX512, GRANTED, "the CPU lacks amx_tile, amx_bf16"),
    (SPR - {"amx_bf16"}, GRANTED, "the CPU lacks amx_bf16"),
    (SPR - {"amx_tile"}, GRANTED, "the CPU lacks amx_tile"),
])
def test_amx_is_never_used_without_both_the_cpu_flags_and_the_kernels_grant(host, caplog, flags, amx_errno, refusal):
    with caplog.at_level(logging.INFO, logger="orbitctl.kernels.bf16_cpu"):
        choice = host(flags, amx_errno=amx_errno)
    assert choice.amx is not None and refusal in choice.amx, choice
    # the CPU without the flags is never asked (the request would change this process for nothing)
    assert host.requests == [all(flag in flags for flag in ("amx_tile", "amx_bf16"))]
    lines = [r.getMessage() for r in caplog.records if "AMX not used" in r.getMessage()]
    assert len(lines) == 1 and refusal in lines[0], lines  # the fallback says why, once
    assert not bf16_cpu.amx_granted() and quant_linear.dense_rows() == quant_linear.DENSE_ROWS
    assert _paths(_layer()) == AVX512_PATHS


def test_amx_is_used_where_the_cpu_has_it_and_the_kernel_grants_the_tile_data(host):
    choice = host(SPR, amx_errno=GRANTED)
    assert choice.amx is None and host.requests == [True]
    assert bf16_cpu.amx_granted() and quant_linear.dense_rows() == quant_linear.DENSE_ROWS_AMX
    # the many-row GEMM from fewer expert rows; whole sequences as before; a decode step keeps the kernel
    assert _paths(_layer()) == AMX_PATHS


def test_amx_granted_but_capped_or_without_native_bf16_is_not_used(host, monkeypatch):
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")
    assert "capped below AMX" in host(SPR).amx
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    cpu_dtype.host_bf16.cache_clear()
    bf16_cpu.host_isa.cache_clear()
    choice = bf16_cpu.host_isa()
    assert "ATEN_CPU_CAPABILITY=avx2" in choice.amx and "ATEN_CPU_CAPABILITY=avx2" in choice.avx512_bf16


@pytest.mark.parametrize("flags", [SPR, AVX512])
def test_the_avx512_kernels_are_refused_where_xcr0_lacks_the_avx512_state_whatever_cpuid_says(host, flags):
    choice = host(flags, xcr0=XCR0_NO_AVX512, amx_errno=EOPNOTSUPP)
    assert choice.avx512_bf16 == "the OS did not enable the AVX-512 registers (XCR0 0x207 lacks the opmask and ZMM states)"
    assert bf16_cpu.cpu_unsupported() == choice.avx512_bf16
    bf16_cpu.library.cache_clear()  # the loader itself, asked under these answers, refuses before loading anything
    try:
        assert bf16_cpu.library() is None and not bf16_cpu.available()
    finally:
        bf16_cpu.library.cache_clear()
    # the same flags with the state enabled: allowed; a kernel before 5.16 (no XCR0 answer) goes by /proc/cpuinfo,
    # where Linux lists avx512f only while XCR0 holds its state
    assert host(flags, xcr0=XCR0_ZEN4, amx_errno=EOPNOTSUPP).avx512_bf16 is None
    assert host(flags, xcr0=None, amx_errno=EINVAL).avx512_bf16 is None
    assert "does not list avx512f" in cpu_state.avx512_state_missing(flags - {"avx512f"}, KernelAnswers())


def test_this_machine_is_asked_for_real_and_its_answers_are_consistent():
    """Unstubbed: XCR0 read in this process (it reads and changes nothing), the AMX request only where the CPU
    lists AMX, and the choice follows from what was read."""
    info = cpu_dtype.read_host_cpu()
    if not cpu_state.on_x86_64_linux() or info is None:
        pytest.skip("arch_prctl is x86-64 Linux only")
    answers = cpu_state.ask_kernel(request_amx=False)
    assert answers.amx_request_errno is None  # not asked
    if answers.xcr0 is not None and "avx512f" in info.flags:
        assert answers.xcr0 & cpu_state.XCR0_AVX512 == cpu_state.XCR0_AVX512  # Linux lists it only then
    choice = bf16_cpu.host_isa()
    if not all(flag in info.flags for flag in cpu_state.AMX_FLAGS):
        assert choice.amx.startswith("the CPU lacks")
    assert (choice.avx512_bf16 is None) == (bf16_cpu.cpu_unsupported() is None)
