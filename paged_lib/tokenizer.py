"""A byte-level tokenizer: every UTF-8 byte is a token, plus BOS and EOS.

Why bytes: the course's tiny model must run with nothing downloaded, so its
tokenizer has no vocabulary file and no merges. Any text encodes (there is no
"unknown" token), ids are easy to read (``ord("d") == 100``), and one token is
one byte, so the model's loss in bits per token *is* bits per byte.

Layout of the ids:

    0 ... 255   the byte values
    256         BOS (start of a sequence)
    257         EOS (end of a sequence)
    258 ... 263 unused padding, so the embedding has a multiple-of-8 rows
"""

from __future__ import annotations

import operator
from collections.abc import Iterable

NUM_BYTES = 256
BOS_ID = 256
EOS_ID = 257
VOCAB_SIZE = 264  # 258 real ids, padded to a multiple of 8


class ByteTokenizer:
    """Text <-> token ids, one id per UTF-8 byte (see the module docstring)."""

    bos_id: int = BOS_ID
    eos_id: int = EOS_ID
    vocab_size: int = VOCAB_SIZE

    # the names a real model's tokenizer uses (paged_lib.models.chat_tokenizer.ChatTokenizer)
    @property
    def bos_token_id(self) -> int:
        return self.bos_id

    @property
    def eos_token_id(self) -> int:
        return self.eos_id

    def encode(self, text: str, add_bos: bool = True, add_eos: bool = False) -> list[int]:
        """The UTF-8 bytes of ``text`` as ids, with BOS first when ``add_bos``."""
        if not isinstance(text, str):
            raise ValueError(
                f"encode expects a str, got {type(text).__name__}; "
                "for raw bytes use encode_bytes(data)"
            )
        return self.encode_bytes(text.encode("utf-8"), add_bos=add_bos, add_eos=add_eos)

    def encode_bytes(self, data: bytes, add_bos: bool = True, add_eos: bool = False) -> list[int]:
        """Raw bytes as ids (any bytes, not only valid UTF-8)."""
        if not isinstance(data, bytes | bytearray):
            raise ValueError(f"encode_bytes expects bytes, got {type(data).__name__}")
        ids = list(data)
        if add_bos:
            ids.insert(0, self.bos_id)
        if add_eos:
            ids.append(self.eos_id)
        return ids

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        """The bytes behind ``ids``; special and padding ids are skipped."""
        return bytes(i for i in self._check_ids(list(ids)) if i < NUM_BYTES)

    def decode(self, ids: Iterable[int]) -> str:
        """Text for ``ids``: special ids skipped, invalid UTF-8 shown as U+FFFD.

        A model can emit a byte sequence that is not valid UTF-8 (half of a
        multi-byte character); ``errors="replace"`` keeps decoding instead of
        raising halfway through a generation.
        """
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def _check_ids(self, ids: list) -> list[int]:
        """Plain ints for ``ids``, or a ValueError naming the first bad one."""
        out = []
        for pos, i in enumerate(ids):
            try:
                if isinstance(i, bool):  # an int subclass, but surely a bug here
                    raise TypeError
                value = operator.index(i)  # int, numpy / torch integer scalars
            except TypeError:
                raise ValueError(
                    f"token id at position {pos} is {i!r} ({type(i).__name__}); expected an int"
                ) from None
            if not 0 <= value < self.vocab_size:
                raise ValueError(
                    f"token id {value} at position {pos} is out of range: "
                    f"valid ids are 0..{self.vocab_size - 1} "
                    f"(bytes 0-255, BOS {self.bos_id}, EOS {self.eos_id})"
                )
            out.append(value)
        return out

    def __repr__(self) -> str:
        return (
            f"ByteTokenizer(vocab_size={self.vocab_size}, "
            f"bos_id={self.bos_id}, eos_id={self.eos_id})"
        )
