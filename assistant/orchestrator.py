"""The orchestrator: one user turn from input to stored answer, as a stream of TurnEvents.

Design note — the turn loop:
  1. the user message is committed to the store before anything else (never lost); an assistant
     message is inserted as `partial` under it;
  2. when the conversation has documents, the question is searched first ("auto-retrieval"; a
     question about a whole file — summarise, how many, compare — reads whole pages instead). Hits
     that share no content word with the question are left out unless the question names documents
     ("file", "pdf", ...), so "compute 20th Fibonacci" does not drag a manual into the prompt (the
     model can still search itself). Kept passages get `[n]` markers in the turn's SourceLedger;
  3. up to `max_steps` engine calls that may use tools: each prompt is fitted to the context window
     (assistant/context.py) and sent to the engine the Router picks (assistant/routing.py) with the
     enabled tools' specs in the model's own chat template. Deltas are streamed as TextDelta except
     what may be a tool call (assistant/agent.py holds it back). A reply with tool calls runs them
     (ToolCallStarted / ToolCallFinished) and feeds results back as `tool` messages. A malformed call
     gets `max_repairs` repair step(s) with the validation error as its observation; after that, and
     after `max_steps`, one last call is made without tools so the turn always ends in an answer;
  4. the answer's `[n]` markers are verified against the ledger (Sources event); the message is
     finalised (`complete`) with usage, steps, sources, route and memory in its meta, then Usage and
     Done are emitted. The streamed text is flushed to the store every FLUSH_INTERVAL_S.
  Our failures (engine, store, a tool backend that is down) become an Error event plus a Done with
  finish_reason "error"; the stored message keeps whatever text was produced, marked `error`.
  History is the active branch (store.py): `regenerate` answers the last question again as a
  sibling answer, `edit` adds a sibling user message; old branches stay reachable by id.
"""

from __future__ import annotations

import json
import re
import threading
import time
from dataclasses import dataclass
from typing import Any, Iterator

from assistant.agent import ToolCallSplitter, call_message, repair_messages, result_message
from assistant.citations import SourceLedger, content_words, verify_citations
from assistant.config import AssistantConfig
from assistant.context import MAX_MEMORY_TOKENS, PromptParts, fit_prompt
from assistant.engine.base import Engine, Message, SamplingParams
from assistant.errors import AssistantError, StoreError
from assistant.events import (Done, Error, Notice, Sources, TextDelta, ToolCallFinished, ToolCallStarted,
                              TurnEvent, Usage)
from assistant.routing import Router
from assistant.store import Store, StoredMessage
from tools.base import Tool, ToolContext, ToolResult
from tools.registry import ToolRegistry

FLUSH_INTERVAL_S = 1.0  # how often a streaming answer is written to the store
FINAL_ANSWER = {"role": "system", "content": "Now answer the user's question in plain text, using the tool results "
                "above. Do not write any tool call."}
REPEATED_CALL = ("You already made exactly this call in this turn; its result is above. Change the arguments "
                 "(fix the error it showed) or answer the question.")
DOCUMENT_WORDS = re.compile(r"\b(documents?|files?|pdfs?|manuals?|pages?|uploads?|report)\b", re.I)
WHOLE_DOCUMENT = re.compile(r"\b(summari[sz]e|summary|whole|entire|how many|compare|comparison|all the|overview)\b", re.I)


@dataclass(frozen=True)
class AgentOptions:
    max_steps: int = 4  # engine calls per turn that may call tools (a last one without tools may follow)
    max_repairs: int = 1  # malformed tool calls answered with their validation error before tools are withdrawn
    auto_retrieve: bool = True  # search the conversation's documents with the question before the first call
    retrieve_k: int = 4  # passages auto-retrieval adds
    max_read_chars: int = 8000  # of whole pages auto-retrieval adds for whole-document questions
    summarize_overflow: bool = False  # fold turns that no longer fit into a model-written summary (else drop them)
    max_observation_chars: int = 4000  # of one tool result shown to the model


class Orchestrator:
    def __init__(self, engine: Engine, store: Store, config: AssistantConfig, *, tools: ToolRegistry | None = None,
                 router: Router | None = None, options: AgentOptions | None = None) -> None:
        self.engine = engine  # the small (default) engine
        self.store = store
        self.config = config
        self.tools = tools if tools is not None else ToolRegistry()
        self.router = router or Router(engine)
        self.options = options or AgentOptions()

    @classmethod
    def from_config(cls, config: AssistantConfig, engine: Engine | None = None, *, large_model: str | None = None,
                    tools: ToolRegistry | None = None, options: AgentOptions | None = None) -> "Orchestrator":
        from assistant.engine import create_engine
        from tools.registry import default_registry

        engine = engine or create_engine(config)
        router = None
        large_model = large_model if large_model is not None else config.engine.large_model
        if large_model:
            from dataclasses import replace

            large_config = replace(config, engine=replace(config.engine, model=large_model))
            router = Router(engine, lambda: create_engine(large_config))
        return cls(engine, Store(config.store_url), config, tools=tools if tools is not None else default_registry(config),
                   router=router, options=options)

    def default_params(self) -> SamplingParams:
        return SamplingParams(max_tokens=self.config.engine.max_new_tokens)

    # -- entry points ---------------------------------------------------------------------------
    def run_turn(self, conversation_id: str | None, user_input: str, *, params: SamplingParams | None = None,
                 cancel: threading.Event | None = None) -> Iterator[TurnEvent]:
        text = user_input.strip()
        cid = self.store.get_or_create(conversation_id, title=text[:60]).id
        history = self.store.history(cid)
        user = self.store.add_message(cid, "user", text)
        yield from self._answer(cid, user, history, params or self.default_params(), cancel)

    def regenerate(self, conversation_id: str, *, params: SamplingParams | None = None,
                   cancel: threading.Event | None = None) -> Iterator[TurnEvent]:
        """Answer the active branch's last question again; the old answer stays as a sibling."""
        path = self.store.history(conversation_id)
        users = [i for i, m in enumerate(path) if m.role == "user"]
        if not users:
            raise StoreError(f"Conversation {conversation_id} has no question to answer again.")
        user = path[users[-1]]
        self.store.set_head(conversation_id, user.id)
        yield from self._answer(conversation_id, user, path[:users[-1]], params or self.default_params(), cancel)

    def edit(self, conversation_id: str, message_id: str, new_text: str, *, params: SamplingParams | None = None,
             cancel: threading.Event | None = None) -> Iterator[TurnEvent]:
        """Replace a user message by a new one on a new branch and answer it; the old branch stays."""
        old = self.store.get_message(message_id)
        if old.conversation_id != conversation_id or old.role != "user":
            raise StoreError(f"Message {message_id} is not a user message of conversation {conversation_id}.")
        history = self.store.history(conversation_id, head_id=old.parent_id)
        user = self.store.add_message(conversation_id, "user", new_text.strip(), parent_id=old.parent_id,
                                      meta={"edited_from": old.id})
        yield from self._answer(conversation_id, user, history, params or self.default_params(), cancel)

    # -- one turn -------------------------------------------------------------------------------
    def _answer(self, cid: str, user: StoredMessage, history: list[StoredMessage], params: SamplingParams,
                cancel: threading.Event | None) -> Iterator[TurnEvent]:
        answer = self.store.add_message(cid, "assistant", "", parent_id=user.id, status="partial")
        turn = _Turn(cid, SourceLedger())
        try:
            yield from self._run_steps(turn, user, history, params, cancel, answer.id)
        except AssistantError as e:
            self.store.update_message(answer.id, content=turn.text, status="error", meta={"error": str(e)})
            yield Error(str(e))
            yield Done(cid, answer.id, turn.text, "error")
            return
        except BaseException:
            # Client gone or a bug: keep what was produced, marked partial, and let it propagate.
            self.store.update_message(answer.id, content=turn.text, status="partial")
            raise
        meta: dict[str, Any] = {"usage": turn.usage_meta(), "finish_reason": turn.finish, "model": turn.model,
                                "route": turn.route, "steps": turn.steps}
        final = turn.text
        if len(turn.ledger) or turn.documents:
            check = verify_citations(final, turn.ledger)
            final = check.text
            meta.update(check.to_meta())
            if check.sources or check.dropped_markers:
                yield Sources(check.sources, check.dropped_markers)
        if turn.memory is not None:
            meta["memory"] = turn.memory
        self.store.update_message(answer.id, content=final, status="complete", meta=meta)
        yield Usage(turn.prompt_tokens, turn.completion_tokens, turn.context_window, turn.dropped, turn.cached_tokens,
                    turn.num_calls, turn.breakdown)
        yield Done(cid, answer.id, final, turn.finish)

    def _run_steps(self, turn: "_Turn", user: StoredMessage, history: list[StoredMessage], params: SamplingParams,
                   cancel: threading.Event | None, answer_id: str) -> Iterator[TurnEvent]:
        chat, ids, memory = _prompt_history(history)
        tools = self.tools.enabled(turn.cid)
        by_name = {t.name: t for t in tools}
        turn.documents = "search_documents" in by_name  # markers are checked whenever documents could be cited
        ctx = ToolContext(turn.cid, turn.ledger)
        context = yield from self._auto_retrieve(user.content, by_name, turn.ledger)
        steps: list[Message] = []
        repairs_left, offer_tools = self.options.max_repairs, bool(tools)
        seen_calls: set[str] = set()
        for step in range(self.options.max_steps + 1):
            offered = tools if offer_tools and step < self.options.max_steps else []
            wrap_up = [FINAL_ANSWER] if steps and not offered else []  # tools withdrawn: ask for the answer
            plan = fit_prompt(
                PromptParts({"role": "system", "content": self.config.system_prompt}, user.as_chat(), chat, memory,
                            context, steps + wrap_up, [t.spec() for t in offered]),
                count_tokens=self.engine.count_tokens, context_window=self.router.context_window,
                reserve=params.max_tokens, summarize=self.summarize if self.options.summarize_overflow else None)
            if plan.num_summarised:  # later steps of this turn start from the new memory
                memory = plan.memory
                turn.memory = {"summary": memory, "through_id": ids[plan.num_summarised - 1]}
                chat, ids = chat[plan.num_summarised:], ids[plan.num_summarised:]
            route = self.router.choose(prompt_tokens=plan.prompt_tokens, has_documents=bool(turn.ledger),
                                       after_tool_step=bool(steps))
            notices: list[str] = []
            engine, stream = self.router.generate(route, plan.messages, params,
                                                  tools=[t.spec() for t in offered] or None, cancel=cancel,
                                                  notices=notices)
            for line in notices:
                yield Notice(line)
            turn.start_call(plan, engine, route)
            splitter = ToolCallSplitter([t.name for t in offered])
            last_flush = time.monotonic()
            for delta in stream:
                turn.track(delta)
                shown = splitter.feed(delta.text)
                if shown:
                    turn.parts.append(shown)
                    yield TextDelta(shown)
                if time.monotonic() - last_flush >= FLUSH_INTERVAL_S:
                    self.store.update_message(answer_id, content=turn.text)
                    last_flush = time.monotonic()
            reply, rest = splitter.finish()
            if rest:
                turn.parts.append(rest)
                yield TextDelta(rest)
            if turn.finish == "cancelled":
                return
            if not reply.wants_tools:
                if turn.text.strip() or not steps or not offered:
                    return
                offer_tools = False  # tools were used but the reply is empty: ask once more for the answer
                continue
            if reply.calls:
                steps.append(call_message(reply.text, reply.calls))
                for call in reply.calls:
                    yield ToolCallStarted(call.id, call.name, call.arguments)
                    key = json.dumps([call.name, call.arguments], sort_keys=True)
                    if key in seen_calls:  # small models loop on a failing call: say so instead of rerunning
                        result = ToolResult(REPEATED_CALL, ok=False, summary="same call as before, not run again")
                    else:
                        seen_calls.add(key)
                        result = by_name[call.name](call.arguments, ctx)  # ToolUnavailable (ours) propagates
                    yield ToolCallFinished(call.id, call.name, result.ok, result.short(), result.artifacts)
                    steps.append(result_message(call.name, result.text[: self.options.max_observation_chars], call.id))
                    turn.steps.append({"name": call.name, "arguments": call.arguments, "ok": result.ok,
                                       "summary": result.short(), "artifacts": list(result.artifacts)})
            elif repairs_left > 0:
                repairs_left -= 1
                bad = reply.malformed[0]
                yield ToolCallStarted(f"repair_{step}", "invalid_tool_call", {"raw": bad.raw[:200]})
                yield ToolCallFinished(f"repair_{step}", "invalid_tool_call", False, bad.error.splitlines()[0])
                steps.extend(repair_messages(splitter.buffer, bad))
                turn.steps.append({"name": "invalid_tool_call", "arguments": {"raw": bad.raw[:200]}, "ok": False,
                                   "summary": bad.error.splitlines()[0]})
            else:
                offer_tools = False
                yield Notice("The model could not write a valid tool call; it answers without tools.")

    def _auto_retrieve(self, question: str, tools: dict[str, Tool], ledger: SourceLedger) -> Iterator[TurnEvent]:
        """Passages for the question from the conversation's documents (rendered, best first)."""
        search = tools.get("search_documents")
        handle = getattr(search, "handle", None)
        if not self.options.auto_retrieve or handle is None:
            return []
        from tools.retrieval import MAX_PASSAGE_CHARS, add_hit, doc_name, read_passages

        if WHOLE_DOCUMENT.search(question):
            documents = [doc_name(d) for d in handle.get().documents()]
            named = [d for d in documents if d.lower() in question.lower()] or documents[:2]
            args: dict[str, Any] = {"documents": named}
            yield ToolCallStarted("auto_read", "read_document", args)
            passages = [p for d in named for p in read_passages(handle, ledger, d)]
            rendered, used = [], 0
            for p in passages:
                text = p.render()
                if used + len(text) > self.options.max_read_chars:
                    break
                rendered.append(text)
                used += len(text)
            yield ToolCallFinished("auto_read", "read_document", True, f"read {len(rendered)} pages")
            return rendered
        yield ToolCallStarted("auto_search", "search_documents", {"query": question})
        hits = handle.get().search(question, self.options.retrieve_k, None)
        asks_documents = DOCUMENT_WORDS.search(question) is not None
        wanted = content_words(question)
        passages = [add_hit(ledger, h) for h in hits if asks_documents or wanted & content_words(h.text)]
        where = ", ".join(dict.fromkeys(f"{p.doc} p. {p.page}" for p in passages)) or "nothing relevant"
        yield ToolCallFinished("auto_search", "search_documents", True, where)
        return [p.render(MAX_PASSAGE_CHARS) for p in passages]

    def summarize(self, memory: str, messages: list[Message], max_tokens: int = MAX_MEMORY_TOKENS) -> str:
        """Fold `messages` (and the previous memory) into a short summary, written by the small model."""
        transcript = "\n".join(f"{m['role']}: {m['content']}" for m in messages)
        if memory:
            transcript = f"Earlier summary: {memory}\n{transcript}"
        prompt = [{"role": "system", "content": "You summarise conversations. Keep names, numbers and decisions."},
                  {"role": "user", "content": f"Summarise this conversation in a few sentences:\n\n{transcript}"}]
        params = SamplingParams(max_tokens=max_tokens)
        return "".join(d.text for d in self.engine.generate(prompt, params)).strip()


class _Turn:
    """Accumulators of one turn (text shown, tokens, steps) shared by the loop and its finaliser."""

    def __init__(self, cid: str, ledger: SourceLedger) -> None:
        self.cid, self.ledger = cid, ledger
        self.parts: list[str] = []
        self.steps: list[dict[str, Any]] = []
        self.finish, self.model, self.route = "error", "", ""
        self.prompt_tokens = self.completion_tokens = self.cached_tokens = self.dropped = self.num_calls = 0
        self.all_prompt_tokens = self._call_completion = self._call_cached = 0
        self.context_window = 0
        self.breakdown: dict[str, int] = {}
        self.memory: dict[str, str] | None = None
        self.documents = False  # the conversation had documents to cite this turn

    @property
    def text(self) -> str:
        return "".join(self.parts)

    def start_call(self, plan: Any, engine: Engine, route: Any) -> None:
        self.completion_tokens += self._call_completion
        self.cached_tokens += self._call_cached
        self._call_completion = self._call_cached = 0
        self.num_calls += 1
        self.prompt_tokens, self.dropped = plan.prompt_tokens, max(self.dropped, plan.num_dropped)
        self.all_prompt_tokens += plan.prompt_tokens
        self.breakdown = dict(plan.breakdown)
        self.model, self.route, self.context_window = engine.name, route.role, engine.context_window

    def track(self, delta: Any) -> None:
        self._call_completion = delta.num_generated_tokens
        self._call_cached = delta.num_cached_tokens
        if delta.finish_reason:
            self.finish = delta.finish_reason
            self.completion_tokens += self._call_completion
            self.cached_tokens += self._call_cached
            self._call_completion = self._call_cached = 0

    def usage_meta(self) -> dict[str, Any]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "dropped_messages": self.dropped, "cached_tokens": self.cached_tokens, "num_steps": self.num_calls,
                "all_prompt_tokens": self.all_prompt_tokens, "breakdown": self.breakdown}


def _prompt_history(history: list[StoredMessage]) -> tuple[list[Message], list[str], str]:
    """(chat messages, their ids, memory): the active branch after the newest stored summary."""
    memory, start = "", 0
    for i, m in enumerate(history):
        mem = m.meta.get("memory") if m.meta else None
        if mem:
            covered = next((j for j, n in enumerate(history) if n.id == mem.get("through_id")), None)
            if covered is not None:
                memory, start = mem.get("summary", ""), covered + 1
    kept = [m for m in history[start:] if m.role in ("user", "assistant") and m.status != "error" and m.content]
    return [m.as_chat() for m in kept], [m.id for m in kept], memory

