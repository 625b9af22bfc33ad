"""Chapter 13: each of the learner's pieces on the scenario that exercises it.

One workload that never repeats a prompt, never evicts a cached block and never meets a
budget lets a piece that is wrong in exactly those states pass. So every piece has its
scenarios here (:data:`PIECE_SCENARIOS`, keyed by the piece's name in
:data:`paged_lib.course.exercises.SAVED`): small workloads on the shipped tiny model, each
built to reach one state the engine meets (a prompt served twice, an eviction from the
LRU free queue, the token budget and the watermark met, a swap of blocks shared by
samples, ties among beams, chunked prefill after a prefix hit, ...). :func:`check_piece`
serves each with the learner's piece alone among the library's and compares, with the
library engine on the same scenario, the tokens and the schedule step by step (who ran,
how many tokens, which blocks their new tokens went to, who was preempted, the swaps and
copies, the prefix-cache hits); the first difference, or an exception, becomes a
one-line story. After its scenarios, a piece serves the random workloads its exercise's
check serves (:mod:`~paged_lib.course.demos.your_engine_random`). A new piece needs only
an entry in :data:`PIECE_SCENARIOS` (and a new :class:`Scenario` if none of
:data:`SCENARIOS` reaches its state).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

from paged_lib.course import grading
from paged_lib.course.demos import your_engine
from paged_lib.course.demos.your_engine_random import NOT_GENERATED, generated_verdict
from paged_lib.course.demos.your_engine_story import PieceDiffers, Served, difference
from paged_lib.course.exercises import SAVED
from paged_lib.engine import SamplingParams as P
from paged_lib.model import TinyLlama


@dataclass(frozen=True)
class Scenario:
    story: str               # what it serves, in a few words (quoted in the verdict)
    options: dict            # LLMEngine options, num_blocks and block_size included
    requests: tuple          # (prompt, SamplingParams, arrival step) per request
    model: str = "tiny"      # "tiny" or "tied" (three tokens with equal logits: beam ties)
    numeric: bool = False    # also each completion's log-probability (1e-5): K/V values


def _text(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(32, 127, (n,), generator=g).tolist()


def _greedy(n: int) -> P:
    return P(max_tokens=n, ignore_eos=True, temperature=0.0)


def _scenarios() -> dict[str, Scenario]:
    a, b, c = _text(1, 16), _text(2, 12), _text(3, 20)
    return {
        "samples": Scenario(
            "3 parallel samples and a beam search sharing blocks that end mid-block "
            "(copy-on-write), 2 samples more when 6 of at most 7 sequences run, 24 blocks "
            "of 4", dict(num_blocks=24, block_size=4, watermark=0, max_num_seqs=7),
            ((_text(4, 10), P(max_tokens=8, temperature=1.0, n=3, seed=1, ignore_eos=True), 0),
             (_text(5, 7), P(max_tokens=6, beam_width=3), 0),
             (_text(6, 5), P(max_tokens=6, temperature=1.0, n=2, seed=6, ignore_eos=True), 1))),
        "swap": Scenario(
            "a swap preemption of 3 samples sharing their prompt's blocks, a request "
            "arriving while they are out, 12 blocks of 4",
            dict(num_blocks=12, block_size=4, watermark=0, preemption="swap",
                 num_cpu_blocks=32),
            ((_text(7, 6), _greedy(18), 0), (_text(8, 5), _greedy(14), 1),
             (_text(9, 9), P(max_tokens=12, temperature=1.0, n=3, seed=2, ignore_eos=True), 2),
             (_text(29, 4), _greedy(4), 8))),
        "recompute": Scenario(
            "recompute preemptions of groups of 1 and 2 sequences admitted at steps 0 to 3, "
            "9 blocks of 4", dict(num_blocks=9, block_size=4, watermark=0),
            ((_text(10, 7), _greedy(9), 0),
             (_text(11, 4), P(max_tokens=9, temperature=1.0, n=2, seed=3, ignore_eos=True), 1),
             (_text(12, 3), P(max_tokens=10, temperature=1.0, n=2, seed=3, ignore_eos=True), 2),
             (_text(13, 3), _greedy(11), 3))),
        "admission": Scenario(
            "the watermark (4 of 16 blocks), the token budget (24) and the sequence limit "
            "(4) met", dict(num_blocks=16, block_size=4, watermark=0.25, max_num_seqs=4,
                            max_model_len=24, max_num_batched_tokens=24),
            tuple((_text(20 + i, n), _greedy(m), t) for i, (n, m, t) in enumerate(
                [(12, 12, 0), (10, 12, 0), (9, 6, 8), (8, 6, 8), (7, 6, 9), (14, 8, 9)]))),
        "prefix": Scenario(
            "a prompt served twice (16 tokens: the last block recomputed), one sharing its "
            "first 10 tokens and one starting with its second block, prefix caching",
            dict(num_blocks=32, block_size=4, watermark=0, enable_prefix_caching=True),
            ((a, _greedy(4), 0), (a, _greedy(4), 6), (a[:10] + _text(14, 5), _greedy(4), 6),
             (a[4:8] + _text(15, 6), _greedy(4), 7),
             (a, P(max_tokens=4, temperature=1.0, n=2, seed=5, ignore_eos=True), 12))),
        "eviction": Scenario(
            "an eviction from the LRU free queue: two prompts cached, a third needs their "
            "blocks, the later one asked again, 10 blocks of 4",
            dict(num_blocks=10, block_size=4, watermark=0, enable_prefix_caching=True),
            ((b, _greedy(2), 0), (_text(16, 12), _greedy(2), 3), (c, _greedy(2), 6),
             (_text(16, 12), _greedy(2), 9), (b, _greedy(2), 12))),
        "hit at the head": Scenario(
            "a prompt asked again when its cached blocks are the next to evict in the LRU "
            "free queue, 4 blocks of 4, prefix caching",
            dict(num_blocks=4, block_size=4, watermark=0, enable_prefix_caching=True),
            ((a[:8], _greedy(1), 0), (b[:8], _greedy(1), 2), (a[:12], _greedy(2), 4))),
        "chunked": Scenario(
            "chunked prefill under a budget of 8 tokens, after prefix hits, 20 blocks of 4",
            dict(num_blocks=20, block_size=4, watermark=0, enable_prefix_caching=True,
                 enable_chunked_prefill=True, max_num_batched_tokens=8, max_num_seqs=4),
            ((a, _greedy(5), 0), (a + _text(17, 9), _greedy(5), 1),
             (a[:8] + _text(18, 3), _greedy(5), 1))),
        "beam ties": Scenario(
            "beam searches of width 2 and 3 on a model where three tokens always tie",
            dict(num_blocks=40, block_size=4, watermark=0),
            ((_text(19, 6), P(max_tokens=6, beam_width=2), 0),
             (_text(20, 5), P(max_tokens=5, beam_width=3), 0)), model="tied"),
        "int8": Scenario(
            "int8 K/V blocks whose scales grow as tokens arrive, reused after a request "
            "ends, 9 blocks of 4",
            dict(num_blocks=9, block_size=4, watermark=0, kv_cache_dtype="int8"),
            ((_text(21, 6), _greedy(10), 0), (_text(22, 9), _greedy(8), 1),
             (_text(31, 7), _greedy(6), 14)), numeric=True),
        "window": Scenario(
            "a sliding window of 12 tokens with 2 sinks, blocks released as it slides",
            dict(num_blocks=12, block_size=4, watermark=0, sliding_window=12,
                 num_sink_tokens=2),
            ((_text(23, 6), _greedy(24), 0), (_text(24, 10), _greedy(20), 1)), numeric=True),
        "decode kernel": Scenario(
            "a greedy batch of 2 whose decode attention runs your Triton kernel "
            "(interpreted), compared with the library's attention at every call",
            dict(num_blocks=8, block_size=16, watermark=0),
            ((_text(25, 5), _greedy(6), 0), (_text(26, 19), _greedy(6), 0))),
        "tensor parallel": Scenario(
            "2 tensor-parallel ranks (gloo), each with its heads and its share of the pool",
            dict(num_blocks=16, block_size=4, watermark=0, tensor_parallel_size=2),
            ((_text(27, 6), _greedy(6), 0), (_text(28, 9), _greedy(5), 0))),
    }


#: every scenario, by name
SCENARIOS: dict[str, Scenario] = _scenarios()

#: piece name (``SAVED[ex_id].name``) -> the scenarios it is checked on
PIECE_SCENARIOS: dict[str, tuple[str, ...]] = {
    "append_token": ("samples", "swap"),
    "fork": ("samples", "swap"),
    "free_block": ("samples", "recompute"),
    "paged_decode_kernel": ("decode kernel",),
    "slot_mapping": ("prefix", "chunked"),
    "build_metadata": ("prefix", "chunked"),
    "num_required_blocks": ("admission", "recompute"),
    "can_admit": ("admission",),
    "schedule_waiting": ("admission", "samples", "swap", "chunked"),
    "swap_mapping": ("swap",),
    "choose_victim": ("recompute", "swap"),
    "preempt_until_fits": ("recompute", "swap"),
    "beam_step": ("beam ties", "samples"),
    "block_hashes": ("prefix",),
    "longest_cache_hit": ("prefix", "chunked"),
    "LRUFreeQueue": ("eviction", "hit at the head"),
    "allocate_slots": ("prefix", "hit at the head", "chunked"),
    "write_int8_blocks": ("int8",),
    "drop_oldest": ("window",),
    "rank_attention": ("tensor parallel",),
}


def missing() -> list[str]:
    """Exercise ids of saved pieces with no scenario (a test keeps this empty)."""
    return [ex for ex, piece in SAVED.items() if piece.name not in PIECE_SCENARIOS]


# ------------------------------------------------------------------ serving, traced

def record(out, stats, steps: list[dict]) -> None:
    steps.append({
        "ran": [(sc.group.request_id, sc.seq.seq_id, sc.num_new_tokens,
                 "prefill" if sc.is_prefill else "decode", [s.block for s in sc.slots])
                for sc in out.scheduled],
        "preempted": [g.request_id for g in out.preempted],
        "swapped out": list(out.swap_out), "swapped in": list(out.swap_in),
        "copied": list(out.blocks_to_copy),
        "prefix-cache hit tokens": out.prefix_cache_hit_tokens,
        "blocks in use": stats.blocks_used[-1]})


@functools.cache
def tied_model() -> TinyLlama:
    """The shipped tiny model with tokens 101, 120 and 121 made one: the same embedding
    row (tied with the LM head), twice as long as token 101's, so after almost any text
    the three are the likeliest and tie exactly, and beams that differ only in them tie
    again at every later step."""
    from paged_lib.model import load_tiny_code_llama

    model = load_tiny_code_llama()
    with torch.no_grad():
        row = model.lm_head.weight[101] * 2
        for token in (101, 120, 121):
            model.lm_head.weight[token] = row
            model.embed_tokens.weight[token] = row
    return model


@functools.cache
def _model(name: str) -> TinyLlama:
    from paged_lib.model import load_tiny_code_llama

    return tied_model() if name == "tied" else load_tiny_code_llama()


def serve(scenario: Scenario, pieces: dict[str, Any], kernel: Any = None,
          steps: list[dict] | None = None) -> Served:
    """``scenario`` on an engine of ``pieces`` (the library's for the rest); ``steps``
    receives each step's record as it runs (what ran before an exception, too)."""
    opts = dict(scenario.options)
    steps = [] if steps is None else steps
    engine = your_engine.build(_model(scenario.model), opts.pop("num_blocks"),
                               opts.pop("block_size"), pieces, attention_backend="torch",
                               on_step=lambda out, stats: record(out, stats, steps), **opts)
    prompts, params, arrivals = (list(x) for x in zip(*scenario.requests, strict=True))
    try:
        with your_engine.your_decode_kernel(kernel, compare=kernel is not None):
            outputs = engine.generate(prompts, params, arrivals)
    finally:
        engine.close()
    return Served([[c.token_ids for c in o.outputs] for o in outputs], steps,
                  [[c.cumulative_logprob for c in o.outputs] for o in outputs])


@functools.cache
def library(name: str) -> Served:
    return serve(SCENARIOS[name], {})


# ------------------------------------------------------------------ the story

def _compared_cache_hit(fn: Any) -> Any:
    """10.2 beside the library's on every call: a difference is told in 10.2's words,
    before 10.4's allocation (which takes the hit) can fail on it in its own."""
    from paged_lib.engine.prefix_cache import longest_cache_hit

    def hit(hashes, lookup, num_tokens, block_size):
        got = fn(list(hashes), lookup, num_tokens, block_size)
        want = longest_cache_hit(list(hashes), lookup, num_tokens, block_size)
        if list(got) != list(want):
            cached = next((i for i, h in enumerate(hashes) if lookup(h) is None), len(hashes))
            raise PieceDiffers(
                f"longest_cache_hit (10.2) for a text of {num_tokens} tokens (blocks of "
                f"{block_size}) whose first {cached} blocks are cached returned blocks "
                f"{list(got)}, the library's {list(want)}: the leading cached blocks, at "
                f"most (num_tokens - 1) // block_size = {max(num_tokens - 1, 0) // block_size}"
                " of them (the last token is computed again for its logits)")
        return got
    return hit


#: what the model says when it read NaN (a block nobody wrote) and then sampled from it
_NAN_SAMPLED = "probability tensor contains either `inf`, `nan` or element < 0"
_COPIED = ("the library copied blocks (source, destination) {want} for copy-on-write, yours "
           "{got}: a sequence wrote into a new block without the shared block's tokens "
           "copied into it (Slot's copy), so the model read a block nobody wrote")


def _story(scenario: Scenario, key: str, got: Served, err: Exception | None) -> str | None:
    """The first difference of a run (cut short by ``err``, if any) from the library's."""
    want = library(key)
    for i, (w, g) in enumerate(zip(want.steps, got.steps, strict=False)):
        if w != g:  # the first step that differs: in its copies only, a missed copy
            if w["copied"] != g["copied"] and w["ran"] == g["ran"]:
                if [tuple(c) for c in g["copied"]] == w["copied"]:  # the copies, not tuples
                    return (f"at engine step {i}, Slot's copy: the library gives (source, "
                            f"destination) tuples {w['copied']}, yours {g['copied']}")
                return f"at engine step {i}, " + _COPIED.format(want=w["copied"],
                                                                 got=g["copied"])
            break
    if err is None:
        return difference(want, got, scenario.numeric)
    partial = Served([], got.steps[:len(want.steps)])
    what = difference(Served([], want.steps[:len(partial.steps)]), partial)
    text = your_engine.error_line(err)
    at = len(got.steps)  # the step that raised (not recorded)
    if _NAN_SAMPLED in text and what is None and at < len(want.steps) \
            and want.steps[at]["copied"]:
        return (f"at engine step {at}, the model read NaN (its logits were NaN) where the "
                f"library copies blocks (source, destination) {want.steps[at]['copied']} "
                "for copy-on-write: a sequence wrote into a new block without the shared "
                "block's tokens copied into it (Slot's copy), then read that block")
    if _NAN_SAMPLED in text:
        text = "the model's logits were NaN: it read K/V from a slot nobody wrote"
    elif not isinstance(err, PieceDiffers):
        text = f"raised {type(err).__name__}: {text[:300]}"
    return f"{what}; then {text}" if what is not None else text


#: seconds one piece's check may take (a right piece's: a few, a first Triton compile
#: included) before it is named as a loop that never ends
PIECE_TIME_LIMIT_S = 300.0


class StillRunning(BaseException):
    """A piece's check ran past :data:`PIECE_TIME_LIMIT_S` (not an ``Exception``: the
    handlers of a learner's exception, here and in the random stage, let it through)."""


def _still_running() -> None:
    raise StillRunning


def check_piece(ex_id: str, obj: Any) -> str | None:
    """None if ``obj`` (exercise ``ex_id``'s saved piece) serves each of its scenarios as
    the library does; else what went wrong, in one line. Remembered per piece object
    (:func:`verdict_of`)."""
    name = SAVED[ex_id].name
    if name not in PIECE_SCENARIOS:
        return f"no scenario checks {name} yet (paged_lib.course.demos.your_engine_scenarios)"
    kernel = obj if name == "paged_decode_kernel" else None
    pieces: dict[str, Any] = {} if kernel is not None else {
        ex_id: _compared_cache_hit(obj) if ex_id == "10.2" else obj}
    verdict, where, steps = None, "random workloads", []
    try:
        with grading.time_limit(PIECE_TIME_LIMIT_S, _still_running):
            for key in PIECE_SCENARIOS[name]:
                scenario, steps = SCENARIOS[key], []
                where = scenario.story
                try:
                    got, err = serve(scenario, pieces, kernel, steps), None
                except your_engine.AttentionDiffers as caught:
                    verdict = f"on {scenario.story}: {caught}"
                    break
                except Exception as caught:  # noqa: BLE001 - a learner's bug: a line
                    got, err = Served([], steps), caught
                if (what := _story(scenario, key, got, err)) is not None:
                    verdict = f"on {scenario.story}: {what[:400]}"
                    break
            if verdict is None and kernel is not None:
                where, steps = your_engine.PADDED_GROUP, []
                verdict = your_engine.check_padded_group(kernel)
            if verdict is None and ex_id not in NOT_GENERATED:
                where, steps = "random workloads", []
                verdict = generated_verdict(ex_id, obj, pieces.get(ex_id, obj))
    except StillRunning:
        at = f" at engine step {len(steps)}" if steps else ""
        verdict = (f"on {where}: still running{at} after {PIECE_TIME_LIMIT_S:.0f} s (a right "
                   f"{name} is checked in seconds): a loop of yours that never ends?")
    your_engine.VERDICTS[ex_id, id(obj)] = (obj, verdict)
    return verdict


def verdict_of(ex_id: str, obj: Any) -> str | None:
    """:func:`check_piece`'s verdict on ``obj``, checked now if it was not yet."""
    known = your_engine.VERDICTS.get((ex_id, id(obj)))
    return known[1] if known is not None and known[0] is obj else check_piece(ex_id, obj)


def check_pieces(pieces: dict[str, Any]) -> list[tuple[str, str | None]]:
    """``(exercise id, None or what went wrong)`` for each of the learner's pieces, in
    exercise order; prints one line per piece."""
    found = []
    for ex_id in sorted(pieces):
        verdict = check_piece(ex_id, pieces[ex_id])
        name = SAVED[ex_id].name
        scenarios = ", ".join(PIECE_SCENARIOS.get(name, ()))
        if ex_id not in NOT_GENERATED:
            scenarios += " and random workloads"
        print(f"✅ your {ex_id} {name}: as the library on {scenarios}" if verdict is None
              else f"❌ your {ex_id} ({SAVED[ex_id].role}) {verdict}")
        found.append((ex_id, verdict))
    return found
