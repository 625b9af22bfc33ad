"""ByteTokenizer: one id per UTF-8 byte, BOS/EOS above the bytes, loud errors."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from paged_lib.tokenizer import ByteTokenizer

tok = ByteTokenizer()


@settings(max_examples=100, deadline=None)
@given(st.text())
def test_text_round_trips_through_utf8_bytes(text):
    ids = tok.encode(text)
    assert ids[0] == tok.bos_id
    assert ids[1:] == list(text.encode("utf-8"))  # outside reference: Python's codec
    assert tok.decode(ids) == text


@settings(max_examples=100, deadline=None)
@given(st.binary())
def test_any_bytes_round_trip(data):
    ids = tok.encode_bytes(data, add_bos=False)
    assert all(0 <= i < 256 for i in ids)
    assert tok.decode_bytes(ids) == data
    assert tok.decode(ids) == data.decode("utf-8", errors="replace")


def test_special_ids_sit_above_the_bytes_and_are_skipped():
    assert (tok.bos_id, tok.eos_id) == (256, 257)
    assert tok.vocab_size >= 258 and tok.vocab_size % 8 == 0
    ids = tok.encode("hi", add_bos=True, add_eos=True)
    assert ids == [256, ord("h"), ord("i"), 257]
    assert tok.encode("hi", add_bos=False) == [104, 105]
    assert tok.decode(ids) == "hi"
    assert tok.decode([tok.vocab_size - 1, 104]) == "h"  # padding ids decode to nothing


def test_half_a_character_decodes_to_the_replacement_char():
    euro = "€".encode()  # 3 bytes
    assert tok.decode(list(euro[:2]) + [ord("x")]) == "\ufffdx"


def test_tensor_and_numpy_ids_decode():
    ids = tok.encode("def f():")
    assert tok.decode(torch.tensor(ids)) == "def f():"
    assert tok.decode(np.array(ids, dtype=np.int64)) == "def f():"


@pytest.mark.parametrize("bad", [-1, 264, 10_000])
def test_out_of_range_id_is_a_value_error_naming_it(bad):
    with pytest.raises(ValueError, match=rf"token id {bad} at position 1 is out of range"):
        tok.decode([104, bad])


@pytest.mark.parametrize("bad", [1.0, True, "a", None])
def test_non_integer_id_is_a_value_error(bad):
    with pytest.raises(ValueError, match="expected an int"):
        tok.decode([bad])


def test_encode_rejects_bytes_and_points_to_encode_bytes():
    with pytest.raises(ValueError, match="encode_bytes"):
        tok.encode(b"abc")
