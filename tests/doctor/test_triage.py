"""Log triage: one fixture per signature (real message text), mixed multi-rank logs, clean logs, fuzz."""

import random
import time
from pathlib import Path

import pytest

from orbitctl.doctor import FAIL, INFO, WARN, triage_log
from orbitctl.doctor.oom import parse_oom, parse_size
from orbitctl.doctor.signatures import SIGNATURES

LOGS = Path(__file__).parent / "fixtures" / "logs"
REAL = Path(__file__).parent / "fixtures" / "real"

# fixture -> (root cause id, its rank, other ids that must be reported)
EXPECTED = {
    "oom_current_cap": ("log.oom.cap", 3, set()),
    "oom_2_1_frag": ("log.oom.frag", None, set()),
    "oom_old_frag": ("log.oom.frag", None, set()),
    "oom_old_cap": ("log.oom.cap", None, set()),
    "oom_private_pools": ("log.oom.cap", 1, set()),
    "oom_peer": ("log.oom.peer", 0, set()),
    "oom_peer_all_ranks_on_gpu0": ("log.oom.peer", 0, set()),
    "oom_hip": ("log.oom.cap", None, set()),
    "oom_raw": ("log.oom.raw", None, set()),
    "ds_flush": ("log.ds.flush", None, set()),
    "host_oom": ("log.host.oom", 0, set()),
    "host_oom_torchrun": ("log.host.oom", 3, set()),
    "nccl_timeout_straggler": ("log.nccl.timeout", 5, set()),
    "nccl_stuck": ("log.nccl.stuck", 1, set()),
    "nccl_pg": ("log.nccl.pg", 2, set()),
    "cuda_launch": ("log.cuda.launch", 4, set()),
    "cuda_ordinal": ("log.cuda.ordinal", 1, set()),
    "host_sigbus": ("log.nccl.shm", None, {"log.host.sigbus"}),
    "host_segv": ("log.host.segv", 1, set()),
    "oom_kv": ("log.oom.kv", None, set()),
    "cuda_nodev": ("log.cuda.nodev", None, set()),
    "drv_mismatch": ("log.drv.mismatch", None, set()),
    "nccl_sys": ("log.nccl.sys", 1, {"log.nccl.sock"}),
    "nccl_cuda": ("log.nccl.cuda", 2, set()),
    "nccl_int": ("log.nccl.int", 2, set()),
    "nccl_remote": ("log.nccl.remote", 6, {"log.nccl.sock"}),
    "nccl_shm": ("log.nccl.shm", None, {"log.nccl.sys"}),
    "nccl_p2p": ("log.nccl.p2p", None, {"log.nccl.cuda"}),
    "nccl_cudaf": ("log.nccl.cudaf", None, {"log.nccl.cuda"}),
    "nccl_ib": ("log.nccl.ib", None, {"log.nccl.remote"}),
    "nccl_if": ("log.nccl.if", None, {"log.nccl.int"}),
    "nccl_ver": ("log.nccl.ver", None, {"log.nccl.usage"}),
    "nccl_err": ("log.nccl.err", None, set()),
    "nccl_dupgpu": ("log.nccl.dupgpu", None, {"log.nccl.usage"}),
    "cuda_err": ("log.cuda.err", 7, set()),
    "ddp_unused": ("log.ddp.unused", 0, set()),
    "exception_then_timeouts": ("log.exception", 5, {"log.nccl.timeout"}),
    "nccl_desync": ("log.nccl.desync", 1, set()),
    "nccl_abort": ("log.nccl.remote", 2, {"log.nccl.abort"}),
    "nccl_sock": ("log.nccl.sock", None, set()),
    "port": ("log.port", None, set()),
    "port_libuv": ("log.port", None, set()),
    "cuda_ima": ("log.cuda.ima", 0, set()),
    "cuda_assert": ("log.cuda.assert", None, set()),
    "cuda_arch": ("log.cuda.arch", None, set()),
    "cuda_drv": ("log.cuda.drv", None, set()),
    "cuda_802": ("log.cuda.802", None, set()),
    "cuda_ecc": ("log.cuda.ecc", 5, set()),
    "xid": ("log.xid", None, set()),
    "bnb": ("log.bnb", None, set()),
    "train_nan": ("log.train.nan", None, set()),
    "dist_store": ("log.dist.store", None, set()),
    "wrapped_watchdog": ("log.nccl.timeout", None, set()),
    "mixed_oom_rank3_then_timeouts": ("log.oom.cap", 3, {"log.nccl.timeout", "log.nccl.depr"}),
    "mixed_xid_then_ima": ("log.xid", None, {"log.cuda.ima", "log.nccl.timeout"}),
    "mixed_nccl_error_with_oom_detail": ("log.oom.raw", 7, {"log.nccl.cuda", "log.nccl.timeout"}),
}


def triage_file(name, **kw):
    return triage_log((LOGS / f"{name}.log").read_text(), **kw)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_root_cause(name):
    root_id, rank, others = EXPECTED[name]
    result = triage_file(name)
    assert result.root_cause is not None
    assert result.root_cause.id == root_id
    assert result.root_cause.rank == rank
    assert result.findings[0] is result.root_cause
    assert others <= {f.id for f in result.findings}


def test_every_signature_has_a_fixture_that_fires_it():
    fired = set()
    for path in [*LOGS.glob("*.log"), *REAL.glob("*.log")]:
        findings = triage_log(path.read_text(encoding="utf-8")).findings
        fired |= {f.id for f in findings}
        # Ray's memory monitor is filed as host OOM; its own signature shows in the finding's data
        fired |= {"log.ray.oom" for f in findings if f.data.get("ray_memory_monitor")}
    fired = {i.removeprefix("log.") for i in fired}
    missing = [s.id for s in SIGNATURES if s.id not in fired and not (s.id == "oom" and fired & {"oom.cap", "oom.frag"})]
    assert missing == []
    # the OOM sub-rows: capacity, fragmentation, another process, the <=2.0 form
    assert {"oom.cap", "oom.frag", "oom.peer", "oom.raw"} <= fired


def test_signature_table_covers_the_reference_33():
    ids = {s.id for s in SIGNATURES} | {"oom.cap", "oom.frag", "oom.old", "oom.peer"}
    reference = {"oom", "oom.cap", "oom.frag", "oom.old", "oom.peer", "oom.raw", "ds.flush", "host.oom", "nccl.timeout",
                 "nccl.pg", "nccl.stuck", "nccl.err", "nccl.sys", "nccl.cuda", "nccl.int", "nccl.remote", "nccl.shm",
                 "nccl.p2p", "nccl.cudaf", "nccl.ib", "nccl.if", "nccl.ver", "nccl.abort", "nccl.depr", "port", "cuda.ima",
                 "cuda.assert", "cuda.arch", "cuda.drv", "cuda.802", "cuda.ecc", "xid", "bnb"}
    assert len(reference) == 33
    assert reference <= ids


def test_consequences_rank_below_the_oom_and_are_not_failures():
    result = triage_file("mixed_oom_rank3_then_timeouts")
    by_id = {f.id: f for f in result.findings}
    assert by_id["log.oom.cap"].status == FAIL
    assert by_id["log.nccl.timeout"].status == WARN
    assert any("consequence of log.oom.cap on rank 3" in e for e in by_id["log.nccl.timeout"].evidence)
    assert by_id["log.nccl.depr"].status == INFO
    assert by_id["log.nccl.timeout"].data["missing_ranks"] == [3]


def test_watchdog_numbers_are_parsed():
    t = {f.id: f for f in triage_file("nccl_timeout_straggler").findings}["log.nccl.timeout"]
    assert t.data["first"] == {"seq": 1580, "op": "ALLREDUCE", "timeout_ms": 600000, "ran_ms": 600004}
    assert t.data["straggler_ranks"] == [5]
    wrapped = {f.id: f for f in triage_file("wrapped_watchdog").findings}["log.nccl.timeout"]
    assert wrapped.data["first"]["op"] == "BROADCAST"  # the paste split "OpTy|pe=BROADCAST"
    assert wrapped.data["missing_ranks"] == [0, 4]


def test_last_error_detail_is_attached():
    f = triage_file("nccl_sys").root_cause
    assert any("socketStartConnect: Connect to 10.0.3.7<43127> failed" in e for e in f.evidence)


@pytest.mark.parametrize("name", ["clean_training", "clean_deepspeed_fp16", "nccl_depr"])
def test_clean_logs_have_no_failure(name):
    result = triage_file(name)
    assert all(f.status != FAIL for f in result.findings)


def test_oom_numbers():
    d = parse_oom((LOGS / "oom_peer.log").read_text())
    assert d.kind == "peer" and d.peers == {48213: 40 * 2**30} and d.request == 2 * 2**30
    d = parse_oom((LOGS / "oom_2_1_frag.log").read_text())
    assert (d.form, d.kind) == ("2.1", "frag") and d.reserved_unallocated == parse_size("5.98 GiB")
    d = parse_oom((LOGS / "oom_old_frag.log").read_text())
    assert d.form == "old" and d.reserved_unallocated == parse_size("14.80 GiB") - parse_size("13.13 GiB")
    assert parse_size("576.00 KiB") == 576 * 1024 and parse_size("0 bytes") == 0 and parse_size("x") is None


def test_oom_kind_comes_from_numbers_not_keywords():
    base = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate {req}. GPU 0 has a total capacity of 80.00 GiB "
            "of which 100.00 MiB is free. Of the allocated memory {alloc} is allocated by PyTorch, and {un} is reserved by "
            "PyTorch but unallocated. If reserved but unallocated memory is large try setting "
            "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.")
    frag = triage_log(base.format(req="2.00 GiB", alloc="60.00 GiB", un="19.00 GiB")).root_cause.id
    cap = triage_log(base.format(req="2.00 GiB", alloc="78.00 GiB", un="1.00 GiB")).root_cause.id
    assert (frag, cap) == ("log.oom.frag", "log.oom.cap")


def test_memory_root_cause_gets_planner_advice():
    from orbitctl.profile import load_profile

    profile = load_profile(Path(__file__).parent / "fixtures" / "profiles" / "llama8b_h100.yaml")
    root = triage_file("oom_peer", profile=profile).root_cause
    plan = root.data["plan"]
    assert plan["gpu_memory_bytes"] == parse_size("79.11 GiB") - 40 * 2**30
    assert plan["fits"] is False and plan["advice"]
    assert root.fix.startswith("set memory.micro_batch_size=")
    assert "planned peak" in root.fix and "usable" in root.fix


def test_fuzz_random_bytes_and_huge_lines_are_bounded():
    rng = random.Random(1234)
    blobs = [bytes(rng.getrandbits(8) for _ in range(200_000)).decode("utf-8", errors="replace"),
             "A" * 5_000_000,
             "CUDA out of memory. Tried to allocate " + "9" * 2_000_000 + " GiB",
             ("Watchdog caught collective operation timeout: WorkNCCL(" + "SeqNum=1, " * 300_000),
             "\n".join("[rank%d]: " % (i % 8) + "x" * rng.randint(0, 300) for i in range(50_000)),
             "NCCL error in: " + "a," * 1_000_000]
    for blob in blobs:
        start = time.perf_counter()
        result = triage_log(blob)
        assert time.perf_counter() - start < 10
        assert isinstance(result.findings, list)


@pytest.mark.parametrize("text, root_id, rank", [
    ("(RayWorkerVllm pid=5304) [E ProcessGroupNCCL.cpp:916] [Rank 7] NCCL watchdog thread terminated with exception: "
     "CUDA error: unknown error", "log.cuda.err", 7),
    ("gpu-1:812:812 [1] init.cc:704 NCCL WARN Duplicate GPU detected : rank 1 and rank 0 both on CUDA device 1a000",
     "log.nccl.dupgpu", None),
    ("stderr: [0]:\nstderr:   rank      : 1 (local_rank: 1)\nstderr:   exitcode  : -9 (pid: 226263)", "log.host.oom", 1),
    ("torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 50.00 MiB (GPU 0; 79.14 GiB total capacity; "
     "10.43 GiB already allocated; 15.19 MiB free; 10.80 GiB reserved in total by PyTorch) If reserved memory is >> "
     "allocated memory try setting max_split_size_mb to avoid fragmentation.", "log.oom.peer", None),
    ("RuntimeError: NCCL Error 2: unhandled system error", "log.nccl.sys", None),
    ("RuntimeError: DataLoader worker (pid 3321) is killed by signal: Killed.", "log.host.oom", None),
    ("[rank2]: torch.distributed.DistBackendError: [2] is setting up NCCL communicator and retrieving ncclUniqueId from "
     "[0] via c10d key-value store by key '0', but store->get('0') got error: Connection reset by peer", "log.dist.store", 2),
    ("RuntimeError: CUDA error: no kernel image is available for execution on the device", "log.cuda.arch", None),
])
def test_real_world_variants(text, root_id, rank):
    root = triage_log(text).root_cause
    assert (root.id, root.rank) == (root_id, rank)


def test_own_pid_listed_as_another_process_is_not_a_peer():
    text = ("torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 3.92 GiB. GPU 1 has a total capacity of "
            "39.39 GiB of which 2.00 MiB is free. Process 112077 has 39.38 GiB memory in use. Of the allocated memory 37.36 "
            "GiB is allocated by PyTorch, and 76.66 MiB is reserved by PyTorch but unallocated.")
    root = triage_log(text).root_cause
    assert root.id == "log.oom.cap"
    assert root.data["oom"]["peers"] == {} and root.data["oom"]["this_process"] == parse_size("39.38 GiB")


def test_blocking_wait_timeout_and_capitalised_progress():
    text = ("[rank3]:[E1002 18:16:40.711756918 ProcessGroupNCCL.cpp:756] [Rank 3] Work WorkNCCL(SeqNum=2521, "
            "OpType=ALLREDUCE, NumelIn=160672064, NumelOut=160672064, Timeout(ms)=600000) timed out in blocking wait.\n"
            "[rank1]:[E602 11:17:52.557 ProcessGroupNCCL.cpp:1743] [PG ID 0 PG GUID 0(default_pg) Rank 1] Received a dump "
            "signal due to a collective timeout from this local rank. Last enqueued NCCL work: 6, last completed NCCL work: 6.")
    found = {f.id: f for f in triage_log(text).findings}
    assert found["log.nccl.timeout"].data["first"]["seq"] == 2521
    assert found["log.nccl.timeout"].data["first"]["op"] == "ALLREDUCE"


def test_bitsandbytes_warning_does_not_hide_a_later_oom():
    text = ("UserWarning: The installed version of bitsandbytes was compiled without GPU support. 8-bit optimizers are "
            "unavailable.\n" + (LOGS / "oom_current_cap.log").read_text())
    assert triage_log(text).root_cause.id == "log.oom.cap"


def test_needle_prefilter_finds_exactly_the_lines_some_needle_is_in():
    import re

    from orbitctl.doctor.logscan import needle_pattern

    needles = {"nan", "nccl error", "nccl warn", "cuda error:", "cuda", "-9", ": inf"}
    trie = re.compile(needle_pattern(needles))
    naive = re.compile("|".join(map(re.escape, needles)))
    rng = random.Random(7)
    pool = sorted(needles) + ["nc", "cud", " ", ":", "i", "n", "-"]
    for _ in range(5000):
        text = "".join(rng.choice(pool) for _ in range(rng.randint(0, 8)))
        assert bool(trie.search(text)) == bool(naive.search(text)), text
    assert trie.search("loss: inf") and not trie.search("info nc cud")
