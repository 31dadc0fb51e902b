"""Counting questions ("how many options does asn1Decoding accept?") answered by listing, then counting.

Design note — counting over a whole section:
  Small models cannot count: with whole pages in front of it, the 0.5B model answered every "how
  many…" question of the dev part wrongly (0 of 8). Nor can it list: asked to copy the items one per
  line, it listed 2 of 5 options, 6 of 15 modifiers, or looped on one table row (measured on four dev
  questions, three prompt wordings). So a counting question takes its own path, and the counting is
  done in code over the structure of the section the question is about (tools/retrieval.py reads that
  whole section, across pages):
    1. `section_items` finds the section's list: the most frequent item form among its lines — rows
       of a table (header and rule rows left out), bullets or numbers, command-line options, or a
       label line that repeats ("[Return code]", each item being the line after it);
    2. the count is the number of those items; the answer (`count_answer`) states it and lists the
       items, each cited with the passage it is on.
  A section without such a list (the items run through prose) falls back to the ordinary answer
  with the whole section in context. An item counts only where a passage shown to the model holds it
  (`supported_items`), which also gives its citation.
"""

from __future__ import annotations

import re
from typing import Sequence

from assistant.citations import Passage, content_words

HOW_MANY = re.compile(r"\bhow many\s+(?P<noun>.+?)\s+(?:does|do|did|are|is|were|was|can|could|will|would|has|have|"
                      r"exist|appear|get)\b", re.I)
BULLET = re.compile(r"^\s*(?:[-*•·]|\d{1,3}[.)](?!\d)|\(\d{1,3}\))\s*")  # not "1.3 Design goals"
MAX_ITEMS = 60  # a listing longer than this is not a count the section supports


TABLE_ROW = re.compile(r"^\s*\|.*\|\s*$")
TABLE_RULE = re.compile(r"^\s*\|?[\s:|-]+\|[\s:|-]*$")
OPTION = re.compile(r"^\s*-{1,2}[A-Za-z0-9]")
MIN_ITEMS = 2
MAX_WRAPS = 3  # continuation lines one list item may wrap onto
WRAPPED = re.compile(r"^[a-z0-9/(\[`'\"_<*-]")  # how a wrapped line of an item starts


def bullets(lines: Sequence[str]) -> list[str]:
    """Bulleted or numbered items, each with the lines it wraps onto: a PDF breaks "... are subclasses
    of" / "application/octet-stream." over two lines. A line continues the item before it when that
    item has no closing punctuation yet and the line starts in lower case or with a symbol (a new
    sentence or heading starts with a capital), at most MAX_WRAPS lines."""
    items: list[str] = []
    wraps = 0
    for line in lines:
        if BULLET.match(line) and not OPTION.match(line):
            items.append(BULLET.sub("", line, count=1))
            wraps = 0
        elif (items and wraps < MAX_WRAPS and not items[-1].rstrip().endswith((".", "!", "?", ":", ";"))
              and not OPTION.match(line) and not TABLE_ROW.match(line) and WRAPPED.match(line)):
            items[-1] += " " + line
            wraps += 1
        else:
            wraps = MAX_WRAPS  # prose after the list ends the last item
    return items


def section_items(text: str) -> list[str]:
    """The items of the list that `text` (one section) holds, by its most frequent item form (see the
    design note); [] when no form occurs at least MIN_ITEMS times."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    rows = [line for line in lines if TABLE_ROW.match(line) and not TABLE_RULE.match(line)]
    forms: dict[str, list[str]] = {
        "table": rows[1:] if rows and any(TABLE_RULE.match(line) for line in lines) else rows,
        "bullet": bullets(lines),
        "option": [line for line in lines if OPTION.match(line)],
    }
    labels: dict[str, list[str]] = {}
    for i, line in enumerate(lines[:-1]):
        if re.fullmatch(r"\[[^\]]{2,40}\]", line):  # "[Return code]" before each item
            labels.setdefault(line, []).append(lines[i + 1])
    for label, items in labels.items():
        forms[label] = items
    best = max(forms.values(), key=len)
    return [" ".join(item.split()).strip("|").strip() for item in best] if len(best) >= MIN_ITEMS else []


def counted_noun(question: str) -> str:
    """What a "how many X ..." question counts ("options"), or "items"."""
    match = HOW_MANY.search(question) or re.search(r"\bhow many\s+(?P<noun>.+)$", question, re.I)
    if not match:
        return "items"
    words = match.group("noun").rstrip("?.!").split()[:4]
    plural = next((i for i, w in enumerate(words)
                   if w.lower().endswith("s") and not w.lower().endswith(("ss", "us", "is")) and len(w) > 3), None)
    return " ".join(words[: plural + 1] if plural is not None else words[:1])  # "rules decide…" -> "rules"


def supported_items(items: Sequence[str], passages: Sequence[Passage]) -> list[tuple[str, int]]:
    """The items some passage contains, with that passage's marker: verbatim (whitespace- and
    case-insensitively), or every content word of the item is in the passage."""
    flat = [(p.marker, " ".join(p.text.split()).lower(), content_words(p.text)) for p in passages]
    out: list[tuple[str, int]] = []
    for item in items:
        needle, words = " ".join(item.split()).lower(), content_words(item)
        marker = next((m for m, text, vocab in flat if needle in text or (words and words <= vocab)), None)
        if marker is not None:
            out.append((item, marker))
    return out[:MAX_ITEMS + 1]


def count_answer(question: str, items: Sequence[tuple[str, int]]) -> str:
    """The answer to a counting question from its supported items: the number, then the items."""
    # each item cited where it was found, the marker inside the item's sentence (after its full stop it
    # would read as the start of the next sentence, and the citation check would add a second one)
    lines = "\n".join(f"- {item.rstrip().rstrip('.')} [{marker}]" for item, marker in items)
    return f"There are {len(items)} {counted_noun(question)}:\n{lines}"
