"""Chunk: pages → `Chunk`s sized in the embedder's tokens, each tied to one page and one heading.

llama-index's `SentenceSplitter` does the splitting (paragraphs, then sentences, then words, packed
up to `chunk_tokens` with `overlap_tokens` carried over). Each page is split on its own, so a chunk
never straddles two pages and its citation is page-exact. Offsets are character offsets into the
page text (`page.text[start_char:end_char] == chunk.text`), so `Retriever.read` and the UI can
highlight the exact passage. A chunk's heading is the heading in force where it starts, counting one
that opens in its first tenth (carried across pages, so page 7 still knows it is in "2. Methods").
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

from ingest.parse import ParsedDocument

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Chunk:
    index: int  # position within the document, 0-based
    page: int  # 1-based page number
    heading: str  # nearest heading ("" when the document has none)
    text: str
    start_char: int  # offsets into the page text
    end_char: int


class Chunker:
    """Token-sized, sentence-aware splitting with overlap (llama-index SentenceSplitter)."""

    def __init__(self, tokenize: Callable[[str], list], *, chunk_tokens: int = 200, overlap_tokens: int = 30) -> None:
        if not 0 <= overlap_tokens < chunk_tokens:
            raise ValueError(f"overlap_tokens={overlap_tokens} must be >= 0 and below chunk_tokens={chunk_tokens}")
        self.tokenize, self.chunk_tokens, self.overlap_tokens = tokenize, chunk_tokens, overlap_tokens
        self._splitter = None  # built on first use: importing llama-index takes ~2 s

    def _get_splitter(self):
        if self._splitter is None:
            try:
                from llama_index.core.node_parser import SentenceSplitter
            except ImportError as e:
                raise ImportError("llama-index-core is not installed: pip install -e '.[ingest]'") from e
            self._splitter = SentenceSplitter(
                chunk_size=self.chunk_tokens, chunk_overlap=self.overlap_tokens, tokenizer=self.tokenize,
                paragraph_separator="\n\n", include_metadata=False, include_prev_next_rel=False,
            )
        return self._splitter

    def split(self, document: ParsedDocument) -> list[Chunk]:
        from llama_index.core import Document

        splitter = self._get_splitter()
        chunks: list[Chunk] = []
        heading = ""
        for page in document.pages:
            nodes = splitter.get_nodes_from_documents([Document(text=page.text)])
            headings = sorted(page.headings)
            for node in nodes:
                text = node.get_content()
                start = node.start_char_idx
                if start is None or page.text[start:start + len(text)] != text:
                    start = page.text.find(text)  # llama-index could not place it: search once
                if start < 0:
                    log.debug("chunk not found verbatim on page %d of %s", page.number, document.path)
                    start = 0
                end = start + len(text)
                heading = heading_at(headings, start, end, heading)
                chunks.append(Chunk(len(chunks), page.number, heading, text, start, end))
            if headings:
                heading = headings[-1][1]
        return chunks


def heading_at(headings: list[tuple[int, str]], start: int, end: int, carried: str) -> str:
    """The heading in force at `start`, counting one that opens within the first tenth of [start, end)."""
    current = carried
    reach = start + max(80, (end - start) // 10)
    for offset, title in headings:
        if offset <= reach:
            current = title
        else:
            break
    return current
