"""A passage that cuts a table: whole rows, the table's header, and one row per line for the model."""

from assistant.citations import SourceLedger, flatten
from ingest.retriever import Hit, PageText, Retriever, whole_rows
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


def test_readable_completes_table_hits_and_drops_one_a_completed_hit_already_holds():
    class Pages(Retriever):
        def __init__(self):
            pass

        def read(self, doc, pages=None):
            return [PageText("d1", "/docs/README.md", 1, PAGE)]

    start, end = PAGE.index("06 | 660 MB/s"), PAGE.index("4500 MB/s") + 4
    inside = PAGE.index("| lz4 1.9.3")
    prose = hit(PAGE.index("Decompression speed"), len(PAGE))
    out = Pages().readable([hit(start, end), hit(inside, inside + 20), prose])
    assert [h.text[:16] for h in out] == ["| lzo1x 2.10 -1 ", "Decompression sp"]  # the second is inside the first
    assert out[0].header.startswith("| Compressor name |") and out[1] == prose
