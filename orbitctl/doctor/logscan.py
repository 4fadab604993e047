"""Turn raw log text into signature events: line splitting, unwrapping, rank attribution.

Bounded work on hostile input: a line longer than MAX_LINE is examined in overlapping
windows, at most MAX_WINDOWS of them; every regex in the table is linear.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field

from orbitctl.doctor.findings import INFO
from orbitctl.doctor.signatures import SIGNATURES, Signature

MAX_LINE = 4096
OVERLAP = 512
MAX_WINDOWS = 64
MAX_LINES = 2_000_000

_RANK_RES = (
    re.compile(r"\[rank(\d{1,5})\]"),
    re.compile(r"\[default(\d{1,5})\]:"),
    re.compile(r"^\s*\[\d+,(\d{1,5})\]<std(?:out|err)>"),
    re.compile(r"\[(?:PG[^\]]{0,80}?)?Rank (\d{1,5})\]"),
    re.compile(r"^\s*[Rr]ank ?(\d{1,5})\s?:"),
    re.compile(r"--local_rank=(\d{1,5})"),
    re.compile(r"\brank=(\d{1,5})\b"),  # vLLM workers: "(VllmWorker rank=3 pid=1090)"
    re.compile(r"\(Worker(?:_PP\d{1,4})?_TP(\d{1,4})(?!\d)"),  # vLLM V1 workers: "(Worker_TP1 pid=15193)", "Worker_TP0_EP0"
    re.compile(r"\blocal_rank: (\d{1,5}) \(pid"),  # torchrun: "failed (exitcode: -9) local_rank: 3 (pid: 812917)"
    re.compile(r"^\s*\[[^\]]{0,40}?\bTP(\d{1,4})\]"),  # SGLang schedulers: "[2025-07-02 07:41:59 DP7 TP7]"
    re.compile(r"\bprocess rank (\d{1,5}) with PID"),  # mpirun: "mpirun noticed that process rank 1 with PID 6547 ..."
)
_NCCL_PID = re.compile(r"(?:^|\s)[\w.-]+:(\d+):\d+ \[\d+\] NCCL")
_NCCL_RANK_OF_PID = re.compile(r"(?:^|\s)[\w.-]+:(\d+):\d+ \[\d+\] NCCL INFO .{0,120}?\brank (\d+) nranks")
_ELASTIC_RANK = re.compile(r"(?:^|\s)rank\s*:\s*(\d+) \(local_rank")
_LINE_START = re.compile(
    r"^\s*(?:\[\d+\]\s*)?(?:\[rank\d+\]|\[default\d+\]|\[\d+,\d+\]<|\[?\d{4}-\d\d-\d\d|[EWIF]\d{4} |\[[EWIF]\d{0,4} |"
    r"Traceback|File \"|[\w.-]+:\d+:\d+ \[\d+\]|\w+:\d+:\d+|\(\w+ pid=)")
_PREFIX = re.compile(r"^(?:\[[^\]]{1,40}\]:)+\s*")
_ANSI = re.compile(r"\x1b\[[0-9;?]{0,20}[A-Za-z]")
_LAST_ERROR = re.compile(r"Last error:\s*(.*)$")
# the launcher's summary of a child that failed: never the cause itself
_LAUNCHER_ERRORS = {"ChildFailedError", "CalledProcessError", "ProcessRaisedException", "ProcessExitedException"}
_EXC_LINE = re.compile(r"^(?:[\w.]+\.)?(?P<cls>\w*(?:Error|Exception))(?::\s?(?P<msg>.*))?$")
# argparse prints "train.py: error: the following arguments are required: ..." and exits 2, with no traceback
_USAGE_ERROR = re.compile(r"^[\w./-]{1,200}\.py: error: \S")
# a traceback frame, and an exception line anywhere in a line (ranks' output may be glued together)
_FRAME = re.compile(r"File \"(?P<file>[^\"]{1,300})\", line (?P<line>\d+), in (?P<func>[\w<>.]+)|Traceback \(most recent call last\)")
_EXC_ANYWHERE = re.compile(r"(?:^|[\s\])>|:])(?:[A-Za-z_][\w.]*\.)?[A-Z]\w*(?:Error|Exception)(?::|\s*$)")
CUT_TAIL_LINES = 12
"""A traceback still open this close to the end of the log means the paste (or the process) was cut."""
CONTEXT_LINES = {"host.sigill": (8, 30), "pkg.mismatch": (40, 0), "cuda.toolkit": (0, 3), "host.oom": (60, 0)}
"""Lines (before, after) an event's line that triage reads with it (Event.window, newline-joined): the library a SIGILL
names on the lines around it, the traceback frames above an ImportError, the torch version a wrapped CUDA mismatch
message gives on its next line, and what the process was doing (loading a checkpoint) before the OOM killer."""


@dataclass
class Event:
    sig: Signature | None
    """None for findings a rule derives (no signature line of their own)."""
    line_no: int
    rank: int | None
    text: str
    groups: dict = field(default_factory=dict)
    window: str = ""
    detail: str | None = None


@dataclass
class Scan:
    events: list[Event] = field(default_factory=list)
    exceptions: list[tuple[int, int | None, str]] = field(default_factory=list)
    """(line, rank, text) of Python exception lines after a traceback that no signature explains."""
    lines: int = 0
    truncated_chars: int = 0
    open_traceback: tuple[int, str] | None = None
    """(line, last frame) when the log ends inside a traceback: the exception line that names the error is missing."""


def split_lines(text: str) -> list[str]:
    """Lines, also splitting on carriage returns (progress bars) and on literal '\\n' in huge escaped lines."""
    if "\x1b" in text:  # terminal colours pasted with the log would split words the regexes look for
        text = _ANSI.sub("", text)
    lines: list[str] = []
    for raw in text.split("\n"):
        for part in raw.split("\r"):
            if len(part) > MAX_LINE and "\\n" in part:
                lines.extend(part.split("\\n"))
            else:
                lines.append(part)
        if len(lines) > MAX_LINES:
            break
    return lines[:MAX_LINES]


def unwrap(lines: list[str]) -> list[str]:
    """Re-join a hard-wrapped paste: many lines of one exact width are pieces of longer lines."""
    widths = Counter(len(ln) for ln in lines if 60 <= len(ln) <= 400)
    if not widths:
        return lines
    width, count = widths.most_common(1)[0]
    long_lines = sum(widths.values())
    if count < 3 or count < 0.3 * long_lines:
        return lines
    out: list[str] = []
    joining = False
    for ln in lines:
        # records that merely share a length ("Sending process 484376 closing signal SIGTERM" x 7)
        # start alike; a wrapped piece does not start like the record it continues
        if joining and not _LINE_START.match(ln) and ln[:6] != out[-1][:6]:
            out[-1] += ln
        else:
            out.append(ln)
        joining = len(ln) == width and len(out[-1]) < 64 * MAX_LINE
    return out


def _windows(line: str) -> list[str]:
    if len(line) <= MAX_LINE:
        return [line]
    step = MAX_LINE - OVERLAP
    return [line[i:i + MAX_LINE] for i in range(0, min(len(line), step * MAX_WINDOWS), step)]


def line_rank(line: str, pid_rank: dict[str, int]) -> int | None:
    head = line[:400]
    for rx in _RANK_RES:
        m = rx.search(head)
        if m:
            return int(m.group(1))
    m = _NCCL_PID.search(head)
    if m and m.group(1) in pid_rank:
        return pid_rank[m.group(1)]
    return None


def needle_pattern(needles: set[str]) -> str:
    """One regex that finds any of ``needles``, as a trie: one branch per character instead of one per needle.

    Only whether some needle occurs matters, so a needle that is a prefix of others stands for them.
    """
    trie: dict = {}
    for needle in needles:
        node = trie
        for ch in needle:
            node = node.setdefault(ch, {})
        node[""] = {}

    def emit(node: dict) -> str:
        if "" in node:
            return ""
        alts = [re.escape(ch) + emit(child) for ch, child in sorted(node.items())]
        return alts[0] if len(alts) == 1 else "(?:" + "|".join(alts) + ")"

    return emit(trie)


# One pass over a line tells whether any signature could match; most lines of a log have no needle.
_ANY_NEEDLE = re.compile(needle_pattern({n for s in SIGNATURES for n in s.needles}))


def match_line(chunk: str) -> list[tuple[Signature, re.Match]]:
    low = chunk.lower()
    if not _ANY_NEEDLE.search(low):
        return []
    hits = []
    for sig in SIGNATURES:
        if any(n in low for n in sig.needles):
            m = sig.pattern.search(chunk)
            if m:
                hits.append((sig, m))
    dropped = {x for sig, _ in hits for x in sig.supersedes}
    return [(s, m) for s, m in hits if s.id not in dropped]


def scan_lines(lines: list[str]) -> Scan:
    scan = Scan(lines=len(lines))
    pid_rank: dict[str, int] = {}
    seen_traceback = False
    pending_last_error: Event | None = None
    last_error_event: Event | None = None
    elastic_rank: tuple[int, int] | None = None  # (line, rank) from a torchrun error summary
    tail = _TracebackTail()
    for no, line in enumerate(lines, start=1):
        if len(line) > MAX_LINE * MAX_WINDOWS:
            scan.truncated_chars += len(line) - MAX_LINE * MAX_WINDOWS
        stripped = line.strip()
        if m := _NCCL_RANK_OF_PID.search(line[:400]):
            pid_rank[m.group(1)] = int(m.group(2))
        if m := _ELASTIC_RANK.search(line[:200]):
            elastic_rank = (no, int(m.group(1)))
        if pending_last_error is not None and _PREFIX.sub("", stripped):
            pending_last_error.detail = _PREFIX.sub("", stripped)[:300]
            pending_last_error = None
        if "Last error:" in line and last_error_event is not None and no - last_error_event.line_no <= 12:
            rest = _LAST_ERROR.search(line[:MAX_LINE])
            if rest and rest.group(1).strip():
                last_error_event.detail = rest.group(1).strip()[:300]
            else:
                pending_last_error = last_error_event
        if "Traceback (most recent call last)" in line:
            seen_traceback = True
        elif len(scan.exceptions) < 50 and len(stripped) < 2000:
            body = _PREFIX.sub("", stripped)
            if seen_traceback and (m := _EXC_LINE.match(body)) and m.group("cls") and \
                    m.group("cls") not in _LAUNCHER_ERRORS and not match_line(body):
                scan.exceptions.append((no, line_rank(line, pid_rank), body[:300]))
            elif _USAGE_ERROR.match(body):
                scan.exceptions.append((no, line_rank(line, pid_rank), body[:300]))
        tail.track(no, line)
        rank = None
        rank_done = False
        seen_here: set[str] = set()
        for chunk in _windows(line):
            for sig, m in match_line(chunk):
                if sig.id in seen_here:  # overlapping windows of one long line
                    continue
                seen_here.add(sig.id)
                if not rank_done:
                    rank, rank_done = line_rank(line, pid_rank), True
                    if rank is None and elastic_rank and no - elastic_rank[0] <= 3:
                        rank = elastic_rank[1]
                ev = Event(sig, no, rank, stripped[:300], {k: v for k, v in m.groupdict().items() if v is not None})
                if sig.id in ("oom", "ray.oom"):  # the numbers follow on this line or the next few
                    ev.window = " ".join(x.strip() for x in lines[no - 1:no + 5])[:8 * MAX_LINE]
                elif sig.id in CONTEXT_LINES:
                    before, after = CONTEXT_LINES[sig.id]
                    ev.window = "\n".join(x[:MAX_LINE] for x in lines[max(0, no - 1 - before):no + after])
                if sig.id.startswith("nccl.") and sig.id in ("nccl.err", "nccl.sys", "nccl.cuda", "nccl.int", "nccl.remote"):
                    last_error_event = ev
                scan.events.append(ev)
                if sig.severity != INFO:
                    tail.closed(no)
    scan.open_traceback = tail.open_at_end(len(lines))
    return scan


class _TracebackTail:
    """Whether the log ends inside a traceback: a frame after the last exception line, near the end."""

    def __init__(self) -> None:
        self.frame: tuple[int, str] | None = None
        self.closed_at = 0

    def track(self, no: int, line: str) -> None:
        head = line[:MAX_LINE]
        m = _FRAME.search(head) if ('File "' in head or "Traceback" in head) else None
        if m is not None:
            where = f"{m.group('func')} ({m.group('file')}:{m.group('line')})" if m.group("func") else "Traceback"
            self.frame = (no, where)
        rest = head[m.end():] if m else head
        if ("Error" in rest or "Exception" in rest) and _EXC_ANYWHERE.search(rest):
            self.closed(no)

    def closed(self, no: int) -> None:
        self.closed_at = max(self.closed_at, no)

    def open_at_end(self, total: int) -> tuple[int, str] | None:
        if self.frame is None or self.frame[0] <= self.closed_at or total - self.frame[0] > CUT_TAIL_LINES:
            return None
        return self.frame
