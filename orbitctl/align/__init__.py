"""`orbitctl verify-alignment`: does the training path still agree with the inference path?

    from orbitctl.align import api
    report = api.verify_alignment(load_profile("profiles/tiny-cpu.yaml"))

``metrics``/``tokens`` (per-token metrics into a TokenTable), ``floor`` (the kernel floor and its
one-ulp dtype bound), the sources ``selfcheck`` (the profile's own infer path against its train
path), ``rollouts`` (an engine's logprobs), ``dumps`` (two logit dumps), ``trends`` (a run's
metrics.jsonl), ``verdict`` (gates), ``plot`` (the PNG) and ``api`` (the entry point).
"""
