"""summary.md: one page with a table per run and the report's figures linked below."""

from __future__ import annotations

from orbitctl.units import GiB


def render_markdown(document: dict, figures: list[tuple[str, str]]) -> str:
    """The page for a summary.json ``document``; ``figures`` are ``(file name, caption)`` next to it."""
    names = ", ".join(run["name"] for run in document["runs"])
    lines = [f"# Training report: {names}", ""]
    for run in document["runs"]:
        lines += [f"## {run['name']}", "", f"`{run['dir']}`, status {run['status'] or 'unknown'}", "",
                  "| | value |", "|---|---|"]
        lines += [f"| {key} | {value} |" for key, value in _rows(run)]
        lines.append("")
        for warning in run["warnings"]:
            lines.append(f"- warning from step {warning['first_step']} ({warning['steps']} steps): {warning['message']}")
        for note in run["notes"]:
            lines.append(f"- note: {note}")
        if run["warnings"] or run["notes"]:
            lines.append("")
    for name, caption in figures:
        lines += [f"### {caption}", "", f"![{caption}]({name})", ""]
    return "\n".join(lines)


def _rows(run: dict) -> list[tuple[str, str]]:
    steps, entropy = run["steps"], run["entropy"]
    rows = [("steps logged", f"{steps['logged']} ({steps['first']}-{steps['last']})"),
            ("reward first / last / best", _progress(run["reward"], "{:.3f}")),
            ("rollout accuracy first / last / best", _progress(run["accuracy"], "{:.1%}")),
            ("held-out accuracy before / after", f"{_num(run['eval']['before'], '{:.1%}')} / "
                                                 f"{_num(run['eval']['after'], '{:.1%}')}")]
    if entropy["verdict"] == "not logged":
        rows.append(("entropy stability", "not logged"))
    else:
        left = f"; left the band at step {entropy['left_band_at_step']}" if entropy["left_band_at_step"] else ""
        windows = f"{entropy['window']}-step windows" if entropy["full_windows"] else \
            f"{entropy['steps']} steps, fewer than one {entropy['window']}-step window"
        rows.append((f"entropy stability ({windows}, gate < {entropy['fluctuation_max']:.0%})",
                     f"**{entropy['verdict']}**: worst {_num(entropy['worst_fluctuation'], '{:.2%}')} over steps "
                     f"{entropy['worst_window'][0]}-{entropy['worst_window'][1]}{left}"))
    for name, trend in run["mismatch"].items():
        rows.append((f"{name} first / last / max", " / ".join(_num(trend[k], "{:.3g}") for k in ("first", "last", "max"))))
    memory = run["memory"]
    for phase, entry in memory["phases"].items():
        rows.append((f"{phase} memory peak / plan, GiB ({memory['kind']})",
                     f"{entry['measured_peak_bytes'] / GiB:.3f} / {_num(_gib(entry['predicted_bytes']), '{:.3f}')} "
                     f"({_num(entry['ratio'], '{:.2f}')}x)"))
    rows += [("median step time", _num(run["step_time_s"]["median"], "{:.3f} s")),
             ("median throughput", f"{_num(run['throughput']['samples_per_s_median'], '{:,.0f}')} samples/s, "
                                   f"{_num(run['throughput']['tokens_per_s_median'], '{:,.0f}')} tokens/s"),
             ("warnings", str(len(run["warnings"])))]
    return rows


def _progress(entry: dict, spec: str) -> str:
    if entry["best"] is None:
        return "not logged"
    return (f"{_num(entry['first'], spec)} / {_num(entry['last'], spec)} / {_num(entry['best'], spec)} "
            f"(step {entry['best_step']})")


def _gib(value: int | None) -> float | None:
    return None if value is None else value / GiB


def _num(value, spec: str) -> str:
    return "n/a" if value is None else spec.format(value)
