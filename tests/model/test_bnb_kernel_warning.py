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
