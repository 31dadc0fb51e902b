"""Grounding: an answer to a document question states only the facts the turn's texts hold.

Design note — a fact the model could not have read is one it made up:
  * Small models asked what the documents do not say answer anyway ("libtasn1 needs OpenSSL 1.1.1 or
    later", "the spec assigns text/markdown", a made-up `docker run` line), and no prompt wording made
    the 0.5B model refuse (0 of 9 dev unanswerables). Whether the answer is *supported* is checkable
    in code, so it is checked in code, after the answer and before it is stored.
  * The *facts* of an answer are its specific tokens, the ones a reader would act on and a model
    cannot guess right: numbers and versions (1.1.1, 0x100, 63), identifiers (ASN1_SUCCESS,
    idn2_to_ascii_8z, mime.cache, text/markdown, --name), ALL-CAPS names, quoted and code spans.
  * The *evidence* is every text the model was shown for the turn: the passages and tool results
    that entered through the agent loop's one door (`observe`), the question and the conversation.
    The answer to a part of a compound question that the prefetch judged off the documents ("Where is
    the shed key, and what is 3 times 7?") is its own evidence: no passage was meant to hold "21", and
    the whole answer had been refused for it.
  * A fact is supported when the evidence holds it as a whole word (case-insensitive, whitespace and
    line-break hyphens folded; a number also as its word, "2" as "two"). A sentence with an
    unsupported fact is dropped; an answer left with no sentence that states a fact, or one with more
    unsupported facts than supported ones ("use this command: <made-up block>"), becomes a refusal
    that names the closest passages, so the user knows where to look.
  * A name the model copied one letter off ("glob2" for the passage's "globs2": a dev two-hop answer
    lost its first half so) is not made up: it is spelt as the evidence spells it, when exactly one
    token there is one letter away with the same digits (`Evidence.spelling`). Numbers and versions
    are never respelt.
  * Sentences without facts ("It is a compact purifier.") are left to the citation check
    (assistant/citations.py), which removes markers no passage supports.
  * Passage headers the model copied from the context ("[3] manual.pdf p. 8 (section X): …") are
    removed first: they are the prompt's layout, not an answer, and their file names would count as
    unsupported facts. An answer that was only such a header is a refusal too.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

from assistant.citations import (NUMBER_WORDS, Passage, content_words, counted_noun, fold_text,  # noqa: F401
                                 mentions, specific_terms, stem)

# "libidn2.pdf p. 6", as passages are headed
DOC_PAGE = r"[\w.+-]+\.(?i:pdf|html?|md|markdown|docx?|txt|rst|odt|epub)[ \t]+p\.[ \t]*\d+"
POINTER_VERBS = ("found|stated|cited|indicated|mentioned|given|described|located|listed|explained|shown|provided|taken|"
                 "documented|seen|noted|referenced|specified|written")  # "it is <verb> in passage [2]": where, not what
ECHO = re.compile(r"(?:\[\d{1,3}\][ \t]*)?" + DOC_PAGE +
                  r"(?:[ \t]*\(section[^)\n]*\))?(?:[ \t]*:[ \t]*|(?:[ \t]*\[\d{1,3}\])?[ \t.]*$)", re.I | re.M)
CODE_BLOCK = re.compile(r"```.*?(?:```|$)", re.S)
FACT = re.compile(
    r"`[^`\n]+`"  # inline code
    r"|[A-Za-z0-9_./+-]*\d[A-Za-z0-9_./+-]*"  # numbers, versions, hex, names with digits
    r"|[A-Za-z0-9_./-]*_[A-Za-z0-9_./-]*"  # snake_case identifiers
    r"|\b[A-Z][A-Z0-9]{2,}\b"  # ALL-CAPS names
    r"|[A-Za-z][\w-]*/[\w.+-]+"  # type/subtype, paths
    r"|(?<![\w-])--?[A-Za-z][\w-]*"  # options
    r"|\b[A-Za-z]\w*\.[A-Za-z]\w*\b")  # file.ext, module.name
META = re.compile(  # a sentence about where the answer was read, not part of it ("It is found in passages [1] and [3].")
    r"^\W*(?:(?:it|this|that|these|the answer|th(?:is|ese) \w+|the (?:relevant )?information)\s+(?:is|are|was|were|can be|"
    r"could be|may be)\s+(?:\w+\s+){0,2}?(?:" + POINTER_VERBS + r")\b(?=.*\b(?:passages?|documents?|documentation|manual|section|p\.)(?!\w)"
    r"|\s+(?:in|from|at|on|by)(?:\W+(?:and|or))*\W*$)"  # "It is cited in [1] and [3].", its markers removed
    r"|the passages?\b.{0,120}?\b(?:provides?|contains?|gives?|holds?)\s+(?:the\s+|this\s+)?(?:relevant\s+)?information\b)",
    re.I | re.S)
SENTENCES = re.compile(r"(?<=[.!?])[ \t]+(?=[A-Z`\"'(\[*-])|\n+")
MARKERS = re.compile(r"\[\d{1,3}(?:\s*,\s*\d{1,3})*\]")
POINTER_CLAUSE = re.compile(  # ", as stated in the first passage [1]", ", which is in passage [3]": where, not what
    r",?[ \t]+(?:as[ \t]+)?(?:which[ \t]+(?:is|are)[ \t]+)?(?:(?:is|are|was|were)[ \t]+)?"
    r"(?:(?:" + POINTER_VERBS + r")[ \t]+)?"
    r"(?:in|from)[ \t]+(?:the[ \t]+)?(?:(?:first|second|third|fourth|fifth|last|same|above|cited)[ \t]+)?"
    r"(?-i:passages?)(?:[ \t]+from)?(?=[ \t]*(?:\[\d|[.!?](?:\s|$)|$))", re.I)
PASSAGE_SENTENCE = re.compile(  # "The passage from zstd-README.md p. 1 (section …) provides the command [1].", after the answer
    r"(?<=[.!?\]])[ \t]+(?:The|This)[ \t]+passages?[ \t]+(?:from|in|on)[ \t]+" + DOC_PAGE +
    r"(?:[ \t]*\([^()\n]*\))?[^.!?\n]*[.!?](?:[ \t]*" + MARKERS.pattern + ")?")
LEADING_MARKERS = re.compile(r"^\s*(?:\[\d{1,3}(?:\s*,\s*\d{1,3})*\][\s.]*)+(?=\w)")  # markers before any word
OPENING_MARKERS = re.compile(r"^\s*(?:\[\d{1,3}(?:\s*,\s*\d{1,3})*\][ \t]*)+")
REFUSAL = "The documents I searched do not say."
MAX_POINTERS = 3
MAX_DOUBLED = 400  # an answer said twice is looked for when each half can be at most this long
DIGIT_WORDS = {digits: word for word, digits in NUMBER_WORDS.items()}  # "2" -> "two"
EMPTY_WORDS = frozenset({"the", "a", "an", "it", "this", "is", "see"})
# "the 4th row" says where, as "the fourth row" does: a position, not a fact (a dev answer with lz4's
# right speed, "4500 MB/s ... the 4th row", was refused for "4th" twice)
ORDINAL = re.compile(r"\d{1,3}(?:st|nd|rd|th)", re.I)
ABBREVIATIONS = frozenset({"e.g", "i.e", "etc", "vs", "cf", "a.k.a"})
MIN_RESPELL = 5  # shorter names are respelt by no one: "glob" and "globs" are two words
TOKEN = re.compile(r"[A-Za-z0-9_][\w./+-]*")
VERSION = re.compile(r"v?(\d+(?:\.\d+)+)")  # a version, with or without its "v"


@dataclass(frozen=True)
class Grounding:
    text: str  # the answer with unsupported sentences (and copied passage headers) removed
    unsupported: tuple[str, ...]  # the facts no evidence holds
    refused: bool  # the whole answer was unsupported and is now a refusal
    respelled: tuple[tuple[str, str], ...] = ()  # (as the model wrote it, as the evidence does)

    def to_meta(self) -> dict:
        meta = {"unsupported_facts": list(self.unsupported), "grounding_refusal": self.refused}
        return {**meta, "respelled": [list(pair) for pair in self.respelled]} if self.respelled else meta


def strip_echoes(answer: str) -> str:
    """The answer without passage headers copied from the context ("[2] doc.pdf p. 4: …"), without
    markers before its first word (they cite nothing), and without sentences after the first that
    only say where it was read ("It is found in the passage from …"), nor such clauses (", as stated in
    the first passage [1]"): the user never saw "the passages", and the sources already say where each
    fact comes from."""
    text = LEADING_MARKERS.sub("", answer)  # "[1] The version is 0.21 [1].": a first reply that was only "[1]"
    text = PASSAGE_SENTENCE.sub("", text)  # its header's "(section …: 3 [1]. …)" would split it into two sentences
    meta = [s for s in _sentences(text)[1:] if META.match(MARKERS.sub("", s))]  # before the headers go: "p. 3" says it
    for sentence in meta:
        text = text.replace(sentence, "", 1)
    text = ECHO.sub("", text)
    pointed = POINTER_CLAUSE.sub("", text)
    if pointed != text and says_anything(pointed):
        return re.sub(r"[ \t]{2,}", " ", pointed).strip()
    return re.sub(r"[ \t]{2,}", " ", text).strip() if meta else text


def says_anything(text: str) -> bool:
    """Whether `text` has a word besides citation markers and an article ("[1]" and "The [4]" do not)."""
    return any(w.lower() not in EMPTY_WORDS for w in re.findall(r"\w+", MARKERS.sub(" ", text)))


def facts(text: str) -> list[str]:
    """The specific tokens of `text` (see the design note), citation markers left out."""
    out = []
    for match in FACT.finditer(MARKERS.sub(" ", text)):
        token = match.group(0).strip("`'\".,;:()[]")
        if (len(token) >= 2 or token.isdigit()) and token.lower() not in ABBREVIATIONS and not ORDINAL.fullmatch(token):
            out.append(token)
    return out


class Evidence:
    """The texts the model was shown, folded for whole-word lookups."""

    def __init__(self, texts: Iterable[str]) -> None:
        texts = [t for t in texts if t]
        self.text = " " + " ".join(fold_text(t) for t in texts) + " "
        self._raw, self._tokens = texts, None  # the evidence's identifiers, for `spelling` (read when asked)

    def spelling(self, fact: str) -> str | None:
        """The evidence's own spelling of an identifier the model copied one letter off ("glob2" for
        "globs2"): the one token that differs from `fact` by a letter inserted, dropped or changed, with
        the same digits. None when there is none or more than one: a number or a version is never
        changed, and "glob2" is not "glob" or "globs"."""
        if len(fact) < MIN_RESPELL or not any(c.isalpha() for c in fact):
            return None
        if self._tokens is None:
            self._tokens = {t.strip(".-/") for raw in self._raw for t in TOKEN.findall(raw)}
        near = {t for t in self._tokens if _one_letter_off(fact.lower(), t.lower())}
        return near.pop() if len(near) == 1 else None

    def holds(self, fact: str) -> bool:
        folded = fold_text(fact)
        if not folded:
            return True
        # whole words; a number is not the tail of a longer one ("11.1" of "1.11.1", "5" of "2.5"), nor a whole
        # number the head of a decimal ("2" of "2.5"); a version may be the head of a longer one ("1.11" of
        # "1.11.1"), and "v1.11.1" and "1.11.1" are one version (a dev answer quoting Ninja's "v1.11.1" was refused)
        version = VERSION.fullmatch(folded)
        core = rf"v?{re.escape(version.group(1))}" if version else re.escape(folded)
        after = r"(?![\w])" if "." in folded else r"(?![\w])(?!\.\d)"
        if re.search(rf"(?<![\w])(?<!\d\.){core}{after}", self.text):
            return True
        word = DIGIT_WORDS.get(folded)
        return word is not None and f" {word} " in self.text


def ground(answer: str, evidence: Evidence, passages: Sequence[Passage] = ()) -> Grounding:
    """Drop the sentences of `answer` whose facts the evidence does not hold (see the design note)."""
    text = _without_repeats(strip_echoes(answer))
    if answer.strip() and not says_anything(text):  # nothing but a copied passage header or a marker: no answer
        return Grounding(refusal(passages), (), True)
    kept, unsupported, stated, supported, respelled = [], [], 0, 0, []
    for sentence in _with_trailing_markers(_sentences(text)):
        found = facts(sentence)
        missing = [f for f in found if not evidence.holds(f)]
        for fact in list(missing):  # a name copied one letter off is the passage's name, spelt as it is there
            spelt = evidence.spelling(fact)
            if spelt is not None:
                sentence = re.sub(rf"(?<![\w-]){re.escape(fact)}(?![\w-])", spelt, sentence)
                missing.remove(fact)
                respelled.append((fact, spelt))
        supported += len(found) - len(missing)
        if missing:
            unsupported.extend(missing)
            continue
        stated += bool(found)
        kept.append(sentence)
    if not unsupported and not respelled:
        return Grounding(text, (), False)
    body = " ".join(s.strip() for s in kept if s.strip())
    if not unsupported:
        return Grounding(body, (), False, tuple(respelled))
    if stated == 0 or len(unsupported) > supported:  # mostly made up: what is left is not worth showing
        return Grounding(refusal(passages), tuple(dict.fromkeys(unsupported)), True, tuple(respelled))
    return Grounding(body, tuple(dict.fromkeys(unsupported)), False, tuple(respelled))


def _without_repeats(text: str) -> str:
    """`text` without a sentence it already said (markers aside): an answer asked once more (the
    agent loop's NAME_IT) may say its first sentence again. Untouched when nothing repeats."""
    def key(sentence: str) -> str:
        return " ".join(MARKERS.sub(" ", fold_text(sentence)).split()).rstrip(". ")

    whole = text.strip()  # said twice with no sentence end between: "X prints everything [1] X prints everything [1]"
    cuts = [i for i, c in enumerate(whole) if c == " "] if len(whole) <= 2 * MAX_DOUBLED else []
    for i in reversed(cuts):  # the last cut that halves it keeps the first half's "[1]"
        if (first := key(whole[:i])) and first == key(whole[i + 1:]):
            return whole[:i]
    said: set[str] = set()
    kept, repeated = [], False
    for sentence in _sentences(text):
        key_ = key(sentence)
        if key_ and key_ in said and not sentence.lstrip().startswith(("-", "*", "|", "```")):
            repeated = True
            continue
        said.add(key_)
        kept.append(sentence.strip())
    return " ".join(kept) if repeated else text


def _one_letter_off(a: str, b: str) -> bool:
    """Whether `b` is `a` with one letter inserted, dropped or changed (never a digit)."""
    if a == b or abs(len(a) - len(b)) > 1:
        return False
    if len(a) == len(b):
        diff = [(x, y) for x, y in zip(a, b) if x != y]
        return len(diff) == 1 and diff[0][0].isalpha() and diff[0][1].isalpha()
    short, long_ = (a, b) if len(a) < len(b) else (b, a)
    return any(long_[i].isalpha() and long_[:i] + long_[i + 1:] == short for i in range(len(long_)))


def facts_held(passages: Iterable[Passage]) -> Callable[[str], dict[int, int]]:
    """citations.FactSupport: for a claim, how many of its facts each passage holds, by marker (the
    span match that assigns a claim's citation to the passage its names and numbers come from).
    Each passage is folded once per answer, not once per claim."""
    folded = [(p.marker, Evidence([p.text])) for p in passages]

    def held(claim: str) -> dict[int, int]:
        found = list(dict.fromkeys(facts(claim)))
        return {marker: sum(e.holds(f) for f in found) for marker, e in folded} if found else {}

    return held


# -- an answer that only restates the question -----------------------------------------------------
# Asked for a named thing, the 1.5B model at times answers by restating the question: "Which ninja -t
# clean flag also deletes files built by generator rules?" -> "The ninja -t clean flag also deletes files
# built by generator rules [1]." (4 of the 14 dev two-hop questions lost a part so). Such an answer names
# nothing the question does not: no identifier, number, code span, hyphenated or capitalised name, nor
# a word of its own ("The special rule name is phony" names "phony"). The agent loop then asks once more
# for the name (agent_loop.NAME_IT). Measured on dev it is worth little: on one copy of the eval library
# a two-hop part was won so, on the other no answer changed; the 1.5B model mostly restates again (the
# repeat is dropped, `_without_repeats`). It costs one more call on the few answers it flags.
ASKS_NAME = re.compile(r"\b(?:which|what)\s+(?:[\w./+-]+\s+){0,3}?(?P<noun>files?|functions?|flags?|options?|"
                       r"parameters?|arguments?|tools?|variables?|fields?|elements?|commands?|headers?|directives?|"
                       r"settings?|keys?|(?:storage )?class(?:es)?|formats?|attributes?|keywords?|rules?|procedures?|macros?|"
                       r"programs?|(?:return |error )?codes?|names?)\b", re.I)
DECLINES = re.compile(r"\b(?:not|no|cannot|can't|doesn't|don't|unknown|unclear)\b", re.I)
HYPHENATED = re.compile(r"(?<![\w-])[A-Za-z]\w*(?:-\w+)+")  # "generic-icons" names what "generic icons" does not


def restates(question: str, answer: str) -> str:
    """The thing `question` asks to be named ("file") when `answer` names nothing the question does not
    (see above), else "". A refusal or an answer that says something is not so is no restatement."""
    asked = ASKS_NAME.search(question)
    if asked is None or not says_anything(answer) or DECLINES.search(answer):
        return ""
    text = MARKERS.sub(" ", answer).strip()
    named = [*facts(text), *specific_terms(text), *HYPHENATED.findall(text)]
    new = [t for t in named if not re.search(rf"(?<![\w-]){re.escape(t)}(?:e?s)?(?![\w-])", question, re.I)]
    # nor a word of its own: "The keyword is dejagnu", "The special rule name is phony" name it in plain words
    words = {stem(w) for w in content_words(text)} - {stem(w) for w in content_words(question)}
    return "" if new or words else asked.group("noun").lower()


# -- what the question names --------------------------------------------------------------------
# A question may name a thing the documents never mention ("Which minimum OpenSSL version does libtasn1
# need?"). Grounding cannot see the answer is made up: the question is evidence, so "OpenSSL" is held,
# and the version the model took ("4.19.0", the manual's own) is in a passage. The answer check read
# the title page and said yes. So a thing the question names is looked for in the turn's texts and, when
# they lack it, in the whole library (DocumentPrefetch.mentions); an answer that cites passages and
# speaks of a thing no document mentions says so instead (the orchestrator).
QUESTION_TERM = re.compile(
    r"(?<![\w.%-])(?:(?=[\w.-]*\d)(?=[\w.-]*[^\W\d_])[^\W_][\w.-]*[^\W_]"  # a letter and a digit: IDNA2008, v2.3.0
    r"|[^\W\d_]\w*_\w+"  # snake_case
    r"|\d+(?:\.\d+)+"  # a dotted version: 2.3.0
    r"|%[A-Za-z])(?![\w-])"  # a format code: %V
    r"|(?<![\w-])([A-Z][a-z]*[A-Z][\w+]*)(?:'s)?(?!\w)")  # a capital inside a word: OpenSSL, ISO, TeX
# Not a word that is only capitalised ("Docker", "Markdown"): in German every noun is, and an answer in
# German over English manuals would name things in words that no document holds ("Bibliothek").


def question_terms(question: str) -> list[str]:
    """The things `question` names that a text either mentions or not: identifiers, versions, format
    codes and words with a capital inside, wherever they stand ("(OpenSSL)", a sentence's first word)."""
    out = []
    for match in QUESTION_TERM.finditer(question.replace("\u2019", "'")):
        term = (match.group(1) or match.group(0)).rstrip(".")
        if len(term) >= 2:
            out.append(term)
    return list(dict.fromkeys(out))


# A question that asks for a version ("What is the minimum Tcl version DejaGnu needs?") is
# not answered by a text without a number: the 1.5B model, with nothing in the passages, described DejaGnu
# and Tcl at length, citing them, and no rule above had a fact to object to.
ASKS_NUMBER = re.compile(r"\b(?:which|what)\s+(?:(?:is|was)\s+)?(?:the\s+)?(?:[\w.-]+\s+){0,2}version\b(?!\s+numbers?)"
                         r"|\bsince\s+(?:which|what)\s+(?:[\w.-]+\s+)?version\b", re.I)
# (not "how much": "at least ASN1_MAX_TL_SIZE bytes" answers "how much space must the buffer have")
# a number: not the digit of a name ("X2", "libidn2")
A_NUMBER = re.compile(r"(?<![A-Za-z_\d])\d|\bv\d|\b(?:" + "|".join(NUMBER_WORDS) + r"|none)\b", re.I)


def states_no_number(question: str, answer: str) -> bool:
    """Whether `question` asks for a version and `answer` (markers aside) holds no number besides the
    question's own: "Which Unicode version are libidn2's IDNA2008 tables generated from?" is not answered
    by "… IDNA2008 tables is Unicode TR46" (a name with digits is no number either)."""
    if not ASKS_NUMBER.search(question):
        return False
    text, asked = MARKERS.sub(" ", answer), Evidence([question])
    for fact in facts(text):
        if asked.holds(fact):
            text = re.sub(rf"(?<![\w.]){re.escape(fact)}(?![\w])", " ", text)
    return not A_NUMBER.search(text)


# A count the model wrote itself ("The datatypes page lists 5 mathematical operators [1].") is a guess
# unless a passage states it: small models cannot count (assistant/counting.py), and a counting question
# reaches the model only when the count path found no list to count. On a dev run, all three such answers
# were wrong: 5 operators (9), 2 file formats (4), and "100 MIME types" for a question the documents do not
# answer, read off "the maximum is 100".
COUNT_WORDS = 4  # words a stated count may have between its number and its noun ("six date and time functions")


def unstated_count(question: str, answer: str, passages: Sequence[Passage]) -> str:
    """The number `answer` gives as the count a "how many X" `question` asks for, when no passage
    states that number of X (the number, then X within COUNT_WORDS words); "" otherwise, and when the
    answer states no count."""
    noun = counted_noun(question)
    if noun == "items":
        return ""
    head = stem(noun.split()[-1])
    number = rf"(\d+|{'|'.join(NUMBER_WORDS)})"
    stated = re.compile(rf"(?<![\w.]){number}\s+(?:[\w/-]+\s+){{0,{COUNT_WORDS}}}?{re.escape(head)}", re.I)
    found = stated.search(fold_text(MARKERS.sub(" ", answer)))
    if not found:
        return ""
    given = found.group(1).lower()
    forms = {given, NUMBER_WORDS.get(given, given), DIGIT_WORDS.get(given, given)}
    for passage in passages:
        for match in stated.finditer(fold_text(passage.text)):
            if match.group(1).lower() in forms:
                return ""
    return given


# A question about a default ("What is the default page size of a new SQLite database?") is answered by a
# passage that says what the default is. The 1.5B model answered two unanswerable dev questions from a
# nearby fact, "65536" (the *largest* page size) and "level 1" (zstd's README compares with it), and the
# answer check said yes to both; every answerable dev question about a default has its answer in a
# sentence that says so ("the default weight value is 50", "which defaults to 999", "normally set to").
ASKS_DEFAULT = re.compile(r"\bdefault\b|\b(?:don't|do not|didn't|did not)\s+(?:specify|set|give|pass|choose)\b"
                          r"|\bwithout\s+(?:specifying|setting|giving|passing)\b|\bif\s+I\s+(?:omit|leave\s+out)\b", re.I)
SAYS_DEFAULT = re.compile(r"\bdefault|\bnormally\b|\bunless\b|\botherwise\b|\bomitted\b|\bnot\s+(?:specified|given|set)\b"
                          r"|\bif\s+(?:no|none)\b|\binitially\b|\bimplicit|\bassumed?\b", re.I)
TABLE_LINE = re.compile(r"^\s*\|")


def unstated_default(question: str, answer: str, passages: Sequence[Passage]) -> str:
    """The fact `answer` gives for the default a `question` asks about ("What is the default …", "… when I
    don't specify one?") when no passage states any of the answer's facts in a sentence that speaks of a
    default (a table row: with its header); "" otherwise, and when the answer gives no fact the question
    does not name itself."""
    if not ASKS_DEFAULT.search(question):
        return ""
    asked = Evidence([question])
    # the facts of the sentences that state the default ("The default … is 50"), not of one that adds
    # something ("It is available since Ninja 1.2"); all of them when no sentence says "default"
    sentences = _sentences(MARKERS.sub(" ", answer))
    stating = [s for s in sentences if SAYS_DEFAULT.search(s)] or sentences
    given = [f for s in stating for f in facts(s) if not asked.holds(f)]
    if not given:
        return ""
    for passage in passages:
        for context in _default_contexts(passage.text):
            if SAYS_DEFAULT.search(context) and any(Evidence([context]).holds(f) for f in given):
                return ""
    return given[0]


def _default_contexts(text: str) -> list[str]:
    """A passage's sentences, and each table row with its table's first line (its header: "| Option |
    Default |")."""
    out, header, prose = [], None, []
    for line in text.splitlines():
        if TABLE_LINE.match(line):
            header = header or line
            out.append(f"{header} {line}")
        else:
            header = None
            prose.append(line)
    return out + _sentences(" ".join(prose))  # a PDF wraps lines mid-sentence: "default" may be a line up


def not_mentioned(terms: Sequence[str], passages: Sequence[Passage]) -> str:
    """The refusal for a question about things no document mentions."""
    named = " or ".join(terms)
    return refusal(passages).replace(REFUSAL, f"The documents I searched do not mention {named}.", 1)


def refusal(passages: Sequence[Passage]) -> str:
    where = list(dict.fromkeys(f"{p.doc} p. {p.page}" if p.page is not None else p.doc for p in passages))
    if not where:
        return REFUSAL
    return f"{REFUSAL} The closest passages I found are in {', '.join(where[:MAX_POINTERS])}."


def _sentences(text: str) -> list[str]:
    """Sentences and list lines; a fenced code block is one sentence (a made-up command is one claim)."""
    out, last = [], 0
    for block in CODE_BLOCK.finditer(text):
        out += SENTENCES.split(text[last:block.start()]) + [block.group(0)]
        last = block.end()
    return [s for s in out + SENTENCES.split(text[last:]) if s and s.strip()]


def _with_trailing_markers(sentences: list[str]) -> list[str]:
    """A marker written after a sentence's full stop ("… is icons.xml. [3] The …") opens the next piece;
    it is the earlier sentence's citation, so it moves back to it and is dropped or kept with it."""
    out: list[str] = []
    for piece in sentences:
        opening = OPENING_MARKERS.match(piece)
        if opening and out:
            out[-1] = f"{out[-1].rstrip()} {opening.group(0).strip()}"
            piece = piece[opening.end():]
        if piece.strip():
            out.append(piece)
    return out
