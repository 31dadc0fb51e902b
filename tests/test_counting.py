"""Counting questions: the section's list found in code, each item cited; the prefetch paths that
lead there (whole section for "how many", follow-ups searched with the previous question, whole
files only for summarise/compare requests)."""

from __future__ import annotations

from dataclasses import dataclass

from assistant.citations import SourceLedger
from assistant.citations import SourceLedger, verify_citations
from assistant.counting import count_answer, counted_noun, listed_items, named_members, section_items, supported_items
from tools.retrieval import DocumentPrefetch, RetrieverHandle, named_documents, named_section, retrieval_query


def test_a_markdown_table_counts_its_rows_not_its_header_or_rule():
    text = "## Benchmarks\n\n| Name | Ratio |\n| --- | ----- |\n| zstd | 2.8 |\n| zlib | 2.7 |\n| lz4 | 2.1 |\n\nThe end."
    assert section_items(text) == ["zstd | 2.8", "zlib | 2.7", "lz4 | 2.1"]


def test_options_bullets_and_repeated_labels_are_list_forms():
    options = "Usage: tool [OPTION]\n-b, --benchmark\nrun a benchmark\n-h, --help\nshow help\n-v, --version\nversion"
    assert section_items(options) == ["-b, --benchmark", "-h, --help", "-v, --version"]
    numbered = "1.2 New in this release\nChanges:\n1. SSH support.\n2. Old files removed.\nwrapped line\n3. D compiler."
    assert section_items(numbered) == ["SSH support.", "Old files removed.", "D compiler."]  # "1.2 New..." is a heading
    labels = "Return Codes\n[Return code]\nIDN2_OK\nSuccess.\n[Return code]\nIDN2_MALLOC\nNo memory."
    assert section_items(labels) == ["IDN2_OK", "IDN2_MALLOC"]
    assert section_items("Just prose about two things, text/plain and octet-stream.") == []


def test_items_no_passage_holds_do_not_count_and_each_item_is_cited_where_it_is():
    ledger = SourceLedger()
    a = ledger.add("m.pdf", 10, "-b, --benchmark\n-s, --strict", "c1")
    b = ledger.add("m.pdf", 11, "-h, --help", "c2")
    items = supported_items(["-b, --benchmark", "-s, --strict", "-h, --help", "-x, --invented"], ledger.passages)
    assert items == [("-b, --benchmark", a.marker), ("-s, --strict", a.marker), ("-h, --help", b.marker)]
    answer = count_answer("How many options does asn1Decoding accept?", items)
    assert answer.startswith("There are 3 options:") and "- -h, --help [2]" in answer and "invented" not in answer


def test_counted_noun():
    assert counted_noun("How many return codes are listed in the Return Codes section?") == "return codes"
    assert counted_noun("How many rules decide a column's affinity?") == "rules"
    assert counted_noun("Count them") == "items"
    assert counted_noun("How many implicit subclass rules does the spec state?") == "implicit subclass rules"


@dataclass
class Hit:
    chunk_id: str
    doc_id: str
    path: str
    page: int
    heading: str
    text: str


@dataclass
class Page:
    doc_id: str
    path: str
    page: int
    text: str


class FakeRetriever:
    def __init__(self) -> None:
        self.queries: list[str] = []
        self.hits = [Hit("c1", "d1", "/docs/a.pdf", 3, "Options", "-a one\n-b two"),
                     Hit("c2", "d1", "/docs/a.pdf", 7, "Return Codes", "[Return code]\nE1\n[Return code]\nE2")]

    def search(self, query, k=None, filters=None):
        self.queries.append(query)
        return list(self.hits)

    def section(self, hit, max_chars=8000):
        return [Page(hit.doc_id, hit.path, hit.page, f"{hit.heading}\n{hit.text}")]

    def read(self, doc, pages=None):
        return [Page("d1", "/docs/a.pdf", 1, "whole page one"), Page("d1", "/docs/a.pdf", 2, "whole page two")]

    def documents(self):
        return [{"doc_id": "d1", "path": "/docs/a.pdf", "file_name": "a.pdf"}]


def prefetch(retriever: FakeRetriever) -> DocumentPrefetch:
    return DocumentPrefetch(RetrieverHandle(lambda: retriever), k=4, lists=section_items)


def test_a_counting_question_reads_the_section_it_names():
    retriever = FakeRetriever()
    ledger = SourceLedger()
    found = prefetch(retriever)("How many codes does the Return Codes section list?", ledger)
    assert found.tool == "read_section" and found.count and found.arguments["section"] == "Return Codes"
    assert retriever.queries[0] == "Return Codes"  # the named section is searched by its name
    assert [(p.page, p.heading) for p in ledger.passages] == [(7, "Return Codes")]
    assert named_section("the 'New in this release' section") == "New in this release"


def test_a_counting_question_reads_the_section_whose_list_names_what_is_counted():
    # "In how many ways can a test wind up UNRESOLVED?": the best hit was "Running runtest", which has
    # no such list; "A test is UNRESOLVED when:" and its five items were under a hit ranked lower
    retriever = FakeRetriever()
    retriever.hits = [Hit("c0", "d1", "/docs/a.pdf", 10, "Running runtest", "runtest is the test driver. UNRESOLVED"),
                      Hit("c1", "d1", "/docs/a.pdf", 11, "Installation", "Refer to INSTALL."),
                      Hit("c2", "d1", "/docs/a.pdf", 9, "Test outcomes",
                          "A test wind up UNRESOLVED in these ways:\n- it is interrupted\n"
                          "- it depends on a failed test\n- it was set up incorrectly"),
                      Hit("c3", "d2", "/docs/b.pdf", 2, "Other ways", "Other ways:\n- one\n- two")]
    ledger = SourceLedger()
    found = prefetch(retriever)("In how many ways can a test wind up UNRESOLVED?", ledger)
    assert found.tool == "read_section" and found.arguments["section"] == "Test outcomes"
    assert [p.page for p in ledger.passages] == [9]
    # no section of the best hit's document has such a list: the best headed hit, as before
    retriever.hits = retriever.hits[:2] + retriever.hits[3:]
    found = prefetch(retriever)("In how many ways can a test wind up UNRESOLVED?", SourceLedger())
    assert found.arguments["section"] == "Running runtest"


def test_a_counting_question_also_searches_its_counted_noun_in_the_best_hits_document():
    # "How many mathematical operators does SQLite's datatypes page list?": the question's words found
    # "Affinity Name Examples"; "mathematical operators" alone, searched in that document, finds "Operators"
    class NounSearch(FakeRetriever):
        def __init__(self) -> None:
            super().__init__()
            self.filters: list = []
            self.hits = [Hit("c0", "d1", "/docs/t.docx", 1, "Affinity Name Examples", "The following table shows names.")]
            self.by_noun = [Hit("c9", "d1", "/docs/t.docx", 1, "Operators", "Mathematical operators (+, -, *) work."),
                            Hit("c8", "d2", "/docs/other.pdf", 4, "Operators", "Other operators (and, or).")]

        def search(self, query, k=None, filters=None):
            self.queries.append(query)
            self.filters.append(filters)
            if query != "mathematical operators":
                return list(self.hits)
            return [h for h in self.by_noun if filters is None or h.doc_id in filters["doc_id"]]

    retriever = NounSearch()
    found = prefetch(retriever)("How many mathematical operators does the datatypes page list?", SourceLedger())
    assert found.arguments["section"] == "Operators" and found.arguments["document"] == "t.docx"
    assert retriever.filters[-1] == {"doc_id": ["d1"]}  # only in the best hit's document


def test_the_section_path_reads_only_inside_the_turns_scope():
    retriever = FakeRetriever()
    question = "How many codes does the Return Codes section list?"
    assert prefetch(retriever)(question, SourceLedger(), scope=frozenset({"another-keys-doc"})) is None
    ledger = SourceLedger()
    found = prefetch(retriever)(question, ledger, scope=frozenset({"d1"}))
    assert found.tool == "read_section" and [p.page for p in ledger.passages] == [7]


def test_a_follow_up_is_searched_with_the_previous_question_and_whole_files_need_a_file_request():
    assert retrieval_query("And what does it return?", ["What does asn1_get_length_der do?"]) == \
        "What does asn1_get_length_der do? And what does it return?"
    assert retrieval_query("Which flag allows padding?", ["What does asn1_get_length_der do?"]) == "Which flag allows padding?"
    retriever = FakeRetriever()
    found = prefetch(retriever)("Which function deletes a whole structure?", SourceLedger())
    assert found.tool == "search_documents"  # "whole" alone is not a request to read whole files
    found = prefetch(retriever)("Summarise a.pdf", SourceLedger())
    assert found.tool == "read_document" and found.arguments == {"documents": ["a.pdf"]}
    found = prefetch(retriever)("What are the summary and log files called?", SourceLedger())
    assert found.tool == "search_documents"  # "summary" names a file here, it asks for no summary
    assert prefetch(retriever)("Give me a summary of the files", SourceLedger()).tool == "read_document"


def test_a_bullet_wrapped_over_two_lines_keeps_its_end():
    text = ("Some subclass rules are implicit:\n• All text/* types are subclasses of text/plain.\n"
            "• All streamable types (ie, everything except the inode/* types) are subclasses of\n"
            "application/octet-stream.\nIn addition to these rules, explicit subclass information may be given.")
    assert section_items(text) == ["All text/* types are subclasses of text/plain.",
                                   "All streamable types (ie, everything except the inode/* types) are subclasses "
                                   "of application/octet-stream."]
    unfinished = "- first item\n- second item\nThe next paragraph starts here."
    assert section_items(unfinished) == ["first item", "second item"]  # a capitalised line is not a wrap


def test_a_number_alone_on_a_line_is_the_end_of_a_sentence_not_an_item():
    # the shared-mime-info spec's element list ran on to "The default is" / "100." and was counted as 14 of 13
    text = ("A mime-type node may contain any of the following elements:\n• glob elements have a pattern.\n"
            "• magic elements contain a list of rules. The priority defaults to\n100.\n"
            "• treemagic elements contain a list of treematch rules.\nEach treematch element has attributes:")
    assert section_items(text) == ["glob elements have a pattern.",
                                   "magic elements contain a list of rules. The priority defaults to 100.",
                                   "treemagic elements contain a list of treematch rules."]


def test_counted_items_carry_one_marker_each_after_the_citation_check():
    ledger = SourceLedger()
    ledger.add("spec.pdf", 14, "All text/* types are subclasses of text/plain. All streamable types are "
               "subclasses of application/octet-stream.", "c1")
    answer = count_answer("How many implicit subclass rules are there?",
                          [("All text/* types are subclasses of text/plain.", 1),
                           ("All streamable types are subclasses of application/octet-stream.", 1)])
    checked = verify_citations(answer, ledger).text
    assert checked.count("[1]") == 2, checked
    assert "application/octet-stream [1]" in checked


def test_only_a_list_that_something_names_is_counted():
    section = ("Design goals\nSome explicit non-goals:\n- convenient syntax\n- built-in rules\n- shell ops\n"
               "Ninja's design goals are:\n- very fast builds\n- little policy\n")
    assert section_items(section, "design goals", "Design goals") == ["convenient syntax", "built-in rules", "shell ops"]
    assert section_items(section, "explicit non-goals") == ["convenient syntax", "built-in rules", "shell ops"]
    assert section_items(section, "fast builds") == []  # nothing introduces a list of those
    lookup = ("Evaluation and scoping\nTop-level variable declarations are scoped to the file.\n"
              "The full lookup order for a variable is:\n1. Special variables.\n2. Build-level variables.")
    assert section_items(lookup, "top-level variables", "Evaluation and scoping") == []  # one word is not enough
    assert section_items(lookup, "variables", "Evaluation and scoping") == ["Special variables.", "Build-level variables."]
    table = "| Compressor name | Ratio |\n| --- | --- |\n| zstd | 2.8 |\n| zlib | 2.7 |"
    assert section_items(table, "compressor configurations", "Benchmarks") == ["zstd | 2.8", "zlib | 2.7"]
    options = "Usage: tool [OPTION]\n-b, --benchmark\nrun it\n-h, --help\nshow help"
    assert section_items(options, "options", "Invoking tool") == ["-b, --benchmark", "-h, --help"]
    limits = "The limits are:\n- columns\n- rows\n- pages"
    assert section_items(limits, "limits") == ["columns", "rows", "pages"]
    assert section_items(limits, "of the limits") == []  # "how many of the limits can be lowered": a part


def test_a_lead_in_that_ends_by_naming_the_plural_head_noun_names_the_list():
    # "how many format substitutions": the lead-in never says "format", but its last words name substitutions
    section = ("The strftime() routine returns the date formatted according to the format string.\n"
               "The following is a complete list of valid strftime() substitutions:\n"
               "| | | |\n| %d | | day of month: 00 |\n| %f | | fractional seconds |\n| %% | | % |\n"
               "All other functions can be expressed in terms of strftime():\n"
               "| Function | | Equivalent |\n| date(...) | | strftime('%Y-%m-%d', ...) |")
    assert section_items(section, "format substitutions", "1. Overview") == [
        "%d | day of month: 00", "%f | fractional seconds", "%% | %"]
    # the head noun only in passing, not at the end: the lead-in introduces functions
    simple = ("For simple types like OCTET STRING the simple parsing functions listed below may be used instead.\n"
              "- asn1_decode_simple_der\n- asn1_encode_simple_der")
    assert section_items(simple, "ASN.1 types", "Simple parsing") == []
    # a singular head names no list (see the lookup order above)
    single = "Each entry below is one substitution:\n- %d\n- %f"
    assert section_items(single, "format substitution", "Entries") == []


def test_a_listed_item_that_is_a_symbol_keeps_it():
    # the model's listing of "+, -, *, /": "*" is an item, not emphasis around nothing
    assert listed_items("- +\n- -\n- *\n- `<<`\n- **bold** [1]\n- \"quoted\".") == ["+", "-", "*", "<<", "bold", "quoted"]


def test_a_number_out_of_sequence_starts_a_new_list():
    section = "3. Modifiers\nThe available modifiers are as follows.\n1. NNN days\n2. NNN hours\n4. Examples"
    assert section_items(section, "modifiers", "3. Modifiers") == ["NNN days", "NNN hours"]  # not the headings
    assert section_items("Intro:\n1. a\n2. b\n3. c\n1. x\n2. y") == ["a", "b", "c"]  # a restart is a new list


def test_a_table_of_rules_only_is_no_list():
    assert section_items("Options\n|---|\n| --- | --- |\nSome prose.", "options", "Options") == []


class OneSection(FakeRetriever):
    """A library whose every search finds one hit, `hit`'s section."""

    def __init__(self, hit: Hit) -> None:
        super().__init__()
        self.hits = [hit]


def prose_section() -> OneSection:
    """One section whose items run through prose: no list for the code to find."""
    return OneSection(Hit("c3", "d1", "/docs/a.pdf", 5, "Modifiers",
                          "The modifiers are start of month, start of year, weekday N, unixepoch and localtime; "
                          "utc converts back."))


def test_a_section_without_a_list_is_listed_by_the_model_and_counted_in_code(tmp_path):
    from assistant.events import Done
    from tests.agent_fakes import make_assistant

    listing = "- start of month [1]\n- start of year\n- weekday N\n- unixepoch.\n- weekday N\n- sunset\n- localtime"
    assistant, engine = make_assistant(tmp_path, listing, retriever=prose_section())
    done = list(assistant.turn(None, "How many modifiers does the Modifiers section describe?"))[-1]
    assert isinstance(done, Done) and done.text.startswith("There are 5 modifiers")  # a repeat and "sunset" do not count
    assert "- weekday N [1]" in done.text and "sunset" not in done.text and len(engine.prompts) == 1
    meta = assistant.orchestrator.store.get_message(done.message_id).meta
    assert (meta["model"], meta["route"]) == ("listed by the model, counted in code", "count")
    assert "Copy out every item the question counts" in engine.prompts[0][-1]["content"]


def test_a_count_of_symbols_keeps_the_markers_code_gave_its_items(tmp_path):
    # "- * [1]" holds no words: read as a model's claim its marker went, and the count cited nothing
    from assistant.events import Done, Sources
    from tests.agent_fakes import make_assistant

    assistant, _ = make_assistant(tmp_path, "- +\n- -\n- *\n- /\n- |", retriever=OneSection(Hit(
        "c4", "d1", "/docs/a.pdf", 6, "Operators",
        "Mathematical operators (+, -, *, /, and |) interpret both operands as if they were numbers.")))
    events = list(assistant.turn(None, "How many mathematical operators does the Operators section list?"))
    done = events[-1]
    assert isinstance(done, Done) and done.text.startswith("There are 5 mathematical operators")
    assert done.text.count("[1]") == 5 and "- * [1]" in done.text
    sources = [s for e in events if isinstance(e, Sources) for s in e.sources]
    assert [(s.marker, s.page) for s in sources] == [(1, 6)]
    assert assistant.orchestrator.store.get_message(done.message_id).meta["sources"][0]["page"] == 6


def test_a_listing_with_fewer_than_two_held_items_falls_back_to_the_answer(tmp_path):
    from assistant.events import Done
    from tests.agent_fakes import make_assistant

    assistant, engine = make_assistant(tmp_path, "- sunset\n- moonrise", "Five modifiers are described [1].",
                                       retriever=prose_section())
    done = list(assistant.turn(None, "How many modifiers does the Modifiers section describe?"))[-1]
    assert done.text.startswith("Five modifiers are described") and len(engine.prompts) == 2


def test_a_turn_cancelled_while_the_model_lists_ends_without_an_answer(tmp_path):
    import threading

    from assistant.events import Done
    from tests.agent_fakes import make_assistant

    assistant, engine = make_assistant(tmp_path, "- start of month\n- start of year\n- weekday N",
                                       "Five modifiers are described [1].", retriever=prose_section())
    cancel = threading.Event()
    cancel.set()
    done = list(assistant.orchestrator.run_turn(None, "How many modifiers does the Modifiers section describe?",
                                                cancel=cancel))[-1]
    assert isinstance(done, Done) and done.finish_reason == "cancelled" and done.text == ""
    assert len(engine.prompts) == 1  # no second call after the cancelled listing


def test_an_empty_first_table_row_is_neither_a_rule_nor_an_item():
    # SQLite's strftime() table parses with a row of empty cells where a header would be
    table = ("The following is a complete list of valid strftime() substitutions:\n| | | |\n"
             "| %d | | day of month: 00 |\n| %f | | fractional seconds |\n| %H | | hour: 00-24 |")
    assert section_items(table, "substitutions") == ["%d | day of month: 00", "%f | fractional seconds",
                                                     "%H | hour: 00-24"]  # the empty spacer cells left out


class TwoManuals(FakeRetriever):
    """libtasn1's chunks outrank libidn2's for any query; search honours a doc_id filter."""

    def __init__(self) -> None:
        super().__init__()
        tasn = [Hit(f"t{i}", "tasn", "/docs/libtasn1.pdf", i + 1, "Intro", f"libtasn1 is under LGPL 2.1, part {i}")
                for i in range(4)]
        self.hits = [*tasn, Hit("i0", "idn", "/docs/libidn2.pdf", 4, "Intro", "libidn2 is distributed under LGPLv3")]
        self.filters: list = []

    def search(self, query, k=None, filters=None):
        self.filters.append(filters)
        wanted = (filters or {}).get("doc_id")
        return [h for h in self.hits if wanted is None or h.doc_id in wanted][:k]

    def documents(self):
        return [{"doc_id": "tasn", "path": "/docs/libtasn1.pdf", "file_name": "libtasn1.pdf"},
                {"doc_id": "tasn-copy", "path": "/old/libtasn1.pdf", "file_name": "libtasn1.pdf"},
                {"doc_id": "idn", "path": "/docs/libidn2.pdf", "file_name": "libidn2.pdf"},
                {"doc_id": "lim", "path": "/docs/sqlite-limits.html", "file_name": "sqlite-limits.html"},
                {"doc_id": "typ", "path": "/docs/sqlite-datatypes.docx", "file_name": "sqlite-datatypes.docx"}]


def test_a_question_naming_two_documents_gets_passages_from_each():
    # "Under which licences are libtasn1 and libidn2 distributed?": one search filled all four places
    # with libtasn1's chunks, and the answer named one licence
    retriever = TwoManuals()
    ledger = SourceLedger()
    question = "Under which licences are the libtasn1 library and the libidn2 library distributed?"
    found = prefetch(retriever)(question, ledger)
    assert found.tool == "search_documents"
    assert [p.doc for p in ledger.passages] == ["libidn2.pdf", "libtasn1.pdf", "libtasn1.pdf", "libtasn1.pdf"]
    assert {"doc_id": ["idn"]} in retriever.filters and {"doc_id": ["tasn", "tasn-copy"]} in retriever.filters
    # one document named, or a word several names share ("sqlite"), or a generic one: one search as before
    for question in ("Which licence does libtasn1 use?", "What does SQLite store?", "What does the manual say?"):
        retriever.filters.clear()
        prefetch(retriever)(question, SourceLedger())
        assert retriever.filters == [None], question
    named = named_documents("How do the SQLite limits page and the datatypes page differ?", retriever.documents())
    assert list(named) == ["sqlite-datatypes.docx", "sqlite-limits.html"]


def test_an_acronym_counts_only_the_members_that_carry_its_name():
    links = ["IDNA2008 Framework (https://tools.ietf.org/html/rfc5890)", "IDNA2008 Protocol (https://tools.ietf.org/html/rfc5891)",
             "IDNA2008 Unicode tables (https://tools.ietf.org/html/rfc5892)", "IDNA2008 Bidi rule (https://tools.ietf.org/html/rfc5893)",
             "Punycode (https://tools.ietf.org/html/rfc3492)",
             "Unicode IDNA Compatibility Processing (http://www.unicode.org/reports/tr46/)"]
    question = "How many RFCs does the libidn2 manual's introduction point to for technical reference?"
    assert named_members(links, counted_noun(question)) == links[:5]
    # a plain noun is also a word of the other items' descriptions: the list stays whole
    functions = ["asn1_create_element: this function creates a structure", "asn1_delete_structure: this function deletes it",
                 "asn1_read_value: reads a value"]
    assert named_members(functions, "functions") == functions
    ids = ["the session ID", "the user ID", "an idle timeout"]  # "IDs" is no prefix of "idle"
    assert named_members(ids, "IDs") == ids[:2]
    # every item, or fewer than half, carrying the name: the list is what the question counts
    assert named_members(links[:5], "RFCs") == links[:5]
    assert named_members(links[4:] + ["Unicode TR46", "UTS 46"], "RFCs") == links[4:] + ["Unicode TR46", "UTS 46"]


def test_a_count_of_an_acronym_through_the_agent_loop_counts_only_its_members(tmp_path):
    from assistant.events import Done
    from tests.agent_fakes import make_assistant

    listing = "- SMTP (RFC 5321)\n- Message format (RFC 5322)\n- MIME bodies (RFC 2045)\n- Unicode collation (UTS 10)"
    references = Hit("c4", "d1", "/docs/mailer.pdf", 2, "References", "The mailer follows SMTP (RFC 5321), Message format "
                     "(RFC 5322), MIME bodies (RFC 2045) and Unicode collation (UTS 10).")  # three RFCs and a report
    assistant, _ = make_assistant(tmp_path, listing, retriever=OneSection(references))
    done = list(assistant.turn(None, "How many RFCs does the References section list?"))[-1]
    assert isinstance(done, Done) and done.text.startswith("There are 3 RFCs"), done.text
    assert "RFC 2045" in done.text and "UTS 10" not in done.text
