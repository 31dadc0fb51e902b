"""The turn: one user input in, a stored answer out, as a stream of TurnEvents.

Design note — the turn:
  1. pre-stage: speech becomes the question's text (Transcribed), each image a description that goes
     into the model's context with the question (ImageDescribed), attached files are ingested; the
     recording and the pictures are kept under <data_dir>/uploads/<conversation>/ and named in the
     user message's meta, so the stored question can be played back and its pictures shown again;
  2. the input guard (bound to the conversation: its safety policy and audit) checks the question
     *before* it is stored; an allowed verdict that names a category is a warning, shown as an event. A blocked question is stored marked
     `blocked` (never shown to the model again), the refusal is stored as the answer, and the turn
     ends with SafetyVerdict + Done(finish_reason="blocked"). A message the fast detectors leave in
     doubt gets a slower second opinion that reads beside the turn's start (`_gated`): nothing of the
     answer is shown until it has spoken, and a block then ends the turn the same way;
  3. the user message is committed, then an assistant message is inserted as `partial` under it and
     TurnStarted carries both ids (what a UI needs to cancel, regenerate or edit);
  4. the agent loop (assistant/agent_loop.py) runs the steps; its streamed text is flushed to the
     store every FLUSH_INTERVAL_S;
  5. finalise: an answer over documents keeps only sentences whose facts the turn's texts hold
     (assistant/grounding.py; an answer with none left becomes a refusal), and a citing answer that speaks
     of something the question names but no document mentions ("OpenSSL" in a manual that never says it)
     becomes the refusal that says so, as does a citing answer without a number to a question that asks
     for a version; then its `[n]` markers are
     verified against what was retrieved in this turn; a document answer the large model wrote is read
     against the passages it cites once more (assistant/answer_check.py) and withdrawn for a refusal
     when they do not answer the question (a Notice says so); then Sources, the message is marked `complete`
     with usage, steps, sources, route and memory in its meta, then Usage and Done.
  Our failures (engine, store, a tool backend that is down) become an Error event plus a Done with
  finish_reason "error"; the stored message keeps whatever text was produced, marked `error`.
  Spoken answers: when the input asks for them (`UserInput.speak`, or `speech.speak_answers`), the
  `speaker` factory adds a sentence-to-speech transformer last in the chain, so it speaks exactly what
  the user sees (after the output guard) and its AudioChunk events interleave with the text.
  History is the active branch (store.py): `regenerate` answers the last question again as a
  sibling answer, `edit` adds a sibling user message; old branches stay reachable by id.
  Document scope: each entry point takes `scope`, the doc ids the turn may search and read (the
  server computes it from the caller's key and the conversation: assistant/keys.py DocumentAccess);
  None, the default of the local single user, is the whole library, and an empty set an empty one.
  A scoped turn ingests no attached files: the front end uploads them first, so they have an owner.
"""

from __future__ import annotations

import logging
import threading
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from assistant.agent_loop import AgentLoop, AgentOptions, Prefetch, TurnState, on_documents
from assistant.answer_check import WITHDRAWN, cited_passages, passages_hold_answer
from assistant.citations import SourceLedger, cited_as_written, verify_citations
from assistant.config import AssistantConfig
from assistant.context import MAX_MEMORY_TOKENS, user_questions
from assistant.engine.base import Engine, Message, SamplingParams
from assistant.errors import AssistantError, StoreError
from assistant.events import (Done, Error, ImageDescribed, Notice, SafetyVerdict, Sources, ToolCallFinished,
                              ToolCallStarted, Transcribed, TurnEvent, TurnStarted, Usage)
from assistant.grounding import (Evidence, facts_held, ground, mentions, not_mentioned, question_terms, refusal,
                                 states_no_number, unstated_count, unstated_default)
from assistant.routing import LARGE, Router
from assistant.seams import AllowAll, Attachment, InputGuard, NoModalities, PreStage, StreamTransformer, UserInput
from assistant.store import Store, StoredMessage
from tools.registry import ToolRegistry
from tools.retrieval import is_follow_up

__all__ = ["AgentOptions", "Orchestrator"]

IngestFiles = Callable[[str, Sequence[Attachment]], Iterator[TurnEvent]]  # (conversation id, files) -> events


log = logging.getLogger(__name__)
UNMENTIONED = "The answer was withdrawn: it spoke of {terms}, which no document mentions."
NO_NUMBER = "The answer was withdrawn: the question asks for a version, and it gave none."
UNSTATED_COUNT = ("The answer was withdrawn: it gave a count ({count}) that no passage states, and no list to count "
                  "was found.")
UNSTATED_DEFAULT = "The answer was withdrawn: the question asks for a default, and no passage says {fact} is one."


class Orchestrator:
    def __init__(self, engine: Engine, store: Store, config: AssistantConfig, *, tools: ToolRegistry | None = None,
                 router: Router | None = None, options: AgentOptions | None = None, prefetch: Prefetch | None = None,
                 input_guard: InputGuard | None = None, transformers: Sequence[StreamTransformer] = (),
                 prestage: PreStage | None = None, ingest_files: IngestFiles | None = None,
                 speaker: Callable[[], StreamTransformer] | None = None) -> None:
        self.engine = engine  # the small (default) engine
        self.store = store
        self.config = config
        self.tools = tools if tools is not None else ToolRegistry()
        self.router = router or Router(engine)
        self.options = options or AgentOptions()
        self.prefetch = prefetch
        self.input_guard = input_guard or AllowAll()
        self.transformers = list(transformers)
        self.prestage = prestage or NoModalities()
        self.ingest_files = ingest_files
        self.speaker = speaker  # a fresh sentence-to-speech transformer per spoken answer

    def default_params(self) -> SamplingParams:
        return SamplingParams(max_tokens=self.config.engine.max_new_tokens)

    # -- entry points ---------------------------------------------------------------------------
    def run_turn(self, conversation_id: str | None, user_input: UserInput | str, *,
                 params: SamplingParams | None = None, cancel: threading.Event | None = None,
                 scope: frozenset[str] | None = None) -> Iterator[TurnEvent]:
        turn_input = UserInput.of(user_input)
        meta: dict[str, Any] = {}
        if turn_input.files and scope is not None:  # they would be nobody's, and outside the scope
            yield Error("Files cannot be attached to this turn: upload them as documents first "
                        "(they then belong to you), then ask about them.")
            yield Done(conversation_id or "", "", "", "error")
            return
        try:
            text = yield from self._prestage(turn_input, meta)
        except AssistantError as e:  # nothing was stored yet: say why, end the turn
            yield Error(str(e))
            yield Done(conversation_id or "", "", "", "error")
            return
        if not text and not meta.get("images"):
            yield Error("The message is empty: type a question, or record one that has speech in it.")
            yield Done(conversation_id or "", "", "", "error")
            return
        cid = self.store.get_or_create(conversation_id, title=text[:60]).id
        self._keep_media(cid, turn_input, meta)
        if turn_input.files and self.ingest_files is not None:
            try:
                yield from self.ingest_files(cid, turn_input.files)
            except AssistantError as e:  # no attached file could be read: the question would be about nothing
                yield Error(str(e))
                yield Done(cid, "", "", "error")
                return
        history = self.store.history(cid)
        cancel = cancel or threading.Event()
        verdict = self._check(cid, text, cancel)
        if not verdict.allowed:
            yield from self._refuse(cid, text, meta, verdict)
            return
        if verdict.category:  # allowed with a warning: the user sees it
            yield SafetyVerdict("input", True, verdict.category, verdict.reason, verdict.score, verdict.threshold,
                                verdict.detector)
        user = self.store.add_message(cid, "user", text, meta=meta)
        yield from self._gated(self._answer(cid, user, history, params or self.default_params(), cancel,
                                            speak=turn_input.speak, model=turn_input.model, scope=scope,
                                            tap=verdict.tap, begin=verdict.begin), verdict, cid, user, cancel)

    def regenerate(self, conversation_id: str, *, params: SamplingParams | None = None,
                   cancel: threading.Event | None = None, speak: bool = False,
                   scope: frozenset[str] | None = None) -> Iterator[TurnEvent]:
        """Answer the active branch's last question again; the old answer stays as a sibling."""
        path = self.store.history(conversation_id)
        users = [i for i, m in enumerate(path) if m.role == "user" and m.status != "blocked"]
        if not users:
            raise StoreError(f"Conversation {conversation_id} has no question to answer again.")
        user = path[users[-1]]
        self.store.set_head(conversation_id, user.id)
        yield from self._answer(conversation_id, user, path[:users[-1]], params or self.default_params(), cancel,
                                speak=speak, scope=scope)

    def edit(self, conversation_id: str, message_id: str, new_text: str, *, params: SamplingParams | None = None,
             cancel: threading.Event | None = None, speak: bool = False,
             scope: frozenset[str] | None = None) -> Iterator[TurnEvent]:
        """Replace a user message by a new one on a new branch and answer it; the old branch stays."""
        old = self.store.get_message(message_id)
        if old.conversation_id != conversation_id or old.role != "user":
            raise StoreError(f"Message {message_id} is not a user message of conversation {conversation_id}.")
        history = self.store.history(conversation_id, head_id=old.parent_id)
        text = new_text.strip()
        cancel = cancel or threading.Event()
        verdict = self._check(conversation_id, text, cancel)
        if not verdict.allowed:
            self.store.set_head(conversation_id, old.parent_id)
            yield from self._refuse(conversation_id, text, {"edited_from": old.id}, verdict)
            return
        user = self.store.add_message(conversation_id, "user", text, parent_id=old.parent_id,
                                      meta={"edited_from": old.id})
        yield from self._gated(self._answer(conversation_id, user, history, params or self.default_params(), cancel,
                                            speak=speak, scope=scope, tap=verdict.tap, begin=verdict.begin),
                               verdict, conversation_id, user, cancel)

    # -- one turn -------------------------------------------------------------------------------
    def _guard(self, cid: str) -> InputGuard:
        """The input guard bound to this conversation (its policy, its audit rows), when it can be bound."""
        bind = getattr(self.input_guard, "for_conversation", None)
        return bind(cid) if bind is not None else self.input_guard

    def _check(self, cid: str, text: str, cancel: threading.Event) -> Any:
        """The input verdict, `pending` while the detectors still read beside the turn (see `_gated`;
        `cancel`, the turn's, is set when they block). safety.check_beside_turn = false keeps a message
        the fast detectors block from reaching the model at all."""
        guard = self._guard(cid)
        beside = getattr(guard, "check_beside", None)
        if beside is not None and self.config.safety.check_beside_turn:
            return beside(text, where="input", cancel=cancel)
        early = getattr(guard, "check_early", None)
        return early(text, where="input") if early is not None else guard.check(text, where="input")

    def _gated(self, events: Iterator[TurnEvent], verdict: Any, cid: str, user: StoredMessage,
               cancel: threading.Event) -> Iterator[TurnEvent]:
        """The turn's events, held back while the input's verdict is pending.

        Design note — the input check reads beside the turn: the fast detectors run on a thread of
        their own, started (`verdict.begin`, handed down like the tap) just before the turn's first
        model call, so they read while the engine prefills on the other core
        (`SafetyGuard.check_beside`; a block sets `cancel` at once). A message they leave in
        doubt is read again by a slower one (assistant/safety/probe.py). Where the turn's model is the
        one it reads, it reads the turn's own prefill (`verdict.tap`, handed to the first model call:
        assistant/engine/taps.py), so the verdict is ready with the prompt; elsewhere it runs its own
        request (~70-100 ms here) while the turn starts (retrieval, the model's prefill), so the user
        waits for the slower of the two, not their sum. Only events that show nothing of the answer pass before the verdict:
        TurnStarted, the automatic document search (ToolCallStarted/Finished "auto_*") and
        quarantine notices. The first other event (answer text, a tool call about to run, the end)
        waits for the verdict. A block cancels the turn and ends it as a blocked message does: the
        question is marked `blocked`, the refusal is the answer, and SafetyVerdict + Done follow."""
        pending, answer_id = verdict.pending, ""
        try:
            for event in events:
                if isinstance(event, TurnStarted):
                    answer_id = event.message_id
                if pending is not None and not _before_verdict(event):
                    try:
                        final, pending = pending(), None
                    except BaseException:  # a detector failed: the turn must not go on unchecked
                        pending = None
                        cancel.set()
                        events.close()
                        raise
                    if not final.allowed:
                        cancel.set()
                        events.close()
                        yield from self._blocked_late(cid, user, answer_id, final)
                        return
                    if final.category:
                        yield SafetyVerdict("input", True, final.category, final.reason, final.score,
                                            final.threshold, final.detector)
                yield event
        finally:
            if pending is not None:  # the turn ended before it needed the verdict (the client left, an error)
                cancel.set()
                self._unread_verdict(pending, user)

    def _unread_verdict(self, pending: Callable[[], Any], user: StoredMessage) -> None:
        """The verdict of a turn that ended before it was needed, read all the same: it is audited, and a
        blocked question is marked as one, as if the turn had run to its end."""
        try:
            final = pending()
            if not final.allowed:
                self.store.update_message(user.id, status="blocked",
                                          meta={**user.meta, "verdict": _verdict_meta(final)})
        except Exception:  # noqa: BLE001 - nothing is left to show it to; the log keeps it
            log.warning("The input check of message %s failed after its turn ended.", user.id, exc_info=True)

    def _blocked_late(self, cid: str, user: StoredMessage, answer_id: str, verdict: Any) -> Iterator[TurnEvent]:
        """A turn already started whose question the second opinion blocked: stored as `_refuse` stores it."""
        audit = _verdict_meta(verdict)
        self.store.update_message(user.id, status="blocked", meta={**user.meta, "verdict": audit})
        if answer_id:
            self.store.update_message(answer_id, content=verdict.reason, status="complete",
                                      meta={"finish_reason": "blocked", "verdict": audit})
        yield SafetyVerdict("input", False, verdict.category, verdict.reason, verdict.score, verdict.threshold,
                            verdict.detector)
        yield Done(cid, answer_id, verdict.reason, "blocked")

    def _prestage(self, turn_input: UserInput, meta: dict[str, Any]) -> Iterator[TurnEvent]:
        """Speech -> the question's text, images -> descriptions kept in `meta` (returns the text)."""
        text = turn_input.text.strip()
        if turn_input.audio is not None:
            heard = self.prestage.transcribe(turn_input.audio).strip()
            yield Transcribed(heard)
            text = f"{text}\n{heard}".strip() if text else heard
            meta["audio"] = {"name": turn_input.audio.name, "transcript": heard}
        descriptions = []
        for i, image in enumerate(turn_input.images, start=1):
            description = self.prestage.describe(image)
            yield ImageDescribed(i, description)
            descriptions.append(f"image {i} ({image.name}): {description}")
        if descriptions:
            meta["images"] = descriptions
        return text

    def _keep_media(self, cid: str, turn_input: UserInput, meta: dict[str, Any]) -> None:
        """Write the turn's recording and pictures under uploads/<conversation>/ and name them in `meta`."""
        media = [*([turn_input.audio] if turn_input.audio is not None else []), *turn_input.images]
        if not media:
            return
        folder = Path(self.config.data_dir) / "uploads" / cid
        folder.mkdir(parents=True, exist_ok=True)
        saved = []
        for item in media:
            target = folder / f"{uuid.uuid4().hex[:12]}-{Path(item.name).name or 'upload'}"
            target.write_bytes(item.read())
            saved.append(str(target))
        if turn_input.audio is not None:
            meta["audio"]["path"] = saved.pop(0)
        if saved:
            meta["image_files"] = saved

    def _refuse(self, cid: str, text: str, meta: dict[str, Any], verdict: Any) -> Iterator[TurnEvent]:
        reason = verdict.reason or (f"This message was blocked by the safety policy ({verdict.category or 'unsafe'}). "
                                    "Rephrase it, or ask the administrator about the policy.")
        audit = _verdict_meta(verdict)
        user = self.store.add_message(cid, "user", text, status="blocked", meta={**meta, "verdict": audit})
        answer = self.store.add_message(cid, "assistant", reason, parent_id=user.id,
                                        meta={"finish_reason": "blocked", "verdict": audit})
        yield TurnStarted(cid, user.id, answer.id)
        yield SafetyVerdict("input", False, verdict.category, reason, verdict.score, verdict.threshold, verdict.detector)
        yield Done(cid, answer.id, reason, "blocked")

    def _answer(self, cid: str, user: StoredMessage, history: list[StoredMessage], params: SamplingParams,
                cancel: threading.Event | None, *, speak: bool = False, model: str = "",
                scope: frozenset[str] | None = None, tap: Any = None,
                begin: Callable[[], Any] | None = None) -> Iterator[TurnEvent]:
        answer = self.store.add_message(cid, "assistant", "", parent_id=user.id, status="partial")
        yield TurnStarted(cid, user.id, answer.id)
        turn = TurnState(cid, SourceLedger(), None if scope is None else frozenset(scope))
        turn.prefer, turn.tap, turn.begin = model, tap, begin
        chat, ids, memory = _prompt_history(history)
        transformers = [t.for_turn(cid) if hasattr(t, "for_turn") else t for t in self.transformers]
        if self.speaker is not None and (speak or self.config.speech.speak_answers):
            try:
                transformers.append(self.speaker())
            except AssistantError as e:  # no voice: the answer still comes, in text, and says why
                yield Notice(f"The answer is not spoken: {e}")
        loop = AgentLoop(self.router, self.tools, self.config, self.options, guard=self._guard(cid),
                         transformers=transformers, prefetch=self.prefetch, summarize=self.summarize)
        try:
            yield from loop.run(turn, user.as_chat(), chat, ids, memory, params, cancel,
                                flush=lambda text: self.store.update_message(answer.id, content=text))
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
        if turn.quarantined:
            meta["quarantined"] = turn.quarantined
        final = turn.text
        asked = on_documents(user.content, turn)
        if len(turn.ledger) and turn.route != "count" and turn.finish in ("stop", "length"):
            evidence = [*turn.evidence, user.as_chat()["content"], *(str(m.get("content") or "") for m in chat),
                        *(p.doc for p in turn.ledger.passages), *(said for _, said in turn.off_documents)]
            grounding = ground(final, Evidence(evidence), turn.ledger.passages)
            final = grounding.text
            meta.update(grounding.to_meta())
        if len(turn.ledger) or turn.documents:
            check = (cited_as_written(final, turn.ledger) if turn.route == "count"
                     else verify_citations(final, turn.ledger, facts=facts_held))
            final = check.text
            meta.update(check.to_meta())
            absent = self._not_in_documents(asked, final, turn) if check.sources else []
            why, instead = "", ""
            if absent:  # cites passages, yet speaks of what no document mentions
                meta["not_in_documents"] = absent
                why, instead = UNMENTIONED.format(terms=" or ".join(absent)), not_mentioned(absent, turn.ledger.passages)
            elif check.sources and isinstance(asked, str) and states_no_number(asked, final):
                meta["states_no_number"] = True
                why, instead = NO_NUMBER, refusal(turn.ledger.passages)
            elif check.sources and isinstance(asked, str) and turn.route != "count" and (
                    count := unstated_count(asked, final, turn.ledger.passages)):
                meta["unstated_count"] = count
                why, instead = UNSTATED_COUNT.format(count=count), refusal(turn.ledger.passages)
            elif check.sources and isinstance(asked, str) and (
                    fact := unstated_default(asked, final, turn.ledger.passages)):
                meta["unstated_default"] = fact
                why, instead = UNSTATED_DEFAULT.format(fact=fact), refusal(turn.ledger.passages)
            if why:
                meta.update({"grounding_refusal": True, "replaced_answer": final})
                final = instead
                check = replace(check, text=final, sources=())
                meta.update(check.to_meta())
                yield Notice(why, replaces_answer=final)
            if self._withdrawn(turn, asked, chat, [s.marker for s in check.sources], meta, cancel):
                meta["withdrawn_answer"] = final  # kept for the record, not shown
                final = refusal(turn.ledger.passages)
                check = replace(check, text=final, sources=())
                meta.update(check.to_meta())
                yield Notice(WITHDRAWN, replaces_answer=final)
            if check.sources or check.dropped_markers:
                yield Sources(check.sources, check.dropped_markers)
        if turn.memory is not None:
            meta["memory"] = turn.memory
        self.store.update_message(answer.id, content=final, status="complete", meta=meta)
        yield Usage(turn.prompt_tokens, turn.completion_tokens, turn.context_window, turn.dropped, turn.cached_tokens,
                    turn.num_calls, turn.breakdown, turn.all_prompt_tokens)
        yield Done(cid, answer.id, final, turn.finish)

    def _not_in_documents(self, question: Any, answer: str, turn: TurnState) -> list[str]:
        """The things the question names that a citing answer speaks of, but that neither the turn's
        texts nor any document in its scope mention (assistant/grounding.py, "what the question names"):
        such an answer was made up from a nearby fact. The library is searched only for the few terms
        the cheap tests leave."""
        library = getattr(self.prefetch, "mentions", None)
        if not (isinstance(question, str) and callable(library)):
            return []
        seen = "\n".join([*turn.evidence, *(f"{p.doc} {p.heading or ''}" for p in turn.ledger.passages)])
        return [term for term in question_terms(question)
                if mentions(answer, term) and not mentions(seen, term) and not library(term, turn.scope)]

    def _withdrawn(self, turn: TurnState, question: Any, chat: list[Message], markers: list[int],
                   meta: dict[str, Any], cancel: threading.Event | None) -> bool:
        """Whether the answer check (assistant/answer_check.py) withdraws a document answer the large
        model wrote and grounding kept; its reply goes into `meta`. A follow-up ("And the second one?")
        is not checked: the check reads the question alone."""
        if not (self.options.check_answers and len(turn.ledger) and turn.route == LARGE and turn.finish == "stop"
                and not meta.get("grounding_refusal") and isinstance(question, str)):
            return False
        if is_follow_up(question, user_questions(chat)):
            return False
        try:
            keep, reply = passages_hold_answer(self.router.large(), question,
                                               cited_passages(markers, turn.ledger.passages), turn.ledger.passages,
                                               cancel=cancel)
        except AssistantError:  # the check may only withdraw: without it the answer stands
            return False
        meta["answer_check"] = reply
        return not keep

    def summarize(self, memory: str, messages: list[Message], max_tokens: int = MAX_MEMORY_TOKENS) -> str:
        """Fold `messages` (and the previous memory) into a short summary, written by the small model."""
        transcript = "\n".join(f"{m['role']}: {m['content']}" for m in messages)
        if memory:
            transcript = f"Earlier summary: {memory}\n{transcript}"
        prompt = [{"role": "system", "content": "You summarise conversations. Keep names, numbers and decisions."},
                  {"role": "user", "content": f"Summarise this conversation in a few sentences:\n\n{transcript}"}]
        params = SamplingParams(max_tokens=max_tokens)
        return "".join(d.text for d in self.engine.generate(prompt, params)).strip()


def _verdict_meta(verdict: Any) -> dict[str, Any]:
    """What a blocked message's meta keeps of the verdict (the audit table has the rest)."""
    return {"category": verdict.category, "score": verdict.score, "threshold": verdict.threshold,
            "detector": verdict.detector}


def _before_verdict(event: TurnEvent) -> bool:
    """Whether `event` may pass while the input's second opinion is pending (it shows nothing of the answer)."""
    if isinstance(event, (TurnStarted, SafetyVerdict)):
        return True
    return isinstance(event, (ToolCallStarted, ToolCallFinished)) and event.call_id.startswith("auto_")


def _prompt_history(history: list[StoredMessage]) -> tuple[list[Message], list[str], str]:
    """(chat messages, their ids, memory): the active branch after the newest stored summary."""
    memory, start = "", 0
    for i, m in enumerate(history):
        mem = m.meta.get("memory") if m.meta else None
        if mem:
            covered = next((j for j, n in enumerate(history) if n.id == mem.get("through_id")), None)
            if covered is not None:
                memory, start = mem.get("summary", ""), covered + 1
    kept = [m for m in history[start:] if m.role in ("user", "assistant") and m.status not in ("error", "blocked")
            and m.content and m.meta.get("finish_reason") != "blocked"]
    return [m.as_chat() for m in kept], [m.id for m in kept], memory
