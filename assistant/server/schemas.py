"""Request models of the /v1 and /api routes: every client mistake is caught here, before any engine work.

The models are strict (no "0.7" for a number, no "5" for a seed, no 1 for a stop string), floats must
be finite (Python's json accepts NaN and Infinity), and unknown fields are ignored like OpenAI's
optional extras. Content may be a list of parts: text parts are joined, `image_url` parts must be
`data:image/...;base64,` URLs (the server never fetches from the network) and are decoded into the
message's `images` (bytes), which the API describes with the vision backend before the model sees them.
`parse_chat_request(raw_bytes)` returns a `ChatCompletionRequest` or raises
`RequestError` with the OpenAI error fields (message, param) for an HTTP 400. The /api routes' bodies
(turns, conversations: TurnRequest, Rename, Edit, ...) are declared in their routes' signatures, so
FastAPI validates them and the OpenAPI schema shows them.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from dataclasses import replace
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import (AfterValidator, BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, ValidationInfo,
                      field_validator, model_validator)

from assistant.engine.base import MAX_LOGIT_BIAS, MAX_TOP_LOGPROBS, SamplingParams
from assistant.seams import Attachment, UserInput

MAX_TOKENS_DEFAULT = 512
MAX_STOP_STRINGS = 4  # OpenAI's limit
MAX_IMAGES = 8  # pictures per request
DATA_URL = re.compile(r"data:(image/[\w.+-]+)?(;[\w-]+=[^;,]*)*;base64,(.*)", re.S)


class RequestError(ValueError):
    """A request the API refuses with HTTP 400 (OpenAI's invalid_request_error)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message, self.param = message, param


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionCall(_Strict):
    model_config = ConfigDict(strict=True, extra="allow")
    name: str = Field(min_length=1)
    arguments: Union[str, dict[str, Any]] = "{}"  # OpenAI sends a JSON string; the agent passes a dict


class ToolCall(_Strict):
    model_config = ConfigDict(strict=True, extra="allow")
    id: Optional[str] = None
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(_Strict):
    role: Literal["system", "user", "assistant", "tool"]
    content: Optional[str] = None  # a list of text parts is joined into one string (see below)
    name: Optional[str] = None
    tool_calls: Optional[list[ToolCall]] = None
    tool_call_id: Optional[str] = None

    _images: list[bytes] = PrivateAttr(default_factory=list)

    @property
    def images(self) -> list[bytes]:
        """The decoded pictures of this message's `image_url` parts, in order."""
        return self._images

    @model_validator(mode="wrap")
    @classmethod
    def _keep_images(cls, data: Any, handler: Any) -> "Message":
        message = handler(data)  # `content` is checked (and its text parts joined) by the field validator
        if isinstance(data, dict) and isinstance(data.get("content"), list):
            message._images = _split_parts(data["content"])[1]
            if message._images and message.role != "user":
                raise ValueError("only user messages may carry images")
        return message

    @field_validator("content", mode="before")
    @classmethod
    def _join_text_parts(cls, value: Any) -> Any:
        if value is None or isinstance(value, str):
            return value
        if not isinstance(value, list):
            raise ValueError("content must be a string or a list of content parts")
        return _split_parts(value)[0]

    @model_validator(mode="after")
    def _content_present(self) -> "Message":
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a {self.role} message needs content (only an assistant message with "
                             "tool_calls may omit it)")
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("only assistant messages may carry tool_calls")
        return self

    def for_engine(self) -> dict[str, Any]:
        """The message as chat templates expect it: content always a string."""
        out: dict[str, Any] = {"role": self.role, "content": self.content or ""}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump(exclude_none=True) for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


def _split_parts(parts: list[Any]) -> tuple[str, list[bytes]]:
    """(joined text, decoded pictures) of a content-part list; ValueError names the bad part."""
    texts, images = [], []
    for i, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind == "text":
            if not isinstance(part.get("text"), str):
                raise ValueError(f"content part {i} needs a string 'text'")
            texts.append(part["text"])
        elif kind == "image_url":
            images.append(_data_url_image(part.get("image_url"), i))
        else:
            raise ValueError(f"content part {i} has type {kind!r}: use text or image_url parts")
    return "".join(texts), images


def _data_url_image(value: Any, index: int) -> bytes:
    url = value.get("url") if isinstance(value, dict) else value
    if not isinstance(url, str):
        raise ValueError(f"content part {index}: image_url needs a 'url' string")
    match = DATA_URL.fullmatch(url.strip())
    if match is None:
        raise ValueError(f"content part {index}: only data: URLs (data:image/png;base64,...) are accepted; this "
                         "server works offline and never fetches a picture from the network")
    try:
        data = base64.b64decode(match.group(3), validate=True)
    except (binascii.Error, ValueError) as e:
        raise ValueError(f"content part {index}: the image's base64 data is not valid ({e})") from None
    if not data:
        raise ValueError(f"content part {index}: the image is empty")
    return data


class FunctionSpec(_Strict):
    model_config = ConfigDict(strict=True, extra="allow")
    name: str = Field(min_length=1)
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None


class Tool(_Strict):
    model_config = ConfigDict(strict=True, extra="allow")
    type: Literal["function"] = "function"
    function: FunctionSpec


class StreamOptions(_Strict):
    include_usage: Optional[bool] = None


class FunctionName(_Strict):
    name: str = Field(min_length=1)


class NamedToolChoice(_Strict):
    type: Literal["function"] = "function"
    function: FunctionName


class ResponseFormat(_Strict):
    model_config = ConfigDict(strict=True, extra="allow")
    type: Literal["text", "json_object", "json_schema"]


class _Sampled(_Strict):
    """The sampling fields /v1/chat/completions and /v1/completions share."""

    model: Optional[str] = None
    temperature: Optional[float] = Field(None, ge=0, le=2, allow_inf_nan=False)
    top_p: Optional[float] = Field(None, gt=0, le=1, allow_inf_nan=False)
    top_k: Optional[int] = Field(None, ge=0)
    max_tokens: Optional[int] = Field(None, ge=1)
    stop: Optional[list[str]] = None  # a single string is accepted and wrapped (see below)
    seed: Optional[int] = Field(None, ge=-(2**63), lt=2**64)  # torch.Generator.manual_seed's range
    n: Optional[int] = Field(None, ge=1, le=1)  # one choice per request
    stream: Optional[bool] = None
    stream_options: Optional[StreamOptions] = None
    presence_penalty: Optional[float] = Field(None, ge=-2, le=2, allow_inf_nan=False)
    frequency_penalty: Optional[float] = Field(None, ge=-2, le=2, allow_inf_nan=False)
    logit_bias: Optional[dict[str, float]] = None  # token id (as a string) -> -100..100, added to its logit

    @field_validator("logit_bias")
    @classmethod
    def _token_biases(cls, value: Any) -> Any:
        if value is None:
            return None
        if len(value) > MAX_LOGIT_BIAS:
            raise ValueError(f"biases at most {MAX_LOGIT_BIAS} tokens")
        for token, bias in value.items():
            if not token.isdigit():
                raise ValueError(f"keys are token ids (integers as strings), not {token!r}")
            if not -100 <= bias <= 100:
                raise ValueError(f"token {token}'s bias {bias} is outside -100..100")
        return value

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_strings(cls, value: Any) -> Any:
        if value is None:
            return None
        if isinstance(value, str):
            value = [value]
        if (not isinstance(value, list) or len(value) > MAX_STOP_STRINGS
                or not all(isinstance(s, str) and s for s in value)):
            raise ValueError(f"must be a non-empty string or a list of up to {MAX_STOP_STRINGS} non-empty strings")
        return value

    def _params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        params = SamplingParams(
            temperature=self.temperature if self.temperature is not None else 0.0,
            top_p=self.top_p if self.top_p is not None else 1.0,
            top_k=self.top_k or 0,
            max_tokens=max_tokens,
            stop=tuple(self.stop or ()),
            seed=self.seed,
            logprobs=logprobs,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            logit_bias=tuple((int(t), float(b)) for t, b in (self.logit_bias or {}).items()),
        )
        params.verify()  # cannot fail after the checks above; kept as the engines' own contract
        return params

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(_Sampled):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    tools: Optional[list[Tool]] = None
    tool_choice: Optional[Union[Literal["auto", "none", "required"], NamedToolChoice]] = None
    parallel_tool_calls: Optional[bool] = None  # accepted; the model may make several calls either way
    response_format: Optional[ResponseFormat] = None
    logprobs: Optional[bool] = None  # each generated token's log-probability (raw models only)
    top_logprobs: Optional[int] = Field(None, ge=0, le=MAX_TOP_LOGPROBS)  # and its n most likely alternatives

    @model_validator(mode="after")
    def _few_images(self) -> "ChatCompletionRequest":
        count = sum(len(m.images) for m in self.messages)
        if count > MAX_IMAGES:
            raise ValueError(f"{count} images were sent; at most {MAX_IMAGES} per request are accepted")
        return self

    @field_validator("tool_choice")
    @classmethod
    def _choice_names_a_tool(cls, value: Any, info: ValidationInfo) -> Any:
        tools = info.data.get("tools") or []
        if value is None or value == "none":
            return value
        if not tools:
            raise ValueError("tool_choice needs `tools` to choose from")
        if isinstance(value, NamedToolChoice) and value.function.name not in {t.function.name for t in tools}:
            raise ValueError(f"names the function {value.function.name!r}, which is not among `tools`")
        return value

    @field_validator("top_logprobs")
    @classmethod
    def _top_needs_logprobs(cls, value: Any, info: ValidationInfo) -> Any:
        if value is not None and not info.data.get("logprobs"):
            raise ValueError("needs `logprobs: true`")
        return value

    def sampling_params(self) -> SamplingParams:
        return self._params(self.max_tokens or self.max_completion_tokens or MAX_TOKENS_DEFAULT,
                            (self.top_logprobs or 0) if self.logprobs else None)

    def engine_messages(self) -> list[dict[str, Any]]:
        return [m.for_engine() for m in self.messages]

    def engine_tools(self) -> list[dict[str, Any]] | None:
        """The tools the model is shown: none when tool_choice is "none"."""
        if not self.tools or self.tool_choice == "none":
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools]

    @property
    def tool_names(self) -> list[str]:
        return [t.function.name for t in self.tools] if self.engine_tools() else []

    @property
    def forced_tool(self) -> str | None:
        """None: the model decides; "": it must call some tool ("required"); else the tool it must call."""
        if isinstance(self.tool_choice, NamedToolChoice):
            return self.tool_choice.function.name
        return "" if self.tool_choice == "required" else None

    @property
    def wants_json(self) -> bool:
        return self.response_format is not None and self.response_format.type != "text"

TEXT_MAX_TOKENS_DEFAULT = 16  # OpenAI's default for /v1/completions
MAX_TEXT_LOGPROBS = 5  # OpenAI's limit for /v1/completions' logprobs


class TextCompletionRequest(_Sampled):
    """/v1/completions: the model continues `prompt` as it stands (no chat template); with `suffix`, it
    fills in what goes between the two (fill-in-the-middle)."""

    prompt: Union[str, list[str], list[int]]
    max_tokens: Optional[int] = Field(None, ge=0)  # 0: score the prompt (with echo and logprobs), write nothing
    suffix: Optional[str] = None
    echo: Optional[bool] = None
    best_of: Optional[int] = Field(None, ge=1, le=1)  # one candidate per request
    logprobs: Optional[int] = Field(None, ge=0, le=MAX_TEXT_LOGPROBS)

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, value: Any) -> Any:
        if isinstance(value, list) and not value:
            raise ValueError("must not be empty")
        if isinstance(value, list) and isinstance(value[0], str) and len(value) != 1:
            raise ValueError("one prompt per request: send a string, or a list of one string")
        if isinstance(value, list) and isinstance(value[0], int) and min(value) < 0:
            raise ValueError("token ids are integers from 0")
        if (isinstance(value, str) or isinstance(value, list) and isinstance(value[0], str)) and not (
                value if isinstance(value, str) else value[0]):
            raise ValueError("must not be empty")
        return value

    @model_validator(mode="after")
    def _echo_plain(self) -> "TextCompletionRequest":
        if self.echo and self.suffix is not None:
            raise ValueError("cannot echo a fill-in-the-middle prompt: leave `echo` or `suffix` out")
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("`max_tokens: 0` writes nothing: it is for scoring an echoed prompt (`echo: true`)")
        return self

    @property
    def scores_prompt(self) -> bool:
        return bool(self.echo) and self.logprobs is not None

    @property
    def prompt_text(self) -> str | None:
        """The prompt as text; None when it was sent as token ids."""
        if isinstance(self.prompt, str):
            return self.prompt
        return self.prompt[0] if isinstance(self.prompt[0], str) else None

    def sampling_params(self) -> SamplingParams:
        """max_tokens 0 asks the engine for one token, which the reply leaves out (text_completions.py)."""
        params = self._params(max(1, self.max_tokens if self.max_tokens is not None else TEXT_MAX_TOKENS_DEFAULT),
                              self.logprobs)
        return replace(params, prompt_logprobs=self.logprobs) if self.scores_prompt else params


def parse_text_request(raw: bytes) -> TextCompletionRequest:
    """Decode and validate a /v1/completions body, or raise RequestError."""
    return _validate(TextCompletionRequest, _decode(raw))


def _param(loc: tuple[Any, ...]) -> str | None:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or None


def parse_chat_request(raw: bytes) -> ChatCompletionRequest:
    """Decode and validate a /v1/chat/completions body, or raise RequestError."""
    return _validate(ChatCompletionRequest, _decode(raw))

MAX_EMBEDDING_INPUTS = 2048  # OpenAI's limit per request


class EmbeddingsRequest(_Strict):
    model: str = Field(min_length=1)
    input: Union[str, list[str]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Optional[int] = Field(None, ge=1)
    user: Optional[str] = None

    @field_validator("input")
    @classmethod
    def _texts(cls, value: Any) -> Any:
        texts = [value] if isinstance(value, str) else value
        if not texts or len(texts) > MAX_EMBEDDING_INPUTS:
            raise ValueError(f"must be a string or a list of 1 to {MAX_EMBEDDING_INPUTS} strings")
        if any(not t for t in texts):
            raise ValueError("inputs must not be empty strings")
        return value

    @field_validator("dimensions")
    @classmethod
    def _no_dimensions(cls, value: Any) -> Any:
        if value is not None:
            raise ValueError("the embedder makes vectors of one fixed size: leave `dimensions` out")
        return value

    @property
    def texts(self) -> list[str]:
        return [self.input] if isinstance(self.input, str) else list(self.input)


def _decode(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise RequestError(f"The request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise RequestError("The request body must be a JSON object.")
    return body


def _validate(model: type[BaseModel], body: dict[str, Any]) -> Any:
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise RequestError(*first_error(e.errors(include_url=False))) from None


def first_error(errors: Any) -> tuple[str, str | None]:
    """(message, param) of the first of pydantic's `errors`, as the API reports a 400."""
    error = errors[0]
    param = _param(tuple(error["loc"]))
    message = str(error["msg"]).removeprefix("Value error, ")
    return (f"{param}: {message}" if param else message), param


def parse_embeddings_request(raw: bytes) -> EmbeddingsRequest:
    """Decode and validate a /v1/embeddings body, or raise RequestError."""
    return _validate(EmbeddingsRequest, _decode(raw))


# -- the /api routes (turns.py, rest.py) ------------------------------------------------------------
MAX_TURN_TEXT = 100_000
MAX_TITLE = 200


class FilePart(BaseModel):
    name: str = Field(min_length=1, max_length=255, description="file name, e.g. question.webm")
    data: str = Field(description="the file's bytes, base64")

    @field_validator("data")
    @classmethod
    def _base64(cls, value: str) -> str:
        try:
            if not base64.b64decode(value, validate=True):
                raise ValueError("the file is empty")
        except binascii.Error as e:
            raise ValueError(f"data is not valid base64 ({e})") from None
        return value

    def attachment(self) -> Attachment:
        return Attachment(self.name, data=base64.b64decode(self.data))


class TurnInput(BaseModel):
    """One turn of a stored conversation (POST /api/conversations/{id}/turns)."""

    text: str = Field(default="", max_length=MAX_TURN_TEXT, description="the user's message ('' when audio carries it)")
    max_tokens: int | None = Field(default=None, ge=1, le=32768, description="answer length limit")
    audio: FilePart | None = Field(default=None, description="the question spoken: its transcript becomes the message")
    images: list[FilePart] = Field(default_factory=list, max_length=MAX_IMAGES,
                                   description="pictures the question is about")
    speak: bool = Field(default=False, description="also answer in speech (`audio` events)")

    @model_validator(mode="after")
    def _something_to_answer(self) -> "TurnInput":
        if not self.text.strip() and self.audio is None and not self.images:
            raise ValueError("send `text`, or `audio` with the spoken question, or `images`")
        return self

    def user_input(self) -> UserInput:
        return UserInput(self.text, self.audio.attachment() if self.audio else None,
                         tuple(i.attachment() for i in self.images), speak=self.speak)


class TurnRequest(TurnInput):
    """POST /api/turns: a turn of a new conversation, or of `conversation_id`."""

    conversation_id: str | None = Field(default=None, description="continue this conversation (default: a new one)")


class NewConversation(_Strict):
    title: str = Field(default="", max_length=MAX_TITLE, description="shown in conversation lists")


def _not_blank(value: str) -> str:
    if not value.strip():
        raise ValueError("must not be blank")
    return value.strip()


class Rename(_Strict):
    title: Annotated[str, AfterValidator(_not_blank)] = Field(max_length=MAX_TITLE, description="the new title")


class Regenerate(_Strict):
    max_tokens: Optional[int] = Field(None, ge=1, le=32768, description="answer length limit")


class Edit(Regenerate):
    text: Annotated[str, AfterValidator(_not_blank)] = Field(max_length=MAX_TURN_TEXT,
                                                             description="the question, as it should have been")
