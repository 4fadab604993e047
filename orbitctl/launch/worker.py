"""What each rank runs: ``python -m orbitctl.launch.worker LAUNCH_DIR`` (started by :mod:`orbitctl.launch.ranks`).

It reads the resolved profile and the run's options from the launch directory and runs the
trainer on this rank. Rank 0 appends every event to ``events.jsonl`` and writes ``result.json``
when the run ends. An error becomes one message in the error file the elastic launcher names
(``TORCHELASTIC_ERROR_FILE``) and this process's exit code (2 bad input, 1 a failed run), so the
launching process reports this rank's own message. A rank does not outlive its launcher.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path


def _record_error(message: str) -> None:
    target = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if target:
        Path(target).write_text(json.dumps({"message": message, "timestamp": int(time.time())}))


def _die_with_launcher() -> None:
    """Have the kernel SIGKILL this rank when the process that started it dies (Linux), so a launcher that is
    killed or times out leaves no rank behind still training, holding the CPU or writing into the run
    directory that the next run resumes from."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, int(signal.SIGKILL))
    if os.getppid() == 1:  # the launcher died before the request was in place: this rank was orphaned already
        os.kill(os.getpid(), signal.SIGKILL)


def main(argv: list[str] | None = None) -> int:
    import warnings

    _die_with_launcher()

    from orbitctl.errors import OrbitError
    from orbitctl.launch.ranks import LaunchDir
    from orbitctl.rundir import atomic_write_json

    where = LaunchDir(Path((argv or sys.argv[1:])[0]))
    debug = os.environ.get("ORBITCTL_DEBUG", "") not in ("", "0")
    # DeepSpeed's ZeRO calls a torch collective under its deprecated name, once per step on every rank
    warnings.filterwarnings("ignore", message=r".*all_gather_into_tensor.* is deprecated", category=FutureWarning)
    try:
        from orbitctl.profile import load_profile
        from orbitctl.rl import api

        profile = load_profile(str(where.profile))
        options = json.loads(where.options.read_text())
        rank = int(os.environ.get("RANK", "0"))
        events = where.events.open("a", encoding="utf-8") if rank == 0 else None

        def on_event(kind: str, payload: dict) -> None:
            events.write(json.dumps({"kind": kind, "payload": payload}, default=str) + "\n")
            events.flush()

        try:
            result = api.train(profile, fresh=options.get("fresh", False), steps=options.get("steps"),
                               on_event=on_event if events else None)
        finally:
            if events:
                events.close()
        if result.rank == 0:
            atomic_write_json(where.result, asdict(result))
        return 0
    except OrbitError as exc:
        if debug:
            raise
        _record_error(exc.render())
        return exc.exit_code
    except Exception as exc:
        if debug:
            raise
        _record_error(f"{type(exc).__name__}: {exc} (rerun with ORBITCTL_DEBUG=1 for the traceback)")
        return 1


if __name__ == "__main__":
    sys.exit(main())
