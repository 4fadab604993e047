"""The figures in a shipped profile's comments are the ones `orbitctl plan` prints for it.

A comment states a plan figure in the plan's own words, and this test recomputes every one it finds (the
convention, also in docs/profiles.md, "Figures in the shipped profiles' comments"):

- ``peak 125.5 GiB per GPU in rollout``: the peak and its phase (plan's verdict line);
- ``step 26 min (rollout 17 min, update 10 min)``: the predicted RL step, the parenthesis optional;
- ``largest micro-batch that fits: 4``;
- ``EP 8, dense replicated ... 23 TiB ... >= 56 s``, optionally ``... max mb 4`` and ``... step 26 min``: a row
  of the base-layouts table (TiB each GPU sends per RL step, the link time, the largest micro-batch, the step);
- ``routed_experts 66.4 GiB``: a memory component (its name as the plan's table has it) in the peak phase, or in
  the phase named after it (``all_to_all_buffers 7.0 GiB in policy_update``);
- ``auto: 36 sequences``: what ``rollout.batch_size: auto`` resolves to;
- ``408.3 M trainable``: the trainable parameters;
- ``4 rollout rounds``: the rollout rounds of one RL step;
- ``with `--set KEY=VALUE ...`: CLAIMS``: the claims up to the next ``;`` or ``)`` are about the plan with those
  values set (``plan PROFILE --set KEY=VALUE``); besides the forms above they may say ``fits`` or
  ``does not fit``.

A figure matches when the plan's value, in the comment's unit and rounded to the comment's decimals, is the
comment's number (``22 GiB`` for 22.14, ``56 s`` for 56.2 s). In the GPU profiles no step time, link time or TiB
figure may stand outside such a claim: those are the figures that drift when the time model changes.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from orbitctl.plan import COMPONENTS, plan_profile
from orbitctl.profile import load_profile

REPO = Path(__file__).resolve().parents[2]
PROFILES = sorted((REPO / "profiles").glob("*.yaml"))
GPU_PROFILES = [p for p in PROFILES if load_profile(p).hardware.gpu != "cpu"]

NUMBER = r"\d[\d,]*(?:\.\d+)?"
TIME = rf"{NUMBER} (?:h|min|s|ms)\b"
PHASES = "policy_update|rollout|adapter_sync"
UNIT_SECONDS = {"h": 3600.0, "min": 60.0, "s": 1.0, "ms": 1e-3}


def comment_text(path: Path) -> str:
    """Every comment of the file, in order, as one line (claims may wrap from one comment line to the next)."""
    parts = []
    for line in path.read_text().splitlines():
        if "#" in line:
            parts.append(line.split("#", 1)[1].strip())
    return " ".join(parts)


def agrees(stated: str, value: float, scale: float = 1.0) -> bool:
    """``stated`` (e.g. '2,941', '66.4') equals ``value / scale`` rounded to the decimals ``stated`` has."""
    number = stated.replace(",", "")
    decimals = len(number.split(".")[1]) if "." in number else 0
    return round(value / scale, decimals) == float(number)


def agrees_time(stated: str, seconds: float) -> bool:
    number, unit = stated.split()
    return agrees(number, seconds, UNIT_SECONDS[unit])


class Claims:
    """The claims found in one stretch of comment text, each checked against one plan."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.found: list[tuple[str, str, bool]] = []
        """(kind, the words, whether the plan agrees)."""

    def take(self, pattern: str):
        """Each match of ``pattern``, then the text with the matches blanked (a claim is read once)."""
        matches = list(re.finditer(pattern, self.text))
        for m in matches:
            self.text = self.text[:m.start()] + " " * (m.end() - m.start()) + self.text[m.end():]
        return matches

    def check(self, kind: str, words: str, ok: bool) -> None:
        self.found.append((kind, words, ok))

    def read(self, plan) -> None:
        """Every claim form but the what-if, checked against ``plan``."""
        for m in self.take(r"EP (\d+), dense (sharded|replicated)\b.*?(?=EP \d+, dense|;|\.\s|\.?$)"):
            self.layout_row(plan, m.group(0), int(m.group(1)), m.group(2))
        for m in self.take(rf"peak ({NUMBER}) GiB per GPU(?: in ({PHASES}))?"):
            ok = agrees(m.group(1), plan.peak_bytes, 2**30) and m.group(2) in (None, plan.peak_phase)
            self.check("peak", m.group(0), ok)
        timing = plan.timing
        for m in self.take(rf"step ({TIME})(?: \(rollout ({TIME}), update ({TIME})\))?"):
            ok = agrees_time(m.group(1), timing.seconds)
            if m.group(2):
                phases = timing.phases
                ok = ok and agrees_time(m.group(2), phases["rollout"].seconds) and agrees_time(
                    m.group(3), phases["policy_update"].seconds + phases["adapter_sync"].seconds)
            self.check("step", m.group(0), ok)
        for m in self.take(r"largest micro-batch that fits: (\d+)"):
            self.check("max micro-batch", m.group(0), int(m.group(1)) == plan.max_micro_batch)
        names = "|".join(sorted(COMPONENTS, key=len, reverse=True))
        for m in self.take(rf"\b({names}) ({NUMBER}) GiB(?: in ({PHASES}))?"):
            phase = m.group(3) or plan.peak_phase
            self.check("component", m.group(0), agrees(m.group(2), plan.phases[phase].get(m.group(1), 0), 2**30))
        for m in self.take(r"auto: (\d+) sequences"):
            self.check("rollout batch", m.group(0), int(m.group(1)) == plan.details.get("rollout_batch_size_auto"))
        for m in self.take(rf"({NUMBER}) ([MB]) trainable"):
            scale = 1e6 if m.group(2) == "M" else 1e9
            self.check("trainable", m.group(0), agrees(m.group(1), plan.params_trainable, scale))
        for m in self.take(r"(\d+) rollout rounds?\b"):
            self.check("rollout rounds", m.group(0), int(m.group(1)) == plan.communication.shape.rollout_rounds)

    def layout_row(self, plan, row: str, ep: int, dense: str) -> None:
        layout = next((r for r in plan.layouts if r["expert_parallel"] == ep and r["dense_layout"] == dense), None)
        if layout is None:
            self.check("layout", row, False)
            return
        checks = []
        if m := re.search(rf"({NUMBER}) TiB", row):
            checks.append(agrees(m.group(1), layout["total_bytes"], 2**40))
        if m := re.search(rf">= ({TIME})", row):
            checks.append(agrees_time(m.group(1), layout["link_seconds"]))
        if m := re.search(r"max mb (\d+)", row):
            checks.append(int(m.group(1)) == layout["max_micro_batch"])
        if m := re.search(rf"step ({TIME})", row):
            checks.append(agrees_time(m.group(1), layout["step_seconds"]))
        self.check("layout", row.strip(), bool(checks) and all(checks))


def claims_of(path: Path) -> tuple[list[tuple[str, str, bool]], str]:
    """Every claim in ``path``'s comments with whether the plan agrees, and the comment text left unclaimed."""
    profile = load_profile(path)
    claims = Claims(comment_text(path))
    for m in claims.take(r"with `((?:--set [^\s`]+ ?)+)`:? ([^;)]*)"):
        sets = re.findall(r"--set ([^\s`]+)", m.group(1))
        what_if = plan_profile(load_profile(path, sets))
        body = Claims(m.group(2))
        body.read(what_if)
        for fit in body.take(r"\bdoes not fit\b"):
            body.check("fit", fit.group(0), not what_if.fits)
        for fit in body.take(r"(?<!that )\bfits\b"):
            body.check("fit", fit.group(0), what_if.fits)
        claims.found += [(kind, f"with `{m.group(1).strip()}`: {words}", ok) for kind, words, ok in body.found]
    claims.read(plan_profile(profile))
    return claims.found, claims.text


@pytest.mark.parametrize("path", PROFILES, ids=lambda p: p.stem)
def test_every_figure_in_the_comments_is_what_plan_prints(path):
    found, _ = claims_of(path)
    wrong = [f"{kind}: {words}" for kind, words, ok in found if not ok]
    assert wrong == [], f"{path.name}: comment figures that differ from `orbitctl plan {path.name}`"


@pytest.mark.parametrize("path", GPU_PROFILES, ids=lambda p: p.stem)
def test_gpu_profiles_state_their_plan_figures_as_claims(path):
    found, rest = claims_of(path)
    kinds = {kind for kind, _, _ in found}
    assert {"peak", "step", "max micro-batch"} <= kinds, kinds
    loose = re.findall(rf"{TIME}|{NUMBER} TiB", rest)
    assert loose == [], f"{path.name}: time or traffic figures outside a claim the test checks"


def test_a_wrong_figure_is_caught(tmp_path):
    text = (REPO / "profiles" / "kimi-k2_grpo_int4_8xh200.yaml").read_text()
    found, _ = claims_of(REPO / "profiles" / "kimi-k2_grpo_int4_8xh200.yaml")
    layout = next(words for kind, words, _ in found if kind == "layout")
    tib = re.search(rf"({NUMBER}) TiB", layout).group(1)
    line = next(line for line in text.splitlines() if f"{tib} TiB" in line)
    wrong = tmp_path / "kimi.yaml"
    wrong.write_text(text.replace(line, line.replace(f"{tib} TiB", f"{int(tib.replace(',', '')) * 2 + 1} TiB")))
    assert [kind for kind, _, ok in claims_of(wrong)[0] if not ok] == ["layout"]
