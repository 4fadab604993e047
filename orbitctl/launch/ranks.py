"""Start the ranks of a run with an existing launcher, and bring back what rank 0 reports.

One node: PyTorch's elastic launcher (``torch.distributed.launcher.api.elastic_launch``, what
``torchrun`` runs) starts ``hardware.gpus_per_node`` workers on a free port of 127.0.0.1 with a
static rendezvous, each bound to its GPU's NUMA node where the machine reports one. Several nodes:
DeepSpeed's launcher (``deepspeed --hostfile``) with the master address and port given. Workers get
``TORCH_NCCL_ASYNC_ERROR_HANDLING=1``, so a rank stuck in a collective after another died is torn
down instead of hanging.

The launch directory (``RUN_DIR/.launch/``) carries the resolved profile to the workers and brings
back rank 0's events (``events.jsonl``, one JSON object per line, replayed to the caller's callback
while the ranks run) and its result (``result.json``). A failing rank writes its error (message and
exit code) to the file the elastic launcher names; the launcher stops the other ranks and the
caller gets that rank's own message, not only an exit code.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from orbitctl.errors import RunFailed, UserError
from orbitctl.profile import dump_profile
from orbitctl.rundir import RunDir, atomic_write_json, atomic_write_text, jsonl_records

WORKER_ENV = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "OMP_NUM_THREADS": None}
"""Set for every worker (None: keep the caller's value, or let the launcher choose)."""
EVENTS, RESULT, PROFILE, OPTIONS = "events.jsonl", "result.json", "profile.yaml", "options.json"


@dataclass(frozen=True)
class LaunchDir:
    """Where a launch keeps its hand-over files: ``RUN_DIR/.launch``."""

    root: Path

    @classmethod
    def of(cls, profile) -> "LaunchDir":
        return cls(RunDir(profile.run_dir).root / ".launch")

    events = property(lambda self: self.root / EVENTS)
    result = property(lambda self: self.root / RESULT)
    profile = property(lambda self: self.root / PROFILE)
    options = property(lambda self: self.root / OPTIONS)

    def prepare(self, profile, options: dict) -> None:
        """A fresh directory holding the profile (the keys given, loadable as it was) and the run's options."""
        shutil.rmtree(self.root, ignore_errors=True)
        self.root.mkdir(parents=True)
        atomic_write_text(self.profile, dump_profile(profile), fsync=False)
        atomic_write_json(self.options, options, fsync=False)


def under_launcher(env=None) -> bool:
    """True in a process a launcher started as one rank of a group (torchrun, deepspeed, mpirun via env)."""
    env = os.environ if env is None else env
    return "LOCAL_RANK" in env and "WORLD_SIZE" in env


def _replay(events: Path, on_event: Callable[[str, dict], None] | None, seen: int) -> int:
    """Hand the events rank 0 wrote since line ``seen`` to ``on_event``; returns the lines handled."""
    if on_event is None or not events.exists():
        return seen
    lines = list(jsonl_records(events))
    complete = lines if lines and lines[-1].record is not None else lines[:-1]  # a line being written waits
    for line in complete[seen:]:
        on_event(line.record["kind"], line.record["payload"])
    return max(seen, len(complete))


CONSEQUENCES = ("Connection reset by peer", "Connection closed by peer", "Watchdog caught collective operation timeout",
                "NCCL communicator was aborted", "Broken pipe")
"""What a rank says when another rank died under it: the peer's failure is the cause, not this."""


def _consequence(failure) -> int:
    """0 for a rank that died on its own (killed by a signal other than the launcher's SIGTERM), 1 for one
    that failed with its own error, 2 for one whose error is another rank's death, 3 for one the launcher
    stopped: the root cause sorts first."""
    code = failure.exitcode or 0
    if code < 0:
        return 3 if failure.signal_name() == "SIGTERM" else 0
    message = failure.message if isinstance(failure.message, str) else ""
    return 2 if any(text in message for text in CONSEQUENCES) else 1


def _root_failure(exc) -> tuple[int, int, str]:
    """(rank, exit code, message) of the rank that failed first."""
    failures = getattr(exc, "failures", {}) or {}
    if not failures:
        return -1, 1, str(exc)
    rank, failure = min(failures.items(), key=lambda kv: (_consequence(kv[1]), kv[1].timestamp or 0, kv[0]))
    message = failure.message if isinstance(failure.message, str) else json.dumps(failure.message)
    if not message or message.startswith("To enable traceback"):
        signal = failure.signal_name() if failure.exitcode is not None and failure.exitcode < 0 else None
        message = (f"killed by {signal}" if signal else f"exited with code {failure.exitcode}") + \
                  " (its own output is above)"
    return rank, failure.exitcode if failure.exitcode and failure.exitcode > 0 else 1, message


def launch_local(profile, options: dict, on_event, *, numa: bool) -> dict:
    """Run ``hardware.gpus_per_node`` workers on this node; returns rank 0's result document."""
    from torch.distributed.elastic.multiprocessing.api import DefaultLogsSpecs
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    where = LaunchDir.of(profile)
    where.prepare(profile, options)
    from orbitctl.rl.engine import free_port

    port = free_port()
    numa_options = None
    if numa:
        from torch.numa.binding import AffinityMode, NumaOptions

        numa_options = NumaOptions(affinity_mode=AffinityMode.NODE)
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=profile.hardware.gpus_per_node,
                          rdzv_backend="static", rdzv_endpoint=f"127.0.0.1:{port}", rdzv_configs={"rank": 0},
                          run_id=f"orbitctl-{port}", max_restarts=0, monitor_interval=0.2, start_method="spawn",
                          logs_specs=DefaultLogsSpecs(log_dir=str(where.root / "logs")), numa_options=numa_options)
    outcome: dict = {}
    stop = threading.Event()

    def follow() -> None:  # rank 0's events, replayed while the ranks run (the launcher keeps the main thread)
        seen = 0
        while not stop.wait(0.25):
            seen = _replay(where.events, on_event, seen)
        outcome["seen"] = seen

    saved = {k: os.environ.get(k) for k in WORKER_ENV}
    os.environ.update({k: v for k, v in WORKER_ENV.items() if v is not None})
    # the launcher's own log lines (which worker it stopped, its exit code) say less than the error reported below
    elastic_log = logging.getLogger("torch.distributed.elastic")
    level = elastic_log.level
    elastic_log.setLevel(logging.CRITICAL)
    follower = threading.Thread(target=follow, name="orbitctl-events", daemon=True)
    follower.start()
    try:
        elastic_launch(config, sys.executable)("-m", "orbitctl.launch.worker", str(where.root))
    except Exception as exc:
        outcome["error"] = exc
    finally:
        stop.set()
        follower.join()
        elastic_log.setLevel(level)
        _replay(where.events, on_event, outcome.get("seen", 0))
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
    error = outcome.get("error")
    if error is not None:
        if type(error).__name__ != "ChildFailedError":
            raise error
        rank, code, message = _root_failure(error)
        cls = UserError if code == 2 else RunFailed
        raise cls(f"rank {rank} of {profile.hardware.gpus_per_node}: {message}")
    return _rank0_result(where)


def _rank0_result(where: LaunchDir) -> dict:
    """The result document rank 0 wrote when the run ended."""
    if not where.result.exists():
        raise RunFailed(f"{where.result}: rank 0 ended without a result", fix="rerun; the run resumes from its newest checkpoint")
    return json.loads(where.result.read_text())


def multinode_command(profile, hostfile: str, master_addr: str, master_port: int | None = None) -> list[str]:
    """The DeepSpeed launcher command that starts every node's ranks for a run over ``hostfile``."""
    if not Path(hostfile).is_file():
        raise UserError(f"--hostfile {hostfile}: file not found",
                        fix="write one line per node, e.g. 'node1 slots=8' (DeepSpeed's hostfile format)")
    where = LaunchDir.of(profile)
    return ["deepspeed", "--hostfile", hostfile, "--master_addr", master_addr,
            "--master_port", str(master_port or 29500), "--num_nodes", str(profile.hardware.nodes),
            "--num_gpus", str(profile.hardware.gpus_per_node), "--module", "orbitctl.launch.worker", str(where.root)]


def launch_nodes(profile, options: dict, command: list[str]) -> dict:
    """Run ``command`` (:func:`multinode_command`) and return rank 0's result document."""
    import subprocess

    where = LaunchDir.of(profile)
    where.prepare(profile, options)
    env = {**os.environ, **{k: v for k, v in WORKER_ENV.items() if v is not None}}
    code = subprocess.call(command, env=env)
    if code != 0:
        raise RunFailed(f"the DeepSpeed launcher exited with code {code}", fix="the failing rank's error is above")
    return _rank0_result(where)
