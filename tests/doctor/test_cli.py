"""The `orbitctl doctor` command: thin over diagnose(), exit codes 0/1/2, one JSON document, no traceback."""

import json
from pathlib import Path

from typer.testing import CliRunner

from orbitctl.cli.app import app, main
from orbitctl.doctor import Report, api

FIX = Path(__file__).parent / "fixtures"
runner = CliRunner()


def test_cli_passes_flags_to_one_library_call(monkeypatch):
    seen = {}

    def fake_diagnose(**kwargs):
        seen.update(kwargs)
        return Report()

    monkeypatch.setattr(api, "diagnose", fake_diagnose)
    result = runner.invoke(app, ["doctor", "p.yaml", "--log", "run.log", "--set", "memory.seq_len=2048",
                                 "--snapshot", "s.json", "--save-snapshot", "o.json", "--expect-gpus", "8", "--active",
                                 "--machine", "--json"])
    assert result.exit_code == 0, result.output
    assert seen == {"snapshot_path": "s.json", "save_snapshot_path": "o.json", "log": "run.log", "profile_path": "p.yaml",
                    "overrides": ["memory.seq_len=2048"], "expect_gpus": 8, "active": True, "machine": True, "run_dir": None}
    assert json.loads(result.stdout)["ok"] is True


def test_gpu_less_machine_exits_0_and_says_so(capsys):
    assert main(["doctor"]) == 0
    out = capsys.readouterr()
    assert "no NVIDIA driver/GPU found" in out.out
    assert "Traceback" not in out.out + out.err
    assert main(["doctor", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["exit_code"] == 0 and any("no NVIDIA driver/GPU found" in n for n in doc["notes"])
    statuses = {f["id"]: f["status"] for f in doc["findings"]}
    assert statuses["env.nvml"] == statuses["pcie.width"] == statuses["numa.bind"] == "SKIP"


def test_no_gpu_is_said_once_and_every_skipped_check_stays_in_the_json(capsys):
    snapshot = str(FIX / "snapshots" / "no_gpu.json")
    assert main(["doctor", "--snapshot", snapshot]) == 0
    out = capsys.readouterr().out
    words = " ".join(out.split())  # the note wraps at the terminal's width
    nvml_error = "NVML Shared Library Not Found"
    assert words.count(nvml_error) == 1 and words.count("no NVIDIA driver/GPU found") == 1
    assert words.startswith("no NVIDIA driver/GPU found (nvmlInit failed") and "`--gpus all`" in words
    for skipped in ("env.nvml", "ver.driver", "pcie.width", "numa.bind", "env.alloc"):
        assert skipped not in out, skipped
    assert "env.torch" in out and "xid.recent" in out  # what is not about the missing GPU is shown as before
    assert main(["doctor", "--snapshot", snapshot, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    no_gpu = {f["id"]: f for f in doc["findings"] if f["data"].get("skip_reason") == "no_gpu"}
    assert {"env.nvml", "ver.driver", "pcie.width", "numa.bind", "env.alloc"} <= set(no_gpu)
    assert all(f["status"] == "SKIP" for f in no_gpu.values())
    assert all(f["evidence"] == ["no NVIDIA driver/GPU found"] for i, f in no_gpu.items() if i != "env.nvml")
    assert nvml_error in no_gpu["env.nvml"]["evidence"][0] and "--gpus all" in no_gpu["env.nvml"]["fix"]
    assert f"{len(no_gpu)} GPU checks SKIP" in doc["notes"][0]


def test_fail_gives_exit_1_and_table(capsys):
    assert main(["doctor", "--snapshot", str(FIX / "snapshots" / "pcie_x8.json")]) == 1
    out = capsys.readouterr().out
    assert "pcie.width" in out and "FAIL" in out and "topology" in out
    assert main(["doctor", "--log", str(FIX / "logs" / "mixed_oom_rank3_then_timeouts.log")]) == 1
    out = capsys.readouterr().out
    assert "Root cause: log.oom.cap on rank 3" in out


def test_bad_input_exits_2_without_traceback(tmp_path, capsys):
    assert main(["doctor", "--log", str(tmp_path / "nope.log")]) == 2
    err = capsys.readouterr().err
    assert "nope.log: log file not found" in err and "Traceback" not in err
    bad = tmp_path / "snap.json"
    bad.write_text("[1, 2")
    assert main(["doctor", "--snapshot", str(bad)]) == 2
    assert "not a JSON snapshot" in capsys.readouterr().err


def test_log_from_stdin_json():
    text = (FIX / "logs" / "cuda_802.log").read_text()
    result = runner.invoke(app, ["doctor", "--log", "-", "--json"], input=text)
    assert result.exit_code == 1
    doc = json.loads(result.stdout)
    assert doc["root_cause"]["id"] == "log.cuda.802"
    assert [f["area"] for f in doc["findings"]] == ["log"]  # a log alone does not probe this machine


def test_save_snapshot_round_trip(tmp_path):
    out = tmp_path / "here.json"
    assert main(["doctor", "--save-snapshot", str(out), "--json"]) == 0
    assert json.loads(out.read_text())["format"] == "orbitctl.doctor.snapshot/1"
    assert main(["doctor", "--snapshot", str(out), "--json"]) == 0


def test_help_has_examples_and_imports_no_torch():
    import subprocess
    import sys

    code = "import sys; from orbitctl.cli.app import main; main(['doctor', '--help']); print('torch' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "orbitctl doctor --log" in proc.stdout
    assert proc.stdout.strip().endswith("False")


def test_docs_list_every_check_and_signature():
    from orbitctl.doctor import check_ids
    from orbitctl.doctor.signatures import SIGNATURES

    text = (Path(__file__).parents[2] / "docs" / "doctor.md").read_text()
    missing = [i for i in check_ids() + [s.id for s in SIGNATURES] if f"`{i}`" not in text]
    assert missing == []


def test_huge_log_keeps_its_end(tmp_path, monkeypatch):
    monkeypatch.setattr(api, "MAX_LOG_BYTES", 4096)
    log = tmp_path / "big.log"
    log.write_text("step ok\n" * 5000 + "RuntimeError: Error 802: system not yet initialized\n")
    text = api.read_log(str(log))
    assert len(text) <= 4096 + 1 and text.startswith("step ok") and "system not yet initialized" in text


def test_no_machine_with_a_machine_flag_is_refused(tmp_path, capsys):
    log = tmp_path / "run.log"
    log.write_text("RuntimeError: CUDA out of memory.\n")
    for flag in (["--expect-gpus", "8"], ["--active"], ["--snapshot", str(tmp_path / "s.json")]):
        assert main(["doctor", "--log", str(log), "--no-machine", *flag]) == 2, flag
        assert flag[0] in capsys.readouterr().err, flag
    assert main(["doctor", "--set", "memory.seq_len=8"]) == 2
    assert "PROFILE" in capsys.readouterr().err
