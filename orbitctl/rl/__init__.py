"""`orbitctl train`: GRPO/PPO with adapters on the frozen quantized base.

    from orbitctl.rl import api
    result = api.train(load_profile("profiles/tiny-cpu.yaml"))

``rewards``/``sandbox`` (rewards, code run in a subprocess sandbox), ``rollout``, ``envs`` and
``multiturn`` (environments, ``data.train: env:NAME``, and episodes of several turns), ``losses``,
``update``, ``engine`` (DeepSpeed), ``checkpoint``, ``runlog`` (metrics.jsonl and health
warnings), ``trainer`` (the loop), ``api`` (the entry point).
"""
