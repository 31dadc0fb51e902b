"""Hidden-state taps: the mean hidden state of one span of a prompt at a few layers, taken by the
engine while it prefills that prompt anyway.

Why: the safety second opinion (assistant/safety/probe.py) is a linear head on the chat model's own
middle layers, pooled over the user's message. Run as a forward pass of its own, it cost ~120-160 ms
on this CPU, longer than a short turn's whole prefill (~90 ms), and the turn's first token waited for
it. The turn's prefill computes exactly those hidden states, so a tap on the request reads them for
the price of a few row sums: the verdict is ready when the prompt is.

Protocol (one tap, one request, one engine thread filling it, any thread waiting on it):
  * the caller makes `HiddenTap(text, layers)` and hands it to `LocalEngine.generate(..., tap=tap)`;
  * the engine `bind`s it to the encoded prompt: the span is the last place the text's own tokens
    occur (its first `max_tokens`), found by token match, so no template knowledge is needed. The
    request then reuses no prefix-cache blocks that reach into the span (`limit`), so every position
    of the span is computed by this request, in order;
  * each step that computes positions of the span adds their rows' sum per layer (model.py), and
    `advance` completes the mean after the span's last position;
  * anything that stops that (no span found, the request failed or was cancelled first, an engine
    that has no taps) `decline`s it. `wait` returns the features, or None once declined: the reader
    then computes them itself. The first of `finish`/`decline` wins; waiting never hangs on a
    request that ended.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence


@dataclass(eq=False)
class HiddenTap:
    text: str  # the user message whose tokens are pooled
    layers: tuple[int, ...]  # hidden-state indices as HF counts them: the output of that many decoder layers
    max_tokens: int = 200  # the first tokens of the text read
    source: str = ""  # the engine whose hidden states the reader was trained on (routing hands it only to that one)
    span: tuple[int, int] | None = None  # prompt positions [lo, hi) pooled (set by `bind`)
    reason: str = ""  # why it was declined
    _sums: Any = None  # (len(layers), D) running sums, engine thread only
    _next: int = 0  # the next span position to add
    _result: Any | None = None
    _settled: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _callbacks: list = field(default_factory=list)

    def bind(self, prompt_ids: Sequence[int], tokenize: Callable[[str], list[int]]) -> bool:
        """Find the span of the text's tokens in the prompt (the last occurrence); False (declined) when
        the text's tokens do not occur as such (a template that rewrites the message, say)."""
        body = tokenize(self.text)[: self.max_tokens]
        n = len(body)
        for lo in range(len(prompt_ids) - n, -1, -1) if n else ():
            if prompt_ids[lo] == body[0] and list(prompt_ids[lo:lo + n]) == body:
                self.span, self._next = (lo, lo + n), lo
                return True
        self.decline("the message's tokens were not found in the prompt")
        return False

    @property
    def limit(self) -> int:
        """Prompt tokens the request may take from the prefix cache (those before the span)."""
        return self.span[0] if self.span else 0

    def rows(self, start: int, num_new: int) -> tuple[int, int] | None:
        """The span positions among a step's new positions [start, start + num_new), as offsets into
        them, or None when the step has none (or the tap is settled)."""
        if self.span is None or self._settled.is_set():
            return None
        lo, hi = max(self._next, start), min(self.span[1], start + num_new)
        if lo >= hi:
            return None
        if lo != self._next:  # positions of the span were skipped: the sums would be wrong
            self.decline("part of the message was not computed by this request")
            return None
        return lo - start, hi - start

    def add(self, index: int, row_sum: Any) -> None:
        """Engine thread: add one layer's sum over this step's span rows (index into `layers`)."""
        if self._sums is None:
            self._sums = row_sum.new_zeros((len(self.layers), row_sum.numel()))
        self._sums[index] += row_sum

    def advance(self, upto: int) -> None:
        """Engine thread: the span is computed up to position `upto`; completes it at the span's end."""
        self._next = upto
        if self.span is not None and upto >= self.span[1] and self._sums is not None:
            mean = (self._sums / (self.span[1] - self.span[0])).float().cpu().numpy().reshape(-1)
            self._settle(mean, "")

    def decline(self, reason: str) -> None:
        self._settle(None, reason)

    def _settle(self, result: Any | None, reason: str) -> None:
        with self._lock:
            if self._settled.is_set():
                return
            self._result, self.reason = result, reason
            self._settled.set()
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback(self)

    def on_settle(self, callback: Callable[["HiddenTap"], Any]) -> None:
        """Call `callback(tap)` once it is settled (at once if it is): on the settling thread, which may
        be the engine's, so it must be quick and must not raise."""
        with self._lock:
            if not self._settled.is_set():
                self._callbacks.append(callback)
                return
        callback(self)

    @property
    def settled(self) -> bool:
        return self._settled.is_set()

    @property
    def features(self) -> Any | None:
        return self._result

    def wait(self, timeout: float | None = None) -> Any | None:
        """The features (len(layers) * D,) float32, or None when declined (or not settled in time)."""
        self._settled.wait(timeout)
        return self._result


def tap_source(engine: Any) -> str:
    """Whose hidden states an engine's taps hold: model, weights and device. A reader names the one it
    was trained on (`HiddenTap.source`); routing hands a tap only to an engine that matches it."""
    device = getattr(getattr(engine, "device", None), "type", "?")
    return f"{getattr(engine, 'name', '?')}-engine-{getattr(engine, 'quantize', None) or 'none'}-{device}"


def generate_kwargs(engine: Any, tap: HiddenTap | None, kwargs: dict) -> dict:
    """`kwargs` for `engine.generate`, with the tap when that engine can fill it; else the tap is
    declined (so its reader computes the features itself) and left out."""
    if tap is None:
        return kwargs
    if not tap.settled and tap_source(engine) == tap.source:
        return {**kwargs, "tap": tap}
    tap.decline(f"the turn's model is {tap_source(engine)}, not {tap.source}")
    return kwargs

