"""Resuming never runs code from the run directory: a planted pickle in a checkpoint stops the
run with exit 2 and the file's name, and its payload never fires. A clean checkpoint resumes, to
the same adapter bit for bit, on the run's own thread count; one whose dtypes changed is refused."""

import contextlib
import importlib.util
import json
import os
import pickle
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

torch = pytest.importorskip("torch")


class Payload:
    """Unpickling this creates ``marker``: what a hostile checkpoint would do instead."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, model_cache):
    """A real two-step tiny run through the CLI, checkpointed at step 2; copied by every test."""
    from orbitctl.cli.app import main

    spec = importlib.util.spec_from_file_location("train_conftest", Path(__file__).with_name("conftest.py"))
    conftest = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(conftest)
    root = tmp_path_factory.mktemp("resume-safety")
    profile = conftest.small_profile_yaml(root, "source", **{"rl.steps": 2, "run.save_every": 2})
    assert main(["train", str(profile), "--json"]) == 0
    assert (root / "source" / "checkpoints" / "step-2" / "COMPLETE").exists()
    return root / "source"


def _copy_run(source: Path, tmp_path: Path, name: str, steps: int = 3) -> tuple[Path, Path]:
    """The run under ``tmp_path/name`` and a profile that resumes it up to ``steps``."""
    run_dir = tmp_path / name
    shutil.copytree(source, run_dir)
    data = yaml.safe_load((run_dir / "profile.yaml").read_text())
    data["run"]["dir"] = str(run_dir)
    data["rl"]["steps"] = steps
    profile = tmp_path / f"{name}.yaml"
    profile.write_text(yaml.safe_dump(data, sort_keys=False))
    return run_dir, profile


def _engine_file(checkpoint: Path, suffix: str) -> Path:
    (found,) = [p for p in (checkpoint / "engine").iterdir() if p.name.endswith(suffix)]
    return found


def _plant(checkpoint: Path, target: str, marker: Path) -> Path:
    """Replace one file of ``checkpoint`` with a pickle whose loading would create ``marker``."""
    if target == "rng":
        planted = checkpoint / "rng-rank0.safetensors"
        planted.write_bytes(pickle.dumps(Payload(marker)))
    elif target == "legacy-rng":  # the layout before safetensors: still read, with weights_only=True
        (checkpoint / "rng-rank0.safetensors").unlink()
        planted = checkpoint / "rng-rank0.pt"
        torch.save({"torch": torch.get_rng_state(), "python": Payload(marker)}, planted)
    elif target == "engine-model":  # torch's zip format, as DeepSpeed writes it
        planted = _engine_file(checkpoint, "model_states.pt")
        torch.save({"module": {}, "hook": Payload(marker)}, planted)
    else:  # a bare pickle stream, which torch.load also accepts
        planted = _engine_file(checkpoint, "optim_states.pt")
        planted.write_bytes(pickle.dumps({"optimizer_state_dict": Payload(marker)}))
    return planted


@pytest.mark.slow
@pytest.mark.parametrize("target", ["rng", "legacy-rng", "engine-model", "engine-optim"])
def test_a_planted_pickle_is_refused_and_never_runs(finished_run, tmp_path, capsys, target):
    from orbitctl.cli.app import main

    run_dir, profile = _copy_run(finished_run, tmp_path, f"planted-{target}")
    marker = tmp_path / "payload-ran"
    planted = _plant(run_dir / "checkpoints" / "step-2", target, marker)
    capsys.readouterr()
    assert main(["train", str(profile), "--json"]) == 2
    out = capsys.readouterr()
    assert not marker.exists(), "resuming ran code from the checkpoint"
    errors = [line for line in out.err.splitlines() if line.startswith("Error: ")]
    assert len(errors) == 1 and str(planted) in errors[0] and "--fresh" in errors[0], out.err[-2000:]
    assert "Traceback" not in out.err and out.out.strip() == ""
    # the planted file is live: an unguarded loader would have run it (and then failed on the rest)
    if target != "rng":
        with contextlib.suppress(Exception):
            torch.load(planted, weights_only=False)
        assert marker.exists()


@pytest.mark.slow
def test_without_the_guard_deepspeed_would_run_the_payload(finished_run, tmp_path, monkeypatch):
    """DeepSpeed's TorchCheckpointEngine.load uses torch.load(weights_only=False): the check is what stops it."""
    from orbitctl.cli.app import main
    from orbitctl.rl import checkpoint

    run_dir, profile = _copy_run(finished_run, tmp_path, "unguarded")
    marker = tmp_path / "payload-ran"
    _plant(run_dir / "checkpoints" / "step-2", "engine-model", marker)
    monkeypatch.setattr(checkpoint, "check_engine_files", lambda path: None)
    main(["train", str(profile), "--json"])  # fails one way or another once the payload ran
    assert marker.exists()


@pytest.mark.slow
def test_a_clean_checkpoint_resumes(finished_run, tmp_path, capsys):
    from orbitctl.cli.app import main

    checkpoint = finished_run / "checkpoints" / "step-2"
    assert {p.name for p in checkpoint.iterdir() if p.suffix == ".pt"} == set()  # no pickle outside engine/
    run_dir, profile = _copy_run(finished_run, tmp_path, "clean")
    capsys.readouterr()
    assert main(["train", str(profile), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["resumed_from"] == 2 and result["steps"] == 3
    assert [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]


@pytest.mark.slow
def test_a_resume_whose_adapter_dtype_changed_is_refused(finished_run, tmp_path, capsys):
    from orbitctl.cli.app import main

    run_dir, profile = _copy_run(finished_run, tmp_path, "other-dtype")
    trained = json.loads((run_dir / "checkpoints" / "step-2" / "trainer.json").read_text())["adapter_dtype"]
    capsys.readouterr()
    assert main(["train", str(profile), "--set", f"adapter.dtype={'bf16' if trained == 'fp32' else 'fp32'}"]) == 2
    err = capsys.readouterr().err
    assert "trainer.json" in err and "adapter.dtype" in err and "--fresh" in err and "Traceback" not in err


def _cli(profile: Path, threads: int | None, *extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_DYNAMIC")}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[2]), env.get("PYTHONPATH", "")])
    if threads is not None:
        # MKL caps torch's default at the physical cores unless its dynamic mode is off
        env.update(OMP_NUM_THREADS=str(threads), MKL_DYNAMIC="FALSE")
    out = subprocess.run([sys.executable, "-m", "orbitctl.cli.app", "train", str(profile), "--json", *extra],
                         env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout)


def _recorded_threads(run_dir: Path, step: int) -> int:
    return json.loads((run_dir / "checkpoints" / f"step-{step}" / "trainer.json").read_text())["torch_threads"]


@pytest.mark.slow
def test_a_run_resumed_on_another_thread_count_keeps_the_runs_count_and_its_bits(tmp_path, profile_yaml):
    """In fp32 the lm_head GEMM (100-token vocabulary) goes to MKL, which splits it by thread count
    and rounds accordingly (measured on an AVX512 EPYC: straight runs on 4 and 2 threads differ
    after 8 steps in about 14,500 of the adapter's 16,384 values). A resume therefore runs on the
    thread count the run recorded, whatever this process started with, and ends on the
    uninterrupted run's adapter bit for bit."""
    from safetensors.torch import load_file

    settings = {"rl.steps": 6, "run.save_every": 3, "quant.compute_dtype": "fp32", "adapter.dtype": "fp32"}
    straight, split = profile_yaml("straight", **settings), profile_yaml("split", **settings)
    assert _cli(straight, 4)["steps"] == 6
    # --steps 3 leaves rl.steps at 3 for the first half; with no warmup and a constant lr that
    # changes nothing the optimizer sees
    small = yaml.safe_load(split.read_text())["rl"]
    assert small["warmup_steps"] == 0 and small.get("lr_schedule", "constant") == "constant"
    assert _cli(split, 4, "--steps", "3")["steps"] == 3
    resumed = _cli(split, 1)  # started on one thread
    assert resumed["resumed_from"] == 3 and resumed["steps"] == 6
    assert [_recorded_threads(tmp_path / run, 6) for run in ("straight", "split")] == [4, 4]
    a = load_file(str(tmp_path / "straight" / "adapter" / "adapter_model.safetensors"))
    b = load_file(str(tmp_path / "split" / "adapter" / "adapter_model.safetensors"))
    assert a.keys() == b.keys() and {t.dtype for t in a.values()} == {torch.float32}
    differ = {k: int((a[k] != b[k]).sum()) for k in a if not torch.equal(a[k], b[k])}
    assert not differ, f"elements that differ per tensor: {differ}"


@pytest.mark.slow
@pytest.mark.parametrize("overrides", [
    {"memory.zero_stage": 0}, {"memory.zero_stage": 1}, {"memory.zero_stage": 3},
], ids=["zero0", "zero1", "zero3"])
def test_every_engine_file_deepspeed_writes_passes_the_check(small_profile, overrides):
    """The allow-list holds every class DeepSpeed pickles, so no honest checkpoint is refused."""
    from orbitctl.rl.checkpoint import check_engine_files
    from orbitctl.rundir import RunDir
    from orbitctl.rl.api import train

    result = train(small_profile(**{"rl.steps": 1, **overrides}))
    step, path = RunDir(result.run_dir).latest_checkpoint()
    assert step == 1
    check_engine_files(path)


def test_rng_states_round_trip_without_pickle(tmp_path):
    from orbitctl.rl.checkpoint import read_rng, restore_rng, save_rng

    generator = torch.Generator().manual_seed(11)
    torch.manual_seed(5)
    random.seed(3)
    random.gauss(0.0, 1.0)  # leaves a cached gauss_next in the state
    torch.rand(3, generator=generator)
    file = tmp_path / "rng-rank0.safetensors"
    save_rng(file, generator)
    expected = (torch.rand(4), torch.rand(4, generator=generator), random.random(), random.gauss(0.0, 1.0))
    other = torch.Generator().manual_seed(99)
    torch.manual_seed(0)
    random.seed(0)
    restore_rng(read_rng(tmp_path, 0), other)
    got = (torch.rand(4), torch.rand(4, generator=other), random.random(), random.gauss(0.0, 1.0))
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1]) and got[2:] == expected[2:]


@pytest.mark.parametrize("damage", ["truncated", "no-python", "short-state"])
def test_a_damaged_rng_file_is_an_input_error(tmp_path, damage):
    from safetensors.torch import save_file

    from orbitctl.errors import InputFileError
    from orbitctl.rl.checkpoint import read_rng, save_rng

    file = tmp_path / "rng-rank0.safetensors"
    save_rng(file, torch.Generator())
    if damage == "truncated":
        file.write_bytes(file.read_bytes()[:100])
    elif damage == "no-python":
        save_file({"torch": torch.get_rng_state(), "sampler": torch.Generator().get_state()}, str(file))
    else:
        save_file({"torch": torch.get_rng_state(), "sampler": torch.Generator().get_state()}, str(file),
                  metadata={"python": json.dumps([3, [1, 2, 3], None])})
    with pytest.raises(InputFileError) as caught:
        read_rng(tmp_path, 0)
    assert str(file) in caught.value.render() and "\n" not in caught.value.render()
