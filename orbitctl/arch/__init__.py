"""Hugging Face config.json -> ArchSpec: every weight matrix's shape and kind, parameter counts."""
