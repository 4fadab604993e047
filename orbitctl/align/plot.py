"""``verify-alignment --plot``: where the two paths disagree, as one PNG.

Panels: the per-token JS histogram (log-scaled counts, the gate drawn in), |Δlog p| of the
sampled token against its infer-path probability (mismatch concentrates on unlikely tokens),
and, with ``--per-layer``, the relative hidden-state error of every layer.
"""

from __future__ import annotations

from pathlib import Path
from orbitctl.rundir import atomic_file


def write_plot(report, path: str | Path, js_gate: float) -> Path:
    """Render the report's per-token values to ``path`` (written atomically); returns the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import torch

    path = Path(path)
    if report.table is None:
        from orbitctl.errors import UserError

        raise UserError("--plot needs per-token values", fix="use it with the internal check, --rollouts or --logits-a/-b")
    panels = 3 if report.layers else 2
    fig, axes = plt.subplots(1, panels, figsize=(5.2 * panels, 4.2))
    js = report.table.values("js").numpy()
    ax = axes[0]
    top = max(float(js.max()), js_gate) * 1.05 or 1e-12
    ax.hist(js, bins=60, range=(0.0, top), color="#3b75af", log=True)
    ax.axvline(js_gate, color="#c0392b", linestyle="--", label=f"gate {js_gate:g}")
    ax.set(title=f"per-token JS divergence ({len(js)} tokens)", xlabel="JS (nats)", ylabel="tokens")
    ax.legend()
    ax = axes[1]
    names = report.table.names
    if "sampled_dlogp_abs" in names and report.infer_token_logp is not None:
        p = torch.as_tensor(report.infer_token_logp).exp().numpy()
        dlogp = report.table.values("sampled_dlogp_abs").numpy()
        floor = 1e-12
        ax.scatter(p.clip(floor), dlogp.clip(floor), s=6, alpha=0.5, color="#3b75af")
        ax.set(xscale="log", yscale="log", title="sampled token: |Δlog p| against p_infer",
               xlabel="infer-path probability of the sampled token", ylabel="|log p_train - log p_infer|")
    else:
        ax.text(0.5, 0.5, "no sampled tokens in this source", ha="center", va="center", transform=ax.transAxes)
        ax.set_axis_off()
    if report.layers:
        ax = axes[2]
        errors = [max(e.rel_error, 1e-12) for e in report.layers]
        ax.bar(range(len(errors)), errors, color="#3b75af")
        ax.set_xticks(range(len(errors)), [e.name for e in report.layers], rotation=45, ha="right")
        ax.set(yscale="log", title="hidden-state relative error by layer", ylabel="||h_train - h_infer|| / ||h_train||")
        ax.set_ylim(bottom=min(errors) / 2 if min(errors) > 0 else 1e-12, top=max(1.0, max(errors) * 2))
    fig.suptitle(f"verify-alignment: {report.verdict}")
    fig.tight_layout()
    with atomic_file(path, fsync=False) as tmp:
        fig.savefig(tmp, format="png", dpi=110)
    plt.close(fig)
    return path
