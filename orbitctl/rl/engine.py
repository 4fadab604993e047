"""The DeepSpeed engine over the adapter parameters, and the process group it needs.

The engine is real ``deepspeed.initialize``: ZeRO stage from the profile, bf16 with fp32
master weights, AdamW on adapter parameters only, gradient accumulation and clipping,
and a linear warmup followed by a constant or cosine schedule. A non-finite gradient makes
DeepSpeed skip the optimizer step (``check_grad_overflow``); the trainer counts those.

A single process that was not started by a launcher gets the env a launcher would set
(RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT); DeepSpeed then picks the
accelerator and backend (CPU and gloo here, CUDA and NCCL on GPUs).
"""

from __future__ import annotations

import contextlib
import math
import os
import socket
import sys


@contextlib.contextmanager
def _quiet_stdout():
    """DeepSpeed logs and op-build messages (some from C++) go to stdout, which is for data
    (``--json``): point file descriptor 1 at stderr while DeepSpeed runs its setup."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        os.dup2(2, 1)
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


_OWN_ENV: dict[str, str] = {}
"""Launcher variables this process set for itself; removed again when the group closes, so
child processes (and a later run) do not inherit a stale port."""


def ensure_process_group() -> tuple[int, int]:
    """(rank, world_size), initialising the default process group if nobody has."""
    with _quiet_stdout():
        import deepspeed
    import torch.distributed as dist

    if not dist.is_initialized():
        if "RANK" not in os.environ:
            launcher_env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
                            "MASTER_ADDR": os.environ.get("MASTER_ADDR", "127.0.0.1"),
                            "MASTER_PORT": os.environ.get("MASTER_PORT", str(free_port()))}
            _OWN_ENV.update({k: v for k, v in launcher_env.items() if k not in os.environ})
            os.environ.update(launcher_env)
        with _quiet_stdout():
            deepspeed.init_distributed(verbose=False)
    return dist.get_rank(), dist.get_world_size()


def close_process_group() -> None:
    """Destroy the default group and DeepSpeed's cached sub-groups, so a later run in the same
    process (tests, notebooks) starts from a clean slate instead of stale group handles."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    groups = sys.modules.get("deepspeed.utils.groups")
    if groups is not None:
        for name, value in list(vars(groups).items()):
            if name.startswith("_") and ("GROUP" in name or name.startswith("_MPU")) and name.isupper():
                setattr(groups, name, {} if isinstance(value, dict) else None)
        groups.mesh_device = None
    for key in list(_OWN_ENV):
        os.environ.pop(key, None)
        _OWN_ENV.pop(key)


def lr_lambda(warmup_steps: int, total_steps: int, schedule: str):
    """Multiplier of the peak lr at optimizer step ``s``: linear warmup, then constant or cosine to 0."""

    def factor(step: int) -> float:
        if warmup_steps and step < warmup_steps:
            return (step + 1) / warmup_steps
        if schedule == "cosine":
            span = max(1, total_steps - warmup_steps)
            progress = min(1.0, (step - warmup_steps) / span)
            return 0.5 * (1.0 + math.cos(math.pi * progress))
        return 1.0

    return factor


def deepspeed_config(profile, gradient_accumulation_steps: int, bf16: bool) -> dict:
    memory, rl = profile.memory, profile.rl
    zero: dict = {"stage": memory.zero_stage}
    if memory.offload_optimizer == "cpu":
        zero["offload_optimizer"] = {"device": "cpu"}
    return {
        "train_micro_batch_size_per_gpu": memory.micro_batch_size,
        "gradient_accumulation_steps": gradient_accumulation_steps,
        "gradient_clipping": rl.grad_clip,
        "bf16": {"enabled": bf16, "check_grad_overflow": True},
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def build_engine(policy, profile, gradient_accumulation_steps: int, total_steps: int):
    """``deepspeed.initialize`` over the policy's trainable (adapter) parameters only."""
    import torch

    with _quiet_stdout():
        import deepspeed

    params = policy.trainable_parameters()
    bf16 = all(p.dtype == torch.bfloat16 for p in params)
    optimizer = torch.optim.AdamW(params, lr=profile.rl.lr, weight_decay=profile.rl.weight_decay,
                                  betas=(0.9, 0.999), eps=1e-8)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lr_lambda(profile.rl.warmup_steps, total_steps, profile.rl.lr_schedule))
    with _quiet_stdout():
        engine, optimizer, _, scheduler = deepspeed.initialize(
            model=policy.model, optimizer=optimizer, lr_scheduler=scheduler,
            config=deepspeed_config(profile, gradient_accumulation_steps, bf16))
    return engine, scheduler
