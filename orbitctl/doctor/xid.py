"""NVIDIA Xid codes: how bad each one is and what to do. Shared by xid.recent and log triage."""

from __future__ import annotations

import re

from orbitctl.doctor.findings import FAIL, INFO, WARN

XID_RE = re.compile(r"NVRM: Xid \((?P<dev>[^)]{1,40})\): (?P<xid>\d{1,4})\b")

# code -> (severity, meaning, fix)
XIDS: dict[int, tuple[str, str, str]] = {
    13: (INFO, "graphics engine exception (often an out-of-range access in a kernel)",
         "An application bug: rerun with CUDA_LAUNCH_BLOCKING=1 and compute-sanitizer"),
    31: (INFO, "GPU memory page fault (illegal address in a kernel)",
         "An application bug: rerun with CUDA_LAUNCH_BLOCKING=1 and compute-sanitizer"),
    43: (INFO, "GPU stopped processing (the application was killed or faulted)", "Look at the application's own error first"),
    45: (INFO, "preemptive cleanup after a killed channel", "Follows another error; look for the first Xid"),
    48: (FAIL, "double-bit ECC error", "Drain the node, reset the GPU (nvidia-smi -r -i N); RMA if it repeats"),
    61: (WARN, "internal micro-controller breakpoint/warning", "Update the driver; reset the GPU if it repeats"),
    62: (WARN, "internal micro-controller halt", "Reset the GPU; update the driver"),
    63: (WARN, "ECC page retirement / row remapping event", "Restart the application; reset the GPU to activate the remap"),
    64: (FAIL, "ECC page retirement / row remapping failure", "Drain the node and RMA the GPU"),
    68: (WARN, "video processor exception", "Update the driver"),
    74: (FAIL, "NVLink error", "Check `nvidia-smi nvlink -s`; reset the GPU; reseat or RMA if links stay down"),
    79: (FAIL, "GPU has fallen off the bus", "Reseat the GPU and check power and cooling; reboot; RMA if it repeats"),
    92: (WARN, "high single-bit ECC error rate", "Watch the ECC counters; plan a reset"),
    94: (WARN, "contained ECC error (the application was stopped)", "Restart the application; reset the GPU when idle"),
    95: (FAIL, "uncontained ECC error", "Reset the GPU (nvidia-smi -r); drain and RMA if it repeats"),
    119: (FAIL, "GSP RPC timeout", "Update the driver (GSP firmware); reset the GPU; try NVreg_EnableGpuFirmware=0 on older drivers"),
    120: (FAIL, "GSP error", "Update the driver (GSP firmware); reset the GPU"),
    121: (WARN, "C2C link corrected errors", "Watch the counters; RMA if they rise"),
    137: (WARN, "NVLink FLA privilege error", "Check the fabric address (FLA) setup and the driver; update the driver"),
    140: (FAIL, "ECC unrecovered error", "Drain the node; reset the GPU; RMA if it repeats"),
    142: (FAIL, "ECC unrecovered error", "Drain the node; reset the GPU; RMA if it repeats"),
    143: (FAIL, "GPU initialization failure", "Reset the GPU or reboot; update the driver; RMA if it repeats"),
    **{code: (FAIL, f"NVLink {unit} error",
              "Check `nvidia-smi nvlink -s` and `-e`; reset the GPU; the message's intrinfo sub-code says whether "
              "a reset suffices or the link or GPU needs service")
       for code, unit in ((144, "SAW"), (145, "RLW"), (146, "TLW"), (147, "TREX"), (148, "NVLPW_CTRL"),
                          (149, "NETIR"), (150, "MSE"))},
}


def classify_xid(code: int) -> tuple[str, str, str]:
    """Severity, meaning and fix of one Xid; unknown codes are a WARN to look up."""
    return XIDS.get(code, (WARN, f"Xid {code}", "Look the code up in NVIDIA's Xid catalog (docs.nvidia.com/deploy/xid-errors)"))
