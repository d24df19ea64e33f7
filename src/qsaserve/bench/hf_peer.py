"""The Hugging Face transformers peer: the same random-weight shapes built as a transformers
model and run with `generate(cache_implementation="static")` in the same process, so both
engines meet the same device, driver and moment. On CUDA, transformers compiles the decode
step of a static-cache generate by default; warm-up calls keep that compile out of the timings."""
from __future__ import annotations

import time

import torch

from qsaserve.bench.common import sync
from qsaserve.errors import InvalidRequestError


def build_hf_model(hf_config: dict, device: torch.device, dtype: torch.dtype):
    """A randomly initialized transformers model of this config, built directly on `device`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(hf_config)
    model_type = cfg.pop("model_type", None)
    try:
        config = AutoConfig.for_model(model_type, **cfg)
    except (ValueError, KeyError) as e:
        raise InvalidRequestError("peer", f"transformers cannot build model_type {model_type!r}: {e}") from None
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


class HfPeer:
    def __init__(self, hf_config: dict, device: torch.device, dtype: torch.dtype):
        self.device = device
        self.model = build_hf_model(hf_config, device, dtype)
        self.eos = hf_config.get("eos_token_id")
        if isinstance(self.eos, list):
            self.eos = self.eos[0]
        self.pad = self.eos if self.eos is not None else 0

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], new_tokens: int, temperature: float = 0.0, pad_to: int | None = None):
        """Left-padded batch generate of exactly `new_tokens` tokens per row; returns seconds."""
        width = max(pad_to or 0, max(len(p) for p in prompts))
        ids = torch.full((len(prompts), width), self.pad, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        sample = {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0} if temperature > 0 else {"do_sample": False}
        sync(self.device)
        start = time.perf_counter()
        out = self.model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                  cache_implementation="static", pad_token_id=self.pad, eos_token_id=self.eos, **sample)
        sync(self.device)
        elapsed = time.perf_counter() - start
        if out.shape[1] != width + new_tokens:
            raise RuntimeError(f"peer: generate returned {out.shape[1] - width} new tokens, asked for {new_tokens}")
        return elapsed

    def decode_tok_s(self, batch: int, context: int, steps: int, prompt_fn) -> dict:
        """Decode speed as a difference of two generate lengths (prefill and setup cancel out);
        the longer call runs first so its static cache is the one both reuse."""
        prompts = [prompt_fn(context) for _ in range(batch)]
        short, long = 8, 8 + steps
        for n in (long, short):  # warm-up (and compile)
            self.generate(prompts, n)
        # The fastest of three calls each: the difference of two noisy times is noisier still.
        t_long = min(self.generate(prompts, long) for _ in range(3))
        t_short = min(self.generate(prompts, short) for _ in range(3))
        if t_long <= t_short:
            raise RuntimeError(f"peer: {steps} more decode steps measured no slower ({t_long:.6f} s vs "
                               f"{t_short:.6f} s); ask for more --decode-steps")
        per_step = (t_long - t_short) / steps
        return {"batch_size": batch, "context": context, "steps": steps, "ms_per_step": round(per_step * 1e3, 3),
                "tok_s": round(batch / per_step, 1)}

    def close(self) -> None:
        del self.model
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
