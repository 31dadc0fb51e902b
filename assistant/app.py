"""The composition root: `build_assistant(config) -> Assistant`, the one place the app is wired.

It builds the engine(s) and the router, the store, the retriever handle with its prefetch, the tool
registry, the safety guards, and voice and vision (assistant/modalities.py: the turn's pre-stage and
the speaker of spoken answers), and it owns their lifetimes: `Assistant.close()` closes everything it opened.
Every front end (CLI, web chat, terminal, eval, HTTP server, notebook widget) gets an `Assistant`
and uses only its facade:

    assistant.turn(conversation_id, UserInput | str)  -> Iterator[TurnEvent]   (and regenerate, edit)
    assistant.conversations   list / history / rename / delete / export / branches / switch
    assistant.documents       ingest / list / delete
    assistant.models          ids / generate (raw completions for /v1) / count_tokens / embed
    assistant.keys · owners · usage   API keys, who owns what, the usage ledger (the gateway's tables)
    assistant.safety          set_policy / policy_of / audit_log / moderate (None with safety.enabled = false)
    assistant.media           transcribe / speak / describe_image (voice and vision, loaded on first use)

Nothing outside this module reaches into `.engine`, `.store` or the retriever.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

from assistant.agent_loop import AgentOptions
from assistant.config import AUTO, AUTO_LARGE_MODEL, AssistantConfig
from assistant.engine.base import Engine, Message, SamplingParams, TokenDelta
from assistant.errors import AssistantError, ConfigError
from assistant.events import ToolCallFinished, ToolCallStarted, TurnEvent
from assistant.keys import Keys, Owners
from assistant.modalities import Modalities
from assistant.orchestrator import Orchestrator
from assistant.routing import LARGE, SMALL, Router, RoutingPolicy
from assistant.seams import Attachment, InputGuard, PreStage, StreamTransformer, UserInput
from assistant.store import Conversation, Store, StoredMessage
from assistant.usage import UsageLedger


class Conversations:
    """Stored conversations (the active branch of each, and its alternatives)."""

    def __init__(self, store: Store) -> None:
        self._store = store

    def list(self) -> list[Conversation]:
        return self._store.list_conversations()

    def get(self, conversation_id: str) -> Conversation:
        return self._store.get_conversation(conversation_id)

    def history(self, conversation_id: str) -> list[StoredMessage]:
        return self._store.history(conversation_id)

    def message(self, message_id: str) -> StoredMessage:
        return self._store.get_message(message_id)

    def siblings(self, message_id: str) -> list[StoredMessage]:
        return self._store.siblings(message_id)

    def start(self, messages: Sequence[Message] = (), *, title: str = "") -> str:
        """A new conversation holding `messages` (user/assistant turns sent by a stateless client)."""
        conversation = self._store.create_conversation(title)
        for m in messages:
            if m.get("role") in ("user", "assistant") and m.get("content"):
                self._store.add_message(conversation.id, m["role"], str(m["content"]))
        return conversation.id

    def rename(self, conversation_id: str, title: str) -> None:
        self._store.rename_conversation(conversation_id, title)

    def delete(self, conversation_id: str) -> None:
        self._store.delete_conversation(conversation_id)

    def switch(self, conversation_id: str, message_id: str) -> StoredMessage:
        return self._store.switch_branch(conversation_id, message_id)

    def export(self, conversation_id: str, fmt: str = "json") -> str:
        from assistant.conversations import export_json, export_markdown

        return export_markdown(self._store, conversation_id) if fmt == "md" else export_json(self._store, conversation_id)


class Documents:
    """The user's document library: ingestion goes through the retriever's own index, because an
    embedded index has one owner process (the one that also answers searches)."""

    def __init__(self, handle: Any, describe_image: Callable[[Path], str] | None = None,
                 screen: Callable[[list[str]], int] | None = None) -> None:
        self._handle = handle  # tools.retrieval.RetrieverHandle, or None when ingest/ is not installed
        self._describe_image = describe_image  # image file -> what it shows + text read (indexed with it)
        self._screen = screen  # SafetyLayer.screen: a new document's chunks are scored once, at ingest

    @property
    def available(self) -> bool:
        return self._handle is not None

    def _retriever(self) -> Any:
        if self._handle is None:
            raise ConfigError("Documents are not part of this build: run `make setup` or pip install -e '.[ingest]'.")
        return self._handle.get()

    def ingest(self, paths: Iterable[str | Path], on_progress: Callable[[str, int], None] | None = None) -> Iterator[Any]:
        """Ingest files; yields one ingest.pipeline.FileResult per file (failed ones say why)."""
        from ingest.pipeline import expand_paths, screen_result

        retriever = self._retriever()
        ingester = retriever.ingester(describe_image=self._describe_image)
        try:
            for result in ingester.ingest(expand_paths(paths), on_progress):
                screen_result(retriever.index, result, self._screen)
                yield result
        finally:
            self._handle.refresh()

    def list(self) -> list[dict]:
        return list(self._retriever().documents()) if self._handle is not None and self._handle.has_documents() else []

    def delete(self, doc: str) -> dict:
        try:
            return self._retriever().ingester().delete(doc)
        finally:
            self._handle.refresh()


class Models:
    """The chat models as raw completion engines (the /v1 API's raw model ids)."""

    def __init__(self, config: AssistantConfig, router: Router) -> None:
        self._config, self._router = config, router
        self.default = config.engine.model

    def ids(self) -> list[str]:
        large = self._config.engine.large_model
        return [self.default] + ([large] if large and large != self.default else [])

    def role(self, model_id: str | None) -> str:
        """The routing role a chosen model id stands for: "large", "small", or "" (routed per call)."""
        large = self._config.engine.large_model
        if large and model_id == large and large != self.default:
            return LARGE
        return SMALL if model_id == self.default else ""

    def preload_large(self, done: Callable[[Engine | None, str], None] | None = None) -> bool:
        """Load the large model now, in the background (assistant/routing.py `Router.preload`); False when
        there is none to load."""
        return self._router.preload(done) is not None

    def engine(self, model_id: str | None = None) -> Engine:
        if model_id in (None, "", self.default) or model_id not in self.ids():
            return self._router.small
        return self._router.large()

    def generate(self, messages: Sequence[Message], params: SamplingParams, *, model: str | None = None,
                 tools: Sequence[dict] | None = None, cancel: threading.Event | None = None) -> Iterator[TokenDelta]:
        return self.engine(model).generate(list(messages), params, tools=tools, cancel=cancel)

    def count_tokens(self, messages: Sequence[Message], *, tools: Sequence[dict] | None = None) -> int:
        return self._router.small.count_tokens(list(messages), tools=tools)

    @property
    def context_window(self) -> int:
        return self._router.context_window

    @property
    def embedding_model(self) -> str | None:
        """The embedder's id (retrieval.embedder) when ingest/ is installed, else None."""
        try:
            import ingest.embed  # noqa: F401
        except ImportError:
            return None
        return self._config.retrieval.embedder

    def embed(self, texts: Sequence[str]) -> tuple[Any, int]:
        """(N, dim) float32 unit vectors of `texts` with the configured embedder, and their token count."""
        from ingest.embed import load_embedder

        embedder = load_embedder(self._config.retrieval.embedder, lazy=True)
        vectors = embedder.embed(list(texts))
        return vectors, sum(len(embedder.tokenize(t)) for t in texts)


@dataclass
class Assistant:
    """The facade every front end uses (see the module docstring)."""

    config: AssistantConfig
    orchestrator: Orchestrator
    conversations: Conversations
    documents: Documents
    models: Models
    keys: Keys | None = None  # API keys (hashed) in the store's database; None only for hand-built facades
    owners: Owners | None = None  # which key created which conversation or document, and conversations' files
    usage: UsageLedger | None = None  # one row per API request
    _closers: list[Callable[[], None]] = field(default_factory=list, repr=False)
    safety: Any = None  # assistant.safety.layer.SafetyLayer (policies, audit, moderation); None when disabled
    media: Modalities | None = None  # voice and vision: transcribe / speak / describe (backends load on first use)

    def turn(self, conversation_id: str | None, user_input: UserInput | str, *, params: SamplingParams | None = None,
             cancel: threading.Event | None = None, scope: frozenset[str] | None = None) -> Iterator[TurnEvent]:
        """`scope`: the doc ids the turn may search and read (None = the whole library; see orchestrator.py)."""
        return self.orchestrator.run_turn(conversation_id, user_input, params=params, cancel=cancel, scope=scope)

    def regenerate(self, conversation_id: str, *, params: SamplingParams | None = None,
                   cancel: threading.Event | None = None, scope: frozenset[str] | None = None) -> Iterator[TurnEvent]:
        return self.orchestrator.regenerate(conversation_id, params=params, cancel=cancel, scope=scope)

    def edit(self, conversation_id: str, message_id: str, text: str, *, params: SamplingParams | None = None,
             cancel: threading.Event | None = None, scope: frozenset[str] | None = None) -> Iterator[TurnEvent]:
        return self.orchestrator.edit(conversation_id, message_id, text, params=params, cancel=cancel, scope=scope)

    def prompt_texts(self) -> list[str]:
        """Every fixed text the model is shown besides the user's: the system prompt, the tools'
        descriptions and the instructions the turn adds. An answer that repeats any of them leaked it."""
        from assistant import agent_loop, context

        tools = [t.description for t in self.orchestrator.tools.enabled(None)]
        instructions = [context.context_message(["{passages}"])["content"], agent_loop.FINAL_ANSWER["content"],
                        agent_loop.IN_WORDS["content"], agent_loop.NAME_IT, agent_loop.REPEATED_CALL,
                        agent_loop.UNTRUSTED]
        return [self.config.system_prompt, *tools, *instructions]

    def default_params(self, **overrides: Any) -> SamplingParams:
        return replace(self.orchestrator.default_params(), **overrides)

    def close(self) -> None:
        """Close everything build_assistant opened, newest first; safe to call twice."""
        while self._closers:
            try:
                self._closers.pop()()
            except Exception:  # closing must go on: the other resources still need it
                pass

    def __enter__(self) -> "Assistant":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def build_assistant(config: AssistantConfig, *, engine: Engine | None = None, store: Store | None = None,
                    tools: Sequence[Any] | None = None, retriever: Any = None, code_tool: Any = None,
                    options: AgentOptions | None = None, input_guard: InputGuard | None = None,
                    transformers: Sequence[StreamTransformer] = (), prestage: PreStage | None = None,
                    media: Modalities | None = None) -> Assistant:
    """Wire the app from `config`. Every argument but `config` replaces one seam's real default (tests
    pass fakes); whatever is built here is closed by `Assistant.close()`, what is passed in is not.
    `tools`: None = the product's tools (documents and the sandboxed `python`); a list = the document
    tools plus exactly these. `media` (voice and vision, assistant/modalities.py) is the pre-stage and
    the speaker of spoken answers unless `prestage` replaces the pre-stage.
    Safety (assistant/safety, `[safety]` in the config): unless `safety.enabled` is false, the input guard
    is the configured policy's (an `input_guard` argument replaces it) and the output guard runs first
    among the stream transformers, so what later ones (speech) see is already redacted.
    A passed `engine` answers every turn unless `engine.large_model` names a model: "auto" adds the
    prepared large model only to engines built here, so a fake's answers never depend on what is in
    the models dir."""
    closers: list[Callable[[], None]] = []
    safety = None
    if engine is not None and config.engine.large_model == AUTO:
        config = replace(config, engine=replace(config.engine, large_model=""))
    config = with_large_model(config)
    try:
        if engine is None:
            from assistant.engine import create_engine

            small = config  # the draft model drafts for the large model when there is one
            if config.engine.large_model:
                small = replace(config, engine=replace(config.engine, draft_model=""))
            engine = create_engine(small)
            closers.append(engine.close)
        router = _router(config, engine)
        closers.append(router.close)
        if store is None:
            store = Store(config.store_url)
            closers.append(store.close)
        if config.safety.enabled:
            safety = _safety_layer(config, store)
            if safety.lend_engine(engine, config.system_prompt):  # the second opinion reads the chat model's prefill
                closers.append(lambda: safety.lend_engine(None))  # before the engine closes (closers run reversed)
            input_guard = input_guard or safety.input_guard
            transformers = [safety.output_guard(), *transformers]
        handle = _retriever_handle(config, retriever)
        if handle is not None and retriever is None:
            closers.append(handle.close)
        from tools.registry import default_registry

        registry = default_registry(config, handle=handle, code_tool=code_tool, python=tools is None)
        for tool in tools or ():
            registry.register(tool)
        closers.append(registry.close)
        prefetch = None
        if handle is not None:
            from assistant.counting import section_items
            from tools.retrieval import DocumentPrefetch

            prefetch = DocumentPrefetch(handle, k=min(config.retrieval.top_k, 4), lists=section_items,
                                         min_relevance=config.retrieval.min_relevance)
        media = media or Modalities(config)
        # the describer loads on the first picture ingested, not before
        documents = Documents(handle, describe_image=lambda path: media.describer.document_text(path),
                              screen=safety.screen if safety is not None else None)
        orchestrator = Orchestrator(engine, store, config, tools=registry, router=router, options=options,
                                    prefetch=prefetch, input_guard=input_guard, transformers=transformers,
                                    prestage=prestage or media, speaker=media.speech_stream,
                                    ingest_files=_ingest_into(documents, Path(config.data_dir) / "uploads"))
    except BaseException:
        for close in reversed(closers):
            close()
        raise
    assistant = Assistant(config, orchestrator, Conversations(store), documents, Models(config, router),
                          keys=Keys(store.db, tuple(config.server.tiers)), owners=Owners(store.db),
                          usage=UsageLedger(store.db), _closers=closers, safety=safety, media=media)
    if safety is not None:  # the output guard redacts every fixed text the model is shown, not only the system prompt
        safety.protect(assistant.prompt_texts())
    return assistant


def _safety_layer(config: AssistantConfig, store: Store) -> Any:
    try:
        from assistant.safety.layer import SafetyLayer
    except ImportError as e:
        raise ConfigError(f"The safety guards need {e.name}: run `make setup` or pip install -e '.[safety]' "
                          "(or set safety.enabled = false to run without them).") from e
    return SafetyLayer.from_config(config, store)


def with_large_model(config: AssistantConfig) -> AssistantConfig:
    """`engine.large_model = "auto"` resolved: the packaged large model when it is prepared in the models
    dir (and is not already engine.model), else none. Measured on the dev part of eval/rag, the 1.5B
    answers document questions right far more often than the 0.5B (README, "Answer quality")."""
    e = config.engine
    if e.large_model != AUTO:
        return config
    chosen = ""
    if not e.remote_url:
        from assistant.models import known_model_names, prepared_path, resolve_model_name

        spec = resolve_model_name(AUTO_LARGE_MODEL)
        small = e.model if e.model in known_model_names() else ""
        if prepared_path(spec, config.resolved_models_dir) is not None and \
                (not small or resolve_model_name(small).name != spec.name):
            chosen = AUTO_LARGE_MODEL
    return replace(config, engine=replace(e, large_model=chosen))


def _router(config: AssistantConfig, engine: Engine) -> Router:
    large_model = config.engine.large_model
    if not large_model:
        return Router(engine)
    from assistant.engine import create_engine

    large_config = replace(config, engine=replace(config.engine, model=large_model))
    return Router(engine, lambda: create_engine(large_config),
                  RoutingPolicy(large_for_questions=config.engine.large_for_questions))


def _retriever_handle(config: AssistantConfig, retriever: Any) -> Any:
    try:
        from tools.retrieval import RetrieverHandle
    except ImportError:  # tools/ without its retrieval backend: no documents
        return None
    return RetrieverHandle.from_config(config, retriever=retriever)


def _ingest_into(documents: Documents, uploads: Path) -> Callable[[str, Sequence[Attachment]], Iterator[TurnEvent]]:
    """Files attached to a turn are saved under uploads/<conversation>/ and ingested into the library
    before the question is answered (shown as a tool step)."""

    def ingest(conversation_id: str, files: Sequence[Attachment]) -> Iterator[TurnEvent]:
        if not documents.available:
            raise ConfigError("Attached files need the document tools: run `make setup` or pip install -e '.[ingest]'.")
        folder = uploads / conversation_id
        folder.mkdir(parents=True, exist_ok=True)
        paths = []
        for f in files:
            target = folder / Path(f.name).name
            target.write_bytes(f.read())
            paths.append(target)
        yield ToolCallStarted("ingest_files", "ingest", {"files": [p.name for p in paths]})
        results = list(documents.ingest(paths))
        failed = [f"{r.path.name}: {r.error}" for r in results if r.status == "failed"]
        summary = "; ".join(failed) or f"ingested {len(results)} file(s)"
        yield ToolCallFinished("ingest_files", "ingest", not failed, summary)
        if failed and len(failed) == len(results):
            raise AssistantError(f"No attached file could be read: {summary}")

    return ingest

