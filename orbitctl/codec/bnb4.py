"""bitsandbytes NF4/FP4 quantization on the CPU, bit-identical to ``bitsandbytes.functional.quantize_4bit``.

bitsandbytes has no native 4-bit quantizer for the CPU; its torch fallback scales each block
by 1/absmax in float32 and finds every value's code with ``torch.bucketize`` against the
midpoints of the code book, over the whole matrix at once. The same arithmetic done in cache-
sized chunks, with the bucket found through a lookup table, gives the same bits several
times faster on one core: [-1, 1] is cut into 2^16 equal cells, each cell stores how many
midpoints lie below it and the one midpoint inside it (if any), and a value's bucket is
``below[cell] + (value > inside[cell])`` -- one exact comparison, so the result is the same as
counting the midpoints below the value, which is what ``torch.bucketize`` computes. The absmax
double quantization and the ``QuantState`` come from bitsandbytes itself. Anything unusual (CUDA tensors, a matrix that is not a whole number of
blocks) goes straight to bitsandbytes.
"""

from __future__ import annotations

import threading
from functools import lru_cache

import torch

# Elements per chunk: the float32 working set stays in L2. With intra-op threads on, chunks stay
# at torch's parallel grain size so each op runs on the calling thread (larger ones hand every
# small op to the OpenMP pool, which costs more than it saves on a busy two-core machine); the
# converter runs with one intra-op thread per worker and larger chunks, so its two workers make
# fewer, longer calls and rarely wait on each other (every chunk buffer is preallocated).
CHUNK = 1 << 15
CHUNK_SINGLE_THREAD = 1 << 19


@lru_cache(maxsize=4)
def _codebook(quant_type: str) -> tuple[list[float], torch.Tensor | None, torch.Tensor]:
    import bitsandbytes.functional as bnbf

    code = bnbf.get_4bit_type(quant_type, device="cpu")
    order = torch.argsort(code)
    midpoints = (code[order[:-1]] + code[order[1:]]) / 2
    # nf4's code book is sorted, fp4's is not: bucket index -> code index
    remap = None if torch.equal(order, torch.arange(16)) else order.to(torch.uint8)
    return midpoints.tolist(), remap, code


CELLS_PER_UNIT = 1 << 15
"""Cells per unit of the scaled value: [-1, 1] is 2^16 cells, far finer than the code books' midpoints."""


def _cell(scaled: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Cell index trunc((x + 1) * 2^15): monotone in x (a rounded add, then an exact power-of-two scale)."""
    torch.add(scaled, 1.0, out=out)
    out.mul_(CELLS_PER_UNIT)
    return out


@lru_cache(maxsize=4)
def _bucket_table(quant_type: str) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(below [cells] uint8, inside [cells] float32) or None when two midpoints share a cell."""
    midpoints, _, _ = _codebook(quant_type)
    mids = torch.tensor(midpoints, dtype=torch.float32)
    cells = 2 * CELLS_PER_UNIT + 1
    cell_of_mid = _cell(mids, torch.empty_like(mids)).to(torch.int64)
    if len(set(cell_of_mid.tolist())) != len(midpoints):
        return None
    # f monotone: a midpoint in a lower cell is below every value of this cell, one in a higher cell above
    below = torch.zeros(cells, dtype=torch.int64)
    below.scatter_add_(0, (cell_of_mid + 1).clamp(max=cells - 1), torch.ones_like(cell_of_mid))
    below = below.cumsum(0).to(torch.uint8)
    inside = torch.full((cells,), float("inf"), dtype=torch.float32)
    inside[cell_of_mid] = mids
    return below, inside


def _codes(scaled: torch.Tensor, midpoints: list[float], mask: torch.Tensor, out: torch.Tensor,
           table: tuple[torch.Tensor, torch.Tensor] | None = None, work: torch.Tensor | None = None,
           cell: torch.Tensor | None = None) -> None:
    """out = number of midpoints strictly below each value (torch.bucketize with right=False).

    With the table, ``work`` (float32) and ``cell`` (int32) are scratch of the same length: every
    temporary is preallocated, so large chunks neither fault in fresh pages nor allocate.
    """
    if table is not None and work is not None and cell is not None:
        below, inside = table
        cell.copy_(_cell(scaled, work))  # float -> int32 truncates; index_select takes int32 indices
        cell.clamp_(0, 2 * CELLS_PER_UNIT)  # a NaN weight gets code 0, as counting midpoints gives it
        torch.index_select(below, 0, cell, out=out)
        torch.gt(scaled, torch.index_select(inside, 0, cell, out=work), out=mask)
        out.add_(mask.view(torch.uint8))
        return
    torch.gt(scaled, midpoints[0], out=mask)
    out.copy_(mask.view(torch.uint8))
    for m in midpoints[1:]:
        torch.gt(scaled, m, out=mask)
        out.add_(mask.view(torch.uint8))


_thread_buffers = threading.local()


def _chunk_buffers(n: int) -> tuple[torch.Tensor, ...]:
    """This thread's scratch for one chunk (mask, codes, scaled, work, cell, high nibbles), kept
    between calls: fresh buffers would be faulted in page by page for every weight."""
    cached = getattr(_thread_buffers, "chunk", None)
    if cached is None or cached[0].numel() != n:
        cached = _thread_buffers.chunk = (
            torch.empty(n, dtype=torch.bool), torch.empty(n, dtype=torch.uint8), torch.empty(n, dtype=torch.float32),
            torch.empty(n, dtype=torch.float32), torch.empty(n, dtype=torch.int32), torch.empty(n // 2, dtype=torch.uint8))
    return cached


def _block_absmax(blocks: torch.Tensor) -> torch.Tensor:
    """max |x| of every block, float32; |x| and max are exact in the input dtype. In slices, so the
    |x| temporary is small and reused rather than a second whole-matrix buffer."""
    absmax = torch.empty(blocks.shape[0], dtype=blocks.dtype)
    rows = max(1, CHUNK_SINGLE_THREAD // blocks.shape[1])
    magnitude = torch.empty(rows, blocks.shape[1], dtype=blocks.dtype)
    for r in range(0, blocks.shape[0], rows):
        chunk = blocks[r:r + rows]
        m = magnitude[:chunk.shape[0]]
        torch.abs(chunk, out=m)
        torch.amax(m, dim=-1, out=absmax[r:r + rows])
    return absmax.float()


def quantize_4bit_packed(weight: torch.Tensor, blocksize: int, quant_type: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed uint8 codes [n/2] (first value in the high nibble) and float32 absmax [n/blocksize]."""
    midpoints, remap, _ = _codebook(quant_type)
    table = _bucket_table(quant_type)
    flat = weight.reshape(-1)
    n = flat.numel()
    blocks = flat.view(-1, blocksize)
    absmax = _block_absmax(blocks)
    inv = 1.0 / absmax.clamp(min=1e-38)
    packed = torch.empty(n // 2, dtype=torch.uint8)
    rows = max(1, (CHUNK_SINGLE_THREAD if torch.get_num_threads() == 1 else CHUNK) // blocksize)
    mask, codes, scaled, work, cell, high = _chunk_buffers(rows * blocksize)
    for r in range(0, blocks.shape[0], rows):
        chunk = blocks[r:r + rows]
        k = chunk.numel()
        s = scaled[:k].view(chunk.shape)
        s.copy_(chunk)  # exact; a mixed-dtype mul would cast the chunk into a fresh temporary
        s.mul_(inv[r:r + rows, None])
        s.clamp_(-1, 1)
        c = codes[:k]
        _codes(scaled[:k], midpoints, mask[:k], c, table, work[:k], cell[:k])
        if remap is not None:
            c = remap[c.long()]
        start = r * blocksize // 2
        h = torch.bitwise_left_shift(c[0::2], 4, out=high[:k // 2])
        torch.bitwise_or(h, c[1::2], out=packed[start:start + k // 2])
    return packed, absmax


def quantize_4bit(weight: torch.Tensor, *, blocksize: int, quant_type: str, double_quant: bool,
                  quant_storage: torch.dtype):
    """(packed, QuantState) exactly as ``bitsandbytes.functional.quantize_4bit`` returns them."""
    import bitsandbytes.functional as bnbf

    n = weight.numel()
    if weight.device.type != "cpu" or n % blocksize or n % 2 or weight.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return bnbf.quantize_4bit(weight, blocksize=blocksize, compress_statistics=double_quant,
                                  quant_type=quant_type, quant_storage=quant_storage)
    packed, absmax = quantize_4bit_packed(weight.contiguous(), blocksize, quant_type)
    packed = packed.view(quant_storage).unsqueeze(1) if quant_storage != torch.uint8 else packed.unsqueeze(1)
    _, _, code = _codebook(quant_type)
    common = dict(shape=weight.shape, dtype=weight.dtype, blocksize=blocksize, code=code, quant_type=quant_type)
    if not double_quant:
        return packed, bnbf.QuantState(absmax=absmax, **common)
    offset = absmax.mean()
    qabsmax, state2 = bnbf.quantize_blockwise(absmax - offset, blocksize=256)
    return packed, bnbf.QuantState(absmax=qabsmax, offset=offset, state2=state2, **common)

