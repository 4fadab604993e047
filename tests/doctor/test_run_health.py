"""`orbitctl doctor --run`: planted instabilities in synthetic metrics are ranked first, a healthy run is quiet.

The synthetic runs follow the demo profile (profiles/tiny-cpu.yaml: 32 prompts x 8 completions per
step, warmup 10 steps to lr 1e-3, grad_clip 1.0) with seeded noise of the size a real demo run
shows (reward_std 0.45, entropy 0.26 nats); each plants one cause on top.
"""

import json
import math
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from orbitctl.cli.app import main
from orbitctl.doctor import api
from orbitctl.doctor.findings import FAIL, INFO, PASS, WARN
from orbitctl.doctor.run_health import (AREA, ENTROPY_FAIL, FINDING_IDS, MISMATCH_FLOOR_FRACTION, SWING_RATIO,
                                        diagnose_run)
from orbitctl.profile import load_profile

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "profiles" / "tiny-cpu.yaml"
STEPS = 200
PROMPTS, GROUP = 32, 8


def _profile(**changes) -> dict:
    data = yaml.safe_load(DEMO.read_text())
    for key, value in changes.items():
        *parents, leaf = key.split(".")
        node = data
        for part in parents:
            node = node[part]
        node[leaf] = value
    return data


def _healthy(seed: int = 0, steps: int = STEPS) -> list[dict]:
    """A run that learns slowly and steadily: noise only, every metric in its healthy range."""
    rng = random.Random(seed)
    records = []
    for step in range(1, steps + 1):
        reward = min(1.0, 0.3 + 0.3 * step / steps + rng.gauss(0, 0.45 / math.sqrt(PROMPTS)))
        records.append({
            "step": step, "samples": step * PROMPTS * GROUP, "tokens": 512, "reward_mean": reward, "reward_std": 0.45,
            "accuracy": reward, "entropy": 0.26 + rng.gauss(0, 0.01), "mismatch_k3_kl": abs(rng.gauss(1e-5, 3e-6)),
            "mismatch_logp_abs_mean": abs(rng.gauss(2e-3, 3e-4)), "is_ratio_max": 1.0 + abs(rng.gauss(0, 0.02)),
            "is_ratio_min": 1.0 - abs(rng.gauss(0, 0.02)), "is_clipped_fraction": 0.0, "ppo_clipped_fraction": 0.0,
            "grad_norm": 0.15 * math.exp(rng.gauss(0, 0.3)), "update_applied": True, "nonfinite_skipped": 0,
            "lr": 1e-3 * min(1.0, step / 10), "warnings": [],
        })
    return records


def _write_run(root: Path, records: list[dict], **profile_changes) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "profile.yaml").write_text(yaml.safe_dump(_profile(**profile_changes)))
    (root / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return root


def _alarming(findings):
    """The WARN and FAIL findings (every finding's id one the docs describe)."""
    assert all(f.id in FINDING_IDS for f in findings), [f.id for f in findings]
    return [f for f in findings if f.status in (FAIL, WARN)]


def test_healthy_run_is_nothing_alarming(tmp_path):
    findings = diagnose_run(_write_run(tmp_path / "run", _healthy()))
    assert [f.id for f in findings] == ["run.healthy"]
    assert findings[0].status == PASS and findings[0].area == AREA
    assert "200 step record(s), steps 1-200" in findings[0].evidence[0]


def test_growing_mismatch_is_ranked_first_with_the_align_weight_fix(tmp_path):
    records = _healthy()
    for r in records:  # k3 grows 500x over the run, to 5x alignment.k3_kl_warn (1e-3)
        r["mismatch_k3_kl"] = 1e-5 * 500 ** (r["step"] / STEPS)
        r["mismatch_logp_abs_mean"] = 2e-3 * 20 ** (r["step"] / STEPS)
    findings = diagnose_run(_write_run(tmp_path / "run", records))
    top = findings[0]
    assert top.id == "run.mismatch_growth" and top.status == WARN, [f.id for f in findings]
    # the first window's k3 (~2e-5) is under the noise floor, so growth is measured from the floor
    assert top.data["last"] > 1e-3 and top.data["first"] < 1e-3 * MISMATCH_FLOOR_FRACTION
    assert top.data["growth"] == pytest.approx(top.data["last"] / (1e-3 * MISMATCH_FLOOR_FRACTION))
    assert "--set rl.align_loss.weight=0.5" in top.fix and "fits" in top.fix
    assert top.data["set"] == ["rl.align_loss.weight=0.5"] and top.data["plan"]["fits"] is True


def test_entropy_collapse_is_ranked_first(tmp_path):
    records = _healthy()
    for r in records:  # falls to about a quarter of its start, still falling at the end
        r["entropy"] = 0.26 * math.exp(-1.5 * r["step"] / STEPS)
    findings = diagnose_run(_write_run(tmp_path / "run", records))
    top = findings[0]
    assert top.id == "run.entropy_collapse" and top.status == WARN, [f.id for f in findings]
    assert top.data["slope"] < 0 and top.data["last"] < 0.5 * top.data["first"]
    assert "rl.lr=0.0005" in top.fix and "rl.warmup_steps=150" in top.fix and "verify-alignment" in top.fix
    # under a tenth of its start it is a FAIL
    for r in records:
        r["entropy"] = 0.26 * math.exp(-4 * r["step"] / STEPS)
    top = diagnose_run(_write_run(tmp_path / "run2", records))[0]
    assert top.id == "run.entropy_collapse" and top.status == FAIL and top.data["last"] < ENTROPY_FAIL * top.data["first"]


def test_grad_spikes_are_ranked_first_with_their_steps(tmp_path):
    records = _healthy()
    planted = [60, 80, 110, 160, 180]  # 5 in 190 judged steps: over the 1-in-50 share
    for r in records:
        if r["step"] in planted:
            r["grad_norm"] *= 20
    findings = diagnose_run(_write_run(tmp_path / "run", records))
    top = findings[0]
    assert top.id == "run.grad_spikes", [f.id for f in findings]
    assert [s["step"] for s in top.data["spikes"]] == planted
    assert "rl.grad_clip 1: 5 spike(s) were clipped" in "\n".join(top.evidence)
    # without clipping the fix turns it on
    top = diagnose_run(_write_run(tmp_path / "run2", records, **{"rl.grad_clip": 0.0}))[0]
    assert top.id == "run.grad_spikes" and "--set rl.grad_clip=1.0" in top.fix
    # three such spikes, under one step in 50, are what a healthy RL run shows (heavy-tailed norms)
    for r in records:
        if r["step"] in planted[3:]:
            r["grad_norm"] /= 20
    assert _alarming(diagnose_run(_write_run(tmp_path / "run3", records))) == []


def test_lr_too_high_swinging_is_ranked_first_not_the_bare_symptom(tmp_path):
    records = _healthy()
    rng = random.Random(1)
    for r in records:  # at the peak lr the reward flips between two levels and every update is clipped
        if r["lr"] >= 1e-3:
            r["reward_mean"] = 0.45 + (0.25 if r["step"] % 2 else -0.25)
        r["grad_norm"] = 2.0 * math.exp(rng.gauss(0, 0.3))
    findings = diagnose_run(_write_run(tmp_path / "run", records))
    top = findings[0]
    assert top.id == "run.lr_high", [f.id for f in findings]
    assert top.data["swing"] > SWING_RATIO and top.data["clipped_share"] > 0.9
    assert "rl.lr=0.0005" in top.fix and "rl.warmup_steps=150" in top.fix
    assert "run.reward_swing" not in [f.id for f in findings]  # the symptom is in the cause's evidence


def test_swinging_without_a_cause_is_the_symptom(tmp_path):
    records = _healthy()
    for r in records:
        r["reward_mean"] = 0.45 + (0.25 if r["step"] % 2 else -0.25)
    findings = _alarming(diagnose_run(_write_run(tmp_path / "run", records)))
    assert [f.id for f in findings] == ["run.reward_swing"]
    assert "rl.align_loss.weight=0.5" in findings[0].fix and "rl.warmup_steps=150" in findings[0].fix


def test_plateau_with_a_small_adapter_doubles_the_rank_re_planned(tmp_path):
    records = _healthy()
    rng = random.Random(2)
    for r in records:
        r["reward_mean"] = r["accuracy"] = 0.4 + rng.gauss(0, 0.45 / math.sqrt(PROMPTS))
    # tiny-llama's hidden size is 64: rank 4 is under its 'auto' rank of 6
    findings = _alarming(diagnose_run(_write_run(tmp_path / "run", records, **{"adapter.rank": 4})))
    assert [f.id for f in findings] == ["run.adapter_small"]
    assert findings[0].data["set"] == ["adapter.rank=8"] and findings[0].data["plan"]["peak_bytes"] > 0
    assert "--set adapter.rank=8 (planned peak" in findings[0].fix
    # the shipped rank 8 is above the auto rank: the same plateau blames nothing
    assert _alarming(diagnose_run(_write_run(tmp_path / "run2", records))) == []
    # judged against a 24 GB profile whose doubled rank no longer fits, the fix says so and what would
    big = load_profile(str(ROOT / "profiles" / "llama-3.1-8b_grpo_qlora-nf4_1x24g.yaml"), ["adapter.rank=400"])
    top = diagnose_run(tmp_path / "run2", profile=big)[0]
    assert top.id == "run.adapter_small" and top.data["set"] == ["adapter.rank=800"]
    assert top.data["plan"]["fits"] is False and top.data["plan"]["peak_bytes"] > top.data["plan"]["usable_bytes"]
    assert "does NOT fit" in top.fix and ("to fit, also --set" in top.fix or "closest the planner gets" in top.fix)


def test_nonfinite_updates_and_recorded_warnings(tmp_path):
    records = _healthy()
    for r in records[-3:]:  # rl.max_nonfinite_steps is 3: the run stopped
        r.update(update_applied=False, grad_norm=None, nonfinite_skipped=r["step"] - records[-4]["step"])
    records[50]["warnings"] = ["gradient-norm spike: 2.5, over 10x the recent median 0.15"]
    findings = diagnose_run(_write_run(tmp_path / "run", records))
    assert findings[0].id == "run.nonfinite" and findings[0].status == FAIL
    assert findings[0].data["skipped_steps"] == [198, 199, 200]
    warned = next(f for f in findings if f.id == "run.warnings")
    assert warned.data["warnings"] == {"gradient-norm spike": [51]} and warned.status == INFO  # run.grad_spikes judges it
    # memory over the limit is judged by nothing else: WARN, with the micro-batch halved and re-planned
    healthy = _healthy()
    healthy[60]["warnings"] = healthy[61]["warnings"] = ["host memory above the profile's limit: 20.00 GiB > 14.40 GiB"]
    findings = _alarming(diagnose_run(_write_run(tmp_path / "run2", healthy)))
    assert [f.id for f in findings] == ["run.warnings"]
    assert findings[0].data["warnings"] == {"host memory above the profile's limit": [61, 62]}
    assert findings[0].data["set"] == ["memory.micro_batch_size=128", "memory.gradient_accumulation_steps=2"]


def test_cli_run_alone_reads_no_machine_and_json_has_the_findings(tmp_path, capsys, monkeypatch):
    def no_probe(*args, **kwargs):
        raise AssertionError("--run alone must not probe the machine")

    monkeypatch.setattr(api, "take_snapshot", no_probe)
    healthy = _write_run(tmp_path / "healthy", _healthy())
    assert main(["doctor", "--run", str(healthy)]) == 0
    out = capsys.readouterr().out
    assert "run.healthy" in out and "training run" in out and "OK: 1 PASS" in out
    assert main(["doctor", "--run", str(healthy), "--no-machine"]) == 0
    capsys.readouterr()
    records = _healthy()
    for r in records:
        r["entropy"] = 0.26 * math.exp(-4 * r["step"] / STEPS)
    collapsed = _write_run(tmp_path / "collapsed", records)
    assert main(["doctor", "--run", str(collapsed), "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["exit_code"] == 1 and doc["snapshot"] is None
    first = doc["findings"][0]
    assert first["id"] == "run.entropy_collapse" and first["area"] == AREA and first["status"] == FAIL
    assert "rl.lr=0.0005" in first["data"]["set"] and first["data"]["score"] > 1


def test_docs_describe_every_run_finding():
    text = (ROOT / "docs" / "doctor.md").read_text()
    assert [i for i in FINDING_IDS if f"`{i}`" not in text] == []


def test_cli_passes_run_dir_to_diagnose(monkeypatch):
    from orbitctl.doctor import Report

    seen = {}
    monkeypatch.setattr(api, "diagnose", lambda **kwargs: seen.update(kwargs) or Report())
    assert main(["doctor", "--run", "runs/x", "--json"]) == 0
    assert seen["run_dir"] == "runs/x" and seen["machine"] is None


def test_missing_or_empty_run_exits_2(tmp_path, capsys, one_error_line):
    assert main(["doctor", "--run", str(tmp_path / "nope")]) == 2
    one_error_line(capsys.readouterr().err, "nope: no such run directory")
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["doctor", "--run", str(empty)]) == 2
    one_error_line(capsys.readouterr().err, "metrics.jsonl")
    (empty / "metrics.jsonl").write_text("")
    assert main(["doctor", "--run", str(empty)]) == 2
    one_error_line(capsys.readouterr().err, "metrics.jsonl: no step records")
    (empty / "metrics.jsonl").write_text(json.dumps(_healthy()[0]) + "\n")
    assert main(["doctor", "--run", str(empty)]) == 2
    one_error_line(capsys.readouterr().err, "profile.yaml", "orbitctl doctor PROFILE --run")
    assert main(["doctor", str(DEMO), "--run", str(empty)]) == 0
    capsys.readouterr()


@pytest.mark.slow
def test_real_demo_run_has_no_fail(tmp_path):
    """40 steps of the demo profile, shrunk the way tests/train shrinks it, then `doctor --run` on it."""
    run = tmp_path / "run"
    sets = {"rl.steps": 40, "rl.prompts_per_step": 8, "rl.group_size": 4, "memory.micro_batch_size": 16,
            "rollout.batch_size": 32, "rl.warmup_steps": 0, "run.eval_every": 100, "run.save_every": 100,
            "data.eval_size": 16, "run.dir": str(run)}
    env = dict(os.environ)  # the session's ORBITCTL_CACHE (tests/conftest.py): the demo base built once
    cli = [sys.executable, "-m", "orbitctl.cli.app"]
    trained = subprocess.run([*cli, "train", str(DEMO), "--json", *[a for k, v in sets.items() for a in ("--set", f"{k}={v}")]],
                             env=env, capture_output=True, text=True, timeout=900)
    assert trained.returncode == 0, trained.stderr[-2000:]
    doctor = subprocess.run([*cli, "doctor", "--run", str(run), "--json"], env=env, capture_output=True, text=True,
                            timeout=300)
    doc = json.loads(doctor.stdout)
    run_findings = [f for f in doc["findings"] if f["area"] == AREA]
    assert run_findings and all(f["id"].startswith("run.") and f["evidence"] for f in run_findings)
    assert not [f for f in run_findings if f["status"] == FAIL], run_findings
    assert doctor.returncode == doc["exit_code"] == 0 and doc["snapshot"] is None
