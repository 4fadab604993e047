"""Host probes: torch build (in a subprocess), CPU, NUMA, /dev/shm, kernel log, env, MASTER_PORT.

Each probe returns its Snapshot section and never raises: what it cannot see stays None
or carries a status (missing, unreadable) that the checks turn into SKIP or UNKNOWN.
"""

from __future__ import annotations

import errno
import json
import os
import platform
import re
import shutil
import socket
import subprocess
import sys
from datetime import datetime, timezone
from typing import Callable

from orbitctl.doctor.probe_nvml import GpuProbe, NvmlProbe
from orbitctl.doctor.snapshot import (Cpu, Host, KernelLog, MasterPort, ProcessBinding, Shm, Snapshot, TorchInfo,
                                      XState)
from orbitctl.doctor.sysfs import read_numa_nodes, read_process_binding, read_text
from orbitctl.units import KiB

ENV_PREFIXES = ("NCCL_", "TORCH_NCCL_", "TORCH_DISTRIBUTED_", "CUDA_", "PYTORCH_", "TORCH_FR_")
ENV_NAMES = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "LD_LIBRARY_PATH", "LD_PRELOAD",
             "OMP_NUM_THREADS", "BNB_CUDA_VERSION", "ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")
DEFAULT_MASTER_PORT = 29500
XID_LINE = re.compile(r"NVRM: Xid|fallen off the bus")

# Runs in a child interpreter: a broken CUDA install can crash or hang torch's import,
# and the doctor itself must not become a process holding GPU memory.
_TORCH_SCRIPT = r"""
import json, sys
out = {"status": "ok"}
try:
    import torch
except Exception as exc:
    print(json.dumps({"status": "missing", "detail": f"{type(exc).__name__}: {exc}"})); sys.exit(0)
out["version"] = torch.__version__
out["cuda"] = getattr(torch.version, "cuda", None)
out["hip"] = getattr(torch.version, "hip", None)
try:
    out["cuda_available"] = bool(torch.cuda.is_available())
    out["device_count"] = int(torch.cuda.device_count()) if out["cuda_available"] else 0
    out["arch_list"] = list(torch.cuda.get_arch_list()) if out["cuda"] or out["hip"] else []
    out["capabilities"] = [list(torch.cuda.get_device_capability(i)) for i in range(out["device_count"])]
except Exception as exc:
    out["detail"] = f"torch.cuda: {type(exc).__name__}: {exc}"
try:
    v = torch.cuda.nccl.version() if out["cuda"] else None
    out["nccl_version"] = ".".join(str(x) for x in v) if isinstance(v, tuple) else (str(v) if v else None)
except Exception:
    out["nccl_version"] = None
try:
    out["cpu_capability"] = torch.backends.cpu.get_cpu_capability()
except Exception:
    out["cpu_capability"] = None
try:
    maps = open("/proc/self/maps").read().splitlines()
    out["loaded_nccl"] = sorted({l.split()[-1] for l in maps if "libnccl" in l and "/" in l})
except Exception:
    out["loaded_nccl"] = None
print(json.dumps(out))
"""


def take_snapshot(gpu_probe: GpuProbe | None = None, *, probe_torch: bool = True) -> Snapshot:
    """Probe this machine now. ``gpu_probe`` replaces the live NVML probe (tests)."""
    nvml = (gpu_probe or NvmlProbe()).probe()
    torch_info, loaded_nccl = probe_torch_build() if probe_torch else (TorchInfo(status="missing", detail="not probed"), None)
    host = probe_host()
    host.loaded_nccl = loaded_nccl
    env = probe_env()
    return Snapshot(
        taken_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        nvml=nvml, torch=torch_info, host=host, env=env,
        kernel_log=probe_kernel_log(), master_port=probe_master_port(env),
    )


def probe_torch_build(timeout_s: float = 120.0) -> tuple[TorchInfo, list[str] | None]:
    try:
        proc = subprocess.run([sys.executable, "-c", _TORCH_SCRIPT], capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return TorchInfo(status="error", detail=f"torch probe did not finish: {exc}"), None
    last = proc.stdout.strip().splitlines()[-1:] or [""]
    try:
        data = json.loads(last[0])
    except json.JSONDecodeError:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return TorchInfo(status="error", detail=f"torch probe exited {proc.returncode}: {tail[:300]}"), None
    loaded = data.pop("loaded_nccl", None)
    return TorchInfo.model_validate(data), loaded


def probe_host() -> Host:
    host = Host(hostname=socket.gethostname(), kernel=platform.release(), cpu_count=os.cpu_count())
    host.numa_nodes = read_numa_nodes()
    binding = read_process_binding("self")
    cpus = binding.get("cpus")
    if cpus is None:
        try:
            cpus = sorted(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            cpus = None
    host.process = ProcessBinding(pid=os.getpid(), cpus_allowed=cpus, mems_allowed=binding.get("mems"))
    host.shm = probe_shm()
    from orbitctl.doctor.isa import probe_xstate

    host.cpu = probe_cpu(xstate=probe_xstate)
    host.cmdline = read_text("/proc/cmdline")
    try:
        host.net_interfaces = sorted(os.listdir("/sys/class/net"))
    except OSError:
        host.net_interfaces = None
    meminfo = read_text("/proc/meminfo") or ""
    for key, attr in (("MemTotal", "mem_total_bytes"), ("MemAvailable", "mem_available_bytes")):
        m = re.search(rf"^{key}:\s+(\d+) kB", meminfo, re.M)
        if m:
            setattr(host, attr, int(m.group(1)) * KiB)  # /proc/meminfo's kB are KiB
    host.acs_enabled_bridges = probe_acs()
    from orbitctl.dist.build_locks import stale_build_locks

    host.stale_build_locks = [str(lock) for lock in stale_build_locks()]
    return host


def probe_cpu(path: str = "/proc/cpuinfo", xstate: Callable[[], XState] | None = None) -> Cpu:
    """CPU model and the ISA flags that decide bf16 speed, from /proc/cpuinfo (``path`` in tests), and the `isa`
    table's part: every ISA feature with the kernel's answers about its register state (``xstate``, e.g.
    orbitctl.doctor.isa.probe_xstate, which asks in a child process; None: not asked)."""
    from orbitctl.doctor.isa import isa_from_flags
    from orbitctl.kernels.cpu_dtype import ISA_FLAGS, read_host_cpu

    info = read_host_cpu(path)
    if info is None:
        cpu = Cpu(status="unreadable", model=platform.processor() or None, arch=platform.machine() or None)
        cpu.isa.status = "unreadable"
        return cpu
    isa = isa_from_flags(info.flags, info.arch, None)
    if isa.status == "ok" and xstate is not None:
        isa.xstate = xstate()
    return Cpu(status="ok", model=info.model, arch=info.arch or None, flags=[f for f in ISA_FLAGS if f in info.flags],
               isa=isa)


def probe_shm(path: str = "/dev/shm") -> Shm:
    try:
        st = os.statvfs(path)
    except FileNotFoundError:
        return Shm(status="missing")
    except OSError:
        return Shm(status="error")
    return Shm(status="ok", total_bytes=st.f_blocks * st.f_frsize, free_bytes=st.f_bavail * st.f_frsize)


def probe_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    environ = dict(os.environ if environ is None else environ)
    return {k: v for k, v in sorted(environ.items()) if k.startswith(ENV_PREFIXES) or k in ENV_NAMES}


def probe_master_port(env: dict[str, str]) -> MasterPort:
    raw = env.get("MASTER_PORT", str(DEFAULT_MASTER_PORT))
    try:
        port = int(raw)
    except ValueError:
        return MasterPort(port=None, bindable=None, error=f"MASTER_PORT={raw!r} is not a number")
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        # SO_REUSEADDR like TCPStore: only a listening socket makes bind() fail, not TIME_WAIT.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("0.0.0.0", port))
        sock.listen(1)
        return MasterPort(port=port, bindable=True)
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            return MasterPort(port=port, bindable=False, error=f"errno {exc.errno}: {exc.strerror}")
        return MasterPort(port=port, bindable=None, error=f"errno {exc.errno}: {exc.strerror}")
    finally:
        sock.close()


def probe_kernel_log(max_lines: int = 200) -> KernelLog:
    """Xid lines from `journalctl -k`, else `dmesg`; UNKNOWN-worthy when neither can be read."""
    tried = []
    for cmd in (["journalctl", "-k", "-q", "--no-pager", "-n", "50000"], ["dmesg"]):
        if shutil.which(cmd[0]) is None:
            tried.append(f"{cmd[0]}: not installed")
            continue
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, errors="replace", timeout=20)
        except (OSError, subprocess.TimeoutExpired) as exc:
            tried.append(f"{cmd[0]}: {exc}")
            continue
        if proc.returncode != 0 or not proc.stdout.strip():
            why = (proc.stderr.strip().splitlines() or ["no output"])[0][:200]
            tried.append(f"{cmd[0]}: {why}")
            continue
        lines = [ln for ln in proc.stdout.splitlines() if XID_LINE.search(ln)]
        return KernelLog(status="ok", source=" ".join(cmd[:2]), xid_lines=lines[-max_lines:])
    restrict = read_text("/proc/sys/kernel/dmesg_restrict")
    detail = "; ".join(tried) + (f"; kernel.dmesg_restrict={restrict}" if restrict else "")
    return KernelLog(status="unreadable", detail=detail)


def probe_acs() -> list[str] | None:
    """Bridges with ACS source validation on (needs root for lspci to show ACSCtl)."""
    if shutil.which("lspci") is None or os.geteuid() != 0:
        return None
    try:
        proc = subprocess.run(["lspci", "-vvv"], capture_output=True, text=True, errors="replace", timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    bridges, current = [], None
    for line in proc.stdout.splitlines():
        if line and not line[0].isspace():
            current = line.split()[0]
        elif "ACSCtl:" in line and "SrcValid+" in line and current:
            bridges.append(current)
    return bridges
