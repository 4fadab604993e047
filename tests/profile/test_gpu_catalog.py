"""The GPU catalog (orbitctl/profile/gpus.py): the cards people rent, their datasheet figures, names that never
change the memory, and the refusal of a card it lacks, naming the keys that describe one."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from orbitctl.profile.gpus import GPUS, match_gpu_name, resolve_gpu
from orbitctl.units import GiB, MiB

ROOT = Path(__file__).resolve().parents[2]

# key: (memory GB as sold, HBM/GDDR GB/s, dense BF16 TFLOPS, peer GB/s both ways), from the datasheets cited in gpus.py
DATASHEETS = {
    "a100-40g": (40, 1555, 312, 600),
    "a100-80g": (80, 2039, 312, 600),
    "h100-80g": (80, 3350, 989, 900),
    "h100-pcie": (80, 2000, 756, 128),
    "h100-nvl": (94, 3900, 835, 128),
    "h800": (80, 3350, 989, 400),
    "h20": (96, 4000, 148, 900),
    "h200": (141, 4800, 989, 900),
    "b200": (180, 8000, 2250, 1800),
    "l4": (24, 300, 121, 64),
    "l40s": (48, 864, 362, 64),
    "a10g": (24, 600, 70, 64),
    "rtx6000-ada": (48, 960, 364, 64),
    "rtx4090": (24, 1008, 165, 32),
}


@pytest.mark.parametrize("key", sorted(DATASHEETS))
def test_the_rented_cards_are_in_the_catalog_with_their_datasheet_figures(key):
    sold_gb, bandwidth, tflops, peer = DATASHEETS[key]
    spec = GPUS[key]
    assert (spec.hbm_bandwidth_gbs, spec.bf16_tflops, spec.p2p_bandwidth_gbs) == (bandwidth, tflops, peer)
    # what the driver exposes: a little under the memory as sold (GB, or the GiB the smaller cards are sold in)
    assert 0.9 * sold_gb * 1e9 <= spec.visible_bytes <= sold_gb * GiB


def test_every_entry_cites_its_source():
    source = (ROOT / "orbitctl" / "profile" / "gpus.py").read_text()
    for key, spec in GPUS.items():
        if key == "cpu":
            continue
        above = source[:source.index(f'GpuSpec("{key}"')].splitlines()[:-1]
        comment = []
        while above and above[-1].strip().startswith("#"):  # the comment lines right above the entry
            comment.insert(0, above.pop())
        assert re.search(r"datasheet|data sheet|whitepaper|product brief|AWS", " ".join(comment)), key


@pytest.mark.parametrize("name, key", [
    ("h100", "h100-80g"), ("H100-SXM", "h100-80g"), ("h100-pcie", "h100-pcie"), ("h100-nvl", "h100-nvl"),
    ("a100-40gb", "a100-40g"), ("a100-sxm4-80gb", "a100-80g"), ("H800", "h800"), ("h20", "h20"), ("L4", "l4"),
    ("a10g", "a10g"), ("rtx-6000-ada", "rtx6000-ada"), ("4090", "rtx4090"), ("b200-180g", "b200"),
])
def test_aliases_name_the_card(name, key):
    assert resolve_gpu(name).name == key


def test_no_alias_names_a_card_of_other_memory():
    """An alias that states a size names a card of that size; a family name that covers several sizes is none."""
    for spec in GPUS.values():
        for alias in spec.aliases:
            stated = re.search(r"(\d+)g(?:b)?$", alias)
            if stated and not alias.startswith(("rtx", "4090", "3090")):
                assert abs(spec.visible_bytes / 1e9 - int(stated.group(1))) < 0.1 * int(stated.group(1)), alias
    for family in ("a100", "mi300"):  # 40 or 80 GB; MI300X or MI300A
        assert resolve_gpu(family) is None
    # 'h100' is the SXM card, and the PCIe card has the same memory; the NVL's 94 GB is only 'h100-nvl'
    assert resolve_gpu("h100").visible_bytes == GPUS["h100-pcie"].visible_bytes < GPUS["h100-nvl"].visible_bytes


@pytest.mark.parametrize("product, key", [
    ("NVIDIA H100 80GB HBM3", "h100-80g"), ("NVIDIA H100 PCIe", "h100-pcie"), ("NVIDIA H100 NVL", "h100-nvl"),
    ("NVIDIA H800", "h800"), ("NVIDIA H20", "h20"), ("NVIDIA H200", "h200"), ("NVIDIA B200", "b200"),
    ("NVIDIA A100-SXM4-40GB", "a100-40g"), ("NVIDIA A100-SXM4-80GB", "a100-80g"), ("NVIDIA A10G", "a10g"),
    ("NVIDIA L4", "l4"), ("NVIDIA L40S", "l40s"), ("NVIDIA L40", None), ("NVIDIA RTX 6000 Ada Generation", "rtx6000-ada"),
    ("NVIDIA GeForce RTX 4090", "rtx4090"),
])
def test_nvml_product_names_map_to_their_entry(product, key):
    found = match_gpu_name(product)
    assert (found.name if found else None) == key


@pytest.mark.parametrize("name, suggested", [("a100", ("a100-40g", "a100-80g")), ("h2000", ("h200",)),
                                              ("rtx5090", ())])
def test_an_unknown_card_names_the_keys_to_set(name, suggested, tmp_path, one_error_line):
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "orbitctl.cli.app", "plan", str(ROOT / "profiles" / "tiny-cpu.yaml"),
                           "--set", f"hardware.gpu={name}"], capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 2
    one_error_line(done.stderr, f"hardware.gpu: unknown GPU '{name}'", "hardware.gpu_memory_gib", "hardware.gpu to",
                   "known: a100-40g")
    for key in suggested:  # a suggestion shows its memory, so it is not taken for the same card
        assert f"'{key}' ({GPUS[key].visible_bytes / GiB:.1f} GiB)" in done.stderr


def test_gpu_memory_gib_stands_in_for_a_card_the_catalog_lacks():
    from orbitctl.profile import load_profile

    tiny = ROOT / "profiles" / "tiny-cpu.yaml"
    profile = load_profile(tiny, ["hardware.gpu=rtx4090", "hardware.gpu_memory_gib=31.5"])
    assert profile.hardware.memory_bytes() == int(31.5 * GiB)
    assert load_profile(tiny, ["hardware.gpu=l4"]).hardware.memory_bytes() == 23_034 * MiB
