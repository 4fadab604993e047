"""An OpenAI-compatible HTTP server over orbitctl's own infer path (``orbitctl serve``).

The server samples with the :class:`~orbitctl.model.policy.Policy` the trainer builds: the same
frozen quantized base, adapters unmerged, the same KV-cache decode and keyed draws. A client
that trains against it over HTTP therefore sees the log-probs the trainer's rollouts record.
See docs/serve.md.
"""
