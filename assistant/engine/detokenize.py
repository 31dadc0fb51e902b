"""Incremental detokenisation and stop strings, shared by every engine backend.

`IncrementalDetokenizer` turns a growing list of token ids into text deltas that never split a UTF-8
character: byte-level BPE tokens can end mid-character, which decodes to U+FFFD until the next token
completes it, so text is only released once it no longer ends in U+FFFD. Decoding restarts from a
small window (`prefix_offset`) instead of from the first token, so each step costs O(window).

`StopMatcher` holds back any tail of the text that could still be the start of a stop string, so a
stop string split across tokens is never partly shown to the user.
"""

from __future__ import annotations

from typing import Any, Sequence

REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_ids: Sequence[int] = (), *, window: int = 6) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = list(prompt_ids[-window:])  # context so the first token decodes with its leading space
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def push(self, token_id: int) -> str:
        """Add one token; return the newly completed text (possibly "")."""
        self.ids.append(token_id)
        decode = self.tokenizer.decode
        prefix = decode(self.ids[self.prefix_offset:self.read_offset], skip_special_tokens=True)
        full = decode(self.ids[self.prefix_offset:], skip_special_tokens=True)
        if len(full) <= len(prefix) or full.endswith(REPLACEMENT_CHAR):
            return ""  # no complete character yet
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        return full[len(prefix):]


class StopMatcher:
    def __init__(self, stop: Sequence[str]) -> None:
        self.stop = tuple(stop)
        self.text = ""  # everything seen so far
        self.emitted = 0  # characters of `text` already released
        self.stopped = False

    def push(self, new_text: str) -> str:
        """Add decoded text; return what is safe to show. Sets `stopped` when a stop string appears."""
        if self.stopped:
            return ""
        self.text += new_text
        if not self.stop:
            out, self.emitted = self.text[self.emitted:], len(self.text)
            return out
        longest = max(len(s) for s in self.stop)
        start = max(0, self.emitted - longest + 1)
        hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
        if hits:
            end = min(hits)
            self.stopped = True
        else:
            end = len(self.text) - self._held_back()
        out = self.text[self.emitted:end] if end > self.emitted else ""
        self.emitted = max(self.emitted, end)
        return out

    def flush(self) -> str:
        """Release held-back text at the end of generation (no stop string completed)."""
        if self.stopped:
            return ""
        out, self.emitted = self.text[self.emitted:], len(self.text)
        return out

    def _held_back(self) -> int:
        """Length of the longest tail of `text` that is a proper prefix of some stop string."""
        best = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(self.text)), best, -1):
                if self.text.endswith(s[:n]):
                    best = n
                    break
        return best
