"""Fixtures shared by all test packages."""

import pytest


@pytest.fixture(scope="session")
def smollm2_gguf_path() -> str:
    """Path of the default GGUF (SmolLM2-135M-Instruct Q4_1), fetched into the cache on first use."""
    from qsaserve.loader import resolve_model

    return resolve_model(None, progress=False)
