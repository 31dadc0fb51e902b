"""Document retrieval, the one door through which passages reach the model: the `search_documents`
(top-k chunks) and `read_document` (whole pages, for "summarise the file", "how many…", "compare
the two documents") tools, and `DocumentPrefetch`, which the agent loop runs before its first engine
call so that a question about the documents starts with the right passages in context.

Both register what they return in the turn's SourceLedger, so every passage the model sees has a
marker `[n]` it can cite and the orchestrator can verify. The retriever is any object with
`search(query, k, filters) -> [hit]` (hit: chunk_id, doc_id, path or doc, page, text),
`read(doc, pages) -> [page]` (page: doc_id, path, page, text) and `documents() -> [record]`;
`ingest.retriever.Retriever` is the real one, tests pass a small fake.

Design note — a turn's document scope: a turn may be limited to some documents (the API key's own,
the conversation's files: the server computes which, assistant/keys.py `DocumentAccess`). Every path
that brings passages into a turn — the two tools, `search_passages`, `read_pages` and the prefetch,
its section and whole-file paths included — goes through `RetrieverHandle.scoped(scope)`, a view in
which only those documents exist: search adds a doc_id filter (and drops any hit outside it, should
a backend ignore the filter), `read` of any other document fails exactly as an unknown one does, and
`documents()` lists only the scope. An empty scope is an empty library: no document tool is offered
and nothing is prefetched. The agent loop hands the scope to the tools in `ToolContext.extra[SCOPE]`;
`None` (the local single user, the CLI, the terminal) is the whole library.
"""

from __future__ import annotations

import itertools
import logging
import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol, Sequence

from assistant.citations import (QUOTED, Passage, SourceLedger, content_words, counted_noun, mentions, names,
                                 holds_plural_head, specific_terms)
from assistant.seams import close_if_closable
from ingest.parse import SUPPORTED_SUFFIXES
from tools.base import Tool, ToolContext, ToolInputError, ToolResult

MAX_PASSAGE_CHARS = 1200  # of one chunk shown to the model
MAX_READ_CHARS = 6000  # of all pages one read_document call returns (the rest is listed as cut)
DOCS_CHECK_TTL_S = 2.0  # how long "are there documents?" is remembered (both tools ask every turn)
DOCUMENT_WORDS = re.compile(r"\b(documents?|files?|pdfs?|manuals?|pages?|uploads?|report)\b", re.I)
# a file name of a kind the library takes (ingest/parse.py), in the library or not ("read carol_plans.txt")
FILE_NAME = re.compile(r"\b[\w.+-]+(?:" + "|".join(re.escape(s) for s in sorted(SUPPORTED_SUFFIXES)) + r")\b", re.I)
# a request to read one file or to ask what it says ("Read notes.pdf", "What does notes.pdf say about X?", "the
# warranty in notes.pdf"), not code to write about one ("a Python script that reads data.csv"): `unknown_files`
ASKS_FILE = re.compile(r"\b(?:read|open|show|summari[sz]e|summary|overview|compare|according to|cite|quote)\b"
                       r"|\b(?:in|from|does|did|do)\s+(?:the\s+)?(?:file\s+|document\s+)?" + FILE_NAME.pattern
                       + "|" + FILE_NAME.pattern + r"\s+(?:says?|said|mentions?|covers?|lists?|contains?)\b", re.I)
CODE_WORDS = re.compile(r"\b(?:script|code|program|function|python|pandas|snippet|regex|bash|shell|command|parse|"
                        r"parser|class|module|import)\b", re.I)
# a request for code to read ("Write a Python function that…", "Implement binary search in Python"): the agent
# loop does not offer it the code interpreter (agent_loop.py), and "files" in it does not make it about the documents
WRITE_CODE = re.compile(
    r"^\s*(?:please\s+)?(?:(?:can|could|would)\s+you\s+(?:please\s+)?)?(?:write|create|give\s+me|show\s+me|implement)"
    r"\s+(?:me\s+)?(?:a|an|the|some)?\s*(?:[\w+#.-]+\s+){0,3}?(?:functions?|scripts?|programs?|class|methods?|query|"
    r"regex|regular\s+expression|snippet|code|one-liner|decorator)\b|^\s*(?:please\s+)?implement\b", re.I)
# a question that may need the code interpreter: a number in it, or a word of computing. Any other question is
# not offered it (agent_loop.py): with its spec in the prompt the 1.5B model answered "How many minutes are in a
# day?" with "24", "How many planets are in our solar system?" with "3" (2026-12-01)
COMPUTES = re.compile(
    r"\d|\b(?:calculat\w*|comput\w*|convert\w*|factorials?|fibonacci|primes?|sort\w*|square\s+roots?|squared|cubed|"
    r"powers?|percent\w*|average|mean|median|sum|product|multipl\w*|divid\w*|plus|minus|times|random\w*|simulat\w*|"
    r"plot\w*|graphs?|charts?|run|execute|python|code|scripts?|csv|spreadsheet|solve|equations?|integral|derivative|"
    r"statistics|dice|coin|date|days\s+(?:between|until|since)|how\s+long\s+ago)\b", re.I)
URL = re.compile(r"\b(?:https?://|www\.)\S+", re.I)
IMAGE_NOTE = re.compile(r"^\[image \d+ \(.*$", re.M)  # an attached picture's description (store.py `as_chat`)
LISTED_DOCUMENTS = 12  # names a "No document ..." reply lists before "and N more"
# "What documents do I have?", "List my files", "What's in my library?" (the whole question: not "Which files
# does update-mime-database write?" nor "What files are there in the zstd README?")
LISTS_DOCUMENTS = re.compile(
    r"^\s*(?:(?:what|which)\s+(?:documents|files|pdfs|manuals|uploads)\s+(?:do\s+I\s+have|have\s+I\s+(?:uploaded|added)"
    r"|did\s+I\s+(?:upload|add)|are\s+there|are\s+(?:uploaded|available)|can\s+you\s+(?:see|read|search|access))"
    r"|(?:please\s+)?(?:list|show)(?:\s+me)?(?:\s+(?:all|my|the))*\s+(?:documents|files|uploads|library)"
    r"|what(?:'s|\s+is)\s+in\s+my\s+library|how\s+many\s+(?:documents|files)\s+(?:do\s+I\s+have|have\s+I\s+uploaded))"
    r"(?:\s+(?:in\s+(?:my|the)\s+library|so\s+far|right\s+now|now|here|uploaded|available))*\s*[?.!]*\s*$", re.I)
UPLOAD_HOW = "the web chat's file button, `assistant ingest FILE`, or POST /api/documents"
# a request about whole files: only with a document word or a file name ("deletes a whole structure" is not)
# ("summary" only as "a summary of ...": "what are the summary and log files called" is a lookup)
SUMMARY = re.compile(r"\b(summari[sz]e|summary of|compare|comparison|overview)\b", re.I)
COUNTING = re.compile(r"\bhow many\b|\bnumber of (?:the )?\w+ (?:are|is|does|do)\b", re.I)
# a question that leans on the previous one: "And ...?", "what does it return?", "those", "the second one"
# question words that content_words keeps (its stopwords hold the rest), and "up" ("Up to what value?")
ASKING_WORDS = frozenset({"since", "whose", "up"})
FOLLOW_UP = re.compile(r"^\s*(?:and|also|then|so)\b|\b(?:it|its|that|those|these|them|they|this|one|ones|there)\b", re.I)

log = logging.getLogger(__name__)
Scope = frozenset[str] | None  # doc ids a turn may search and read; None = the whole library
SCOPE = "document_scope"  # the ToolContext.extra key under which the agent loop passes the turn's Scope


def scope_of(ctx: ToolContext | None) -> Scope:
    """The document scope of the turn a tool runs in (None: no restriction)."""
    return ctx.extra.get(SCOPE) if ctx is not None else None


class DocumentNotFound(LookupError):
    """A document that is not there, or not in the turn's scope: the same error either way."""


class RetrieverLike(Protocol):
    def search(self, query: str, k: int | None = None, filters: dict[str, Any] | None = None) -> Sequence[Any]: ...

    def read(self, doc: str, pages: list[int] | None = None) -> Sequence[Any]: ...

    def documents(self) -> Sequence[dict]: ...


class RetrieverHandle:
    """Opens the retriever on first use (loading the embedder takes seconds) and shares it."""

    def __init__(self, factory: Callable[[], RetrieverLike], *, top_k: int = 4,
                 index_dir: Path | None = None) -> None:
        self._factory = factory
        self._index_dir = index_dir  # embedded index location: nothing there means no documents (no load)
        self._checked: tuple[float, frozenset[str]] | None = None  # (when, doc ids) of the last document_ids()
        self._warned = False
        self._retriever: RetrieverLike | None = None
        self._lock = threading.Lock()
        self.top_k = top_k

    @classmethod
    def from_config(cls, config: Any, *, retriever: RetrieverLike | None = None) -> "RetrieverHandle | None":
        """None when the ingest package is not part of this build (and no retriever was given)."""
        top_k = min(getattr(getattr(config, "retrieval", None), "top_k", 4), 4)
        if retriever is not None:
            return cls(lambda: retriever, top_k=top_k)
        try:
            from ingest.retriever import Retriever
        except ImportError:
            return None
        r = config.retrieval
        index_dir = None if r.qdrant_url else Path(config.data_dir) / "qdrant"
        return cls(lambda: Retriever.from_config(config), top_k=top_k, index_dir=index_dir)

    def get(self) -> RetrieverLike:
        with self._lock:
            if self._retriever is None:
                self._retriever = self._factory()
            return self._retriever

    def close(self) -> None:
        """Close the retriever if it was opened (it holds the embedded index)."""
        with self._lock:
            retriever, self._retriever = self._retriever, None
        close_if_closable(retriever)

    def refresh(self) -> None:
        """Forget the cached document_ids() answer (call after ingesting in the same process)."""
        self._checked = None

    def document_ids(self) -> frozenset[str]:
        """The ids of every ingested document; asked for every turn, so the answer is kept DOCS_CHECK_TTL_S."""
        if self._retriever is None and self._index_dir is not None and not self._index_dir.exists():
            return frozenset()
        now = time.monotonic()
        checked = self._checked
        if checked is not None and now - checked[0] < DOCS_CHECK_TTL_S:
            return checked[1]
        try:
            found = frozenset(doc_id_of(d) for d in self.get().documents())
        except Exception as e:  # the index cannot open (locked by another process, broken): say why, go on
            if not self._warned:
                log.warning("Document tools are off: the document index cannot be read (%s).", e)
                self._warned = True
            found = frozenset()
        self._checked = (now, found)
        return found

    def has_documents(self) -> bool:
        """Whether anything is ingested (see document_ids)."""
        return bool(self.document_ids())

    def scoped(self, scope: Scope) -> "RetrieverHandle | ScopedHandle":
        """This handle as a turn limited to `scope` sees it (itself when the scope is None)."""
        return self if scope is None else ScopedHandle(self, scope)


class ScopedHandle:
    """A RetrieverHandle seen through a turn's document scope (see the module's design note)."""

    def __init__(self, handle: RetrieverHandle, doc_ids: frozenset[str]) -> None:
        self.handle, self.doc_ids = handle, frozenset(doc_ids)

    @property
    def top_k(self) -> int:
        return self.handle.top_k

    def get(self) -> "ScopedRetriever":
        return ScopedRetriever(self.handle.get(), self.doc_ids)

    def document_ids(self) -> frozenset[str]:
        return self.doc_ids & self.handle.document_ids() if self.doc_ids else frozenset()

    def has_documents(self) -> bool:
        return bool(self.document_ids())  # an empty scope never opens the index

    def scoped(self, scope: Scope) -> "ScopedHandle":
        return self if scope is None else ScopedHandle(self.handle, self.doc_ids & scope)

    def refresh(self) -> None:
        self.handle.refresh()


class ScopedRetriever:
    """A retriever in which only the documents `doc_ids` exist."""

    def __init__(self, retriever: RetrieverLike, doc_ids: frozenset[str]) -> None:
        self.retriever, self.doc_ids = retriever, doc_ids
        if callable(getattr(retriever, "section", None)):
            self.section = self._section  # offered only when the retriever can find sections

    def search(self, query: str, k: int | None = None, filters: dict[str, Any] | None = None) -> list[Any]:
        filters = dict(filters or {})
        wanted = self.doc_ids
        if "doc_id" in filters:  # a caller's own doc_id filter narrows the scope, never widens it
            given = filters["doc_id"]
            wanted = wanted & set(given if isinstance(given, (list, tuple, set, frozenset)) else [given])
        if not wanted:
            return []
        filters["doc_id"] = sorted(wanted)  # the index's Where language: a list matches any of them
        return [h for h in self.retriever.search(query, k, filters) if getattr(h, "doc_id", None) in wanted]

    def documents(self) -> list[dict]:
        return [d for d in self.retriever.documents() if doc_id_of(d) in self.doc_ids] if self.doc_ids else []

    def readable(self, hits: list[Any]) -> list[Any]:
        return readable(self.retriever, hits)  # the hits are in scope already

    def read(self, doc: str, pages: list[int] | None = None) -> Sequence[Any]:
        """Pages of `doc` (a doc id, a path or a file name, resolved among the scope's documents only)."""
        return self.retriever.read(self._find(doc), pages)

    def _section(self, hit: Any, max_chars: int = 8000) -> Sequence[Any]:
        return self.retriever.section(hit, max_chars) if getattr(hit, "doc_id", None) in self.doc_ids else []

    def similarity(self, query: str) -> float | None:
        """The best cosine of `query` to a chunk of the scope (None: the retriever cannot tell)."""
        measure = getattr(self.retriever, "similarity", None)
        return measure(query, {"doc_id": sorted(self.doc_ids)}) if callable(measure) and self.doc_ids else None

    def _find(self, doc: str) -> str:
        """The doc id `doc` names in the scope, as ingest.pipeline.find_document resolves names."""
        docs = self.documents()
        resolved = str(Path(doc).expanduser().resolve()) if doc else ""
        for d in docs:
            if doc in (doc_id_of(d), d.get("path")) or d.get("path") == resolved:
                return doc_id_of(d)
        named = [d for d in docs if doc_name(d) == doc]
        if len(named) == 1:
            return doc_id_of(named[0])
        if named:
            raise DocumentNotFound(f"{doc!r} names {len(named)} documents: give the doc id or the full path "
                                   f"({', '.join(doc_id_of(d) for d in named)})")
        raise DocumentNotFound(f"no document {doc!r} in this collection: see `assistant docs list`")


def doc_name(item: Any) -> str:
    """A document's display name: the file name of its path."""
    for attr in ("file_name", "doc", "path", "doc_id"):
        value = getattr(item, attr, None) if not isinstance(item, dict) else item.get(attr)
        if value:
            return Path(str(value)).name
    return "document"


def doc_id_of(record: dict) -> str:
    """A library record's doc id (its path for a retriever whose records have none)."""
    return str(record.get("doc_id") or record.get("path") or doc_name(record))


def readable(retriever: Any, hits: list[Any]) -> list[Any]:
    """Hits as the model reads them (ingest.retriever.Retriever.readable: a table with whole rows and
    its header); a retriever without that gives them as they are."""
    complete = getattr(retriever, "readable", None)
    return complete(hits) if callable(complete) else hits


def add_hit(ledger: SourceLedger, hit: Any) -> Passage:
    header = getattr(hit, "header", "")  # a table's header row, when the hit holds rows without it
    text = f"{header}\n{hit.text}" if header else hit.text
    return ledger.add(doc_name(hit), getattr(hit, "page", None), text, str(hit.chunk_id), getattr(hit, "heading", ""))


def add_page(ledger: SourceLedger, page: Any) -> Passage:
    chunk_id = f"{getattr(page, 'doc_id', doc_name(page))}:p{page.page}"
    return ledger.add(doc_name(page), page.page, page.text, chunk_id)


def search_passages(handle: RetrieverHandle, ledger: SourceLedger, query: str, *, k: int | None = None,
                    document: str | None = None) -> list[Passage]:
    filters = {"file_name": Path(document).name} if document else None
    retriever = handle.get()
    return [add_hit(ledger, hit) for hit in readable(retriever, retriever.search(query, k or handle.top_k, filters))]


def read_pages(handle: RetrieverHandle, document: str, pages: list[int] | None = None) -> list[Any]:
    """Whole pages of `document` (not yet registered for citation: see render_within)."""
    try:
        return list(handle.get().read(document, pages or None))
    except Exception as e:  # DocumentNotFound and friends: the model named something that is not there
        if type(e).__name__ in ("DocumentNotFound", "KeyError", "FileNotFoundError"):
            raise ToolInputError(no_document([document], [doc_name(d) for d in handle.get().documents()])) from e
        raise


def no_document(missing: Sequence[str], documents: Sequence[str]) -> str:
    """The one line that says a named file is not among the documents, and which ones there are."""
    names = ", ".join(documents[:LISTED_DOCUMENTS]) or "none"
    if len(documents) > LISTED_DOCUMENTS:
        names += f" and {len(documents) - LISTED_DOCUMENTS} more"
    return f"No document {', '.join(repr(m) for m in missing)}. Documents: {names}."


def listing(records: Sequence[dict]) -> str:
    """The answer to "What documents do I have?": each document with its pages, the first LISTED_DOCUMENTS."""
    shown = []
    for record in records[:LISTED_DOCUMENTS]:
        pages = record.get("num_pages") if isinstance(record, dict) else None
        shown.append(f"{doc_name(record)} ({pages} page{'' if pages == 1 else 's'})" if pages else doc_name(record))
    more = f", and {len(records) - LISTED_DOCUMENTS} more" if len(records) > LISTED_DOCUMENTS else ""
    return (f"You have {len(records)} document{'' if len(records) == 1 else 's'}: {', '.join(shown)}{more}. "
            + (f"Ask about it (\"Summarise {doc_name(records[0])}\")." if len(records) == 1 else
             f"Ask about them, or name one (\"Summarise {doc_name(records[0])}\")."))


def unknown_files(question: str, documents: Sequence[str]) -> list[str]:
    """The files a question asks to read or asks about (`ASKS_FILE`) that none of `documents` is: "Read
    notes.pdf" when there is no notes.pdf. None for a request to write code about a file, a file name inside
    a web address, or an attached picture's name."""
    text = URL.sub(" ", IMAGE_NOTE.sub(" ", question))
    if CODE_WORDS.search(text) or not ASKS_FILE.search(text):
        return []
    have = {d.lower() for d in documents}
    return list(dict.fromkeys(m for m in FILE_NAME.findall(text) if m.lower() not in have))


def render_within(ledger: SourceLedger, pages: Sequence[Any], max_chars: int) -> tuple[list[Passage], list[str], list[Any]]:
    """The one budget loop: pages registered in the ledger and rendered, in order, while they fit in
    `max_chars` (the first one always); returns (passages, their renderings, the pages left over).
    Only pages the model is shown get a marker, so nothing unseen can be cited."""
    passages: list[Passage] = []
    rendered: list[str] = []
    used = 0
    for i, page in enumerate(pages):
        draft = Passage(len(ledger) + 1, doc_name(page), page.page, page.text, "").render()
        if used + len(draft) > max_chars and rendered:
            return passages, rendered, list(pages[i:])
        passage = add_page(ledger, page)
        passages.append(passage)
        rendered.append(passage.render())
        used += len(rendered[-1])
    return passages, rendered, []


def _ledger(ctx: ToolContext) -> SourceLedger:
    if ctx.sources is None:
        ctx.sources = SourceLedger()
    return ctx.sources


class SearchDocumentsTool(Tool):
    name = "search_documents"
    description = (
        "Search the user's uploaded documents. Returns numbered passages like '[1] file.pdf p. 3: text'. "
        "Cite the passages you use with their numbers, e.g. [1]."
    )
    inputs = {
        "query": {"type": "string", "description": "what to look for, in a few words"},
        "document": {"type": "string", "description": "only search this file name", "nullable": True},
    }

    def __init__(self, handle: RetrieverHandle) -> None:
        super().__init__()
        self.handle = handle

    def available(self) -> bool:
        return self.handle.has_documents()  # offered only once something is ingested

    def available_for(self, scope: Scope) -> bool:
        """Whether a turn limited to `scope` has anything to search."""
        return self.handle.scoped(scope).has_documents()

    def forward(self, query: str, document: str | None, ctx: ToolContext) -> ToolResult:
        passages = search_passages(self.handle.scoped(scope_of(ctx)), _ledger(ctx), query, document=document)
        if not passages:
            return ToolResult("No passage matches. Try other words, or read_document for a whole file.",
                              summary="no matches")
        text = "\n".join(p.render(MAX_PASSAGE_CHARS) for p in passages)
        where = ", ".join(sorted({f"{p.doc} p. {p.page}" for p in passages}))
        return ToolResult(text, summary=f"{len(passages)} passages: {where}", data=passages)


class ReadDocumentTool(Tool):
    name = "read_document"
    description = (
        "Read whole pages of one of the user's documents (all pages when none are given). Use it to "
        "summarise a file, count things in it or compare documents. Returns numbered pages like "
        "'[1] file.pdf p. 2: text'; cite them with their numbers."
    )
    inputs = {
        "document": {"type": "string", "description": "the file name, e.g. report.pdf"},
        "pages": {"type": "array", "items": {"type": "integer"}, "description": "1-based page numbers",
                  "nullable": True},
    }

    def __init__(self, handle: RetrieverHandle) -> None:
        super().__init__()
        self.handle = handle

    def available(self) -> bool:
        return self.handle.has_documents()

    def available_for(self, scope: Scope) -> bool:
        return self.handle.scoped(scope).has_documents()

    def forward(self, document: str, pages: list[int] | None, ctx: ToolContext) -> ToolResult:
        found = read_pages(self.handle.scoped(scope_of(ctx)), document, pages)
        if not found:
            return ToolResult(f"{document} has no such pages.", ok=False, summary="no pages")
        passages, parts, rest = render_within(_ledger(ctx), found, MAX_READ_CHARS)
        if rest:
            parts.append(f"(pages {[q.page for q in rest]} not shown: ask for them with the pages argument)")
        return ToolResult("\n".join(parts), summary=f"read {passages[0].doc}: {len(passages)} of {len(found)} pages",
                          data=passages)


DOCUMENT_TOOLS = frozenset({SearchDocumentsTool.name, ReadDocumentTool.name})  # not offered off the documents


@dataclass(frozen=True)
class Prefetched:
    """What DocumentPrefetch put into the turn: shown to the user as an automatic tool step."""

    tool: str  # "search_documents", "read_document" or "read_section"
    arguments: dict[str, Any]
    passages: list[str]  # rendered "[n] doc p. N (section S): text", best first
    summary: str  # one line for display
    count: bool = False  # a "how many" question over one section: the agent loop counts by listing
    texts: list[str] = field(default_factory=list)  # each passage's own text (no header): what the safety
                                                    # guard screens, so scores cached at ingest are found
    about_documents: bool = True  # False: the question is not about the documents ("nothing relevant")
    reply: str = ""  # the whole answer, said without the model: the documents listed, or a named file missing
    ok: bool = True  # False: the question named a file that is not there


def retrieval_query(question: str, history: Sequence[str] = ()) -> str:
    """The search query for `question`: a follow-up ("and the second one?", "what does it return?",
    "since which version?": a pronoun, or one content word at most) is searched together with the
    user's previous question, which holds what "it" refers to."""
    return f"{history[-1]} {question}" if is_follow_up(question, history) else question


def is_follow_up(question: str, history: Sequence[str] = ()) -> bool:
    """Whether `question` leans on the previous one: there is one, and it has a pronoun or at most
    one content word of its own."""
    return bool(history) and bool(FOLLOW_UP.search(question) or len(content_words(question) - ASKING_WORDS) <= 1)


GENERIC_NAME_WORDS = frozenset({"manual", "readme", "spec", "info", "guide", "docs", "document", "notes", "html",
                                "final", "draft", "copy", "page", "file", "index", "book"})


def named_documents(question: str, records: Sequence[dict]) -> dict[str, list[str]]:
    """The documents a question names, by file name -> their doc ids (one file may be indexed from two
    paths): a file name itself ("libtasn1.pdf"), or a word of it that no other file's name holds and
    that is no generic word ("libidn2", "zstd"; not "sqlite", which three names share, nor "manual")."""
    words = {w for w in re.findall(r"[a-z0-9]+", question.lower().replace("\u2019", "'").replace("'s", ""))}
    by_name: dict[str, list[str]] = {}
    for record in records:
        by_name.setdefault(doc_name(record), []).append(doc_id_of(record))
    owners: dict[str, set[str]] = {}
    for name in by_name:
        for word in re.split(r"[^a-z0-9]+", name.rsplit(".", 1)[0].lower()):
            if word not in GENERIC_NAME_WORDS and (len(word) == 4 if word.isdigit() else len(word) >= 4):
                owners.setdefault(word, set()).add(name)  # a year, or a name of four letters or more
    named = {name for word, names_ in owners.items() if len(names_) == 1 and word in words for name in names_}
    named |= {name for name in by_name if name.lower() in question.lower()}
    return {name: by_name[name] for name in sorted(named)}


NAMED_SECTION = re.compile(QUOTED.pattern + r"|\b((?:[A-Z][\w-]*\s+){0,5}[A-Z][\w-]*)\s+(?:section|chapter)\b")


def named_section(question: str) -> str:
    """The section a question names: 'New in this release' in quotes, or "the Return Codes section"."""
    match = NAMED_SECTION.search(question)
    return (match.group(1) or match.group(2)).strip() if match else ""


def section_hit(question: str, hits: Sequence[Any], named: str = "",
                listed: Callable[[Any], bool] | None = None) -> Any | None:
    """The hit whose section a whole-section question is about: one whose heading is the section the
    question names, else the first in the best hit's document whose section holds a list that
    something names as what is counted (`listed(hit)`: "A test is UNRESOLVED when:" and five items,
    for "in how many ways can a test wind up UNRESOLVED", while the best hit was "Running runtest"),
    else one there whose heading names it ("3. Modifiers" for "how many modifiers") or holds its plural
    head word ("Operators" for "how many mathematical operators"), else the best hit under a heading
    among the first three, else the best hit."""
    if not hits:
        return None
    wanted = content_words(named)
    for hit in hits if wanted else ():
        heading = content_words(getattr(hit, "heading", "") or "")
        if heading and wanted <= heading:
            return hit
    noun, best = counted_noun(question), hits[0]
    same_doc = [h for h in hits if doc_name(h) == doc_name(best)]
    if listed is not None and noun != "items":
        found = next((h for h in same_doc if listed(h)), None)
        if found is not None:
            return found
    # "Operators" is the section "how many mathematical operators" counts
    return next((h for h in same_doc if noun != "items" and (names(getattr(h, "heading", "") or "", noun)
                                                             or holds_plural_head(getattr(h, "heading", "") or "", noun))),
                next((h for h in hits[:3] if getattr(h, "heading", "")), best))


FOLLOW_UP_EXTRA = 1  # passages a follow-up's prefetch gets beyond k (DocumentPrefetch)


class DocumentPrefetch:
    """Retrieval before the model's first step, through the same handle, ledger and renderings as
    the tools. Three paths:
      * a request to summarise or compare files (SUMMARY words with a document word or a file name)
        reads whole pages of the files it names (else the first two), within `max_read_chars`;
      * a counting question ("how many…") reads the whole section the best matching chunk lies in
        (`Retriever.section`), so the items that are counted are all in front of the model, and the
        agent loop counts them by listing (see assistant/counting.py);
      * any other question is searched (with the previous question when it is a follow-up), and hits
        that share no content word with it are left out unless it names documents ("file", "pdf",
        ...). A question that names two documents or more (`named_documents`: "the libtasn1 library
        and the libidn2 library") is searched in each of them, and their hits are taken in turn: one
        search over the library had filled all four places with one manual's chunks. A follow-up gets
        one passage more (`FOLLOW_UP_EXTRA`): its query is the earlier question and the new one together,
        so its hits are shared between two topics. On the nine dev follow-ups (2026-11-29) 5 -> 7 right
        by the scorer: "And the first Tuesday in October of this year?" found its example, and "Which of
        those had the glob system...?" got "GNOME and KDE" (KDE, with a wrong one beside it). On the
        held-out test part's follow-up and two-hop questions it changed no score (15 of 21 either way)
        and cost two wrong-page citations. Five passages for every question lost more than they won
        (27 against 28 of 37 dev questions).

    Design note — is the question about the documents at all? Before any of that, a question that is not gets
    nothing ("nothing relevant"), and the agent loop does not offer it the document tools either
    (`DOCUMENT_TOOLS`; the code interpreter stays): with all three tools in its prompt the packaged 0.5B model
    answered "Write a long story about a lighthouse keeper." and "Write a scary story set in an abandoned train
    station." with "I'm sorry, but I can't assist with that.", and with python alone, the two document tools
    alone or no tools it wrote both stories (2026-11-30); a general turn's prompt is shorter by their two specs
    too. Sharing a content word is no sign: with the nine eval documents in the library, 83 of 100 general
    questions ("What is 17 times 23?", "Write a haiku about autumn") shared one ("times", "write") with some chunk,
    got passages, and grounding then withdrew "391" as a fact no passage held. A question is about the documents
    when it names them (a document word, unless it asks for code: "a bash one-liner that counts the lines in
    all .txt files" had been answered "The documents do not say"; a file name the library holds, a word only
    one file's name has, a section the library holds), when its best dense cosine to any chunk reaches
    `min_relevance`, or when a passage found for it holds one of its specific terms (`specific_terms`:
    "OpenSSL", "PRAGMA", "'New in this release'"). A follow-up is judged with the two questions before it. At
    0.4, 9 of the 100 general questions get passages and all 215 eval questions still do (eval/general/gate.py).

    A question that asks to read a file, or what a file says, when no document of the turn is that file
    (`unknown_files`: "Read notes.pdf") is answered with that and the documents there are, before any search and
    without the model: given the search's passages from other files, the 0.5B model answered "Read notes.pdf"
    with "The documents I searched do not say", "Summarise notes.pdf" (which read the first two files) with "ii",
    and "What does notes.pdf say about compression levels?" from the zstd README (2026-12-01). A file name alone
    no longer makes a question about the documents: "Write a Python script that reads data.csv" had been searched,
    offered the document tools, and answered "The documents do not say" (2026-12-01)."""

    def __init__(self, handle: RetrieverHandle, *, k: int = 4, max_read_chars: int = 8000,
                 lists: Callable[[str, str, str], Sequence[str]] | None = None, min_relevance: float = 0.4) -> None:
        self.handle, self.k, self.max_read_chars, self.min_relevance = handle, k, max_read_chars, min_relevance
        # (section text, counted noun, heading) -> the items of the list something there names as what is
        # counted (assistant/counting.py `section_items`, passed in by the composition root); None: the
        # section of a counting question is chosen by headings alone
        self.lists = lists

    def __call__(self, question: str, ledger: SourceLedger, history: Sequence[str] = (), *,
                 scope: Scope = None) -> Prefetched | None:
        handle = self.handle.scoped(scope)  # every path below sees only the turn's documents
        if not handle.has_documents():
            if LISTS_DOCUMENTS.search(question):
                return Prefetched("list_documents", {}, [], "0 documents",
                                  reply=f"You have no documents yet. Upload one ({UPLOAD_HOW}) and ask about it.")
            return None
        retriever = handle.get()
        records = retriever.documents()  # read once per question
        documents = [doc_name(d) for d in records]
        named = [d for d in documents if d.lower() in question.lower()]
        missing = unknown_files(question, documents)
        if missing:  # no search: another file's passages are no answer about this one (nor "do not say")
            line = no_document(missing, documents)
            upload = f"Upload {'it' if len(missing) == 1 else 'them'} ({UPLOAD_HOW}) and ask again."
            return Prefetched("read_document", {"documents": missing}, [], line, ok=False, reply=f"{line} {upload}")
        if LISTS_DOCUMENTS.search(question):  # asked before the search tool is offered: agent_loop.py
            return Prefetched("list_documents", {}, [], f"{len(records)} document{'' if len(records) == 1 else 's'}",
                              reply=listing(records))
        if SUMMARY.search(question) and (named or DOCUMENT_WORDS.search(question)):
            named = named or documents[:2]
            found = [page for d in named for page in read_pages(handle, d)]
            shown, rendered, _ = render_within(ledger, found, self.max_read_chars)
            return Prefetched("read_document", {"documents": named}, rendered, f"read {len(rendered)} pages",
                              texts=[p.text for p in shown])
        query = retrieval_query(question, history)
        if not self._about_documents(retriever, records, question, query, history, named):
            return Prefetched("search_documents", {"query": query}, [], "nothing relevant", about_documents=False)
        if COUNTING.search(question) and callable(getattr(retriever, "section", None)):
            named = named_section(question)
            hits = retriever.search(named, 2 * self.k + 2, None) if named else []  # the section by its name first
            found = retriever.search(query, 2 * self.k + 2, None)
            noun = counted_noun(question)
            best_doc = getattr(found[0], "doc_id", None) if found else None
            if best_doc is not None and noun != "items":  # the counted noun alone, in the best hit's document,
                # finds the section that says it ("Operators" for "how many mathematical operators does the
                # datatypes page list?", which the whole question's words had sent to "Affinity Name Examples")
                found = [*found, *retriever.search(noun, self.k, {"doc_id": [best_doc]})]
            hit = section_hit(question, [*hits, *found], named,
                              self._names_a_list(retriever, question) if self.lists is not None else None)
            if hit is not None:
                pages = retriever.section(hit, self.max_read_chars)
                passages = [ledger.add(doc_name(p), p.page, p.text, f"{hit.chunk_id}:section:p{p.page}", hit.heading)
                            for p in pages]
                where = f"{doc_name(hit)} section {hit.heading or '(untitled)'}"
                return Prefetched("read_section", {"document": doc_name(hit), "section": hit.heading},
                                  [p.render() for p in passages], where, count=True, texts=[p.text for p in passages])
        each = named_documents(question, records)
        if len(each) >= 2:  # "the libtasn1 library and the libidn2 library": passages from each, in turn
            per = [retriever.search(query, self.k, {"doc_id": ids}) for ids in each.values()]
            found = [hit for row in itertools.zip_longest(*per) for hit in row if hit is not None][: self.k]
        else:
            found = retriever.search(query, self.k + (FOLLOW_UP_EXTRA if is_follow_up(question, history) else 0), None)
        hits = readable(retriever, found)
        asks_documents = DOCUMENT_WORDS.search(question) is not None
        wanted = content_words(query)
        passages = [add_hit(ledger, h) for h in hits if asks_documents or wanted & content_words(h.text)]
        where = ", ".join(dict.fromkeys(f"{p.doc} p. {p.page}" for p in passages)) or "nothing relevant"
        return Prefetched("search_documents", {"query": query}, [p.render(MAX_PASSAGE_CHARS) for p in passages], where,
                          texts=[p.text for p in passages])

    def _about_documents(self, retriever: Any, records: Sequence[dict], question: str, query: str,
                         history: Sequence[str], named: Sequence[str]) -> bool:
        """Whether `question` is about the documents at all (see the design note above)."""
        if self.min_relevance <= 0 or named or (DOCUMENT_WORDS.search(question) and not WRITE_CODE.search(question)):
            return True
        section = named_section(question)  # 'New in this release' is one; "good morning" (to translate) is not
        if section and any(mentions(f"{getattr(h, 'heading', '') or ''}\n{getattr(h, 'text', '')}", section)
                           for h in retriever.search(section, 2 * self.k + 2, None)):
            return True
        asked = " ".join([*history[-2:], question]) if is_follow_up(question, history) else question
        if named_documents(asked, records):
            return True
        measure = getattr(retriever, "similarity", None)
        similarity = measure(asked) if callable(measure) else None
        if similarity is None or similarity >= self.min_relevance:  # None: the retriever cannot tell
            return True
        terms = specific_terms(asked)
        return bool(terms) and any(mentions(getattr(h, "text", ""), t)
                                   for h in retriever.search(query, self.k, None) for t in terms)

    def mentions(self, term: str, scope: Scope = None, *, k: int = 20) -> bool:
        """Whether any document of the turn's scope mentions `term` (assistant/grounding.py `mentions`):
        the library searched for it, its best `k` hits read. A term in any chunk is found there: BM25
        ranks its chunks first. No documents, or a search that fails, counts as mentioned."""
        handle = self.handle.scoped(scope)
        try:
            if not handle.has_documents():
                return True
            hits = handle.get().search(re.sub(r"[_-]+", " ", term), k, None)
        except Exception:  # noqa: BLE001 - this may only refuse when it is sure
            log.warning("could not search the library for %r", term, exc_info=True)
            return True
        return any(mentions(f"{doc_name(h)}\n{getattr(h, 'heading', '') or ''}\n{getattr(h, 'text', '')}", term)
                   for h in hits)

    def _names_a_list(self, retriever: Any, question: str) -> Callable[[Any], bool]:
        """Whether a hit's section holds a list something names as what `question` counts
        (assistant/counting.py `section_items`); each section is read once."""
        noun, seen = counted_noun(question), {}

        def listed(hit: Any) -> bool:
            key = (hit.doc_id, hit.heading or f"{hit.page}:{hit.start_char}")
            if key not in seen:
                text = "\n".join(p.text for p in retriever.section(hit, self.max_read_chars))
                seen[key] = bool(self.lists(text, noun, hit.heading or ""))  # type: ignore[misc]
            return seen[key]
        return listed
