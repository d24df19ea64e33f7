"""KV-scale calibration: run text through the model and record, per attention layer, the
per-KV-head, per-channel mean m of K (as written: after k-norm and RoPE), the largest |K - m| and
the largest |V|.

Keys are stored as K - m (ops/attention/reference.py: exact for attention, since q.m is one
constant per query). m removes the channels' fixed bias (a few channels of SmolLM2's keys sit far
from zero), so the stored keys are smaller and E4M3's relative rounding error costs less in q.k.
The absmax of K - m comes out of the same single pass: per channel it is
max(max_c - m_c, m_c - min_c), from the running per-channel min, max and sum.

scale = absmax * margin / 448, so the calibration maximum lands at 448 / margin. The margin
(default 1.25) leaves headroom for values beyond what the calibration text produced: clamping
an outlier key (attention sinks are exactly such keys) costs far more than the quarter binade
of precision given up at the small end, where E4M3 keeps its relative precision down to
2^-6 * scale anyway.

The first key of every sequence is an attention sink: most queries put most of their weight on
it, and in SmolLM2's upper layers it is nearly the same vector whatever the first token is, yet
far from the mean. So m is then nudged (by at most half an E4M3 step of that key, per channel)
until the calibrated first-token key minus m is exactly representable at the layer's k_scale:
the sink is then stored with almost no rounding error, while every other key sees an offset
within a rounding step of the mean. The first-token key is measured with one-token prompts (a
causal model's position-0 key depends on that token only). Still one offset per layer and
channel, so still exact for attention, and readers and kernels need nothing new.

V gets the same treatment where the model can apply it (Llama family): values are stored as
V - c, with c the per-channel mean of V aligned to the mean first-token value, and c is added
back to the attention output, which is exact because the attention weights of a query sum to
one. The sink's value, which most queries weight most, is then stored exactly too. The model
folds both into its projection biases (models/llama.py), so nothing runs per step for it (its
effect on quality: docs/fp8.md).

With `--kv-rotation whitened` (the CLI's default for models that support it, default_kv_rotation)
a first pass over the same windows records, per layer and KV head,
the second moments of K and of the group's queries (as the layer produces them, before any
transform); from them comes the layer's key transform (quant/kv_rotation.whitened_key_transform),
which the layers then apply, and the pass above measures offsets and scales of the transformed
keys. The transforms go into the scales file's sidecar.

Observation happens in the layers' cache-write hook (LayerCache.observer), on device, with no
host sync per step; the cache itself runs in the model dtype while calibrating.
"""
from __future__ import annotations

import dataclasses
import datetime
import logging

import torch

from qsaserve.errors import InvalidRequestError
from qsaserve.quant.dataset import TextSet, token_windows
from qsaserve.quant.fp8 import FP8_E4M3_MAX, dequantize_fp8, quantize_fp8
from qsaserve.quant.kv_rotation import KEY_TRANSFORM_MAX_CONDITION, key_transform_condition, whitened_key_transform
from qsaserve.quant.kv_scales import write_scales_file

logger = logging.getLogger("qsaserve")

DEFAULT_MARGIN = 1.25
DEFAULT_NUM_TOKENS = 8192
DEFAULT_SEQ_LEN = 512
WHITENING_SEED = 0  # seeds the random signs of the whitened key transforms' Hadamard


class _ChannelStats:
    """Per-channel running sum (float64), min and max of [T, Hkv, D] values (device tensors)."""

    def __init__(self):
        self.sum = self.min = self.max = None

    def add(self, x: torch.Tensor) -> None:
        if self.sum is None:
            self.sum = torch.zeros(x.shape[1:], dtype=torch.float64, device=x.device)
            self.min = torch.full(x.shape[1:], float("inf"), device=x.device)
            self.max = torch.full(x.shape[1:], float("-inf"), device=x.device)
        self.sum += x.sum(0, dtype=torch.float64)
        self.min = torch.minimum(self.min, x.amin(0))
        self.max = torch.maximum(self.max, x.amax(0))

    def mean(self, tokens: int) -> torch.Tensor:
        return (self.sum / tokens).float()

    def absmax_after(self, offset: torch.Tensor | float) -> float:
        """max |x - offset| over every observed value (0.0 before any)."""
        if self.max is None:
            return 0.0
        return torch.maximum(self.max - offset, offset - self.min).amax().item()


class KVObserver:
    """Over every cache write of one layer: per-channel running sum, min and max of K and of V
    ([Hkv, D], sums in float64; device tensors, no host sync). max |K| and max |V| follow from the
    per-channel min and max. With moments=True also sum K K^T and the sum of q q^T over each KV
    head's query group ([Hkv, D, D] float64), for the whitened key transform."""

    def __init__(self, device: torch.device, moments: bool = False):
        self.device = device
        self.k_stats, self.v_stats = _ChannelStats(), _ChannelStats()
        self.tokens = 0
        self.k_moment = self.q_moment = None
        self.moments = moments
        self.queries = 0  # query vectors summed into q_moment, per KV head

    def __call__(self, k: torch.Tensor, v: torch.Tensor, q: torch.Tensor | None = None) -> None:
        """k, v: [T, Hkv, D]; q: [T, Hq, D] (its heads grouped over k's, as in GQA)."""
        k, v = k.detach().float(), v.detach().float()
        self.k_stats.add(k)
        self.v_stats.add(v)
        self.tokens += k.shape[0]
        if self.moments:
            if q is None or q.shape[1] % k.shape[1]:
                raise RuntimeError("calibrate: the whitened key transform needs each layer's queries grouped over its KV heads")
            k64 = k.double()
            qg = q.detach().double().unflatten(1, (k.shape[1], -1))  # [T, Hkv, G, D]
            km = torch.einsum("thd,the->hde", k64, k64)
            qm = torch.einsum("thgd,thge->hde", qg, qg)
            self.k_moment = km if self.k_moment is None else self.k_moment + km
            self.q_moment = qm if self.q_moment is None else self.q_moment + qm
            self.queries += qg.shape[0] * qg.shape[2]

    def key_covariance(self) -> torch.Tensor:
        """Centred covariance of K per KV head, [Hkv, D, D] float64."""
        mean = self.k_stats.sum / self.tokens
        return self.k_moment / self.tokens - mean.unsqueeze(-1) * mean.unsqueeze(-2)

    def query_moment(self) -> torch.Tensor:
        """Second moment E[q q^T] over each KV head's query group, [Hkv, D, D] float64."""
        return self.q_moment / self.queries

    def k_offset(self) -> torch.Tensor:
        """The per-channel mean of K, [Hkv, D] float32."""
        return self.k_stats.mean(self.tokens)

    def v_mean(self) -> torch.Tensor:
        """The per-channel mean of V, [Hkv, D] float32."""
        return self.v_stats.mean(self.tokens)

    def k_absmax_after(self, offset: torch.Tensor) -> float:
        """max |K - offset| over every observed key."""
        return self.k_stats.absmax_after(offset)

    def v_absmax_after(self, offset: torch.Tensor) -> float:
        """max |V - offset| over every observed value."""
        return self.v_stats.absmax_after(offset)


def sink_aligned_offset(mean: torch.Tensor, sink: torch.Tensor, scale: float) -> torch.Tensor:
    """The offset within half an E4M3 step (at `scale`, per channel) of `mean` for which
    sink - offset is exactly an E4M3 value times scale: sink - Q(sink - mean). [Hkv, D] float32."""
    s = torch.tensor(scale, dtype=torch.float32, device=mean.device)  # the float32 scale the cache will use
    if (sink - mean).abs().max() > FP8_E4M3_MAX * s:
        raise ValueError(f"scale: {scale} would clamp the sink key (|sink - mean| max {(sink - mean).abs().max().item()})")
    return sink - dequantize_fp8(quantize_fp8(sink - mean, s), s)


SINK_ALIGN_HEADROOM = 17 / 16  # |Q(x) - x| <= |x| / 16 in E4M3's normal range: the most aligning can add to |K - m|


def _sink_aligned(mean: torch.Tensor, absmax_after, sink: torch.Tensor, margin: float, what: str
                  ) -> tuple[torch.Tensor, float, float]:
    """(offset, absmax after it, scale) with the offset aligned to the sink's K or V
    (absmax_after: offset -> max |x - offset| observed). The sink is itself an observed value, so
    |sink - mean| <= absmax of x - mean per channel, and aligning moves each channel by at most
    1/16 of that: the scale takes 17/16 of that absmax (times the margin), so no calibration value
    clamps whatever the alignment does."""
    scale = absmax_after(mean) * SINK_ALIGN_HEADROOM * margin / FP8_E4M3_MAX
    offset = sink_aligned_offset(mean, sink, scale)
    absmax = absmax_after(offset)
    if absmax * margin > scale * FP8_E4M3_MAX * (1 + 1e-6):
        raise RuntimeError(f"calibrate: the sink-aligned {what} offset gives |{what} - offset| max {absmax}, beyond "
                           f"its scale {scale}")
    return offset, absmax, scale


def default_kv_rotation(config) -> str:
    """The head transform `qsaserve calibrate` measures when --kv-rotation is not given: whitened
    where the model supports it (the scheme that loses least to FP8, docs/fp8.md), else none."""
    from qsaserve.loader.checkpoint import dummy_checkpoint, load_checkpoint
    from qsaserve.models.registry import kv_rotation_unsupported

    checkpoint = dummy_checkpoint(config.model) if config.load_format == "dummy" else \
        load_checkpoint(config.model, progress=False)
    why_not = kv_rotation_unsupported(checkpoint.hf_config)
    if why_not:
        logger.info("calibrate: no head transform (%s)", why_not)
        return "none"
    return "whitened"


def calibration_config(config, *, choose_rotation: bool = False):
    """The engine config to calibrate with: a cache in the model dtype (the observer must see
    unquantized K/V upstream too), no overlay, one rank (a TP rank sees only its own heads), and
    no CUDA graphs (the whitened key transforms are set between passes, after capture).
    choose_rotation: an unset kv_rotation becomes default_kv_rotation's choice (the CLI's default)."""
    if config.tensor_parallel_size != 1:
        raise InvalidRequestError("tensor_parallel_size", "calibrate runs on one rank (a TP rank observes only its own heads)")
    dtype = str(config.torch_dtype).removeprefix("torch.")
    if config.kv_cache_dtype not in ("auto", dtype) or config.kv_scales:
        logger.info("calibrate: the KV cache runs in the model dtype (%s); kv_cache_dtype/kv_scales are ignored", dtype)
    rotation = config.kv_rotation
    if rotation is None and choose_rotation:
        rotation = default_kv_rotation(config)
    # no prefix caching: the whitened transforms' two passes run the same windows, and the second
    # must compute every key again in the new basis
    return dataclasses.replace(config, kv_cache_dtype=dtype, kv_scales=None, strict_kv_scales=False, enforce_eager=True,
                               enable_prefix_caching=False, kv_rotation=rotation)


def observe(llm, windows: list[list[int]], progress: bool = False, moments: bool = False) -> dict[int, KVObserver]:
    """Runs each window as one prompt (prefill only) with observers on every attention layer's
    cache; returns them by layer number."""
    from qsaserve.sampling_params import SamplingParams

    executor = llm.engine.executor
    observers = {i: KVObserver(executor.device, moments) for i in executor.attention_layer_ids()}
    executor.observe_kv_writes(list(observers.values()))
    try:
        llm.generate([{"prompt_token_ids": w} for w in windows], SamplingParams(max_tokens=1, temperature=0), use_tqdm=progress)
    finally:
        executor.observe_kv_writes(None)
    return observers


def calibrate(llm, dataset: TextSet, output: str, *, num_tokens: int = DEFAULT_NUM_TOKENS, seq_len: int = DEFAULT_SEQ_LEN,
              margin: float = DEFAULT_MARGIN, align_sink: bool = True, progress: bool = False) -> dict:
    """Tokenizes `dataset` into windows of seq_len tokens (num_tokens in all), calibrates on them,
    writes the scales file for llm's model to `output` and returns its contents."""
    engine = llm.engine
    if engine.tokenizer is None:
        raise InvalidRequestError("model", "calibrate needs a model with a tokenizer (or use calibrate_windows with token ids)")
    seq_len = min(seq_len, engine.max_model_len - 1)
    windows = token_windows(engine.tokenizer, dataset.texts, seq_len, num_tokens)
    return calibrate_windows(llm, windows, output, dataset.description, margin=margin, align_sink=align_sink,
                             progress=progress)


def measure_key_transforms(llm, windows: list[list[int]], progress: bool = False) -> dict[int, torch.Tensor]:
    """The whitened key transform of every attention layer ([Hkv, D, D] float32 by layer number),
    from the K and q moments over `windows`; from here on the engine's layers apply them, so the
    next observation sees K T (quant/kv_rotation.py).

    The layers change under the engine, so what was built for the old ones goes: captured decode
    graphs (they recorded the layers without a transform) and cached prefixes (their pages hold
    keys in the old basis, and a second pass over the same windows would reuse them)."""
    engine = llm.engine
    engine.executor.set_key_transforms(None)  # moments of q and K as the model makes them
    engine.block_manager.reset_prefix_cache()
    observers = observe(llm, windows, progress, moments=True)
    gen = torch.Generator().manual_seed(WHITENING_SEED)
    transforms = {}
    for i, obs in observers.items():
        hkv, d = obs.k_moment.shape[:2]
        signs = torch.randint(0, 2, (hkv, d), generator=gen).double() * 2 - 1
        try:
            transforms[i] = whitened_key_transform(obs.key_covariance().cpu(), obs.query_moment().cpu(), signs)
        except ValueError as e:
            raise InvalidRequestError("dataset", f"layer {i}: {e} (more or more varied calibration text?)") from None
        cond = key_transform_condition(transforms[i])
        if not cond < KEY_TRANSFORM_MAX_CONDITION:
            raise InvalidRequestError("dataset", f"layer {i}: the whitened key transform has condition number {cond:.3g} "
                                      f"(at most {KEY_TRANSFORM_MAX_CONDITION:g} loads); K or q barely varies in some "
                                      "direction over this text: calibrate on more or more varied tokens (num_tokens)")
    engine.executor.set_key_transforms([transforms[i] for i in observers])
    engine.block_manager.reset_prefix_cache()
    return transforms


def calibrate_windows(llm, windows: list[list[int]], output: str, dataset_description: dict, *,
                      margin: float = DEFAULT_MARGIN, align_sink: bool = True, progress: bool = False) -> dict:
    """Calibrates on token-id windows (each one prompt) and writes the scales file. align_sink:
    align the K offset to the mean first-token key (module docstring); False keeps the plain mean."""
    if margin < 1:
        raise InvalidRequestError("margin", f"must be >= 1 (below 1 the calibration maximum itself would clamp), got {margin}")
    engine = llm.engine
    if engine.executor.kv_quant.is_fp8:
        raise InvalidRequestError("kv_cache_dtype", "calibrate needs a high-precision KV cache (see calibration_config)")
    if not windows:
        raise InvalidRequestError("dataset", "yields no tokens")
    rotation = engine.executor.kv_quant.rotation
    key_transforms = measure_key_transforms(llm, windows, progress) if rotation == "whitened" else None
    observers = observe(llm, windows, progress)
    sinks = observe(llm, [w[:1] for w in windows]) if align_sink else {}  # position-0 keys only
    # V offsets are folded into the model's projection biases (models/llama.py fold_v_offsets)
    with_v_offset = align_sink and engine.executor.can_fold_v_offsets()
    layers = {}
    for i, obs in observers.items():
        k_max, v_max = obs.k_absmax_after(0.0), obs.v_absmax_after(0.0)
        if obs.tokens == 0 or not (0 < k_max < float("inf") and 0 < v_max < float("inf")):
            raise RuntimeError(f"calibrate: layer {i} observed {obs.tokens} tokens with |K| max {k_max}, |V| max {v_max}; "
                               "cannot derive a scale")
        mean = obs.k_offset()
        k_max_mean = obs.k_absmax_after(mean)
        if not 0 < k_max_mean < float("inf"):
            raise RuntimeError(f"calibrate: layer {i} has |K - mean| max {k_max_mean}; cannot derive a scale")
        if align_sink:
            offset, k_max_off, k_scale = _sink_aligned(mean, obs.k_absmax_after, sinks[i].k_offset(), margin, "K")
        else:
            offset, k_max_off, k_scale = mean, k_max_mean, k_max_mean * margin / FP8_E4M3_MAX
        layers[i] = {"k_scale": k_scale, "v_scale": v_max * margin / FP8_E4M3_MAX,
                     "k_absmax_after_offset": k_max_off, "k_absmax": k_max, "v_absmax": v_max,
                     "k_offset": offset.cpu().tolist(), "k_mean": mean.cpu().tolist(), "k_absmax_after_mean": k_max_mean}
        if align_sink:
            layers[i]["k_sink"] = sinks[i].k_offset().cpu().tolist()
        if with_v_offset:
            v_mean = obs.v_mean()
            v_max_mean = obs.v_absmax_after(v_mean)
            if not 0 < v_max_mean < float("inf"):
                raise RuntimeError(f"calibrate: layer {i} has |V - mean| max {v_max_mean}; cannot derive a V scale")
            v_sink = sinks[i].v_mean()
            v_offset, v_max_off, v_scale = _sink_aligned(v_mean, obs.v_absmax_after, v_sink, margin, "V")
            layers[i].update(v_scale=v_scale, v_offset=v_offset.cpu().tolist(), v_absmax_after_offset=v_max_off,
                             v_mean=v_mean.cpu().tolist(), v_absmax_after_mean=v_max_mean, v_sink=v_sink.cpu().tolist())
    from qsaserve import __version__

    meta = {
        "kv_cache_dtype": "fp8_e4m3",
        # K and V were observed after this head rotation; loading requires the same (quant/kv_rotation.py)
        "kv_rotation": rotation,
        "scale_rule": f"scale = absmax * margin / {FP8_E4M3_MAX:g} (per layer, per tensor; for K the absmax of "
                      "K - k_mean, K after norm and RoPE" + (", times 17/16: aligning the offset to k_sink moves "
                      "|K - k_offset| by at most 1/16" if align_sink else "") + ")",
        "k_offset_rule": ("per layer, per KV head, per channel mean of K over the calibration tokens (k_mean), moved by "
                          "at most half an E4M3 step so that k_sink - k_offset is exactly representable at k_scale "
                          "(k_sink: the mean first-token key, from one-token prompts); " if align_sink else
                          "per layer, per KV head, per channel mean of K over the calibration tokens; ")
                         + "keys are stored as K - k_offset (exact for attention)",
        **({"v_offset_rule": "per layer, per KV head, per channel mean of V, moved by at most half an E4M3 step so that "
                             "v_sink - v_offset is exactly representable at v_scale (v_sink: the mean first-token value); "
                             "values are stored as V - v_offset and v_offset is added back to the attention output "
                             "(exact: the attention weights sum to one); v_scale = absmax of V - v_mean times 17/16 "
                             "times the margin / 448"} if with_v_offset else {}),
        "margin": margin,
        "tool": f"qsaserve {__version__} calibrate",
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "model": engine.checkpoint.path,
        "model_dtype": str(engine.executor.dtype).removeprefix("torch."),
        "dataset": dataset_description,
        "num_tokens": sum(len(w) for w in windows),
        "seq_len": max(len(w) for w in windows),
    }
    if key_transforms is not None:
        meta["key_transform_rule"] = (
            "per layer and KV head T = Ck^-1/2 (Ck^1/2 Cq Ck^1/2)^1/4 diag(s) H (Ck: centred covariance of K after norm "
            "and RoPE, Cq: second moment of the KV head's queries, over the calibration tokens; s: random signs seeded "
            f"{WHITENING_SEED}; H: the normalized Hadamard matrix); the pages hold K T - k_offset, queries are "
            "multiplied by T^-T; k_offset and k_scale were measured on K T")
    doc = write_scales_file(output, identity=engine.checkpoint.identity, layers=layers, meta=meta,
                            key_transforms=key_transforms)
    logger.info("calibrate: %d tokens in %d windows; wrote %d layers' k/v scales to %s", meta["num_tokens"], len(windows),
                len(layers), output)
    return doc
