"""The run state of a conversion: plan, progress log, manifest and verification.

- ``.orbitctl-quantize-plan.json`` is written first: source fingerprint, options, and which
  tensors go into which shard. A rerun with the same source and options finds it and resumes.
- ``.orbitctl-quantize-progress.jsonl`` gets one line per finished shard (after the rename),
  with its sha256 and the report rows of its tensors.
- ``quant_manifest.json`` is written last; its presence means the output is complete. The plan
  and progress files are then removed, so a resumed run leaves the same files as a clean one.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from orbitctl.errors import CheckFailed, InputFileError
from orbitctl.rundir import jsonl_records, read_json_or_none

PLAN_NAME = ".orbitctl-quantize-plan.json"
PROGRESS_NAME = ".orbitctl-quantize-progress.jsonl"
MANIFEST_NAME = "quant_manifest.json"
REPORT_NAME = "quant_report.json"
MANIFEST_VERSION = 1


def sha256_file(path: Path, chunk: int = 16 * 1024 * 1024) -> str:
    h = hashlib.sha256()
    buf = bytearray(chunk)  # one buffer for the whole file: no fresh pages per block
    view = memoryview(buf)
    with path.open("rb") as f:
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def append_progress(out: Path, record: dict) -> None:
    with (out / PROGRESS_NAME).open("a") as f:
        f.write(json.dumps(record, sort_keys=True) + "\n")
        f.flush()
        os.fsync(f.fileno())


def read_progress(out: Path) -> dict[str, dict]:
    """Finished shards by file name; a torn last line (killed mid-write) is ignored."""
    path = out / PROGRESS_NAME
    done: dict[str, dict] = {}
    if not path.exists():
        return done
    for line in jsonl_records(path):
        if isinstance(line.record, dict):
            done[line.record["shard"]] = line.record
    return done


def verify_output(out: str | Path) -> dict:
    """Re-hash every file the manifest lists; raise CheckFailed (exit 1) on any mismatch."""
    out = Path(out)
    manifest = read_json_or_none(out / MANIFEST_NAME)
    if manifest is None:
        if (out / PLAN_NAME).exists():
            raise InputFileError(f"{out}: conversion did not finish (no {MANIFEST_NAME})", fix="rerun the same orbitctl quantize command to resume it")
        raise InputFileError(f"{out}: no {MANIFEST_NAME}", fix="pass a directory written by orbitctl quantize")
    files = []
    bad = []
    for name, expected in sorted(manifest["files"].items()):
        path = out / name
        actual = sha256_file(path) if path.exists() else None
        ok = actual == expected["sha256"]
        files.append({"file": name, "bytes": expected["bytes"], "ok": ok})
        if not ok:
            bad.append(name if actual else f"{name} (missing)")
    result = {"output": str(out), "files": files, "ok": not bad, "format": manifest.get("format")}
    if bad:
        raise CheckFailed(f"{out}: {len(bad)} file(s) differ from {MANIFEST_NAME}: {', '.join(bad[:5])}",
                          fix="rerun orbitctl quantize into an empty directory")
    return result
