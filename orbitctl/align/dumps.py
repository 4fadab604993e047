"""Logit dumps from any two engines: safetensors files with ``logits [tokens, vocab]``.

Each file holds a floating tensor ``logits`` of shape ``[tokens, vocab]`` (when there is no tensor of that
name, the file's single 2-D floating tensor is taken) and optionally an integer ``token_ids [tokens]``: the
token at each row, so two dumps can be checked to describe the same sequence. Row i of A and row i of B are
the two engines' logits for the same position. Rows are read in chunks through ``safe_open(...).get_slice``,
so memory holds one chunk, never the whole dump (a 160k vocabulary times thousands of tokens).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from orbitctl.errors import InputFileError

LOGITS = "logits"
TOKEN_IDS = "token_ids"
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2")
INT_DTYPES = ("I64", "I32", "I16", "I8", "U64", "U32", "U16", "U8")
DUMP_FIX = "save with safetensors.torch.save_file({'logits': logits[tokens, vocab], 'token_ids': ids})"


@dataclass
class LogitDump:
    """What one dump holds, read from its header; no tensor data is loaded."""

    path: Path
    n_tokens: int
    vocab: int
    dtype: str              # safetensors dtype name of the logits, e.g. "BF16"
    has_token_ids: bool
    logits_key: str = LOGITS


def open_dump(path) -> LogitDump:
    """Read a dump's header and check its tensors: one 2-D floating logits tensor, optional token_ids."""
    path = Path(path)
    if not path.is_file():
        raise InputFileError(f"{path}: no such logit dump — fix: pass a .safetensors file with "
                             f"{LOGITS} [tokens, vocab]")
    with _open(path) as handle:
        keys = list(handle.keys())
        shapes = {k: list(handle.get_slice(k).get_shape()) for k in keys}
        dtypes = {k: handle.get_slice(k).get_dtype() for k in keys}
    key = _logits_key(path, keys, shapes, dtypes)
    if len(shapes[key]) != 2:
        raise InputFileError(f"{path}: tensor {key} has rank {len(shapes[key])} {shapes[key]}, not [tokens, vocab] "
                             f"— fix: flatten the batch, e.g. logits.reshape(-1, vocab)")
    if dtypes[key] not in FLOAT_DTYPES:
        raise InputFileError(f"{path}: tensor {key} is {dtypes[key]}, not floating point — fix: save the raw logits "
                             f"as float32 or bfloat16")
    n_tokens, vocab = shapes[key]
    has_ids = TOKEN_IDS in keys
    if has_ids and (shapes[TOKEN_IDS] != [n_tokens] or dtypes[TOKEN_IDS] not in INT_DTYPES):
        raise InputFileError(f"{path}: tensor {TOKEN_IDS} is {dtypes[TOKEN_IDS]} {shapes[TOKEN_IDS]}, not an integer "
                             f"[{n_tokens}] — fix: save one token id per logits row (int64)")
    return LogitDump(path, int(n_tokens), int(vocab), dtypes[key], has_ids, key)


def _open(path: Path):
    from safetensors import safe_open

    try:
        return safe_open(str(path), framework="pt")
    except Exception as exc:  # safetensors raises its own error types, or OSError on a torn header
        raise InputFileError(f"{path}: not a safetensors file ({type(exc).__name__}: {str(exc)[:80]}) "
                             f"— fix: {DUMP_FIX}") from None


def _logits_key(path: Path, keys: list[str], shapes: dict, dtypes: dict) -> str:
    if LOGITS in keys:
        return LOGITS
    candidates = [k for k in keys if len(shapes[k]) == 2 and dtypes[k] in FLOAT_DTYPES]
    if len(candidates) == 1:
        return candidates[0]
    what = "no tensor named logits and no 2-D floating tensor" if not candidates else \
        f"no tensor named logits and {len(candidates)} 2-D floating tensors ({', '.join(sorted(candidates)[:4])})"
    raise InputFileError(f"{path}: {what} (tensors: {', '.join(sorted(keys)[:8]) or 'none'}) — fix: name the "
                         f"[tokens, vocab] tensor {LOGITS!r}")


def check_pair(a: LogitDump, b: LogitDump) -> None:
    """Refuse two dumps that do not describe the same tokens over the same vocabulary."""
    if a.n_tokens != b.n_tokens or a.vocab != b.vocab:
        raise InputFileError(f"{b.path}: logits shape [{b.n_tokens}, {b.vocab}] differs from {a.path}'s "
                             f"[{a.n_tokens}, {a.vocab}] — fix: dump the same tokens from both engines and cut any "
                             f"padded vocabulary to the tokenizer's size (logits[:, :vocab])")
    if not (a.has_token_ids and b.has_token_ids):
        return
    ids_a, ids_b = read_token_ids(a), read_token_ids(b)
    differ = (ids_a.long() != ids_b.long()).nonzero()
    if len(differ):
        i = int(differ[0])
        raise InputFileError(f"{b.path}: token_ids differ from {a.path}'s first at row {i} ({int(ids_b[i])} vs "
                             f"{int(ids_a[i])}) — fix: dump both engines on the same prompt and completion tokens")


def read_token_ids(dump: LogitDump):
    """The dump's token_ids as a 1-D torch tensor (small: one integer per row)."""
    with _open(dump.path) as handle:
        return handle.get_tensor(TOKEN_IDS)


def iter_rows(dump: LogitDump, rows_per_chunk: int) -> Iterator[tuple[int, object, object | None]]:
    """(start, logits [n, V] torch tensor in the file's dtype, token_ids [n] or None) chunk by chunk.

    A row holding NaN (or +inf) stops the iteration with the row's index: no metric is defined on it.
    """
    import torch

    if rows_per_chunk < 1:
        raise ValueError("rows_per_chunk must be >= 1")
    ids = read_token_ids(dump) if dump.has_token_ids else None
    with _open(dump.path) as handle:
        logits = handle.get_slice(dump.logits_key)
        for start in range(0, dump.n_tokens, rows_per_chunk):
            stop = min(start + rows_per_chunk, dump.n_tokens)
            chunk = logits[start:stop]
            bad = (torch.isnan(chunk) | torch.isposinf(chunk)).any(dim=-1).nonzero()
            if len(bad):
                row = start + int(bad[0])
                raise InputFileError(f"{dump.path}: logits row {row} holds NaN or +inf — fix: the engine produced "
                                     f"non-finite logits there; re-dump (masked tokens may be -inf, never NaN)")
            yield start, chunk, None if ids is None else ids[start:stop]
