"""A passage that cuts a table: whole rows, the table's header, and one row per line for the model."""

from assistant.citations import SourceLedger, flatten
from ingest.retriever import Hit, PageText, Retriever, continued, whole_rows
from tools.retrieval import add_hit

PAGE = ("Benchmarks on one core.\n\n"
        "| Compressor name | Ratio | Compression | Decompress. |\n"
        "| --------------- | ----- | ----------- | ----------- |\n"
        "| zstd 1.5.1 -1 | 2.887 | 530 MB/s | 1700 MB/s |\n"
        "| lzo1x 2.10 -1 | 2.106 | 660 MB/s | 845 MB/s |\n"
        "| lz4 1.9.3 | 2.101 | 740 MB/s | 4500 MB/s |\n"
        "| lzf 3.6 -1 | 2.077 | 410 MB/s | 830 MB/s |\n\n"
        "Decompression speed is preserved at all settings.")


def hit(start: int, end: int) -> Hit:
    return Hit("c1", "d1", "/docs/README.md", 1, "Benchmarks", PAGE[start:end], 1.0, start, end)


def test_a_hit_cut_inside_a_table_gets_whole_rows_and_the_header():
    start = PAGE.index("06 | 660 MB/s")  # mid-row, below the header
    end = PAGE.index("4500 MB/s") + 4  # mid-cell
    out = whole_rows(hit(start, end), PAGE)
    assert out.text == PAGE[out.start_char:out.end_char]  # still a verbatim slice of the page
    assert out.text.startswith("| lzo1x 2.10 -1 |") and out.text.endswith("| 4500 MB/s |")
    assert out.header == ("| Compressor name | Ratio | Compression | Decompress. |\n"
                          "| --------------- | ----- | ----------- | ----------- |")
    passage = add_hit(SourceLedger(), out)
    assert passage.render().splitlines() == [  # each row on its own line, under the header
        "[1] README.md p. 1 (section Benchmarks): | Compressor name | Ratio | Compression | Decompress. |",
        "| --------------- | ----- | ----------- | ----------- |",
        "| lzo1x 2.10 -1 | 2.106 | 660 MB/s | 845 MB/s |", "| lz4 1.9.3 | 2.101 | 740 MB/s | 4500 MB/s |"]


def test_a_hit_that_holds_the_header_or_no_table_is_left_alone():
    with_header = hit(0, PAGE.index("| lzo1x"))
    assert whole_rows(with_header, PAGE) == with_header
    prose = hit(PAGE.index("Decompression speed"), len(PAGE))
    assert whole_rows(prose, PAGE) == prose
    stale = Hit("c1", "d1", "/docs/README.md", 1, "", "text the page no longer holds", 1.0, 0, 29)
    assert whole_rows(stale, PAGE) == stale  # offsets that do not match the page: nothing is guessed


def test_flatten_joins_prose_and_keeps_table_rows_apart():
    assert flatten("one\n two  words\n\nthree") == "one two words three"
    assert flatten("Speeds:\n| a | 1 |\n| b | 2 |\nAfter the table.") == "Speeds:\n| a | 1 |\n| b | 2 |\nAfter the table."


def test_a_short_hit_is_continued_along_its_page_to_a_line_break():
    page = ("idn2_to_ascii_8z converts a domain name.\nThe output buffer must be freed.\n"
            "When unsure, pass IDN2_NONTRANSITIONAL.\nSince: 2.0.0\nidn2_to_unicode_8z8z converts back.")
    short = Hit("c1", "d1", "/docs/libidn2.pdf", 5, "", page[:41], 1.0, 0, 41)
    out = continued(short, page, 120)
    assert out.text == page[:out.end_char] and out.text.endswith("IDN2_NONTRANSITIONAL.")  # cut at a line end
    assert continued(short, page, 40) == short  # long enough already
    assert continued(short, page, 10_000).text == page  # the page ends first


def test_readable_continues_short_hits_and_drops_one_a_continued_hit_already_holds():
    page = "First line of the page.\nSecond line.\nThird line.\n"

    class Pages(Retriever):
        def __init__(self):
            pass

        def read(self, doc, pages=None):
            return [PageText("d1", "/docs/a.md", 1, page)]

    first = Hit("c1", "d1", "/docs/a.md", 1, "", page[:23], 1.0, 0, 23)
    second = Hit("c2", "d1", "/docs/a.md", 1, "", page[24:36], 0.9, 24, 36)
    out = Pages().readable([first, second], min_chars=40)
    assert [h.chunk_id for h in out] == ["c1"] and out[0].text == page[:36]
    assert Pages().readable([first, second]) == [first, second]  # nothing asked: the hits as they are
