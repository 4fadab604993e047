"""Prompts and tasks: JSONL prompt files, the builtin tasks, the seeded per-rank prompt stream.

``tasks`` (builtin tasks with their items, held-out rule and scorer), ``prompts`` (reading and
checking JSONL files, the train/eval split, :class:`~orbitctl.data.prompts.PromptStream`).
Used by the trainer, verify-alignment and the builder (the warm-start task of a demo base).
"""
