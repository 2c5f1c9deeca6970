"""conformance.text: whatever a target raises becomes text every writer accepts, and describing it never fails."""

from __future__ import annotations

import json
import re

import pytest

from conformance.text import MESSAGE_LIMIT, describe_exception, safe_text, without_surrogates


def writable(text: str) -> bool:
    """What the writers need: valid UTF-8, no control character but newline and tab."""
    text.encode("utf-8")  # raises on a lone surrogate
    return not re.search(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]", text)


class Unprintable(Exception):
    def __str__(self):
        raise ValueError("no str")

    def __repr__(self):
        raise ValueError("no repr")


class StrRaises(Exception):
    def __str__(self):
        raise KeyError("no str")


class NamelessMeta(type):
    @property
    def __name__(cls):
        raise RuntimeError("no name")


class Nameless(Exception, metaclass=NamelessMeta):
    pass


def raised(exc: BaseException) -> BaseException:
    try:
        raise exc
    except BaseException as caught:  # noqa: BLE001
        return caught


def test_surrogates_are_shown_as_escapes():
    text = safe_text("driver said \udcff\udcfe!")
    assert text == "driver said \\udcff\\udcfe!" and writable(text)


def test_nul_esc_and_other_controls_are_escaped_but_newline_and_tab_kept():
    text = safe_text("a\x00b\x1b[31mred\x1b[0m\r\n\tc\x7f\x85")
    assert text == "a\\x00b\\x1b[31mred\\x1b[0m\\r\n\tc\\x7f\\x85" and writable(text)


def test_plain_text_is_returned_as_it_is():
    text = "RuntimeError: synapse error 26 — ünïcödé 数据\n\tline 2"
    assert safe_text(text) == text


def test_bytes_are_decoded_with_undecodable_bytes_escaped():
    assert safe_text(b"ok \xc3\xa9 \xff\xfe") == "ok é \\xff\\xfe"
    assert safe_text(bytearray(b"\x00\xff")) == "\\x00\\xff"


def test_none_and_other_values():
    assert safe_text(None) == "None"
    assert safe_text(12) == "12"
    assert safe_text(["\udcff"]) == "['\\udcff']"  # repr of a list escapes already


def test_a_raising_str_falls_back_to_repr_and_a_raising_repr_too_is_named():
    class ReprOnly:
        def __str__(self):
            raise ValueError

        def __repr__(self):
            return "<ReprOnly \udcff>"

    assert safe_text(ReprOnly()) == "<ReprOnly \\udcff>"
    assert safe_text(Unprintable()) == "<Unprintable object: str() raised ValueError, repr() raised ValueError>"


def test_a_str_subclass_with_hostile_methods_is_taken_as_its_characters():
    class Hostile(str):
        def __str__(self):
            raise ValueError

        def encode(self, *args, **kwargs):
            raise ValueError

    assert safe_text(Hostile("a\x00")) == "a\\x00"


def test_ten_megabytes_are_cut_to_the_limit_with_a_note_keeping_head_and_tail():
    text = "HEAD" + "x" * 10_000_000 + "TAIL"
    cut = safe_text(text)
    assert len(cut) <= MESSAGE_LIMIT and cut.startswith("HEADxxx") and cut.endswith("xxxTAIL")
    count = int(re.search(r"… \[([\d,]+) characters cut\] …", cut).group(1).replace(",", ""))
    assert count == len(text) - (len(cut) - len(re.search(r" … \[.*?\] … ", cut).group()))
    assert safe_text(cut) == cut  # idempotent


@pytest.mark.parametrize("char", ["\udcff", "\x00", "\x1b"])
def test_escapes_count_towards_the_limit_and_are_never_cut_in_half(char):
    for length in (MESSAGE_LIMIT // 2, MESSAGE_LIMIT, 10 * MESSAGE_LIMIT):
        cut = safe_text(char * length)
        assert len(cut) <= MESSAGE_LIMIT and writable(cut) and "characters cut" in cut
        head, tail = re.split(r" … \[[\d,]+ characters cut\] … ", cut)
        escape = safe_text(char)
        assert head.replace(escape, "") == "" and tail.replace(escape, "") == ""
        kept = (len(head) + len(tail)) // len(escape)
        assert f"[{length - kept:,} characters cut]" in cut


def test_a_small_limit():
    assert safe_text("abcdef", limit=6) == "abcdef"
    assert safe_text("abcdefg", limit=6) == "… [7 characters cut]"  # the note alone when nothing else fits
    assert len(safe_text("y" * 500, limit=100)) <= 100


def test_describe_exception_names_type_message_and_innermost_frame():
    text = describe_exception(raised(RuntimeError("synapse error 26")))
    assert re.fullmatch(r"RuntimeError: synapse error 26 \(at .*test_text\.py:\d+\)", text), text
    assert describe_exception(RuntimeError("no traceback")) == "RuntimeError: no traceback"
    assert describe_exception(RuntimeError()) == "RuntimeError"


def test_describe_exception_with_surrogates_nul_and_esc():
    text = describe_exception(RuntimeError("driver said \udcff \x00 \x1b[0m"))
    assert text == "RuntimeError: driver said \\udcff \\x00 \\x1b[0m" and writable(text)


def test_describe_exception_when_str_and_repr_raise():
    text = describe_exception(raised(Unprintable("hidden")))
    assert text.startswith("Unprintable: <str() raised ValueError; repr() raised ValueError> (at ") and writable(text)


def test_describe_exception_when_only_str_raises_uses_repr():
    assert describe_exception(StrRaises("x")) == "StrRaises: StrRaises('x') (str() raised KeyError)"


def test_describe_exception_when_the_type_name_raises():
    assert describe_exception(Nameless("m")) == "<unnamed type>: m"


def test_describe_exception_of_a_huge_message_keeps_the_location():
    text = describe_exception(raised(RuntimeError("z" * 10_000_000)))
    assert len(text) <= MESSAGE_LIMIT and "characters cut" in text and re.search(r"\(at .*test_text\.py:\d+\)$", text)


def test_without_surrogates_escapes_every_string_of_a_json_value():
    record = json.loads(json.dumps({"id": "a", "message": "x\udcff", "kinds": ["\udcfe"], "k\udcff": 1.5, "n": None}))
    clean = without_surrogates(record)
    assert clean == {"id": "a", "message": "x\\udcff", "kinds": ["\\udcfe"], "k\\udcff": 1.5, "n": None}
    json.dumps(clean, ensure_ascii=False).encode("utf-8")
