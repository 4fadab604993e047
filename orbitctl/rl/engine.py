"""The DeepSpeed engine over the adapter parameters, and the process group it needs.

The engine is real ``deepspeed.initialize``: ZeRO stage from the profile, bf16 with fp32
master weights, AdamW on adapter parameters only, gradient accumulation and clipping,
and a linear warmup followed by a constant or cosine schedule. A non-finite gradient makes
DeepSpeed skip the optimizer step (``check_grad_overflow``); the trainer counts those.

Under ZeRO-3 the frozen base is partitioned like any parameter (its packed storage: bitsandbytes'
``Params4bit`` in bf16 storage, :class:`~orbitctl.model.quant_linear.QuantLinear`'s int32/fp8 codes
and scales) and gathered module by module; ``memory.offload_params: cpu`` keeps those partitions in
host memory (ZeRO-Infinity's ``offload_param``), and ``memory.prefetch_layers`` sets how many decoder
layers DeepSpeed gathers ahead of the one computing, from the measured size of one layer
(:func:`zero3_gather_limits`). Expert-parallel experts are buffers, which ZeRO never touches.

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

from orbitctl.errors import UserError


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
        from orbitctl.dist.build_locks import clear_stale_build_locks

        clear_stale_build_locks()  # a killed op build's lock would keep init_distributed waiting forever
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


BUILD_WAIT_HOURS = 24
"""How long the other ranks wait for rank 0 to build or quantize the base (the demo base trains 300 warm-start
steps; a real checkpoint is quantized tensor by tensor)."""


def after_rank0(world: int):
    """A barrier for the other ranks to wait on while rank 0 does work of unbounded length; call it on every rank
    before that work, and the returned function after it.

    The default group's timeout (10 minutes on gloo) is meant for collectives, not for a base build: on a loaded
    machine the first run's build outlasted it and every other rank failed with "Timed out waiting 600000ms for
    recv". The wait is on a gloo group of its own whose timeout is :data:`BUILD_WAIT_HOURS`; a rank 0 that fails
    meanwhile ends the wait through the launcher, which stops every rank."""
    from datetime import timedelta

    import torch.distributed as dist

    from orbitctl.dist.collectives import barrier

    if world == 1:
        return lambda: None
    group = dist.new_group(backend="gloo", timeout=timedelta(hours=BUILD_WAIT_HOURS))

    def wait() -> None:
        barrier(group)
        dist.destroy_process_group(group)

    return wait


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


PERSISTENCE_PER_HIDDEN = 10
"""``stage3_param_persistence_threshold`` is 10 x hidden elements, the Hugging Face integration's rule that
the plan's adapter states assume (:mod:`orbitctl.plan.adapters`): smaller tensors (norms, most LoRA factors)
stay whole on every rank and are never gathered."""


def zero3_gather_limits(prefetch_layers: int, layer_elements: int) -> dict[str, int]:
    """DeepSpeed's ZeRO-3 gather limits for ``memory.prefetch_layers`` over layers of ``layer_elements``
    gathered elements each (:func:`measured_layer_elements`).

    The plan's ``gather_window`` (:mod:`orbitctl.plan.layout`) counts 1 + prefetch_layers consecutive gather
    units alive at once, the one computing and those fetched ahead; these limits say the same to DeepSpeed:
    fetch ahead at most ``prefetch_layers`` layers (``stage3_prefetch_bucket_size``), hold at most
    1 + prefetch_layers layers (``stage3_max_live_parameters``), and keep a gathered parameter for a reuse only
    within the prefetch window (``stage3_max_reuse_distance``; DeepSpeed's default of 1e9 elements would keep a
    small model's every layer gathered from the forward to its recompute in the backward). 0 = no prefetch: one
    layer at a time, each released as soon as it has run."""
    ahead = prefetch_layers * layer_elements
    return {"stage3_prefetch_bucket_size": ahead,
            "stage3_max_live_parameters": (1 + prefetch_layers) * layer_elements,
            "stage3_max_reuse_distance": ahead}


def _stored_numel(param) -> int:
    """Elements of a parameter as ZeRO-3 counts them (``ds_numel`` once partitioned): the packed storage for
    a quantized weight (four NF4 codes per bf16 element, eight INT4 codes per int32 element)."""
    return int(getattr(param, "ds_numel", param.numel()))


def measured_layer_elements(model, persistence_threshold: int) -> int:
    """Elements ZeRO-3 gathers for the largest decoder layer of ``model``: every parameter of the layer
    (frozen packed base and adapters) above the persistence threshold. Expert-parallel experts are
    buffers and count nothing."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    layers = getattr(getattr(base, "model", base), "layers", None)
    if not layers:
        raise UserError("memory.prefetch_layers: this model has no decoder layers at model.layers to size the "
                        "ZeRO-3 prefetch by", fix="set memory.zero_stage: 2 for this architecture")
    return max(sum(n for n in map(_stored_numel, layer.parameters()) if n > persistence_threshold)
               for layer in layers)


def planned_layer_elements(profile, arch) -> int:
    """:func:`measured_layer_elements` worked out from the architecture, without a model (``--dry-run``):
    the stored tensors of each decoder layer's weights in ``quant.format`` (NF4/FP4 codes in bf16 storage,
    INT4 int32 codes and bf16 group scales, FP8 codes and fp32 block scales, per routed expert; the fused bf16
    experts of nf4 as one tensor) and the adapter factors, each counted when above the persistence threshold."""
    from orbitctl.arch.spec import EXPERT
    from orbitctl.plan.adapters import plan_adapters
    from orbitctl.plan.storage import is_quantized

    quant, threshold = profile.quant, PERSISTENCE_PER_HIDDEN * arch.hidden_size
    expert_parallel = profile.memory.expert_parallel > 1 and arch.num_experts > 0
    adapters = plan_adapters(arch, profile.adapter)

    def tensors(w) -> list[int]:
        rows, cols = (w.shape + (1,))[:2]
        if not is_quantized(w, quant) or quant.format in ("nf4", "fp4") and w.kind == EXPERT:
            return [w.numel]  # plain weights, and nf4/fp4's fused bf16 routed experts, are one tensor
        if quant.format == "int4":
            one = [rows * cols // 8, rows * cols // quant.group_size]
        elif quant.format == "fp8":
            one = [rows * cols, -(-rows // 128) * -(-cols // 128)]
        else:  # nf4/fp4: 4-bit codes packed in 2-byte (bf16) or 1-byte storage; absmax is not a parameter
            one = [rows * cols // (4 if quant.storage_dtype == "bf16" else 2)]
        return one * w.copies

    def factors(index: int, w) -> list[int]:
        if adapters.kind == "lora" and adapters.adapted_in(index, w.name):
            rows, cols = w.shape
            return [adapters.rank * cols, rows * adapters.rank] * w.copies  # one A and one B per expert
        return []

    best = 0
    for layer in arch.layers:
        sizes = []
        for w in layer.weights:
            if not w.parameter or expert_parallel and w.kind == EXPERT:
                continue
            sizes += tensors(w) + factors(layer.index, w)
        if adapters.kind == "bottleneck":
            sizes += [adapters.rank * arch.hidden_size, arch.hidden_size * adapters.rank]
        if adapters.expert_layout != "none" and layer.moe:
            sizes.append(adapters.expert_params // max(1, arch.moe_layers))  # one layer's factors, counted whole
        best = max(best, sum(n for n in sizes if n > threshold))
    return best


def deepspeed_config(profile, gradient_accumulation_steps: int, bf16: bool, *, layer_elements: int | None = None,
                     hidden_size: int | None = None) -> dict:
    """The DeepSpeed config train builds (and records as ``deepspeed_config.json`` in the run directory).

    Under ZeRO-3, ``layer_elements`` (one decoder layer's gathered elements, :func:`measured_layer_elements` on
    the loaded model) and ``hidden_size`` size the prefetch and persistence; without them (``--dry-run``) they
    are worked out from the profile's architecture."""
    memory, rl = profile.memory, profile.rl
    zero: dict = {"stage": memory.zero_stage}
    offload_optimizer = memory.offload_optimizer == "cpu"
    if offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu"}
    if memory.zero_stage == 3:
        if layer_elements is None or hidden_size is None:
            from orbitctl.plan import _arch

            arch = _arch(profile)
            hidden_size = arch.hidden_size if hidden_size is None else hidden_size
            layer_elements = planned_layer_elements(profile, arch) if layer_elements is None else layer_elements
        zero["stage3_param_persistence_threshold"] = PERSISTENCE_PER_HIDDEN * hidden_size
        zero.update(zero3_gather_limits(memory.prefetch_layers, layer_elements))
        if memory.offload_params == "cpu":
            # pinned host memory: the gathers copy host -> GPU at full PCIe bandwidth, overlapped with compute
            zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    config = {
        "train_micro_batch_size_per_gpu": memory.micro_batch_size,
        "gradient_accumulation_steps": gradient_accumulation_steps,
        "gradient_clipping": rl.grad_clip,
        "bf16": {"enabled": bf16, "check_grad_overflow": True},
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if offload_optimizer:
        # the AdamW above steps the offloaded fp32 partitions on the host; DeepSpeed otherwise insists on its
        # own CPU Adam, a C++ extension compiled at start-up, for what is only the adapters' state here
        config["zero_force_ds_cpu_optimizer"] = False
    return config


def engine_config(policy, profile, gradient_accumulation_steps: int) -> dict:
    """:func:`deepspeed_config` for ``policy`` as loaded on this rank: bf16 when every adapter parameter is,
    and under ZeRO-3 the prefetch sized by the largest decoder layer measured on the model."""
    import torch

    bf16 = all(p.dtype == torch.bfloat16 for p in policy.trainable_parameters())
    if profile.memory.zero_stage != 3:
        return deepspeed_config(profile, gradient_accumulation_steps, bf16)
    hidden = int(policy.model.config.hidden_size)
    return deepspeed_config(profile, gradient_accumulation_steps, bf16, hidden_size=hidden,
                            layer_elements=measured_layer_elements(policy.model, PERSISTENCE_PER_HIDDEN * hidden))


def build_engine(policy, profile, gradient_accumulation_steps: int, total_steps: int, config: dict | None = None):
    """``deepspeed.initialize`` over the policy's trainable (adapter) parameters only, with ``config``
    (:func:`engine_config` when not given)."""
    import torch

    with _quiet_stdout():
        import deepspeed

    if config is None:
        config = engine_config(policy, profile, gradient_accumulation_steps)
    params = policy.trainable_parameters()
    optimizer = torch.optim.AdamW(params, lr=profile.rl.lr, weight_decay=profile.rl.weight_decay,
                                  betas=(0.9, 0.999), eps=1e-8)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lr_lambda(profile.rl.warmup_steps, total_steps, profile.rl.lr_schedule))
    with _quiet_stdout():
        engine, optimizer, _, scheduler = deepspeed.initialize(
            model=policy.model, optimizer=optimizer, lr_scheduler=scheduler, config=config)
    return engine, scheduler
