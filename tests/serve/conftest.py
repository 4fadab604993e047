"""One server for the whole directory: the demo profile's engine on a free loopback port, on a thread."""

from pathlib import Path

import pytest

DEMO = Path(__file__).resolve().parents[2] / "profiles" / "tiny-cpu.yaml"


@pytest.fixture(scope="session")
def engine(model_cache):
    """The demo profile's serving engine (its base built into the session cache)."""
    from orbitctl.profile import load_profile
    from orbitctl.serve.api import build_engine

    return build_engine(load_profile(DEMO))


@pytest.fixture(scope="session")
def server(engine, tmp_path_factory):
    """The running server, keyless on loopback, loading adapters at run time from under the session's temporary
    directory (where every test's ``tmp_path`` lies); ``server.url`` ends in /v1."""
    from orbitctl.serve.api import Access, start_background
    from orbitctl.serve.security import AdapterFence

    running = start_background(engine, access=Access(fence=AdapterFence(True, tmp_path_factory.getbasetemp())))
    yield running
    running.stop()


@pytest.fixture(scope="session")
def client(server):
    """The real ``openai`` client pointed at the server."""
    import openai

    return openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=60)


@pytest.fixture
def perturbed_adapter(engine):
    """``perturbed_adapter(directory, scale)``: the live adapter saved with every factor moved by ``scale`` times
    a fixed normal draw, then the live one put back; returns the directory."""
    import torch

    from orbitctl.model.adapters import save_adapter

    def make(directory, scale):
        with engine._lock, torch.no_grad():
            saved = {n: p.detach().clone() for n, p in engine.policy.named_trainable()}
            g = torch.Generator().manual_seed(int(scale * 1000))
            for _, p in engine.policy.named_trainable():
                p.add_(scale * torch.randn(p.shape, generator=g).to(p.dtype))
            save_adapter(engine.policy.model, directory, "lora", engine.policy.hidden_size)
            for n, p in engine.policy.named_trainable():
                p.copy_(saved[n])
        return str(directory)

    return make
