"""The CUDA rehearsal (orbitctl/dist/rehearsal.py, rehearse.py): the shipped Kimi-K2 profile's GPU paths at world
size 8 and expert parallelism 8, on fake cuda tensors under a process group that takes CUDA tensors only, as NCCL
does. Each run is a child process (the fake CUDA library loads before torch); planted defects are edits of a copy
of the package, so the rehearsal must name the real file and line of each.

    pytest -k rehearsal
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from orbitctl.isolated import signal_death

ROOT = Path(__file__).resolve().parents[1]
PROFILE = ROOT / "profiles" / "kimi-k2_grpo_int4_8xh200.yaml"
STEPS = ["load", "prefill", "decode", "sampling", "update", "statistics", "adapter_sync"]


def rehearse(tmp_path: Path, *args: str, package: Path | None = None) -> tuple[dict, str]:
    """Run the rehearsal in a child (on ``package``'s copy of orbitctl when given); its report and output."""
    out = tmp_path / f"report-{len(list(tmp_path.glob('report-*.json')))}.json"
    env = {**os.environ, "PYTHONPATH": str(package or ROOT)}
    env.pop("TRITON_INTERPRET", None)
    done = subprocess.run([sys.executable, "-m", "orbitctl.launch.rehearse", "--profile", str(PROFILE), "--json",
                           str(out), *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    # the child first-loads fake_cuda's library: a crash there fails this test with the signal and its cause
    died = signal_death("the rehearsal (fake_cuda's library loads there)", done.returncode)
    assert out.exists(), f"no report ({died or f'exit {done.returncode}'}):\n{done.stdout}\n{done.stderr[-3000:]}"
    report = json.loads(out.read_text())
    if package is not None:  # the copy ran, not the installed package
        assert report["steps"][0]["status"] in ("pass", "fail")
    return report, done.stdout


def by_step(report: dict) -> dict:
    return {s["step"]: s for s in report["steps"]}


def planted(tmp_path: Path, edits: dict[str, list[tuple[str, str]]]) -> Path:
    """A copy of the orbitctl package with ``edits`` ({file: [(old, new)]}) applied; each ``old`` must be there."""
    root = tmp_path / "planted"
    shutil.copytree(ROOT / "orbitctl", root / "orbitctl", ignore=shutil.ignore_patterns("__pycache__"))
    for name, changes in edits.items():
        path = root / "orbitctl" / name
        text = path.read_text()
        for old, new in changes:
            assert text.count(old) == 1, f"{name}: the code to plant a defect in changed: {old!r}"
            text = text.replace(old, new)
        path.write_text(text)
    return root


def line_of(package: Path, name: str, needle: str) -> int:
    lines = (package / "orbitctl" / name).read_text().splitlines()
    return next(i for i, line in enumerate(lines, start=1) if needle in line)


def test_rehearsal_runs_the_k2_profile_at_world_8_on_rank_0(tmp_path):
    report, out = rehearse(tmp_path)
    steps = by_step(report)
    assert [s["step"] for s in report["steps"]] == STEPS
    assert all(s["status"] == "pass" for s in report["steps"]), out
    assert report["world"] == 8 and report["expert_parallel"] == 8 and report["fake_cuda_state"] == 3
    load = steps["load"]
    # rank 0 of EP 8 holds experts 0..47 of 384, stacked for the grouped kernel; the rest is replicated
    assert load["experts_held"] == [0, 47] and load["experts_total"] == 384 and load["grouped_stack"]
    assert load["trainable_params"] > 0
    assert steps["decode"]["static"] and steps["decode"]["captured"] and steps["decode"]["lockstep"]
    assert steps["decode"]["recorded_layers"] == 2
    assert steps["decode"]["logits"] == [8, 163840]
    assert steps["update"]["offload_bytes"] > 0  # memory.offload_activations: cpu sent the checkpoints to the host
    assert steps["adapter_sync"]["gradients_reduced"] == steps["update"]["adapters_with_gradient"]
    # every collective crossed the group on a CUDA tensor (the group refuses others); the step statistics and the
    # lockstep among them
    sites = {c["where"].rsplit(":", 1)[0] for c in report["collectives"]}
    assert {"orbitctl/rl/trainer.py", "orbitctl/model/expert_parallel.py", "orbitctl/model/graph_decode.py",
            "orbitctl/rl/chunked_loss.py"} <= sites
    # the captured decode step read nothing on the host
    assert not any("graph_decode" in site for site in report["host_reads"])


def test_rehearsal_on_the_last_rank_holds_the_last_experts_and_replays_the_routing(tmp_path):
    report, out = rehearse(tmp_path, "--rank", "7", "--layers", "2", "--set", "rl.router_replay=true")
    assert all(s["status"] == "pass" for s in report["steps"]), out
    assert by_step(report)["load"]["experts_held"] == [336, 383]
    assert by_step(report)["update"]["router_replay"]  # the train path ran the recorded experts


def test_rehearsal_names_each_planted_host_tensor(tmp_path):
    """Three defects at once, each failing its own step with the file and line that made it: a CPU tensor into the
    expert-parallel lockstep's all-reduce and into the step statistics' (as landed code once did), and a CPU tensor
    mixed into the device sampler's CUDA ops."""
    package = planted(tmp_path, {
        "model/expert_parallel.py": [(
            '        return coll.reduce_scalars([int(value)], op, self.group)[0]',
            '        import torch.distributed as dist\n'
            '        t = torch.tensor([value], dtype=torch.int64)  # planted: a host tensor\n'
            '        dist.all_reduce(t, op=dist.ReduceOp.MIN if op == "min" else dist.ReduceOp.MAX, group=self.group)\n'
            '        return int(t.item())')],
        "rl/trainer.py": [(
            '    n, r_sum, r_sq, correct, length_sum, valid, calls = reduce_scalars([',
            '    import torch\n'
            '    import torch.distributed as dist\n'
            '    planted = torch.tensor([float(batch.size)], dtype=torch.float64)\n'
            '    dist.all_reduce(planted)\n'
            '    n, r_sum, r_sq, correct, length_sum, valid, calls = reduce_scalars([')],
        "model/draws.py": [(
            'target = self.uniforms(step).to(cdf.device, non_blocking=True) * cdf[:, -1]',
            'target = self.uniforms(step) * cdf[:, -1]')],
    })
    report, out = rehearse(tmp_path, "--layers", "2", package=package)
    steps = by_step(report)
    decode, statistics, sampling = steps["decode"], steps["statistics"], steps["sampling"]
    assert decode["status"] == "fail" and decode["kind"] == "host tensor in a collective", out
    assert decode["where"] == f"orbitctl/model/expert_parallel.py:{line_of(package, 'model/expert_parallel.py', 'dist.all_reduce(t')}"
    assert "No backend type associated with device type cpu" in decode["error"]
    assert statistics["status"] == "fail" and statistics["kind"] == "host tensor in a collective", out
    assert statistics["where"] == f"orbitctl/rl/trainer.py:{line_of(package, 'rl/trainer.py', 'dist.all_reduce(planted)')}"
    assert sampling["status"] == "fail" and sampling["kind"] == "host tensor in a device op", out
    assert sampling["where"] == f"orbitctl/model/draws.py:{line_of(package, 'model/draws.py', 'target = self.uniforms')}"
    # the others still ran and passed
    assert steps["load"]["status"] == steps["update"]["status"] == "pass"


@pytest.mark.parametrize("defect, reason", [
    ("        if bool((self.token > 0).any().item()):\n            pass\n", "reads a device value on the host"),
    ("        _ = self.position[self.position > 0]\n", "boolean-mask index"),
    ("        _ = torch.nonzero(self.token)\n", "nonzero's output shape depends on the data"),
], ids=["item", "boolean-mask", "nonzero"])
def test_rehearsal_names_a_planted_sync_in_the_captured_decode_step(tmp_path, defect, reason):
    anchor = "        with static_shapes() if self.static else contextlib.nullcontext():\n"
    package = planted(tmp_path, {"model/graph_decode.py": [(anchor, defect + anchor)]})
    report, out = rehearse(tmp_path, "--layers", "2", package=package)
    decode = by_step(report)["decode"]
    assert decode["status"] == "fail" and decode["kind"].startswith("not capturable in the captured decode step"), out
    assert reason in decode["error"]
    planted_line = line_of(package, "model/graph_decode.py", defect.strip().splitlines()[0])
    assert decode["where"] == f"orbitctl/model/graph_decode.py:{planted_line}"


def test_train_rehearse_runs_it_from_the_cli_and_refuses_what_does_not_go_with_it(tmp_path, capsys):
    from orbitctl.cli.app import main

    assert main(["train", str(PROFILE), "--rehearse", "--steps", "3"]) == 2
    assert "--steps" in capsys.readouterr().err
    assert main(["train", str(ROOT / "profiles" / "tiny-cpu.yaml"), "--rehearse"]) == 2
    err = capsys.readouterr().err
    assert "model.arch" in err and "llama" in err
    done = subprocess.run([sys.executable, "-m", "orbitctl.cli.app", "train", str(PROFILE), "--rehearse", "--json",
                           "--set", "memory.micro_batch_size=2"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=600, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout)
    assert [s["status"] for s in report["steps"]] == ["pass"] * len(STEPS)
    assert by_step(report)["update"]["micro_batch"] == 2  # the --set reached the rehearsal


def test_rehearsal_runs_the_deepseek_profile_whose_expert_adapters_keep_the_per_expert_loop(tmp_path):
    """adapter.experts: shared-outer keeps the routed experts on the per-expert loop, which reads the routing on the
    host: the decode stays eager (not captured), and the loop runs every held expert on the rehearsal's even split."""
    report, out = rehearse(tmp_path, "--profile", str(ROOT / "profiles" / "deepseek-v3_grpo_int4_8xh200.yaml"),
                           "--layers", "2")
    assert all(s["status"] == "pass" for s in report["steps"]), out
    decode = by_step(report)["decode"]
    assert decode["static"] and not decode["captured"]
    assert by_step(report)["load"]["experts_total"] == 256 and by_step(report)["load"]["experts_held"] == [0, 31]
