"""Text in pictures, by Tesseract: in-process through tesserocr when it is installed, else the CLI.

Design note: a picture's description waits on its OCR (the CNN runs beside it and takes ~35 ms), and
starting the `tesseract` program costs ~120 ms before it reads anything: the CLI took 140-170 ms to
read one line on a 640x480 picture here, the same engine in-process 20 ms. So the describer keeps
one initialised Tesseract per language set (tesserocr's PyTessBaseAPI, one thread, behind a lock:
the API is not thread-safe) and falls back to the CLI (with a timeout) when tesserocr or the
language data is missing. Pictures are shrunk to OCR_MAX_SIDE first, which bounds the in-process
time (no timeout can stop it). Lines whose words Tesseract itself doubts are dropped.
"""

from __future__ import annotations

import glob
import io
import os
import threading
from typing import Any

import numpy as np
from PIL import Image

OCR_MIN_LINE_CONFIDENCE = 60.0  # Tesseract's mean word confidence (0-100) below which a line is noise
OCR_TIMEOUT_S = 30.0  # the CLI fallback's limit
OCR_MAX_SIDE = 3000  # larger pictures are shrunk before OCR (Tesseract time grows with the area)
OCR_MIN_SIDE = 12  # smaller pictures hold no readable text (and Tesseract refuses them)
TSV_HEADER = "level\tpage_num\tblock_num\tpar_num\tline_num\tword_num\tleft\ttop\twidth\theight\tconf\ttext"

_apis: dict[str, tuple[Any, threading.Lock] | None] = {}
_apis_lock = threading.Lock()


def tessdata_dir() -> str | None:
    """Where the installed Tesseract language data is (TESSDATA_PREFIX wins)."""
    if os.environ.get("TESSDATA_PREFIX"):
        return os.environ["TESSDATA_PREFIX"]
    found = sorted(glob.glob("/usr/share/tesseract-ocr/*/tessdata/")) + sorted(glob.glob("/usr/share/tessdata/"))
    return found[-1] if found else None


def _in_process(languages: str) -> tuple[Any, threading.Lock] | None:
    """The shared PyTessBaseAPI for `languages`, or None when tesserocr cannot serve them."""
    with _apis_lock:
        if languages not in _apis:
            try:
                import tesserocr

                api = tesserocr.PyTessBaseAPI(path=tessdata_dir() or "./", lang=languages, psm=tesserocr.PSM.AUTO)
                _apis[languages] = (api, threading.Lock())
            except (ImportError, RuntimeError):  # not installed, or no data for these languages: use the CLI
                _apis[languages] = None
        return _apis[languages]


def cheap(languages: str = "eng") -> bool:
    """True when OCR runs in-process (~20-40 ms a picture): then it is worth running on every picture,
    not only on those whose pixels look like print."""
    return _in_process(languages) is not None


def read_text(image: Image.Image, languages: str = "eng") -> str:
    """Text in the picture (lines joined by newlines, blocks by a blank line; "" when none).
    Raises ingest's IngestError when the CLI fallback is missing or fails."""
    width, height = image.size
    if min(width, height) < OCR_MIN_SIDE:
        return ""
    if max(width, height) > OCR_MAX_SIDE:
        scale = OCR_MAX_SIDE / max(width, height)
        image = image.resize((round(width * scale), round(height * scale)), Image.BILINEAR, reducing_gap=2.0)
    shared = _in_process(languages)
    if shared is not None:
        api, lock = shared
        with lock:
            api.SetImage(image)  # colour: Tesseract's own greying finds text that ours lost
            return confident_lines(TSV_HEADER + "\n" + api.GetTSVText(0))
    from ingest.parse import ocr_png

    png = io.BytesIO()
    image.save(png, "PNG", compress_level=1)
    return confident_lines(ocr_png(png.getvalue(), languages, output="tsv", timeout_s=OCR_TIMEOUT_S, threads=1))


def confident_lines(tsv: str) -> str:
    """Tesseract TSV (with its header line) -> text: words grouped into lines; a line is kept when both
    its words and its block's words have a mean confidence of OCR_MIN_LINE_CONFIDENCE (texture read as
    letters comes in blocks of doubtful one-word lines); blocks are separated by a blank line."""
    lines: dict[tuple[int, int, int], list[tuple[float, str]]] = {}
    for row in tsv.splitlines()[1:]:
        cols = row.split("\t")
        if len(cols) < 12 or cols[0] != "5" or not cols[11].strip():
            continue
        key = (int(cols[2]), int(cols[3]), int(cols[4]))  # block, paragraph, line
        lines.setdefault(key, []).append((float(cols[10]), cols[11].strip()))
    blocks: dict[int, list[float]] = {}
    for (block, _, _), words in lines.items():
        blocks.setdefault(block, []).extend(conf for conf, _ in words)
    out, last_block = [], None
    for (block, _, _), words in lines.items():
        line_conf = sum(conf for conf, _ in words) / len(words)
        if min(line_conf, float(np.mean(blocks[block]))) < OCR_MIN_LINE_CONFIDENCE:
            continue
        text = " ".join(w for _, w in words if any(c.isalnum() for c in w))
        if not text:
            continue
        if last_block is not None and block != last_block:
            out.append("")
        out.append(text)
        last_block = block
    return "\n".join(out)
