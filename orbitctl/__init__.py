"""orbitctl: plan, quantize, train, verify and diagnose adapter-first RL post-training."""

__version__ = "0.1.0"
