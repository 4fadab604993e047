"""No option is accepted and then ignored: for every command, a flag or `--set` key takes effect or
exits 2 naming it, and `train` refuses profile values that only `plan` models."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from orbitctl.cli.app import app, main

REPO = Path(__file__).resolve().parents[2]
TINY = str(REPO / "profiles" / "tiny-cpu.yaml")
KIMI = str(REPO / "profiles" / "kimi-k2_grpo_int4_8xh200.yaml")


def _run(capsys, *args) -> tuple[int, str]:
    code = main([str(a) for a in args])
    return code, capsys.readouterr().err


@pytest.fixture
def trainer_calls(monkeypatch):
    """Calls that reached the trainer (none may, when the profile is refused)."""
    import orbitctl.rl.api as trainer

    calls = []

    def fake(profile, **kwargs):
        calls.append(profile)
        raise SystemExit(0)

    monkeypatch.setattr(trainer, "train", fake)
    return calls


UNBUILT = [
    (["rollout.engine=separate"], "rollout.engine", "separate"),
    (["rollout.engine_tp=4"], "rollout.engine_tp", "4"),
    (["rollout.engine_sleep=false"], "rollout.engine_sleep", "false"),
    (["hardware.gpus_per_node=2", "memory.expert_parallel=2", "adapter.targets=attention+shared"],
     "memory.expert_parallel", "2"),  # nf4 experts
    (["hardware.gpus_per_node=2", "memory.expert_parallel=2", "quant.format=int4", "adapter.targets=all-linear"],
     "memory.expert_parallel", "2"),
    (["memory.prefetch_layers=2"], "memory.prefetch_layers", "2"),
    (["quant.compute_dtype=bf16", "model.dtype=fp32"], "model.dtype", "fp32"),
    (["quant.format=fp8", "quant.group_size=32"], "quant.group_size", "32"),
    (["quant.format=int4", "quant.storage_dtype=uint8"], "quant.storage_dtype", "uint8"),
]


@pytest.mark.parametrize("sets, key, value", UNBUILT, ids=[u[1] for u in UNBUILT])
def test_train_refuses_values_it_does_not_build(capsys, trainer_calls, sets, key, value, one_error_line):
    args = ["train", TINY] + [a for s in sets for a in ("--set", s)]
    code, err = _run(capsys, *args)
    assert code == 2
    one_error_line(err, f"{key}: {value}")
    assert trainer_calls == []


def test_train_lists_every_unbuilt_value_of_a_shipped_profile(capsys, trainer_calls):
    code, err = _run(capsys, "train", KIMI)
    assert code == 2 and trainer_calls == []
    assert "memory.loss_chunk_size" not in err  # train builds the chunked loss
    assert "Traceback" not in err


def test_train_on_a_profile_it_builds_reaches_the_trainer(trainer_calls):
    result = CliRunner().invoke(app, ["train", TINY, "--set", "rl.lr=5e-4", "--steps", "3", "--fresh", "--json"])
    assert result.exit_code == 0, result.output
    assert len(trainer_calls) == 1 and trainer_calls[0].rl.lr == 5e-4


def test_train_refuses_before_importing_torch():
    code = ("import sys\nfrom orbitctl.cli.app import main\n"
            f"codes = [main(['train', {TINY!r}, '--set', s]) for s in "
            "('rollout.engine=separate', 'rollout.engine_tp=4', 'memory.expert_parallel=2')]\n"
            "print(codes, 'torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[-2] == "[2, 2, 2] False"


def _quantized_base(tmp_path, **options) -> Path:
    base = tmp_path / "base"
    base.mkdir()
    (base / "config.json").write_text("{}")
    written = {"fmt": "int4", "group_size": 32, "double_quant": False, "storage_dtype": "bf16", "modules": "all-linear",
               "skip": ["lm_head"], "max_shard_bytes": 2 * 10**9, "compute_dtype": "bfloat16", **options}
    (base / "quant_manifest.json").write_text(json.dumps({"version": 1, "options": written}))
    return base


def _profile_file(tmp_path, **sections) -> Path:
    data = yaml.safe_load(Path(TINY).read_text())
    for section, values in sections.items():
        data.setdefault(section, {}).update(values)
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_train_refuses_quant_values_the_quantized_base_does_not_have(capsys, tmp_path, trainer_calls, one_error_line):
    base = _quantized_base(tmp_path)
    path = _profile_file(tmp_path, model={"quantized_path": str(base)}, quant={"format": "int4", "group_size": 32})
    code, err = _run(capsys, "train", path, "--set", "quant.group_size=128")
    assert code == 2 and trainer_calls == []
    one_error_line(err, "quant.group_size: 128", "32", str(base))
    code, err = _run(capsys, "train", path, "--set", "quant.format=fp8")
    assert code == 2
    one_error_line(err, "quant.format: fp8", "int4")
    with pytest.raises(SystemExit):
        main(["train", str(path)])  # the values it was written with: trained as is
    assert len(trainer_calls) == 1


def test_plan_still_models_what_train_does_not_build(capsys):
    for sets in UNBUILT:
        code = main(["plan", TINY, "--json"] + [a for s in sets[0] for a in ("--set", s)])
        assert code in (0, 1), (sets, capsys.readouterr().err)
    capsys.readouterr()
    assert main(["profile", "validate", *map(str, sorted((REPO / "profiles").glob("*.yaml")))]) == 0


def test_unsupported_for_names_key_value_and_why():
    from orbitctl.profile import load_profile
    from orbitctl.profile.support import refuse_unsupported, unsupported_for
    from orbitctl.errors import UserError

    profile = load_profile(TINY, ["rollout.engine=separate", "rollout.engine_tp=4"])
    found = unsupported_for("train", profile)
    assert [(u.key, u.value) for u in found] == [("rollout.engine", "separate"), ("rollout.engine_tp", 4)]
    assert all(isinstance(why, str) and why for _, _, why, _ in found)
    assert [(u.key, u.value) for u in unsupported_for("verify-alignment", profile)] == [("rollout.engine", "separate")]
    assert unsupported_for("verify-alignment --rollouts", profile) == []
    with pytest.raises(UserError) as info:
        refuse_unsupported(profile, "train")
    assert "rollout.engine: separate" in info.value.render() and "rollout.engine: shared" in info.value.render()
    assert unsupported_for("train", load_profile(TINY)) == []


@pytest.mark.parametrize("command, key, known", [
    (["plan", TINY], "rollout.kv_dtyp", "rollout.kv_dtype"),
    (["train", TINY], "rollout.kv_dtyp", "rollout.kv_dtype"),
    (["profile", "validate", TINY], "rollout.kv_dtyp", "rollout.kv_dtype"),
    (["profile", "show", TINY], "rollout.kv_dtyp", "rollout.kv_dtype"),
    (["verify-alignment", TINY], "rollout.kv_dtyp", "rollout.kv_dtype"),
    (["doctor", TINY], "rollout.kv_dtyp", "rollout.kv_dtype"),
    (["quantize", TINY], "quant.group_sise", "quant.group_size"),
])
def test_unknown_set_key_is_refused_by_every_command(capsys, command, key, known, one_error_line):
    code, err = _run(capsys, *command, "--set", f"{key}=1")
    assert code == 2
    one_error_line(err, key, known)


@pytest.mark.parametrize("args, needle", [
    (["--list-archs", TINY], "PROFILE"),
    (["--list-archs", "--set", "memory.seq_len=8"], "--set"),
    (["--list-archs", "--sweep", "memory.micro_batch_size=1,2"], "--sweep"),
    (["--list-archs", "--measure"], "--measure"),
])
def test_plan_refuses_flags_list_archs_ignores(capsys, args, needle, one_error_line):
    code, err = _run(capsys, "plan", *args)
    assert code == 2
    one_error_line(err, "--list-archs", needle)


def test_doctor_set_needs_profile_and_no_machine_needs_log(capsys, one_error_line):
    code, err = _run(capsys, "doctor", "--set", "memory.seq_len=8")
    assert code == 2
    one_error_line(err, "--set", "PROFILE")
    code, err = _run(capsys, "doctor", TINY, "--no-machine")
    assert code == 2
    one_error_line(err, "--no-machine", "--log")


def test_doctor_machine_flags_with_a_log_check_the_machine(monkeypatch, tmp_path):
    from orbitctl.doctor import api as doctor_lib

    class Probed(Exception):
        pass

    def probe(*args, **kwargs):
        raise Probed

    log = tmp_path / "run.log"
    log.write_text("RuntimeError: CUDA out of memory.\n")
    monkeypatch.setattr(doctor_lib, "take_snapshot", probe)
    for extra in ({"expect_gpus": 8}, {"active": True}):
        with pytest.raises(Probed):  # the machine is probed although only a log was named
            doctor_lib.diagnose(log=str(log), **extra)
    report = doctor_lib.diagnose(log=str(log))  # a log alone is read without probing this machine
    assert report.snapshot_source is None


@pytest.fixture
def verify_calls(monkeypatch):
    import orbitctl.align.api as verify

    calls = []
    monkeypatch.setattr(verify, "verify_alignment", lambda profile, **kw: calls.append(kw) or (_ for _ in ()).throw(SystemExit(0)))
    return calls


@pytest.mark.parametrize("args, needles", [
    ([TINY, "--rollouts", "r.jsonl", "--adapter", "a/"], ["--adapter", "--rollouts"]),
    ([TINY, "--rollouts", "r.jsonl", "--prompts", "p.jsonl"], ["--prompts", "--rollouts"]),
    (["--logits-a", "a", "--logits-b", "b", "--adapter", "a/"], ["--adapter", "--logits-a"]),
    (["--logits-a", "a", "--logits-b", "b", "--prompts", "p.jsonl"], ["--prompts", "--logits-a"]),
    (["--logits-a", "a", "--logits-b", "b", "--engine-temperature", "2"], ["--engine-temperature"]),
    ([TINY, "--engine-temperature", "2"], ["--engine-temperature", "internal"]),
    (["--run", "r", "--perturb-layer", "0"], ["--perturb-layer", "--run"]),
    ([TINY, "--perturb-scale", "2"], ["--perturb-scale", "--perturb-layer"]),
    (["--run", "r", "--plot", "x.png"], ["--plot", "--run"]),
    ([TINY, "--logits-a", "a", "--logits-b", "b", "--set", "rl.lr=0.1"], ["--set rl.lr", "alignment.*"]),
    ([TINY, "--run", "r", "--set", "memory.seq_len=8"], ["--set memory.seq_len", "alignment.*"]),
    ([TINY, "--set", "rollout.engine=separate"], ["rollout.engine: separate", "--rollouts"]),
    ([TINY, "--set", "quant.format=int4", "--set", "quant.double_quant=true"], ["quant.double_quant: true", "int4"]),
])
def test_verify_alignment_refuses_what_the_comparison_ignores(capsys, verify_calls, args, needles, one_error_line):
    code, err = _run(capsys, "verify-alignment", *args)
    assert code == 2
    one_error_line(err, *needles)
    assert verify_calls == []


def test_verify_alignment_flags_that_apply_reach_the_library(verify_calls):
    runner = CliRunner()
    for args in ([TINY, "--rollouts", "r.jsonl", "--engine-temperature", "2", "--set", "rollout.kv_dtype=fp8"],
                 [TINY, "--perturb-layer", "1", "--perturb-scale", "3"],
                 [TINY, "--logits-a", "a", "--logits-b", "b", "--set", "alignment.js_max=0.01"],
                 ["--run", "r"]):
        result = runner.invoke(app, ["verify-alignment", *args, "--json"])
        assert result.exit_code == 0, result.output
    assert verify_calls[0]["engine_temperature"] == 2.0
    assert (verify_calls[1]["perturb"].layer, verify_calls[1]["perturb"].scale) == (1, 3.0)
    assert verify_calls[2]["logits_a"] == "a" and verify_calls[3]["engine_temperature"] == 1.0


@pytest.mark.parametrize("command", ["eval", "serve"])
def test_the_sampling_commands_refuse_what_their_infer_path_would_not_carry_out(command):
    from orbitctl.profile import load_profile
    from orbitctl.profile.support import unsupported_for

    sets = ["rollout.engine=separate", "rollout.max_turns=3", "data.train=env:guess"]
    found = unsupported_for(command, load_profile(TINY, sets))
    assert sorted(u.key for u in found) == ["data.train", "rollout.engine", "rollout.max_turns"]
    assert unsupported_for(command, load_profile(TINY)) == []
