"""The report's figures: one matplotlib Figure per subject, every run overlaid in its own colour.

    fig = draw_reward(runs)        # any draw_* returns the Figure; FIGURES maps file names to them
    fig.savefig("reward.png", dpi=DPI)

matplotlib (Agg backend) is imported inside the functions, so importing the report stays light. A
series no run logged leaves its panel saying "not logged" instead of an empty axis.
"""

from __future__ import annotations

import math
from typing import Callable

from orbitctl.report.runs import ReportRun
from orbitctl.units import GiB

DPI = 110
STEP = "optimizer step"
MARKERS = ("o", "s", "^", "D", "v")
"""Held-out accuracy markers, one shape per run, so runs that evaluated alike stay visible."""
PHASE_STYLE = {"rollout": "-", "reward": ":", "update": "--", "policy_update": "--", "adapter_sync": "-."}
MEMORY_KINDS = {"rss_rise": "resident-set rise, CPU", "rss_rise_lifetime": "resident-set rise (lifetime peak), CPU",
                "cuda_max_allocated": "torch max allocated, GPU"}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _colour(index: int) -> str:
    plt = _pyplot()
    cycle = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    return cycle[index % len(cycle)]


def _panels(columns: int, rows: int = 1, *, title: str, sharex: bool = False, width: float = 6.0):
    plt = _pyplot()
    fig, axes = plt.subplots(rows, columns, figsize=(width * columns, 4.0 * rows), squeeze=False, sharex=sharex)
    fig.suptitle(title, fontsize=13)
    return fig, [ax for row in axes for ax in row]


def _style(ax, title: str, ylabel: str, *, xlabel: str = STEP) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.set_title(title, fontsize=11)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def _legend(ax, *, outside: bool = False) -> None:
    """The panel's legend, if it has entries; ``outside`` (right of the panel) for many crossing lines."""
    if ax.get_legend_handles_labels()[0]:
        if outside:
            ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
        else:
            ax.legend(fontsize=8, framealpha=0.85)


def _not_logged(ax, what: str) -> None:
    ax.text(0.5, 0.5, f"{what}\nnot logged", ha="center", va="center", transform=ax.transAxes, fontsize=12,
            color="#777777")
    ax.set_xticks([])
    ax.set_yticks([])


def _unzip(series: list[tuple[int, float]]) -> tuple[list[int], list[float]]:
    return [s for s, _ in series], [v for _, v in series]


def _percent(ax) -> None:
    from matplotlib.ticker import PercentFormatter

    ax.yaxis.set_major_formatter(PercentFormatter(1.0))


def _line_panel(ax, runs: list[ReportRun], name: str, title: str, ylabel: str, *, log_when_positive: bool = False,
                reference: float | None = None) -> bool:
    """Each run's ``name`` as a line; False (and "not logged") when no run has a value."""
    drawn = False
    all_values: list[float] = []
    for i, run in enumerate(runs):
        series = run.series(name)
        if series:
            steps, values = _unzip(series)
            ax.plot(steps, values, color=_colour(i), lw=1.4, label=run.label)
            all_values += values
            drawn = True
    if not drawn:
        _not_logged(ax, name)
        return False
    _style(ax, title, ylabel)
    if log_when_positive:
        _log_scale(ax, all_values, reference)
    _legend(ax)
    return True


def _log_scale(ax, values: list[float], reference: float | None = None) -> None:
    """Log scale when some value is positive; zeros (which a log axis cannot show) are said in the panel.
    All zero: a linear axis from 0 that still shows the ``reference`` level."""
    positive = [v for v in values if v > 0]
    if not positive:
        ax.text(0.5, 0.25, "0 at every step", ha="center", transform=ax.transAxes, color="#555555")
        if min(values, default=0.0) >= 0:
            ax.set_ylim(-0.05 * (reference or 1.0), 2 * (reference or 1.0))
            ax.ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))
        return
    ax.set_yscale("log", nonpositive="mask")
    zeros = len(values) - len(positive)
    if zeros:
        ax.text(0.02, 0.02, f"{zeros} values of 0 not drawn (log scale)", transform=ax.transAxes, fontsize=8,
                color="#555555")


def draw_reward(runs: list[ReportRun]):
    """Reward mean with a ±std band; rollout accuracy and held-out greedy accuracy at its evaluation steps."""
    fig, (left, right) = _panels(2, title="reward and accuracy")
    drawn = False
    for i, run in enumerate(runs):
        series = run.series("reward_mean")
        if not series:
            continue
        drawn = True
        steps, mean = _unzip(series)
        std = dict(run.series("reward_std"))
        left.plot(steps, mean, color=_colour(i), lw=1.4, label=run.label)
        band = [(s, m, std[s]) for s, m in series if s in std]
        if band:
            left.fill_between([s for s, _, _ in band], [m - d for _, m, d in band], [m + d for _, m, d in band],
                              color=_colour(i), alpha=0.15 if len(runs) == 1 else 0.08, lw=0,
                              label=f"{run.label}: ±1 std")
    if drawn:
        _style(left, "reward over the rollout (mean ± std)", "reward")
        _legend(left)
    else:
        _not_logged(left, "reward_mean")
    _accuracy_panel(right, runs, "accuracy: rollouts and held-out evaluation", "accuracy")
    fig.tight_layout()
    return fig


def _accuracy_panel(ax, runs: list[ReportRun], title: str, ylabel: str) -> None:
    """Rollout ``accuracy`` (thin) and held-out greedy ``eval_accuracy`` (markers) of every run, as a share."""
    drawn = False
    for i, run in enumerate(runs):
        rollouts, held_out = run.series("accuracy"), run.eval_series()
        if rollouts:
            ax.plot(*_unzip(rollouts), color=_colour(i), lw=1.0, alpha=0.55, label=f"{run.label}: rollouts")
        if held_out:
            ax.plot(*_unzip(held_out), color=_colour(i), lw=2.0, marker=MARKERS[i % len(MARKERS)], ms=6,
                    mfc="white" if i else _colour(i), label=f"{run.label}: held-out greedy")
        drawn = drawn or bool(rollouts or held_out)
    if drawn:
        _style(ax, title, ylabel)
        ax.set_ylim(-0.03, 1.03)
        _percent(ax)
        _legend(ax)
    else:
        _not_logged(ax, "accuracy and eval_accuracy")


def draw_entropy(runs: list[ReportRun]):
    """Entropy with each window's mean ±limit band, and every window's relative range against the gate."""
    fig, (top, bottom) = _panels(1, 2, title="entropy stability (the gate of verify-alignment --run)", sharex=True,
                                 width=11.0)
    drawn = False
    unstable: list[tuple[int, int]] = []
    for i, run in enumerate(runs):
        series = run.series("entropy")
        if not series:
            continue
        drawn = True
        judgement = run.entropy
        top.plot(*_unzip(series), color=_colour(i), lw=1.2, label=run.label)
        windows = [w for w in judgement.windows if math.isfinite(w.fluctuation)]
        if not windows:
            continue
        ends = [w.last_step for w in windows]
        # each window's band at its last step; a run shorter than one window has one window, drawn over it
        band = windows * 2 if len(windows) == 1 else windows
        at = [windows[0].first_step, windows[0].last_step] if len(windows) == 1 else ends
        span = f"mean of all {judgement.steps} steps" if not judgement.full_windows else \
            f"{judgement.window}-step window mean"
        top.plot(at, [w.mean for w in band], color=_colour(i), lw=1.0, ls="--")
        top.fill_between(at, [w.mean * (1 - judgement.limit) for w in band],
                         [w.mean * (1 + judgement.limit) for w in band], color=_colour(i), alpha=0.15, lw=0,
                         label=f"{run.label}: {span} ±{judgement.limit:.0%}")
        unstable += [(w.first_step, w.last_step) for w in judgement.unstable]
        worst = judgement.worst
        verdict = f"{judgement.verdict}, worst {worst.fluctuation:.1%} (steps {worst.first_step}-{worst.last_step})"
        bottom.plot(ends, [w.fluctuation for w in windows], color=_colour(i), lw=1.4, ms=4,
                    marker="o" if len(windows) < 20 else None, label=f"{run.label}: {verdict}")
        over = [w for w in windows if not w.fluctuation < judgement.limit]
        if over:
            bottom.scatter([w.last_step for w in over], [w.fluctuation for w in over], color="#c0392b", marker="x",
                           s=18, zorder=3)
    if not drawn:
        _not_logged(top, "entropy")
        _not_logged(bottom, "entropy")
        fig.tight_layout()
        return fig
    for k, (first, last) in enumerate(_merged(unstable)):
        top.axvspan(first, last, color="#c0392b", alpha=0.06, lw=0,
                    label=None if k else f"windows over the gate{' (any run)' if len(runs) > 1 else ''}")
    limits = {run.entropy.limit for run in runs}
    for i, run in enumerate(runs):  # one gate line, or one per run in its colour when the profiles differ
        if len(limits) == 1 and i:
            break
        bottom.axhline(run.entropy.limit, color="#c0392b" if len(limits) == 1 else _colour(i), ls="--", lw=1.2,
                       label=f"{'' if len(limits) == 1 else run.label + ': '}gate < {run.entropy.limit:.0%} "
                             f"(alignment.entropy_fluctuation_max)")
    windows = sorted({run.entropy.window for run in runs})
    short = [run.label for run in runs if run.entropy.windows and not run.entropy.full_windows]
    note = f"; {', '.join(short)}: fewer steps than one window, judged on all" if short else ""
    _style(top, "entropy per completion token", "entropy (nats)", xlabel="")
    _style(bottom, f"(max − min) / mean of each {'/'.join(map(str, windows))}-step window, at its last step{note}",
           "fluctuation")
    bottom.set_ylim(bottom=0)
    _percent(bottom)
    _legend(top)
    _legend(bottom)
    fig.tight_layout()
    return fig


def _merged(spans) -> list[tuple[int, int]]:
    """Overlapping ``(first, last)`` step spans joined."""
    merged: list[list[int]] = []
    for first, last in sorted(spans):
        if merged and first <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], last)
        else:
            merged.append([first, last])
    return [(a, b) for a, b in merged]


def draw_mismatch(runs: list[ReportRun]):
    """The online train/infer mismatch on sampled tokens, with the profile's k3 warning level."""
    fig, (left, right) = _panels(2, title="train/infer mismatch on sampled tokens")
    warns = sorted({run.profile.alignment.k3_kl_warn for run in runs})
    if _line_panel(left, runs, "mismatch_k3_kl", "k3 estimate of KL(infer || train)", "KL (nats)",
                   log_when_positive=True, reference=warns[-1]):
        for warn in warns:
            left.axhline(warn, color="#c0392b", ls="--", lw=1.2, label=f"warn {warn:g} (alignment.k3_kl_warn)")
        _legend(left)
    _line_panel(right, runs, "mismatch_logp_abs_mean", "mean |log p_train − log p_infer|", "|Δ log p| (nats)",
                log_when_positive=True)
    fig.tight_layout()
    return fig


def draw_optimization(runs: list[ReportRun]):
    """Gradient norm before clipping, with rl.grad_clip; the learning rate of every step."""
    fig, (left, right) = _panels(2, title="optimization")
    if _line_panel(left, runs, "grad_norm", "global gradient norm before clipping", "L2 norm"):
        for clip in sorted({run.profile.rl.grad_clip for run in runs if run.profile.rl.grad_clip > 0}):
            left.axhline(clip, color="#c0392b", ls="--", lw=1.2, label=f"clip {clip:g} (rl.grad_clip)")
        left.set_ylim(bottom=0)
        _legend(left)
    if _line_panel(right, runs, "lr", "learning rate", "lr"):
        right.ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))
        right.set_ylim(bottom=0)
    fig.tight_layout()
    return fig


def draw_throughput(runs: list[ReportRun]):
    """Samples and tokens per second, and the seconds of each phase of a step."""
    fig, (samples, tokens, phases) = _panels(3, title="throughput and step time")
    _line_panel(samples, runs, "samples_per_s", "completions per second", "samples/s")
    _line_panel(tokens, runs, "tokens_per_s", "completion tokens per second", "tokens/s")
    values: list[float] = []
    for i, run in enumerate(runs):
        for name in ("time_rollout_s", "time_reward_s", "time_update_s"):
            series = run.series(name)
            if series:
                phase = name[len("time_"):-len("_s")]
                phases.plot(*_unzip(series), color=_colour(i), ls=PHASE_STYLE[phase], lw=1.2,
                            label=f"{run.label}: {phase}")
                values += [v for _, v in series]
    if values:
        _style(phases, "seconds per phase of a step", "seconds")
        _log_scale(phases, values)
        _legend(phases, outside=len(runs) > 1)
    else:
        _not_logged(phases, "time_rollout_s, time_reward_s, time_update_s")
    fig.tight_layout()
    return fig


def draw_memory(runs: list[ReportRun]):
    """Each phase's peak memory against orbitctl plan's prediction: the run's peak, and step by step."""
    fig, (bars, lines) = _panels(2, title="memory per phase against the plan")
    measured = [run.phase_memory() for run in runs]
    phases = list(dict.fromkeys(p for m in measured for p in m))
    if not phases:
        _not_logged(bars, "phase_memory")
        _not_logged(lines, "phase_memory")
        fig.tight_layout()
        return fig
    width = 0.8 / (2 * len(runs))
    for i, (run, memory) in enumerate(zip(runs, measured)):
        for p, phase in enumerate(phases):
            x = p - 0.4 + width * (2 * i + 0.5)
            predicted = run.predicted.get(phase)
            if phase in memory:
                peak = max(b for _, b in memory[phase])
                bars.bar(x, peak / GiB, width, color=_colour(i), label=f"{run.label}: measured" if p == 0 else None)
                if predicted:
                    bars.annotate(f"{peak / predicted:.2f}x", (x + width / 2, max(peak, predicted) / GiB),
                                  ha="center", va="bottom", fontsize=8, xytext=(0, 2), textcoords="offset points")
            if predicted:
                bars.bar(x + width, predicted / GiB, width, facecolor="white", edgecolor=_colour(i), hatch="//",
                         label=f"{run.label}: plan" if p == 0 else None)
    bars.set_xticks(range(len(phases)), phases)
    kinds = sorted({MEMORY_KINDS.get(run.memory_kind, run.memory_kind) for run in runs if run.memory_kind})
    ylabel = f"GiB ({'; '.join(kinds)})" if kinds else "GiB"
    _style(bars, "peak over the run; above the bars: measured / plan", ylabel, xlabel="phase")
    bars.set_ylim(0, bars.get_ylim()[1] * 1.12)
    _legend(bars)
    for i, (run, memory) in enumerate(zip(runs, measured)):
        for phase, series in memory.items():
            steps, values = _unzip(series)
            style = PHASE_STYLE.get(phase, "-")
            lines.plot(steps, [v / GiB for v in values], color=_colour(i), ls=style, lw=1.4,
                       label=f"{run.label}: {phase}")
            if run.predicted.get(phase):
                lines.axhline(run.predicted[phase] / GiB, color=_colour(i), ls=style, lw=0.8, alpha=0.5,
                              label=f"{run.label}: {phase}, plan")
    _style(lines, "phase peak at each step, and the plan's", ylabel)
    _legend(lines, outside=len(runs) > 1)
    fig.tight_layout()
    return fig


def played_episodes(run: ReportRun) -> bool:
    """The run trained on an environment's episodes (``data.train: env:NAME``)."""
    return str(getattr(getattr(run.profile, "data", None), "train", "")).startswith("env:")


def draw_episodes(runs: list[ReportRun]):
    """Completion rate (rollouts and held-out greedy) and the share of well-formed tool calls."""
    fig, (left, right) = _panels(2, title="episodes: completion and tool calls")
    _accuracy_panel(left, runs, "completion rate: rollouts and held-out seeds", "episodes completed")
    drawn = False
    for i, run in enumerate(runs):
        for name, what, marker in (("tool_call_valid_rate", "rollouts", None),
                                   ("eval_tool_call_valid_rate", "held-out greedy", "o")):
            series = run.series(name)
            if series:
                right.plot(*_unzip(series), color=_colour(i), lw=2.0 if marker else 1.4, marker=marker,
                           label=f"{run.label}: {what}")
                drawn = True
    if drawn:
        _style(right, "tool calls that were well-formed", "valid calls / actions")
        right.set_ylim(-0.03, 1.03)
        _percent(right)
        _legend(right)
    else:
        _not_logged(right, "tool_call_valid_rate")
    fig.tight_layout()
    return fig


FIGURES: tuple[tuple[str, str, Callable], ...] = (
    ("reward.png", "reward and accuracy", draw_reward),
    ("entropy.png", "entropy stability", draw_entropy),
    ("mismatch.png", "train/infer mismatch", draw_mismatch),
    ("optimization.png", "gradient norm and learning rate", draw_optimization),
    ("throughput.png", "throughput and step time", draw_throughput),
    ("memory.png", "memory per phase against the plan", draw_memory),
)
"""File name, caption and drawing function of every figure, in the order the report shows them."""
EPISODE_FIGURES: tuple[tuple[str, str, Callable], ...] = (
    ("episodes.png", "episodes: completion rate and tool-call validity", draw_episodes),
)
"""Drawn after :data:`FIGURES` when a run played an environment's episodes."""


def figures_for(runs: list[ReportRun]) -> tuple[tuple[str, str, Callable], ...]:
    """The figures a report of ``runs`` draws: every one of :data:`FIGURES`, and the episode figures when a run
    played episodes or logged tool calls."""
    episodes = any(played_episodes(run) or run.series("tool_call_valid_rate") for run in runs)
    return FIGURES + (EPISODE_FIGURES if episodes else ())


def save(fig, path) -> None:
    """Write ``fig`` as a PNG and free it."""
    fig.savefig(path, format="png", dpi=DPI)
    _pyplot().close(fig)
