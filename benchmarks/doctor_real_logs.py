"""How often `orbitctl doctor --log` names the right root cause on real failure logs.

The logs in tests/doctor/fixtures/real/ were copied from public issue threads; index.json holds,
for each, the root cause the thread settled on (a finding id, or null for a clean log) and the
rank when the log shows it. Run:

    .venv/bin/python benchmarks/doctor_real_logs.py          # table and accuracy
    .venv/bin/python benchmarks/doctor_real_logs.py --misses # only the logs it gets wrong

The last lines give the same counts per category of index.json (the RL stack's, the GPU paths' and the
environment's crashes: sigill, versions, cuda_toolkit, flash_abi, host_oom).
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REAL_LOGS = Path(__file__).resolve().parent.parent / "tests" / "doctor" / "fixtures" / "real"
# 'log.oom' in the index means "an OOM" when the thread does not say which kind; the kind is then
# the doctor's own reading of the numbers and any of them counts.
OOM_KINDS = {"log.oom", "log.oom.cap", "log.oom.frag", "log.oom.peer"}


@dataclass
class Outcome:
    file: str
    expected: str | None
    expected_rank: int | None
    got: str | None
    got_rank: int | None
    fails: int

    @property
    def cause_ok(self) -> bool:
        if self.expected is None:
            return self.got is None and self.fails == 0
        if self.expected == "log.oom":
            return self.got in OOM_KINDS
        return self.got == self.expected

    @property
    def ok(self) -> bool:
        return self.cause_ok and (self.expected_rank is None or self.got_rank == self.expected_rank)


def load_index(root: Path = REAL_LOGS) -> list[dict]:
    return json.loads((root / "index.json").read_text(encoding="utf-8"))["logs"]


def triage_one(entry: dict, root: Path = REAL_LOGS) -> Outcome:
    from orbitctl.doctor import FAIL, triage_log

    text = (root / entry["file"]).read_text(encoding="utf-8", errors="replace")
    result = triage_log(text)
    rc = result.root_cause
    fails = sum(1 for f in result.findings if f.status == FAIL)
    return Outcome(entry["file"], entry["expected"], entry.get("rank"), rc.id if rc else None,
                   rc.rank if rc else None, fails)


def run(root: Path = REAL_LOGS) -> list[Outcome]:
    return [triage_one(e, root) for e in load_index(root)]


def accuracy(outcomes: list[Outcome]) -> float:
    return sum(o.ok for o in outcomes) / len(outcomes) if outcomes else 0.0


def main(argv: list[str]) -> int:
    only_misses = "--misses" in argv
    start = time.perf_counter()
    outcomes = run()
    elapsed = time.perf_counter() - start
    width = max(len(o.file) for o in outcomes)
    print(f"{'file':<{width}}  {'expected':<18} {'got':<18} ok")
    for o in outcomes:
        if only_misses and o.ok:
            continue
        exp = f"{o.expected}" + (f"@{o.expected_rank}" if o.expected_rank is not None else "")
        got = f"{o.got}" + (f"@{o.got_rank}" if o.got_rank is not None else "")
        print(f"{o.file:<{width}}  {exp:<18} {got:<18} {'yes' if o.ok else 'NO'}")
    cause = sum(o.cause_ok for o in outcomes)
    print(f"\nlogs: {len(outcomes)}  root cause right: {cause}/{len(outcomes)} ({cause / len(outcomes):.1%})  "
          f"cause and rank right: {sum(o.ok for o in outcomes)}/{len(outcomes)} ({accuracy(outcomes):.1%})  "
          f"time: {elapsed:.2f} s")
    by_category: dict[str, list[Outcome]] = {}
    for entry, outcome in zip(load_index(), outcomes):
        for category in entry.get("categories", ()):
            by_category.setdefault(category, []).append(outcome)
    if by_category:
        print("by category: " + ", ".join(f"{c} {sum(o.ok for o in rows)}/{len(rows)}"
                                          for c, rows in sorted(by_category.items())))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
