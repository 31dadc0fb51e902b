"""Quote, then answer: a document answer starts with the passage sentence that holds the answer, which
the user does not see; the answer follows it.

Design note — reading by copying first:
  * The 1.5B model names the right passage and then loses the fact in its own words (a field name,
    a version, a flag). Asked to copy the sentence that holds the answer first ("Quote: ..."), it
    writes its answer right after reading that sentence once more, in its own output, where the fact
    is a few tokens back rather than somewhere in four passages. Copying is cheap: prompt lookup
    (assistant/engine/speculate.py) drafts a copied sentence several tokens per step.
  * `QuoteFilter` sits in the answer's stream before the sentence cap (assistant/brevity.py): it holds
    text back while the reply starts with "Quote:", drops everything up to "Answer:", and passes the
    rest. A reply that does not start with a quote passes untouched (a tool call never reaches it:
    the tool-call splitter runs first). A reply that quotes and never writes "Answer:" shows the
    quote's sentence as the answer, unless it quoted nothing ("none"): then what the user sees is the
    documents' silence, said as a refusal.
  * The quote is kept (`QuoteFilter.quote`) for the stored message.
"""

from __future__ import annotations

import re

QUOTE_INSTRUCTION = (
    "First, on a line that starts with \"Quote:\", copy word for word the sentence of these passages that "
    "answers the user's question, then its passage number in square brackets. Then, on a line that starts "
    "with \"Answer:\", answer the question in one or two full sentences, using only these passages, with "
    "names and values written exactly as in the passages. End each sentence with the number of the "
    "passage it comes from, in square brackets. If no passage contains the answer, write \"Quote: none\" "
    "and answer that the documents do not say.")
NO_ANSWER = "The documents do not say."

_QUOTE = "quote:"
# "Answer:" and the bold marks and space after it, matched once the answer's first character is there
_ANSWER = re.compile(r"(?:^|\n)\s*\**answer\**\s*:\**\s*(?=[^\s*]|\*\*\w)", re.I)
_NONE = re.compile(r"^\W*(none|n/a|no (?:passage|sentence|quote))\b", re.I)


class QuoteFilter:
    """Feed it reply text as it streams; it returns the part the user sees (see the design note)."""

    def __init__(self) -> None:
        self.text = ""
        self.mode = ""  # "" undecided, "pass": no quote, "hold": inside the quote, "answer": after it
        self.quote = ""
        self.started = False  # the answer after the quote has begun

    def feed(self, chunk: str) -> str:
        if not chunk:
            return ""
        self.text += chunk
        if self.mode == "pass":
            return chunk
        if self.mode == "answer":
            return self._answer(chunk)
        if self.mode == "":
            head = _bare(self.text).lower()
            if len(head) < len(_QUOTE) and _QUOTE.startswith(head):
                return ""
            if not head.startswith(_QUOTE):
                self.mode = "pass"
                return self.text
            self.mode = "hold"
        found = _ANSWER.search(self.text)
        if found is None:
            return ""
        self.mode = "answer"
        self.quote = _quote_of(self.text[:found.start()])
        return self._answer(self.text[found.end():])

    def _answer(self, chunk: str) -> str:
        """Answer text, without the space that may follow "Answer:" (it can come in the next chunk)."""
        if not self.started:
            chunk = chunk.lstrip()
            self.started = bool(chunk)
        return chunk

    def finish(self) -> str:
        """What is still held at the end of the reply."""
        if self.mode == "":  # a reply shorter than "Quote:"
            self.mode = "pass"
            return self.text
        if self.mode != "hold":
            return ""
        self.mode = "answer"
        self.quote = _quote_of(self.text)
        return NO_ANSWER if not self.quote or _NONE.match(self.quote) else self.quote


def _bare(text: str) -> str:
    """`text` without its leading space and bold marks ("**Quote:**")."""
    return text.lstrip().lstrip("*")


def _quote_of(text: str) -> str:
    text = _bare(text).rstrip()
    return text[len(_QUOTE):].lstrip("* ").strip() if text.lower().startswith(_QUOTE) else text
