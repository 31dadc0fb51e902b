"""Semantic response cache for stateless `/v1/chat/completions` requests (engine.response_cache).

NOTE — what may be answered from the cache, and how a hit is decided.

  Eligible: a raw-model request (not the `assistant` turn: that one retrieves and runs tools) with
  temperature 0, no tools, no pictures, no logprobs (a stored answer has none) (streamed or not); anything else always goes to the engine. The cache is off unless `engine.response_cache` is on *and* the caller's tier has
  `response_cache = true` (the open server's local user counts as enabled).

  Exact part of the key: the caller's scope (its key id: one key never sees another's answers), the
  model id with the serving engine's name and identity (a reloaded or changed model is a new engine
  object: its requests never meet the old answers) and the reply's prefill (JSON mode, a forced tool), the system prompt verbatim, and every sampling
  setting (each SamplingParams field: max_tokens, stop, top_k, top_p, seed, ...). Only entries with the same exact part are compared.

  Similar part: the conversation without its system prompt, normalised (whitespace collapsed,
  "role: text" lines), embedded with the packaged sentence embedder (unit vectors, cosine =
  dot product). A hit needs cosine >= `threshold` AND the same *content words* (`same_terms`: every
  word but function words and the wording of a request, plural-stemmed; in the same order where a
  direction word such as "to" or "from" is present). Measured on 159 pairs of paraphrases and near
  misses (tests/data/semantic_cache_pairs.jsonl, bench/semantic_cache.py): MiniLM puts many near
  misses ("advantages"/"disadvantages", "France"/"Germany", "5 km"/"50 km") as close as true
  paraphrases, some up to 0.99, so no threshold alone is safe (dev false hits 10% at 0.94, 2.5% even at 0.99); the
  word guard is what keeps wrong answers out, at the price of missing paraphrases that use other
  words ("biggest" for "largest"). A miss only costs a generation; a false hit serves a wrong answer.
  The threshold is then chosen on the dev half: the best hit rate with no false hit there, the
  highest such threshold on a tie: 0.94 (dev: hits 17.5% of paraphrases, no false hit). On the 79 test
  pairs at 0.94: paraphrase hits 20%, false hits 0% (similarity alone would serve 10.3% of the near
  misses); a hit takes 11.8 ms p50, 15.4 ms p95, nearly all of it the embedding (11.5 ms).

  Entries expire after `ttl_s`; at most `max_entries` are kept (oldest dropped first). A lookup is a
  matrix-vector product over the entries of one exact key, so it costs the embedding plus
  microseconds. In memory: one process's cache (replicas each keep their own). Counted in the
  server's metrics.
"""

from __future__ import annotations

import re
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from assistant.engine.base import TokenDelta
from assistant.seams import close_if_closable

_WORD = re.compile(r"[A-Za-z][A-Za-z0-9_+#.'-]*|\d+(?:[.,]\d+)*")


def words(text: str) -> frozenset[str]:
    return frozenset(re.sub(r"'s$", "", m.group(0).rstrip(".'").lower()) for m in _WORD.finditer(text))


# Function words and the wording of a request (politeness, question words): rewording them keeps the
# question. Every other word is content.
_FILLER = frozenset("""a an the of in on at to for with about from by as into onto up out over under and or but
is are was were be been being am do does did done doing have has had can could would should will shall may might
must i me my mine you your yours we us our it its this that these those there here which what whats who whom
whose when where why how please tell show explain give let know want need help just some any one kind
user assistant system""".split())


def _stem(word: str) -> str:
    word = re.sub(r"'s$", "", word)
    for suffix in ("ies", "es", "s"):
        if len(word) > len(suffix) + 2 and word.endswith(suffix) and not word.endswith("ss"):
            return word[: -len(suffix)] + ("y" if suffix == "ies" else "")
    return word


def content_words(text: str) -> tuple[str, ...]:
    """The request's content words in order (lower case, crude plural stemming), filler dropped."""
    out = []
    for m in _WORD.finditer(text):
        word = m.group(0).rstrip(".'").lower()
        if word not in _FILLER and _stem(word) not in _FILLER:
            out.append(_stem(word))
    return tuple(out)


def normalise(messages: Sequence[dict[str, Any]]) -> str:
    """"role: text" lines, whitespace collapsed; case is kept (the embedder is uncased)."""
    return "\n".join(f"{m['role']}: {' '.join(str(m.get('content') or '').split())}" for m in messages)


_DIRECTED = frozenset({"to", "from", "into", "than", "vs", "versus"})


def same_terms(a: str, b: str) -> bool:
    """Whether b may be answered with a's answer, as far as words tell: the same content words (so
    "advantages"/"disadvantages", "encode"/"decode", "France"/"Germany", "5"/"50" all differ), and, where
    a direction word is present ("Fahrenheit to Celsius"), in the same order."""
    ca, cb = content_words(a), content_words(b)
    if set(ca) != set(cb):
        return False
    return ca == cb or not (words(a) | words(b)) & _DIRECTED


@dataclass
class CacheStats:
    lookups: int = 0
    hits: int = 0
    stores: int = 0
    expired: int = 0
    evicted: int = 0


@dataclass
class _Entry:
    exact: tuple
    text: str  # the conversation as asked (for the word guard)
    vector: np.ndarray
    answer: dict[str, Any]
    expires: float


@dataclass
class ResponseCache:
    embed: Callable[[list[str]], np.ndarray]  # texts -> (N, dim) unit vectors
    threshold: float  # engine.response_cache_threshold (its default was chosen as the NOTE says)
    ttl_s: float = 3600.0
    max_entries: int = 10_000
    clock: Callable[[], float] = time.monotonic
    stats: CacheStats = field(default_factory=CacheStats)

    def __post_init__(self) -> None:
        self._entries: OrderedDict[int, _Entry] = OrderedDict()
        self._next = 0
        self._lock = threading.Lock()

    @staticmethod
    def eligible(params: Any, tools: Sequence[Any] | None, has_pictures: bool) -> bool:
        return params.temperature == 0 and getattr(params, "logprobs", None) is None and not tools and not has_pictures

    @staticmethod
    def key(scope: str, model: str, messages: Sequence[dict[str, Any]], params: Any) -> tuple[tuple, str]:
        """(exact part, the conversation's text) of a request."""
        system = "\n".join(str(m.get("content") or "") for m in messages if m["role"] == "system")
        settings = tuple(sorted((k, repr(v)) for k, v in vars(params).items()))
        return (scope, model, system, settings), normalise([m for m in messages if m["role"] != "system"])

    def get(self, exact: tuple, text: str) -> tuple[dict[str, Any] | None, np.ndarray]:
        """The stored answer of the most similar live entry that passes, or None; and the query's vector
        (hand it to `put` on a miss, so the conversation is embedded once)."""
        vector = np.asarray(self.embed([text]), dtype=np.float32)[0]
        now = self.clock()
        with self._lock:
            self.stats.lookups += 1
            for eid in [eid for eid, e in self._entries.items() if e.expires <= now]:
                del self._entries[eid]
                self.stats.expired += 1
            candidates = [e for e in self._entries.values() if e.exact == exact]
            if candidates:
                sims = np.stack([e.vector for e in candidates]) @ vector
                for i in np.argsort(-sims):
                    if sims[i] < self.threshold:
                        break
                    if same_terms(text, candidates[i].text):
                        self.stats.hits += 1
                        return candidates[i].answer, vector
        return None, vector

    def put(self, exact: tuple, text: str, vector: np.ndarray, answer: dict[str, Any]) -> None:
        with self._lock:
            self._entries[self._next] = _Entry(exact, text, vector, answer, self.clock() + self.ttl_s)
            self._next += 1
            self.stats.stores += 1
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)
                self.stats.evicted += 1

    def __len__(self) -> int:
        return len(self._entries)


def replay(answer: dict[str, Any]) -> Iterator[TokenDelta]:
    """A stored answer as the engine's one-delta stream (its prompt tokens count as cached)."""
    yield TokenDelta(answer["text"], tuple(answer["token_ids"]), answer["finish_reason"], answer["num_prompt_tokens"],
                     answer["num_generated_tokens"], answer["num_prompt_tokens"])


def recording(deltas: Iterator[TokenDelta], store: Callable[[dict[str, Any]], None]) -> Iterator[TokenDelta]:
    """Passes the engine's deltas through and stores the answer once it finished by itself (stop or
    length: not cancelled, not failed)."""
    text, ids = [], []
    try:
        for d in deltas:
            text.append(d.text)
            ids.extend(d.token_ids)
            yield d
            if d.finish_reason in ("stop", "length"):
                store({"text": "".join(text), "token_ids": ids, "finish_reason": d.finish_reason,
                       "num_prompt_tokens": d.num_prompt_tokens, "num_generated_tokens": d.num_generated_tokens})
    finally:
        close_if_closable(deltas)
