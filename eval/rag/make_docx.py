"""Build eval/rag/docs/sqlite-datatypes.docx from SQLite's "Datatypes In SQLite" page.

Source: /usr/share/doc/sqlite3/datatype3.html from the Debian package sqlite3-doc (3.40.1-2+deb12u2),
public domain. Get it without installing the package:

    apt-get download sqlite3-doc && dpkg-deb -x sqlite3-doc_*.deb /tmp/sqlite3-doc
    python eval/rag/make_docx.py /tmp/sqlite3-doc/usr/share/doc/sqlite3/datatype3.html

The page's body (from its first <h1>, i.e. after the site menu and table of contents) becomes a Word
document with real styles: <h1>/<h2>/<h3> -> "Heading 1/2/3", <li> -> "List Bullet"/"List Number",
<pre> -> one paragraph per line, <table> -> a Word table ("Table Grid"). Needs python-docx.
The output is byte-for-byte reproducible: fixed core properties and fixed zip timestamps.
"""

from __future__ import annotations

import argparse
import datetime
import io
import re
import sys
import zipfile
from html.parser import HTMLParser
from pathlib import Path

DEFAULT_SOURCE = "/usr/share/doc/sqlite3/datatype3.html"
DEFAULT_OUT = Path(__file__).resolve().parent / "docs" / "sqlite-datatypes.docx"
FIXED_TIME = datetime.datetime(2022, 12, 28, 0, 0, 0)


class Blocks(HTMLParser):
    """Flatten the page body into blocks: ("h", level, text), ("p", style, text), ("table", rows)."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.blocks: list[tuple] = []
        self.started = False  # the body starts at the first <h1>
        self.buf: list[str] = []
        self.kind: tuple | None = None  # what the text in buf will become
        self.lists: list[str] = []  # stack of "ul"/"ol"
        self.pre = False
        self.table: list[list[str]] | None = None
        self.cell: list[str] | None = None
        self.cell_tag = "td"
        self.skip = 0

    # -- helpers
    def flush(self) -> None:
        text = "".join(self.buf)
        self.buf = []
        if self.pre:
            return
        text = re.sub(r"\s+", " ", text).strip()
        if text and self.kind is not None:
            if self.kind[0] == "h":
                text = re.sub(r"^\d+(\.\d+)*\.\s*", "", text)  # drop the "3.1." section numbers
                self.blocks.append(("h", self.kind[1], text))
            else:
                self.blocks.append(("p", self.kind[1], text))
        self.kind = ("p", "Normal") if not self.lists else self.kind

    def handle_starttag(self, tag, attrs):
        if tag in ("script", "style"):
            self.skip += 1
            return
        if not self.started:
            if tag == "h1":
                self.started = True
            else:
                return
        if self.table is not None:
            if tag == "tr":
                self.table.append([])
            elif tag in ("td", "th"):
                self.cell = []
                self.cell_tag = tag
            elif tag == "br" and self.cell is not None:
                self.cell.append("\x00" if self.cell_tag == "td" else " ")  # one type name per line
            return
        if tag in ("h1", "h2", "h3", "h4"):
            self.flush()
            self.kind = ("h", min(int(tag[1]), 3))
        elif tag in ("p", "blockquote", "div", "br", "dt", "dd"):
            self.flush()
            self.kind = ("p", "Normal") if not self.lists else ("p", self._list_style())
        elif tag in ("ul", "ol"):
            self.flush()
            self.lists.append(tag)
        elif tag == "li":
            self.flush()
            self.kind = ("p", self._list_style())
        elif tag == "pre":
            self.flush()
            self.pre = True
        elif tag == "table":
            self.flush()
            self.table = []

    def handle_endtag(self, tag):
        if tag in ("script", "style"):
            self.skip = max(0, self.skip - 1)
            return
        if not self.started:
            return
        if self.table is not None:
            if tag in ("td", "th") and self.cell is not None:
                if not self.table:
                    self.table.append([])
                text = re.sub(r"\s+", " ", "".join(self.cell)).strip()
                parts = [part.strip() for part in text.split("\x00")]
                self.table[-1].append(", ".join(part for part in parts if part))
                self.cell = None
            elif tag == "table":
                self.blocks.append(("table", [r for r in self.table if r]))
                self.table = None
                self.kind = ("p", "Normal")
            return
        if tag == "pre":
            for line in "".join(self.buf).strip("\n").splitlines():
                if line.strip():
                    self.blocks.append(("p", "Code", line.rstrip()))
            self.buf = []
            self.pre = False
            self.kind = ("p", "Normal")
        elif tag in ("h1", "h2", "h3", "h4", "p", "li", "blockquote", "div", "dt", "dd"):
            self.flush()
        elif tag in ("ul", "ol"):
            self.flush()
            if self.lists:
                self.lists.pop()
            self.kind = ("p", "Normal") if not self.lists else ("p", self._list_style())

    def handle_data(self, data):
        if self.skip or not self.started:
            return
        if self.cell is not None:
            self.cell.append(data)
        elif self.table is None:
            self.buf.append(data)

    def _list_style(self) -> str:
        return "List Number" if self.lists and self.lists[-1] == "ol" else "List Bullet"


def build(source: Path, out: Path) -> None:
    import docx
    from docx.shared import Pt

    parser = Blocks()
    parser.feed(source.read_text(encoding="utf-8"))
    parser.close()
    parser.flush()

    document = docx.Document()
    code = document.styles.add_style("Code", 1)  # 1 = WD_STYLE_TYPE.PARAGRAPH
    code.base_style = document.styles["Normal"]
    code.font.name = "Courier New"
    code.font.size = Pt(9)
    document.add_heading("Datatypes In SQLite", level=0)  # the "Title" style
    for block in parser.blocks:
        if block[0] == "h":
            document.add_heading(block[2], level=block[1])
        elif block[0] == "p":
            document.add_paragraph(block[2], style=block[1])
        else:
            rows = block[1]
            width = max(len(r) for r in rows)
            table = document.add_table(rows=len(rows), cols=width)
            table.style = document.styles["Table Grid"]
            for i, row in enumerate(rows):
                for j, text in enumerate(row):
                    table.cell(i, j).text = text
            for cell in table.rows[0].cells:
                for run in cell.paragraphs[0].runs:
                    run.bold = True
    props = document.core_properties
    props.title = "Datatypes In SQLite"
    props.author = "SQLite (public domain); converted by eval/rag/make_docx.py"
    props.created = props.modified = FIXED_TIME
    props.last_modified_by = ""
    props.revision = 1

    raw = io.BytesIO()
    document.save(raw)
    _rezip_deterministic(raw.getvalue(), out)


def _rezip_deterministic(data: bytes, out: Path) -> None:
    """Rewrite the zip with fixed timestamps so that the same input gives the same bytes."""
    src = zipfile.ZipFile(io.BytesIO(data))
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            fixed = zipfile.ZipInfo(info.filename, date_time=(1980, 1, 1, 0, 0, 0))
            fixed.compress_type = zipfile.ZIP_DEFLATED
            fixed.external_attr = 0o644 << 16
            dst.writestr(fixed, src.read(info.filename))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(buf.getvalue())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("source", nargs="?", default=DEFAULT_SOURCE, help=f"datatype3.html (default {DEFAULT_SOURCE})")
    ap.add_argument("-o", "--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args(argv)
    source = Path(args.source)
    if not source.is_file():
        print(f"{source} not found: see the docstring for how to get sqlite3-doc", file=sys.stderr)
        return 1
    build(source, args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
