"""`orbitctl verify-alignment` stays thin, exits 1 on a failed gate and 2 on bad input."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file
from typer.testing import CliRunner

from orbitctl.cli.app import app, main


def test_flags_reach_the_library(monkeypatch, tmp_path, align_profile):
    import orbitctl.align.api as verify

    seen = {}

    def fake(profile, **kwargs):
        seen.update(profile=profile, **kwargs)
        raise SystemExit(0)

    monkeypatch.setattr(verify, "verify_alignment", fake)
    path, _ = align_profile()
    result = CliRunner().invoke(app, ["verify-alignment", str(path), "--adapter", "a/", "--prompts", "p.jsonl",
                                      "--infer-quant", "fp8", "--per-layer", "--run", "runs/x", "--json",
                                      "--set", "alignment.js_max=0.01"])
    assert result.exit_code == 0, result.output
    assert seen["profile"].alignment.js_max == 0.01
    assert (seen["adapter"], seen["prompts_file"], seen["infer_quant"], seen["per_layer"], seen["run"]) == \
        ("a/", "p.jsonl", "fp8", True, "runs/x")
    assert seen["rollouts"] is None and seen["logits_a"] is None and seen["on_progress"] is None


def _dumps(tmp_path, noise: float, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(40, 500, generator=g) * 3
    b = a + noise * torch.randn(40, 500, generator=g)
    ids = torch.randint(0, 500, (40,), generator=g)
    save_file({"logits": a, "token_ids": ids}, str(tmp_path / "a.safetensors"))
    save_file({"logits": b}, str(tmp_path / "b.safetensors"))
    return a, b, ids


def _run(capsys, args):
    code = main(args)
    return code, capsys.readouterr()


def test_logit_dumps_json_matches_the_metrics_library(tmp_path, capsys):
    from orbitctl.align.metrics import token_metrics

    a, b, ids = _dumps(tmp_path, noise=0.01)
    code, out = _run(capsys, ["verify-alignment", "--logits-a", str(tmp_path / "a.safetensors"),
                              "--logits-b", str(tmp_path / "b.safetensors"), "--json"])
    assert code == 0, out.err
    doc = json.loads(out.out)
    want = token_metrics(a, b, ids, k=5)
    assert doc["verdict"] == "PASS" and doc["tokens"] == 40
    assert doc["metrics"]["js"]["mean"] == pytest.approx(float(want["js"].mean()), rel=1e-9)
    assert doc["metrics"]["k3"]["max"] == pytest.approx(float(want["k3"].max()), rel=1e-9)
    assert {g["metric"]: g["status"] for g in doc["gates"]}["js"] == "PASS"


def test_mismatched_dumps_fail_with_exit_1_and_a_plot(tmp_path, capsys):
    _dumps(tmp_path, noise=2.0)
    plot = tmp_path / "out" / "align.png"
    code, out = _run(capsys, ["verify-alignment", "--logits-a", str(tmp_path / "a.safetensors"),
                              "--logits-b", str(tmp_path / "b.safetensors"), "--plot", str(plot)])
    assert code == 1
    assert "FAIL" in out.out and "alignment gates failed" in out.err
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _metrics_file(run_dir, entropies):
    run_dir.mkdir(parents=True)
    lines = [json.dumps({"step": i + 1, "entropy": e, "mismatch_k3_kl": 1e-5, "mismatch_prob_abs_mean": 1e-4})
             for i, e in enumerate(entropies)]
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")


def test_run_entropy_stability_gate(tmp_path, capsys):
    steady = [1.0 + 0.01 * ((i % 2) * 2 - 1) for i in range(150)]  # 2% peak to peak
    _metrics_file(tmp_path / "steady", steady)
    code, out = _run(capsys, ["verify-alignment", "--run", str(tmp_path / "steady"), "--json"])
    assert code == 0, out.err
    doc = json.loads(out.out)
    assert doc["run"]["entropy_fluctuation"] == pytest.approx(0.02, rel=1e-9) and doc["tokens"] == 0
    collapsing = [1.0] * 100 + [1.0 - 0.01 * i for i in range(1, 50)]
    _metrics_file(tmp_path / "collapsing", collapsing)
    code, out = _run(capsys, ["verify-alignment", "--run", str(tmp_path / "collapsing")])
    assert code == 1 and "entropy fluctuation" in out.err


@pytest.mark.parametrize("args, says", [
    (["--logits-a", "x.safetensors"], "--logits-a and --logits-b go together"),
    (["--logits-a", "missing-a.safetensors", "--logits-b", "missing-b.safetensors"], "missing-a.safetensors"),
    (["--run", "no/such/run"], "no/such/run"),
    (["--rollouts", "r.jsonl"], "needs a PROFILE"),
])
def test_bad_input_is_one_line_and_exit_2(capsys, args, says):
    code, out = _run(capsys, ["verify-alignment", *args])
    assert code == 2
    lines = [line for line in out.err.splitlines() if line.strip()]
    assert len(lines) == 1 and says in lines[0] and "Traceback" not in out.err


@pytest.mark.parametrize("args, says", [
    (["--infer-quant", "int3"], "--infer-quant int3"),
    (["--adapter", "no-such-adapter"], "no-such-adapter"),
    (["--rollouts", "missing.jsonl"], "missing.jsonl"),
])
def test_bad_input_with_a_profile_is_exit_2(capsys, align_profile, args, says):
    path, _ = align_profile()
    code, out = _run(capsys, ["verify-alignment", str(path), *args])
    assert code == 2
    assert says in out.err and "Traceback" not in out.err
