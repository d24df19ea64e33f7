"""Model loading: resolve a `model` argument, open GGUF / HF safetensors checkpoints, build tokenizers."""

from .checkpoint import Checkpoint, ModelLoadError
from .resolve import load_checkpoint, resolve_model
from .default_model import DEFAULT_MODEL_NAME

__all__ = ["Checkpoint", "DEFAULT_MODEL_NAME", "ModelLoadError", "load_checkpoint", "resolve_model"]
