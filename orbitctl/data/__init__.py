"""Prompts and tasks: data files as datasets ship them, the builtin tasks, the seeded per-rank prompt stream.

``tasks`` (builtin tasks with their items, held-out rule and scorer), ``containers`` (records from
JSON Lines, JSON, Parquet and Arrow files), ``formats`` (GSM8K, MATH, HumanEval, chat and
prompt/answer layouts, detected or named), ``prompts`` (the train/eval split,
:class:`~orbitctl.data.prompts.PromptStream`).
Used by the trainer, verify-alignment and the builder (the warm-start task of a demo base).
"""
