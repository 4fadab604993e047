"""The frozen base as one GGUF file for llama.cpp.

Per weight (``orbitctl.export.report`` records why):

- INT4 whose group is a multiple of 32: ``Q4_0`` with the same codes (:mod:`orbitctl.export.q4_0`);
  exact where every group scale is an fp16 number, else converted (the scales rounded to fp16),
  and written dequantized to F32 (exact) where a scale lies beyond fp16's range.
- 1-D tensors (norms, biases): ``F32``, as llama.cpp expects them; bf16/f16 -> f32 is exact.
- other plain 2-D tensors (embeddings, ``lm_head``) and weights of formats llama.cpp has no block
  for (nf4/fp4 codebooks, fp8 blocks): the decoded values as ``F16`` where fp16 holds every one of
  them exactly, else ``F32``; exact either way, but no longer 4-bit for nf4/fp4.

Rows of ``q_proj``/``k_proj`` are reordered for llama (:meth:`orbitctl.export.archs.Namer.row_order`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np
import torch

from orbitctl.errors import UserError
from orbitctl.export import q4_0
from orbitctl.export.archs import Arch, Namer, write_hparams
from orbitctl.export.base import BaseWeight, QuantizedBase
from orbitctl.export.report import CONVERTED, EXACT, TensorRecord
from orbitctl.export.vocab import Vocab

Progress = Callable[[str, int, int], None]


def write_base_gguf(base: QuantizedBase, arch: Arch, vocab: Vocab, path: Path, *, name: str,
                    progress: Progress | None = None) -> list[TensorRecord]:
    """Write ``path`` (GGUF v3) and return one record per tensor, in file order."""
    import gguf

    q4_0.check_layout()
    namer = Namer(arch, base.config)
    writer = gguf.GGUFWriter(str(path), arch.gguf_arch, use_temp_file=True)
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(name)
    write_hparams(writer, base.config, arch)
    vocab.write(writer)
    records: list[TensorRecord] = []
    names = base.names()
    for done, hf_name in enumerate(names, start=1):
        gguf_name = namer.gguf_name(hf_name)
        if gguf_name is None:
            raise UserError(f"{base.path}: tensor '{hf_name}' has no {arch.gguf_arch} GGUF name",
                            fix="the checkpoint does not have the layout llama.cpp loads for this architecture")
        weight = base.read(hf_name)
        data, record = _encode(weight, gguf_name, namer.row_order(hf_name, weight.shape[0]))
        raw = gguf.GGMLQuantizationType[record.written_as]
        writer.add_tensor(gguf_name, data, raw_dtype=raw if record.written_as in ("Q4_0",) else None)
        records.append(record)
        if progress:
            progress("writing GGUF", done, len(names))
    q4 = sum(r.written_as == "Q4_0" for r in records)
    f16 = sum(r.written_as == "F16" for r in records)
    writer.add_file_type(int(gguf.LlamaFileType.MOSTLY_Q4_0 if q4 else gguf.LlamaFileType.MOSTLY_F16 if f16
                             else gguf.LlamaFileType.ALL_F32))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return records


def _encode(weight: BaseWeight, gguf_name: str, rows) -> tuple[np.ndarray, TensorRecord]:
    """The array to write and its record."""
    def record(written_as: str, status: str, why: str) -> TensorRecord:
        return TensorRecord(gguf_name, weight.name, weight.describe(), written_as, status, why, weight.shape)

    if weight.codes is not None:
        codes, scale = (weight.codes, weight.scale) if rows is None else (weight.codes[rows], weight.scale[rows])
        reason = q4_0.can_pack(weight.shape, weight.group_size)
        if reason is None:
            half, check = q4_0.fp16_scales(scale)
            if check.overflow == 0:
                data, check = q4_0.pack(codes, scale)
                if check.exact:
                    return data, record("Q4_0", EXACT, f"same INT4 codes; every bf16 scale is exact in fp16"
                                                       f"{'' if weight.group_size == 32 else f' (group {weight.group_size}: {weight.group_size // 32} blocks per scale)'}")
                return data, record("Q4_0", CONVERTED, f"same INT4 codes; {check.inexact} of {check.total} bf16 scales "
                                                        f"rounded to fp16 (max relative change {check.max_rel_change:.3g})")
            reason = f"{check.overflow} scales beyond fp16's range"
        dense = BaseWeight(weight.name, weight.stored_as, weight.shape, codes=codes, scale=scale).decoded()
        return dense.numpy(), record("F32", EXACT, f"decoded to F32: {reason}")
    dense = weight.dense if rows is None else weight.dense[rows]
    if dense.dim() == 1:
        return dense.to(torch.float32).numpy(), record("F32", EXACT, "1-D tensor: F32 as llama.cpp expects")
    wide = dense.to(torch.float32)
    half = wide.to(torch.float16)
    lossy = int((half.to(torch.float32) != wide).sum())
    quantized = weight.stored_as in ("nf4", "fp4", "fp8")
    note = f"{weight.stored_as} has no llama.cpp block type; decoded values" if quantized else f"{weight.stored_as} values"
    if lossy == 0:
        return half.numpy(), record("F16", EXACT, f"{note}, every one exact in F16")
    return wide.numpy(), record("F32", EXACT, f"{note} in F32 ({lossy} would round in F16)")
