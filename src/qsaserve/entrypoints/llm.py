"""LLM: the offline API, shaped like vLLM's so existing scripts run unchanged."""
from __future__ import annotations

import itertools
from typing import Sequence as Seq

from tqdm.auto import tqdm

from qsaserve.config import EngineConfig
from qsaserve.engine.llm_engine import LLMEngine
from qsaserve.errors import InvalidRequestError
from qsaserve.outputs import RequestOutput
from qsaserve.sampling_params import SamplingParams


class LLM:
    """LLM(model=None, dtype="auto", max_model_len=None, enable_prefix_caching=True, ...):
    every EngineConfig field is accepted as a keyword argument."""

    def __init__(self, model: str | None = None, *, progress: bool = True, **engine_args):
        unknown = set(engine_args) - set(EngineConfig.field_names())
        if unknown:
            raise TypeError(f"LLM() got unknown engine arguments: {sorted(unknown)}")
        self.engine = LLMEngine(EngineConfig(model=model, **engine_args), progress=progress)
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: str | dict | Seq[str | dict],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise InvalidRequestError(
                    "sampling_params", f"got {len(params_list)} for {len(prompts)} prompts; pass one or one per prompt"
                )
        for params in params_list:  # every grammar compiles on the pool at once; add_request waits for its own
            if params.structured_outputs is not None:
                self.engine.structured_outputs.compile(params.structured_outputs)
        added: list[str] = []
        try:
            for prompt, params in zip(prompts, params_list):
                request_id = str(next(self._ids))
                self.engine.add_request(request_id, prompt, params)
                added.append(request_id)
        except Exception:
            for request_id in added:  # leave the engine as it was: serving nobody from this call
                self.engine.abort_request(request_id)
            raise
        return self._run(added, use_tqdm)

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        tools: list[dict] | None = None,
    ) -> list[RequestOutput]:
        """tools: OpenAI tool objects handed to the chat template (the output is text: parse it, or
        constrain it with SamplingParams(structured_outputs=...))."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [{"prompt_token_ids": self.apply_chat_template(c, add_generation_prompt, chat_template, tools)}
                   for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, chat_template: str | None = None,
                            tools: list[dict] | None = None) -> list[int]:
        return apply_chat_template(self.engine.tokenizer, messages, add_generation_prompt, chat_template, tools)

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        pending = set(request_ids)
        results: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(request_ids), desc="Processed prompts", disable=not use_tqdm, dynamic_ncols=True)
        try:
            while pending:
                for out in self.engine.step(outputs="finished"):  # only final results are returned
                    if out.finished and out.request_id in pending:
                        results[out.request_id] = out
                        pending.discard(out.request_id)
                        bar.update(1)
        except BaseException:
            for request_id in pending:
                self.engine.abort_request(request_id)
            raise
        finally:
            bar.close()
        return [results[r] for r in request_ids]


def apply_chat_template(tokenizer, messages: list[dict], add_generation_prompt: bool = True,
                        chat_template: str | None = None, tools: list[dict] | None = None) -> list[int]:
    """Prompt token ids of a conversation, rendered with the model's chat template (shared by
    LLM.chat and the server so both send the model identical tokens); `tools` (OpenAI tool
    objects) go to the template, which decides how to write them."""
    validate_messages(messages)
    if tokenizer is None or (chat_template is None and not getattr(tokenizer, "chat_template", None)):
        raise InvalidRequestError("messages", "this model has no chat template; use generate() with a plain prompt")
    text = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt, chat_template=chat_template,
        **({"tools": tools} if tools else {}),
    )
    # The template already wrote any BOS it wants.
    return tokenizer.encode(text, add_special_tokens=False)


_ROLES = ("system", "user", "assistant", "tool", "developer")


def validate_messages(messages) -> None:
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError("messages", "must be a non-empty list of {role, content} objects")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise InvalidRequestError(f"messages[{i}]", "must be an object with 'role' and 'content'")
        if m.get("role") not in _ROLES:
            raise InvalidRequestError(f"messages[{i}].role", f"must be one of {', '.join(_ROLES)}; got {m.get('role')!r}")
        content = m.get("content")
        if not isinstance(content, (str, list)) and content is not None:
            raise InvalidRequestError(f"messages[{i}].content", "must be a string or a list of content parts")
