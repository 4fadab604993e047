"""CUDA's device bookkeeping on a CPU-only PyTorch, for the rehearsal: load before torch.

    from orbitctl.dist import fake_cuda
    fake_cuda.load()          # builds orbitctl/dist/csrc/fake_cuda.cpp into the cache once; raises if torch is in
    import torch

A CPU-only build of PyTorch has no CUDA device guard and no CUDA hooks, so a fake ``cuda`` tensor cannot be
indexed, made contiguous or differentiated ("PyTorch is not linked with support for cuda devices", "Cannot access
accelerator device when none is available"). The library registers both, answering as one CUDA device of eight
and touching no device; ATen reads its hooks once, at first use, so the library must be loaded before torch is
imported: the rehearsal runs in a process of its own (``python -m orbitctl.launch.rehearse``). A CUDA build of torch
has both already, and :func:`load` refuses it.
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

SOURCE = Path(__file__).parent / "csrc" / "fake_cuda.cpp"


def _torch_dir() -> Path:
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("torch is not installed")
    return Path(next(iter(spec.submodule_search_locations)))


def _library_path(compiler: str, torch_dir: Path) -> Path:
    from orbitctl.rundir import cache_root

    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=False).stdout
    stamp = (torch_dir / "version.py").read_bytes() if (torch_dir / "version.py").exists() else b""
    digest = hashlib.sha256(SOURCE.read_bytes() + version.encode() + stamp + str(torch_dir).encode()).hexdigest()[:16]
    return cache_root() / "kernels" / f"fake_cuda-{digest}.so"


def build() -> Path:
    """Compile the library against the installed torch's headers (once per source, compiler and torch)."""
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise RuntimeError("no C++ compiler (g++) on PATH; set CXX")
    torch_dir = _torch_dir()
    path = _library_path(compiler, torch_dir)
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    lib = torch_dir / "lib"
    cmd = [compiler, "-O1", "-std=c++17", "-shared", "-fPIC", f"-I{torch_dir / 'include'}", str(SOURCE), "-o", str(tmp),
           f"-L{lib}", "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{lib}"]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"{' '.join(cmd[:2])} ... failed: {done.stderr.strip()[-400:]}")
    os.replace(tmp, path)
    return path


def load() -> int:
    """Load the library into this process, before torch; returns its state (3: guard and hooks in place)."""
    if "torch" in sys.modules:
        raise RuntimeError("the fake CUDA must be loaded before torch is imported (ATen reads its CUDA hooks once)")
    if any((_torch_dir() / "lib").glob("libtorch_cuda*")):  # its own hooks and guard: ours would clash with them
        raise RuntimeError("this torch is a CUDA build: the rehearsal runs on a CPU-only torch (a GPU runs the real "
                           "paths: benchmarks/device_check.py)")
    lib = ctypes.CDLL(str(build()), mode=ctypes.RTLD_GLOBAL)
    return int(lib.orbitctl_fake_cuda_state())
