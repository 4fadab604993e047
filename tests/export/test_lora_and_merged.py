"""The adapter as a GGUF LoRA (read back equal to PEFT's), and the merged bf16 checkpoint with its measured cost."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")


def test_the_lora_gguf_holds_the_peft_adapter(gguf_export, adapter_dir, int4_profile):
    from safetensors.torch import load_file

    from orbitctl.export.archs import ARCHS, Namer
    from orbitctl.export.api import source_config
    from orbitctl.profile import load_profile

    reader = gguf.GGUFReader(str(Path(gguf_export.output) / "adapter.gguf"))
    assert reader.fields["general.type"].contents() == "adapter"
    assert reader.fields["adapter.type"].contents() == "lora"
    assert reader.fields["general.architecture"].contents() == "llama"
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    assert reader.fields["adapter.lora.alpha"].contents() == pytest.approx(config["lora_alpha"])
    peft = load_file(str(adapter_dir / "adapter_model.safetensors"))
    namer = Namer(ARCHS["llama"], source_config(load_profile(str(int4_profile)), str(int4_profile))[0])
    by_name = {t.name: t for t in reader.tensors}
    assert len(by_name) == 2 * 14
    for key, a in peft.items():
        if ".lora_A." not in key:
            continue
        module = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
        b = peft[key.replace("lora_A", "lora_B")]
        target = namer.gguf_name(module + ".weight")
        ta, tb = by_name[target + ".lora_a"], by_name[target + ".lora_b"]
        # ggml shapes are reversed numpy shapes: a.ne = [in, rank], b.ne = [rank, out] (llama-adapter.cpp's checks)
        assert [int(v) for v in ta.shape] == [a.shape[1], a.shape[0]] and [int(v) for v in tb.shape] == [b.shape[1], b.shape[0]]
        rows = namer.row_order(module + ".weight", b.shape[0])
        assert torch.equal(torch.from_numpy(np.array(ta.data)).reshape(a.shape), a.float()), target
        assert torch.equal(torch.from_numpy(np.array(tb.data)).reshape(b.shape), (b if rows is None else b[rows]).float()), target
    assert gguf_export.to_dict()["adapter_counts"]["exact"] == 28


def test_the_q_and_k_row_order_is_llama_cpps_permutation():
    """LlamaModel.permute of convert_hf_to_gguf.py: per head, the rows (0, 2, 4, ..., 1, 3, 5, ...) of HF's halves."""
    from orbitctl.export.archs import _permuted_rows

    order = _permuted_rows(8, 2).tolist()  # 2 heads of 4 rows: halves [0,1 | 2,3] interleave to 0,2,1,3
    assert order == [0, 2, 1, 3, 4, 6, 5, 7]


def test_the_merged_checkpoint_loads_and_costs_little(merged_export):
    from transformers import AutoModelForCausalLM

    out = Path(merged_export.output)
    assert {"config.json", "model.safetensors", "tokenizer.json", "export_report.json"} <= {p.name for p in out.iterdir()}
    model = AutoModelForCausalLM.from_pretrained(str(out))
    assert model.config.model_type == "llama" and not hasattr(model.config, "quantization_config")
    assert next(model.parameters()).dtype == torch.bfloat16
    cost = merged_export.merge_cost
    for key in ("max_abs_logit_diff", "logsoftmax_l1_mean", "js_max"):
        assert math.isfinite(cost[key]), key
    # the merged weights are each rounded once to bf16 (whatever the compute dtype) and the merged model
    # computes (W + sBA)x in one matmul where the train path computes Wx + sB(Ax): a few bf16 ulps of the
    # largest logit, no more
    ulp = torch.finfo(torch.bfloat16).eps * cost["logit_absmax"]
    assert cost["max_abs_logit_diff"] <= 16 * ulp, cost
    assert cost["logsoftmax_l1_mean"] <= 2 * 16 * ulp, cost
    assert cost["positions"] > 8 * 5 and cost["compute_dtype"] in ("bfloat16", "float32")
    merged = [r for r in merged_export.tensors if r.status == "converted" and "B A" in r.why]
    assert len(merged) == 14


def test_an_interrupted_export_leaves_no_out(int4_profile, adapter_dir, tmp_path, monkeypatch):
    import orbitctl.export.gguf_lora as gguf_lora
    from orbitctl.export.api import export

    def broken(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(gguf_lora, "write_lora_gguf", broken)
    with pytest.raises(KeyboardInterrupt):
        export(str(int4_profile), str(tmp_path / "out"), "gguf", adapter=str(adapter_dir))
    assert list(tmp_path.iterdir()) == []
