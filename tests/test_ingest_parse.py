"""Parsing and chunking: page numbers, headings, offsets, per-file errors, OCR (files made here)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import need
from ingest.chunk import Chunker
from ingest.embed import HashEmbedder
from ingest.errors import IngestError, UnsupportedFile
from ingest.parse import parse_file, tesseract_available

pymupdf = pytest.importorskip("pymupdf")

BODY = ("The pump moves water through the pipes. Valves regulate the pressure in each circuit. "
        "Maintenance happens every spring and autumn. ")


def make_pdf(path: Path, pages: list[tuple[str, str]], *, toc: bool = False, **save) -> Path:
    """A PDF whose page i shows heading pages[i][0] (large font) above body text pages[i][1]."""
    doc = pymupdf.open()
    for heading, body in pages:
        page = doc.new_page()
        if heading:
            page.insert_text((72, 80), heading, fontsize=20)
        page.insert_textbox(pymupdf.Rect(72, 110, 540, 780), body, fontsize=10)
    if toc:
        doc.set_toc([[1, h, i + 1] for i, (h, _b) in enumerate(pages) if h])
    doc.save(path, **save)
    return path


def marker_pdf(path: Path, num_pages: int = 5, **kwargs) -> Path:
    pages = [(f"Chapter {i}" if i % 2 else "", f"Page marker PM{i}X. " + BODY * 6 + f"End of page PE{i}X.")
             for i in range(1, num_pages + 1)]
    return make_pdf(path, pages, **kwargs)


def chunker(chunk_tokens: int = 64, overlap: int = 8) -> Chunker:
    return Chunker(HashEmbedder().tokenize, chunk_tokens=chunk_tokens, overlap_tokens=overlap)


@pytest.mark.parametrize("toc", [False, True], ids=["font-headings", "outline-headings"])
def test_pdf_chunks_carry_exact_pages_headings_and_offsets(tmp_path, toc):
    doc = parse_file(marker_pdf(tmp_path / "m.pdf", toc=toc))
    assert [p.number for p in doc.pages] == [1, 2, 3, 4, 5]
    chunks = chunker().split(doc)
    assert len(chunks) > 5  # several chunks per page
    pages = {p.number: p for p in doc.pages}
    for c in chunks:
        assert pages[c.page].text[c.start_char:c.end_char] == c.text
        for i in range(1, 6):  # a page's markers only ever appear in chunks of that page
            if f"PM{i}X" in c.text or f"PE{i}X" in c.text:
                assert c.page == i, (c.page, c.text[:60])
    found = {i for c in chunks for i in range(1, 6) if f"PM{i}X" in c.text and f"PE{i}X" not in c.text or f"PE{i}X" in c.text}
    assert found == {1, 2, 3, 4, 5}
    # headings: pages 1, 3, 5 open a chapter; pages 2 and 4 inherit the one before
    by_page = {c.page: c.heading for c in chunks if c.start_char == 0}
    assert by_page == {1: "Chapter 1", 2: "Chapter 1", 3: "Chapter 3", 4: "Chapter 3", 5: "Chapter 5"}
    assert [c.index for c in chunks] == list(range(len(chunks)))


def test_chunks_respect_token_budget_and_overlap(tmp_path):
    doc = parse_file(make_pdf(tmp_path / "long.pdf", [("", BODY * 12)]))
    tokenize = HashEmbedder().tokenize
    chunks = chunker(60, 12).split(doc)
    assert len(chunks) >= 3
    assert all(len(tokenize(c.text)) <= 60 for c in chunks)
    assert all(chunks[i].start_char < chunks[i - 1].end_char for i in range(1, len(chunks)))  # overlap


def test_markdown_html_text_docx_headings(tmp_path):
    md = tmp_path / "notes.md"
    md.write_text("# Guide\n\nIntro.\n\n```\n# not a heading\n```\n\n## Setup\n\nRun the installer.\n")
    page = parse_file(md).pages[0]
    assert [h for _o, h in page.headings] == ["Guide", "Setup"]
    assert page.text[page.headings[1][0]:].startswith("## Setup")

    html = tmp_path / "page.html"
    html.write_text("<html><head><title>T</title><style>p{}</style><script>var x=1;</script></head><body>"
                    "<h1>Overview</h1><p>First &amp; foremost.</p><h2>Details</h2><p>More here.</p></body></html>")
    page = parse_file(html).pages[0]
    assert "var x" not in page.text and "First & foremost." in page.text
    assert [h for _o, h in page.headings] == ["Overview", "Details"]
    assert all(page.text[o:].startswith(h) for o, h in page.headings)

    txt = tmp_path / "plain.txt"
    txt.write_text("just some words\n")
    assert parse_file(txt).pages[0].text == "just some words"

    docx = pytest.importorskip("docx")
    document = docx.Document()
    document.add_heading("Budget", level=1)
    document.add_paragraph("The budget for 2027 is modest.")
    document.save(tmp_path / "plan.docx")
    page = parse_file(tmp_path / "plan.docx").pages[0]
    assert page.headings == [(0, "Budget")] and "modest" in page.text


def test_lists_and_tables_keep_their_structure(tmp_path):
    """Items start with a marker and table rows read as Markdown rows, in reading order: the counter
    (assistant/counting.py) counts them, and the model sees which cell belongs to which row."""
    html = tmp_path / "page.html"
    html.write_text("<h2>Modifiers</h2><p>The modifiers are:</p><ol><li> NNN days </li><li>start of\n month</li></ol>"
                    "<ul><li>utc</li></ul><table><tr><th>Name</th><th>Limit</th></tr>"
                    "<tr><td><p>columns</p></td><td>2000</td></tr></table><h2>After</h2><p>Done.</p>")
    page = parse_file(html).pages[0]
    assert "The modifiers are:\n\n1. NNN days\n2. start of month\n\n- utc" in page.text
    assert "| Name | Limit |\n| --- | --- |\n| columns | 2000 |" in page.text
    assert all(page.text[o:].startswith(h) for o, h in page.headings) and len(page.headings) == 2

    # a definition list (DocBook's options, variables, placeholders): one "- term: definition" line each
    html.write_text("<p>Several placeholders are available:</p><dl><dt><span> <code>%s</code> </span></dt><dd> The "
                    "number of\n started edges. </dd><dt><code>%%</code></dt><dd><p>A plain %</p><p>character.</p></dd>"
                    "</dl><p>After.</p>")
    text = parse_file(html).pages[0].text
    assert text == ("Several placeholders are available:\n\n- %s: The number of started edges.\n"
                    "- %%: A plain % character.\n\nAfter.")

    docx = pytest.importorskip("docx")
    document = docx.Document()
    document.add_heading("Rules", level=1)
    document.add_paragraph("In this order:")
    for rule in ("INT means INTEGER", "CHAR means TEXT"):
        document.add_paragraph(rule, style="List Number")
    document.add_paragraph("Note.")
    document.add_paragraph("a bullet", style="List Bullet")
    table = document.add_table(rows=2, cols=2)
    for cell, text in zip(table._cells, ("Type", "Affinity", "INT2", "INTEGER")):
        cell.text = text
    document.add_heading("Later", level=1)
    document.save(tmp_path / "rules.docx")
    page = parse_file(tmp_path / "rules.docx").pages[0]
    assert page.text == ("Rules\n\nIn this order:\n\n1. INT means INTEGER\n\n2. CHAR means TEXT\n\nNote.\n\n- a bullet\n\n"
                         "| Type | Affinity |\n| --- | --- |\n| INT2 | INTEGER |\n\nLater")  # the table where it stands
    assert all(page.text[o:].startswith(h) for o, h in page.headings) and len(page.headings) == 2


def test_bad_files_give_clear_per_file_errors(tmp_path):
    corrupt = tmp_path / "corrupt.pdf"
    corrupt.write_bytes(b"%PDF-1.7\n" + bytes(range(256)) * 8)
    with pytest.raises(IngestError, match="not a readable PDF|no text"):
        parse_file(corrupt)

    encrypted = marker_pdf(tmp_path / "secret.pdf", 1, encryption=pymupdf.PDF_ENCRYPT_AES_256,
                           user_pw="u", owner_pw="o")
    with pytest.raises(IngestError, match="encrypted"):
        parse_file(encrypted)

    empty = tmp_path / "empty.pdf"
    empty.write_bytes(b"")
    with pytest.raises(IngestError, match="empty"):
        parse_file(empty)

    blank = tmp_path / "blank.pdf"
    doc = pymupdf.open()
    doc.new_page()
    doc.save(blank)
    with pytest.raises(IngestError, match="no text"):
        parse_file(blank)

    unknown = tmp_path / "data.xyz"
    unknown.write_text("hello")
    with pytest.raises(UnsupportedFile, match=r"unsupported file type '\.xyz'"):
        parse_file(unknown)

    binary = tmp_path / "bin.txt"
    binary.write_bytes(b"\x00\x01\x02" * 10)
    with pytest.raises(IngestError, match="binary"):
        parse_file(binary)


def text_image(path: Path, words: str) -> Path:
    """A PNG of rendered text (no text layer anywhere): PyMuPDF draws it, then rasterises."""
    doc = pymupdf.open()
    page = doc.new_page(width=600, height=200)
    page.insert_text((30, 110), words, fontsize=28)
    page.get_pixmap(dpi=150).save(path)
    return path


@pytest.mark.real
def test_ocr_reads_image_and_scanned_pdf_page(tmp_path):
    need(tesseract_available(), "Tesseract OCR", "apt-get install tesseract-ocr tesseract-ocr-eng")
    image = text_image(tmp_path / "sign.png", "Quarterly invoice 4471")
    doc = parse_file(image)
    assert doc.format == "image" and doc.pages[0].ocr
    assert "invoice" in doc.pages[0].text.lower() and "4471" in doc.pages[0].text

    scan = pymupdf.open()
    page = scan.new_page()
    page.insert_text((72, 72), "This page has a real text layer about pumps.", fontsize=11)
    page = scan.new_page()
    page.insert_image(pymupdf.Rect(50, 50, 550, 217), filename=str(image))
    scan.save(tmp_path / "scan.pdf")
    doc = parse_file(tmp_path / "scan.pdf")
    assert [p.ocr for p in doc.pages] == [False, True]
    assert "invoice" in doc.pages[1].text.lower() and doc.pages[1].number == 2


def test_without_tesseract_scans_are_reported_with_the_install_command(tmp_path, monkeypatch):
    import ingest.parse as parse

    monkeypatch.setattr(parse, "tesseract_available", lambda: False)
    image = text_image(tmp_path / "scan.png", "Quarterly invoice")
    with pytest.raises(IngestError, match="apt-get install tesseract-ocr"):
        parse_file(image)
    mixed = pymupdf.open()
    mixed.new_page().insert_text((72, 72), "A page with a real text layer about pumps.", fontsize=11)
    mixed.new_page().insert_image(pymupdf.Rect(50, 50, 550, 217), filename=str(image))
    mixed.save(tmp_path / "mixed.pdf")
    doc = parse_file(tmp_path / "mixed.pdf")  # the text page is kept, the scan is a warning
    assert [p.number for p in doc.pages] == [1]
    assert len(doc.warnings) == 1 and doc.warnings[0].startswith("page 2:") and "tesseract" in doc.warnings[0]
