"""Streaming text out of tokens: the server's incremental detokeniser with stop strings.

The server streams each choice through the engine's own
:class:`~paged_lib.engine.detokenize.IncrementalDetokenizer` (:mod:`paged_lib.engine.detokenize`
says how it works): the engine ends a sequence at a stop string with the same class, one
per sequence, so the text the engine stops on and the text a client is streamed come from
one piece of code. It lives in the engine, which must not import the server; it is named
here too, as chapter 14 and its exercise know it.
"""

from __future__ import annotations

from paged_lib.engine.detokenize import REPLACEMENT, IncrementalDetokenizer

__all__ = ["REPLACEMENT", "IncrementalDetokenizer"]
