"""Sampling defaults from a checkpoint's generation_config.json (vLLM's --generation-config)."""
from __future__ import annotations

import json
import logging
import os

from qsaserve.errors import InvalidRequestError

logger = logging.getLogger("qsaserve")

# generation_config.json keys that set a request's default when the request leaves it unset.
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def sampling_defaults(setting: str, model_path: str | None) -> dict[str, float]:
    """setting: "auto" (the model directory's generation_config.json, if it has one), "vllm"
    (none: vLLM's neutral defaults), or a directory holding a generation_config.json."""
    if setting == "vllm":
        return {}
    if setting == "auto":
        if model_path is None or not os.path.isdir(model_path):
            return {}  # a GGUF file or a preset carries no generation config
        path = os.path.join(model_path, "generation_config.json")
        if not os.path.isfile(path):
            return {}
    else:
        path = os.path.join(os.path.expanduser(setting), "generation_config.json")
        if not os.path.isfile(path):
            raise InvalidRequestError("generation_config", f"must be auto, vllm or a directory with a "
                                                           f"generation_config.json; {path} does not exist")
    try:
        with open(path, encoding="utf-8") as fh:
            config = json.load(fh)
    except (OSError, ValueError) as e:
        raise InvalidRequestError("generation_config", f"cannot read {path}: {e}") from None
    if not isinstance(config, dict):
        raise InvalidRequestError("generation_config", f"{path} is not a JSON object")
    defaults = {}
    for key in SAMPLING_KEYS:
        value = config.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            defaults[key] = int(value) if key == "top_k" else float(value)
    if defaults:
        logger.info("sampling defaults from %s: %s (requests that set a field override it)", path, defaults)
    return defaults
