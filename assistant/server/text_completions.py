"""/v1/completions, OpenAI's text completion: the raw model continues a prompt as it stands, with no chat
template, which is what code editors' autocomplete asks for. With `suffix`, the model fills in what goes
between the prompt and the suffix (fill-in-the-middle), through its own FIM tokens: the packaged
Qwen2.5-Coder models know `<|fim_prefix|>`, `<|fim_suffix|>` and `<|fim_middle|>`; a model without them
refuses a suffix with a 400.

The request goes through the same gateway (keys, limits, the ledger), the same input and output guards
and the same streaming code as a raw chat completion (completions.py, with `Shape.text`), so only the
prompt and the reply's shape differ. Not offered: the `assistant` model (a turn answers messages), a
remote engine (it takes messages, not a prompt), and logprobs for the echoed prompt.
"""

from __future__ import annotations

from typing import Any

FIM_TOKENS = ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>")
NEEDS_LOCAL = ("/v1/completions needs the model served here in process (its tokenizer); `{model}` is served "
               "by a remote engine: use /v1/chat/completions.")
NO_FIM = ("`{model}` has no fill-in-the-middle tokens ({tokens}), so it cannot take a `suffix`: leave it out, "
          "or use a Qwen2.5-Coder model.")
NO_ECHO_LOGPROBS = "logprobs of an echoed prompt are not given: leave `echo` or `logprobs` out."


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


def guarded_text(req: Any) -> list[dict[str, Any]]:
    """What the input guard reads of a text request: its prompt (and suffix) as one user message."""
    text = req.prompt_text if req.prompt_text is not None else ""
    return [{"role": "user", "content": text + ("\n" + req.suffix if req.suffix else "")}]
