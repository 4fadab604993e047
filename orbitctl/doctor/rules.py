"""Rules across signatures: where a failure sits in the log changes what it means.

- The first transport error or collective timeout within SYNC_WINDOW lines of the trainer pushing
  weights to a rollout engine is a weight-sync failure (log.sync.weights), not a fabric one; the
  transport findings it explains are shown as WARN "seen during the weight sync".
- ZeRO-3's "Invalidate trace cache" followed by collective timeouts is a stage-3 hang (log.zero3.hang).
- A launcher summary (torchrun, DeepSpeed) names the rank that exited and its exit code; an
  exception printed before it is the cause, and gets that rank when it names none.
- A log that ends inside a traceback, with no confident cause, lost the line that says what failed
  (log.cut: WARN, never a guess).
- Triton's "PTXAS error" beside ptxas's own "Value 'sm_XX' is not defined" is one failure: the compile
  finding is shown as WARN "the same failure: see log.triton.ptxas".
"""

from __future__ import annotations

from orbitctl.doctor.findings import FAIL, INFO, WARN
from orbitctl.doctor.groups import Group
from orbitctl.doctor.logscan import Event, Scan
from orbitctl.doctor.signatures import BY_ID

CONSEQUENCE_PRIORITY = 50
"""Below this priority a finding is a consequence when a stronger cause is in the same log."""
SYNC_WINDOW = 40
SYNC_PRIORITY = 69
"""Above the InfiniBand transport error (68) it explains."""
TRANSPORT_IDS = ("log.nccl.ib", "log.nccl.sock", "log.nccl.sys", "log.nccl.err", "log.nccl.int", "log.nccl.remote",
                 "log.dist.store", "log.nccl.timeout", "log.nccl.pg", "log.nccl.stuck", "log.nccl.abort")
TIMEOUT_IDS = ("log.nccl.timeout", "log.nccl.pg", "log.nccl.stuck")
EXIT_MEANING = {1: "a Python exception in that rank", 2: "a usage error (bad command-line arguments)",
                -6: "SIGABRT: an abort in native code (a failed check, or a watchdog taking the process down)",
                -15: "SIGTERM: the launcher stopped it after another rank failed"}


def apply_rules(groups: dict[str, Group], scan: Scan) -> None:
    """Add the findings the rules derive, and mark the ones they explain; ``groups`` is changed in place."""
    _weight_sync(groups)
    _zero3_hang(groups)
    _launcher(groups, scan)
    _cut(groups, scan)
    _ptxas(groups)


def strongest(groups: dict[str, Group], exclude: tuple[str, ...] = ()) -> int:
    """The highest priority among non-INFO findings (0 when none)."""
    return max((g.priority for g in groups.values() if g.severity != INFO and g.id not in exclude), default=0)


def launcher_rank(groups: dict[str, Group]) -> int | None:
    """The one rank a launcher summary names, if it names exactly one."""
    g = groups.get("log.launcher")
    return g.ranks[0] if g is not None and len(g.ranks) == 1 else None


def _derived(gid: str, title: str, severity: str, priority: int, fix: str, events: list[Event]) -> Group:
    g = Group(gid, title, severity, priority, fix, events=sorted(events, key=lambda e: e.line_no))
    first = g.events[0]
    g.evidence.append(f"line {first.line_no}: {first.text}")
    return g


def _weight_sync(groups: dict[str, Group]) -> None:
    ctx = groups.get("log.sync.ctx")
    transport = [g for gid in TRANSPORT_IDS if (g := groups.get(gid)) is not None]
    if ctx is None or not transport or strongest(groups, TRANSPORT_IDS) > SYNC_PRIORITY:
        return
    first = min((e for g in transport for e in g.events), key=lambda e: e.line_no)
    near = [c for c in ctx.events if abs(c.line_no - first.line_no) <= SYNC_WINDOW]
    if not near:
        return  # the first failure is away from any weight sync: the fabric (or a peer) broke
    sync = BY_ID["sync.ctx"]
    hits = [e for g in transport for e in g.events if any(abs(c.line_no - e.line_no) <= SYNC_WINDOW for c in ctx.events)]
    g = _derived("log.sync.weights", "the trainer -> rollout engine weight sync failed (its group timed out or its "
                 "transport broke), not the training fabric", FAIL, SYNC_PRIORITY, SYNC_FIX, hits)
    ctx_line = min(near, key=lambda c: abs(c.line_no - first.line_no))
    g.evidence.append(f"during the weight sync: line {ctx_line.line_no}: {ctx_line.text}")
    g.evidence.append(f"{sync.cause}; the first transport failure is {abs(ctx_line.line_no - first.line_no)} line(s) "
                      "from it")
    groups[g.id] = g
    for t in transport:
        t.note = "seen during the weight sync: see log.sync.weights"


SYNC_FIX = ("Check the weight-sync group, not the fabric: every engine rank must join it (same world size and group "
            "name on both sides); pass the NCCL settings to the engine's Ray actors as well (runtime_env env_vars: "
            "NCCL_SOCKET_IFNAME, NCCL_IB_HCA, NCCL_IB_GID_INDEX; actors do not inherit the driver's shell); the sync "
            "group's master address must be reachable from the engine (not a container-only IP such as 172.17.x); use "
            "one NCCL version in trainer and engine; a colocated engine can take the weights by CUDA IPC instead of a "
            "NIC; on timeouts raise the sync group's timeout and make sure the engine is awake (not generating or "
            "asleep) when the trainer broadcasts")


def _zero3_hang(groups: dict[str, Group]) -> None:
    trace = groups.get("log.zero3.trace")
    timeouts = [g for gid in TIMEOUT_IDS if (g := groups.get(gid)) is not None]
    if trace is None or not timeouts:
        return
    hang = groups.get("log.zero3.hang")
    sig = BY_ID["zero3.hang"]
    if hang is None:
        hang = groups["log.zero3.hang"] = _derived("log.zero3.hang", sig.cause, FAIL, sig.priority, sig.fix,
                                                   list(trace.events))
    later = min(e.line_no for g in timeouts for e in g.events)
    hang.evidence.append(f"the prefetch trace changed at line {trace.first_line}, then collectives timed out "
                         f"(line {later}): the ranks ran different modules")
    trace.note = "see log.zero3.hang"


def _launcher(groups: dict[str, Group], scan: Scan) -> None:
    g = groups.get("log.launcher")
    if g is None:
        return
    codes = sorted({int(c) for e in g.events for c in (e.groups.get(k) for k in ("code", "code2", "code3")) if c})
    for code in codes:
        g.evidence.append(f"exit code {code}: {EXIT_MEANING.get(code, 'see the rank output')}")
    g.data["exit_codes"] = codes
    if scan.exceptions:
        no, _, body = scan.exceptions[0]
        g.title = "the launcher's summary of the rank that failed (its error is earlier in the log)"
        g.evidence.append(f"the error before it: line {no}: {body}")


def _cut(groups: dict[str, Group], scan: Scan) -> None:
    if scan.open_traceback is None or strongest(groups) > CONSEQUENCE_PRIORITY:
        return
    no, where = scan.open_traceback
    g = Group("log.cut", "the log ends inside a traceback: the line that says what failed is missing", WARN, 8,
              "Get the complete output of the failing process (the paste or the log was cut, or the process was killed "
              "while writing): torchrun --redirect 3 --log-dir DIR, the Ray worker's .err file, or rerun with "
              "PYTHONUNBUFFERED=1", events=[Event(None, no, None, where)])
    g.evidence.append(f"line {no}: last frame {where}; no exception line follows it")
    groups[g.id] = g


def _ptxas(groups: dict[str, Group]) -> None:
    if "log.triton.ptxas" in groups and "log.triton.compile" in groups:
        groups["log.triton.compile"].note = "the same failure: see log.triton.ptxas"
