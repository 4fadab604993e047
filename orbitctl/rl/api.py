"""What `orbitctl train` calls: the profile checked for what train builds, then the run.

    from orbitctl.rl import api
    profile = api.load_train_profile("profiles/tiny-cpu.yaml", ["rl.lr=5e-4"])
    result = api.train(profile, steps=50)       # TrainResult; rerunning resumes

Nothing assumes a single rank: prompts are sharded by rank, statistics are all-reduced, and
only rank 0 writes files. The same call on an existing run directory resumes from its newest
complete checkpoint; ``fresh=True`` starts over.
"""

from __future__ import annotations

import contextlib

from orbitctl.profile.support import TRAIN, given_keys, refuse_unsupported
from orbitctl.rl.trainer import EventFn, TrainResult

__all__ = ["EventFn", "TrainResult", "load_train_profile", "train"]


def load_train_profile(path: str, overrides: list[str] | tuple[str, ...] = ()):
    """The profile with ``overrides`` applied, refused (exit 2, naming the key) when it asks for something
    train does not build; before any data, model or process group."""
    from orbitctl.profile import load_profile

    profile = load_profile(path, list(overrides))
    refuse_unsupported(profile, TRAIN, given_keys(list(overrides)))
    return profile


def refuse_before_launch(profile) -> None:
    """The checks :func:`train` makes before anything is built, made once before ranks are started."""
    refuse_unsupported(profile, TRAIN)


def train(profile, *, fresh: bool = False, steps: int | None = None, on_event: EventFn | None = None) -> TrainResult:
    """Run (or resume) the profile's RL training; returns what it did. Raises RunFailed on a failed run."""
    import torch

    from orbitctl.dist.collectives import barrier
    from orbitctl.rl.engine import close_process_group, ensure_process_group
    from orbitctl.rl.trainer import run_loop

    refuse_before_launch(profile)  # a value only plan models: exit 2 before anything is built
    if steps is not None:
        profile = profile.model_copy(update={"rl": profile.rl.model_copy(update={"steps": steps})})
    rank, world = ensure_process_group()
    emit = on_event if on_event is not None and rank == 0 else (lambda kind, payload: None)
    threads = torch.get_num_threads()
    try:
        with contextlib.ExitStack() as closing:  # what the loop starts for itself (an http engine) ends with it
            result = run_loop(profile, fresh, emit, rank, world, torch, closing)
        if world > 1:  # no rank tears its connections down while another still talks to it
            barrier()
        return result
    finally:
        if torch.get_num_threads() != threads:  # a resume runs on the run's own thread count
            torch.set_num_threads(threads)
        close_process_group()
