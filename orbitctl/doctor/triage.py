"""Log triage: classify a failed run's log and rank the root cause above its consequences.

    from orbitctl.doctor import triage_log
    result = triage_log(open("train.log").read(), profile=profile)
    result.root_cause.id   # e.g. 'log.oom.cap', with .rank = 3
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from orbitctl.doctor import env_crash
from orbitctl.doctor.engine import ENGINE_IDS, message_advice, plan_advice
from orbitctl.doctor.findings import FAIL, INFO, WARN, Finding
from orbitctl.doctor.groups import Group, ranges
from orbitctl.doctor.logscan import Event, Scan, scan_lines, split_lines, unwrap
from orbitctl.doctor.oom import FIX_BY_KIND, OomDetails, parse_oom
from orbitctl.doctor.rules import CONSEQUENCE_PRIORITY, apply_rules, launcher_rank
from orbitctl.doctor.signatures import FAQ_OOM, RAY_NODE_MEMORY
from orbitctl.doctor.xid import classify_xid

# An unexplained Python exception outranks peers exiting and timeouts, and nothing else.
EXCEPTION_PRIORITY = 33
OOM_TITLES = {"frag": "GPU out of memory: fragmentation", "cap": "GPU out of memory: the run needs more than the GPU has",
              "peer": "GPU out of memory: another process holds the memory", "unknown": "GPU out of memory"}
MEMORY_IDS = ("log.oom.frag", "log.oom.cap", "log.oom.peer", "log.oom", "log.oom.raw", "log.ds.flush")
LOSS_SCALE_FLOOR = 8.0
"""A dynamic fp16 loss scale at or below this has collapsed (DeepSpeed's floor is 1; start-up settles far higher)."""


@dataclass
class LogTriage:
    findings: list[Finding] = field(default_factory=list)
    root_cause: Finding | None = None
    lines: int = 0


def triage_log(text: str, *, profile: Any = None) -> LogTriage:
    """Classify every signature in ``text``; findings are ordered root cause first."""
    lines = unwrap(split_lines(text))
    scan = scan_lines(lines)
    groups = _group(scan)
    apply_rules(groups, scan)
    out = LogTriage(lines=scan.lines)
    causes = [g for g in groups.values() if g.severity != INFO]
    root = max(causes, key=lambda g: (g.priority, -g.first_line)) if causes else None
    if scan.exceptions and (root is None or root.priority <= EXCEPTION_PRIORITY):
        # a rank died of an ordinary Python error and the others then timed out: the error is the cause
        no, rank, body = scan.exceptions[0]
        rank = launcher_rank(groups) if rank is None else rank
        severity = FAIL if root is not None else WARN
        exc = Group("log.exception", "a rank raised an exception no signature knows", severity, EXCEPTION_PRIORITY,
                    "Read the traceback above this line and fix that error; the NCCL messages after it follow from "
                    "the rank that stopped")
        exc.events.append(Event(None, no, rank, body))
        exc.evidence.append(f"line {no}: {body}")
        groups[exc.id] = root = exc
    if not groups:
        return out
    if root is not None and root.id in MEMORY_IDS and profile is not None:
        _add_plan_advice(root, profile)
    if root is not None and root.id in ENGINE_IDS and profile is not None:
        plan_advice(root, profile)
    ordered = sorted(groups.values(), key=lambda g: (g is not root, -g.priority, g.first_line))
    for g in ordered:
        status = g.severity
        evidence = list(g.evidence)
        if g.note and g is not root and status != INFO:
            status = WARN
            evidence.append(g.note)
        elif root is not None and g is not root and g.priority < min(root.priority, CONSEQUENCE_PRIORITY + 1) \
                and status != INFO:
            status = WARN
            evidence.append(f"likely a consequence of {root.id}" + (f" on rank {root.ranks[0]}" if root.ranks else ""))
        rank = g.ranks[0] if len(g.ranks) == 1 else None
        for key in ("straggler_ranks", "missing_ranks"):
            if rank is None and len(g.data.get(key, [])) == 1:
                rank = g.data[key][0]
        if rank is None and g.ranks and g.id not in ("log.nccl.timeout", "log.nccl.pg", "log.nccl.stuck"):
            rank = g.events[0].rank  # the first rank that hit it (the others may follow from it)
        f = Finding(g.id, "log", status, g.title, evidence, g.fix, rank, {**g.data, "ranks": g.ranks, "count": len(g.events), "first_line": g.first_line})
        out.findings.append(f)
        if g is root:
            out.root_cause = f
    if scan.truncated_chars:
        out.findings.append(Finding("log.truncated", "log", INFO, "very long lines were cut",
                                    [f"{scan.truncated_chars} characters beyond the examined windows were skipped"]))
    return out


def _group(scan: Scan) -> dict[str, Group]:
    groups: dict[str, Group] = {}
    for ev in scan.events:
        gid, title, severity, priority, fix = _classify(ev)
        g = groups.get(gid)
        if g is None:
            g = groups[gid] = Group(gid, title, severity, priority, fix)
            g.evidence.append(f"line {ev.line_no}: {ev.text}")
        g.events.append(ev)
        if severity == FAIL and g.severity != FAIL:  # xid groups take the worst code, loss scales the lowest
            g.title, g.severity, g.priority, g.fix = title, severity, max(priority, g.priority), fix
    for g in groups.values():
        _enrich(g, groups)
    if "log.nccl.timeout" in groups and "log.nccl.pg" in groups:
        groups.pop("log.nccl.pg")
    return groups


def _classify(ev: Event) -> tuple[str, str, str, int, str]:
    sig = ev.sig
    if sig.id == "oom":
        d = parse_oom(ev.window or ev.text)
        ev.groups["oom"] = d
        kind = d.kind if d.kind != "unknown" else None
        fix = FIX_BY_KIND.get(d.kind, FAQ_OOM)
        return (f"log.oom.{kind}" if kind else "log.oom"), OOM_TITLES[d.kind], FAIL, sig.priority, fix
    if sig.id == "xid":
        # a teardown Xid (45, 43) that names the fault behind it is classified as that fault
        code = int(ev.groups.get("prev") or ev.groups.get("xid", 79))
        severity, meaning, fix = classify_xid(code)
        ev.groups["xid_code"] = code
        priority = {FAIL: 100, WARN: 60, INFO: 15}[severity]
        return "log.xid", f"Xid {code}: {meaning}", severity, priority, fix
    if sig.id == "ray.oom":  # host RAM like the kernel's OOM killer, with Ray's own cause and fix
        return "log.host.oom", sig.cause, sig.severity, sig.priority, sig.fix
    if sig.id == "train.scale":
        scale = float(ev.groups.get("to") or ev.groups.get("to2"))
        ev.groups["scale"] = scale
        if scale > LOSS_SCALE_FLOOR:
            return "log.train.scale", "fp16 loss scale reduced after an overflow (routine while it stays high)", INFO, 0, \
                "Nothing to do while the scale stays in the thousands; see it again if it keeps halving"
    return f"log.{sig.id}", sig.cause, sig.severity, sig.priority, sig.fix


def _enrich(g: Group, groups: dict[str, Group]) -> None:
    ranks = g.ranks
    if ranks:
        g.evidence.append(f"rank(s) {ranges(ranks)}; {len(g.events)} line(s)")
    elif len(g.events) > 1:
        g.evidence.append(f"{len(g.events)} line(s)")
    first = g.events[0]
    if "oom" in first.groups:
        d: OomDetails = first.groups["oom"]
        g.evidence.extend(d.reasons)
        g.data["oom"] = d.to_dict()
    elif g.id == "log.xid":
        codes = sorted({e.groups["xid_code"] for e in g.events})
        g.evidence.append("Xid codes: " + ", ".join(str(c) for c in codes))
        g.data["xids"] = codes
    elif g.id in ("log.nccl.timeout", "log.nccl.pg"):
        g.data.update(_progress(groups))
        g.evidence.extend(g.data.pop("lines", []))
    elif g.id == "log.train.scale":
        scales = [e.groups["scale"] for e in g.events]
        g.data.update(lowest=min(scales), last=scales[-1])
        g.evidence.append(f"loss scale down to {min(scales):g} after {len(scales)} overflow(s)")
    elif g.id in GPU_PATH_IDS:
        _gpu_path_numbers(g)
    elif g.id in ENGINE_IDS:
        message_advice(g)
    elif g.id in env_crash.IDS:
        env_crash.enrich(g)
    elif g.id == "log.host.oom":
        g.data["ray_memory_monitor"] = any(e.sig is not None and e.sig.id == "ray.oom" for e in g.events)
        env_crash.host_oom(g)
        node = next((m for m in (RAY_NODE_MEMORY.search(e.window or e.text) for e in g.events) if m), None)
        if node is not None:
            g.data["ray_node_memory"] = {"used": node["used"], "total": node["total"], "fraction": float(node["frac"]),
                                         "threshold": float(node["thr"])}
            g.evidence.append(f"node memory {node['used']} / {node['total']} ({float(node['frac']):.3f}) over Ray's "
                              f"threshold {node['thr']} (RAY_memory_usage_threshold)")
    details = sorted({e.detail for e in g.events if e.detail})
    if details:
        g.evidence.append("Last error: " + " | ".join(details[:3]))
    if g.id == "log.nccl.cudaf":
        errs = sorted({e.groups.get("err", "") for e in g.events} - {""})
        g.evidence.append("CUDA errors: " + ", ".join(errs[:5]))


GPU_PATH_IDS = ("log.triton.smem", "log.triton.ptxas", "log.int4.marlin")


def _gpu_path_numbers(g: Group) -> None:
    """The numbers a GPU-path failure prints: shared memory asked for and present, the arch ptxas did not know, the
    Marlin size that is no multiple of its tile."""
    found = [e.groups for e in g.events]
    if g.id == "log.triton.smem":
        m = next((x for x in found if x.get("req")), None)
        if m is not None:
            g.data["shared_memory"] = {"required": int(m["req"]), "limit": int(m["limit"])}
            g.evidence.append(f"the kernel needs {m['req']} bytes of shared memory; the GPU has {m['limit']}")
    elif g.id == "log.triton.ptxas":
        arch = next((x["arch"] for x in found if x.get("arch")), None)
        if arch is not None:
            g.data["arch"] = arch
            g.evidence.append(f"this ptxas does not know {arch}")
    else:
        m = next((x for x in found if x.get("size") or x.get("size2")), None)
        if m is not None:
            size, div = int(m.get("size") or m["size2"]), int(m.get("div") or m["div2"])
            g.data["marlin"] = {"size": size, "multiple_of": div, "remainder": size % div}
            g.evidence.append(f"a rank's slice of {size} is not a multiple of the kernel's {div} "
                              f"(remainder {size % div})")


def _progress(groups: dict[str, Group]) -> dict[str, Any]:
    """Watchdog SeqNum/OpType per rank and the straggler (lowest last-completed work)."""
    data: dict[str, Any] = {"lines": []}
    timeout = groups.get("log.nccl.timeout")
    reporting: dict[int, dict] = {}
    for e in timeout.events if timeout else []:
        args = e.groups.get("a") or e.groups.get("a2", "")
        seq = re.search(r"SeqNum=(\d+)", args)
        op = re.search(r"OpType=(\w+)", args)
        tmo = re.search(r"Timeout\(ms\)=(\d+)", args)
        info = {"seq": int(seq.group(1)) if seq else None, "op": op.group(1) if op else None,
                "timeout_ms": int(tmo.group(1)) if tmo else None, "ran_ms": int(e.groups.get("ms", 0))}
        if e.rank is not None and e.rank not in reporting:
            reporting[e.rank] = info
        data.setdefault("first", info)
    if timeout:
        first = data["first"]
        data["lines"].append(f"first timeout: SeqNum={first['seq']} OpType={first['op']} after {first['ran_ms']} ms "
                             f"(timeout {first['timeout_ms']} ms)")
        seqs = {r: i["seq"] for r, i in reporting.items() if i["seq"] is not None}
        if len(set(seqs.values())) > 1:
            low = min(seqs.values())
            behind = sorted(r for r, s in seqs.items() if s == low)
            data["lines"].append(f"ranks wait on different collectives (SeqNum {low}..{max(seqs.values())}): ranks "
                                 f"{ranges(behind)} are behind, or the ranks call collectives in a different order")
            data["straggler_ranks"] = behind
    done: dict[int, int] = {}
    for e in groups.get("log.nccl.pg").events if "log.nccl.pg" in groups else []:
        if e.rank is not None and "done" in e.groups:
            value = int(e.groups["done"])
            done[e.rank] = min(value, done.get(e.rank, value))
    if done:
        low, high = min(done.values()), max(done.values())
        if low < high:
            stragglers = sorted(r for r, v in done.items() if v == low)
            data["straggler_ranks"] = stragglers
            data["lines"].append(f"straggler: rank(s) {ranges(stragglers)} last completed work {low}, others up to {high}")
        else:
            data["lines"].append(f"every reporting rank completed work {low}: the collective after it hung on all of them")
    known = set(reporting) | set(done)
    if known and timeout:
        world = max(known) + 1
        missing = sorted(set(range(world)) - set(reporting))
        if missing and len(reporting) >= 2:
            data["missing_ranks"] = missing
            data["lines"].append(f"rank(s) {ranges(missing)} never reported the timeout: look there first "
                                 "(crashed, hung in compute, or a different collective)")
    data["reporting_ranks"] = sorted(reporting)
    return data


def _add_plan_advice(g: Group, profile: Any) -> None:
    from orbitctl.doctor.replan import replan

    memory = None
    d = g.events[0].groups.get("oom")
    if isinstance(d, OomDetails) and d.total:
        memory = d.total - d.peer_bytes
    if memory is None:
        memory = profile.hardware.memory_bytes()
    verdict = replan(profile, memory)
    g.data["plan"] = {"gpu_memory_bytes": verdict.gpu_memory_bytes, "fits": verdict.fits, "peak_bytes": verdict.peak_bytes,
                      "usable_bytes": verdict.usable_bytes, "advice": verdict.advice, "set": verdict.set_flags}
    g.evidence.append("plan for this GPU: " + verdict.summary())
    if verdict.advice:
        g.fix = "; ".join(verdict.advice[:3]) + (f" (orbitctl plan PROFILE --set {' --set '.join(verdict.set_flags)})"
                                                 if verdict.set_flags else "") + ". " + g.fix
    elif verdict.available and verdict.fits:
        g.fix = ("The plan fits on paper but the run used more: set memory.max_hbm_utilization=0.8 and re-plan "
                 "(orbitctl plan PROFILE). " + g.fix)
