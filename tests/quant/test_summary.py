"""The one-line summary the train command prints about its frozen base comes from quant_report.json."""

import json

from orbitctl.quant.report import quant_summary


def test_summary_reads_format_bits_and_error_from_the_report(quantized, tmp_path):
    out = quantized("llama", "nf4")
    report = json.loads((out / "quant_report.json").read_text())
    line = quant_summary(out)
    assert line.startswith("nf4: ")
    assert f"{report['quantized_params']:,} weights quantized" in line
    assert f"{report['bits_per_weight_quantized']:.2f} bits/weight" in line
    error = float(line.split("relative error ")[1].split()[0])
    assert 0.01 < error < 0.2  # NF4 on random weights: about 0.09
    assert quant_summary(tmp_path) is None
