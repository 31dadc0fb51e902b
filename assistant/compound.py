"""Compound questions: "Which file records the weights, and what weight does a glob get?" asked as
two questions, one after the other.

Design note — one question at a time:
  * Asked two things at once, the 1.5B model answers the first by restating it ("The generated file
    records the weight of each glob [1].") and the second from the passages of the first: 5 of 14 dev
    two-hop questions right, against 18 of 22 single lookups. One search for both halves also rarely
    brings both passages.
  * So a question sentence whose parts are joined by ", and which…" / ", what…" is split, and the agent
    loop answers the parts in order, each with its own search, as if the user had asked them one
    after the other: the earlier parts and their answers are the later part's conversation, so "what
    does *that* function return" and "since which version?" read as follow-ups do. The answers are
    shown one after the other, as one answer with one set of sources.
  * What every part needs is kept with it: sentences before the question ("asn1_der_decoding needs
    the structure to be created first.") and an opening clause ("If I store dates as Julian day
    numbers, …", "After runtest --tool gdb, …") are put in front of each part.
  * Only a split at a comma before a question word is made. "Under which licences are libtasn1 and
    libidn2 distributed?" and "What is the default X and how far can it be raised?" stay one
    question: "and" alone joins names as often as questions, and a wrong split asks nonsense.
"""

from __future__ import annotations

import re

MAX_PARTS = 3  # a question of more parts is asked as it is
MAX_CHARS = 400  # longer messages are not one compound question but a pasted text
ASKING = r"(?:which|what|how|where|when|who|whom|whose|why|since|does|do|did|is|are|was|were|can|could|should|will)"
SPLIT = re.compile(rf",\s*(?:and\s+|or\s+)?(?={ASKING}\b)", re.I)
LEAD = re.compile(r"^(?P<lead>.*[.!:])\s+(?=[A-Z`\"'(])(?P<question>[^.!:]*\?)\s*$", re.S)
# the second word of a part that is itself a question ("With which function", "When was it released")
QUESTION_SECOND = re.compile(rf"^\W*\w+\s+(?:{ASKING}|has|have|had|much|many|far|long|old|often)\b", re.I)
CLAUSE_OPENERS = frozenset({"if", "when", "after", "before", "for", "while", "once", "given", "assuming", "suppose",
                            "in", "on", "with", "under", "using", "without", "since", "as", "to"})


def question_parts(text: str) -> list[str]:
    """The questions `text` asks one after the other (see the design note); [text] when it is one."""
    text = text.strip()
    if not text.endswith("?") or len(text) > MAX_CHARS or text.count("?") > 1 or "\n" in text:
        return [text]
    match = LEAD.match(text)
    lead, question = (match.group("lead").strip() + " ", match.group("question")) if match else ("", text)
    pieces = [p.strip() for p in SPLIT.split(question.rstrip("?").strip())]
    clause = ""
    if pieces and _is_clause(pieces[0]):
        clause = pieces.pop(0) + ", "
    if not 2 <= len(pieces) <= MAX_PARTS or any(len(p.split()) < 2 for p in pieces):
        return [text]
    return [lead + (clause + _lower_first(p) if clause else _upper_first(p)) + "?" for p in pieces]


def _is_clause(piece: str) -> bool:
    """Whether the first piece opens the question instead of asking ("If I store dates as REAL")."""
    first = piece.split()[0].lower() if piece.split() else ""
    if re.match(rf"{ASKING}\b", first, re.I) and first not in ("when", "since"):
        return False
    return first in CLAUSE_OPENERS and not QUESTION_SECOND.match(piece)


def _upper_first(text: str) -> str:
    return text[:1].upper() + text[1:]


def _lower_first(text: str) -> str:
    first = text.split()[0] if text.split() else ""
    return text[:1].lower() + text[1:] if re.fullmatch(ASKING, first, re.I) else text  # "Ninja" stays
