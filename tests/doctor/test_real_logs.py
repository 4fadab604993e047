"""Root causes named for failure logs copied from public issue threads (tests/doctor/fixtures/real).

Each log's expected root cause was chosen from what its thread settled on; index.json records the
source. benchmarks/doctor_real_logs.py prints the same comparison as a table. The RL-stack entries
carry 'categories' (engine, lora, zero3, ray, numerics, checkpoint, sync, launcher, interleaving,
cut, clean, and the GPU paths: collective, cudagraph, triton, int4): every category has at least two
logs, and a log whose fatal line is missing ('cut') never gets a confident cause. The environment's
crashes (sigill, versions, cuda_toolkit, flash_abi, ext_abi, host_oom) each have at least two public threads.
"""

import importlib.util
import sys
from pathlib import Path

import pytest

from orbitctl.doctor import FAIL, UNKNOWN, WARN, triage_log

BENCH = Path(__file__).parents[2] / "benchmarks" / "doctor_real_logs.py"
_spec = importlib.util.spec_from_file_location("doctor_real_logs", BENCH)
real = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = real  # its dataclasses look their module up by name
_spec.loader.exec_module(real)

INDEX = real.load_index()
REQUIRED_ACCURACY = 0.9
RL_CATEGORIES = ("engine", "lora", "zero3", "ray", "numerics", "checkpoint", "sync", "launcher", "interleaving", "cut",
                 "clean", "collective", "cudagraph", "triton", "int4")
RL_IDS = {"log.oom.kv", "log.kv.len", "log.kv.util", "log.lora.rank", "log.lora.modules", "log.lora.unsupported",
          "log.lora.mismatch", "log.zero3.gather", "log.zero3.ckpt", "log.zero3.hang", "log.ray.threads", "log.ray.died",
          "log.train.scale", "log.train.nan", "log.ckpt.nospace", "log.ckpt.write", "log.ckpt.corrupt", "log.ckpt.perm",
          "log.sync.weights", "log.launcher", "log.exception", "log.cut",
          # the GPU paths
          "log.nccl.cpu", "log.cuda.graph", "log.triton.smem", "log.triton.ptxas", "log.triton.compile",
          "log.int4.pack", "log.int4.marlin"}


def test_the_set_is_large_and_varied():
    expected = {e["expected"] for e in INDEX}
    assert len(INDEX) >= 40
    assert len({e["source"]["repo"] for e in INDEX}) >= 20
    # every family the doctor promises to recognise appears, and clean logs too
    assert {None, "log.oom.cap", "log.oom.raw", "log.host.oom", "log.ds.flush", "log.nccl.timeout", "log.nccl.shm",
            "log.nccl.ib", "log.nccl.if", "log.nccl.p2p", "log.port", "log.cuda.ima", "log.cuda.assert", "log.cuda.arch",
            "log.cuda.drv", "log.cuda.802", "log.cuda.ecc", "log.xid", "log.bnb"} <= expected
    assert all((real.REAL_LOGS / e["file"]).is_file() for e in INDEX)


def _by_category(category):
    return [e for e in INDEX if category in e.get("categories", ())]


@pytest.mark.parametrize("category", RL_CATEGORIES)
def test_every_rl_category_has_two_real_logs_with_their_source(category):
    entries = _by_category(category)
    assert len(entries) >= 2
    assert all(e["source"]["url"].startswith(f"https://github.com/{e['source']['repo']}/") for e in entries)
    assert len({e["source"]["url"] for e in entries}) == len(entries)


# the environment's crashes: each kind, its finding, and at least two public threads (a recorded line may add to them)
ENV_CATEGORIES = {"sigill": "log.host.sigill", "versions": "log.pkg.mismatch", "cuda_toolkit": "log.cuda.toolkit",
                  "flash_abi": "log.flash.abi", "ext_abi": "log.ext.abi", "host_oom": "log.host.oom"}


@pytest.mark.parametrize("category", sorted(ENV_CATEGORIES))
def test_every_environment_crash_has_two_public_threads_and_is_named(category):
    entries = _by_category(category)
    public = [e for e in entries if e["source"].get("url")]
    assert len({e["source"]["url"] for e in public}) >= 2
    assert all(e["source"]["url"].startswith(f"https://github.com/{e['source']['repo']}/") for e in public)
    recorded = [e for e in entries if not e["source"].get("url")]
    assert all(e["source"].get("recorded") for e in recorded)  # a non-public line says where it was recorded
    assert [(e["file"], real.triage_one(e).got) for e in entries
            if real.triage_one(e).got != ENV_CATEGORIES[category]] == []


def test_rl_set_names_every_new_root_cause():
    expected = {e["expected"] for e in INDEX if e.get("categories")}
    assert RL_IDS <= expected
    outcomes = [real.triage_one(e) for e in INDEX if e.get("categories")]
    assert [(o.file, o.expected, o.got) for o in outcomes if not o.ok] == []


@pytest.mark.parametrize("entry", [pytest.param(e, id=e["file"][:-4]) for e in _by_category("cut")])
def test_a_log_missing_its_fatal_line_is_never_a_confident_cause(entry):
    result = triage_log((real.REAL_LOGS / entry["file"]).read_text(encoding="utf-8"))
    assert result.root_cause is not None and result.root_cause.status in (WARN, UNKNOWN)
    assert [f.id for f in result.findings if f.status == FAIL] == []
    assert "not in this log" in result.root_cause.title or "missing" in result.root_cause.title


def test_accuracy_on_real_logs():
    outcomes = real.run()
    misses = [(o.file, o.expected, o.got) for o in outcomes if not o.ok]
    assert real.accuracy(outcomes) >= REQUIRED_ACCURACY, misses


def _case(entry):
    # a miss the index documents stays visible, and turns into a failure once it is fixed (strict)
    marks = [pytest.mark.xfail(reason=entry["known_miss"], strict=True)] if entry.get("known_miss") else []
    return pytest.param(entry, id=entry["file"][:-4], marks=marks)


@pytest.mark.parametrize("entry", [_case(e) for e in INDEX])
def test_root_cause(entry):
    outcome = real.triage_one(entry)
    assert outcome.cause_ok, f"expected {outcome.expected}, got {outcome.got}"
    if outcome.expected_rank is not None:
        assert outcome.got_rank == outcome.expected_rank
