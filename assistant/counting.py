"""Counting questions ("how many options does asn1Decoding accept?") answered by listing, then counting.

Design note — counting over a whole section:
  Small models cannot count: with whole pages in front of it, the 0.5B model answered every "how
  many…" question of the dev part wrongly (0 of 8). Nor can it list: asked to copy the items one per
  line, it listed 2 of 5 options, 6 of 15 modifiers, or looped on one table row (measured on four dev
  questions, three prompt wordings). So a counting question takes its own path, and the counting is
  done in code over the structure of the section the question is about (tools/retrieval.py reads that
  whole section, across pages):
    1. `item_lists` finds the section's lists: runs of table rows (header, rule and empty rows left
       out), bulleted or numbered items (a line ending in ":" between them starts a new list),
       command-line options, or a label line that repeats ("[Return code]", each item being the line
       after it), each with its lead-in (the lines before its first item). An HTML definition list
       is parsed into bulleted "- term: definition" lines at ingest (ingest/parse.py), where its
       structure is certain. Guessing one here instead (a short term line, then its description)
       was tried first: it found NINJA_STATUS's 10 placeholders, but the section read ended at its
       last chunk's end and held 3 of them (it now ends at the next section's heading,
       ingest/retriever.py `Retriever.section`), and Ninja's variable reference, where subsection
       headings alternate with paragraphs like terms, became one list across sections;
    2. `section_items` takes the list the question counts, and only one that something names: a
       lead-in that names the counted noun ("Some subclass rules are implicit:") or ends on its head
       word in the plural ("... a complete list of valid strftime() substitutions:" for "format
       substitutions"), a table whose first header names it, an option list for "options"/"flags",
       or, failing those, the section's
       heading ("3. Modifiers"). The first version took the section's longest list whatever it was,
       and on held-out questions counted the wrong list (a feature list for "how many command-line
       utilities"): 3 of 13 right. A confident wrong count is worse than the model's own answer;
    3. the answer (`count_answer`) states the count and lists the items, each cited with the passage
       it is on.
  A section where nothing names the counted thing, or without a list (the items run through prose,
  or the question counts part of a list: "how many of the limits can be lowered"), is listed by the
  model instead: asked in a call the user does not see (LIST_ITEMS) to copy out every item the
  question counts, one per line, which the 1.5B model that answers document turns does far better
  than counting (the 0.5B could do neither, above). `listed_items` reads its lines; code counts them.
  A list that names more than an acronym the question counts ("How many RFCs ...": five RFC links and
  Unicode's TR46) counts the members that carry the acronym (`named_members`).
  An item counts only where a passage shown to the model holds it (`supported_items`), which also
  gives its citation and drops what the model made up; fewer than MIN_LISTED such items, and the
  ordinary answer with the whole section in context is given instead.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Sequence

from assistant.citations import Passage, content_words, counted_noun, holds_plural_head, names, stem  # noqa: F401 - API here too

BULLET = re.compile(r"^\s*(?:[-*•·]|\d{1,3}[.)](?!\d)|\(\d{1,3}\))\s*")  # not "1.3 Design goals"
MAX_ITEMS = 60  # a listing longer than this is not a count the section supports
MIN_LISTED = 2  # items of the model's listing a passage must hold before they are counted
LIST_ITEMS = ("{question}\n\nDo not answer with a number. Copy out every item the question counts, one per line, "
              "each line starting with \"- \" and written exactly as in the passages. Write nothing else.")


TABLE_ROW = re.compile(r"^\s*\|.*\|\s*$")
TABLE_RULE = re.compile(r"^\s*\|?[\s:|]*-[\s:|-]*\|[\s:|-]*$")  # "|---|:--|", not "| | |" (an empty row)
EMPTY_ROW = re.compile(r"^[\s|]*$")
OPTION = re.compile(r"^\s*-{1,2}[A-Za-z0-9]")
MIN_ITEMS = 2
MAX_WRAPS = 3  # continuation lines one list item may wrap onto
LEAD_IN_CHARS = 200
WRAPPED = re.compile(r"^[a-z0-9/(\[`'\"_<*-]")  # how a wrapped line of an item starts


@dataclass
class ItemList:
    """One list in a section: its form, its items, and what introduces it (the sentence before its
    first item; for a table also its first header cell)."""

    form: str  # "table", "bullet", "option" or a repeated label such as "[Return code]"
    items: list[str]
    lead_in: str = ""
    header: str = ""  # a table's first header cell: what each row is ("Compressor name")


def bullet_runs(lines: Sequence[str]) -> list[ItemList]:
    """Bulleted or numbered items, each with the lines it wraps onto: a PDF breaks "... are subclasses
    of" / "application/octet-stream." over two lines. A line continues the item before it when that
    item has no closing punctuation yet and the line starts in lower case or with a symbol (a new
    sentence or heading starts with a capital), at most MAX_WRAPS lines; a marker with nothing after it
    ("100." alone, the end of "The priority defaults to") is such a line, not an item. A line ending in ":" between
    items starts a new list (it introduces one), and so does a number out of sequence ("3. Modifiers",
    the section's own heading, then "1. NNN days"); other prose between items (a page's running
    header) does not."""
    runs: list[ItemList] = []
    wraps, number = MAX_WRAPS, None
    for i, line in enumerate(lines):
        if BULLET.match(line) and not OPTION.match(line) and BULLET.sub("", line, count=1).strip():
            digits = re.match(r"\s*\(?(\d+)", line)
            n = int(digits.group(1)) if digits else None
            if not runs or wraps == -1 or (n is not None and number is not None and n != number + 1):
                runs.append(ItemList("bullet", [], lead_in(lines, i)))
            number = n
            runs[-1].items.append(BULLET.sub("", line, count=1))
            wraps = 0
        elif (runs and 0 <= wraps < MAX_WRAPS and not runs[-1].items[-1].rstrip().endswith((".", "!", "?", ":", ";"))
              and not OPTION.match(line) and not TABLE_ROW.match(line) and WRAPPED.match(line)):
            runs[-1].items[-1] += " " + line
            wraps += 1
        else:
            wraps = -1 if line.rstrip().endswith(":") else max(wraps, MAX_WRAPS)  # prose ends the last item
    return runs


def bullets(lines: Sequence[str]) -> list[str]:
    """Every bulleted or numbered item of `lines` (see bullet_runs)."""
    return [item for run in bullet_runs(lines) for item in run.items]


def lead_in(lines: Sequence[str], at: int) -> str:
    """The sentence just before line `at`, what introduces a list ("The available modifiers are as
    follows."), at most LEAD_IN_CHARS: an HTML paragraph is one long line, and its earlier sentences
    are about other things."""
    before = " ".join(lines[max(0, at - 3):at])
    sentences = re.split(r"(?<=[.!?])\s+(?=\S)", before.rstrip())
    return sentences[-1][-LEAD_IN_CHARS:] if sentences else ""


def without_empty_cells(text: str) -> str:
    """`text` (whitespace folded) with a table row's empty cells left out: "| %d | | day |" -> "| %d | day |"."""
    return re.sub(r"\|(?: ?\|)+", "|", text)


def item_lists(text: str) -> list[ItemList]:
    """Every list `text` (one section) holds, by item form (see the design note)."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    out: list[ItemList] = []
    i = 0
    while i < len(lines):  # tables: runs of rows, header and rule rows left out
        if not TABLE_ROW.match(lines[i]):
            i += 1
            continue
        j = i
        while j < len(lines) and TABLE_ROW.match(lines[j]):
            j += 1
        rows = [line for line in lines[i:j] if not TABLE_RULE.match(line) and not EMPTY_ROW.match(line)]
        ruled = any(TABLE_RULE.match(line) for line in lines[i:j])
        header = rows[0].strip("|").split("|")[0] if ruled and rows else ""
        out.append(ItemList("table", rows[1:] if ruled else rows, lead_in(lines, i), header))
        i = j
    out.extend(bullet_runs(lines))
    options = [k for k, line in enumerate(lines) if OPTION.match(line)]
    if options:
        out.append(ItemList("option", [lines[k] for k in options], lead_in(lines, options[0])))
    labels: dict[str, list[int]] = {}
    for k, line in enumerate(lines[:-1]):
        if re.fullmatch(r"\[[^\]]{2,40}\]", line):  # "[Return code]" before each item
            labels.setdefault(line, []).append(k)
    for label, at in labels.items():
        out.append(ItemList(label, [lines[k + 1] for k in at], lead_in(lines, at[0]) + " " + label))
    for found in out:  # a table row's empty cells (an HTML table's spacer column) are left out: "%d | day of month"
        rows = found.form == "table"
        found.items = [(without_empty_cells if rows else str)(" ".join(item.split())).strip("|").strip()
                       for item in found.items]
    return [found for found in out if len(found.items) >= MIN_ITEMS]


OPTION_NOUNS = {"option", "flag", "switch", "argument", "parameter"}


def section_items(text: str, noun: str = "", heading: str = "") -> list[str]:
    """The items of the list the question counts, from `text` (one section under `heading`): the
    longest list that something names `noun` for: its lead-in together with the section's heading,
    its form (an option list counts options, flags, ...), or a table's first header cell
    ("Compressor name" for "compressor configurations"). [] when nothing names what is counted, or
    the question asks for a part of a list ("how many of the limits..."): then the model answers
    from the section. Without a noun, the longest list."""
    if re.match(r"of\b", noun, re.I):
        return []  # "how many of the limits can be lowered": a part of the list, which takes reading
    lists = item_lists("\n".join(line for line in text.splitlines() if line.strip() != heading.strip() or not heading))
    if noun:
        option_noun = any(stem(w) in OPTION_NOUNS for w in noun.split())
        lists = [found for found in lists if names(f"{heading} {found.lead_in}", noun)
                 or names_plural_head(found.lead_in, noun)
                 or (found.form == "option" and option_noun)
                 or any(names(found.header, word) for word in noun.split() if len(word) > 3)]
    return max(lists, key=lambda found: len(found.items)).items if lists else []


HEAD_WORDS = 5  # the words at a lead-in's end where it names what its list holds


def names_plural_head(lead_in: str, noun: str) -> bool:
    """Whether a list's lead-in names the counted noun's head word in the plural, as the question writes it:
    "The following is a complete list of valid strftime() substitutions:" introduces what "how many format
    substitutions" counts, though it never says "format". Only at the lead-in's end, where it says what
    follows: "For simple types like OCTET STRING the simple parsing functions listed below may be used
    instead." introduces functions, not "ASN.1 types". A singular is no list's name ("The full lookup order
    for a variable is:" does not introduce "top-level variables")."""
    return holds_plural_head(lead_in, noun, HEAD_WORDS)  # "... may be used instead." names no types


ACRONYM = re.compile(r"[A-Z]{2,}s?")  # a counted noun written as an acronym: "RFCs", "URLs"


def named_members(items: Sequence[str], noun: str) -> list[str]:
    """The items that carry the counted acronym's name, when most but not all of a list's items do: "How many
    RFCs does the libidn2 manual's introduction point to?" counts the five links to an rfc58xx of a list that
    also links Unicode's TR46 (a dev count answered 6 so). Only an acronym: it names a kind of identifier that
    each member spells out, where a plain noun ("functions") is also a word of other items' descriptions."""
    head = noun.split()[-1] if noun.split() else ""
    if not ACRONYM.fullmatch(head):
        return list(items)
    name = re.compile(rf"(?<![A-Za-z]){re.escape(stem(head))}s?(?![A-Za-z])", re.I)  # "rfc5890", "RFC 3492", not "idle"
    holding = [item for item in items if name.search(item)]
    return holding if 2 * len(holding) >= len(items) and 0 < len(holding) < len(items) else list(items)


def supported_items(items: Sequence[str], passages: Sequence[Passage]) -> list[tuple[str, int]]:
    """The items some passage contains, with that passage's marker: verbatim (whitespace- and
    case-insensitively), or every content word of the item is in the passage."""
    flat = [(p.marker, without_empty_cells(" ".join(p.text.split()).lower()), content_words(p.text)) for p in passages]
    out: list[tuple[str, int]] = []
    for item in items:
        needle, words = without_empty_cells(" ".join(item.split()).lower()), content_words(item)
        marker = next((m for m, text, vocab in flat if needle in text or (words and words <= vocab)), None)
        if marker is not None:
            out.append((item, marker))
    return out[:MAX_ITEMS + 1]


def listed_items(text: str) -> list[str]:
    """The items of the model's listing: its bulleted or numbered lines, without citation markers or a
    closing full stop, each once (case-insensitively), at most MAX_ITEMS + 1."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        if not BULLET.match(line):
            continue
        item = re.sub(r"\s*\[\d{1,3}\]", "", BULLET.sub("", line, count=1)).strip().rstrip(".;,")
        item = item.strip("`*\"' ") or item.strip()  # quotes and emphasis around an item, not an item "*" itself
        if item:
            out.setdefault(" ".join(item.lower().split()), item)
    return list(out.values())[:MAX_ITEMS + 1]


def count_answer(question: str, items: Sequence[tuple[str, int]]) -> str:
    """The answer to a counting question from its supported items: the number, then the items."""
    # each item cited where it was found, the marker inside the item's sentence (after its full stop it
    # would read as the start of the next sentence, and the citation check would add a second one)
    lines = "\n".join(f"- {item.rstrip().rstrip('.')} [{marker}]" for item, marker in items)
    return f"There are {len(items)} {counted_noun(question)}:\n{lines}"
