"""The demo model with an INT4 g32 base, a trained-looking LoRA adapter, and its exports, built once per session;
and a llama_cpp that dies of SIGILL, for the crash isolation of the llama.cpp comparison."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

CRASHING_LLAMA_CPP = """\
import os
import signal


class Llama:
    def __init__(self, *args, **kwargs):
        os.kill(os.getpid(), signal.SIGILL)  # what a build for another CPU does on its first kernel
"""

INT4_G32 = {"quant.format": "int4", "quant.group_size": 32}


@pytest.fixture(scope="session")
def int4_profile(model_cache, tmp_path_factory, write_demo_profile) -> Path:
    return write_demo_profile(tmp_path_factory.mktemp("export-profile") / "tiny-int4.yaml", INT4_G32)


@pytest.fixture(scope="session")
def policy(int4_profile):
    """The demo policy (frozen INT4 g32 base + LoRA) with seeded random, non-zero LoRA weights."""
    from orbitctl.builder import load_policy, prepare_frozen_base
    from orbitctl.data.prompts import load_prompts
    from orbitctl.model.adapters import randomize_adapters
    from orbitctl.profile import load_profile

    profile = load_profile(str(int4_profile))
    base = prepare_frozen_base(profile, load_prompts(profile.data, profile.run.seed).warm_task)
    policy = load_policy(profile, base, device="cpu")
    randomize_adapters(policy.model, seed=7, std=0.15)  # B starts at zero: both factors get a trained size
    return policy


@pytest.fixture(scope="session")
def adapter_dir(policy, tmp_path_factory) -> Path:
    from orbitctl.model.adapters import save_adapter

    out = tmp_path_factory.mktemp("export-run") / "adapter"
    save_adapter(policy.model, out, "lora", policy.hidden_size)
    return out


@pytest.fixture(scope="session")
def gguf_export(int4_profile, adapter_dir, tmp_path_factory):
    from orbitctl.export.api import export

    out = tmp_path_factory.mktemp("export-gguf") / "gguf"
    return export(str(int4_profile), str(out), "gguf", adapter=str(adapter_dir))


@pytest.fixture(scope="session")
def merged_export(int4_profile, adapter_dir, tmp_path_factory):
    from orbitctl.export.api import export

    out = tmp_path_factory.mktemp("export-merged") / "merged"
    return export(str(int4_profile), str(out), "hf-merged", adapter=str(adapter_dir))


@pytest.fixture
def crashing_llama_cpp(tmp_path, monkeypatch) -> Path:
    """A ``llama_cpp`` package whose ``Llama()`` dies of SIGILL, first on PYTHONPATH (children inherit it)."""
    root = tmp_path / "crashing"
    (root / "llama_cpp").mkdir(parents=True)
    (root / "llama_cpp" / "__init__.py").write_text(CRASHING_LLAMA_CPP)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH", "")) if p))
    return root
