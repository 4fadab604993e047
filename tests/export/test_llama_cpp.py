"""llama.cpp itself (llama-cpp-python) reads the exported base and LoRA and agrees with orbitctl's train path.

The floor is measured in the same test: llama.cpp's base against orbitctl's base with the adapters off (the
same integers; what differs is llama.cpp's kernels, which quantize activations to 8 bits for Q4_0). With the
adapter loaded unmerged the distance stays within a few times that floor; with it left out it is far above.
"""

from __future__ import annotations

from pathlib import Path



def test_llama_cpp_follows_the_train_path_with_the_adapter(gguf_export, policy, int4_profile):
    from orbitctl.export.compare import held_out_sequences
    from orbitctl.export.llamacpp import llama_cpp_agreement
    from orbitctl.profile import load_profile

    out = Path(gguf_export.output)
    seqs = held_out_sequences(load_profile(str(int4_profile)), policy, 8)
    agreement = llama_cpp_agreement(policy, seqs, out / "model.gguf", out / "adapter.gguf")
    floor, with_adapter, without = agreement["floor"], agreement["with_adapter"], agreement["without_adapter"]
    assert 0 < floor["logsoftmax_l1_mean"], floor  # the kernels differ: a floor of 0 would mean nothing ran
    assert with_adapter["logsoftmax_l1_mean"] <= 4 * floor["logsoftmax_l1_mean"], (with_adapter, floor)
    assert with_adapter["js_max"] <= 4 * floor["js_max"] + 1e-12, (with_adapter, floor)
    assert without["logsoftmax_l1_mean"] > 20 * with_adapter["logsoftmax_l1_mean"], (with_adapter, without)
