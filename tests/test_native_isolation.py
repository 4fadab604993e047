"""Native code cannot take the test process down, and the llama.cpp `make setup` builds stays on its baseline (issue 42).

A llama.cpp wheel built with GGML_NATIVE on a Sapphire Rapids ran AMX tile instructions (``tilezero %tmm4``) on a
machine whose kernel had not granted the tile state: SIGILL, pytest dead, the 400-odd tests after it never run.
Two guards, both checked here:

* the build: the Makefile builds llama-cpp-python with GGML_NATIVE=OFF for x86-64 + AVX2, FMA, F16C. The installed
  libraries are disassembled (``objdump -d``, binutils, which any machine that compiled llama.cpp has) and must
  hold no AMX, no AVX-512 (EVEX encodings, %zmm, %k masks), no AVX-VNNI, no BMI2, and do hold AVX2/FMA/F16C code;
  the classifier is checked on known encodings first, so a count of 0 means something;
* the isolation: llama.cpp runs in a child (``orbitctl.isolated.run_isolated``), so a crash is one failed
  call with the signal and its cause. A child that executes a real illegal instruction (``ud2`` written into an
  executable page and called) proves it: SIGILL, the cause line, and this process goes on.
"""

from __future__ import annotations

import importlib.util
import os
import platform
import signal
from pathlib import Path

import pytest

from orbitctl.isolated import NativeCrash, run_isolated

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("llama_cpp_check", ROOT / "benchmarks" / "llama_cpp_check.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)

X86 = platform.machine().lower() in ("x86_64", "amd64")
UD2 = {"x86_64": b"\x0f\x0b", "amd64": b"\x0f\x0b", "aarch64": b"\x00\x00\x00\x00", "arm64": b"\x00\x00\x00\x00"}


def execute_illegal_instruction() -> None:
    """What a build for another CPU does: the CPU meets an instruction it refuses (ud2 / udf #0) and raises SIGILL."""
    import ctypes
    import mmap

    code = UD2.get(platform.machine().lower())
    if code is None:  # an architecture without a known undefined instruction here: the signal the CPU would send
        os.kill(os.getpid(), signal.SIGILL)
        return
    page = mmap.mmap(-1, mmap.PAGESIZE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    page.write(code)
    address = ctypes.addressof(ctypes.c_char.from_buffer(page))
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    if libc.mprotect(address, mmap.PAGESIZE, mmap.PROT_READ | mmap.PROT_EXEC) != 0:  # W^X: write, then execute
        raise OSError(ctypes.get_errno(), "mprotect PROT_EXEC refused")
    ctypes.CFUNCTYPE(None)(address)()


def add(a: int, b: int) -> int:
    return a + b


def raise_value_error(text: str) -> None:
    raise ValueError(text)


def sleep_long() -> None:
    import time

    time.sleep(60)


def test_an_illegal_instruction_kills_the_child_only_with_sigill_and_its_cause():
    from orbitctl.export.llamacpp import SIGILL_FIX

    with pytest.raises(NativeCrash) as info:
        run_isolated(execute_illegal_instruction, what="llama.cpp", timeout=120, sigill_fix=SIGILL_FIX)
    crash = info.value
    assert crash.signum == signal.SIGILL and crash.signame == "SIGILL"
    line = crash.render()
    assert "\n" not in line, line
    assert line.startswith("llama.cpp died with SIGILL (illegal instruction): a native build for another CPU"), line
    assert "make setup" in line and crash.exit_code == 2  # exit 2 as bad input: the fix (a rebuild) is the user's
    assert "execute_illegal_instruction" in crash.stderr_tail  # faulthandler's stack of the child, kept for debugging
    assert run_isolated(add, 2, b=3) == 5  # and this process lives on, still able to start children


def test_a_childs_exception_comes_back_as_itself():
    with pytest.raises(ValueError, match="bad model file") as info:
        run_isolated(raise_value_error, "bad model file")
    assert "raise_value_error" in info.value.child_traceback


def test_a_child_past_its_timeout_is_killed():
    with pytest.raises(NativeCrash, match=r"llama.cpp did not finish in 1 s and was killed") as info:
        run_isolated(sleep_long, what="llama.cpp", timeout=1)
    assert info.value.signum is None and info.value.exit_code == 1


def test_other_signals_name_themselves_and_exit_1():
    crash = NativeCrash("llama.cpp", signal.SIGSEGV)
    assert crash.render().startswith("llama.cpp died with SIGSEGV (segmentation fault): ") and crash.exit_code == 1
    abort = NativeCrash("llama.cpp", signal.SIGABRT, stderr_tail="ggml.c:1234: GGML_ASSERT(x) failed\n")
    assert "GGML_ASSERT(x) failed" in abort.render()


# known encodings, as objdump 2.40 prints them: each class the ISA check counts must be seen where it is
@pytest.mark.parametrize("raw, insn, classes", [
    ("62 f1 7c 48 10 00", "vmovups (%rax),%zmm0", {"avx512_evex", "avx512_zmm"}),
    ("62 f1 7c 29 10 00", "vmovups (%rax),%ymm0{%k1}", {"avx512_evex", "avx512_mask"}),
    ("62 f2 75 28 50 c2", "vpdpbusd %ymm2,%ymm1,%ymm0", {"avx512_evex"}),  # AVX512-VNNI on ymm: only the bytes say so
    ("c5 f8 90 c8", "kmovw  %k0,%k1", {"avx512_mask"}),
    ("c4 e2 7b 49 c0", "tilezero %tmm0", {"amx"}),
    ("c4 e2 78 49 00", "ldtilecfg (%rax)", {"amx"}),
    ("c4 e2 7b 4b 24 08", "tileloadd (%rax,%rcx,1),%tmm4", {"amx"}),
    ("c4 e2 72 5c c2", "tdpbf16ps %tmm1,%tmm2,%tmm0", {"amx"}),
    ("c4 e2 75 50 c2", "{vex} vpdpbusd %ymm2,%ymm1,%ymm0", {"avx_vnni", "avx2_ymm"}),
    ("c4 e2 73 f5 c0", "pdep   %eax,%ecx,%eax", {"bmi2"}),
    ("c4 e2 75 a8 c2", "vfmadd213ps %ymm2,%ymm1,%ymm0", {"fma", "avx2_ymm"}),
    ("c4 e2 7d 13 00", "vcvtph2ps (%rax),%ymm0", {"f16c", "avx2_ymm"}),
    ("c5 fd fe c1", "vpaddd %ymm1,%ymm0,%ymm0", {"avx2_ymm"}),
    ("66 0f 38 00 c1", "pshufb %xmm1,%xmm0", set()),
    ("f0 48 0f b1 0a", "lock cmpxchg %rcx,(%rdx)", set()),
])
def test_the_isa_classifier_sees_each_class(raw, insn, classes):
    assert bench.classify(raw, insn) == classes


LIB_DIR = bench.llama_cpp_lib_dir()


@pytest.mark.skipif(LIB_DIR is None, reason="llama-cpp-python is not installed (`make setup` builds it)")
@pytest.mark.skipif(not X86, reason="the baseline checked is x86-64's")
def test_the_installed_llama_cpp_holds_no_instruction_beyond_the_baseline():
    result = bench.scan(LIB_DIR)
    cpu = [name for name in result["libraries"] if name.startswith("libggml-cpu")]
    assert cpu, f"no libggml-cpu*.so under {LIB_DIR}: {sorted(result['libraries'])}"
    # no function is excused: GGML_NATIVE=OFF without GGML_CPU_ALL_VARIANTS has no run-time-dispatched code
    assert bench.DISPATCHED == {}
    assert result["forbidden"] == {}, (
        f"llama.cpp under {LIB_DIR} is a native build (rebuild: rm -f .venv/.llama-cpp-*; make setup): "
        f"{ {lib: dict(list(fns.items())[:5]) for lib, fns in result['forbidden'].items()} }")
    assert all(result["total"][cls] == 0 for cls in bench.BEYOND), result["total"]
    counts = result["libraries"][cpu[0]]["counts"]
    # built for the baseline, not for plain x86-64: the AVX2, FMA and F16C kernels are there
    assert counts["avx2_ymm"] > 0 and counts["fma"] > 0 and counts["f16c"] > 0, counts


def test_the_makefile_builds_the_version_pyproject_pins_with_native_off():
    import re

    makefile = (ROOT / "Makefile").read_text()
    pinned = re.search(r'^llama = \["llama-cpp-python==([\w.]+)"\]', (ROOT / "pyproject.toml").read_text(), re.M)
    built = re.search(r"^LLAMA_CPP_VERSION\s*:=\s*(\S+)", makefile, re.M)
    assert pinned and built and pinned[1] == built[1], (pinned, built)
    args = re.search(r"^LLAMA_CPP_CMAKE_ARGS\s*:=(.*?)(?<!\\)\n", makefile, re.M | re.S)[1]
    for flag in ("GGML_NATIVE=OFF", "GGML_AVX2=ON", "GGML_FMA=ON", "GGML_F16C=ON", "GGML_AVX512=OFF",
                 "GGML_AMX_TILE=OFF", "GGML_AMX_INT8=OFF", "GGML_AMX_BF16=OFF", "GGML_CPU_ALL_VARIANTS=OFF"):
        assert f"-D{flag}" in args, flag
    assert "--no-cache-dir" in makefile and "--no-index --find-links" in makefile  # pip's cache never serves it


# orbitctl's own compiled CPU kernels: their first calls on a machine run in a child (orbitctl.kernels.bf16_cpu)
TRAPPING_KERNELS = """
#include <cstdint>
extern "C" {
int orbitctl_int4_bf16_mm(const void*, const void*, const void*, void*, int64_t, int64_t, int64_t, int64_t) {
    __builtin_trap();  // ud2 on x86-64: what an instruction the CPU or the OS refuses does
}
int orbitctl_int4_bf16_dequantize(const void*, const void*, void*, int64_t, int64_t, int64_t) { return 0; }
int orbitctl_decode_attention(...) { return 0; }
}
"""


@pytest.mark.skipif(not X86, reason="__builtin_trap is ud2 (SIGILL) on x86-64")
def test_a_kernel_library_that_dies_on_its_first_call_is_refused_with_the_signal_and_never_loaded_here(tmp_path):
    import shutil
    import subprocess

    from orbitctl.kernels import bf16_cpu

    compiler = shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        pytest.skip("no C++ compiler")
    source, library = tmp_path / "trap.cpp", tmp_path / "bf16_cpu-trap.so"
    source.write_text(TRAPPING_KERNELS)
    subprocess.run([compiler, "-shared", "-fPIC", str(source), "-o", str(library)], check=True)
    why = bf16_cpu.first_load_refusal(library)
    assert why is not None and why.startswith("orbitctl's AVX512-BF16 kernels (their first calls, in a child) died "
                                              "with SIGILL (illegal instruction): "), why
    assert "\n" not in why
    assert not list(tmp_path.glob("*.ok"))  # no stamp: the next process tries again rather than loading it
    assert run_isolated(add, 1, b=1) == 2  # this process lives on


def test_orbitctls_cpu_kernels_first_calls_ran_in_a_child_on_this_machine():
    """Where the kernels run here, their first calls passed in a child (a crash would be this test's failure: the
    signal and its cause), and the stamp beside the library spares every later process that child."""
    from orbitctl.kernels import bf16_cpu

    why = bf16_cpu.cpu_unsupported()
    if why is not None:
        pytest.skip(f"orbitctl's AVX512-BF16 kernels do not run here: {why}")
    path = bf16_cpu.build()
    assert bf16_cpu.first_load_refusal(path) is None
    assert list(path.parent.glob(f"{path.name}.*.ok"))
    assert bf16_cpu.available()
