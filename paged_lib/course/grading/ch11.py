"""Chapter 11 (the KV landscape): 11.1, 11.2 and 11.4 on fixed cases, then generated ones
(11.4: windowed workloads served); 11.3 in :mod:`~paged_lib.course.grading.ch11_quant`. A
wrong answer is named by the mistake (``reference_levels``' or ``reference_drop``'s keyword).
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from paged_lib.accounting import (
    DEEPSEEK_SPECS,
    SPECS,
    ModelSpec,
    get_spec,
    kv_bytes_per_token,
    mha_equivalent,
)
from paged_lib.blocks import BlockAllocator, BlockTable
from paged_lib.course import grading
from paged_lib.course.grading import generated
from paged_lib.course.grading.ch11_quant import check_write_int8_blocks
from paged_lib.course.grading.generated import numeric, small_counts
from paged_lib.course.grading.generated.small_attention import rng
from paged_lib.engine.window import WindowOp
from paged_lib.util import cdiv

__all__ = ["DEPLOYMENT", "LEVELS", "check_drop_oldest", "check_kv_bytes_per_token",
           "check_kv_levels", "check_write_int8_blocks", "reference_drop", "reference_levels"]


#: The names of 11.1's four numbers, in order.
LEVELS = ("baseline", "fewer bytes per token", "fewer tokens", "paged layout")

# ------------------------------------------------------------------ 11.1 kv_levels


#: The chapter's deployment (the exercise notebook's demo serves it).
DEPLOYMENT = dict(spec="llama-3-8b", max_len=8192, kv_dtype_bytes=1, block_size=16,
                  window=1020, sinks=4)


def reference_levels(spec: ModelSpec, lengths: Sequence[int], max_len: int,
                     kv_dtype_bytes: int, block_size: int, window: int | None, sinks: int,
                     *, base_heads: str = "mha", base_dtype: str = "fp16", own: str = "own",
                     with_sinks: bool = True, cap: bool = True, blocks: str = "ceil",
                     paged_tokens: str = "kept", zero_window: bool = True,
                     per_dtype: str = "kv", reserve: str = "keep", base_len: str = "max_len"
                     ) -> tuple:
    """The four levels, or (with a keyword changed) what one typical mistake gives."""
    base = {"mha": mha_equivalent(spec), "own": spec,
            "hidden": dataclasses.replace(mha_equivalent(spec),
                                          head_dim=spec.hidden_size // spec.num_heads)}[base_heads]
    base = base.with_dtype({"fp16": 2, "kv": kv_dtype_bytes, "model": spec.dtype_bytes}[base_dtype])
    per = (spec if own == "own" else mha_equivalent(spec)).with_dtype(
        kv_dtype_bytes if per_dtype == "kv" else spec.dtype_bytes)
    b_base, b_per = kv_bytes_per_token(base), kv_bytes_per_token(per)
    keep = max_len if window is None or (window == 0 and not zero_window) \
        else window + (sinks if with_sinks else 0)
    keep = min(keep, max_len) if cap else keep
    kept = {"kept": [min(n, keep) for n in lengths], "all": list(lengths),
            "max_len": [max_len] * len(lengths), "reserved": [keep] * len(lengths),
            "sinks_on_top": [min(n, max_len if window is None else window)
                             + (0 if window is None else sinks) for n in lengths],
            "past_window": [n if window is None or n <= window else keep for n in lengths],
            }[paged_tokens]
    slots = {"ceil": lambda n: cdiv(n, block_size) * block_size, "exact": lambda n: n,
             "floor": lambda n: n // block_size * block_size, "batch": lambda n: n,
             "count": lambda n: cdiv(n, block_size),
             "split": lambda n: n if window is None else cdiv(min(n, sinks), block_size)
             * block_size + cdiv(n - min(n, sinks), block_size) * block_size}[blocks]
    held = sum(slots(n) for n in kept)
    if blocks == "batch":  # the batch's tokens rounded up once, as if blocks were shared
        held = cdiv(held, block_size) * block_size
    reserved = len(lengths) * keep if reserve == "keep" else sum(min(n, keep) for n in lengths)
    tokens = len(lengths) * max_len if base_len == "max_len" else sum(lengths)
    return tokens * b_base, tokens * b_per, reserved * b_per, held * b_per


#: level index (23: levels 2 and 3) -> (the mistakes, as keywords of reference_levels, that
#: break one rule; its hint)
_LEVEL_SLIPS: list[tuple[int, list[dict], str]] = [
    (0, [dict(base_heads="own")], "the baseline is plain MHA: one KV head per query head "
     "(accounting.mha_equivalent), not the model's own GQA/MQA/MLA"),
    (0, [dict(base_heads="hidden")], "the baseline's MHA has num_heads heads of head_dim "
     "(accounting.mha_equivalent): 2 x layers x hidden_size is that only where head_dim is "
     "hidden_size / num_heads, and this model's is not"),
    (0, [dict(base_dtype="kv"), dict(base_dtype="model")], "the baseline is fp16 (2 bytes "
     "per value, with_dtype(2)) whatever the model spec's own dtype_bytes: the KV dtype is "
     "a saving, counted in the next level"),
    (10, [dict(base_len="sum")], "the first two levels reserve max_len tokens per request "
     "(before its length is known, as without paging), not the tokens it really has"),
    (1, [dict(own="mha")], "fewer bytes per token uses the model's own attention (its KV "
     "heads or its latent) as well as the KV dtype"),
    (1, [dict(per_dtype="model")], "fewer bytes per token stores each value in the "
     "deployment's KV dtype (kv_dtype_bytes), not in the model spec's own dtype_bytes"),
    (2, [dict(reserve="kept")], "fewer tokens is still a reservation made before a "
     "request's length is known: every request reserves the most the window lets it keep; "
     "what each request really holds is the paged layout's level"),
    (23, [dict(with_sinks=False)], "the sinks are kept too: a request keeps window + sinks tokens"),
    (2, [dict(cap=False)], "a request never needs more than max_len tokens, however long "
     "the window is"),
    (2, [dict(zero_window=False)], "a window of 0 keeps only the sinks: test `window is "
     "None`, not `not window` (0 is falsy)"),
    (3, [dict(blocks=b) for b in ("floor", "exact", "count")], "paging holds whole blocks: "
     "ceil(kept / block_size) blocks of block_size slots each, the partly filled last block "
     "a whole block too: round up"),
    (3, [dict(blocks="batch")], "a block holds one request's tokens: each request rounds up "
     "to whole blocks on its own, not the batch's total once"),
    (3, [dict(blocks="split")], "a request's kept tokens, sinks and window together, are "
     "packed into its whole blocks: ceil(kept / block_size), not the sinks' blocks plus "
     "the window's"),
    (3, [dict(paged_tokens=t) for t in ("all", "max_len", "reserved")], "the levels stack: "
     "paging holds what each request really has (its length, cut by the window), not a "
     "max_len reservation, not a reservation of window + sinks"),
    (3, [dict(paged_tokens="sinks_on_top"), dict(paged_tokens="past_window")], "a request "
     "keeps min(length, window + sinks) tokens: the sinks are its own first tokens, not its "
     "last window plus sinks on top, and one longer than the window by fewer than sinks "
     "tokens keeps its own length, not window + sinks (more tokens than it has)"),
]


def _run_levels(fn: Callable, args: tuple, what: str, named: list | None = None) -> None:
    """11.1 on ``args`` (reference_levels'). With ``named`` (the first generated pass) a wrong
    level counts only where one mistake explains it, and only the one in ``named`` once set."""
    spec, lengths, max_len, dtype_b, b, window, sinks = args
    what, given = what and f"{what}: ", list(lengths)
    got = fn(spec, given, max_len=max_len, kv_dtype_bytes=dtype_b, block_size=b,
             window=window, sinks=sinks)
    grading.expect_true(given == list(lengths), f"{what}your function changed lengths",
                        "read the lengths, do not change them")
    grading.expect_true(isinstance(got, tuple | list) and len(got) == 4,
                        f"{what}expected a tuple of 4 byte counts, got {got!r}",
                        "return (baseline, fewer bytes per token, fewer tokens, paged layout)")
    want = reference_levels(*args)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        level = f"{what}{LEVELS[i]}"
        grading.expect_int(g, level)
        if g != w:
            hits = dict.fromkeys(h for j, kws, h in _LEVEL_SLIPS for kw in kws
                                 if str(i) in str(j) and reference_levels(*args, **kw)[i] == g)
            if not hits and abs(g - w) <= w * 2.0**-20:
                hits = {"off in the low digits only: a float32 (numpy or torch) keeps 24 "
                        "bits, so a count computed in it and cast back loses the rest; stay "
                        "in Python ints": None}
            hint = next(iter(hits), "each level keeps the savings of the ones before it; "
                        "see the spec for what each counts")
            if named is not None:
                if len(hits) != 1 or named[:1] not in ([], [hint]):
                    return
                named[:] = [hint]
            grading.fail(f"{level}: expected {w:,} bytes, got {g:,}", hint)


#: 11.1's generated models: accounting's (GQA, MQA, MHA, MLA), two in fp32, and the
#: published configurations of 11.2's stage (head sizes not hidden / heads, MLA)
_MODELS = [*SPECS.values(), *DEEPSEEK_SPECS.values(), SPECS["llama-2-7b"].with_dtype(4),
           ModelSpec("toy-gqa-fp32", 5, 48, 6, 2, 8, dtype_bytes=4), *(
    ModelSpec(name, n, size, heads, kv, d, dtype_bytes=4 if i % 3 == 0 else 2,
              kv_lora_rank=latent, qk_rope_head_dim=rope)
    for i, (name, n, size, heads, kv, d, latent, rope) in enumerate(small_counts.MODELS))]


@dataclass(frozen=True)
class Levels:
    """One generated case of 11.1."""

    seed: int
    model: int
    lengths: tuple[int, ...]
    max_len: int
    dtype_b: int
    block_size: int
    window: int | None
    sinks: int

    def args(self) -> tuple:
        return (_MODELS[self.model], list(self.lengths), self.max_len, self.dtype_b,
                self.block_size, self.window, self.sinks)

    def describe(self) -> str:
        s = _MODELS[self.model]
        return (f"{s.name} ({s.attention}, {s.dtype_bytes} B), lengths {list(self.lengths)}, "
                f"max_len {self.max_len}, {self.dtype_b} B per value, blocks of "
                f"{self.block_size}, window {self.window}, sinks {self.sinks}")

    def states(self) -> list[str]:
        """What this case reaches that the named cases do not (``tools/grading_report.py``)."""
        s, w, n = _MODELS[self.model], self.window, self.lengths
        return numeric.reached(
            (f"{s.attention} in {({1: 'fp8', 2: 'fp16', 4: 'fp32'})[self.dtype_b]}", True),
            ("model in fp32", s.dtype_bytes == 4), ("no window", w is None),
            ("window of 0", w == 0), ("window past max_len", w is not None and w >= self.max_len),
            ("length at the window", bool(w) and w in n),
            ("past the window by at most sinks", w is not None and any(
                w < x <= w + self.sinks for x in n)))

    def smaller(self) -> Iterator[Levels]:
        n = self.lengths
        for i in range(len(n) if len(n) > 1 else 0):
            yield dataclasses.replace(self, lengths=n[:i] + n[i + 1:])
        for i, x in enumerate(n):
            for v in numeric.shorter(x):
                yield dataclasses.replace(self, lengths=(*n[:i], v, *n[i + 1:]))
        yield from numeric.fewer(self, model=[0] if self.model else [],
                                 dtype_b=[2] if self.dtype_b != 2 else [])


def _draw_levels(seed: int) -> Levels:
    pick = rng(1101 + seed)
    max_len = pick([1, 7, 64, 100, 300, 2048, 4096, 8192, 65537, 131072, 200003])
    window = pick([None, 0, 1, 4, 12, max_len // 3, max_len - 1, max_len, 2 * max_len + 1])
    sinks = pick([0, 0, 1, 3, 4, 8])
    w = max_len if window is None else window
    near = [1, w - 1, w, w + 1, w + max(sinks // 2, 1), w + sinks, max_len, max_len - 1]
    lengths = tuple(min(max(1, pick(near)), max_len) for _ in range(pick([1, 2, 3, 4, 5])))
    return Levels(seed, pick(range(len(_MODELS))), lengths, max_len, pick([1, 2, 4]),
                  pick([1, 3, 7, 12, 16, 100, 256]), window, sinks)


def level_cases(count: int = 120) -> list[Levels]:
    """11.1's generated cases (seeds 0, 1, ...), those with a window of 0 last: there a
    `not window` mistake keeps every token, which hides what else is wrong."""
    return sorted((_draw_levels(seed) for seed in range(count)), key=lambda p: p.window == 0)


def check_kv_levels(fn: Callable[..., Any]) -> None:
    """11.1: the deployment's KV bytes after each level of saving: the spec's example,
    then the generated cases."""
    with grading.exercise("11.1"):
        _run_levels(fn, (get_spec("llama-3-8b"), [1000], 2048, 1, 16, 500, 4),
                    "llama-3-8b, lengths [1000], max_len 2048, 1 B per value, blocks of 16, "
                    "window 500, sinks 4 (the spec's example)")
        named: list[str] = []  # first the cases one mistake explains, then any
        for keep in (named, None):
            numeric.check("11.1", level_cases(),
                          lambda p, keep=keep: _run_levels(fn, p.args(), "", keep))


# ------------------------------------------------------------ 11.2 kv_bytes_per_token

def _bytes_cases() -> list[ModelSpec]:
    # fp32 toys first: at 2 bytes per value a forgotten dtype_bytes and a forgotten K/V pair
    # give the same wrong number, at 4 they do not, so the hint can name the slip
    return [ModelSpec("toy-gqa", 5, 48, 6, 2, 8, dtype_bytes=4),
            ModelSpec("toy-mla", 3, 32, 4, 4, 8, dtype_bytes=4, kv_lora_rank=16,
                      qk_rope_head_dim=4),
            ModelSpec("toy-mla-no-rope", 2, 32, 4, 4, 8, kv_lora_rank=24),
            *SPECS.values(), *DEEPSEEK_SPECS.values(), SPECS["llama-2-70b"].with_dtype("fp8"),
            DEEPSEEK_SPECS["deepseek-v2"].with_dtype("fp8")]


def _bytes_slips(s: ModelSpec) -> list[tuple[int, str]]:
    """What typical mistakes return for ``s``, each with the hint that names it."""
    n, b, heads = s.num_layers, s.dtype_bytes, 2 * s.num_layers * s.head_dim * s.dtype_bytes
    if not s.kv_lora_rank:
        return [(s.num_heads * heads, "count KV heads (num_kv_heads), not query heads: queries "
                 "are never cached"),
                (s.num_kv_heads * heads // 2, "K and V: multiply by 2"),
                (s.num_kv_heads * heads // b, "bytes, not numbers: multiply by dtype_bytes")]
    latent, rope = s.kv_lora_rank, s.qk_rope_head_dim
    return [
        (2 * n * (latent + rope) * b, "the latent is stored once per layer: K and V are both "
         "rebuilt from it, so there is no factor 2"),
        (n * (latent + s.num_heads * rope) * b, "the RoPE key is one qk_rope_head_dim-wide "
         "vector per layer, shared by every head"),
        (n * latent * b, "the RoPE key (qk_rope_head_dim wide) is cached beside the latent"),
        (s.num_kv_heads * heads, "MLA caches the latent (kv_lora_rank) and the RoPE key per "
         "layer, not every head's K and V"),
        ((latent + rope) * b, "every layer caches its own latent: multiply by num_layers"),
        (n * (latent + rope), "bytes, not numbers: multiply by dtype_bytes"),
        (n * (latent + 2 * rope) * b, "the decoupled RoPE key has no value beside it: values "
         "are rebuilt from the latent"),
        (s.num_kv_heads * n * (latent + rope) * b, "the latent and the RoPE key are one per "
         "token and layer, shared by all heads: not one per KV head"),
    ]


def check_kv_bytes_per_token(fn: Callable[[ModelSpec], Any]) -> None:
    """11.2: bytes per token for any attention, MLA included."""
    with grading.exercise("11.2"):
        for s in _bytes_cases():
            what = (f"{s.name} ({s.attention}, {s.dtype_bytes} B per value"
                    + (f", latent {s.kv_lora_rank}, RoPE key {s.qk_rope_head_dim}"
                       if s.kv_lora_rank else "") + ")")
            got = fn(s)
            grading.expect_int(got, what)
            want = kv_bytes_per_token(s)
            if got != want:
                hint = next((h for v, h in _bytes_slips(s) if v == got and v != want),
                            "MHA/GQA/MQA: 2 x layers x KV heads x head_dim x bytes; MLA: "
                            "layers x (latent + RoPE key) x bytes")
                grading.fail(f"{what}: expected {want:,} bytes, got {got:,}", hint)
        small_counts.token_stage(fn)  # generated: real models, head_dim not hidden / heads


# ------------------------------------------------------------------ 11.4 drop_oldest

def reference_drop(table: BlockTable, num_sink_tokens: int, *, gone: str = "floor",
                   copy: str = "partial", rotate: str = "new", shift: int = 1,
                   free: bool = True, check_shared: str = "after", check_short: bool = True,
                   free_first: bool = False) -> tuple[BlockTable, WindowOp]:
    """The release (defaults: the library's rule); a keyword changed: what one typical mistake
    does. ``gone="last_sink"``: the last sink's block goes, its sinks copied on;
    ``free_first``: the block is freed before the shared check (which then sees a changed pool)."""
    bs, sinks, pool = table.block_size, num_sink_tokens, table.allocator
    if check_short and table.num_tokens < sinks + bs:
        raise ValueError("too short")
    blocks = table.blocks
    g = {"floor": sinks // bs, "ceil": -(-sinks // bs), "first": 0,
         "last_sink": max(0, (sinks - 1) // bs)}[gone]
    if free and free_first:
        pool.free(blocks[g])
    looked = {"after": blocks[g:], "all": blocks, "none": [],
              "rewritten": blocks[g + 1:]}[check_shared]
    if any(pool.refcount(b) > 1 for b in looked):
        raise ValueError("shared")
    kept = blocks[:g] + blocks[g + 1:]
    new = BlockTable(pool, bs, kept, table.num_tokens - bs)
    if free and not free_first:
        pool.free(blocks[g])
    source = kept if rotate in ("new", "sorted") else blocks
    first = {"new": sinks, "sorted": sinks, "old": sinks, "all": 0, "copied": g * bs}[rotate]
    slots = tuple((sorted if rotate == "sorted" else list)(
        source[x // bs] * bs + x % bs for x in range(first, new.num_tokens)))
    r = sinks - g * bs if gone == "last_sink" else sinks % bs
    if copy == "partial" and r or copy == "always":
        return new, WindowOp(slots, shift * bs, blocks[g], blocks[g + 1], r or bs)
    return new, WindowOp(slots, shift * bs)


#: one hint per rule, with the typical mistakes (reference_drop's keywords) that break it
_DROP_RULES: list[tuple[list[dict], str]] = [
    ([dict(check_shared="all"), dict(check_shared="rewritten"), dict(check_shared="none")],
     "a block from the released one on that another sequence holds (reference count > 1) "
     "is a ValueError: dropping rewrites it for every holder, and the released block counts "
     "too (its holder shares this table's tokens); only those blocks are rewritten: a "
     "shared sink block before it is fine"),
    ([dict(gone="first"), dict(gone="ceil"), dict(gone="last_sink")], "the block at logical "
     "index num_sink_tokens // block_size goes, the one holding the oldest recent token "
     "(position num_sink_tokens): the sinks are never released, whole sink blocks stay where "
     "they are, and its first num_sink_tokens % block_size slots are sinks, copied on "
     "before it goes (not the first block after every sink)"),
    ([dict(copy="never"), dict(copy="always")], "when num_sink_tokens % block_size = r > 0, "
     "the released block holds r sinks: copy them to the first r slots of the next block "
     "(copy_src, copy_dst, copy_len); with whole sink blocks (r = 0) nothing is copied: "
     "copy_src = copy_dst = -1, copy_len = 0"),
    ([dict(rotate="old"), dict(rotate="copied"), dict(rotate="all"), dict(rotate="sorted")],
     "rotate_slots are the slots of the kept tokens in the NEW table (each recent token moved "
     "one logical block back), from position num_sink_tokens on, in the order of their new "
     "positions (not sorted by slot): the sinks keep their positions, and "
     "the sinks copied on into the next block keep their positions too (only moved)"),
    ([dict(shift=-1)], "shift is block_size: the model runner rotates the keys by -shift "
     "positions"),
    ([dict(free=False)], "the released block goes back to the allocator (allocator.free: "
     "one reference dropped): without it every window step leaks a block"),
    ([dict(free_first=True)], "a ValueError changes nothing: look at every block the drop would "
     "touch before freeing one (the pool after your ValueError is not the pool before it)"),
    ([dict(check_short=False)], "a table of fewer than num_sink_tokens + block_size tokens "
     "has no block of recent tokens to drop: ValueError"),
]


# ------------------------------------------------------------------ states and answers

#: 11.4's named states: (what, the table's blocks, its tokens, block size, sinks, the blocks
#: another sequence holds too), on a pool of 12 blocks freed in the order of _FREED
_EDGES: list[tuple[str, list[int], int, int, int, tuple[int, ...]]] = [
    ("the spec's example", [7, 3, 5], 11, 4, 2, ()),
    ("no sinks", [4, 1, 6], 12, 4, 0, ()),
    ("sinks filling one block", [2, 5, 8], 10, 4, 4, ()),
    ("sinks filling two blocks", [0, 1, 2, 3], 14, 4, 8, ()),
    ("more sinks than a block (6 sinks, blocks of 4)", [9, 4, 7, 1], 15, 4, 6, ()),
    ("exactly sinks + one block of tokens", [3, 8], 6, 4, 2, ()),
    ("exactly sinks + one block, whole sink block", [1, 2], 8, 4, 4, ()),
    ("a block size of 1 and 3 sinks", [5, 6, 7, 8, 9], 5, 1, 3, ()),
    ("blocks of 2 and 3 sinks", [4, 9, 2, 6], 8, 2, 3, ()),
    ("a sink block shared with another sequence (never rewritten)", [6, 2, 9], 10, 4, 4, (6,)),
    ("a block after the sinks shared with another sequence", [6, 2, 9], 10, 4, 2, (2,)),
    ("the block to release shared with another sequence (4 sinks, blocks of 4)", [6, 2, 9],
     10, 4, 4, (2,)),
    ("a table too short to drop a block (5 tokens, 2 sinks, blocks of 4)", [4, 7], 5, 4, 2, ()),
]
_FREED = (5, 0, 11, 2, 9, 4, 10, 1, 8, 3, 6, 7)
_PARTS = ("the new table's blocks", "its number of tokens", *(
    f"the WindowOp's {f}" for f in ("rotate_slots", "shift", "copy_src", "copy_dst",
                                    "copy_len")), "the reference counts", "the free list")


def _table(edge: tuple) -> BlockTable:
    _, blocks, num_tokens, block_size, _, shared = edge
    pool = BlockAllocator(12)
    pool.ref_counts = [(b in blocks) + (b in shared) for b in range(12)]
    pool.free_block_ids = deque(b for b in _FREED if not pool.ref_counts[b])
    return BlockTable(pool, block_size, blocks, num_tokens)


def _answer(fn: Callable, edge: tuple, **slip: Any) -> tuple:
    """What ``fn`` does on the edge's state: ("ValueError", ref counts, free list), or one value
    per part of :data:`_PARTS` (an unread shift or copy source/destination as the defaults)."""
    table = _table(edge)
    pool = table.allocator
    try:
        out = fn(table, edge[4], **slip)
    except ValueError:
        return ("ValueError", list(pool.ref_counts), list(pool.free_block_ids))
    if not (isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], WindowOp)
            and hasattr(out[0], "blocks") and hasattr(out[0], "num_tokens")):
        return (f"{repr(out)[:120]} (not a (table, WindowOp) pair)",)
    (new, op), copied = out, out[1].copy_len != 0
    rot = tuple(op.rotate_slots)
    return (list(new.blocks), new.num_tokens, rot, op.shift if rot else 0,
            op.copy_src if copied else -1, op.copy_dst if copied else -1, op.copy_len,
            list(pool.ref_counts), list(pool.free_block_ids))


def _show(ans: tuple, blocks: list[int]) -> str:
    if len(ans) < len(_PARTS):
        return "a ValueError" if ans[0] == "ValueError" else ans[0]
    new, n, rot, shift, src, dst, length, refs, free = ans
    copy = f"copy {length} slot(s) of block {src} into block {dst}" if length else "no copy"
    return (f"table {new} of {n} tokens; rotate the keys at slots {list(rot)}, shift "
            f"{shift}; {copy}; reference counts {[refs[b] for b in blocks]} on {blocks} "
            f"and free list {free} after")


def _slip_answer(edge: tuple, slip: dict) -> tuple | None:
    try:  # a slip that skips a check may index past the table: None, not the learner's error
        return _answer(reference_drop, edge, **slip)
    except Exception:  # noqa: BLE001
        return None


def _compare(fn: Callable, edge: tuple) -> None:
    want, got = _answer(reference_drop, edge), _answer(fn, edge)
    if got == want:
        return
    where, blocks, num_tokens, block_size, sinks, shared = edge
    parts = [p for p, g, w in zip(_PARTS, got, want, strict=True) if g != w] \
        if len(got) == len(want) == len(_PARTS) else []
    hint = next((h for slips, h in _DROP_RULES for slip in slips
                 if _slip_answer(edge, slip) == got), None) or (
        ", ".join(parts) + " differ(s) from the library's: compare them above with what the "
        "model runner does with each field" if parts else "return (the new BlockTable, a "
        "WindowOp)" if "ValueError" not in (got[0], want[0]) else "a ValueError is due where the "
        "table holds fewer than num_sink_tokens + block_size tokens or a block from the released "
        "one on is shared, and it changes nothing (the pool after it is the pool before it)")
    grading.fail(f"{where}: a table of {num_tokens} tokens on blocks {blocks} (block size "
                 f"{block_size}), {sinks} sink token(s)" + (
                     f", blocks {list(shared)} held by another sequence too" if shared else "")
                 + f", free list {list(_table(edge).allocator.free_block_ids)}; the library "
                 f"answers {_show(want, blocks)}, yours {_show(got, blocks)}", hint)


def check_drop_oldest(fn: Callable[..., Any]) -> None:
    """11.4: ``drop_oldest(table, num_sink_tokens) -> (BlockTable, WindowOp)``."""
    with grading.exercise("11.4"):
        for edge in _EDGES:
            _compare(fn, edge)
        generated.check("drop_oldest", fn, "the block at logical index num_sink_tokens // "
                        "block_size goes, its num_sink_tokens % block_size sinks copied to "
                        "the next block, and every recent token's key rotated by -block_size, "
                        "whatever the block size and however many sinks")
