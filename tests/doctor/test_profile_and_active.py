"""--profile against the machine (real planner), and the opt-in all-reduce run for real over gloo."""

from pathlib import Path

import pytest

from orbitctl.doctor import FAIL, PASS, SKIP, WARN, load_snapshot, run_checks
from orbitctl.doctor.active import run_allreduce
from orbitctl.profile import load_profile

FIX = Path(__file__).parent / "fixtures"


def checks(snapshot, profile_name="llama8b_h100.yaml", overrides=(), **kw):
    profile = load_profile(FIX / "profiles" / profile_name, list(overrides))
    return {f.id: f for f in run_checks(load_snapshot(FIX / "snapshots" / snapshot), profile=profile, **kw)}


def test_profile_fits_on_the_healthy_h100_node():
    found = checks("healthy_8xh100.json")
    assert found["prof.gpu"].status == PASS and found["prof.mem"].status == PASS
    assert found["prof.fit"].status == PASS, found["prof.fit"].evidence
    assert found["prof.fit"].data["fits"] is True


def test_foreign_process_makes_the_run_not_fit_here_and_the_planner_says_what_to_change():
    fit = checks("foreign_40gb.json")["prof.fit"]
    assert fit.status == FAIL
    assert fit.data["gpu_memory_bytes"] < 41 * 2**30
    assert fit.fix.startswith("set memory.micro_batch_size=") and "planned peak" in fit.fix


def test_profile_for_another_gpu_or_count():
    found = checks("healthy_8xh100.json", overrides=["hardware.gpu=h200"])
    assert found["prof.gpu"].status == FAIL and "hardware.gpu=h100-80g" in found["prof.gpu"].fix
    assert found["prof.mem"].status == FAIL
    found = checks("healthy_8xh100.json", overrides=["hardware.gpu=a100-80g"])
    assert found["prof.gpu"].status == WARN  # a bigger GPU than planned is not a failure
    found = checks("no_gpu.json")
    assert found["gpu.count"].status == FAIL and found["prof.gpu"].status == FAIL


def test_cpu_profile_skips_gpu_planning():
    found = {f.id: f.status for f in run_checks(load_snapshot(FIX / "snapshots" / "no_gpu.json"),
                                                 profile=load_profile("profiles/tiny-cpu.yaml"))}
    assert found["prof.fit"] == found["prof.gpu"] == SKIP and found["gpu.count"] == SKIP


def test_active_checks_are_opt_in_and_read_recorded_results():
    assert "act.nccl" not in checks("healthy_8xh100.json")
    snap = load_snapshot(FIX / "snapshots" / "healthy_8xh100.json")
    snap.active["act.nccl"] = {"status": "timeout", "detail": "no result within 60 s", "backend": "nccl"}
    snap.active["act.dcgm"] = {"status": "fail", "failures": ["memory: Fail"]}
    found = {f.id: f.status for f in run_checks(snap, active=True)}
    assert found["act.nccl"] == FAIL and found["act.dcgm"] == FAIL
    snap.active["act.nccl"] = {"status": "ok", "world": 8, "bytes": 2**28, "busbw_gbs": 12.0, "backend": "nccl"}
    assert {f.id: f.status for f in run_checks(snap, active=True)}["act.nccl"] == WARN  # NVLink node at 12 GB/s


@pytest.mark.slow
def test_allreduce_runs_for_real_over_gloo():
    result = run_allreduce(2, backend="gloo", size_mb=4, iters=2, timeout_s=120)
    assert result["status"] == "ok", result
    assert result["world"] == 2 and result["correct"] is True and result["busbw_gbs"] > 0
