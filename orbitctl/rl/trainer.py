"""The training loop behind ``orbitctl train``: rollout -> reward -> advantage -> update.

The entry point is :func:`orbitctl.rl.api.train`; :func:`run_loop` is the loop on one rank.

Nothing assumes a single rank: prompts are sharded by rank, statistics are all-reduced, and
only rank 0 writes files. The same call on an existing run directory resumes from its newest
complete checkpoint; ``fresh=True`` starts over.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Callable

from orbitctl.errors import RunFailed, UserError
from orbitctl.profile import dump_profile
from orbitctl.rundir import RunDir, atomic_dir, atomic_write_json, atomic_write_text

EventFn = Callable[[str, dict], None]


@dataclass
class TrainResult:
    run_dir: str
    steps: int
    resumed_from: int | None
    eval_before: float | None
    eval_after: float | None
    wall_s: float
    adapter_dir: str
    adapter: str
    nonfinite_skipped: int
    last_metrics: dict = field(default_factory=dict)
    rank: int = 0
    """This process's rank: only rank 0 should report (every rank returns the same result)."""

    def to_dict(self) -> dict:
        return asdict(self)


def _accumulation(profile, world: int) -> int:
    rl, micro = profile.rl, profile.memory.micro_batch_size
    rows = rl.prompts_per_step * rl.group_size
    if rl.prompts_per_step % world:
        raise UserError(f"rl.prompts_per_step: {rl.prompts_per_step} does not divide over {world} ranks",
                        fix=f"use a multiple of {world}")
    per_rank = rows // world
    if per_rank % rl.minibatches or (per_rank // rl.minibatches) % micro:
        raise UserError(
            f"memory.micro_batch_size: {micro} must divide the {per_rank // max(rl.minibatches, 1)} sequences "
            f"of each minibatch (rl.prompts_per_step x rl.group_size / rl.minibatches / ranks)",
            fix="choose a micro_batch_size that divides it, or change rl.prompts_per_step")
    return per_rank // rl.minibatches // micro


def _prepare_run_dir(run: RunDir, profile, fresh: bool, rank: int) -> None:
    from orbitctl.dist.collectives import barrier

    if rank == 0:
        if fresh and run.root.exists():
            run.clear()
        run.root.mkdir(parents=True, exist_ok=True)
        atomic_write_text(run.profile, dump_profile(profile), fsync=False)
        run.remove_partial()
    barrier()


def accumulation_warnings(derived: int, profile) -> list[str]:
    """The warning when the accumulation train derives differs from what `orbitctl plan` assumed."""
    planned = profile.memory.gradient_accumulation_steps
    if derived == planned:
        return []
    return [f"gradient accumulation is {derived} micro-batches per optimizer step, derived from "
            f"rl.prompts_per_step x rl.group_size / rl.minibatches / ranks / memory.micro_batch_size; "
            f"memory.gradient_accumulation_steps={planned} is what `orbitctl plan` assumes"]


class _Evaluator:
    def __init__(self, policy, items, reward_fn, profile, max_new_tokens, rank, world, env=None):
        self.policy, self.items, self.reward_fn = policy, items[rank::world], reward_fn
        self.any = bool(items)  # the same on every rank: all of them evaluate, or none (a collective follows)
        self.batch = profile.rollout_batch_size
        self.max_new = max_new_tokens
        self.env, self.max_turns = env, profile.rollout.max_turns

    def __call__(self) -> dict | None:
        import torch

        from orbitctl.rl.multiturn import evaluate_episodes
        from orbitctl.rl.rollout import evaluate
        from orbitctl.dist.collectives import reduce_scalars

        if not self.any:
            return None
        if self.env is not None:
            out = evaluate_episodes(self.policy, self.env, self.items, batch_size=self.batch,
                                    max_turns=self.max_turns, max_new_tokens=self.max_new)
        else:
            out = evaluate(self.policy, self.items, self.reward_fn, batch_size=self.batch,
                           max_new_tokens=self.max_new, generator=torch.Generator())
        total, correct, reward_sum, valid, calls = reduce_scalars([
            float(out["total"]), float(out["correct"]), float(out["reward_sum"]),
            float(out.get("tool_calls_valid", 0)), float(out.get("tool_calls", 0))])
        tools = {"eval_tool_call_valid_rate": valid / calls} if "tool_calls" in out and calls else {}
        return {"eval_accuracy": correct / total, "eval_reward": reward_sum / total, "eval_prompts": int(total),
                **tools}


def run_loop(profile, fresh, emit, rank, world, torch, closing) -> TrainResult:
    """The loop itself, on one rank of an initialised process group (:func:`orbitctl.rl.api.train` sets it up);
    ``closing`` (an ExitStack) ends what the loop starts, such as an http engine, when the run ends."""
    from orbitctl.builder import load_policy, prepare_frozen_base
    from orbitctl.plan import resolve_rollout_batch
    from orbitctl.quant.report import quant_summary
    from orbitctl.rl import checkpoint as ckpt
    from orbitctl.data.prompts import PromptStream, load_prompts
    from orbitctl.rl.engine import after_rank0, build_engine, engine_config
    from orbitctl.rl.runlog import HealthMonitor, MetricsLog, StepClock
    from orbitctl.rl.losses import group_advantages
    from orbitctl.rl.rewards import make_reward
    from orbitctl.rl.multiturn import collect_episodes
    from orbitctl.rl.rollout import collect
    from orbitctl.rl.update import run_update

    wall_start = time.perf_counter()
    profile = resolve_rollout_batch(profile)  # rollout.batch_size: auto -> the plan's number, the same on every rank
    run = RunDir(profile.run_dir)
    run_dir = run.root
    env = _environment(profile)  # bad data fails here, before any work
    if env is None:
        split = load_prompts(profile.data, profile.run.seed)
        reward_fn = make_reward(profile.data.reward, split.task)
    else:
        from orbitctl.rl.envs import episode_split

        split, reward_fn = episode_split(env, profile.data, profile.run.seed), None
    gas = _accumulation(profile, world)
    _prepare_run_dir(run, profile, fresh, rank)

    torch.manual_seed(profile.run.seed)
    from orbitctl.kernels.cpu_dtype import run_device_type
    from orbitctl.rl.phases import PhaseMemory

    # the baseline: before the base is built, quantized or loaded, so that what building it imports counts
    # as it does when the base comes from the cache (the model's modules, loaded after this point either way)
    meter = PhaseMemory.for_profile(profile, run_device_type(profile))
    # rank 0 builds or quantizes what is missing; the others then find it in the cache, waiting on a barrier
    # that outlasts the build (the default group's timeout does not)
    built = after_rank0(world)
    if rank == 0:
        base = prepare_frozen_base(profile, split.warm_task)
    built()
    if rank != 0:
        base = prepare_frozen_base(profile, split.warm_task)
    policy = load_policy(profile, base)
    emit("setup", {"adapter": policy.report.summary(), "base": str(base.quantized_dir), "built": base.built,
                   "quant": quant_summary(base.quantized_dir),
                   "accumulation": {"derived": gas, "profile": profile.memory.gradient_accumulation_steps},
                   "warnings": accumulation_warnings(gas, profile),
                   "run_dir": str(run_dir), "rank": rank, "world_size": world, "data_formats": split.formats,
                   # the plan's seconds per optimizer step: its RL step spread over the updates of one rollout
                   "plan_step_s": None if meter.plan_step_s is None
                   else meter.plan_step_s / (profile.rl.ppo_epochs * profile.rl.minibatches),
                   **base.notes})
    rl = profile.rl
    optimizer_steps_per_rollout = rl.ppo_epochs * rl.minibatches
    ds_config = engine_config(policy, profile, gas)
    if rank == 0:  # what DeepSpeed is given (ZeRO stage, parameter and optimizer offload, prefetch limits)
        atomic_write_json(run.deepspeed_config, ds_config)
    engine, _ = build_engine(policy, profile, gas, rl.steps, ds_config)
    generator = torch.Generator().manual_seed(profile.run.seed * 7919 + rank)
    stream = PromptStream(split.train, profile.run.seed, rank, world)
    max_new = profile.rollout.max_new_tokens
    evaluator = _Evaluator(policy, split.eval, reward_fn, profile, max_new, rank, world, env)
    metrics = MetricsLog(run.metrics, enabled=rank == 0)
    summary_path = run.summary

    step, resumed_from, nonfinite_streak, nonfinite_total = 0, None, 0, 0
    eval_before = None
    latest = None if fresh else run.latest_checkpoint()
    if latest is not None:
        state = ckpt.load_checkpoint(latest[1], engine, generator, rank)
        step, resumed_from = state["step"], state["step"]
        stream.cursor = state["cursor"]
        nonfinite_total = state.get("nonfinite_total", 0)
        eval_before = state.get("eval_before")
        metrics.truncate_after(step)
        emit("resume", {"step": step, "checkpoint": str(latest[1])})
    else:
        metrics.truncate_after(0)
        first = evaluator()
        eval_before = first["eval_accuracy"] if first else None
        emit("eval", {"step": 0, **(first or {})})
    if rank == 0:
        atomic_write_json(summary_path, {"eval_before": eval_before, "status": "running", "step": step})
        if profile.run.loggers:  # after the resume point is known: TensorBoard drops the steps after it
            from orbitctl.rl.loggers import open_loggers

            metrics.loggers = open_loggers(profile, run, resumed_at=step)
            closing.push(lambda kind, exc, tb: metrics.close(failed=kind is not None))

    http = _http_rollout(profile, run, policy, rank, closing, emit) if profile.rollout.engine == "http" else None
    health = HealthMonitor(_memory_limit(profile))
    clock = StepClock(rl.steps)
    last: dict = {}
    # the full infer distribution is kept for the align loss only while it stays small
    # (tiny vocabularies); otherwise the align loss uses the sampled-token k3 estimate
    from orbitctl.plan.budget import KEPT_DIST_BUDGET_BYTES  # the plan counts what is kept under the same rule

    dist_bytes = profile.rollout_batch_size * max_new * int(policy.model.config.vocab_size) * 4
    keep_dist = rl.align_loss.active and dist_bytes <= KEPT_DIST_BUDGET_BYTES \
        and env is None  # multi-turn rollouts keep sampled-token log-probs only (k3 align estimate)
    while step < rl.steps:
        positions, items = zip(*stream.next_step(rl.prompts_per_step))
        batch = advantages = None  # the last step's experience (its kept infer distribution) goes before the next
        with meter.phase("rollout"):
            # draws keyed by each sequence's place in the run: the same tokens on 1 rank or N
            if http is not None:
                batch = http.collect(step, list(items), reward_fn, positions)
            elif env is not None:
                batch = collect_episodes(policy, env, list(items), group_size=rl.group_size,
                                         batch_size=profile.rollout_batch_size, max_turns=profile.rollout.max_turns,
                                         max_new_tokens=max_new, temperature=profile.rollout.temperature,
                                         top_p=profile.rollout.top_p, generator=generator,
                                         keys=(profile.run.seed, positions))
            else:
                batch = collect(policy, list(items), reward_fn, group_size=rl.group_size,
                                batch_size=profile.rollout_batch_size, max_new_tokens=max_new,
                                temperature=profile.rollout.temperature, top_p=profile.rollout.top_p,
                                generator=generator, keep_dist=keep_dist, keys=(profile.run.seed, positions))
        advantages = group_advantages(batch.rewards, rl.group_size, rl.std_normalize) if rl.algorithm == "grpo" \
            else _ppo_advantages(batch.rewards, rl.group_size)
        rollout_stats = _rollout_stats(batch)
        updates: list[dict] = []

        def on_step(stats, seconds, applied, grad_norm):
            updates.append({"stats": stats, "seconds": seconds, "applied": applied, "grad_norm": grad_norm})

        with meter.phase("policy_update") as ran:
            ran.full = run_update(engine, policy, batch, advantages, profile, on_step, max_steps=rl.steps - step)
        memory = meter.report()
        for i, upd in enumerate(updates):
            step += 1
            applied = upd["applied"] and upd["stats"].finite
            if not applied:
                nonfinite_streak += 1
                nonfinite_total += 1
            else:
                nonfinite_streak = 0
            record = _record(step, batch, rollout_stats, upd, i == 0,
                             engine.get_lr()[0], samples_seen=stream.cursor * rl.group_size)
            record["nonfinite_skipped"] = nonfinite_total
            if step % profile.run.eval_every == 0 or step == rl.steps:
                result = evaluator()
                if result:
                    record.update(result)
            record["phase_memory"], record["phase_memory_kind"] = memory["phase_memory"], memory["phase_memory_kind"]
            record["warnings"] = health.check(record) + (memory["memory_warnings"] if i == 0 else [])
            metrics.append(record)
            last = record
            emit("step", {**record, **clock.tick(step)})  # the live view's ETA; not a metric of the run
            if nonfinite_streak >= rl.max_nonfinite_steps:
                if rank == 0:
                    atomic_write_json(summary_path, {"eval_before": eval_before, "status": "failed", "step": step})
                good = run.latest_checkpoint()
                raise RunFailed(
                    f"{nonfinite_streak} optimizer steps in a row had a non-finite loss or gradient (step {step}); "
                    f"updates were skipped and training stopped",
                    fix=f"last good checkpoint: {good[1] if good else 'none yet'}; lower rl.lr or check the reward "
                        f"for NaN/inf values, then rerun the same command to resume")
        # no checkpoint inside a non-finite streak: the newest one stays the last known-good state
        due = step % profile.run.save_every < optimizer_steps_per_rollout or step >= rl.steps
        if due and nonfinite_streak == 0:
            ckpt.save_checkpoint(run_dir, step, engine, policy, generator,
                                 {"step": step, "cursor": stream.cursor, "nonfinite_total": nonfinite_total,
                                  "eval_before": eval_before}, rank, profile.run.keep_last)
    adapter_dir = run.adapter
    from orbitctl.model.adapters import adapter_gathered, save_adapter

    with adapter_gathered(policy.model):  # every rank: ZeRO-3 gathers the partitioned adapter for rank 0's save
        if rank == 0:
            atomic_dir(adapter_dir, lambda tmp: save_adapter(policy.model, tmp, policy.adapter_kind,
                                                             policy.hidden_size), replace=True)
    eval_after = last.get("eval_accuracy") if last else _final_eval(evaluator)
    result = TrainResult(str(run_dir), step, resumed_from, eval_before, eval_after,
                         time.perf_counter() - wall_start, str(adapter_dir), policy.report.summary(),
                         nonfinite_total, last, rank)
    if rank == 0:
        atomic_write_json(summary_path, {**result.to_dict(), "status": "finished"})
    return result


class _HttpRollout:
    """``rollout.engine: http``: the adapter published to the engine before each rollout, the rollout sampled there."""

    def __init__(self, engine, sync, policy, profile) -> None:
        self.engine, self.sync, self.policy, self.profile = engine, sync, policy, profile

    def collect(self, step: int, items: list, reward_fn, positions):
        from orbitctl.rl.engine_http import collect_http

        ro, rl = self.profile.rollout, self.profile.rl
        model = self.sync.publish(step)
        return collect_http(self.engine, model, self.policy, items, reward_fn, group_size=rl.group_size,
                            batch_size=self.profile.rollout_batch_size, max_new_tokens=ro.max_new_tokens,
                            temperature=ro.temperature, top_p=ro.top_p, seed=self.profile.run.seed,
                            positions=positions)


def _http_rollout(profile, run: RunDir, policy, rank: int, closing, emit) -> _HttpRollout:
    """The engine client for ``rollout.engine: http``: attached to ``rollout.engine_url``, or to an ``orbitctl serve``
    that rank 0 starts on loopback over the run's own profile (stopped when the run ends)."""
    from orbitctl.rl.engine_http import AdapterSync, HttpEngine, engine_endpoint, process_tag

    ro = profile.rollout
    # a request holds up to a rollout batch (of whole groups): what the engine train starts accepts
    url, api_key = engine_endpoint(ro.engine_url, run.profile, run.root, rank, closing,
                                   max_batch=max(1024, profile.rollout_batch_size, profile.rl.group_size))
    engine = HttpEngine(url, ro.engine_api, vocab_size=int(policy.model.config.vocab_size), timeout_s=ro.engine_timeout_s,
                        retries=ro.engine_retries, api_key=api_key)
    emit("engine", {"url": url, "api": ro.engine_api, "started": ro.engine_url is None})
    return _HttpRollout(engine, AdapterSync(engine, policy, run.root, profile.name, process_tag(rank), rank), policy,
                        profile)


def _environment(profile):
    """The environment class ``data.train: env:NAME`` names, or None for prompt data (where
    ``rollout.max_turns`` must stay 1: there is nothing to answer a second turn)."""
    from orbitctl.rl.envs import env_name, environment

    if env_name(profile.data.train) is None:
        if profile.rollout.max_turns > 1:
            raise UserError(f"rollout.max_turns: {profile.rollout.max_turns} needs an environment, and data.train "
                            f"is {profile.data.train}",
                            fix="set data.train: env:NAME (env:guess, env:textworld), or rollout.max_turns: 1")
        return None
    return environment(profile.data.train)


def _final_eval(evaluator) -> float | None:
    out = evaluator()
    return out["eval_accuracy"] if out else None


def _ppo_advantages(rewards, group_size: int):
    """PPO without a critic: rewards minus the group mean (a baseline), no std scaling."""
    from orbitctl.rl.losses import group_advantages

    return group_advantages(rewards, group_size, std_normalize=False)


def _rollout_stats(batch) -> dict:
    from orbitctl.dist.collectives import reduce_scalars

    lengths = batch.completion_mask.sum(-1).float()
    # one collective for the step's statistics, on the device the default group's backend takes
    valid, calls = batch.tool_calls or (0, 0)
    n, r_sum, r_sq, correct, length_sum, valid, calls = reduce_scalars([
        float(batch.size), float(batch.rewards.sum()), float((batch.rewards ** 2).sum()),
        float((batch.rewards >= 1.0 - 1e-9).sum()), float(lengths.sum()), float(valid), float(calls)])
    mean = r_sum / n
    return {
        "reward_mean": mean,
        "reward_std": max(0.0, r_sq / n - mean * mean) ** 0.5,
        "accuracy": correct / n,
        "response_length": length_sum / n,
        "samples": int(n),
        "tokens": int(length_sum),
        # an environment with tools: the share of actions that were well-formed tool calls
        **({"tool_call_valid_rate": valid / calls} if batch.tool_calls is not None and calls else {}),
    }


def _record(step, batch, rollout_stats, upd, first_of_rollout, lr, samples_seen) -> dict:
    from orbitctl.rl.runlog import peak_memory_bytes

    stats = upd["stats"].means()
    rollout_s = batch.rollout_s if first_of_rollout else 0.0
    reward_s = batch.reward_s if first_of_rollout else 0.0
    step_s = rollout_s + reward_s + upd["seconds"]
    peak, kind = peak_memory_bytes()
    grad_norm = upd["grad_norm"]
    return {
        "step": step,
        "samples": samples_seen,
        "tokens": rollout_stats["tokens"],
        **{k: rollout_stats[k] for k in ("reward_mean", "reward_std", "accuracy", "response_length",
                                         "tool_call_valid_rate") if k in rollout_stats},
        "policy_loss": stats.get("policy_loss"),
        "align_loss": stats.get("align_loss"),
        "ref_kl": stats.get("ref_kl"),
        "entropy": stats.get("entropy"),
        "mismatch_logp_abs_mean": stats.get("mismatch_logp_abs_mean"),
        "mismatch_logp_abs_max": stats.get("mismatch_logp_abs_max"),
        "mismatch_k3_kl": stats.get("mismatch_k3_kl"),
        "mismatch_prob_abs_mean": stats.get("mismatch_prob_abs_mean"),
        "routing_agreement": stats.get("routing_agreement"),  # MoE: sampled tokens with the same top-k on both paths
        "routing_agreement_min_layer": stats.get("routing_agreement_min_layer"),
        "routing_agreement_per_layer": stats.get("routing_agreement_per_layer"),
        "is_ratio_mean": stats.get("is_ratio_mean"),
        "is_ratio_max": stats.get("is_ratio_max"),
        "is_ratio_min": -stats["neg_is_ratio_min"] if "neg_is_ratio_min" in stats else None,
        "is_clipped_fraction": stats.get("is_clipped_fraction"),
        "ppo_clipped_fraction": stats.get("ppo_clipped_fraction"),
        "offload_bytes": stats.get("offload_bytes"),  # checkpoint boundaries sent to host memory (this rank)
        "grad_norm": float(grad_norm) if grad_norm is not None and upd["applied"] else None,
        "update_applied": bool(upd["applied"] and upd["stats"].finite),
        "lr": lr,
        "time_rollout_s": rollout_s,
        "time_reward_s": reward_s,
        "time_update_s": upd["seconds"],
        "samples_per_s": rollout_stats["samples"] / step_s if first_of_rollout and step_s > 0 else None,
        "tokens_per_s": rollout_stats["tokens"] / step_s if first_of_rollout and step_s > 0 else None,
        "peak_memory_bytes": peak,
        "peak_memory_kind": kind,
    }


def _memory_limit(profile) -> int | None:
    import torch

    if torch.cuda.is_available():
        return int(profile.derived()["usable_bytes_per_gpu"])
    return int(profile.hardware.host_ram_gib * 2**30 * profile.memory.max_hbm_utilization)
