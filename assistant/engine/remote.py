"""RemoteEngine: any OpenAI-compatible chat-completions server (vLLM, TGI, SGLang, this project's
own /v1 API) behind the Engine seam — the scale-out path.

Streams with SSE (`stream: true`); cancelling closes the HTTP response, which makes a vLLM-style
server abort the request. Structured `tool_calls` in the response are rendered back into the
model's native `<tool_call>{json}</tool_call>` text so the orchestrator parses one format.
Token counts for the context budget are estimated (about 4 characters per token) unless the
server's tokenizer is available locally (`tokenizer_path`).
"""

from __future__ import annotations

import json
import threading
from typing import Any, Iterator, Sequence

from assistant.config import AssistantConfig
from assistant.engine.base import (FINISH_CANCELLED, FINISH_LENGTH, FINISH_STOP, PREFIX, Engine, Message, Prompt,
                                    SamplingParams, TokenDelta, TokenLogprob)
from assistant.errors import EngineBusy, EngineError

CHARS_PER_TOKEN = 4


class RemoteEngine(Engine):
    def __init__(self, base_url: str, *, model: str = "", api_key: str = "", context_window: int = 32768,
                 timeout_s: float = 600.0, tokenizer: Any = None) -> None:
        import httpx

        self.base_url = base_url.rstrip("/")
        if not self.base_url.endswith("/v1"):
            self.base_url += "/v1"
        self.model, self.name, self.context_window = model, f"remote:{model or base_url}", context_window
        self.tokenizer = tokenizer
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.Client(headers=headers, timeout=httpx.Timeout(timeout_s, connect=10.0))

    @classmethod
    def from_config(cls, config: AssistantConfig) -> "RemoteEngine":
        e = config.engine
        window = e.max_context_tokens or 32768
        return cls(e.remote_url, model=e.remote_model, api_key=e.remote_api_key, context_window=window)

    def count_tokens(self, messages: Sequence[Message], *, tools: Sequence[dict] | None = None) -> int:
        if self.tokenizer is not None:
            return len(self.tokenizer.apply_chat_template(list(messages), tools=tools, add_generation_prompt=True))
        text = sum(len(str(m.get("content", ""))) + 16 for m in messages) + len(json.dumps(tools or []))
        return text // CHARS_PER_TOKEN

    def _model_name(self) -> str:
        if not self.model:
            try:
                self.model = self.client.get(f"{self.base_url}/models").json()["data"][0]["id"]
            except Exception as e:
                raise EngineError(f"Cannot list models at {self.base_url}: {e}. Set engine.model to the served name.") from e
        return self.model

    def generate(self, prompt: Prompt, params: SamplingParams, *, tools: Sequence[dict] | None = None,
                 cancel: threading.Event | None = None) -> Iterator[TokenDelta]:
        import httpx

        params.verify()
        if prompt and isinstance(prompt[0], int):
            raise EngineError("RemoteEngine takes chat messages, not token ids.")
        body: dict[str, Any] = {
            "model": self._model_name(), "messages": list(prompt), "stream": True,
            "stream_options": {"include_usage": True}, "max_tokens": params.max_tokens,
            "temperature": params.temperature, "top_p": params.top_p,
        }
        if params.top_k:
            body["top_k"] = params.top_k
        if params.stop:
            body["stop"] = list(params.stop)
        if params.seed is not None:
            body["seed"] = params.seed
        if params.logprobs is not None:
            body.update(logprobs=True, top_logprobs=params.logprobs)
        if params.presence_penalty:
            body["presence_penalty"] = params.presence_penalty
        if params.frequency_penalty:
            body["frequency_penalty"] = params.frequency_penalty
        if params.logit_bias:
            body["logit_bias"] = {str(t): b for t, b in params.logit_bias}
        if prompt and prompt[-1].get(PREFIX):  # continue the final assistant message (vLLM's extension)
            body["messages"] = [{k: v for k, v in m.items() if k != PREFIX} for m in prompt]
            body.update(continue_final_message=True, add_generation_prompt=False)
        if tools:
            body["tools"] = list(tools)
        try:
            with self.client.stream("POST", f"{self.base_url}/chat/completions", json=body) as response:
                if response.status_code == 503 or response.status_code == 429:
                    raise EngineBusy(f"The LLM server at {self.base_url} is overloaded ({response.status_code}): retry shortly.")
                if response.status_code >= 400:
                    response.read()
                    raise EngineError(f"The LLM server at {self.base_url} refused the request "
                                      f"({response.status_code}): {response.text[:300]}")
                yield from self._parse(response.iter_lines(), cancel)
        except httpx.TransportError as e:
            raise EngineError(f"Cannot reach the LLM server at {self.base_url}: {e}. "
                              "Start it, or fix engine.remote_url.") from e

    def _parse(self, lines: Iterator[str], cancel: threading.Event | None) -> Iterator[TokenDelta]:
        generated = prompt_tokens = cached = 0
        finish: str | None = None
        calls: dict[int, dict[str, Any]] = {}
        for line in lines:
            if cancel is not None and cancel.is_set():
                yield TokenDelta("", (), FINISH_CANCELLED, prompt_tokens, generated)
                return
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                raise EngineError(f"The LLM server reported: {chunk['error'].get('message', chunk['error'])}")
            usage = chunk.get("usage") or {}
            if usage:
                prompt_tokens = usage.get("prompt_tokens", prompt_tokens)
                generated = usage.get("completion_tokens", generated)
                cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", cached) or 0
            for choice in chunk.get("choices", []):
                delta = choice.get("delta") or {}
                for call in delta.get("tool_calls") or []:
                    entry = calls.setdefault(call.get("index", 0), {"name": "", "arguments": ""})
                    fn = call.get("function") or {}
                    entry["name"] += fn.get("name") or ""
                    entry["arguments"] += fn.get("arguments") or ""
                finish = choice.get("finish_reason") or finish
                scored = _scored(choice.get("logprobs"))
                if delta.get("content") or scored:
                    generated += 1 if delta.get("content") else 0
                    yield TokenDelta(delta.get("content") or "", (), None, prompt_tokens, generated, logprobs=scored)
        tail = "".join(_render_tool_call(c) for c in calls.values())
        reason = FINISH_LENGTH if finish == "length" else FINISH_STOP
        yield TokenDelta(tail, (), reason, prompt_tokens, generated, cached)

    def close(self) -> None:
        self.client.close()


def _scored(logprobs: Any) -> tuple[TokenLogprob, ...]:
    """A chunk's `logprobs.content` (OpenAI's shape) as the engine's TokenLogprob tuple."""
    content = (logprobs or {}).get("content") if isinstance(logprobs, dict) else None
    return tuple(TokenLogprob(t["token"], float(t["logprob"]),
                              tuple((a["token"], float(a["logprob"])) for a in t.get("top_logprobs") or ()))
                 for t in content or ())


def _render_tool_call(call: dict[str, Any]) -> str:
    try:
        arguments = json.loads(call["arguments"] or "{}")
    except json.JSONDecodeError:
        arguments = call["arguments"]
    return "<tool_call>\n" + json.dumps({"name": call["name"], "arguments": arguments}) + "\n</tool_call>"
