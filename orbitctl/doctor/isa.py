"""The CPU's ISA features and the OS state of their registers: the `isa` table of `orbitctl doctor`.

An instruction runs only when the CPU has it *and* the OS saves the registers it uses: the OS enables
each register state in XCR0 (the extended control register the ``xgetbv`` instruction reads), and
Linux (5.16+) also makes every process ask for AMX's tile data before its first tile instruction
(``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)``). Either missing, the instruction raises
SIGILL exactly like one the CPU lacks, which is why a crash log's "Illegal instruction" is read next
to this table (log.host.sigill).

How the OS state is read. Python has no ``xgetbv``, and running one needs a C compiler on the node
(often absent on GPU nodes) or machine code mapped executable by hand (refused under W^X and SELinux
``execmem`` policies, and itself SIGILL where the OS left OSXSAVE off). The kernel answers the same
question without either: ``arch_prctl(ARCH_GET_XCOMP_SUPP)`` returns the user state components it
enabled, which is the XCR0 it wrote (``fpu__init_cpu_xstate`` does ``xsetbv(XCR0,
fpu_user_cfg.max_features)``; the same mask is what this call reports). That is reliable wherever it
exists (x86-64 Linux 5.16+) and is what the table uses. Older kernels answer EINVAL; there the table
falls back to what /proc/cpuinfo already implies: Linux clears ``avx`` and everything that depends on
it (avx2, fma, the avx512 family) when XCR0 lacks the YMM state, and ``avx512f`` with its family when
XCR0 lacks the opmask/ZMM states, so a listed flag means its state is enabled. It does not do so for
AMX on those kernels (the amx flags stay listed with no way to get permission), so AMX is decided by
the permission request alone. Every arch_prctl call runs in a child interpreter: a granted request
changes the process that made it, and the doctor's own process must stay as it was.
"""

from __future__ import annotations

import errno
import json
import platform
import subprocess
import sys
from dataclasses import asdict, dataclass

from orbitctl.doctor.snapshot import Isa, XState

ISA_FEATURES = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni", "avx512_fp16",
                "amx_tile", "amx_bf16", "amx_int8")
"""The rows of the table, in /proc/cpuinfo's names."""
TRACKED_FLAGS = ISA_FEATURES + ("avx",)
"""What the snapshot keeps of /proc/cpuinfo's flags: the rows, and avx (whose presence implies the YMM state)."""

ARCH_GET_XCOMP_SUPP, ARCH_GET_XCOMP_PERM, ARCH_REQ_XCOMP_PERM = 0x1021, 0x1022, 0x1023
XFEATURE_XTILEDATA = 18
SYS_ARCH_PRCTL_X86_64 = 158

# XCR0 bits: 1 SSE, 2 AVX (YMM upper halves), 5 opmask, 6 ZMM_Hi256, 7 Hi16_ZMM, 17 XTILECFG, 18 XTILEDATA
XCR0_AVX = (1 << 1) | (1 << 2)
XCR0_AVX512 = XCR0_AVX | (1 << 5) | (1 << 6) | (1 << 7)
XCR0_AMX = (1 << 17) | (1 << 18)
STATE = {"avx": (XCR0_AVX, "the YMM state"), "avx512": (XCR0_AVX512, "the opmask and ZMM states"),
         "amx": (XCR0_AMX, "the XTILECFG and XTILEDATA states")}
IMPLIED_BY = {"avx": "avx", "avx512": "avx512f"}
"""The /proc/cpuinfo flag Linux lists only when XCR0 holds the state (the fallback without ARCH_GET_XCOMP_SUPP)."""

ENABLED, GRANTED, REFUSED, DISABLED, UNKNOWN_STATE, NOT_APPLICABLE = (
    "enabled", "granted on request", "refused", "disabled", "unknown", "-")
AMX_ERRNO = {
    "EINVAL": "this kernel has no AMX permission call (Linux before 5.16)",
    "EOPNOTSUPP": "the kernel did not enable the tile state (no AMX, a kernel built without it, or a hypervisor "
                  "that hides it)",
    "ENOSPC": "the process's alternate signal stack (sigaltstack) is too small for the tile state",
    "EPERM": "the call is not allowed here (a seccomp filter)",
    "ENOSYS": "arch_prctl is blocked here (a seccomp filter)",
}

# Runs in a child interpreter (-I -S: nothing but the standard library): the request changes the permissions of
# the process that makes it. Prints one JSON object.
_XSTATE_SCRIPT = r"""
import ctypes, json
libc = ctypes.CDLL(None, use_errno=True)
syscall = libc.syscall
syscall.restype = ctypes.c_long

def call(op, arg):
    ctypes.set_errno(0)
    rc = syscall(ctypes.c_long(%(nr)d), ctypes.c_long(op), arg)
    return 0 if rc == 0 else (ctypes.get_errno() or -1)

def read(op):
    value = ctypes.c_uint64(0)
    err = call(op, ctypes.byref(value))
    return (value.value if err == 0 else None), err

out = {}
out["xcr0"], err = read(%(supp)d)
out["xcr0_errno"] = err or None
out["amx_request_errno"] = call(%(req)d, ctypes.c_long(%(tile)d))
perm, _ = read(%(perm)d)
out["amx_permitted"] = None if perm is None else bool(perm >> %(tile)d & 1)
print(json.dumps(out))
""" % {"nr": SYS_ARCH_PRCTL_X86_64, "supp": ARCH_GET_XCOMP_SUPP, "req": ARCH_REQ_XCOMP_PERM,
       "perm": ARCH_GET_XCOMP_PERM, "tile": XFEATURE_XTILEDATA}


def errno_name(code: int | None) -> str:
    """The errno's name as the kernel's arch_prctl code says it (95 is EOPNOTSUPP there; Python's table says ENOTSUP)."""
    if code is not None and code == getattr(errno, "EOPNOTSUPP", None):
        return "EOPNOTSUPP"
    return errno.errorcode.get(code or 0, str(code))


@dataclass(frozen=True)
class IsaRow:
    """One row of the table: the feature, whether the CPU has it, and the OS state of its registers."""

    feature: str
    cpu: str
    """present | absent (/proc/cpuinfo does not list it)."""
    os: str
    """enabled | granted on request | refused | disabled (XCR0 lacks its state) | unknown | - (absent)."""
    detail: str = ""
    errno: int | None = None
    """The refused request's errno."""

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def os_shown(self) -> str:
        if self.os == REFUSED and self.errno:
            return f"{REFUSED} (errno {self.errno} {errno_name(self.errno)})"
        return self.os


def is_x86(arch: str | None) -> bool:
    return (arch or "").lower() in ("x86_64", "amd64", "x64", "i386", "i686", "x86")


def probe_xstate(timeout_s: float = 10.0) -> XState:
    """Ask the kernel for XCR0 and for AMX tile permission, in a child process (x86-64 Linux only)."""
    if not sys.platform.startswith("linux") or platform.machine().lower() not in ("x86_64", "amd64"):
        return XState(status="unsupported", detail=f"arch_prctl is x86-64 Linux only (this is {sys.platform} "
                                                   f"{platform.machine()})")
    try:
        proc = subprocess.run([sys.executable, "-I", "-S", "-c", _XSTATE_SCRIPT], capture_output=True, text=True,
                              timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return XState(status="error", detail=f"the arch_prctl probe did not finish: {exc}")
    last = proc.stdout.strip().splitlines()[-1:] or [""]
    try:
        data = json.loads(last[0])
    except json.JSONDecodeError:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return XState(status="error", detail=f"the arch_prctl probe exited {proc.returncode}: {tail[:300]}")
    return XState(status="ok", **data)


def isa_from_flags(flags, arch: str | None, xstate: XState | None = None) -> Isa:
    """The snapshot's ISA part from /proc/cpuinfo's flags and the kernel's answers (``xstate``; None: not asked)."""
    if arch and not is_x86(arch):
        return Isa(status="not_x86")
    return Isa(status="ok", flags=[f for f in TRACKED_FLAGS if f in flags], xstate=xstate or XState())


def _group(feature: str) -> str:
    return "amx" if feature.startswith("amx") else "avx512" if feature.startswith("avx512") else "avx"


def isa_rows(isa: Isa) -> list[IsaRow]:
    """One row per ISA_FEATURES entry (none when the snapshot has no readable x86 CPU)."""
    if isa.status != "ok":
        return []
    xs = isa.xstate
    xcr0 = xs.xcr0 if xs.status == "ok" else None
    flags = set(isa.flags)
    rows = []
    for feature in ISA_FEATURES:
        group = _group(feature)
        bits, state = STATE[group]
        if feature not in flags:
            note = "not in /proc/cpuinfo"
            if xcr0 is not None and xcr0 & bits != bits and group != "amx":
                note += f" (XCR0 {xcr0:#x} lacks {state} too: Linux hides the flag then)"
            rows.append(IsaRow(feature, "absent", NOT_APPLICABLE, note))
        elif group == "amx":
            rows.append(_amx_row(feature, xs, xcr0))
        elif xcr0 is not None:
            on = xcr0 & bits == bits
            rows.append(IsaRow(feature, "present", ENABLED if on else DISABLED,
                               f"XCR0 {xcr0:#x} {'has' if on else 'lacks'} {state}"))
        elif IMPLIED_BY[group] in flags:
            why = _xcr0_unread(xs)
            rows.append(IsaRow(feature, "present", ENABLED, f"implied: Linux lists {IMPLIED_BY[group]} only while XCR0 "
                                                            f"holds {state} ({why})"))
        else:
            rows.append(IsaRow(feature, "present", UNKNOWN_STATE, f"{_xcr0_unread(xs)}, and /proc/cpuinfo does not "
                                                                  f"list {IMPLIED_BY[group]}"))
    return rows


def _xcr0_unread(xs: XState) -> str:
    if xs.status != "ok":
        return f"XCR0 not read: {xs.detail or 'not probed'}"
    name = errno_name(xs.xcr0_errno)
    return f"XCR0 not read: ARCH_GET_XCOMP_SUPP failed with {name}" + (" (Linux before 5.16)" if name == "EINVAL" else "")


def _amx_row(feature: str, xs: XState, xcr0: int | None) -> IsaRow:
    if xs.status != "ok" or xs.amx_request_errno is None:
        return IsaRow(feature, "present", UNKNOWN_STATE, f"tile permission not asked: {xs.detail or xs.status}")
    err = xs.amx_request_errno
    if err == 0 and xs.amx_permitted is not False:
        return IsaRow(feature, "present", GRANTED, "arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) succeeded in a "
                                                   "child process; every process must ask before its first tile "
                                                   "instruction")
    if err == 0:
        detail, code = "the request returned 0 but ARCH_GET_XCOMP_PERM lacks XTILEDATA", None
    else:
        name = errno_name(err)
        why = AMX_ERRNO.get(name)
        detail, code = f"arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) failed: errno {err} ({name})" + \
            (f": {why}" if why else ""), err
    if xcr0 is not None and xcr0 & XCR0_AMX != XCR0_AMX:
        detail += f"; XCR0 {xcr0:#x} lacks {STATE['amx'][1]}"
    return IsaRow(feature, "present", REFUSED, detail, code)


def render_table(rows: list[IsaRow]) -> list[str]:
    """The rows as aligned text lines (a header, then one line per feature)."""
    if not rows:
        return []
    width = max(len(r.feature) for r in rows)
    lines = [f"{'feature':<{width}}  {'CPU':<7}  OS"]
    lines += [f"{r.feature:<{width}}  {r.cpu:<7}  {r.os_shown}" for r in rows]
    return lines


def xcr0_source(isa: Isa) -> str:
    """Where the OS states come from, in one phrase."""
    xs = isa.xstate
    if xs.status == "ok" and xs.xcr0 is not None:
        return f"XCR0 {xs.xcr0:#x} from the kernel (arch_prctl ARCH_GET_XCOMP_SUPP)"
    return f"{_xcr0_unread(xs)}; AVX/AVX-512 states implied by /proc/cpuinfo"
