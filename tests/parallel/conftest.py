"""Fixtures of the multi-process tests."""
import pytest


@pytest.fixture(scope="session")
def smollm2_tokenizer_dir(tmp_path_factory, smollm2_gguf_path):
    from qsaserve.loader import load_checkpoint

    d = tmp_path_factory.mktemp("tok")
    load_checkpoint(smollm2_gguf_path, progress=False).tokenizer.save_pretrained(d)
    return d
