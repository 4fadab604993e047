"""Gates: the profile's ``alignment`` thresholds applied to a comparison's summary.

FAIL gates are the adapter-first method's defaults (JS < 0.05, log-softmax L1 < 0.1, the
same top-1 and top-k actions, entropy fluctuating < 5% over the window); WARN levels are the
stricter sampled-token figures healthy runs report (k3 KL < 1e-3, mean |dp| < 0.005). A
gate whose metric the source cannot provide is not judged (shown as n/a, never as PASS).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class Gate:
    name: str
    metric: str
    statistic: str
    op: str                 # "<" (value must stay below) or ">=" (value must reach)
    threshold: float
    level: str              # FAIL or WARN: what crossing it means
    value: float | None = None

    @property
    def status(self) -> str:
        if self.value is None:
            return "n/a"
        ok = self.value < self.threshold if self.op == "<" else self.value >= self.threshold
        return "PASS" if ok else self.level

    @property
    def margin(self) -> float | None:
        """How far inside the gate the value is, as a fraction of the threshold (negative: crossed)."""
        if self.value is None:
            return None
        if self.op == "<":
            return (self.threshold - self.value) / self.threshold
        return (self.value - self.threshold) / self.threshold if self.threshold else self.value

    def to_dict(self) -> dict:
        return {**asdict(self), "status": self.status, "margin": self.margin}


def token_gates(alignment) -> list[Gate]:
    return [
        Gate("JS divergence", "js", "mean", "<", alignment.js_max, "FAIL"),
        Gate("log-softmax L1", "logsoftmax_l1", "mean", "<", alignment.logit_l1_max, "FAIL"),
        Gate("top-1 agreement", "top1_agree", "mean", ">=", alignment.top1_agreement_min, "FAIL"),
        Gate(f"top-{alignment.top_k} overlap", "topk_overlap", "mean", ">=", alignment.top_k_agreement_min, "FAIL"),
        Gate("sampled-token k3 KL", "k3", "mean", "<", alignment.k3_kl_warn, "WARN"),
        Gate("sampled-token |dp|", "sampled_dp_abs", "mean", "<", alignment.prob_diff_warn, "WARN"),
    ]


def run_gates(alignment) -> list[Gate]:
    return [
        Gate(f"entropy fluctuation ({alignment.entropy_window} steps)", "entropy_fluctuation", "worst window", "<",
             alignment.entropy_fluctuation_max, "FAIL"),
        Gate("online k3 KL (last 10% of steps)", "mismatch_k3_kl", "last", "<", alignment.k3_kl_warn, "WARN"),
        Gate("online |dp| (last 10% of steps)", "mismatch_prob_abs_mean", "last", "<", alignment.prob_diff_warn, "WARN"),
    ]


def judge_tokens(summary: dict, alignment) -> list[Gate]:
    gates = token_gates(alignment)
    for gate in gates:
        stats = summary.get(gate.metric)
        gate.value = None if stats is None else float(stats[gate.statistic])
    return gates


def judge_run(fluctuation: float | None, trends: dict[str, float], alignment) -> list[Gate]:
    gates = run_gates(alignment)
    for gate in gates:
        gate.value = fluctuation if gate.metric == "entropy_fluctuation" else trends.get(gate.metric)
    return gates


def overall(gates: list[Gate]) -> str:
    statuses = {g.status for g in gates}
    if "FAIL" in statuses:
        return "FAIL"
    if "WARN" in statuses:
        return "WARN"
    return "PASS" if "PASS" in statuses else "n/a"
