"""`orbitctl profile validate|show` and the fast-path promise: no torch on --help or validation."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from unittest import mock

from typer.testing import CliRunner

from orbitctl.cli.app import app, main

REPO = Path(__file__).resolve().parents[2]
TINY = str(REPO / "profiles" / "tiny-cpu.yaml")


def test_show_json_is_one_document_with_defaults_and_derived(capsys):
    assert main(["profile", "show", TINY, "--json", "--set", "memory.micro_batch_size=2"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["name"] == "tiny-cpu"
    assert doc["memory"]["micro_batch_size"] == 2
    assert doc["alignment"]["js_max"] == 0.05
    derived = doc["derived"]
    assert derived["world_size"] == doc["hardware"]["gpus_per_node"] * doc["hardware"]["nodes"]
    assert derived["global_batch_size"] == 2 * doc["memory"]["gradient_accumulation_steps"] * derived["world_size"]


def test_validate_reports_every_file(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: t\nmodel: {arch: tiny-llama}\nrun: {seed: -1}\n")
    code = main(["profile", "validate", TINY, str(bad), "--json"])
    results = json.loads(capsys.readouterr().out)
    assert code == 2
    assert [r["ok"] for r in results] == [True, False]
    assert results[1]["problems"] == ["run.seed: must be greater than or equal to 0 (got -1)"]


def test_show_passes_path_and_overrides_to_the_library():
    from orbitctl.profile import api

    runner = CliRunner()
    with mock.patch("orbitctl.profile.api.resolved_profile", wraps=api.resolved_profile) as spy:
        result = runner.invoke(app, ["profile", "show", TINY, "--set", "rl.lr=0.001", "--json"])
    assert result.exit_code == 0, result.output
    spy.assert_called_once_with(TINY, ["rl.lr=0.001"])


def _modules_after(code: str) -> set[str]:
    out = subprocess.run([sys.executable, "-c", code + "\nimport sys, json; print(json.dumps(sorted(sys.modules)))"],
                         capture_output=True, text=True, cwd=REPO, check=True).stdout
    return set(json.loads(out.strip().splitlines()[-1]))


def test_help_and_validation_never_import_heavy_libraries():
    heavy = {"torch", "transformers", "deepspeed", "peft", "bitsandbytes", "safetensors"}
    code = (
        "import contextlib, io\n"
        "from orbitctl.cli.app import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    main(['--help'])\n"
        f"    main(['profile', 'validate', {TINY!r}])\n"
    )
    loaded = _modules_after(code)
    assert not heavy & loaded, heavy & loaded
