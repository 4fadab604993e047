"""bitsandbytes' "Failed to load CPU gemm_4bit_forward from kernels-community" line is dropped (orbitctl/__init__.py):
the kernel it could not fetch serves only the repacked no-grad path the frozen base turns off. Its other messages pass."""

import logging

import orbitctl  # noqa: F401  (installs the filter)


def test_the_unused_kernel_warning_is_dropped_and_nothing_else(caplog):
    logger = logging.getLogger("bitsandbytes.backends.cpu.ops")
    with caplog.at_level(logging.WARNING):
        logger.warning("Failed to load CPU gemm_4bit_forward from kernels-community: %s. Please make sure you "
                       "already `pip install kernels` and the kernels >= 0.11.1", "offline")
        logger.warning("another bitsandbytes warning")
    messages = [r.getMessage() for r in caplog.records if r.name == logger.name]
    assert messages == ["another bitsandbytes warning"]


def test_the_dropped_line_is_the_one_bitsandbytes_writes():
    """The filter matches the message bitsandbytes' CPU backend really logs (read from its source)."""
    import inspect

    from bitsandbytes.backends.cpu import ops

    assert '"Failed to load CPU gemm_4bit_forward from kernels-community: %s.' in inspect.getsource(ops)


def _peft_wrap_warnings() -> list[str]:
    import warnings

    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from orbitctl.model.tiny import tiny_config

    model = AutoModelForCausalLM.from_config(tiny_config("llama"))
    with warnings.catch_warnings(record=True) as seen:
        get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj"]))
    return [str(w.message) for w in seen if issubclass(w.category, FutureWarning)]


def test_peft_reading_the_deprecated_checkpointing_flag_warns_only_without_the_filter():
    import warnings

    with warnings.catch_warnings():  # pytest restores the filters collection installed: install them again
        orbitctl.quiet_deprecations()
        assert not any("is_gradient_checkpointing" in m for m in _peft_wrap_warnings())
    with warnings.catch_warnings():
        warnings.resetwarnings()  # the filters as if orbitctl had installed none: the warning is real
        warnings.simplefilter("always")
        assert any("is_gradient_checkpointing" in m for m in _peft_wrap_warnings())
