"""llama.cpp itself (llama-cpp-python) reads the exported base and LoRA and agrees with orbitctl's train path.

The floor is measured in the same test: llama.cpp's base against orbitctl's base with the adapters off (the
same integers; what differs is llama.cpp's kernels, which quantize activations to 8 bits for Q4_0). With the
adapter loaded unmerged the distance stays within a few times that floor; with it left out it is far above.

llama.cpp runs in a child process (orbitctl.isolated): a llama.cpp that dies (SIGILL from a build for
another CPU, issue 42) fails the one test that ran it, with the signal and its cause, and the session goes on;
the last two tests prove it with a llama_cpp that dies of SIGILL (tests/export/conftest.py).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from orbitctl.isolated import NativeCrash

ROOT = Path(__file__).resolve().parents[2]
# the parent never imports llama_cpp (importing it loads llama.cpp's libraries): find_spec only looks for it
requires_llama_cpp = pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None,
                                        reason="llama-cpp-python is not installed (`make setup` builds it)")
SIGILL_LINE = "llama.cpp died with SIGILL (illegal instruction): a native build for another CPU"


@requires_llama_cpp
def test_llama_cpp_follows_the_train_path_with_the_adapter(gguf_export, policy, int4_profile):
    from orbitctl.export.compare import held_out_sequences
    from orbitctl.export.llamacpp import llama_cpp_agreement
    from orbitctl.profile import load_profile

    out = Path(gguf_export.output)
    seqs = held_out_sequences(load_profile(str(int4_profile)), policy, 8)
    agreement = llama_cpp_agreement(policy, seqs, out / "model.gguf", out / "adapter.gguf")
    floor, with_adapter, without = agreement["floor"], agreement["with_adapter"], agreement["without_adapter"]
    assert 0 < floor["logsoftmax_l1_mean"], floor  # the kernels differ: a floor of 0 would mean nothing ran
    assert with_adapter["logsoftmax_l1_mean"] <= 4 * floor["logsoftmax_l1_mean"], (with_adapter, floor)
    assert with_adapter["js_max"] <= 4 * floor["js_max"] + 1e-12, (with_adapter, floor)
    assert without["logsoftmax_l1_mean"] > 20 * with_adapter["logsoftmax_l1_mean"], (with_adapter, without)


def test_a_crashing_llama_cpp_fails_the_call_not_the_process(crashing_llama_cpp, tmp_path):
    from orbitctl.export.llamacpp import llama_cpp_logits

    with pytest.raises(NativeCrash) as info:
        llama_cpp_logits(tmp_path / "model.gguf", [[1, 2, 3]])
    assert info.value.signame == "SIGILL" and info.value.render().startswith(SIGILL_LINE), info.value.render()


@pytest.mark.slow
def test_the_check_reports_a_crashing_llama_cpp_in_one_line(crashing_llama_cpp, int4_profile, adapter_dir):
    """benchmarks/llama_cpp_check.py with a llama.cpp that dies: one `Error:` line, exit 2, no traceback.
    On the session's profile and adapter, so that its frozen base comes from the session's ORBITCTL_CACHE."""
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "llama_cpp_check.py"), "--prompts", "2",
                           "--profile", str(int4_profile), "--adapter", str(adapter_dir)],
                          capture_output=True, text=True, timeout=600, cwd=ROOT, env=dict(os.environ))
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2, done.stdout + done.stderr
    assert lines and lines[-1].startswith(f"Error: {SIGILL_LINE}"), done.stderr
    assert "Traceback" not in done.stderr, done.stderr
