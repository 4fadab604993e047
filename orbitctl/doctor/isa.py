"""The CPU's ISA features and the OS state of their registers: the `isa` table of `orbitctl doctor`.

An instruction runs only when the CPU has it *and* the OS saves the registers it uses: the OS enables
each register state in XCR0 (the extended control register the ``xgetbv`` instruction reads), and
Linux (5.16+) also makes every process ask for AMX's tile data before its first tile instruction
(``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)``). Either missing, the instruction raises
SIGILL exactly like one the CPU lacks, which is why a crash log's "Illegal instruction" is read next
to this table (log.host.sigill).

How the OS state is read: :mod:`orbitctl.kernels.cpu_state` (``arch_prctl(ARCH_GET_XCOMP_SUPP)`` for XCR0, the
tile-data request for AMX; /proc/cpuinfo's flags where the kernel is older than 5.16), the same answers orbitctl's
own CPU kernels go by. The questions run in a child interpreter (that module run as a script): a granted request
changes the process that made it, and the doctor's own process must stay as it was.
"""

from __future__ import annotations

import json
import platform
import subprocess
import sys
from dataclasses import asdict, dataclass

from orbitctl.doctor.snapshot import Isa, XState
from orbitctl.kernels import cpu_state
from orbitctl.kernels.cpu_state import STATE, XCR0_AMX, errno_name

ISA_FEATURES = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni", "avx512_fp16",
                "amx_tile", "amx_bf16", "amx_int8")
"""The rows of the table, in /proc/cpuinfo's names."""
TRACKED_FLAGS = ISA_FEATURES + ("avx",)
"""What the snapshot keeps of /proc/cpuinfo's flags: the rows, and avx (whose presence implies the YMM state)."""

IMPLIED_BY = {"avx": "avx", "avx512": "avx512f"}
"""The /proc/cpuinfo flag Linux lists only when XCR0 holds the state (the fallback without ARCH_GET_XCOMP_SUPP)."""

ENABLED, GRANTED, REFUSED, DISABLED, UNKNOWN_STATE, NOT_APPLICABLE = (
    "enabled", "granted on request", "refused", "disabled", "unknown", "-")


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
    if not cpu_state.on_x86_64_linux():
        return XState(status="unsupported", detail=f"arch_prctl is x86-64 Linux only (this is {sys.platform} "
                                                   f"{platform.machine()})")
    try:  # the module as a script, in an interpreter with nothing but the standard library (-I -S)
        proc = subprocess.run([sys.executable, "-I", "-S", cpu_state.__file__], capture_output=True, text=True,
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
    answers = cpu_state.KernelAnswers(xs.xcr0, xs.xcr0_errno, xs.amx_request_errno, xs.amx_permitted)
    detail = cpu_state.amx_request_refusal(answers)
    if detail is None:
        return IsaRow(feature, "present", GRANTED, "arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) succeeded in a "
                                                   "child process; every process must ask before its first tile "
                                                   "instruction")
    code = xs.amx_request_errno or None
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
