"""/v1/completions, OpenAI's text completion: the raw model continues a prompt as it stands, with no chat
template, which is what code editors' autocomplete asks for. With `suffix`, the model fills in what goes
between the prompt and the suffix (fill-in-the-middle), through its own FIM tokens: the packaged
Qwen2.5-Coder models know `<|fim_prefix|>`, `<|fim_suffix|>` and `<|fim_middle|>`; a model without them
refuses a suffix with a 400. The packaged instruct models, past the middle, go on to write the suffix
again: a FIM answer stops at the suffix's first non-blank line (`suffix_stop`). With `echo` and `logprobs`, the prompt's own tokens are scored too (the
first has none), and `max_tokens: 0` scores the prompt alone: what evaluation harnesses ask to compare
the likelihood of texts.

The request goes through the same gateway (keys, limits, the ledger), the same input and output guards
and the same streaming code as a raw chat completion (completions.py, with `Shape.text`), so only the
prompt and the reply's shape differ. Not offered: the `assistant` model (a turn answers messages), a
remote engine (it takes messages, not a prompt).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Iterator

from assistant.engine.base import FINISH_LENGTH, TokenDelta, TokenLogprob
from assistant.seams import close_if_closable

FIM_TOKENS = ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>")
NEEDS_LOCAL = ("/v1/completions needs the model served here in process (its tokenizer); `{model}` is served "
               "by a remote engine: use /v1/chat/completions.")
NO_FIM = ("`{model}` has no fill-in-the-middle tokens ({tokens}), so it cannot take a `suffix`: leave it out, "
          "or use a Qwen2.5-Coder model.")


def prompt_ids(tokenizer: Any, req: Any, model: str) -> list[int]:
    """The request's prompt as token ids: as sent, or the text encoded as the model reads a document's
    start (with its BOS, if it has one); with a suffix, in the model's FIM layout. ValueError: the
    request asks what this model cannot do, in words for the caller."""
    if req.prompt_text is None:
        if req.suffix is not None:
            raise ValueError("a `suffix` needs the prompt as text, not token ids.")
        return [int(t) for t in req.prompt]
    if req.suffix is None:
        return list(tokenizer(req.prompt_text)["input_ids"])
    ids = [tokenizer.convert_tokens_to_ids(t) for t in FIM_TOKENS]
    if any(i is None or i == tokenizer.unk_token_id for i in ids):
        raise ValueError(NO_FIM.format(model=model, tokens=", ".join(FIM_TOKENS)))
    prefix, suffix, middle = FIM_TOKENS
    text = f"{prefix}{req.prompt_text}{suffix}{req.suffix}{middle}"
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def suffix_stop(suffix: str | None) -> str | None:
    """A stop string for a fill-in-the-middle answer: the suffix's first non-blank line, where the model
    would start writing the suffix again (the packaged instruct models do, past the middle); None when
    that line is too short to be told from code of the middle (under 4 characters)."""
    line = next((l.strip() for l in (suffix or "").splitlines() if l.strip()), "")
    return line if len(line) >= 4 else None


def guarded_text(req: Any) -> list[dict[str, Any]]:
    """What the input guard reads of a text request: its prompt (and suffix) as one user message."""
    text = req.prompt_text if req.prompt_text is not None else ""
    return [{"role": "user", "content": text + ("\n" + req.suffix if req.suffix else "")}]


@dataclass(frozen=True)
class TextPrompt:
    """A text request as the engine gets it, and what its reply puts around the engine's tokens."""

    ids: list[int]
    echo: str = ""  # the prompt text, put before the completion (`echo`)
    first_token: str | None = None  # with the prompt scored: its first token's text (which has no score)
    answer: bool = True  # False: `max_tokens: 0`, the prompt is scored and no token is returned

    def deltas(self, deltas: Iterator[TokenDelta]) -> Iterator[TokenDelta]:
        """The engine's deltas with the prompt's scores (SamplingParams.prompt_logprobs) put before the first
        one's own, as one list of token logprobs; without an answer, one delta with the scores alone."""
        if self.first_token is None:
            yield from deltas
            return
        first = TokenLogprob(self.first_token, None)
        try:
            for delta in deltas:
                scored = (first, *delta.prompt_logprobs) if delta.prompt_logprobs else ()
                if not self.answer:
                    yield TokenDelta("", (), FINISH_LENGTH, delta.num_prompt_tokens, 0, delta.num_cached_tokens, scored)
                    return
                yield replace(delta, logprobs=(*scored, *delta.logprobs), prompt_logprobs=())
        finally:
            close_if_closable(deltas)
