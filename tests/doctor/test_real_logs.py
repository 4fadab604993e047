"""Root causes named for failure logs copied from public issue threads (tests/doctor/fixtures/real).

Each log's expected root cause was chosen from what its thread settled on; index.json records the
source. benchmarks/doctor_real_logs.py prints the same comparison as a table.
"""

import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).parents[2] / "benchmarks" / "doctor_real_logs.py"
_spec = importlib.util.spec_from_file_location("doctor_real_logs", BENCH)
real = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = real  # its dataclasses look their module up by name
_spec.loader.exec_module(real)

INDEX = real.load_index()
REQUIRED_ACCURACY = 0.9


def test_the_set_is_large_and_varied():
    expected = {e["expected"] for e in INDEX}
    assert len(INDEX) >= 40
    assert len({e["source"]["repo"] for e in INDEX}) >= 20
    # every family the doctor promises to recognise appears, and clean logs too
    assert {None, "log.oom.cap", "log.oom.raw", "log.host.oom", "log.ds.flush", "log.nccl.timeout", "log.nccl.shm",
            "log.nccl.ib", "log.nccl.if", "log.nccl.p2p", "log.port", "log.cuda.ima", "log.cuda.assert", "log.cuda.arch",
            "log.cuda.drv", "log.cuda.802", "log.cuda.ecc", "log.xid", "log.bnb"} <= expected
    assert all((real.REAL_LOGS / e["file"]).is_file() for e in INDEX)


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
