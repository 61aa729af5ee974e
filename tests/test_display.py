"""Text printed for the user: control characters shown, never obeyed, and answers released as they are written."""

import json

from klevict_cli.display import TextStream, json_text, visible


def test_visible_shows_control_characters_as_escapes():
    assert visible("a\x1b[31mb\x07\u202ec\nd") == "a\\x1b[31mb\\x07\\u202ec\\nd"
    assert visible("a\tb\nc\x9b", keep="\n\t") == "a\tb\nc\\x9b"
    assert visible("Grüße, 東京 [bold]") == "Grüße, 東京 [bold]"


def test_json_text_escapes_what_json_dumps_leaves_raw_and_round_trips():
    payload = {"a": "x\x7fy\x9bz\u202e\U000e0001 é"}
    text = json_text(payload)
    assert all(c.isprintable() for c in text) and "é" in text
    assert json.loads(text) == payload


class Pieces:
    """A tokenizer whose token i decodes to pieces[i]; bytes of a split character decode to U+FFFD."""

    def __init__(self, pieces):
        self.pieces = pieces

    def decode(self, tokens, skip_special_tokens=True):
        return "".join(self.pieces[t] for t in tokens)


def test_text_stream_releases_what_adds_up_to_the_stripped_answer():
    pieces = ["\n", " Hello", ",", " wor", "\ufffd", "ld", " ", "\n"]
    stream = TextStream(Pieces(pieces))
    released = [stream.update(list(range(n + 1))) for n in range(len(pieces))]
    assert released == ["", "Hello", ",", " wor", "", "\ufffdld", "", ""]
    final = "".join(pieces).strip()
    assert "".join(released) + stream.finish(final) == final


def test_text_stream_restates_an_answer_that_does_not_extend_what_was_shown():
    stream = TextStream(Pieces(["Hello", " ,"]))
    assert stream.update([0, 1]) == "Hello ,"
    assert stream.finish("Hello,") == "\nHello,"  # e.g. a tokenizer that cleans up spaces in the final decode
