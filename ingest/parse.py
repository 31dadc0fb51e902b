"""Parse: a file on disk → `ParsedDocument`, a list of 1-based `Page`s of plain text with headings.

PDF pages keep their real page numbers (PyMuPDF); pages without a text layer, and image files, go
through Tesseract OCR; given `describe_image` (e.g. tools.vision's `ImageDescriber.document_text`;
ingest never imports an image model itself), an image's page also says what the picture shows.
Formats without pages (Markdown, plain text, HTML, DOCX) are one page, page 1, and chunks locate
themselves inside it by character offsets. Headings are (char offset, title) pairs
per page: from the PDF outline when it has one, else from font sizes (a line set noticeably larger
than the page's body text); `#` lines in Markdown; <h1>-<h6> in HTML; "Heading N" styles in DOCX.

Every failure is an `IngestError` whose message says what is wrong with *this* file, so the CLI can
print "Skipping X: reason" and go on with the next one.
"""

from __future__ import annotations

import collections
import os
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path
from typing import Callable

from ingest.errors import IngestError, UnsupportedFile

PDF_SUFFIXES = {".pdf"}
MARKDOWN_SUFFIXES = {".md", ".markdown"}
TEXT_SUFFIXES = {".txt", ".text", ".rst", ".log", ".csv"}
HTML_SUFFIXES = {".html", ".htm"}
DOCX_SUFFIXES = {".docx"}
IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".tif", ".tiff", ".bmp", ".gif", ".webp", ".pnm"}
SUPPORTED_SUFFIXES = PDF_SUFFIXES | MARKDOWN_SUFFIXES | TEXT_SUFFIXES | HTML_SUFFIXES | DOCX_SUFFIXES | IMAGE_SUFFIXES

# Bump when what a parser makes of a file changes: a document ingested by an older parser is then read
# again on its next ingest ("updated"), not skipped as unchanged. 2: HTML definition lists as list items.
PARSE_VERSION = 2
MIN_TEXT_CHARS = 16  # a PDF page with fewer extracted characters is treated as a scan (OCR)
HEADING_SIZE_RATIO = 1.15  # a line this much larger than the body font is a heading
MAX_HEADING_CHARS = 120
OCR_DPI = 300
OCR_INSTALL_HINT = "install Tesseract: apt-get install tesseract-ocr tesseract-ocr-eng"

DescribeImage = Callable[[Path], str]  # image file -> text to index: what it shows and the text read in it


@dataclass
class Page:
    number: int  # 1-based page number as printed by a PDF viewer; 1 for formats without pages
    text: str  # the page's plain text
    headings: list[tuple[int, str]] = field(default_factory=list)  # (char offset in text, heading)
    ocr: bool = False  # text came from OCR


@dataclass
class ParsedDocument:
    path: Path
    format: str  # "pdf", "markdown", "text", "html", "docx", "image"
    pages: list[Page]
    warnings: list[str] = field(default_factory=list)  # per-page problems that did not fail the file

    @property
    def num_chars(self) -> int:
        return sum(len(p.text) for p in self.pages)


def is_supported(path: Path) -> bool:
    return path.suffix.lower() in SUPPORTED_SUFFIXES


def parse_file(path: str | Path, *, ocr_languages: str = "eng",
               describe_image: DescribeImage | None = None) -> ParsedDocument:
    """Read one file into pages. Raises IngestError/UnsupportedFile with a per-file reason."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in SUPPORTED_SUFFIXES:
        kinds = ", ".join(sorted(SUPPORTED_SUFFIXES))
        raise UnsupportedFile(f"unsupported file type {suffix or '(no extension)'!r}; supported: {kinds}")
    try:
        size = path.stat().st_size
    except OSError as e:
        raise IngestError(f"cannot read file: {e.strerror or e}") from e
    if size == 0:
        raise IngestError("file is empty (0 bytes)")
    if suffix in PDF_SUFFIXES:
        doc = parse_pdf(path, ocr_languages=ocr_languages)
    elif suffix in IMAGE_SUFFIXES:
        doc = parse_image(path, ocr_languages=ocr_languages, describe_image=describe_image)
    elif suffix in DOCX_SUFFIXES:
        doc = parse_docx(path)
    else:
        text = _read_text(path)
        if suffix in MARKDOWN_SUFFIXES:
            doc = ParsedDocument(path, "markdown", [Page(1, text, markdown_headings(text))])
        elif suffix in HTML_SUFFIXES:
            text, headings = html_to_text(text)
            doc = ParsedDocument(path, "html", [Page(1, text, headings)])
        else:
            doc = ParsedDocument(path, "text", [Page(1, text)])
    doc.pages = [p for p in doc.pages if p.text.strip()]
    if not doc.pages:
        reason = "; ".join(doc.warnings) if doc.warnings else "the file has no readable text"
        raise IngestError(f"no text found: {reason}")
    return doc


# -- PDF ----------------------------------------------------------------------------------------


def parse_pdf(path: Path, *, ocr_languages: str = "eng") -> ParsedDocument:
    import pymupdf

    try:
        pdf = pymupdf.open(path, filetype="pdf")
    except Exception as e:  # pymupdf raises FileDataError/RuntimeError/ValueError for broken files
        raise IngestError(f"not a readable PDF (corrupt or truncated): {e}") from e
    with pdf:
        if pdf.needs_pass:
            raise IngestError("PDF is encrypted (password protected): decrypt it first, e.g. `qpdf --decrypt in.pdf out.pdf`")
        if pdf.page_count == 0:
            raise IngestError("PDF has no pages")
        outline = _outline_by_page(pdf)
        pages, warnings = [], []
        for index in range(pdf.page_count):
            try:
                page = pdf.load_page(index)
                if outline:
                    text = page.get_text("text", flags=pymupdf.TEXTFLAGS_TEXT)
                    headings = _place_headings(text, outline.get(index + 1, []))
                else:
                    text, headings = _text_and_font_headings(page.get_text("dict", flags=pymupdf.TEXTFLAGS_TEXT))
                ocr = False
                if len(text.strip()) < MIN_TEXT_CHARS and (page.get_images(full=False) or page.get_drawings()):
                    text, ocr, headings = _clean(ocr_pdf_page(page, ocr_languages)), True, []
            except IngestError as e:
                warnings.append(f"page {index + 1}: {e}")
                continue
            except Exception as e:  # a broken page must not lose the rest of the document
                warnings.append(f"page {index + 1}: unreadable ({e})")
                continue
            pages.append(Page(index + 1, text.replace("\x00", " ").rstrip(), headings, ocr))
    if not any(p.text.strip() for p in pages) and not warnings:
        warnings.append("every page is blank (no text layer and nothing to OCR)")
    return ParsedDocument(path, "pdf", pages, warnings)


def _outline_by_page(pdf) -> dict[int, list[str]]:
    by_page: dict[int, list[str]] = collections.defaultdict(list)
    for _level, title, page in pdf.get_toc(simple=True):
        if page >= 1 and title.strip():
            by_page[page].append(title.strip())
    return by_page


def _place_headings(text: str, titles: list[str]) -> list[tuple[int, str]]:
    out = []
    for title in titles:
        at = text.find(title)
        out.append((max(at, 0), title))
    return sorted(out)


def _text_and_font_headings(page_dict: dict) -> tuple[str, list[tuple[int, str]]]:
    """Rebuild the page text from PyMuPDF's dict output; lines set larger than the body are headings."""
    lines = []  # (block index, text, max size)
    sizes: collections.Counter[float] = collections.Counter()
    for b, block in enumerate(page_dict.get("blocks", [])):
        for line in block.get("lines", []):
            spans = line.get("spans", [])
            text = "".join(s["text"] for s in spans)
            if not text.strip():
                continue
            for s in spans:
                sizes[round(s["size"], 1)] += len(s["text"])
            lines.append((b, text, max(s["size"] for s in spans)))
    body = sizes.most_common(1)[0][0] if sizes else 0.0
    parts, headings, offset, prev_block = [], [], 0, None
    for b, text, size in lines:
        sep = "" if prev_block is None else ("\n" if b == prev_block else "\n\n")
        offset += len(sep)
        parts.append(sep + text)
        stripped = text.strip()
        if body and size >= body * HEADING_SIZE_RATIO and len(stripped) <= MAX_HEADING_CHARS and re.search(r"[^\W\d_]", stripped):
            if headings and headings[-1][0] + len(headings[-1][1]) + 1 >= offset and prev_block == b:
                headings[-1] = (headings[-1][0], f"{headings[-1][1]} {stripped}")  # a wrapped heading line
            else:
                headings.append((offset, stripped))
        offset += len(text)
        prev_block = b
    return "".join(parts), headings


# -- images -------------------------------------------------------------------------------------


def parse_image(path: Path, *, ocr_languages: str = "eng", describe_image: DescribeImage | None = None) -> ParsedDocument:
    """One page: the text OCR reads in the picture or, with `describe_image`, its description plus that
    text, so "which picture showed a cat?" finds a photo without any text in it. If the describer
    fails (model missing, a bug) the page falls back to OCR alone and says why in a warning."""
    if describe_image is not None:
        try:
            return ParsedDocument(path, "image", [Page(1, _clean(describe_image(path)), ocr=True)])
        except Exception as e:  # noqa: BLE001 - the text in the picture is still worth indexing
            doc = ParsedDocument(path, "image", [Page(1, ocr_image_file(path, ocr_languages), ocr=True)])
            doc.warnings.append(f"no picture description ({e}); indexed the text read in it only")
            return doc
    return ParsedDocument(path, "image", [Page(1, ocr_image_file(path, ocr_languages), ocr=True)])


# -- OCR ----------------------------------------------------------------------------------------


def tesseract_available() -> bool:
    return shutil.which("tesseract") is not None


def ocr_png(png: bytes, languages: str = "eng", *, output: str = "txt", timeout_s: float = 300,
            threads: int = 0) -> str:
    """Run Tesseract on PNG bytes (stdin → stdout). output: "txt" (plain text) or "tsv" (one row per
    word with its box and confidence 0-100). threads: OpenMP threads for Tesseract, 0 = its default
    (all cores); 1 beside other CPU work, where its spinning threads can make it 3x slower."""
    if not tesseract_available():
        raise IngestError(f"no text layer and OCR is unavailable: {OCR_INSTALL_HINT}")
    env = {**os.environ, "OMP_THREAD_LIMIT": str(threads)} if threads else None
    try:
        done = subprocess.run(
            ["tesseract", "stdin", "stdout", "-l", languages, "--psm", "3", *([output] if output != "txt" else [])],
            input=png, capture_output=True, timeout=timeout_s, check=False, env=env,
        )
    except subprocess.TimeoutExpired as e:
        raise IngestError(f"OCR timed out after {timeout_s:g} s") from e
    if done.returncode != 0:
        err = done.stderr.decode(errors="replace").strip().splitlines()
        raise IngestError(f"OCR failed: {err[-1] if err else 'tesseract exit ' + str(done.returncode)} "
                          f"(for other languages: apt-get install tesseract-ocr-<lang>)")
    return done.stdout.decode("utf-8", errors="replace")


def ocr_pdf_page(page, languages: str = "eng") -> str:
    pixmap = page.get_pixmap(dpi=OCR_DPI, colorspace="gray", alpha=False)
    return ocr_png(pixmap.tobytes("png"), languages)


def ocr_image_file(path: Path, languages: str = "eng") -> str:
    import pymupdf

    try:
        pixmap = pymupdf.Pixmap(str(path))
        if pixmap.alpha or pixmap.n > 3:
            pixmap = pymupdf.Pixmap(pymupdf.csRGB, pixmap)  # drop alpha / CMYK for PNG
        png = pixmap.tobytes("png")
    except Exception as e:
        raise IngestError(f"not a readable image: {e}") from e
    return _clean(ocr_png(png, languages))


# -- text formats -------------------------------------------------------------------------------


def _read_text(path: Path) -> str:
    data = path.read_bytes()
    if b"\x00" in data[:8192]:
        raise IngestError("looks like a binary file, not text")
    try:
        return data.decode("utf-8-sig").rstrip()
    except UnicodeDecodeError:
        return data.decode("latin-1").rstrip()


_MD_HEADING = re.compile(r"^(#{1,6})[ \t]+(.+?)[ \t#]*$")
_MD_FENCE = re.compile(r"^\s*(```|~~~)")


def markdown_headings(text: str) -> list[tuple[int, str]]:
    """ATX headings (`# Title`) outside fenced code blocks, with their char offsets."""
    out, offset, in_fence = [], 0, False
    for line in text.splitlines(keepends=True):
        if _MD_FENCE.match(line):
            in_fence = not in_fence
        elif not in_fence and (m := _MD_HEADING.match(line.rstrip("\r\n"))):
            out.append((offset, m.group(2).strip()))
        offset += len(line)
    return out


_BLOCK_TAGS = {"p", "div", "section", "article", "header", "footer", "li", "ul", "ol", "table", "tr",
               "pre", "blockquote", "br", "hr", "dl", "dt", "dd", "h1", "h2", "h3", "h4", "h5", "h6", "title"}
_SKIP_TAGS = {"script", "style", "noscript", "template", "svg"}


class _HTMLText(HTMLParser):
    """Visible text, with the structure a reader (and the counter in assistant/counting.py) needs:
    list items start with "- " or "1. ", table rows read "| a | b |" with a rule under a header row, and
    a definition list's entries read "- term: definition", one per line (DocBook manuals list options,
    variables and placeholders so: Ninja's ten NINJA_STATUS placeholders had been ten lone terms, each
    with its definition as a paragraph of its own, which nothing could count)."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        self.length = 0
        self.headings: list[tuple[int, str]] = []
        self._skip = 0
        self._heading_start: int | None = None
        self._lists: list[list] = []  # [tag, items so far] per open <ol>/<ul>
        self._rows: list[int] = []  # rows so far per open <table>
        self._cells = 0  # cells so far in the open row
        self._header_row = True  # every cell of the open row is a <th>
        self._in_cell = 0
        self._in_dd = 0  # inside a definition: it stays on its term's line

    def _emit(self, s: str) -> None:
        self.parts.append(s)
        self.length += len(s)

    def _trim(self) -> None:
        """Drop the spaces the text so far ends with."""
        while self.parts and self.parts[-1].endswith(" "):
            kept = self.parts[-1].rstrip(" ")
            self.length -= len(self.parts[-1]) - len(kept)
            self.parts[-1] = kept
            if kept:
                break
            self.parts.pop()

    def handle_starttag(self, tag, attrs):
        if tag in _SKIP_TAGS:
            self._skip += 1
        elif self._skip:
            return
        elif tag in ("td", "th") and self._rows:
            self._emit("| " if self._cells == 0 else " | ")
            self._cells += 1
            self._header_row &= tag == "th"
            self._in_cell += 1
        elif (self._in_cell or self._in_dd) and tag in _BLOCK_TAGS and tag != "dd":
            self._emit(" ")  # a paragraph inside a cell stays on the row's line, inside a definition on its term's
        elif tag == "dt":
            self._emit("\n- ")
        elif tag == "dd":
            self._trim()
            self._emit(": ")
            self._in_dd += 1
        elif tag in _BLOCK_TAGS:
            if tag == "table":
                self._rows.append(0)
            elif tag == "tr":
                self._cells, self._header_row = 0, True
            elif tag in ("ol", "ul"):
                self._lists.append([tag, 0])
            self._emit("\n\n" if tag not in ("br", "li", "tr") else "\n")
            if tag == "li" and self._lists:
                self._lists[-1][1] += 1
                kind, n = self._lists[-1]
                self._emit(f"{n}. " if kind == "ol" else "- ")
            if tag in ("h1", "h2", "h3", "h4", "h5", "h6"):
                self._heading_start = self.length

    def handle_endtag(self, tag):
        if tag in _SKIP_TAGS:
            self._skip = max(0, self._skip - 1)
        elif self._skip:
            return
        elif tag in ("td", "th") and self._in_cell:
            self._in_cell -= 1
        elif tag == "dd" and self._in_dd:
            self._in_dd -= 1
        elif tag == "dt":
            return  # its definition follows on the same line
        elif (self._in_cell or self._in_dd) and tag in _BLOCK_TAGS:
            self._emit(" ")
        elif tag in _BLOCK_TAGS:
            if tag.startswith("h") and tag[1:].isdigit() and self._heading_start is not None:
                title = " ".join("".join(self.parts)[self._heading_start:].split())
                if title:
                    self.headings.append((self._heading_start, title))
                self._heading_start = None
            if tag == "tr" and self._rows and self._cells:
                self._emit(" |")
                if self._rows[-1] == 0 and self._header_row:
                    self._emit("\n|" + " --- |" * self._cells)
                self._rows[-1] += 1
            elif tag == "table" and self._rows:
                self._rows.pop()
            elif tag in ("ol", "ul") and self._lists:
                self._lists.pop()
            if tag not in ("tr", "li"):  # the next row or item starts on the next line, no blank line between
                self._emit("\n\n")

    def handle_data(self, data):
        if not self._skip:
            self._emit(re.sub(r"\s+", " ", data))


def html_to_text(html: str) -> tuple[str, list[tuple[int, str]]]:
    """Visible text of an HTML page (paragraphs kept as blank lines) and its <h1>-<h6> headings."""
    parser = _HTMLText()
    parser.feed(html)
    parser.close()
    raw = "".join(parser.parts)
    # collapse runs of blank lines while keeping heading offsets valid
    out, mapping, i = [], {}, 0
    for m in re.finditer(r"[ \t]*\n[\s]*|[^\n]+", raw):
        mapping[m.start()] = i
        piece = m.group(0)
        if "\n" in piece:
            piece = "\n\n" if piece.count("\n") > 1 else "\n"
            if not out:
                piece = ""
        else:
            piece = re.sub(r"(?<=\S)[ \t]{2,}", " ", piece).rstrip()  # "1.  NNN days " -> "1. NNN days"
        out.append(piece)
        i += len(piece)
    text = "".join(out)
    headings = []
    for start, title in parser.headings:
        at = text.find(title, max(0, min(mapping.get(start, 0), len(text)) - 2))
        headings.append((at if at >= 0 else 0, title))
    return text.strip("\n"), headings


def parse_docx(path: Path) -> ParsedDocument:
    try:
        import docx
        from docx.table import Table
    except ImportError as e:
        raise IngestError("DOCX support is not installed: pip install -e '.[ingest]'") from e
    try:
        document = docx.Document(str(path))
    except Exception as e:  # PackageNotFoundError, BadZipFile, KeyError on broken parts
        raise IngestError(f"not a readable DOCX file: {e}") from e
    parts, headings, offset = [], [], 0
    numbered = 0  # items so far in the current numbered list
    for block in document.iter_inner_content():  # paragraphs and tables in reading order
        if isinstance(block, Table):
            lines = table_lines([[cell.text for cell in row.cells] for row in block.rows])
            text = "\n".join(lines)
        else:
            text = block.text.strip()
            style = (block.style.name if block.style is not None else "") or ""
            if text and (style.startswith("Heading") or style == "Title"):
                headings.append((offset, text))
            numbered = numbered + 1 if style.startswith("List Number") else 0
            if numbered:
                text = f"{numbered}. {text}"
            elif style.startswith("List") or block._p.pPr is not None and block._p.pPr.numPr is not None:
                text = f"- {text}"  # bullets, or Word's own numbering (its format lives elsewhere)
        if not text.strip():
            continue
        parts.append(text)
        offset += len(text) + 2
    return ParsedDocument(path, "docx", [Page(1, "\n\n".join(parts), headings)])


def table_lines(rows: list[list[str]]) -> list[str]:
    """A table as Markdown rows, "| a | b |", with a rule under the first (header) row."""
    out = []
    for i, row in enumerate(rows):
        cells = [" ".join(cell.split()).replace("|", "/") for cell in row]
        if not any(cells):
            continue
        out.append("| " + " | ".join(cells) + " |")
        if i == 0:
            out.append("|" + " --- |" * len(cells))
    return out


def _clean(text: str) -> str:
    text = text.replace("\x00", "").replace("\r\n", "\n")
    return re.sub(r"[ \t]+\n", "\n", text).strip()
