"""Run checkpoints: adapter, optimizer, scheduler, RNG states and data cursor, atomically.

Layout ``runs/NAME/checkpoints/step-N/``::

    engine/            DeepSpeed state: trainable params, fp32 master weights, AdamW moments,
                       lr scheduler (frozen base excluded; it is rebuilt from the profile)
    adapter/           the adapter in its own format (PEFT for LoRA), usable on its own
    rng-rank{R}.safetensors
                       each rank's torch and sampler RNG states (uint8 tensors ``torch`` and
                       ``sampler``) and, in the metadata key ``python``, Python's
                       ``random.getstate()`` as JSON ``[version, [625 ints], gauss_next]``
    trainer.json       step, data cursor, non-finite streak, first evaluation; the adapter and
                       compute dtypes and torch thread count the run had: a resume whose ``auto``
                       dtypes resolve differently is refused, and it runs on the recorded thread
                       count (some CPU kernels round by it)
    COMPLETE           written last: a directory without it is ignored

Every rank writes into ``.tmp-step-N``; rank 0 renames it to ``step-N`` after a barrier
and deletes all but the newest ``run.keep_last``. A run killed mid-save leaves only a
``.tmp-`` directory, which the next start removes.

Resuming never runs code from the run directory: the RNG file is safetensors and JSON, and
every DeepSpeed ``.pt`` file under ``engine/`` must load with ``torch.load(weights_only=True)``
with only DeepSpeed's own state classes allowed (:data:`DEEPSPEED_SAFE_GLOBALS`) before
DeepSpeed, which unpickles with ``weights_only=False``, gets the directory. A file that needs
anything else stops the run with :class:`~orbitctl.errors.InputFileError`. Checkpoints of older
versions (``rng-rank{R}.pt``) still resume; that file is read with ``weights_only=True`` too.
"""

from __future__ import annotations

import json
import pickle
import random
import shutil
import zipfile
from pathlib import Path

from orbitctl.errors import InputFileError, UserError
from orbitctl.rundir import RunDir, atomic_write_json, fsync_tree, promote_dir
from orbitctl.units import short_dtype

DEEPSPEED_SAFE_GLOBALS = (
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.utils.tensor_fragment.fragment_address",
    "deepspeed.runtime.zero.config.ZeroStageEnum",
)
"""What DeepSpeed's engine files pickle besides tensors and containers, found by listing the
globals of checkpoints this trainer wrote (ZeRO 0, 1, 2 and 3); plain data classes and an
enum, so the weights-only unpickler can build them and still nothing else."""

_FIX = "delete that checkpoint directory to resume from an older one, or rerun with --fresh"


def rng_file(path: Path, rank: int) -> Path:
    return Path(path) / f"rng-rank{rank}.safetensors"


def save_rng(file: Path, generator) -> None:
    """This rank's torch, sampler and Python RNG states: tensors and JSON, no pickle."""
    import torch
    from safetensors.torch import save_file

    version, internal, gauss_next = random.getstate()
    python = json.dumps([version, list(internal), gauss_next])
    save_file({"torch": torch.get_rng_state(), "sampler": generator.get_state()}, str(file),
              metadata={"format": "orbitctl-rng", "version": "1", "python": python})


def read_rng(path: Path, rank: int):
    """The RNG states :func:`save_rng` wrote for ``rank``, checked; a file that does not hold them is an
    InputFileError. Pass the result to :func:`restore_rng`."""
    import torch

    file = rng_file(path, rank)
    legacy = Path(path) / f"rng-rank{rank}.pt"
    if not file.exists() and legacy.exists():
        file, (torch_state, sampler_state, python) = legacy, _read_legacy_rng(legacy)
    else:
        torch_state, sampler_state, python = _read_rng(file)
    try:
        for name, tensor in (("torch", torch_state), ("sampler", sampler_state)):
            if not isinstance(tensor, torch.Tensor) or tensor.dtype != torch.uint8 or tensor.dim() != 1:
                raise ValueError(f"'{name}' is not a 1-D uint8 tensor")
        version, internal, gauss_next = python
        python = (int(version), tuple(int(x) for x in internal), None if gauss_next is None else float(gauss_next))
        random.Random().setstate(python)  # the same checks random.setstate makes, on a throwaway generator
    except (ValueError, TypeError, OverflowError) as exc:
        raise InputFileError(f"{file}: not an RNG state ({_first_line(exc)})", fix=_FIX) from None
    return file, torch_state, sampler_state, python


def restore_rng(state, generator) -> None:
    import torch

    file, torch_state, sampler_state, python = state
    try:
        torch.set_rng_state(torch_state)
        generator.set_state(sampler_state)
    except RuntimeError as exc:  # a tensor of the wrong size for this torch
        raise InputFileError(f"{file}: not an RNG state of this torch ({_first_line(exc)})", fix=_FIX) from None
    random.setstate(python)


def _read_rng(file: Path):
    from safetensors import SafetensorError, safe_open

    if not file.exists():
        raise InputFileError(f"{file}: missing; the checkpoint is incomplete", fix=_FIX)
    try:
        with safe_open(str(file), framework="pt") as handle:
            metadata = handle.metadata() or {}
            tensors = {key: handle.get_tensor(key) for key in handle.keys()}
        return tensors["torch"], tensors["sampler"], json.loads(metadata["python"])
    except (SafetensorError, OSError, ValueError, KeyError) as exc:
        raise InputFileError(f"{file}: not an RNG state file ({_first_line(exc)})", fix=_FIX) from None


def _read_legacy_rng(file: Path):
    import torch

    try:
        state = torch.load(file, weights_only=True, map_location="cpu")
        return state["torch"], state["sampler"], state["python"]
    except pickle.UnpicklingError:
        raise InputFileError(f"{file}: refusing to unpickle it: it holds more than RNG tensors and numbers",
                             fix=_FIX) from None
    except (OSError, RuntimeError, ValueError, EOFError, KeyError, TypeError) as exc:
        raise InputFileError(f"{file}: not an RNG state file ({_first_line(exc)})", fix=_FIX) from None


def check_engine_files(path: Path) -> None:
    """Refuse a DeepSpeed file under ``path/engine`` that loads only by running code."""
    import importlib

    import torch

    allowed = []
    for dotted in DEEPSPEED_SAFE_GLOBALS:
        module, _, name = dotted.rpartition(".")
        allowed.append(getattr(importlib.import_module(module), name))
    files = sorted((Path(path) / "engine").rglob("*.pt"))
    if not files:
        raise InputFileError(f"{Path(path) / 'engine'}: no DeepSpeed state in it; the checkpoint is incomplete",
                             fix=_FIX)
    with torch.serialization.safe_globals(allowed):
        for file in files:
            try:
                torch.load(file, weights_only=True, map_location="cpu", mmap=zipfile.is_zipfile(file))
            except pickle.UnpicklingError:
                needs = ", ".join(_unsafe_globals(file)) or "objects no DeepSpeed checkpoint holds"
                raise InputFileError(f"{file}: refusing to unpickle it: it needs {needs}", fix=_FIX) from None
            except (OSError, RuntimeError, ValueError, EOFError) as exc:
                raise InputFileError(f"{file}: not a readable DeepSpeed file ({_first_line(exc)})", fix=_FIX) from None


def _unsafe_globals(file: Path) -> list[str]:
    """The globals a torch file names outside the weights-only set (read from the pickle, nothing run)."""
    import torch

    try:
        found = torch.serialization.get_unsafe_globals_in_checkpoint(file)
    except Exception:  # not a zip-format torch file: nothing to list
        return []
    return [name for name in found if name not in DEEPSPEED_SAFE_GLOBALS]


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:200] if text else type(exc).__name__


def save_checkpoint(run_dir: Path, step: int, engine, policy, generator, trainer_state: dict,
                    rank: int, keep_last: int) -> Path:
    """Collective: every rank calls it. Returns the final checkpoint path."""
    import torch

    from orbitctl.dist.collectives import barrier
    from orbitctl.model.adapters import adapter_gathered, save_adapter

    run = RunDir(run_dir)
    tmp, final = run.partial_checkpoint(step), run.checkpoint(step)
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier()
    engine.save_checkpoint(str(tmp), tag="engine", client_state={"step": step}, save_latest=False,
                           exclude_frozen_parameters=True)
    save_rng(rng_file(tmp, rank), generator)
    with adapter_gathered(policy.model):
        if rank == 0:
            save_adapter(policy.model, tmp / RunDir.ADAPTER, policy.adapter_kind, policy.hidden_size)
    if rank == 0:
        recorded = {**trainer_state, **run_dtypes(engine), "torch_threads": torch.get_num_threads()}
        atomic_write_json(tmp / RunDir.TRAINER_STATE, recorded, fsync=False)
    barrier()
    if rank == 0:
        fsync_tree(tmp)
        (tmp / RunDir.COMPLETE).write_text(f"{step}\n")
        promote_dir(tmp, final)
        for _, old in run.complete_checkpoints()[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    barrier()
    return final


def run_dtypes(engine) -> dict:
    """The adapter's dtype and the base's compute dtype (its input embeddings), as profile names."""
    module = engine.module
    adapter = next((p.dtype for p in module.parameters() if p.requires_grad), None)
    compute = module.get_input_embeddings().weight.dtype
    return {"adapter_dtype": short_dtype(adapter), "compute_dtype": short_dtype(compute)}


def load_checkpoint(path: Path, engine, generator, rank: int) -> dict:
    """Restore engine, RNG and trainer state from a complete checkpoint; return trainer state.

    Every file is checked before DeepSpeed unpickles anything; a bad one is an InputFileError."""
    path = Path(path)
    trainer_file = path / RunDir.TRAINER_STATE
    try:
        state = json.loads(trainer_file.read_text())
        if not isinstance(state, dict) or not isinstance(state.get("step"), int) or not isinstance(state.get("cursor"), int):
            raise ValueError("needs integer 'step' and 'cursor'")
    except (OSError, ValueError) as exc:
        raise InputFileError(f"{trainer_file}: not a trainer state ({_first_line(exc)})", fix=_FIX) from None
    here = run_dtypes(engine)
    changed = [(name, state[key], here[key]) for key, name in (("adapter_dtype", "adapter.dtype"),
                                                               ("compute_dtype", "quant.compute_dtype"))
               if state.get(key, here[key]) != here[key]]
    if changed:
        was = " and ".join(f"{name} {saved}" for name, saved, _ in changed)
        now = " and ".join(f"{name} {now}" for name, _, now in changed)
        pin = ", ".join(f"{name}: {saved}" for name, saved, _ in changed)
        raise UserError(f"{trainer_file}: this run trained with {was}; here the profile resolves to {now}",
                        fix=f"set {pin} to resume it here (auto follows the CPU and ATEN_CPU_CAPABILITY / "
                            f"ONEDNN_MAX_CPU_ISA), or rerun with --fresh")
    rng = read_rng(path, rank)
    check_engine_files(path)
    try:
        loaded, _ = engine.load_checkpoint(str(path), tag="engine", load_module_strict=False,
                                           load_optimizer_states=True, load_lr_scheduler_states=True)
    except FileNotFoundError as exc:
        raise InputFileError(f"{exc.filename}: missing; the checkpoint is incomplete", fix=_FIX) from None
    if loaded is None:
        raise InputFileError(f"{path / 'engine'}: DeepSpeed found no model states in it", fix=_FIX)
    restore_rng(rng, generator)
    _continue_on_threads(state.get("torch_threads"))
    return state


def _continue_on_threads(threads) -> None:
    """Run on the thread count the run had: some CPU kernels split their work, and round, by it
    (MKL's fp32 GEMM for a 100-token lm_head: 4 threads and 1 end a few steps later up to 7.5e-9
    apart), so another count is not bit-exact. :func:`orbitctl.rl.api.train` puts the caller's
    count back when it returns."""
    import torch

    if isinstance(threads, int) and threads > 0 and threads != torch.get_num_threads():
        torch.set_num_threads(threads)
