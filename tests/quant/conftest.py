"""Fixtures of the FP8 KV tests."""
import pytest

from fp8_testing import save_tiny_llama


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture(scope="session")
def tiny_identity(tiny_llama):
    from qsaserve.loader.resolve import load_checkpoint

    return load_checkpoint(tiny_llama, progress=False).identity
