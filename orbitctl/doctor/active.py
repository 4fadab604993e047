"""Opt-in active tests (--active): a real all-reduce across the GPUs, and DCGM's quick diag.

Both run as subprocesses with a timeout; their results land in Snapshot.active so a saved
snapshot carries them. The all-reduce runs on any torch.distributed backend: NCCL on GPUs,
gloo on CPU (how it is tested on machines without GPUs).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from orbitctl.doctor.findings import FAIL, PASS, SKIP, WARN
from orbitctl.doctor.registry import CheckContext, Outcome, check, no_gpu_outcome
from orbitctl.doctor.snapshot import Snapshot
from orbitctl.units import MiB

# busbw below this (GB/s) on 8 NVLink GPUs means a link, P2P or NUMA problem
LOW_BUSBW_NVLINK_GBS = 100.0
LOW_BUSBW_PCIE_GBS = 5.0

_ALLREDUCE = r"""
import json, os, sys, time, datetime
import torch, torch.distributed as dist
backend, size_mb, iters = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
dist.init_process_group(backend, timeout=datetime.timedelta(seconds=60))
rank, world = dist.get_rank(), dist.get_world_size()
dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if backend == "nccl" else torch.device("cpu")
if dev.type == "cuda":
    torch.cuda.set_device(dev)
x = torch.ones(size_mb * 1024 * 1024 // 4, dtype=torch.float32, device=dev)
dist.all_reduce(x)
sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
sync(); t0 = time.perf_counter()
for _ in range(iters):
    dist.all_reduce(x)
sync(); dt = (time.perf_counter() - t0) / iters
ok = bool(torch.all(x == float(world) ** (iters + 1)).item())
if rank == 0:
    busbw = 2 * (world - 1) / world * x.numel() * 4 / dt / 1e9
    print("ALLREDUCE " + json.dumps({"world": world, "bytes": x.numel() * 4, "seconds": dt, "busbw_gbs": busbw, "correct": ok}))
dist.destroy_process_group()
"""


def run_allreduce(nprocs: int, backend: str = "nccl", size_mb: int = 256, iters: int = 5, timeout_s: float = 60.0) -> dict:
    """Launch ``nprocs`` ranks with torchrun and all-reduce ``size_mb`` MiB; never raises."""
    with tempfile.TemporaryDirectory(prefix="orbitctl-allreduce-") as tmp:
        script = Path(tmp) / "allreduce.py"
        script.write_text(_ALLREDUCE)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nprocs}",
               str(script), backend, str(size_mb), str(iters)]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return {"status": "timeout", "detail": f"no result within {timeout_s:.0f} s", "backend": backend}
        except OSError as exc:
            return {"status": "error", "detail": str(exc), "backend": backend}
    for line in proc.stdout.splitlines():
        if line.startswith("ALLREDUCE "):
            result = json.loads(line[len("ALLREDUCE "):])
            result.update(status="ok" if result.get("correct") else "wrong", backend=backend)
            return result
    tail = (proc.stderr.strip().splitlines() or ["no output"])[-3:]
    return {"status": "error", "detail": f"exit {proc.returncode}: " + " | ".join(tail)[:600], "backend": backend}


def run_dcgm(timeout_s: float = 300.0) -> dict:
    """`dcgmi diag -r 1 --json`: DCGM's quick deployment checks."""
    if shutil.which("dcgmi") is None:
        return {"status": "missing", "detail": "dcgmi not installed"}
    try:
        proc = subprocess.run(["dcgmi", "diag", "-r", "1", "--json"], capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return {"status": "error", "detail": str(exc)}
    text = proc.stdout
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        return {"status": "error", "detail": (proc.stderr or text).strip()[:600]}
    failed = _dcgm_failures(data)
    return {"status": "fail" if failed else "pass", "failures": failed}


def _dcgm_failures(node: object, path: str = "") -> list[str]:
    """Every test result reading 'Fail' anywhere in DCGM's JSON, with where it was."""
    out: list[str] = []
    if isinstance(node, dict):
        name = node.get("name") or node.get("test_name") or path
        status = str(node.get("status", node.get("result", ""))).lower()
        if status == "fail":
            warn = node.get("warnings") or node.get("info") or ""
            out.append(f"{name}: Fail {json.dumps(warn)[:200] if warn else ''}".strip())
        for key, value in node.items():
            out.extend(_dcgm_failures(value, str(name or key)))
    elif isinstance(node, list):
        for item in node:
            out.extend(_dcgm_failures(item, path))
    return out


def run_active(snapshot: Snapshot) -> None:
    """Fill snapshot.active from the live machine (only where there are GPUs)."""
    if snapshot.has_gpus and snapshot.torch.cuda_available:
        snapshot.active["act.nccl"] = run_allreduce(len(snapshot.nvml.gpus), "nccl")
    snapshot.active["act.dcgm"] = run_dcgm()


@check("act.nccl", "NCCL", "live all-reduce across every GPU", when="active")
def act_nccl(s: Snapshot, ctx: CheckContext) -> Outcome:
    r = s.active.get("act.nccl")
    if r is None:
        return no_gpu_outcome(s) or Outcome(SKIP, ["all-reduce not run (torch cannot use the GPUs; see env.torch)"])
    fix = ("Rerun with NCCL_DEBUG=INFO; isolate pairs with CUDA_VISIBLE_DEVICES=0,1 ...; "
           "all_reduce_perf -b 8 -e 256M -f 2 -g 8 from NVIDIA/nccl-tests")
    if r.get("status") != "ok":
        return Outcome(FAIL, [f"all-reduce {r.get('status')}: {r.get('detail', 'wrong result')}"], fix, r)
    bw = float(r.get("busbw_gbs", 0.0))
    ev = [f"{r.get('world')} ranks, {r.get('bytes', 0) / MiB:.0f} MiB, busbw {bw:.1f} GB/s ({r.get('backend')})"]
    nvlink = any(any(g.nvlink_active or []) for g in s.nvml.gpus)
    floor = LOW_BUSBW_NVLINK_GBS if nvlink else LOW_BUSBW_PCIE_GBS
    if r.get("backend") == "nccl" and bw < floor:
        return Outcome(WARN, ev + [f"below {floor:.0f} GB/s expected for {'NVLink' if nvlink else 'PCIe'}"], fix, r)
    return Outcome(PASS, ev, None, r)


@check("act.dcgm", "GPU", "DCGM quick diagnostic (dcgmi diag -r 1)", when="active")
def act_dcgm(s: Snapshot, ctx: CheckContext) -> Outcome:
    r = s.active.get("act.dcgm")
    if r is None or r.get("status") == "missing":
        return Outcome(SKIP, [r.get("detail") if r else "DCGM diag not run"])
    if r.get("status") == "error":
        return Outcome(FAIL, [f"dcgmi diag failed to run: {r.get('detail')}"],
                       "Start the host engine: sudo systemctl start nvidia-dcgm (in containers DCGM needs the host engine)", r)
    if r.get("status") == "fail":
        return Outcome(FAIL, r.get("failures", [])[:10], "Follow the DCGM guidance for each failed test; drain the node", r)
    return Outcome(PASS, ["every DCGM level-1 test passed"], None, r)


