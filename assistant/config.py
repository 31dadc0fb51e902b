"""Configuration: frozen dataclasses, one per subsystem, under one `AssistantConfig`.

Values come, lowest precedence first, from the field defaults, an optional TOML file, `ASSISTANT_*`
environment variables, and finally explicit overrides (the CLI's flags). Everything is checked in
one place, `AssistantConfig.verify()`, which raises `ConfigError` with a message that says how to fix
the value.

TOML layout (every key optional)::

    data_dir = "./data"
    system_prompt = "You are a helpful assistant."
    [engine]
    model = "qwen2.5-coder-0.5b"
    num_threads = 2
    [server]
    port = 7860
    [safety]
    policy = "default"            # or strict, permissive-research; enabled = false turns the guards off
    [speech]
    stt_model = "tiny.en"         # or "base", a CTranslate2 Whisper dir; voice = "joe" (Piper)
    [vision]
    backend = "efficientnet"      # or "vit" with model = a local ViT/CLIP directory

Environment: `ASSISTANT_DATA_DIR`, `ASSISTANT_MODELS_DIR`, `ASSISTANT_CONFIG` (the TOML path) and
`ASSISTANT_<SECTION>_<FIELD>` for any section field, e.g. `ASSISTANT_ENGINE_MODEL=large`,
`ASSISTANT_SERVER_PORT=8000`, `ASSISTANT_STORE_URL=postgresql+psycopg://user@host/db`.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
import typing
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Mapping

from assistant.errors import ConfigError

AUTO = "auto"  # engine.large_model: the packaged large model if it is prepared, else none
AUTO_LARGE_MODEL = "large"

DEFAULT_SYSTEM_PROMPT = (
    "You are a helpful, honest assistant running fully offline on the user's own machine. "
    "Answer concisely and correctly. If you do not know, say so."
)


# a decoder layer's linears, in the order the engine's native layer stack takes them (engine/model.py)
INT8_LINEARS = ("qkv", "o", "gate_up", "down")


def int8_residual_linears(setting: str) -> tuple[str, ...]:
    """engine.int8_residual ("down", "qkv, down", "all", "" for none) -> the linears' names, checked."""
    names = INT8_LINEARS if setting.strip() == "all" else tuple(n.strip() for n in setting.split(",") if n.strip())
    if not set(names) <= set(INT8_LINEARS):
        raise ConfigError(f"engine.int8_residual={setting!r} is not valid: use a comma-separated list of "
                          f"{', '.join(INT8_LINEARS)}, or all, or \"\" for none (default: down).")
    return names


@dataclass(frozen=True)
class EngineConfig:
    model: str = "qwen2.5-coder-0.5b"  # a name from `assistant models list`, a local HF dir, or a .gguf file
    # second model for document, tool-heavy and long turns (assistant/routing.py): "auto" = the packaged 1.5B
    # when it is prepared (`make run` prepares it), a model name or path, or "" = every turn on engine.model
    large_model: str = "auto"
    # with a large model: general questions go to it too, writing requests ("Write a poem…") stay on engine.model
    # (assistant/routing.py has the measurements); false = only document, tool-heavy and long turns go to it
    large_for_questions: bool = True
    device: str = "auto"  # "auto" (CUDA when present, else CPU), "cpu", "cuda", "cuda:N"
    dtype: str = "auto"  # "auto" (float32 on CPU, bfloat16 on CUDA), "float32", "bfloat16", "float16"
    num_threads: int = 0  # CPU threads of torch and the native kernels; 0 = torch one per two vCPUs, kernels one per core (engine/loading.py)
    max_context_tokens: int = 0  # prompt + answer budget; 0 = the model's own context window (capped at 32768)
    max_new_tokens: int = 512  # default answer length limit when a request does not give one
    remote_url: str = ""  # an OpenAI-compatible server (vLLM, TGI, ...) instead of the in-process model
    remote_api_key: str = ""  # bearer token for remote_url, if the server wants one
    remote_model: str = ""  # model name served at remote_url; "" = the first one the server lists
    quantize: str = "auto"  # weights: "auto" (int8 on CPU, none on CUDA), "none", "int8" (weight-only, per channel)
    # int8 on CPU: the linears that refine generated rows beyond one int8 pass over their activations
    # (comma-separated from qkv, o, gate_up, down, or "all"; "" = none); engine/int8.py has the measured quality
    int8_residual: str = "down"
    # ... by keeping each row's N largest activations exact (fp32) and quantizing the rest more finely (0 to 32;
    # nearly free at any batch), or with 0 by a second pass over the rounding residual (a GEMM row per row)
    int8_outliers: int = 16
    kv_cache_mb: int = 1024  # memory for the paged KV cache; bounds concurrent context tokens
    # what the KV cache stores: "auto" (the model's dtype), "float32" or "bfloat16" (half the bytes attention
    # reads and twice the tokens in kv_cache_mb; engine/native.py has the measured agreement and speed)
    kv_dtype: str = "auto"
    block_size: int = 16  # tokens per KV block (prefix cache granularity)
    # on CUDA, decode steps replay captured CUDA graphs (engine/cuda_graphs.py); prompt-lookup speculation is off
    # there (its verify steps would run eager); false = every step eager, as on CPU
    cuda_graphs: bool = True
    max_num_seqs: int = 16  # requests decoded together in one batch
    max_batched_tokens: int = 512  # tokens computed per engine step (the CPU's native int8 path: at most 32, model.py)
    max_prefill_chunk: int = 64  # upper bound on prefill tokens per step while others stream (tuned below it)
    max_waiting: int = 64  # queued requests before new ones are refused as busy
    prefix_cache: bool = True  # reuse KV of shared prompt prefixes (system prompt, earlier turns, documents)
    # greedy requests draft tokens from their own prompt and output and verify them in one step where that pays
    # (engine/speculate.py); "off" = one token per step
    speculation: str = "prompt_lookup"
    # a smaller model with the same tokenizer that drafts tokens for the large model (engine/draft.py): a model
    # name or path; "" = none (prompt lookup drafts). With engine.large_model set it drafts for that one only
    draft_model: str = ""
    # semantic response cache of /v1 raw-model requests at temperature 0 without tools (server/response_cache.py):
    # off by default; on, it serves the tiers with response_cache = true (and an open server's local user)
    response_cache: bool = False
    response_cache_threshold: float = 0.94  # cosine similarity a hit needs (chosen by bench/semantic_cache.py)
    response_cache_ttl_s: int = 3600  # seconds an answer is served from the cache


@dataclass(frozen=True)
class TierConfig:
    """What an API key of one tier may do (`[server.tiers.NAME]`); 0 = no limit."""

    models: str = "*"  # comma-separated model ids this tier may use; "*" = every model
    rpm: int = 0  # requests per minute (token bucket: bursts up to rpm, refilled evenly)
    tpm: int = 0  # tokens (prompt + completion) per minute, same bucket shape
    daily_tokens: int = 0  # tokens per UTC day
    safety_policy: str = ""  # safety policy of this tier's conversations and raw completions ("" = safety.policy)
    response_cache: bool = False  # its raw-model requests may be answered from the semantic cache (engine.response_cache)
    priority: int = 0  # admission order when the engine queue is contended: higher goes first


def _default_tiers() -> dict[str, TierConfig]:
    return {"free": TierConfig(rpm=20, tpm=20_000, daily_tokens=200_000, priority=0),
            "paid": TierConfig(rpm=600, tpm=400_000, daily_tokens=0, priority=10)}


@dataclass(frozen=True)
class PriceConfig:
    """Price of one model's tokens (`[server.prices."MODEL"]`), in any currency, per million tokens."""

    prompt: float = 0.0  # per 1M uncached prompt tokens
    cached: float = 0.0  # per 1M prompt tokens served from the prefix cache
    completion: float = 0.0  # per 1M generated tokens


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"  # interface to bind; 0.0.0.0 exposes the chat to the network (needs keys)
    port: int = 7860  # web chat (and /v1 API) port
    api_keys: str = ""  # static comma-separated keys (tier `default_tier`); prefer `assistant keys create`
    default_tier: str = "free"  # tier of the static api_keys
    tiers: dict[str, TierConfig] = field(default_factory=_default_tiers)  # tier name -> limits
    prices: dict[str, PriceConfig] = field(default_factory=dict)  # model id -> price, for `assistant usage`
    redis_url: str = ""  # "" = rate limits in process; redis://host:6379/0 = shared by every replica
    max_body_bytes: int = 4 * 1024 * 1024  # larger request bodies are refused (413) before they are read
    max_upload_bytes: int = 64 * 1024 * 1024  # the same for uploads: recordings, pictures, files (web chat, /api/turns)
    max_running: int = 16  # generations the gateway lets run at once (keep >= engine.max_num_seqs)
    max_queued: int = 64  # requests waiting for a running slot; beyond that: 503 + Retry-After at once
    shared_library: bool = False  # keys also see and search, read-only, the documents no key owns (the CLI's)


@dataclass(frozen=True)
class StoreConfig:
    url: str = ""  # SQLAlchemy URL; "" = SQLite file <data_dir>/assistant.db; postgresql+psycopg://... scales out


@dataclass(frozen=True)
class RetrievalConfig:
    collection: str = "default"  # Qdrant collection that ingestion writes and retrieval reads
    qdrant_url: str = ""  # "" = embedded Qdrant Edge under <data_dir>/qdrant; http://host:6333 = a Qdrant server
    embedder: str = "all-minilm-l6-v2"  # packaged embedder name or a sentence-transformers directory
    top_k: int = 5  # chunks returned per search
    chunk_tokens: int = 200  # chunk size in the embedder's tokens (MiniLM reads at most 256)
    chunk_overlap: int = 30  # tokens repeated between neighbouring chunks of a page
    candidates: int = 50  # chunks each of the dense and the sparse search hand to RRF fusion
    # a question whose best cosine to any chunk is below this, and that names no document, section or term a
    # passage holds, is not about the documents: nothing is prefetched (MiniLM: general questions scored
    # 0.10-0.49, the eval's document questions 0.38-0.83); 0 = every question is searched
    min_relevance: float = 0.4
    embed_batch_size: int = 32  # chunks embedded (and upserted) per batch during ingestion
    embed_threads: int = 0  # torch threads for `assistant ingest`/`eval`; 0 = the idle cores (max 4); `serve` keeps the engine's
    search_threads: int = 1  # Qdrant Edge search threads (one is fastest for single small queries)
    ocr_languages: str = "eng"  # Tesseract languages, e.g. "eng+deu" (apt-get install tesseract-ocr-deu)


@dataclass(frozen=True)
class SandboxConfig:
    image: str = "assistant-sandbox:2"  # locally built image (see `assistant sandbox setup`); bump when its recipe changes
    runtime: str = "runc"  # "runc" or "runsc" (gVisor)
    memory_mb: int = 512  # memory limit == memory+swap limit
    cpus: float = 1.0  # CPU quota
    pids_limit: int = 64  # max processes inside the container
    timeout_s: float = 30.0  # wall-clock limit per execution
    tmpfs_mb: int = 64  # size of the writable /tmp work dir
    max_output_bytes: int = 65536  # stdout/stderr kept per stream; the rest is cut with a marker
    idle_reap_s: float = 600.0  # a conversation's warm container is removed after this idle time
    max_containers: int = 8  # bound on warm containers (LRU evicted)
    max_artifact_bytes: int = 8 * 1024 * 1024  # files the code writes that come back per run (the rest are listed only)
    debian_mirror: str = "http://deb.debian.org/debian"  # where `assistant sandbox setup` debootstraps the image from


@dataclass(frozen=True)
class SafetyConfig:
    enabled: bool = True  # input and output guards on every turn (assistant/safety); false = no guard at all
    policy: str = "default"  # default | strict | permissive-research | a name in policies_dir | a .toml path
    policies_dir: str = ""  # a folder of your own policy files (*.toml), added to the shipped ones
    head_dir: str = ""  # the trained head (safety_head.npz + .json); "" = the one shipped in assistant/safety/models
    # the policies' second opinions (the probe on the chat model, assistant/safety/probe.py): more caught and
    # fewer blocked, at ~120-160 ms more before the first token of a turn whose message is in doubt; false = the
    # heads decide alone
    second_opinion: bool = True
    # the input's detectors read beside the turn (its retrieval and prefill start at once; nothing is shown
    # until they allow it, a block cancels it); false = a message the fast detectors block never reaches the model
    check_beside_turn: bool = True


@dataclass(frozen=True)
class SpeechConfig:
    stt_backend: str = "faster-whisper"  # "faster-whisper" (CTranslate2) or "openai-whisper" (a .pt checkpoint)
    stt_model: str = "tiny.en"  # packaged "tiny.en" | "base", a CTranslate2 Whisper dir, or a .pt for openai-whisper
    language: str = ""  # spoken language code ("en", "de", ...); "" = the model detects it
    device: str = "auto"  # "auto" (CUDA when present: float16; else CPU: int8), "cpu", "cuda"
    num_threads: int = 0  # CPU threads for speech models; 0 = one per two vCPUs
    max_seconds: float = 600.0  # longest recording accepted; longer ones are refused with a message
    tts_backend: str = "piper"  # "piper" (ONNX voices); Coqui cannot run beside the CPU torch here (README)
    voice: str = "joe"  # packaged Piper voice "joe", or a Piper .onnx file (with its .onnx.json beside it)
    speak_answers: bool = False  # speak every answer (front ends can also ask for it per turn)


@dataclass(frozen=True)
class VisionConfig:
    backend: str = "efficientnet"  # "efficientnet" (packaged EfficientNet-Lite0) or "vit" (a local ViT/CLIP dir)
    model: str = "lite0"  # packaged "lite0", or the path of a transformers ViT / CLIP vision directory
    ocr: bool = True  # read text in pictures with Tesseract
    ocr_languages: str = "eng"  # Tesseract language codes joined by "+", e.g. "eng+deu"
    top_k: int = 3  # labels kept in an image's description
    max_pixels: int = 50_000_000  # larger images are refused (decompression-bomb guard)


@dataclass(frozen=True)
class AssistantConfig:
    data_dir: Path = Path("./data")  # models/, qdrant/, assistant.db, uploads/, logs/ live here
    models_dir: Path | None = None  # prepared models; None = <data_dir>/models (share one across data dirs)
    system_prompt: str = DEFAULT_SYSTEM_PROMPT  # first message of every conversation
    engine: EngineConfig = field(default_factory=EngineConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    store: StoreConfig = field(default_factory=StoreConfig)
    retrieval: RetrievalConfig = field(default_factory=RetrievalConfig)
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)
    safety: SafetyConfig = field(default_factory=SafetyConfig)
    speech: SpeechConfig = field(default_factory=SpeechConfig)
    vision: VisionConfig = field(default_factory=VisionConfig)

    # -- derived paths -------------------------------------------------------------------------
    @property
    def resolved_models_dir(self) -> Path:
        return Path(self.models_dir) if self.models_dir is not None else Path(self.data_dir) / "models"

    @property
    def api_keys(self) -> tuple[str, ...]:
        return tuple(k.strip() for k in self.server.api_keys.split(",") if k.strip())

    @property
    def store_url(self) -> str:
        return self.store.url or f"sqlite:///{Path(self.data_dir).resolve() / 'assistant.db'}"

    # -- loading -------------------------------------------------------------------------------
    @classmethod
    def load(
        cls,
        path: str | Path | None = None,
        *,
        env: Mapping[str, str] | None = None,
        overrides: Mapping[str, Any] | None = None,
    ) -> "AssistantConfig":
        """Defaults <- TOML file <- ASSISTANT_* env <- overrides ({"data_dir": ..., "engine.model": ...})."""
        env = os.environ if env is None else env
        values: dict[str, Any] = {}
        path = path or env.get("ASSISTANT_CONFIG")
        if path:
            values = _read_toml(Path(path))
        _merge(values, _from_env(env))
        for key, value in (overrides or {}).items():
            if value is None:
                continue
            section, _, name = key.rpartition(".")
            (values.setdefault(section, {}) if section else values)[name] = value
        config = _build(cls, values, where="")
        config.verify()
        return config

    def verify(self) -> None:
        """Raise ConfigError naming the first bad value and how to fix it."""
        from assistant.models import known_model_names  # local: keeps config free of import cycles

        e, s = self.engine, self.server
        if not e.remote_url and e.model not in known_model_names() and not _looks_like_path(e.model):
            raise ConfigError(
                f"Unknown model {e.model!r} in engine.model. Available: {', '.join(known_model_names())}; "
                "or give the path of a local Hugging Face model directory or a .gguf file."
            )
        if e.large_model not in ("", AUTO) and e.large_model not in known_model_names() \
                and not _looks_like_path(e.large_model):
            raise ConfigError(
                f"Unknown model {e.large_model!r} in engine.large_model. Available: {', '.join(known_model_names())}; "
                "or a local model path; or \"\" to serve every turn with engine.model."
            )
        if e.device not in ("auto", "cpu", "cuda") and not e.device.startswith("cuda:"):
            raise ConfigError(f"engine.device={e.device!r} is not valid: use auto, cpu, cuda or cuda:N.")
        if e.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ConfigError(f"engine.dtype={e.dtype!r} is not valid: use auto, float32, bfloat16 or float16.")
        if e.num_threads < 0:
            raise ConfigError(f"engine.num_threads={e.num_threads} must be >= 0 (0 picks automatically).")
        if e.max_new_tokens < 1:
            raise ConfigError(f"engine.max_new_tokens={e.max_new_tokens} must be at least 1.")
        if e.kv_dtype not in ("auto", "float32", "bfloat16"):
            raise ConfigError(f"engine.kv_dtype={e.kv_dtype!r} is not valid: use auto, float32 or bfloat16.")
        if e.quantize not in ("auto", "none", "int8"):
            raise ConfigError(f"engine.quantize={e.quantize!r} is not valid: use auto, none or int8.")
        int8_residual_linears(e.int8_residual)
        if not 0 <= e.int8_outliers <= 32:
            raise ConfigError(f"engine.int8_outliers={e.int8_outliers} must be 0 to 32 (0 = the residual pass).")
        for name in ("kv_cache_mb", "block_size", "max_num_seqs", "max_batched_tokens", "max_prefill_chunk", "max_waiting"):
            if getattr(e, name) < 1:
                raise ConfigError(f"engine.{name}={getattr(e, name)} must be at least 1.")
        if e.max_context_tokens < 0:
            raise ConfigError(f"engine.max_context_tokens={e.max_context_tokens} must be >= 0 (0 = model's window).")
        if not 0.0 < e.response_cache_threshold <= 1.0:
            raise ConfigError(f"engine.response_cache_threshold={e.response_cache_threshold} must be in (0, 1].")
        if e.response_cache_ttl_s < 1:
            raise ConfigError(f"engine.response_cache_ttl_s={e.response_cache_ttl_s} must be at least 1.")
        if e.speculation not in ("prompt_lookup", "off"):
            raise ConfigError(f"engine.speculation={e.speculation!r} is not valid: use prompt_lookup or off.")
        if not 0 < s.port < 65536:
            raise ConfigError(f"server.port={s.port} is out of range: pick a port between 1 and 65535, e.g. 7860.")
        if s.default_tier not in s.tiers:
            raise ConfigError(f"server.default_tier={s.default_tier!r} is not a tier: define [server.tiers.{s.default_tier}] "
                              f"or use one of {', '.join(sorted(s.tiers))}.")
        for name, tier in s.tiers.items():
            for limit in ("rpm", "tpm", "daily_tokens"):
                if getattr(tier, limit) < 0:
                    raise ConfigError(f"server.tiers.{name}.{limit}={getattr(tier, limit)} must be >= 0 (0 = no limit).")
        for model, price in s.prices.items():
            if min(price.prompt, price.cached, price.completion) < 0:
                raise ConfigError(f"server.prices.{model!r}: prices must be >= 0.")
        if s.redis_url and not s.redis_url.startswith(("redis://", "rediss://", "unix://")):
            raise ConfigError(f"server.redis_url={s.redis_url!r}: use redis://host:6379/0 (or \"\" for in-process limits).")
        for name in ("max_body_bytes", "max_upload_bytes", "max_running", "max_queued"):
            if getattr(s, name) < 1:
                raise ConfigError(f"server.{name}={getattr(s, name)} must be at least 1.")
        if self.sandbox.runtime not in ("runc", "runsc"):
            raise ConfigError(f"sandbox.runtime={self.sandbox.runtime!r}: use runc (default) or runsc (gVisor).")
        sb = self.sandbox
        for name in ("memory_mb", "cpus", "pids_limit", "timeout_s", "tmpfs_mb", "max_output_bytes", "max_containers"):
            if getattr(sb, name) <= 0:
                raise ConfigError(f"sandbox.{name}={getattr(sb, name)} must be positive; remove it to use the default.")
        if sb.pids_limit < 16:
            raise ConfigError(f"sandbox.pids_limit={sb.pids_limit} is too small for python3 to start: use at least 16.")
        r = self.retrieval
        if r.top_k < 1:
            raise ConfigError(f"retrieval.top_k={r.top_k} must be at least 1.")
        if not 16 <= r.chunk_tokens <= 8192:
            raise ConfigError(f"retrieval.chunk_tokens={r.chunk_tokens} must be between 16 and 8192 (default 200).")
        if not 0 <= r.chunk_overlap < r.chunk_tokens:
            raise ConfigError(f"retrieval.chunk_overlap={r.chunk_overlap} must be >= 0 and below chunk_tokens={r.chunk_tokens}.")
        if r.candidates < 1 or r.embed_batch_size < 1:
            raise ConfigError("retrieval.candidates and retrieval.embed_batch_size must be at least 1.")
        if r.embed_threads < 0 or r.search_threads < 1:
            raise ConfigError("retrieval.embed_threads must be >= 0 (0 = auto) and retrieval.search_threads >= 1.")
        if not r.ocr_languages or not all(part.isidentifier() for part in r.ocr_languages.split("+")):
            raise ConfigError(f"retrieval.ocr_languages={r.ocr_languages!r}: use Tesseract codes joined by '+', e.g. eng+deu.")
        if not self.safety.policy.strip():
            raise ConfigError("safety.policy is empty: use default, strict or permissive-research "
                              "(or safety.enabled = false to turn the guards off).")
        sp, v = self.speech, self.vision
        if sp.stt_backend not in ("faster-whisper", "openai-whisper"):
            raise ConfigError(f"speech.stt_backend={sp.stt_backend!r}: use faster-whisper or openai-whisper.")
        if sp.tts_backend == "coqui":
            raise ConfigError("speech.tts_backend=\"coqui\" is not available: Coqui TTS needs torchaudio, and the only "
                              "torchaudio wheels to be had here are CUDA builds that do not load beside the CPU torch "
                              "(see README, Voice and pictures). Use piper.")
        if sp.tts_backend != "piper":
            raise ConfigError(f"speech.tts_backend={sp.tts_backend!r}: use piper.")
        if sp.device not in ("auto", "cpu", "cuda") and not sp.device.startswith("cuda:"):
            raise ConfigError(f"speech.device={sp.device!r} is not valid: use auto, cpu, cuda or cuda:N.")
        if sp.max_seconds <= 0 or sp.num_threads < 0:
            raise ConfigError("speech.max_seconds must be positive and speech.num_threads >= 0 (0 = auto).")
        if v.backend not in ("efficientnet", "vit"):
            raise ConfigError(f"vision.backend={v.backend!r}: use efficientnet or vit.")
        if v.top_k < 1 or v.max_pixels < 1:
            raise ConfigError("vision.top_k and vision.max_pixels must be at least 1.")
        if not v.ocr_languages or not all(part.isidentifier() for part in v.ocr_languages.split("+")):
            raise ConfigError(f"vision.ocr_languages={v.ocr_languages!r}: use Tesseract codes joined by '+', e.g. eng+deu.")
        if not self.system_prompt.strip():
            raise ConfigError("system_prompt is empty: remove the setting to use the default, or write one.")

    def with_data_dir(self, data_dir: str | Path) -> "AssistantConfig":
        return replace(self, data_dir=Path(data_dir))


def _looks_like_path(model: str) -> bool:
    return model.endswith(".gguf") or "/" in model or os.sep in model or Path(model).exists()


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError as e:
        raise ConfigError(f"Config file {path} does not exist: create it or unset ASSISTANT_CONFIG.") from e
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"Config file {path} is not valid TOML: {e}") from e


def _merge(into: dict[str, Any], new: Mapping[str, Any]) -> None:
    for key, value in new.items():
        if isinstance(value, Mapping) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = value


def _sections() -> dict[str, type]:
    hints = typing.get_type_hints(AssistantConfig)
    return {f.name: hints[f.name] for f in dataclasses.fields(AssistantConfig) if dataclasses.is_dataclass(hints[f.name])}


def _from_env(env: Mapping[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in ("data_dir", "models_dir", "system_prompt"):
        if f"ASSISTANT_{name.upper()}" in env:
            out[name] = env[f"ASSISTANT_{name.upper()}"]
    for section, cls in _sections().items():
        for f in dataclasses.fields(cls):
            key = f"ASSISTANT_{section.upper()}_{f.name.upper()}"
            if key in env:
                out.setdefault(section, {})[f.name] = env[key]
    return out


def _build(cls: type, values: Mapping[str, Any], where: str) -> Any:
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = set(values) - known
    if unknown:
        name = sorted(unknown)[0]
        raise ConfigError(f"Unknown setting {where}{name!r}. Known settings here: {', '.join(sorted(known))}.")
    kwargs: dict[str, Any] = {}
    for name, value in values.items():
        hint = hints[name]
        if typing.get_origin(hint) is dict and dataclasses.is_dataclass(typing.get_args(hint)[1]):
            kwargs[name] = _build_table(typing.get_args(hint)[1], value, f"{where}{name}")
        elif dataclasses.is_dataclass(hint):
            if not isinstance(value, Mapping):
                raise ConfigError(f"Setting {where}{name!r} must be a table/section, got {value!r}.")
            kwargs[name] = _build(hint, value, where=f"{where}{name}.")
        else:
            kwargs[name] = _coerce(value, hint, f"{where}{name}")
    return cls(**kwargs)


def _build_table(cls: type, value: Any, where: str) -> dict[str, Any]:
    """A table of named sections, e.g. [server.tiers.free]; from the environment, a JSON object."""
    if isinstance(value, str):
        import json

        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ConfigError(f"Setting {where} must be a JSON object like {{\"free\": {{\"rpm\": 20}}}}: {e}") from e
    if not isinstance(value, Mapping) or not all(isinstance(v, Mapping) for v in value.values()):
        raise ConfigError(f"Setting {where} must be a table of tables, e.g. [{where}.NAME], got {value!r}.")
    return {str(k): _build(cls, v, where=f"{where}.{k}.") for k, v in value.items()}


def _coerce(value: Any, hint: Any, name: str) -> Any:
    args = typing.get_args(hint)
    if type(None) in args:  # Optional[X]
        if value is None or value == "":
            return None
        hint = next(a for a in args if a is not type(None))
    try:
        if hint is bool:
            if isinstance(value, str):
                if value.lower() in ("1", "true", "yes", "on"):
                    return True
                if value.lower() in ("0", "false", "no", "off"):
                    return False
                raise ValueError(value)
            return bool(value)
        if hint in (int, float):
            if isinstance(value, bool):
                raise ValueError(value)
            return hint(value)
        if hint is Path:
            return Path(str(value))
        if hint is str:
            return str(value)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"Setting {name}={value!r} is not a valid {getattr(hint, '__name__', hint)}.") from e
    return value
