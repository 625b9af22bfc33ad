"""One detokenizer for the engine's stop strings and the server's stream.

The engine ends a sequence at a stop string with its own
:class:`~paged_lib.engine.detokenize.IncrementalDetokenizer` (one per sequence); the
server streams each choice through the same class (:func:`paged_lib.serve.outputs.
text_pieces`). Here the engine serves generated cases, and for every output three texts
must agree: the engine's ``text`` and ``stop_reason``, what the server's pieces join to
when it is given the same tokens one step at a time, and vLLM v1's rule computed
directly (the whole text decoded again after each token, only the new text searched).

A random tiny model draws the tokens; its "tokenizer" maps them to fragments of UTF-8,
so characters arrive split over tokens (``é`` as ``\\xc3`` then ``\\xa9``, an emoji in two
halves), and stop strings are cut out of the text the engine made without them, so they
span tokens and characters.
"""

import asyncio
import collections
import dataclasses
import random
from types import SimpleNamespace

import pytest
import torch

from paged_lib.engine import LLMEngine, SamplingParams
from paged_lib.engine.detokenize import IncrementalDetokenizer
from paged_lib.engine.sequence import Sequence, SequenceGroup, fork_samples
from paged_lib.engine.stop import StopStrings, check_stop
from paged_lib.serve.async_engine import Delta
from paged_lib.serve.outputs import Choices, text_pieces

pytestmark = pytest.mark.usefixtures("one_torch_thread")

EOS = 5
#: what each token decodes to: ASCII, whole characters, halves of é, 日 and 🎉, newlines
FRAGMENTS = [b"a", b"b", b" ", b"\n", b"\xc3", b"", b"\xa9", b"\xe6", b"\x97\xa5", b"ab",
             b"\xf0\x9f", b"\x8e\x89", "é".encode(), b"x\n", "日".encode(), b"c"]


def vocab(token: int) -> bytes:
    return b"" if token == EOS else FRAGMENTS[token % len(FRAGMENTS)]


class FragmentTokenizer:
    def decode(self, ids) -> str:
        return b"".join(vocab(t) for t in ids).decode("utf-8", errors="replace")


TOK = FragmentTokenizer()
CHECK = StopStrings(TOK.decode)  # the engine's, as LLMEngine(tokenizer=TOK) makes it


@pytest.fixture(scope="module")
def engine():
    from transformers import LlamaConfig, LlamaForCausalLM

    from paged_lib.model import TinyLlama

    torch.manual_seed(1)
    cfg = LlamaConfig(vocab_size=97, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
                      num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=256,
                      eos_token_id=EOS, bos_token_id=None)
    model = TinyLlama.from_hf(LlamaForCausalLM(cfg).float().eval())
    return LLMEngine(model, num_blocks=96, block_size=4, tokenizer=TOK)


def vllm_rule(tokens: list[int], stops: list[str], min_tokens: int
              ) -> tuple[str, str | None, int]:
    """vLLM v1's stop strings, the slow way: after each token decode everything again,
    search only the new text (and ``len(stop) - 1`` characters before it), not before
    ``min_tokens``; of the stops found, the one that completes first ends it, ties going
    to the first listed (vLLM's ``check_stop_strings``). (text, stop, tokens used)."""
    seen = ""
    for k in range(1, len(tokens) + 1):
        text = TOK.decode(tokens[:k]).rstrip("\ufffd")
        if k > min_tokens and len(text) > len(seen):
            found = [(at + len(s), j, at, s) for j, s in enumerate(stops)
                     if (at := text.find(s, max(0, len(seen) - len(s) + 1))) >= 0]
            if found:
                _, _, at, stop = min(found)
                return text[:at], stop, k
        seen = text
    return TOK.decode(tokens), None, len(tokens)


def served(choices: list[tuple[list[int], str | None]], stops: list[str], min_tokens: int
           ) -> list[dict]:
    """What the server's pieces join to: ``choices`` are each output's tokens and the
    finish reason the engine's own checks give (EOS, length), handed to
    :func:`text_pieces` a token per step as the async engine does. The server's engine
    knows no stop strings: a choice a stop string ended goes on (its later tokens are
    dropped)."""
    engine = SimpleNamespace(abort=lambda request_id, reason: None)
    longest = max(len(t) for t, _ in choices) + 3

    class Stream:  # a RequestStream's side that text_pieces reads
        request_id = 0
        params = SimpleNamespace(n=len(choices), min_tokens=min_tokens)

        async def __aiter__(self):
            for k in range(longest):
                deltas = []
                for i, (tokens, reason) in enumerate(choices):
                    if reason is None:  # a stop string ended it: the engine goes on
                        tokens, reason = tokens + [0, 3, 12], "length"
                    if k < len(tokens):
                        deltas.append(Delta(i, [tokens[k]], [0.0],
                                            reason if k == len(tokens) - 1 else None))
                if deltas:
                    yield deltas

    stream = Stream()
    out = Choices(len(choices), TOK.decode, vocab, chat=False, logprobs=False)

    async def run():
        async for piece in text_pieces(engine, stream, TOK.decode, stops):
            out.add(piece)

    asyncio.run(run())
    return out.final()


def cases(rng: random.Random, count: int = 16):
    """(prompt, params without stops, min_tokens): beams, greedy, samples (n up to 3,
    seeded)."""
    for k in range(count):
        prompt = [rng.randrange(6, 97) for _ in range(rng.randint(1, 6))]
        kind = ("beams", "greedy", "samples", "samples")[k % 4]
        max_tokens = rng.randint(8, 30)
        if kind == "beams":
            yield prompt, SamplingParams(max_tokens=max_tokens, beam_width=rng.randint(2, 3)), 0
        elif kind == "greedy":
            yield prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0), \
                rng.choice([0, 3])
        else:
            yield prompt, SamplingParams(max_tokens=max_tokens, n=rng.randint(1, 3),
                                         seed=rng.randrange(1000)), rng.choice([0, 0, 2, 5])


def stops_from(tokens: list[int], min_tokens: int, rng: random.Random) -> list[str]:
    """One to three stop strings cut out of the text of ``tokens`` (so they come, if
    nothing earlier stops it), one from the text of its first ``min_tokens`` tokens (not
    to be found there), and one that never comes."""
    text, stops = TOK.decode(tokens).replace("\ufffd", ""), []
    if min_tokens:
        early = TOK.decode(tokens[:min_tokens]).replace("\ufffd", "")
        stops.append(early[-rng.randint(1, 2):] or "never")
    for _ in range(rng.randint(1, 3)):
        at = rng.randrange(max(len(text) - 1, 1))
        stops.append(text[at:at + rng.randint(1, 3)] or "never")
    return stops + ["not in this text"]


def test_the_engines_text_is_what_the_server_streams(engine):
    """Stops spanning tokens and characters, several stops, min_tokens, n > 1 samples
    (each its own detokenizer) and beams (no stop strings: the texts still agree)."""
    rng = random.Random(2)
    seen = collections.Counter()
    for prompt, plain, min_tokens in cases(rng):
        params, stops = plain, []
        if plain.beam_width is None:
            stops = stops_from(engine.generate([prompt], plain)[0].outputs[0].token_ids,
                               min_tokens, rng)
            params = dataclasses.replace(plain, stop=stops, min_tokens=min_tokens)
        out = engine.generate([prompt], params)[0]
        server = served([(c.token_ids, None if isinstance(c.stop_reason, str)
                          else c.finish_reason) for c in out.outputs], stops, min_tokens)
        for c, s in zip(out.outputs, server, strict=True):
            story = (prompt, params, c.token_ids)
            assert (s["text"], s["finish_reason"], s["stop_reason"]) == \
                (c.text, c.finish_reason, c.stop_reason), story
            text, stop, used = vllm_rule(c.token_ids, stops, min_tokens)
            assert (c.text, c.stop_reason) == (text, stop), story
            assert used == len(c.token_ids), story  # the engine stopped where the stop came
            last = TOK.decode(c.token_ids[-1:])
            seen.update({"stop string": stop is not None,
                         "a stop spanning tokens": stop is not None and stop not in last,
                         "a stop after min_tokens": stop is not None and min_tokens > 0,
                         "several stops": len(stops) > 2 and stop is not None,
                         "length": c.finish_reason == "length",
                         "EOS": c.finish_reason == "stop" and c.stop_reason is None,
                         "multi-byte text": any(ord(ch) > 127 and ch != "\ufffd"
                                                for ch in c.text),
                         "a sample of n > 1": params.n > 1,
                         "a beam": params.beam_width is not None,
                         "a stop made within min_tokens, passed over":
                             min_tokens > 0 and len(c.token_ids) > min_tokens
                             and stops[0] in TOK.decode(c.token_ids[:min_tokens])})
    assert len(+seen) == 10, seen  # every kind of case came up


def test_a_stop_at_max_tokens_and_within_min_tokens():
    """Fed by hand through ``check_stop``: a stop completed by the last allowed token
    still stops ("stop", not "length"); one that lies wholly in the first ``min_tokens``
    tokens is never found, one that ends after them is, though it begins inside them."""
    tokens = [0, 1, 2, 4, 6, 0, 1]  # "ab " and the two halves of é, then "ab"
    for min_tokens, stop, want in [(0, "é", ("ab ", "stop", "é", 5)),
                                   (5, "é", ("ab éab", "length", None, 7)),
                                   (5, "éa", ("ab ", "stop", "éa", 6)),
                                   (6, "ab", ("ab é", "stop", "ab", 7))]:
        seq = Sequence(0, [9])
        group = SequenceGroup(0, [seq], SamplingParams(max_tokens=7, stop=[stop],
                                                       min_tokens=min_tokens))
        for t in tokens:
            seq.append(t, 0.0)
            if check_stop(seq, group, EOS, CHECK):
                break
        got = (seq.output_text, seq.finish_reason, seq.stop_reason, len(seq.output_token_ids))
        assert got == want, (min_tokens, stop)


def test_a_fork_goes_on_alone():
    """A fork shares nothing with its parent: the half character both hold and the held
    text come out of each as if it had been fed its own tokens from the start."""
    parent = IncrementalDetokenizer(TOK.decode, ["b\n", "日"], min_tokens=1)
    for t in [0, 2, 4]:  # "a ", then the first half of é
        parent.add([t])
    child = parent.fork()
    mine, theirs = [6, 3, 1, 3], [7, 8, 1]  # "é\nb\n" / "日b"
    got = [parent.add([t]) for t in mine] + [parent.finish()], \
        [child.add([t]) for t in theirs] + [child.finish()]
    for det, rest, pieces in ((parent, mine, got[0]), (child, theirs, got[1])):
        fresh = IncrementalDetokenizer(TOK.decode, ["b\n", "日"], min_tokens=1)
        want = [fresh.add([t]) for t in [0, 2, 4] + rest] + [fresh.finish()]
        assert "".join(pieces) == "".join(want[3:]) and det.stopped == fresh.stopped
        assert det.text == fresh.text
    assert (parent.text, parent.stopped, child.text, child.stopped) == \
        ("a é\n", "b\n", "a \ufffd", "日")  # its é never completes: U+FFFD


def test_a_forked_sample_starts_from_a_copy_of_its_parents_detokenizer():
    """``fork_samples``: the child's detokenizer is a fork of the parent's (the same text
    and half character so far), and each then sees only its own tokens."""
    params = SamplingParams(max_tokens=9, n=2, stop=["日"])
    parent = Sequence(0, [9], block_table=SimpleNamespace(fork=lambda: None))
    group = SequenceGroup(0, [parent], params)
    for t in [0, 2, 4]:  # "a " and the first half of é, checked as the engine does
        parent.append(t, 0.0)
        assert CHECK(parent, params) is None
    fork_samples(group, parent, [(6, 0.0)])  # the child completes é
    parent.append(7, 0.0)  # the parent starts 日
    child = group.seqs[1]
    assert child.detokenizer is not parent.detokenizer
    assert (CHECK(child, params), child.output_text) == (None, "a é")
    parent.append(8, 0.0)
    assert (CHECK(parent, params), parent.output_text) == ("日", "a \ufffd")
    assert child.detokenizer.num_tokens == 4 and child.detokenizer.stopped is None
