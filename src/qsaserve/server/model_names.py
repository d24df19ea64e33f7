"""The names a server answers to in `model`: by default the model's own name, as its file or
directory spells it (SmolLM2-135M-Instruct.Q4_1.gguf -> SmolLM2-135M-Instruct), with the path
and, for the default model, `default` accepted too (older clients sent those)."""
from __future__ import annotations

import os
import re

# llama.cpp's shard and quantization suffixes: -00001-of-00003, .Q4_1, -Q4_K_M, .IQ3_XXS, -f16, .BF16
_SHARD = re.compile(r"-\d{5}-of-\d{5}$")
_QUANT = re.compile(r"[.-](?:I?Q\d\w*|F16|F32|BF16)$", re.IGNORECASE)


def own_name(path: str | None, model_arg: str | None) -> str:
    """The model's own name from its checkpoint path (a GGUF file or an HF directory)."""
    if not path:
        return model_arg or "default"
    path = os.path.normpath(path)
    parts = path.split(os.sep)
    # A Hugging Face cache snapshot, .../models--org--name/snapshots/<revision>: org/name.
    if len(parts) >= 3 and parts[-2] == "snapshots" and parts[-3].startswith("models--"):
        return parts[-3][len("models--"):].replace("--", "/")
    base = parts[-1]
    if base.lower().endswith(".gguf"):
        base = _QUANT.sub("", _SHARD.sub("", base[: -len(".gguf")]))
    return base or parts[-1]


def default_names(path: str | None, model_arg: str | None) -> tuple[list[str], set[str]]:
    """(names listed in /v1/models, other names accepted) when --served-model-name is not given."""
    name = own_name(path, model_arg)
    aliases = {a for a in (model_arg, path) if a} | ({"default"} if model_arg is None else set())
    return [name], aliases - {name}
