"""What the OS lets a process run on its CPU: the register states the kernel enabled (XCR0) and AMX's tile data.

    from orbitctl.kernels import cpu_state
    answers = cpu_state.ask_kernel(request_amx=True)     # this process asks (x86-64 Linux; elsewhere: no answers)
    cpu_state.avx512_state_missing(flags, answers)       # None, or why the AVX-512 registers may not be used
    cpu_state.amx_refusal(flags, answers)                # None where this process may run AMX tile instructions

An instruction runs only when the CPU has it *and* the OS saves the registers it uses: the OS enables each register
state in XCR0 (the extended control register the ``xgetbv`` instruction reads), and Linux (5.16+) also makes every
process ask for AMX's tile data before its first tile instruction (``arch_prctl(ARCH_REQ_XCOMP_PERM,
XFEATURE_XTILEDATA)``). Either missing, the instruction raises SIGILL exactly like one the CPU lacks.

How XCR0 is read. Python has no ``xgetbv``; running one needs a C compiler or machine code mapped executable by hand
(refused under W^X policies), and ``xgetbv`` itself raises SIGILL where the OS left OSXSAVE off. The kernel answers
the same question without either: ``arch_prctl(ARCH_GET_XCOMP_SUPP)`` returns the user state components it enabled,
which is the XCR0 it wrote (``fpu__init_cpu_xstate`` does ``xsetbv(XCR0, fpu_user_cfg.max_features)``; the same mask
is what this call reports). It reads and changes nothing. Kernels before 5.16 answer EINVAL; there what
/proc/cpuinfo lists stands in: Linux clears ``avx512f`` and its family when XCR0 lacks the opmask/ZMM states, so a
listed ``avx512f`` means the state is enabled. Linux keeps the ``amx`` flags on those kernels, which have no way to
grant the tile data, so AMX is decided by the permission request alone.

The AMX request changes the process that makes it (its signal frames grow by the tile state; oneDNN makes the same
request before its first AMX kernel). Run as a script, ``python -I -S cpu_state.py``, this module asks in that
process and prints the answers as one JSON object: how ``orbitctl doctor`` reads them without changing its own
process. Standard library only.
"""

from __future__ import annotations

import errno
import json
import platform
import sys
from dataclasses import asdict, dataclass

ARCH_GET_XCOMP_SUPP, ARCH_GET_XCOMP_PERM, ARCH_REQ_XCOMP_PERM = 0x1021, 0x1022, 0x1023
XFEATURE_XTILEDATA = 18
SYS_ARCH_PRCTL_X86_64 = 158

# XCR0 bits: 1 SSE, 2 AVX (YMM upper halves), 5 opmask, 6 ZMM_Hi256, 7 Hi16_ZMM, 17 XTILECFG, 18 XTILEDATA
XCR0_AVX = (1 << 1) | (1 << 2)
XCR0_AVX512 = XCR0_AVX | (1 << 5) | (1 << 6) | (1 << 7)
XCR0_AMX = (1 << 17) | (1 << 18)
STATE = {"avx": (XCR0_AVX, "the YMM state"), "avx512": (XCR0_AVX512, "the opmask and ZMM states"),
         "amx": (XCR0_AMX, "the XTILECFG and XTILEDATA states")}
AMX_FLAGS = ("amx_tile", "amx_bf16")
"""What a bf16 GEMM on AMX tiles needs, as /proc/cpuinfo spells it."""
AMX_ERRNO = {
    "EINVAL": "this kernel has no AMX permission call (Linux before 5.16)",
    "EOPNOTSUPP": "the kernel did not enable the tile state (no AMX, a kernel built without it, or a hypervisor "
                  "that hides it)",
    "ENOSPC": "the process's alternate signal stack (sigaltstack) is too small for the tile state",
    "EPERM": "the call is not allowed here (a seccomp filter)",
    "ENOSYS": "arch_prctl is blocked here (a seccomp filter)",
}
"""What each errno of the tile-data request means."""


@dataclass(frozen=True)
class KernelAnswers:
    """What the kernel answered one process (every field None: not asked, as off x86-64 Linux)."""

    xcr0: int | None = None
    """ARCH_GET_XCOMP_SUPP: the user state components the kernel enabled in XCR0."""
    xcr0_errno: int | None = None
    """errno of ARCH_GET_XCOMP_SUPP (EINVAL: a kernel before 5.16, which has no such call)."""
    amx_request_errno: int | None = None
    """ARCH_REQ_XCOMP_PERM(XFEATURE_XTILEDATA): 0 granted, else its errno; None: not asked."""
    amx_permitted: bool | None = None
    """ARCH_GET_XCOMP_PERM read back after the request has XTILEDATA (bit 18)."""


def on_x86_64_linux() -> bool:
    """Whether this process can ask (arch_prctl is x86-64 Linux's)."""
    return sys.platform.startswith("linux") and platform.machine().lower() in ("x86_64", "amd64")


def errno_name(code: int | None) -> str:
    """The errno's name as the kernel's arch_prctl code says it (95 is EOPNOTSUPP there; Python's table says ENOTSUP)."""
    if code is not None and code == getattr(errno, "EOPNOTSUPP", None):
        return "EOPNOTSUPP"
    return errno.errorcode.get(code or 0, str(code))


def ask_kernel(request_amx: bool) -> KernelAnswers:
    """Ask the kernel for XCR0 and, with ``request_amx``, for AMX's tile data, in this process (which the granted
    request changes: see the module's docstring)."""
    if not on_x86_64_linux():
        return KernelAnswers()
    import ctypes

    syscall = ctypes.CDLL(None, use_errno=True).syscall
    syscall.restype = ctypes.c_long

    def call(op: int, arg) -> int:
        ctypes.set_errno(0)
        rc = syscall(ctypes.c_long(SYS_ARCH_PRCTL_X86_64), ctypes.c_long(op), arg)
        return 0 if rc == 0 else (ctypes.get_errno() or -1)

    def read(op: int) -> tuple[int | None, int]:
        value = ctypes.c_uint64(0)
        err = call(op, ctypes.byref(value))
        return (value.value if err == 0 else None), err

    xcr0, err = read(ARCH_GET_XCOMP_SUPP)
    if not request_amx:
        return KernelAnswers(xcr0, err or None)
    requested = call(ARCH_REQ_XCOMP_PERM, ctypes.c_long(XFEATURE_XTILEDATA))
    permission, _ = read(ARCH_GET_XCOMP_PERM)
    return KernelAnswers(xcr0, err or None, requested,
                         None if permission is None else bool(permission >> XFEATURE_XTILEDATA & 1))


def avx512_state_missing(flags, answers: KernelAnswers) -> str | None:
    """Why the OS does not let a process use the AVX-512 registers (None: it does): XCR0 lacks the opmask and ZMM
    states, or, where XCR0 was not answered, /proc/cpuinfo's ``flags`` do not list avx512f."""
    bits, state = STATE["avx512"]
    if answers.xcr0 is not None:
        if answers.xcr0 & bits == bits:
            return None
        return f"the OS did not enable the AVX-512 registers (XCR0 {answers.xcr0:#x} lacks {state})"
    if "avx512f" in flags:  # Linux lists it only while XCR0 holds the state
        return None
    return "the OS did not enable the AVX-512 registers (/proc/cpuinfo does not list avx512f)"


def amx_request_refusal(answers: KernelAnswers) -> str | None:
    """Why the tile-data request did not grant AMX (None: granted)."""
    err = answers.amx_request_errno
    if err is None:
        return "the tile-data permission was not asked (arch_prctl is x86-64 Linux only)"
    if err:
        name = errno_name(err)
        why = AMX_ERRNO.get(name)
        return f"arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) failed: errno {err} ({name})" + \
            (f": {why}" if why else "")
    if answers.amx_permitted is False:
        return "the tile-data request returned 0 but ARCH_GET_XCOMP_PERM lacks XTILEDATA"
    return None


def amx_refusal(flags, answers: KernelAnswers) -> str | None:
    """Why a process may not run bf16 AMX tile instructions (None: the CPU has AMX-TILE and AMX-BF16 and the kernel
    granted the tile data to the process that asked)."""
    missing = [flag for flag in AMX_FLAGS if flag not in flags]
    if missing:
        return f"the CPU lacks {', '.join(missing)}"
    return amx_request_refusal(answers)


if __name__ == "__main__":  # the doctor's child: ask here, print the answers
    print(json.dumps(asdict(ask_kernel(request_amx=True))))
