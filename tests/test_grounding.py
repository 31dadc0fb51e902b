"""Grounding (assistant/grounding.py): an answer over documents keeps only sentences whose specific
facts the turn's texts hold; one with nothing left becomes a refusal that points at the passages."""

from __future__ import annotations

from assistant.citations import Passage
from assistant.events import Done, Sources
from assistant.grounding import REFUSAL, Evidence, facts, ground, mentions, question_terms, restates, strip_echoes
from tests.agent_fakes import MANUAL, FakeRetriever, make_assistant

PASSAGES = [Passage(1, "libtasn1.pdf", 22, "Use the flag ASN1_DECODE_FLAG_ALLOW_PADDING to ignore padding. Since "
                    "version 4.12 the DER decoder is stricter. The ELE- MENT must not be NULL.", "c1"),
            Passage(2, "libtasn1.pdf", 8, "asn1Parser -c, --check checks the syntax only; the default weight is fifty.",
                    "c2")]


def evidence(*extra):
    return Evidence([p.text for p in PASSAGES] + list(extra))


def test_facts_are_the_specific_tokens():
    got = facts("Pass `--check` to asn1Parser 4.12 with ASN1_SUCCESS, mime.cache and text/markdown [2], e.g. now.")
    assert got == ["--check", "asn1Parser", "4.12", "ASN1_SUCCESS", "mime.cache", "text/markdown"]
    assert facts("The warranty is long and the device is small.") == []
    assert facts("lz4 1.9.3 decompresses at 4500 MB/s, the 4th row of the 1st table [3].") == \
        ["lz4", "1.9.3", "4500", "MB/s"]  # "4th" says where, not what


def test_supported_facts_match_whole_words_with_folded_case_hyphens_and_number_words():
    ev = evidence()
    assert ev.holds("asn1_decode_flag_allow_padding") and ev.holds("4.12") and ev.holds("--check")
    assert ev.holds("ELEMENT")  # the line-break hyphen in "ELE- MENT" is folded
    assert not ev.holds("4.1") and not ev.holds("ASN1_DECODE_FLAG")  # a part of a token is not the token
    assert Evidence(["the default weight is fifty"]).holds("50") is False  # only small numbers have words
    assert Evidence(["it takes two seconds"]).holds("2")
    title = Evidence(["The Ninja build system v1.11.1, Aug 2022"])  # a version's "v" is notation, not a fact
    assert title.holds("1.11.1") and title.holds("v1.11.1") and Evidence(["ninja 1.11.1"]).holds("v1.11.1")
    assert not title.holds("11.1") and not Evidence(["uv1.11.1"]).holds("1.11.1")
    assert title.holds("1.11")  # the release line of 1.11.1
    assert not Evidence(["about 2.5 MB"]).holds("5") and not Evidence(["about 2.5 MB"]).holds("2")
    assert Evidence(["version 2.5."]).holds("2.5") and Evidence(["in 2 steps."]).holds("2")


def test_an_unsupported_answer_becomes_a_refusal_pointing_at_the_passages():
    g = ground("libtasn1 needs OpenSSL version 1.1.1 or later [1].", evidence("Which OpenSSL does libtasn1 need?"),
               PASSAGES)
    assert g.refused and g.unsupported == ("1.1.1",)
    assert g.text == f"{REFUSAL} The closest passages I found are in libtasn1.pdf p. 22, libtasn1.pdf p. 8."


def test_only_the_unsupported_sentence_is_dropped():
    answer = "Use ASN1_DECODE_FLAG_ALLOW_PADDING [1]. It was added in version 9.9 [1]. It is handy."
    g = ground(answer, evidence(), PASSAGES)
    assert not g.refused and g.unsupported == ("9.9",)
    assert g.text == "Use ASN1_DECODE_FLAG_ALLOW_PADDING [1]. It is handy."


def test_the_markers_of_a_dropped_sentence_go_with_it_and_those_of_a_kept_one_stay():
    answer = ("The file is icons.xml. [2] Use ASN1_DECODE_FLAG_ALLOW_PADDING with asn1Parser --check. [1] "
              "It was added in 9.9. [1]")
    g = ground(answer, evidence(), PASSAGES)
    assert not g.refused and g.unsupported == ("icons.xml", "9.9")
    assert g.text == "Use ASN1_DECODE_FLAG_ALLOW_PADDING with asn1Parser --check. [1]"


def test_a_made_up_command_block_is_one_unsupported_claim():
    answer = "Run it like this:\n```bash\ndocker run -it --rm dejagnu\n```\nThat starts the tests."
    g = ground(answer, evidence(), PASSAGES)
    assert g.refused and "--rm" in g.unsupported
    mostly = ground("Use version 4.12 with these:\n```\nrun --rm --fast\n```\nIt checks the syntax [2].", evidence(),
                    PASSAGES)
    assert mostly.refused and mostly.unsupported == ("--rm", "--fast")  # 2 made up against 1 supported


def test_answers_without_specific_facts_and_supported_ones_are_left_alone():
    for answer in ("It checks the syntax only [2].", "The --check option checks the syntax only [2].",
                   "The documents do not say."):
        g = ground(answer, evidence(), PASSAGES)
        assert (g.text, g.unsupported, g.refused) == (answer, (), False)


def test_copied_passage_headers_are_removed():
    echoed = "[2] libtasn1.pdf p. 8 (section Invoking asn1Parser): asn1Parser -c, --check checks the syntax only."
    assert strip_echoes(echoed) == "asn1Parser -c, --check checks the syntax only."
    g = ground(echoed, evidence(), PASSAGES)
    assert g.text == "asn1Parser -c, --check checks the syntax only." and not g.unsupported
    bare = ground("[3] shared-mime-info-spec.pdf p. 8", evidence(), PASSAGES)  # a header and nothing else
    assert bare.text.startswith(REFUSAL)
    for empty in ("The ninja-manual.html p. 1 (section Version compatibility) [4]", "[1]", " [2]. [2]"):  # eval answers
        assert ground(empty, evidence(), PASSAGES).text.startswith(REFUSAL), empty
    assert ground("ASN1_DECODE_FLAG_ALLOW_PADDING [1]", evidence(), PASSAGES).text == "ASN1_DECODE_FLAG_ALLOW_PADDING [1]"


def test_sentences_that_only_say_where_the_answer_was_read_are_removed():
    # seen in eval answers: the markers the citation check drops left "It is cited in passages and."
    for tail in ("It is cited in passages [1] and [3].", "This is stated in the passage from libtasn1.pdf p. 8.",
                 "The passage from libtasn1.pdf p. 8 (section Invoking asn1Parser) provides the relevant information.",
                 "This option is described in libtasn1.pdf p. 8.", "It is found in [1].",
                 # once the header went, "It is described in" was left; "It is cited in and." reached a user
                 "It is cited in [1] and [3].", "It is cited in [1], [2] or [4].",
                 # a dev answer (2026-12-01): the header went and "This can be seen in the passage from" was left
                 "This can be seen in the passage from [4] libidn2.pdf p. 6."):
        g = ground(f"The --check option checks the syntax only [2]. {tail}", evidence(), PASSAGES)
        assert g.text == "The --check option checks the syntax only [2]." and not g.refused
    for kept in ("It is described in section 3 of the manual [2].",  # the first sentence is the answer
                 "The --check option checks the syntax [2]. It is located at the end of the file.",  # a claim, not a pointer
                 "The --check option checks the syntax [2]. It is found in Debian and Fedora."):
        assert strip_echoes(kept) == kept


def test_clauses_that_only_say_where_a_fact_was_read_are_removed():
    # eval answers (2026-12-01): the user never saw "the passages"; the sources say where each fact is from
    for said, shown in (
            ("The spec's version is 0.21, as stated in the first passage [1].", "The spec's version is 0.21 [1]."),
            ("The CPU was a Core i7-6700K CPU @ 4.0GHz, which is in passage [3].", "The CPU was a Core i7-6700K CPU @ 4.0GHz [3]."),
            ("The manual describes version 2.3.3, as stated in the passage from [1] libidn2.pdf p. 1.",
             "The manual describes version 2.3.3"),
            ("It goes into globs2 [1]. This is written in [1] shared-mime-info-spec.pdf p. 7.", "It goes into globs2 [1]."),
            # a test answer (2026-12-01): the section named in the header holds "[1]." and a sentence's start
            ("It decompresses `FILE.zst` [1]. The passage from zstd-README.md p. 1 (section Dictionary compression How "
             "To: 3 [1]. Decompress with dictionary `zstd -D dictionaryName --decompress FILE.zst`) provides the command "
             "to decompress the file using the dictionary [1].", "It decompresses `FILE.zst` [1].")):
        assert strip_echoes(said) == shown
    for kept in ("REAL comes first in the order shown in the passage, which says FLOAT gives REAL [1].",  # a clause goes on
                 "The ships anchored in the Passage [2].",  # a name, not the context
                 "Read the passage from the manual aloud [2].",
                 "The passage from ninja-manual.html p. 1 says so [2]."):  # the first sentence is the answer
        assert strip_echoes(kept) == kept


def test_a_turn_over_documents_refuses_a_made_up_fact_and_cites_nothing(tmp_path):
    assistant, _ = make_assistant(tmp_path, "The Zephyr X2 weighs 2.5 kg [1].", "The warranty period is 7 years [1].",
                                  retriever=FakeRetriever(MANUAL))
    events = list(assistant.turn(None, "How heavy is the Zephyr X2?"))
    done = events[-1]
    assert isinstance(done, Done) and done.text.startswith(REFUSAL) and "zephyr_manual.pdf p." in done.text
    assert not any(isinstance(e, Sources) and e.sources for e in events)
    stored = assistant.conversations.history(done.conversation_id)[-1]
    assert stored.content == done.text and stored.meta["unsupported_facts"] == ["2.5"]
    kept = list(assistant.turn(None, "What is the warranty period of the Zephyr X2?"))[-1]
    assert kept.text == "The warranty period is 7 years [1]."  # supported: untouched, cited


def test_an_answer_that_is_only_a_passage_number_is_asked_again_in_words(tmp_path):
    """The 1.5B model sometimes answers "[1]" and stops; the turn asks once more, without tools, and the
    stray marker before the answer's first word goes."""
    from assistant.agent_loop import IN_WORDS

    assistant, engine = make_assistant(tmp_path, "[1]", "The warranty period is 7 years [1].",
                                       retriever=FakeRetriever(MANUAL))
    events = list(assistant.turn(None, "What is the warranty period of the Zephyr X2?"))
    assert len(engine.prompts) == 2
    again = engine.prompts[1]
    assert again[-2] == {"role": "assistant", "content": "[1]"} and again[-1] == IN_WORDS
    done = events[-1]
    assert isinstance(done, Done) and done.text == "The warranty period is 7 years [1]."
    assert IN_WORDS["content"] in assistant.prompt_texts()  # the output guard protects it like the system prompt
    # asked once only: a second bare number is the refusal that names the closest passages
    assistant, engine = make_assistant(tmp_path / "b", "[1]", "[1]", retriever=FakeRetriever(MANUAL))
    assert list(assistant.turn(None, "What is the warranty period of the Zephyr X2?"))[-1].text.startswith(REFUSAL)
    assert len(engine.prompts) == 2


def test_markers_before_the_first_word_are_removed():
    assert strip_echoes("[1] The version is 0.21 [1].") == "The version is 0.21 [1]."
    assert strip_echoes("[1]. [2] It is 7 years [2].") == "It is 7 years [2]."
    assert strip_echoes("It is 7 years [2].") == "It is 7 years [2]."


def test_the_things_a_question_names_and_whether_a_text_mentions_them():
    assert question_terms("Which minimum OpenSSL version does libtasn1 need at build time?") == ["OpenSSL", "libtasn1"]
    assert question_terms("Does SQLite's strftime() support the %V ISO week number?") == ["SQLite", "%V", "ISO"]
    assert question_terms("On which date was libidn2 2.3.0 released? What changed?") == ["libidn2", "2.3.0"]
    assert question_terms("Which variable points Ninja at a Makefile-style file?") == []  # capitalised only: no name
    assert question_terms("Welche Version von OpenSSL braucht die Bibliothek?") == ["OpenSSL"]  # German capitalises nouns
    assert question_terms("I need it. What must I define?") == []  # a capitalised word is no name
    assert question_terms("OpenSSL or GnuTLS (TLS): which one?") == ["OpenSSL", "GnuTLS", "TLS"]
    assert mentions("add dejagnu to the AUTOMAKE OPTIONS\nvariable", "AUTOMAKE_OPTIONS")  # a PDF drops the "_"
    assert mentions("see RFC 5890", "RFCs") and mentions("all classes", "class") and mentions("DOCKER", "docker")
    assert not mentions("a glass", "class") and not mentions("%W is the week", "%V") and not mentions("openssl3", "OpenSSL")


def test_a_cited_answer_about_what_no_document_mentions_is_withdrawn(tmp_path):
    # "Which minimum OpenSSL version does libtasn1 need?" was answered with the manual's own version: every
    # fact of it is in a passage (the question holds "OpenSSL"), and the answer check said yes
    from assistant.events import Notice

    assistant, _ = make_assistant(tmp_path, "The Zephyr X2 works with HomeKit in rooms up to 40 square metres [1].",
                                  "The Zephyr X2 uses a HEPA filter [2].", retriever=FakeRetriever(MANUAL))
    events = list(assistant.turn(None, "Which HomeKit version does the Zephyr X2 need?"))
    done = events[-1]
    assert isinstance(done, Done) and done.text.startswith("The documents I searched do not mention HomeKit.")
    assert "zephyr_manual.pdf p. 1" in done.text
    notice = next(e for e in events if isinstance(e, Notice) and e.replaces_answer)
    assert "HomeKit" in notice.message and notice.replaces_answer == done.text
    assert not any(isinstance(e, Sources) and e.sources for e in events)
    stored = assistant.conversations.history(done.conversation_id)[-1]
    assert stored.meta["not_in_documents"] == ["HomeKit"] and "40 square metres" in stored.meta["replaced_answer"]
    # a name the documents do mention stands
    kept = list(assistant.turn(None, "Which filter does the Zephyr X2 use, a HEPA one?"))[-1]  # HEPA is mentioned
    assert kept.text == "The Zephyr X2 uses a HEPA filter [2]."


def test_the_library_is_searched_for_a_name_the_passages_lack():
    from tools.retrieval import DocumentPrefetch, RetrieverHandle

    prefetch = DocumentPrefetch(RetrieverHandle(lambda: FakeRetriever(MANUAL)))
    assert prefetch.mentions("HEPA") and prefetch.mentions("pre-filter") and prefetch.mentions("zephyr_manual")
    assert not prefetch.mentions("Bluetooth")
    assert prefetch.mentions("Bluetooth", frozenset()) is True  # no documents in scope: nothing to be sure of


def test_a_cited_answer_without_a_number_to_a_version_question_is_withdrawn(tmp_path):
    # "What is the minimum Tcl version DejaGnu needs?" got a cited description of DejaGnu and Tcl
    from assistant.grounding import states_no_number

    assert states_no_number("What is the minimum Tcl version DejaGnu needs?", "DejaGnu is written in Tcl [3].")
    assert not states_no_number("What is the minimum Tcl version DejaGnu needs?", "Tcl 8.5 or later [3].")
    assert not states_no_number("Which runtest option prints the version numbers?", "The -V option [1].")
    assert not states_no_number("Since which version is it there?", "Since v2 [1].")
    assert not states_no_number("How much space must the buffer have?", "ASN1_MAX_TL_SIZE bytes [1].")
    q = "Which Unicode version are libidn2's IDNA2008 tables generated from?"
    assert states_no_number(q, "The Unicode version used in libidn2's IDNA2008 tables is Unicode TR46 [1].")
    assert not states_no_number(q, "From Unicode 11.0.0, like IDNA2008's [1].")  # the question's digits aside
    assistant, _ = make_assistant(tmp_path, "The Zephyr X2 is a compact air purifier [1].",
                                  "The warranty period is 7 years [1].", retriever=FakeRetriever(MANUAL))
    done = list(assistant.turn(None, "Which firmware version does the Zephyr X2 purifier run?"))[-1]
    assert done.text.startswith(REFUSAL)
    stored = assistant.conversations.history(done.conversation_id)[-1]
    assert stored.meta["states_no_number"] and stored.meta["replaced_answer"].startswith("The Zephyr X2 is")
    kept = list(assistant.turn(None, "Since which version does the Zephyr X2 have its warranty?"))[-1]
    assert kept.text == "The warranty period is 7 years [1]."  # a number the question lacks: not this rule's to judge


def test_a_count_no_passage_states_is_withdrawn(tmp_path):
    # "How many mathematical operators does the datatypes page list?" got "5" (there are 9); the model
    # writes a count only when the count path found no list, and it cannot count
    from assistant.grounding import unstated_count

    shown = [Passage(1, "a.html", 1, "SQLite supports six date and time functions as follows: date(), time().", "c"),
             Passage(2, "b.pdf", 3, "The default priority value is 50, and the maximum is 100.", "d")]
    assert unstated_count("How many MIME types does it define?", "It defines 100 MIME types [2].", shown) == "100"
    assert unstated_count("How many date and time functions are there?", "There are 6 date and time functions [1].",
                          shown) == ""  # stated, as a word, four words before its noun
    assert unstated_count("How many date and time functions are there?", "There are 7 functions [1].", shown) == "7"
    assert unstated_count("How many functions are there?", "They are date() and time() [1].", shown) == ""  # no count
    assert unstated_count("What is the maximum priority?", "It is 100 [2].", shown) == ""  # not a count question
    assistant, _ = make_assistant(tmp_path, "The Zephyr X2 has 3 filters [1].", "The Zephyr X2 has 3 filters [1].",
                                  retriever=FakeRetriever(MANUAL))
    done = list(assistant.turn(None, "How many filters does the Zephyr X2 have?"))[-1]
    assert done.text.startswith(REFUSAL)
    stored = assistant.conversations.history(done.conversation_id)[-1]
    assert stored.meta["unstated_count"] == "3" and stored.meta["replaced_answer"].startswith("The Zephyr X2 has 3")


def test_a_default_no_passage_states_is_withdrawn(tmp_path):
    # "What is the default page size of a new SQLite database?" got "65536" from "at the maximum page size
    # of 65536 bytes", and "Which compression level does zstd use when I don't specify one?" got "1" from
    # "(compared to level 1)"; neither passage says what the default is
    from assistant.grounding import unstated_default

    limits = Passage(1, "limits.html", 1, "SQLITE_MAX_PAGE_COUNT, which is normally set to 1073741823, is the largest "
                     "number of pages. At the maximum page size of 65536 bytes, that is 1.4e+14 bytes.", "c")
    zstd = Passage(2, "README.md", 1, "Negative levels offer faster compression (compared to level 1).\n\n"
                   "| Option | Default |\n|---|---|\n| ZSTD_LEGACY_SUPPORT | 5 |", "d")
    shown = [limits, zstd]
    assert unstated_default("What is the default page size of a new SQLite database?",
                            "The default page size of a new SQLite database is 65536 bytes [1].", shown) == "65536"
    assert unstated_default("Which compression level does zstd use when I don't specify one?",
                            "It uses level 1 [2].", shown) == "1"
    assert unstated_default("What is SQLITE_MAX_PAGE_COUNT by default?", "1073741823 [1].", shown) == ""  # "normally"
    assert unstated_default("What is ZSTD_LEGACY_SUPPORT's default?", "It is 5 [2].", shown) == ""  # the table's header
    assert unstated_default("What is the maximum page size?", "65536 bytes [1].", shown) == ""  # no default asked
    assert unstated_default("What is the default build type?", "Release, by default [2].", shown) == ""  # no fact given
    assert unstated_default("Is 65536 the default page size?", "No: 65536 is the maximum [1].", shown) == ""  # asked
    assert unstated_default("What is SQLITE_MAX_PAGE_COUNT by default?",  # the sentence that states the default
                            "It is normally 1073741823 [1]. It can be lowered to 65536 [1].", shown) == ""
    assert unstated_default("What is the default level?", "The default level is 1 [2]. SQLite has 1073741823 [1].", shown) == "1"
    assistant, _ = make_assistant(tmp_path, "The default filter life is 6 months [1].",
                                  "The default filter life is 6 months [1].", retriever=FakeRetriever(MANUAL))
    done = list(assistant.turn(None, "What is the default filter life of the Zephyr X2 HEPA filter?"))[-1]
    assert done.text.startswith(REFUSAL)
    stored = assistant.conversations.history(done.conversation_id)[-1]
    assert stored.meta["unstated_default"] == "6" and stored.meta["replaced_answer"].startswith("The default filter")
    kept = list(assistant.turn(None, "How often do I replace the HEPA filter of the Zephyr X2?"))[-1]
    assert kept.text == "The default filter life is 6 months [1]."  # no default asked: the answer stands


def test_an_answer_that_names_nothing_the_question_does_not_restates_it():
    q = "Which file generated by update-mime-database maps MIME types to generic icons?"
    assert restates(q, "The file generated by update-mime-database maps MIME types to generic icons [1].") == "file"
    assert restates("If I store dates in SQLite as Julian day numbers, which storage class holds them?",
                    "The Julian day numbers storage class holds dates in SQLite [1].") == "storage class"
    assert restates("Which ninja -t clean flag also deletes generator outputs?",
                    "The ninja -t clean flag also deletes generator outputs [1].") == "flag"
    assert restates(q, "The generic-icons file [2].") == ""  # names it
    assert restates(q, "They are mapped in `mime.cache` [1].") == ""
    assert restates("Which desktops does the spec merge?", "GNOME and Kde [1].") == ""  # capitalised names
    assert restates(q, "The documents I searched do not say.") == ""  # a refusal
    assert restates("How long is the warranty?", "The warranty is long [1].") == ""  # asks for no name
    assert restates("Which keyword must I add to AUTOMAKE_OPTIONS?", "The keyword to add is dejagnu [1].") == ""
    # an answer asked once more that says its first sentence again says it once
    again = ground("The keyword is dejagnu [1]. It enables tests. The keyword is dejagnu [2].", Evidence(["dejagnu"]))
    assert again.text == "The keyword is dejagnu [1]. It enables tests."
    # and one with no sentence end to split at (the 1.5B model's "... everything [1]" and then the same again)
    twice = "asn1_print_structure prints everything [1] asn1_print_structure prints everything [2]"
    assert ground(twice, Evidence(["asn1_print_structure"])).text == "asn1_print_structure prints everything [1]"
    assert ground("It is x [1] and it is y [1]", Evidence(["x y"])).text == "It is x [1] and it is y [1]"


def test_an_answer_that_restates_the_question_is_asked_again_for_the_name(tmp_path):
    from assistant.agent_loop import NAME_IT

    manual = {"/docs/zephyr_manual.pdf": [*MANUAL["/docs/zephyr_manual.pdf"],
                                          "The filter log is written to zephyr-filter.log every night."]}
    assistant, engine = make_assistant(tmp_path, "The filter log file is written every night [1].",
                                       "It is zephyr-filter.log [1].", retriever=FakeRetriever(manual))
    done = list(assistant.turn(None, "Which file is the filter log written to every night?"))[-1]
    assert len(engine.prompts) == 2
    assert engine.prompts[1][-2] == {"role": "assistant", "content": "The filter log file is written every night [1]."}
    assert engine.prompts[1][-1] == {"role": "system", "content": NAME_IT.format(noun="file")}
    assert done.text == "The filter log file is written every night [1]. It is zephyr-filter.log [1]."
    assert NAME_IT in assistant.prompt_texts()
    # an answer that names it is not asked again
    assistant, engine = make_assistant(tmp_path / "b", "The filter log goes to zephyr-filter.log [1].",
                                       retriever=FakeRetriever(manual))
    assert list(assistant.turn(None, "Which file is the filter log written to every night?"))[-1].text == \
        "The filter log goes to zephyr-filter.log [1]."
    assert len(engine.prompts) == 1


def test_a_name_copied_one_letter_off_is_spelt_as_the_passage_spells_it():
    ev = Evidence(["The globs2 file lists each glob with its weight; glob and globs are words. IDN2_USE_STD3 is set. "
                   "Version 1.2.3 of libfoo sets x_ab."])
    fixed = ground("The weights are in glob2 [1].", ev)
    assert fixed.text == "The weights are in globs2 [1]." and fixed.respelled == (("glob2", "globs2"),)
    assert fixed.unsupported == () and fixed.to_meta()["respelled"] == [["glob2", "globs2"]]
    assert ground("Use IDNA_USE_STD3 [1].", ev).refused  # a digit differs: not a misspelling
    assert ground("libfoo 1.2.4 added it [1].", ev).unsupported == ("1.2.4",)  # numbers are never respelt
    assert ground("libfoo sets x_a [1].", ev).unsupported == ("x_a",)  # too short to tell from another name
    assert "respelled" not in ground("It is globs2 [1].", ev).to_meta()
