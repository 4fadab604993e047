"""The run's record: metrics.jsonl (one line per optimizer step), the trackers it goes to, the time left, memory
and health warnings.

Field meanings are documented in docs/train.md. Only rank 0 writes. On resume the file is cut
back to the checkpoint's step first, so a step is never missing or written twice. Each record
appended also goes to the ``run.loggers`` attached (:mod:`orbitctl.rl.loggers`).
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections import deque
from pathlib import Path
from orbitctl.rundir import atomic_write_text, jsonl_records


class MetricsLog:
    def __init__(self, path: Path, enabled: bool) -> None:
        self.path = Path(path)
        self.enabled = enabled
        self.loggers: list = []
        """Experiment trackers (:func:`orbitctl.rl.loggers.open_loggers`) each appended record is sent to."""

    def truncate_after(self, step: int) -> None:
        """Keep only lines with ``step <= step`` (atomic rewrite); a torn last line is dropped."""
        if not self.enabled or not self.path.exists():
            return
        kept = [line.text for line in jsonl_records(self.path)
                if isinstance(line.record, dict) and line.record.get("step", 0) <= step]
        atomic_write_text(self.path, "".join(k + "\n" for k in kept), fsync=False)

    def append(self, record: dict) -> None:
        if not self.enabled:
            return
        with self.path.open("a") as handle:
            handle.write(json.dumps(record) + "\n")
            handle.flush()
            os.fsync(handle.fileno())
        if self.loggers:
            from orbitctl.rl.loggers import step_scalars

            values = step_scalars(record)
            for logger in self.loggers:
                logger.log(record["step"], values)

    def close(self, failed: bool = False) -> None:
        """End every attached tracker's run (marked failed when the run stopped on an error)."""
        loggers, self.loggers = self.loggers, []
        for logger in loggers:
            logger.close(failed)


class StepClock:
    """The seconds an optimizer step takes in this process and the time the run has left.

    The mean is of the steps after the first (which pays the warm-up: the first rollout, kernels compiled, caches
    filled), measured as wall time between the ends of consecutive steps, so evaluation and checkpoint time count."""

    def __init__(self, total_steps: int) -> None:
        self.total = total_steps
        self.first_end: float | None = None
        self.steps_after_first = 0

    def tick(self, step: int) -> dict:
        """Step ``step`` ended now: ``{"step_s_mean": ..., "eta_s": ...}`` (None until a step after the first)."""
        now = time.perf_counter()
        if self.first_end is None:
            self.first_end = now
            return {"step_s_mean": None, "eta_s": None}
        self.steps_after_first += 1
        mean = (now - self.first_end) / self.steps_after_first
        return {"step_s_mean": mean, "eta_s": mean * max(self.total - step, 0)}


def peak_memory_bytes() -> tuple[int, str]:
    """(bytes, what): CUDA max allocated on a GPU, else the process's peak RSS."""
    import resource

    import torch

    if torch.cuda.is_available():
        return int(torch.cuda.max_memory_allocated()), "cuda_max_allocated"
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024, "rss_peak"


class HealthMonitor:
    """Warnings for the live view: entropy collapse, gradient-norm spikes, memory over the limit."""

    def __init__(self, memory_limit_bytes: int | None, window: int = 20) -> None:
        self.memory_limit = memory_limit_bytes
        self.first_entropy: float | None = None
        self.grad_norms: deque[float] = deque(maxlen=window)

    def check(self, record: dict) -> list[str]:
        warnings = []
        entropy = record.get("entropy")
        if entropy is not None:
            if self.first_entropy is None:
                self.first_entropy = entropy
            elif self.first_entropy > 0 and entropy < 0.1 * self.first_entropy:
                warnings.append(f"entropy collapse: {entropy:.3f} nats, under 10% of the first step's {self.first_entropy:.3f}")
        norm = record.get("grad_norm")
        if norm is not None:
            median = statistics.median(self.grad_norms) if len(self.grad_norms) >= 10 else 0.0
            if median > 0 and norm > 10 * median:
                warnings.append(f"gradient-norm spike: {norm:.3g}, over 10x the recent median {median:.3g}")
            self.grad_norms.append(norm)
        peak = record.get("peak_memory_bytes")
        if self.memory_limit and peak and peak > self.memory_limit:
            what = "HBM" if record.get("peak_memory_kind") == "cuda_max_allocated" else "host memory"
            warnings.append(f"{what} above the profile's limit: {peak / 2**30:.2f} GiB > {self.memory_limit / 2**30:.2f} GiB")
        return warnings
