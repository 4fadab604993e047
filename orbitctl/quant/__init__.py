"""`orbitctl quantize`: the streaming conversion job of a Hugging Face checkpoint into a frozen base.

    from orbitctl.quant import api
    result = api.quantize_profile("profiles/tiny-cpu.yaml")

``convert`` (tensor by tensor, shard by shard, resumable), ``outdir`` (the output directory:
plan, side files, index, config, manifest written last), ``manifest`` (run state and
``--verify``), ``report`` (the quality report), ``api`` (the entry point). The formats are
:mod:`orbitctl.codec`; importing this package imports no torch.
"""
