"""GGUF checkpoints: metadata -> HF config, llama.cpp tensor names -> HF names, dequantisation.

The `GGUFReader` memory-maps the file; tensors are dequantised one at a time on iteration.
"""

from __future__ import annotations

import logging
import os
import re
from typing import Any, Iterator

import numpy as np
import torch

from .checkpoint import Checkpoint, ModelLoadError, compute_identity, sample_digest

logger = logging.getLogger("qsaserve")

_SUPPORTED_ARCHS = {
    "llama": ("llama", "LlamaForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
}

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
# Not model parameters in HF form: llama.cpp's precomputed Llama-3 rope frequency factors.
_SKIPPED = {"rope_freqs.weight"}


def _supported_types():
    from gguf import GGMLQuantizationType as T

    return {T.Q4_0, T.Q4_1, T.Q8_0, T.F16, T.BF16, T.F32}


def hf_name(gguf_name: str) -> str | None:
    """HF parameter name for a llama.cpp tensor name (None if unknown)."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _LAYER_RE.match(gguf_name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"
    return None


def unpermute_rotary(t: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation for `llama` models.

    HF keeps each head's rotary pairs as (first half, second half) of the head (rotate_half); llama.cpp's
    converter reorders rows to interleaved pairs (x0, x_{d/2}, x1, x_{d/2+1}, ...) for its RoPE kernel,
    i.e. it views rows as (head, 2, d/2) and swaps the last two. We view as (head, d/2, 2) and swap back.
    Works for weights (rows x in) and biases (rows)."""
    rows = t.shape[0]
    if rows % (2 * n_head):
        raise ModelLoadError(f"model: cannot un-permute rotary rows: {rows} rows for {n_head} heads")
    half = rows // n_head // 2
    return t.reshape(n_head, half, 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape).contiguous()


def _field_value(field) -> Any:
    """A metadata field as Python values (works with old and new `gguf` releases)."""
    from gguf import GGUFValueType as V

    types = list(field.types)
    if not types:
        return None

    def scalar(part, vtype):
        if vtype == V.STRING:
            return bytes(part).decode("utf-8", errors="replace")
        value = part.tolist()
        value = value[0] if isinstance(value, list) and len(value) == 1 else value
        return bool(value) if vtype == V.BOOL else value

    if types[0] == V.ARRAY:
        sub = types[-1]
        if sub == V.ARRAY:  # nested arrays: not used by anything we read
            return None
        if sub == V.STRING:
            return [bytes(field.parts[i]).decode("utf-8", errors="replace") for i in field.data]
        out = []
        for i in field.data:
            out.extend(field.parts[i].tolist())
        return [bool(x) for x in out] if sub == V.BOOL else out
    return scalar(field.parts[field.data[0]], types[0])


class GGUFWeights:
    """Weight source over an open GGUFReader."""

    def __init__(self, path: str, reader, arch: str, n_head: int, n_head_kv: int):
        self.path = path
        self.reader = reader
        self.arch = arch
        self.n_head = n_head
        self.n_head_kv = n_head_kv
        self._entries = []  # (hf name, ReaderTensor)
        for t in reader.tensors:
            if t.name in _SKIPPED:
                continue
            self._entries.append((hf_name(t.name), t))

    def weight_names(self) -> list[str]:
        return [name for name, _ in self._entries]

    def _tensor(self, t) -> torch.Tensor:
        from gguf import GGMLQuantizationType as T
        from gguf.quants import dequantize

        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        try:
            if t.tensor_type in (T.F32, T.F16):
                # np.array copies out of the read-only memmap, which torch needs.
                out = torch.from_numpy(np.array(t.data))
            elif t.tensor_type == T.BF16:
                raw = np.array(t.data, dtype=np.uint8).reshape(-1)
                out = torch.from_numpy(raw).view(torch.bfloat16)
            else:
                out = torch.from_numpy(dequantize(t.data, t.tensor_type))
            return out.reshape(shape)
        except (ValueError, TypeError, IndexError, OSError) as exc:
            raise ModelLoadError(f"model: corrupt GGUF file {self.path}: tensor {t.name}: {exc}") from exc

    def weights(self, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in self._entries:
            tensor = self._tensor(t)
            if tensor.dtype != dtype:
                tensor = tensor.to(dtype)
            if self.arch == "llama":
                if ".attn_q." in t.name:
                    tensor = unpermute_rotary(tensor, self.n_head)
                elif ".attn_k." in t.name:
                    tensor = unpermute_rotary(tensor, self.n_head_kv)
            yield name, tensor


def _reader_class():
    from gguf import GGUFReader

    class _PlainViewReader(GGUFReader):
        """GGUFReader whose buffer is a plain ndarray view of its memmap.

        Header parsing slices the buffer ~10^6 times for a 50k-token vocabulary; np.memmap's subclass hooks
        make that ~5x slower. The view still shares the same mapping, so tensor data stays lazily paged."""

        @property
        def data(self):
            return self._plain_data

        @data.setter
        def data(self, value):
            self._plain_data = value.view(np.ndarray) if isinstance(value, np.memmap) else value

    return _PlainViewReader


def _open_reader(path: str):
    try:
        with open(path, "rb") as fh:
            magic = fh.read(4)
    except OSError as exc:
        raise ModelLoadError(f"model: cannot read {path}: {exc}") from exc
    if magic != b"GGUF":
        raise ModelLoadError(f"model: corrupt GGUF file {path}: bad magic {magic!r} (not a GGUF file)")
    try:
        return _reader_class()(path)
    except Exception as exc:  # the reader surfaces struct/numpy/enum errors raw on malformed files
        raise ModelLoadError(
            f"model: corrupt GGUF file {path}: truncated or malformed header/tensor table "
            f"({type(exc).__name__}: {exc})") from exc


def _validate_tensors(path: str, reader) -> None:
    """Fail at load time (not mid-iteration) on truncation, unsupported types or unknown tensors."""
    from gguf import GGML_QUANT_SIZES

    supported = _supported_types()
    size = os.path.getsize(path)
    for t in reader.tensors:
        block, type_size = GGML_QUANT_SIZES[t.tensor_type]
        n_elem = int(np.prod(t.shape.tolist()))
        expect = n_elem // block * type_size
        if t.data_offset + expect > size or t.data.nbytes != expect:
            raise ModelLoadError(
                f"model: corrupt GGUF file {path}: tensor {t.name} data [{t.data_offset}, "
                f"{t.data_offset + expect}) lies beyond the end of the file ({size} bytes); truncated?")
        if t.tensor_type not in supported:
            names = ", ".join(sorted(s.name for s in supported))
            raise ModelLoadError(
                f"model: GGUF tensor {t.name} has unsupported type {t.tensor_type.name} (supported: {names})")
        if t.name not in _SKIPPED and hf_name(t.name) is None:
            raise ModelLoadError(f"model: GGUF tensor {t.name} has no known Hugging Face equivalent")


def _hf_config(path: str, meta: dict[str, Any], tensor_names: set[str]) -> dict:
    arch = meta.get("general.architecture")
    if arch not in _SUPPORTED_ARCHS:
        raise ModelLoadError(
            f"model: GGUF architecture {arch!r} in {path} is not supported (supported: {sorted(_SUPPORTED_ARCHS)})")
    model_type, hf_arch = _SUPPORTED_ARCHS[arch]

    def get(key, default=None, required=False):
        full = f"{arch}.{key}"
        if full in meta:
            return meta[full]
        if required:
            raise ModelLoadError(f"model: corrupt GGUF file {path}: missing metadata {full}")
        return default

    hidden = int(get("embedding_length", required=True))
    n_head = int(get("attention.head_count", required=True))
    n_head_kv = get("attention.head_count_kv", n_head)
    if isinstance(n_head_kv, list):  # per-layer counts; dense models repeat one value
        n_head_kv = max(n_head_kv)
    n_head_kv = int(n_head_kv)
    tokens = meta.get("tokenizer.ggml.tokens")
    vocab_size = get("vocab_size") or (len(tokens) if tokens else None)
    if vocab_size is None:
        raise ModelLoadError(f"model: corrupt GGUF file {path}: cannot determine vocab size")

    config: dict[str, Any] = {
        "model_type": model_type,
        "architectures": [hf_arch],
        "vocab_size": int(vocab_size),
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length", required=True)),
        "num_hidden_layers": int(get("block_count", required=True)),
        "num_attention_heads": n_head,
        "num_key_value_heads": n_head_kv,
        "head_dim": int(get("attention.key_length", hidden // n_head)),
        "hidden_act": "silu",
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(get("context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": "blk.0.attn_q.bias" in tensor_names,
    }
    for hf_key, gguf_key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                             ("pad_token_id", "padding_token_id")):
        value = meta.get(f"tokenizer.ggml.{gguf_key}")
        if value is not None:
            config[hf_key] = int(value)
    # Chat models end turns with EOT; stop on it too when it differs from EOS.
    eot = meta.get("tokenizer.ggml.eot_token_id")
    if eot is not None and "eos_token_id" in config and int(eot) != config["eos_token_id"]:
        config["eos_token_id"] = [config["eos_token_id"], int(eot)]

    scaling_type = get("rope.scaling.type")
    if scaling_type and scaling_type != "none":
        rope_scaling: dict[str, Any] = {"rope_type": scaling_type}
        if get("rope.scaling.factor") is not None:
            rope_scaling["factor"] = float(get("rope.scaling.factor"))
        if get("rope.scaling.original_context_length") is not None:
            rope_scaling["original_max_position_embeddings"] = int(get("rope.scaling.original_context_length"))
        for src, dst in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow"),
                         ("attn_factor", "attention_factor")):
            if get(f"rope.scaling.{src}") is not None:
                rope_scaling[dst] = float(get(f"rope.scaling.{src}"))
        config["rope_scaling"] = rope_scaling
    if "rope_freqs.weight" in tensor_names:
        logger.warning("%s: GGUF has rope_freqs (Llama-3 style rope scaling factors); they are not exported "
                       "to hf_config and are ignored", path)
    if model_type == "qwen2":
        config["use_sliding_window"] = False
    return config


def read_metadata(reader) -> dict[str, Any]:
    meta = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        meta[key] = _field_value(field)
    return meta


def load_gguf_checkpoint(path: str) -> Checkpoint:
    from .tokenizer import build_gguf_tokenizer

    reader = _open_reader(path)
    try:
        meta = read_metadata(reader)
    except Exception as exc:
        raise ModelLoadError(f"model: corrupt GGUF file {path}: unreadable metadata: {exc}") from exc
    _validate_tensors(path, reader)
    tensor_names = {t.name for t in reader.tensors}
    config = _hf_config(path, meta, tensor_names)
    tokenizer = build_gguf_tokenizer(meta)

    size = os.path.getsize(path)
    tensor_info = [[t.name, int(t.tensor_type), [int(d) for d in t.shape.tolist()], int(t.data_offset)]
                   for t in reader.tensors]
    identity = compute_identity(config, [
        ("gguf", {"name": os.path.basename(path), "size": size}),
        ("gguf-tensor-info", tensor_info),
        ("gguf-data-sample", sample_digest(path, int(reader.data_offset), size)),
    ])
    source = GGUFWeights(path, reader, meta["general.architecture"], config["num_attention_heads"],
                         config["num_key_value_heads"])
    logger.info("loaded GGUF %s (%s, %d tensors)", path, config["model_type"], len(reader.tensors))
    return Checkpoint(path=path, format="gguf", hf_config=config, tokenizer=tokenizer, identity=identity,
                      _source=source)
