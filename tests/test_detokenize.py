"""Incremental detokenisation never emits broken UTF-8; stop strings work across token boundaries."""

from assistant.engine.detokenize import IncrementalDetokenizer, StopMatcher


class ByteTokenizer:
    """Each token is one byte: multi-byte characters span several tokens, like byte-level BPE."""

    def decode(self, ids, skip_special_tokens=True):
        return bytes(ids).decode("utf-8", errors="replace")


def test_multibyte_characters_are_released_whole():
    text = "naïve café — 東京 🙂!"
    detok = IncrementalDetokenizer(ByteTokenizer(), [])
    pieces = [detok.push(b) for b in text.encode()]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
    assert "" in pieces  # some tokens completed no character on their own


def _run(stop, chunks):
    m = StopMatcher(stop)
    out = [m.push(c) for c in chunks]
    return "".join(out) + m.flush(), m.stopped


def test_stop_string_split_across_tokens_is_never_shown():
    assert _run(["<END>"], ["Hello <E", "N", "D> tail"]) == ("Hello ", True)
    assert _run(["\n\n"], ["a\n", "\nb"]) == ("a", True)


def test_partial_stop_prefix_is_released_when_it_turns_out_not_to_be_one():
    m = StopMatcher(["<END>"])
    assert m.push("x <EN") == "x "  # held back: could be the stop string
    assert m.push("VELOPE") == "<ENVELOPE"
    assert _run(["<END>"], ["ends with <EN"]) == ("ends with <EN", False)


def test_no_stop_strings_pass_through():
    assert _run([], ["a", "b"]) == ("ab", False)
