"""Run checkpoints: adapter, optimizer, scheduler, RNG states and data cursor, atomically.

Layout ``runs/NAME/checkpoints/step-N/``::

    engine/            DeepSpeed state: trainable params, fp32 master weights, AdamW moments,
                       lr scheduler (frozen base excluded; it is rebuilt from the profile)
    adapter/           the adapter in its own format (PEFT for LoRA), usable on its own
    rng-rank{R}.pt     torch, sampler and Python RNG states of each rank
    trainer.json       step, data cursor, non-finite streak, first evaluation
    COMPLETE           written last: a directory without it is ignored

Every rank writes into ``.tmp-step-N``; rank 0 renames it to ``step-N`` after a barrier
and deletes all but the newest ``run.keep_last``. A run killed mid-save leaves only a
``.tmp-`` directory, which the next start removes.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path


def checkpoint_root(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def complete_checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    root = checkpoint_root(run_dir)
    found = []
    if root.exists():
        for path in root.iterdir():
            if path.name.startswith("step-") and (path / "COMPLETE").exists():
                try:
                    found.append((int(path.name[5:]), path))
                except ValueError:
                    continue
    return sorted(found)


def latest_checkpoint(run_dir: Path) -> tuple[int, Path] | None:
    found = complete_checkpoints(run_dir)
    return found[-1] if found else None


def remove_partial(run_dir: Path) -> None:
    root = checkpoint_root(run_dir)
    if root.exists():
        for path in root.iterdir():
            if path.name.startswith(".tmp-") or (path.name.startswith("step-") and not (path / "COMPLETE").exists()):
                shutil.rmtree(path, ignore_errors=True)


def rng_state(generator) -> dict:
    import torch

    return {"torch": torch.get_rng_state(), "sampler": generator.get_state(), "python": random.getstate()}


def restore_rng(state: dict, generator) -> None:
    import torch

    torch.set_rng_state(state["torch"])
    generator.set_state(state["sampler"])
    random.setstate(state["python"])


def save_checkpoint(run_dir: Path, step: int, engine, policy, generator, trainer_state: dict,
                    rank: int, keep_last: int) -> Path:
    """Collective: every rank calls it. Returns the final checkpoint path."""
    import torch
    import torch.distributed as dist

    from orbitctl.model.adapters import save_adapter

    root = checkpoint_root(run_dir)
    tmp, final = root / f".tmp-step-{step}", root / f"step-{step}"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    engine.save_checkpoint(str(tmp), tag="engine", client_state={"step": step}, save_latest=False,
                           exclude_frozen_parameters=True)
    torch.save(rng_state(generator), tmp / f"rng-rank{rank}.pt")
    if rank == 0:
        save_adapter(policy.model, tmp / "adapter", policy.adapter_kind, policy.hidden_size)
        (tmp / "trainer.json").write_text(json.dumps(trainer_state, indent=2) + "\n")
    dist.barrier()
    if rank == 0:
        _fsync_tree(tmp)
        (tmp / "COMPLETE").write_text(f"{step}\n")
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        for _, old in complete_checkpoints(run_dir)[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return final


def _fsync_tree(path: Path) -> None:
    for file in path.rglob("*"):
        if file.is_file():
            with open(file, "rb") as handle:
                os.fsync(handle.fileno())


def load_checkpoint(path: Path, engine, generator, rank: int) -> dict:
    """Restore engine, RNG and trainer state from a complete checkpoint; return trainer state."""
    import torch

    engine.load_checkpoint(str(path), tag="engine", load_module_strict=False, load_optimizer_states=True,
                           load_lr_scheduler_states=True)
    restore_rng(torch.load(path / f"rng-rank{rank}.pt", weights_only=False), generator)
    return json.loads((path / "trainer.json").read_text())
