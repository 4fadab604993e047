"""Rollout-engine start-up failures: the knob to turn, its value read from the message, and with a
profile the value the memory plan gives.

    kv.util   free/total at start-up           -> gpu_memory_utilization <= free share - 0.02
    kv.len    the tokens the KV cache holds    -> max_model_len <= that (or the engine's own estimate)
    oom.kv    a negative or zero KV budget     -> the engine's share cannot even hold its weights
    lora.rank the adapter's rank               -> max_lora_rank = the smallest engine value >= it

With a profile, ``plan_profile`` sizes the rollout phase: the engine's share (its weights when
separate, KV cache, working set, context) against what the trainer keeps resident, and the context
length the run decodes (max(memory.seq_len, rollout.max_new_tokens)).
"""

from __future__ import annotations

import math
from typing import Any

from orbitctl.doctor.groups import Group
from orbitctl.units import GiB, gib

ENGINE_IDS = ("log.oom.kv", "log.kv.len", "log.kv.util", "log.lora.rank")
LORA_RANKS = (8, 16, 32, 64, 128, 256, 320, 512)
"""The max_lora_rank values vLLM accepts."""
ENGINE_PARTS = ("engine_weights", "rollout_kv_cache", "rollout_activations", "cuda_context")


def lora_rank_setting(rank: int) -> int:
    """The smallest max_lora_rank an engine accepts that holds ``rank``."""
    return next((r for r in LORA_RANKS if r >= rank), rank)


def _num(groups: dict, *keys: str) -> float | None:
    for key in keys:
        value = groups.get(key)
        if value:
            return float(value.split()[0].removesuffix("GiB"))
    return None


def message_advice(g: Group) -> None:
    """Evidence and the first fix line from the numbers in the engine's own message."""
    m = g.events[0].groups
    line = None
    if g.id == "log.kv.util" and (free := _num(m, "free")) and (total := _num(m, "total")):
        share = math.floor((free / total - 0.02) * 100) / 100
        g.evidence.append(f"{free:g} of {total:g} GiB free at start-up; gpu_memory_utilization {m.get('util')} wants "
                          f"{m.get('want')} GiB")
        g.data.update(free_gib=free, total_gib=total, max_utilization=share)
        line = f"set gpu_memory_utilization <= {share:.2f} (the free share of this GPU)"
    elif g.id == "log.kv.len":
        length, fits = m.get("len") or m.get("len2"), m.get("est") or m.get("cap")
        if m.get("need"):
            g.evidence.append(f"max_model_len {length} needs {m['need']} of KV cache; {m.get('avail')} available")
        else:
            g.evidence.append(f"max_model_len {length} > {fits} tokens the KV cache holds")
        g.data.update(max_model_len=int(length), fits_tokens=int(fits) if fits else None)
        line = f"set max_model_len <= {fits}" if fits else None
    elif g.id == "log.oom.kv" and (m.get("neg") or m.get("tokens")):
        budget = f"-{m['neg']}" if m.get("neg") else f"-{m['tokens']} tokens"
        g.evidence.append(f"the KV-cache budget is {budget}: the weights and warm-up activations alone exceed the "
                          "engine's share of the GPU")
    elif g.id == "log.lora.rank":
        rank = int(m["rank"])
        g.data.update(adapter_rank=rank, max_lora_rank=int(m["max"]))
        line = f"set max_lora_rank={lora_rank_setting(rank)} (the adapter's rank is {rank})"
    if line:
        g.fix = f"{line}; {g.fix}"


def plan_advice(g: Group, profile: Any) -> None:
    """Prefix the fix with the engine settings the memory plan gives for this profile."""
    if g.id == "log.lora.rank":
        rank = getattr(getattr(profile, "adapter", None), "rank", None)
        if isinstance(rank, int):
            g.fix = f"profile adapter.rank={rank}: set max_lora_rank={lora_rank_setting(rank)}; {g.fix}"
        return
    from orbitctl.plan import plan_profile

    total = g.data.get("total_gib")
    try:
        plan = plan_profile(profile, gpu_memory_bytes=int(total * GiB) if total else None)
    except Exception as exc:  # the planner's own input errors become part of the verdict
        g.evidence.append(f"memory plan not available: {getattr(exc, 'message', None) or exc}")
        return
    rollout, gpu = plan.phases["rollout"], plan.gpu_memory_bytes
    engine = sum(rollout.get(part, 0) for part in ENGINE_PARTS)
    trainer = sum(rollout.values()) - engine
    need = math.ceil(engine / gpu * 100) / 100
    room = math.floor((1 - trainer / gpu) * 100) / 100
    context = max(profile.memory.seq_len, profile.rollout.max_new_tokens)
    g.data["plan"] = {"gpu_memory_bytes": gpu, "engine_bytes": engine, "trainer_bytes": trainer,
                      "gpu_memory_utilization": need, "max_utilization": room, "max_model_len": context}
    text = (f"plan: the engine needs {gib(engine)} GiB of {gib(gpu)} GiB (KV cache {gib(rollout.get('rollout_kv_cache', 0))}"
            f" GiB for {plan.details.get('rollout_sequences_per_gpu')} sequences of {context} tokens) and the trainer "
            f"keeps {gib(trainer)} GiB")
    if need <= room:
        text += f": set gpu_memory_utilization={need:.2f} and max_model_len={context}"
    else:
        text += (f": gpu_memory_utilization={need:.2f} does not fit {'this GPU' if need > 1 else 'next to the trainer'} "
                 f"(room {room:.2f}); shrink the rollout: rollout.batch_size, rollout.kv_dtype: fp8, "
                 f"rollout.engine_sleep: true (orbitctl plan PROFILE)")
    g.evidence.append(text)
    g.fix = f"{text}. {g.fix}"
