"""Why an RL run is unstable, read from its metrics.jsonl: each cause a ranked Finding with its fix.

    from orbitctl.doctor.run_health import diagnose_run
    findings = diagnose_run("runs/tiny-cpu")   # worst first; one PASS finding when nothing is alarming

Every detector reads the per-step records (fields in docs/train.md) and the profile the run
trained with (``RUN_DIR/profile.yaml``), and compares one measured number with a named threshold
below. A finding's ``data["score"]`` is that number over its threshold (1 or more once it fires);
FAIL findings come first, then the higher score. Reward swinging is a symptom: it is reported on
its own only when no cause found here explains it (the learning rate, the train/infer mismatch or
the IS correction), and otherwise shows up in the cause's evidence. Each fix is a set of
``--set`` changes, re-planned (orbitctl.doctor.replan.replan_change) so a fix that costs memory
says whether the run still fits. No torch: this reads JSON and plans on paper.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any

from orbitctl.doctor.findings import FAIL, INFO, PASS, SEVERITY, WARN, Finding
from orbitctl.errors import InputFileError
from orbitctl.rundir import RUN_DIR_FIX, RunDir, metric_series, read_metrics
from orbitctl.units import GiB, gib

AREA = "training run"

FINDING_IDS = ("run.healthy", "run.nonfinite", "run.no_signal", "run.mismatch_growth", "run.entropy_collapse",
               "run.entropy_blowup", "run.grad_spikes", "run.lr_high", "run.warming_up", "run.is_clipping",
               "run.adapter_small", "run.warnings", "run.reward_swing")
"""Every id a run finding can have; docs/doctor.md describes each."""

MIN_STEPS = 10
"""Fewer logged steps (rollouts, for reward) than this show no trend: medians of two or three points are noise."""
WINDOW_FRACTION = 0.2
"""The first and the last fifth of the run are compared: enough points for a median, far enough apart for a trend."""
MISMATCH_GROWTH = 2.0
"""The last window's k3 at twice the first's or more: the train and infer paths drift apart as the adapter moves."""
MISMATCH_FAIL_FACTOR = 10.0
"""k3 an order of magnitude above alignment.k3_kl_warn: the IS correction is estimating from a different policy."""
MISMATCH_FLOOR_FRACTION = 0.1
"""A k3 under a tenth of alignment.k3_kl_warn counts as that tenth: growth from nearly nothing to nearly nothing is noise."""
ENTROPY_COLLAPSE = 0.5
"""Entropy under half its start and still falling: the policy is sharpening faster than it learns."""
ENTROPY_FAIL = 0.1
"""Under a tenth of its start the policy samples one answer: train's own live view warns at the same level."""
ENTROPY_BLOWUP = 2.0
"""Entropy at twice its start and still rising: the updates are pushing the policy towards noise."""
GRAD_WINDOW = 20
"""Steps of history a gradient norm is compared with: the window train's own spike warning uses."""
GRAD_SPIKE_Z = 6.0
"""Robust z-score (MAD scaled to a normal sigma) of a spike: a normal sample passes 6 sigma once in 10^9."""
GRAD_SPIKE_RATIO = 10.0
"""A spike is also 10x the rolling median, train's own warning level: RL gradient norms are heavy-tailed, so
z-scores alone flag healthy steps (the demo's 300 steps have 22 over 6 sigma and 3x, 4 over 10x)."""
GRAD_SPIKES_WARN = 3
"""One spike is an odd batch; three in a run are a pattern."""
GRAD_SPIKE_SHARE = 0.02
"""And more than one step in 50: the healthy demo reaches 10x about once in 70 steps (4 of 290)."""
SWING_RATIO = 3.0
"""Step-to-step reward changes 3x what sampling alone explains (reward_std / sqrt(prompts per rollout)) are swings."""
LR_PEAK_FRACTION = 0.9
"""A step at 90% of rl.lr or more counts as at the peak learning rate."""
LR_CALMER_BEFORE = 2.0
"""The reward swings twice as much at the peak as before it: the swinging came with the learning rate."""
LR_CLIPPED_SHARE = 0.5
"""Gradient norm above rl.grad_clip in half the peak steps or more: every update is as large as clipping allows."""
IS_CLIPPED_WARN = 0.05
"""5% of sampled tokens truncated (TIS) or masked (IcePop): the IS correction, not the align loss, carries the run."""
PPO_CLIPPED_WARN = 0.2
"""The PPO clip active on a fifth of the tokens: each update moves the policy further than the clip allows."""
NO_SIGNAL_STD = 1e-6
"""reward_std at or under this: every completion scored the same, so group advantages are zero."""
SOLVED_ACCURACY = 0.99
"""Accuracy this high explains a flat or uniform reward: the task is solved, not stuck."""
PLATEAU_MIN_ROLLOUTS = 30
"""A plateau is judged on 30 rollouts or more: the last two thirds must each hold enough points for a median."""
JUDGED_WARNINGS = ("entropy collapse", "gradient-norm spike")
"""Kinds of train's per-step warnings that a detector here judges over the whole run: shown as INFO, the rest WARN."""
SEED_WARMUP_STEPS = 1000
"""The warmup the tutorial's fix for unstable training sets."""
SEED_ALIGN_WEIGHT = 0.5
"""The align-loss weight the tutorial's fix sets (from the method's 0.1)."""


def diagnose_run(run_dir: str | Path, *, profile: Any = None) -> list[Finding]:
    """Every detector on the run in ``run_dir``, worst first; ``profile`` replaces the run's profile.yaml.

    Raises InputFileError (exit 2) for a missing directory, a missing or empty metrics.jsonl or a
    missing profile.yaml."""
    run = RunDir(run_dir)
    records = read_metrics(run.root)
    if not records:
        raise InputFileError(f"{run.metrics}: no step records", fix=f"{RUN_DIR_FIX}, after at least one training step")
    if profile is None:
        if not run.profile.is_file():
            raise InputFileError(f"{run.profile}: no profile.yaml in the run directory",
                                 fix="pass the profile the run trained with: orbitctl doctor PROFILE --run RUN_DIR")
        from orbitctl.profile import load_profile

        profile = load_profile(str(run.profile))
    found = [f for detector in DETECTORS if (f := detector(records, profile)) is not None]
    explained = any(f.id in ("run.lr_high", "run.mismatch_growth", "run.is_clipping") for f in found)
    if not explained and (swing := _reward_swing(records, profile)) is not None:
        found.append(swing)
    found.sort(key=lambda f: (-SEVERITY[f.status], -f.data.get("score", 0.0)))
    if not any(f.status in (FAIL, WARN) for f in found):
        steps = [r["step"] for r in records]
        short = f" (trends need {MIN_STEPS} steps or more)" if len(records) < MIN_STEPS else ""
        found.insert(0, Finding("run.healthy", AREA, PASS, "nothing alarming in the run's metrics",
                                [f"{len(records)} step record(s), steps {steps[0]}-{steps[-1]}: "
                                 f"no detector found a problem{short}"]))
    return found


# --- statistics -------------------------------------------------------------------------------------------


def _windows(values: list[Any]) -> tuple[list[Any], list[Any]]:
    """The first and the last WINDOW_FRACTION of ``values`` (3 points each at least)."""
    width = max(3, round(len(values) * WINDOW_FRACTION))
    return values[:width], values[-width:]


def _slope(points: list[tuple[int, float]]) -> float:
    """Theil-Sen slope (median of pairwise slopes) of at most 64 evenly spaced points: one outlier cannot tilt it."""
    if len(points) > 64:
        points = [points[round(i * (len(points) - 1) / 63)] for i in range(64)]
    slopes = [(y2 - y1) / (x2 - x1) for i, (x1, y1) in enumerate(points) for x2, y2 in points[i + 1:] if x2 != x1]
    return statistics.median(slopes) if slopes else 0.0


def _rollouts(records: list[dict]) -> list[dict]:
    """One record per rollout: the optimizer steps of one rollout (ppo_epochs x minibatches) share its reward."""
    out: list[dict] = []
    for r in records:
        if not out or r.get("samples") is None or r.get("samples") != out[-1].get("samples"):
            out.append(r)
    return out


def _swing(rollouts: list[dict], profile: Any) -> tuple[float, int] | None:
    """(std of the reward's step-to-step change over the sampling noise of that change, rollouts) or None.

    The noise bound treats every prompt's completions as one sample (reward_std / sqrt(prompts)),
    the most a group's shared prompt can add, so a ratio over SWING_RATIO is the policy moving."""
    reward = [r["reward_mean"] for r in rollouts if _finite(r.get("reward_mean")) and _finite(r.get("reward_std"))]
    spread = [r["reward_std"] for r in rollouts if _finite(r.get("reward_mean")) and _finite(r.get("reward_std"))]
    if len(reward) < MIN_STEPS:
        return None
    noise = statistics.median(spread) / math.sqrt(_prompts(rollouts, profile)) * math.sqrt(2)
    if noise <= NO_SIGNAL_STD:
        return None
    changes = [b - a for a, b in zip(reward, reward[1:])]
    return statistics.pstdev(changes) / noise, len(reward)


def _prompts(rollouts: list[dict], profile: Any) -> float:
    """Prompts per rollout over all ranks: from the ``samples`` counter, else the profile's (one rank)."""
    samples = [b["samples"] - a["samples"] for a, b in zip(rollouts, rollouts[1:])
               if isinstance(a.get("samples"), int) and isinstance(b.get("samples"), int) and b["samples"] > a["samples"]]
    per_rollout = statistics.median(samples) if samples else profile.rl.prompts_per_step * profile.rl.group_size
    return max(1.0, per_rollout / profile.rl.group_size)


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _steps(steps: list[int], limit: int = 8) -> str:
    shown = ", ".join(str(s) for s in steps[:limit])
    return shown + (f" and {len(steps) - limit} more" if len(steps) > limit else "")


def _finding(check_id: str, status: str, title: str, evidence: list[str], score: float, profile: Any,
             fix: str, change: dict[str, Any] | None = None, **data: Any) -> Finding:
    """A run finding; ``change`` becomes ready-to-paste --set flags, re-planned for the run's GPUs."""
    from orbitctl.doctor.replan import replan_change
    from orbitctl.plan.result import set_values

    data = {"score": round(score, 3), **data}
    if change:
        verdict, now = replan_change(profile, change), replan_change(profile, {})
        same = verdict.peak_bytes is not None and verdict.peak_bytes == now.peak_bytes
        before = "the same peak as now" if same else f"now {_gib(now.peak_bytes)}"
        fix = f"{fix}: {' '.join('--set ' + flag for flag in set_values(change))} ({verdict.summary()}; {before})"
        if verdict.fits is False and verdict.advice:
            fix += ("; to fit, also --set " + " --set ".join(verdict.set_flags) if verdict.set_flags
                    else f"; closest the planner gets: {verdict.advice[0]}")
        data["set"] = set_values(change)
        data["plan"] = {"fits": verdict.fits, "peak_bytes": verdict.peak_bytes, "usable_bytes": verdict.usable_bytes,
                        "error": verdict.error}
    return Finding(check_id, AREA, status, title, evidence, fix=fix, data=data)


def _gib(n: int | None) -> str:
    return "?" if n is None else f"{gib(n, 0 if n >= 10 * GiB else 2)} GiB"


def _align_change(profile: Any) -> dict[str, Any]:
    loss = profile.rl.align_loss
    change: dict[str, Any] = {"rl.align_loss.weight": max(SEED_ALIGN_WEIGHT, round(loss.weight * 5, 6))}
    if loss.kind == "none":
        change["rl.align_loss.kind"] = "kl"
    return change


# --- detectors: each (records, profile) -> Finding or None --------------------------------------------------


def _mismatch(records: list[dict], profile: Any) -> Finding | None:
    k3 = metric_series(records, "mismatch_k3_kl")
    if len(k3) < MIN_STEPS:
        return None
    warn = profile.alignment.k3_kl_warn
    first, last = (statistics.median(v for _, v in w) for w in _windows(k3))
    floor = warn * MISMATCH_FLOOR_FRACTION
    growth = max(last, floor) / max(first, floor)
    if last < warn or (growth < MISMATCH_GROWTH and last < warn * MISMATCH_FAIL_FACTOR):
        return None
    evidence = [f"mismatch_k3_kl median {first:.3g} over the first {len(_windows(k3)[0])} steps -> {last:.3g} over "
                f"the last (x{growth:.1f}); alignment.k3_kl_warn is {warn:g}",
                f"peak {max(v for _, v in k3):.3g} at step {max(k3, key=lambda p: p[1])[0]}"]
    logp = metric_series(records, "mismatch_logp_abs_mean")
    if len(logp) >= MIN_STEPS:
        a, b = (statistics.median(v for _, v in w) for w in _windows(logp))
        evidence.append(f"mismatch_logp_abs_mean {a:.3g} -> {b:.3g}")
    _add_swing(evidence, records, profile)
    status = FAIL if last >= warn * MISMATCH_FAIL_FACTOR else WARN
    is_kind = profile.rl.is_correction.kind
    check = ("rl.is_correction.kind is none: set it to tis" if is_kind == "none"
             else f"check rl.is_correction ({is_kind}) truncates what it should")
    return _finding("run.mismatch_growth", status,
                    "train/infer mismatch growing" if growth >= MISMATCH_GROWTH else "train/infer mismatch high",
                    evidence, last / warn, profile,
                    f"weak alignment compensation: raise the align-loss weight ({check}; "
                    f"orbitctl verify-alignment measures the two paths)", _align_change(profile),
                    first=first, last=last, growth=growth)


def _entropy(records: list[dict], profile: Any) -> Finding | None:
    series = metric_series(records, "entropy")
    if len(series) < MIN_STEPS:
        return None
    head, tail = _windows(series)
    first, last = statistics.median(v for _, v in head), statistics.median(v for _, v in tail)
    if first <= 0:
        return None
    slope = _slope(tail)
    ratio = last / first
    evidence = [f"entropy median {first:.4g} nats over steps {head[0][0]}-{head[-1][0]} -> {last:.4g} over steps "
                f"{tail[0][0]}-{tail[-1][0]} ({ratio:.0%} of its start); last window's slope {slope:.3g} per step"]
    window = (f"orbitctl verify-alignment judges the +-{profile.alignment.entropy_fluctuation_max:.0%} window of "
              f"{profile.alignment.entropy_window} steps")
    if ratio < ENTROPY_COLLAPSE and (slope < 0 or ratio < ENTROPY_FAIL):
        return _finding("run.entropy_collapse", FAIL if ratio < ENTROPY_FAIL else WARN, "entropy collapsing", evidence,
                        ENTROPY_COLLAPSE / max(ratio, 1e-9), profile,
                        f"the policy sharpens faster than it learns: lower the learning rate and lengthen warmup ({window})",
                        {**_lr_change(profile), **_warmup_change(profile)}, first=first, last=last, slope=slope)
    if ratio > ENTROPY_BLOWUP and slope > 0:
        return _finding("run.entropy_blowup", WARN, "entropy blowing up", evidence, ratio / ENTROPY_BLOWUP, profile,
                        f"updates push the policy towards noise: lower the learning rate and keep clipping ({window})",
                        {**_lr_change(profile), **_clip_change(profile)}, first=first, last=last, slope=slope)
    return None


def _grad_spikes(records: list[dict], profile: Any) -> Finding | None:
    series = metric_series(records, "grad_norm")
    spikes: list[tuple[int, float, float]] = []
    for i, (step, norm) in enumerate(series):
        history = [v for _, v in series[max(0, i - GRAD_WINDOW):i]]
        if len(history) < MIN_STEPS:
            continue
        median = statistics.median(history)
        mad = statistics.median(abs(v - median) for v in history) * 1.4826
        z = (norm - median) / mad if mad > 0 else math.inf
        if z > GRAD_SPIKE_Z and norm > GRAD_SPIKE_RATIO * median:
            spikes.append((step, norm, median))
    judged = max(1, len(series) - MIN_STEPS)
    if len(spikes) < GRAD_SPIKES_WARN or len(spikes) / judged <= GRAD_SPIKE_SHARE:
        return None
    clip = profile.rl.grad_clip
    evidence = [f"{len(spikes)} gradient-norm spike(s) in {judged} steps (robust z > {GRAD_SPIKE_Z:g} and > "
                f"{GRAD_SPIKE_RATIO:g}x the median of the previous {GRAD_WINDOW} steps) at step(s) "
                f"{_steps([s for s, _, _ in spikes])}",
                "largest: " + ", ".join(f"{n:.3g} at step {s} (median {m:.3g})"
                                        for s, n, m in sorted(spikes, key=lambda x: -x[1] / x[2])[:3])]
    if clip > 0:
        evidence.append(f"rl.grad_clip {clip:g}: {sum(1 for _, n, _ in spikes if n > clip)} spike(s) were clipped")
        fix = "lower the learning rate and keep clipping"
    else:
        evidence.append("rl.grad_clip is 0: nothing caps a spike's update")
        fix = "clip the gradient norm and lower the learning rate"
    return _finding("run.grad_spikes", WARN, "gradient-norm spikes", evidence, len(spikes) / judged / GRAD_SPIKE_SHARE,
                    profile, fix, {**_lr_change(profile), **_clip_change(profile)},
                    spikes=[{"step": s, "grad_norm": n, "median": m} for s, n, m in spikes])


def _learning_rate(records: list[dict], profile: Any) -> Finding | None:
    peak, rl = profile.rl.lr, profile.rl
    lrs = metric_series(records, "lr")
    if not lrs:
        return None
    last_step, last_lr = lrs[-1]
    if last_lr < LR_PEAK_FRACTION * peak and last_step < rl.warmup_steps:
        return Finding("run.warming_up", AREA, INFO, "still warming up",
                       [f"lr {last_lr:.3g} at step {last_step}, {last_lr / peak:.0%} of rl.lr {peak:g}; warmup ends at "
                        f"step {rl.warmup_steps}: judge stability after it"], data={"score": 0.0})
    at_peak = {s for s, v in lrs if v >= LR_PEAK_FRACTION * peak}
    rollouts = _rollouts(records)
    swing = _swing([r for r in rollouts if r["step"] in at_peak], profile)
    if swing is None or swing[0] < SWING_RATIO:
        return None
    before = _swing([r for r in rollouts if r["step"] not in at_peak], profile)
    norms = [v for s, v in metric_series(records, "grad_norm") if s in at_peak]
    clipped = sum(1 for v in norms if rl.grad_clip > 0 and v > rl.grad_clip) / len(norms) if norms else 0.0
    calmer_before = before is not None and swing[0] >= LR_CALMER_BEFORE * before[0]
    if clipped < LR_CLIPPED_SHARE and not calmer_before:
        return None
    evidence = [f"reward swings at the peak learning rate ({peak:g}): step-to-step change {swing[0]:.1f}x the sampling "
                f"noise over {swing[1]} rollouts"]
    if norms:
        evidence.append(f"grad_norm above rl.grad_clip {rl.grad_clip:g} in {clipped:.0%} of the peak steps")
    if before is not None:
        evidence.append(f"before the peak: {before[0]:.1f}x over {before[1]} rollouts")
    evidence.append(f"rl.warmup_steps {rl.warmup_steps}")
    return _finding("run.lr_high", WARN, "learning rate too high: reward swinging at the peak", evidence,
                    swing[0] / SWING_RATIO + clipped, profile, "lower the learning rate and warm up longer",
                    {**_lr_change(profile), **_warmup_change(profile)}, swing=swing[0], clipped_share=clipped)


def _is_clipping(records: list[dict], profile: Any) -> Finding | None:
    values = {}
    for name in ("is_clipped_fraction", "ppo_clipped_fraction"):
        series = metric_series(records, name)
        if len(series) >= MIN_STEPS:
            values[name] = statistics.median(v for _, v in _windows(series)[1])
    is_score = values.get("is_clipped_fraction", 0.0) / IS_CLIPPED_WARN
    ppo_score = values.get("ppo_clipped_fraction", 0.0) / PPO_CLIPPED_WARN
    if max(is_score, ppo_score) < 1:
        return None
    evidence = [f"{name} median {value:.1%} over the last window (warn at "
                f"{IS_CLIPPED_WARN if name.startswith('is') else PPO_CLIPPED_WARN:.0%})" for name, value in values.items()]
    ratios = [v for name in ("is_ratio_max", "is_ratio_min") for _, v in metric_series(records, name)]
    if ratios:
        evidence.append(f"IS ratio range {min(ratios):.3g}-{max(ratios):.3g} (rl.is_correction "
                        f"{profile.rl.is_correction.kind}, cap {profile.rl.is_correction.cap:g})")
    _add_swing(evidence, records, profile)
    return _finding("run.is_clipping", WARN, "IS / PPO clipping carries the run", evidence, max(is_score, ppo_score),
                    profile, "weak alignment compensation: raise the align-loss weight so fewer tokens need clipping",
                    _align_change(profile), **values)


def _no_signal(records: list[dict], profile: Any) -> Finding | None:
    spread = metric_series(records, "reward_std")
    if len(spread) < MIN_STEPS:
        return None
    tail = _windows(spread)[1]
    if statistics.median(v for _, v in tail) > NO_SIGNAL_STD:
        return None
    accuracy = metric_series(records, "accuracy")
    if accuracy and accuracy[-1][1] >= SOLVED_ACCURACY:
        return None
    flat = [s for s, v in spread if v <= NO_SIGNAL_STD]
    return _finding("run.no_signal", FAIL, "no learning signal: every completion gets the same reward",
                    [f"reward_std <= {NO_SIGNAL_STD:g} on {len(flat)} of {len(spread)} steps, from step {flat[0]}",
                     f"reward_mean {records[-1].get('reward_mean')} at step {records[-1]['step']}; with one reward per "
                     f"group GRPO's advantages are zero"], 10.0, profile,
                    "check the reward on a few completions (data.reward) and sample more varied completions", None)


def _adapter_small(records: list[dict], profile: Any) -> Finding | None:
    from orbitctl.plan.adapters import adapter_rank

    rollouts = [r for r in _rollouts(records) if _finite(r.get("reward_mean"))]
    if len(rollouts) < PLATEAU_MIN_ROLLOUTS or (hidden := _hidden_size(profile)) is None:
        return None
    rank = adapter_rank(profile.adapter, hidden)
    if rank > max(1, hidden // 10):
        return None
    third = len(rollouts) // 3
    middle = statistics.median(r["reward_mean"] for r in rollouts[third:2 * third])
    last = statistics.median(r["reward_mean"] for r in rollouts[2 * third:])
    noise = statistics.median(r.get("reward_std") or 0.0 for r in rollouts) / math.sqrt(_prompts(rollouts, profile))
    accuracy = rollouts[-1].get("accuracy")
    if last - middle > noise or (_finite(accuracy) and accuracy >= SOLVED_ACCURACY) or noise <= NO_SIGNAL_STD:
        return None
    return _finding("run.adapter_small", WARN, "reward plateaued with a small adapter",
                    [f"reward_mean median {middle:.4g} over the middle third -> {last:.4g} over the last "
                     f"({len(rollouts)} rollouts): less than the sampling noise {noise:.3g} gained",
                     f"adapter.rank {rank} (the 'auto' rank of hidden size {hidden} is {max(1, hidden // 10)})"],
                    1.0, profile, "give the adapter more capacity (double its rank)",
                    {"adapter.rank": rank * 2}, middle=middle, last=last)


def _nonfinite(records: list[dict], profile: Any) -> Finding | None:
    skipped = [r["step"] for r in records if r.get("update_applied") is False]
    total = max((r.get("nonfinite_skipped") or 0 for r in records), default=0)
    if not skipped and not total:
        return None
    limit = profile.rl.max_nonfinite_steps
    stopped = len(records) >= limit and all(r.get("update_applied") is False for r in records[-limit:])
    evidence = [f"{max(total, len(skipped))} update(s) skipped for a non-finite loss or gradient, at step(s) {_steps(skipped)}"]
    if stopped:
        evidence.append(f"the last {limit} steps were all skipped (rl.max_nonfinite_steps): training stopped")
    return _finding("run.nonfinite", FAIL if stopped else WARN, "non-finite updates skipped", evidence,
                    float(max(total, len(skipped))), profile,
                    "lower the learning rate, keep clipping, and check the reward for NaN/inf; rerun to resume",
                    {**_lr_change(profile), **_clip_change(profile)}, skipped_steps=skipped)


def _recorded_warnings(records: list[dict], profile: Any) -> Finding | None:
    kinds: dict[str, list[int]] = {}
    examples: dict[str, str] = {}
    for r in records:
        for text in r.get("warnings") or []:
            kind = str(text).split(":", 1)[0]
            kinds.setdefault(kind, []).append(r["step"])
            examples.setdefault(kind, str(text))
    if not kinds:
        return None
    evidence = [f"{kind}: {len(steps)} time(s), step(s) {_steps(steps)}; first: {examples[kind]}"
                for kind, steps in kinds.items()]
    unjudged = [kind for kind in kinds if kind not in JUDGED_WARNINGS]
    change = None
    fix = ("train warns on single steps; run.entropy_collapse and run.grad_spikes judge the whole run" if not unjudged
           else f"read the run's log around the step(s) of: {', '.join(unjudged)}")
    if any("above the profile's limit" in text for text in examples.values()) and profile.memory.micro_batch_size > 1:
        mem = profile.memory
        change = {"memory.micro_batch_size": mem.micro_batch_size // 2,
                  "memory.gradient_accumulation_steps": mem.gradient_accumulation_steps * 2}
        fix = "memory above the profile's limit: halve the micro-batch (same global batch)"
    return _finding("run.warnings", WARN if unjudged else INFO, "warnings recorded during training", evidence,
                    float(len(unjudged)), profile, fix, change, warnings={kind: steps for kind, steps in kinds.items()})


def _reward_swing(records: list[dict], profile: Any) -> Finding | None:
    swing = _swing(_rollouts(records), profile)
    if swing is None or swing[0] < SWING_RATIO:
        return None
    return _finding("run.reward_swing", WARN, "reward swinging", [
        f"reward_mean's step-to-step change is {swing[0]:.1f}x its sampling noise over {swing[1]} rollouts "
        f"(warn at {SWING_RATIO:g}x)", "no learning-rate, mismatch or clipping cause found in the metrics"],
        swing[0] / SWING_RATIO, profile,
        "the tutorial's fixes for unstable training: raise the align-loss weight, warm up longer",
        {**_align_change(profile), **_warmup_change(profile)}, swing=swing[0])


def _add_swing(evidence: list[str], records: list[dict], profile: Any) -> None:
    swing = _swing(_rollouts(records), profile)
    if swing is not None and swing[0] >= SWING_RATIO:
        evidence.append(f"reward swinging: step-to-step change {swing[0]:.1f}x the sampling noise")


def _warmup_change(profile: Any) -> dict[str, Any]:
    """The tutorial's 1000-step warmup, at most half the run's steps; nothing when warmup is already that long."""
    target = min(SEED_WARMUP_STEPS, profile.rl.steps // 2)
    return {"rl.warmup_steps": target} if target > profile.rl.warmup_steps else {}


def _lr_change(profile: Any) -> dict[str, Any]:
    """Half the peak learning rate, to three significant digits."""
    return {"rl.lr": float(f"{profile.rl.lr / 2:.3g}")}


def _clip_change(profile: Any) -> dict[str, Any]:
    return {} if profile.rl.grad_clip > 0 else {"rl.grad_clip": 1.0}


def _hidden_size(profile: Any) -> int | None:
    try:
        from orbitctl.arch import model_arch

        arch = model_arch(profile.model)
    except Exception:  # an unreadable model config leaves the rank unjudged, never the whole report
        return None
    return arch.hidden_size


DETECTORS = (_nonfinite, _no_signal, _mismatch, _entropy, _grad_spikes, _learning_rate, _is_clipping,
             _adapter_small, _recorded_warnings)
"""Every detector but the reward-swing symptom, which runs only when none of its causes fired."""
