"""Chapter 11's graders against typical wrong answers: each gets ❌ with a hint naming it."""

from __future__ import annotations

import dataclasses

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from stage_verdicts import caught_only_by_the_stage  # noqa: E402

from paged_lib import accounting as acc  # noqa: E402
from paged_lib.accounting import kv_bytes_per_token, mha_equivalent  # noqa: E402
from paged_lib.course.demos import your_counts
from paged_lib.course.exercises import EXERCISES  # noqa: E402
from paged_lib.course.grading import ch11  # noqa: E402
from paged_lib.util import cdiv  # noqa: E402


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


def verdict(capsys, check, answer) -> str:
    check(answer)
    out = capsys.readouterr().out
    assert out.count("\n") <= 2, out  # one verdict line, at most one hint line
    return out


def levels_with(base="mha", base_fp16=True, own=True, sinks_kept=True, cap=True,
                rounding="ceil", paged="kept", cast=int, zero_window=True, float32=False):
    """A kv_levels with one planted mistake (defaults: correct)."""
    def fn(spec, lengths, *, max_len, kv_dtype_bytes, block_size, window=None, sinks=0):
        b = (mha_equivalent(spec) if base == "mha" else spec)
        if base == "hidden":  # 2 x layers x hidden_size: MHA's heads x head_dim, mostly
            b = dataclasses.replace(mha_equivalent(spec),
                                    head_dim=spec.hidden_size // spec.num_heads)
        b = b if base_fp16 == "model" else b.with_dtype(2 if base_fp16 else kv_dtype_bytes)
        per = (spec if own else mha_equivalent(spec)).with_dtype(kv_dtype_bytes)
        if float32:
            import numpy as np
            return tuple(int(v) for v in np.float32(levels_with()(
                spec, lengths, max_len=max_len, kv_dtype_bytes=kv_dtype_bytes,
                block_size=block_size, window=window, sinks=sinks)))
        unset = window is None if zero_window else not window
        keep = max_len if unset else window + (sinks if sinks_kept else 0)
        keep = min(keep, max_len) if cap else keep
        kept = {"kept": [min(n, keep) for n in lengths], "all": lengths,
                "sinks_on_top": [min(n, window or max_len) + (sinks if window else 0)
                                 for n in lengths],
                "max_len": [max_len] * len(lengths), "reserved": [keep] * len(lengths)}[paged]
        held = sum({"ceil": cdiv(n, block_size) * block_size,
                    "floor": n // block_size * block_size, "exact": n,
                    "count": cdiv(n, block_size)}[rounding] for n in kept)
        n = len(lengths)
        bb, bp = kv_bytes_per_token(b), kv_bytes_per_token(per)
        return (cast(n * max_len * bb), cast(n * max_len * bp), cast(n * keep * bp),
                cast(held * bp))
    return fn


def _base_of_lengths(spec, lengths, **kw):
    """The first two levels counted over the requests' own lengths, not max_len each."""
    a, b, c, d = levels_with()(spec, lengths, **kw)
    reserved = len(lengths) * kw["max_len"]
    return a // reserved * sum(lengths), b // reserved * sum(lengths), c, d


def test_11_1_a_correct_answer_passes(capsys):
    assert verdict(capsys, ch11.check_kv_levels, levels_with()).startswith("✅ [11.1]")


def test_11_1_not_attempted(capsys):
    def todo(*args, **kwargs):
        raise NotImplementedError()
    assert verdict(capsys, ch11.check_kv_levels, todo).startswith("⏳ [11.1]")


@pytest.mark.parametrize("wrong, hint", [
    (levels_with(base="own"), "the baseline is plain MHA"),
    (levels_with(base="hidden"), "2 x layers x hidden_size is that only where"),
    (levels_with(base_fp16=False), "the baseline is fp16"),
    (levels_with(own=False), "uses the model's own attention"),
    (levels_with(sinks_kept=False), "the sinks are kept too"),
    (levels_with(cap=False), "never needs more than max_len"),
    (levels_with(rounding="floor"), "partly filled last block"),
    (levels_with(rounding="exact"), "paging holds whole blocks"),
    (levels_with(rounding="count"), "blocks of block_size slots each"),  # blocks, not slots
    (levels_with(paged="all"), "the levels stack"),
    (levels_with(paged="max_len"), "not a max_len reservation"),
    (levels_with(paged="reserved"), "not a reservation of window + sinks"),
    (levels_with(cast=float), "expected an int"),
    (levels_with(paged="sinks_on_top"), "not its last window plus sinks on top"),
    (levels_with(zero_window=False), "a window of 0 keeps only the sinks"),
    (levels_with(base_fp16="model"), "whatever the model spec's own dtype_bytes"),
    (levels_with(float32=True), "a float32 (numpy or torch) keeps 24 bits"),
    (_base_of_lengths, "the first two levels reserve max_len tokens per request"),
    (lambda spec, lengths, **kw: levels_with()(spec, lengths, **kw)[:3], "a tuple of 4"),
    (lambda spec, lengths, **kw: sum(levels_with()(spec, lengths, **kw)), "a tuple of 4"),
])
def test_11_1_wrong_answers_get_a_named_hint(capsys, wrong, hint):
    out = verdict(capsys, ch11.check_kv_levels, wrong)
    assert out.startswith("❌ [11.1]") and hint in out, out


def _reserved_as_kept(spec, lengths, **kw):
    """Level 3 counted from each request's real length (the window applied), not as the
    reservation it is; the other levels right."""
    right = levels_with()(spec, lengths, **kw)
    keep = kw["max_len"] if kw["window"] is None else min(kw["max_len"],
                                                          kw["window"] + kw["sinks"])
    per = kv_bytes_per_token(spec.with_dtype(kw["kv_dtype_bytes"]))
    return right[0], right[1], sum(min(n, keep) for n in lengths) * per, right[3]


def _own_dtype(spec, lengths, **kw):
    """Levels 2-4 in the model spec's own dtype: the KV dtype forgotten."""
    right = levels_with()(spec, lengths, **kw)
    scale = spec.dtype_bytes / kw["kv_dtype_bytes"]
    return (right[0], *(int(v * scale) for v in right[1:]))


def _batch_rounded(spec, lengths, **kw):
    """The paged layout rounds the batch's kept tokens up to blocks once, as if requests
    shared blocks."""
    right = levels_with()(spec, lengths, **kw)
    keep = kw["max_len"] if kw["window"] is None else min(kw["max_len"],
                                                          kw["window"] + kw["sinks"])
    kept = sum(min(n, keep) for n in lengths)
    per = kv_bytes_per_token(spec.with_dtype(kw["kv_dtype_bytes"]))
    return (*right[:3], cdiv(kept, kw["block_size"]) * kw["block_size"] * per)


def _sinks_once_past_window(spec, lengths, **kw):
    """The paged layout keeps a request whole while it fits in the window, window + sinks
    once it is longer: more tokens than it has when it is longer by fewer than sinks."""
    right = levels_with()(spec, lengths, **kw)
    window, per = kw["window"], kv_bytes_per_token(spec.with_dtype(kw["kv_dtype_bytes"]))
    keep = [n if window is None or n <= window else min(window + kw["sinks"], kw["max_len"])
            for n in lengths]
    return (*right[:3], sum(cdiv(k, kw["block_size"]) * kw["block_size"] for k in keep) * per)


@pytest.mark.parametrize("wrong, hint, state", [
    (_reserved_as_kept, "still a reservation made before a request's length is known",
     "fewer tokens"),
    (_own_dtype, "not in the model spec's own dtype_bytes", "fewer bytes per token"),
    (_batch_rounded, "each request rounds up to whole blocks on its own", "paged layout"),
])
def test_11_1_rules_read_from_the_levels_definitions_get_a_named_hint(capsys, wrong, hint,
                                                                       state):
    out = verdict(capsys, ch11.check_kv_levels, wrong)
    assert out.startswith("❌ [11.1]") and hint in out and state in out, out


def test_11_1_window_plus_sinks_once_past_the_window_is_caught_by_the_generated_stage(
        monkeypatch):
    hint = caught_only_by_the_stage(ch11.check_kv_levels, _sinks_once_past_window,
                                    monkeypatch, "paged layout")
    assert "one longer than the window by fewer than sinks tokens" in hint, hint


def test_11_1_the_specs_example_is_the_librarys():
    spec = acc.get_spec("llama-3-8b")
    want = (1073741824, 134217728, 33030144, 33554432)  # as the spec's example says
    assert ch11.reference_levels(spec, [1000], 2048, 1, 16, 500, 4) == want
    assert [v / 2**20 for v in want] == [1024, 128, 31.5, 32]


def test_11_1_a_learner_that_sorts_the_lengths_in_place_is_told(capsys):
    def sorts(spec, lengths, **kw):
        lengths.sort()
        return levels_with()(spec, lengths, **kw)
    out = verdict(capsys, ch11.check_kv_levels, sorts)
    assert out.startswith("❌ [11.1]") and "changed lengths" in out


def bytes_with(factor2_mla=False, rope_per_head=False, rope=True, mla=True, layers=True,
               q_heads=False, kv_pair=True, dtype=True, cast=int):
    """A kv_bytes_per_token with one planted mistake (defaults: correct)."""
    def fn(s):
        b = s.dtype_bytes if dtype else 1
        if s.kv_lora_rank and mla:
            r = s.qk_rope_head_dim * (s.num_heads if rope_per_head else 1) if rope else 0
            return cast((2 if factor2_mla else 1) * (s.num_layers if layers else 1)
                        * (s.kv_lora_rank + r) * b)
        heads = s.num_heads if q_heads else s.num_kv_heads
        return cast((2 if kv_pair else 1) * s.num_layers * heads * s.head_dim * b)
    return fn


def test_11_2_a_correct_answer_passes_and_the_library_is_refused(capsys):
    assert verdict(capsys, ch11.check_kv_bytes_per_token, bytes_with()).startswith("✅ [11.2]")
    out = verdict(capsys, ch11.check_kv_bytes_per_token, lambda s: acc.kv_bytes_per_token(s))
    assert out.startswith("❌ [11.2]") and "kv_bytes_per_token" in out


@pytest.mark.parametrize("wrong, hint", [
    (bytes_with(factor2_mla=True), "no factor 2"),
    (bytes_with(rope_per_head=True), "shared by every head"),
    (bytes_with(rope=False), "is cached beside the latent"),
    (bytes_with(mla=False), "not every head's K and V"),
    (bytes_with(layers=False), "multiply by num_layers"),
    (bytes_with(q_heads=True), "not query heads"),
    (bytes_with(kv_pair=False), "K and V: multiply by 2"),
    (bytes_with(dtype=False), "multiply by dtype_bytes"),
    (bytes_with(cast=float), "expected an int"),
])
def test_11_2_wrong_answers_get_a_named_hint(capsys, wrong, hint):
    out = verdict(capsys, ch11.check_kv_bytes_per_token, wrong)
    assert out.startswith("❌ [11.2]") and hint in out, out


def _mla_rope_kv(s):
    """The decoupled RoPE part cached as a key and a value."""
    if s.kv_lora_rank:
        return s.num_layers * (s.kv_lora_rank + 2 * s.qk_rope_head_dim) * s.dtype_bytes
    return bytes_with()(s)


def _mla_per_kv_head(s):
    """The latent and the RoPE key counted once per KV head."""
    return bytes_with()(s) * (s.num_kv_heads if s.kv_lora_rank else 1)


def _mla_by_rope(s):
    """MLA told apart by its RoPE key instead of its latent."""
    if s.qk_rope_head_dim:
        return s.num_layers * (s.kv_lora_rank + s.qk_rope_head_dim) * s.dtype_bytes
    return 2 * s.num_layers * s.num_kv_heads * s.head_dim * s.dtype_bytes


@pytest.mark.parametrize("wrong, hint, state", [
    (_mla_rope_kv, "no value beside it", "toy-mla (MLA"),
    (_mla_per_kv_head, "not one per KV head", "toy-mla (MLA"),
    (_mla_by_rope, "not every head's K and V", "toy-mla-no-rope"),
])
def test_11_2_rules_read_from_what_mla_caches_get_a_named_hint(capsys, wrong, hint, state):
    out = verdict(capsys, ch11.check_kv_bytes_per_token, wrong)
    assert out.startswith("❌ [11.2]") and hint in out and state in out, out


def test_11_2_the_specs_examples_are_the_librarys():
    assert kv_bytes_per_token(acc.DEEPSEEK_SPECS["deepseek-v2"]) == 69_120
    assert kv_bytes_per_token(acc.SPECS["llama-2-70b"]) == 327_680
    assert acc.gqa_groups(acc.DEEPSEEK_SPECS["deepseek-v2"]) == 2.25


def test_twins_and_demo(capsys):
    assert all(EXERCISES[k].twins for k in ("11.1", "11.2", "11.3", "11.4"))
    assert EXERCISES["11.2"].twins[0] == "paged_lib.accounting.kv_bytes_per_token"
    your_counts.chapter_11(levels_with(), bytes_with())
    out = capsys.readouterr().out
    assert "baseline" in out and "paged layout" in out and "deepseek-v2" in out
    assert len(plt.get_fignums()) == 2


@pytest.mark.parametrize("check, delegate, name", [
    (ch11.check_kv_levels, lambda spec, lengths, **kw: ch11.reference_levels(
        spec, lengths, kw["max_len"], kw["kv_dtype_bytes"], kw["block_size"], kw["window"],
        kw["sinks"]), "reference_levels"),
    (ch11.check_kv_bytes_per_token, lambda s: acc.kv_bytes(s, 1), "kv_bytes"),
    (ch11.check_kv_bytes_per_token, lambda s: __import__(
        "paged_lib.parallel", fromlist=["x"]).kv_bytes_per_rank(s, 1, 1), "kv_bytes_per_rank"),
])
def test_the_library_helpers_that_do_the_exercise_are_refused(capsys, check, delegate, name):
    out = verdict(capsys, check, delegate)
    assert out.startswith("❌") and name in out and "what you are asked to write" in out, out


def test_demo_on_unfinished_code_says_so(capsys):
    def todo(*args, **kwargs):
        raise NotImplementedError()
    your_counts.chapter_11(todo, todo)
    out = capsys.readouterr().out
    assert out.count("⏳") == 2 and "Traceback" not in out


# ------------------------------------------------------------------ 11.3 the int8 write


def write_with(doubling=True, requantise=True, fresh=True, nan=True, per_head=True,
               joint=True, strict=True, rnd=torch.round, tiny=True, dtype=torch.float32,
               ratio_first=True, growth="least", need_of="block"):
    """A write_int8_blocks with one planted mistake (defaults: correct), written as a
    learner would: block by block."""
    def fn(x, data, scale, slots):
        bs = data.shape[1]
        blocks, offsets = slots // bs, slots % bs
        for b in torch.unique(blocks).tolist():
            where = (blocks == b).nonzero().flatten().tolist()
            for part in ([where] if joint else [[i] for i in where]):
                vals = x[part].to(dtype)
                seen = vals if need_of == "block" else x.to(dtype)  # "call": every block's
                need = (seen.abs().amax(dim=(0, 2)) / 127).float()
                if not per_head:
                    need = need.max().expand_as(need)
                old = scale[b].clone()
                if fresh and bool((offsets[part] == 0).any()):
                    old.zero_()
                if nan:
                    old = torch.nan_to_num(old, nan=0.0)
                grows = need > old if strict else need >= old
                if growth == "least":
                    grown = torch.maximum(need, 2 * old)
                else:  # "double": twice the old scale; "pow2": doubled until it holds need
                    grown = torch.where(old > 0, 2 * old, need)
                    while growth == "pow2" and bool((grown < need).any()):
                        grown = torch.where(grown < need, 2 * grown, grown)
                new = torch.where(grows, grown if doubling else need, old)
                if tiny:
                    new = new.clamp(min=torch.finfo(torch.float32).tiny)
                if requantise and ratio_first:
                    ratio = torch.where(old > 0, old / new, torch.zeros_like(old))
                    data[b] = rnd(data[b].float() * ratio[None, :, None]).clamp(
                        -127, 127).to(torch.int8)
                elif requantise:  # q * old / new: off a true tie by a rounding error
                    data[b] = rnd(data[b].float() * old[None, :, None]
                                  / new[None, :, None]).clamp(-127, 127).to(torch.int8)
                scale[b] = new
                data[b, offsets[part]] = rnd(vals.float() / new[None, :, None]).clamp(
                    -127, 127).to(torch.int8)
    return fn


def test_11_3_a_correct_answer_passes_and_the_library_is_refused(capsys):
    out = verdict(capsys, ch11.check_write_int8_blocks, write_with())
    assert out.startswith("✅ [11.3]"), out
    from paged_lib.kernels import kv_quant
    out = verdict(capsys, ch11.check_write_int8_blocks, kv_quant.write_int8_blocks)
    assert out.startswith("❌ [11.3]") and "write_int8_blocks" in out

    def through_write_quantized(x, data, scale, slots):
        cache = kv_quant.QuantizedKV(data, scale, "int8")
        kv_quant.write_quantized(x, cache, slots)
    out = verdict(capsys, ch11.check_write_int8_blocks, through_write_quantized)
    assert out.startswith("❌ [11.3]") and "write_quantized" in out, out


@pytest.mark.parametrize("wrong, hint, state", [
    (write_with(doubling=False), "at least doubles", "its scale was"),
    (write_with(requantise=False), "must be requantised", "a code already there"),
    (write_with(fresh=False), "starts the block afresh", "starts afresh"),
    (write_with(per_head=False), "one scale per (block, KV head)", "2 KV head(s)"),
    (write_with(joint=False), "taken together", "offset(s) [0, 1"),
    (write_with(strict=False), "exactly at 127 x scale fits", "exactly 127 x the scale"),
    (write_with(rnd=torch.trunc), "do not truncate", "generated case"),
    (write_with(rnd=torch.floor), "not down", "generated case"),
    (write_with(tiny=False), "never goes below", "a token of zeros"),
    (write_with(nan=False), "", "a block never written (scale NaN), first written at offset 2"),
    (write_with(dtype=torch.float16), "", "generated case"),
])
def test_11_3_wrong_answers_get_a_named_hint(capsys, wrong, hint, state):
    out = verdict(capsys, ch11.check_write_int8_blocks, wrong)
    assert out.startswith("❌ [11.3]") and hint in out and state in out, out


@pytest.mark.parametrize("wrong, hint, state", [
    (write_with(growth="double"), "doubling is not enough", "a hundred times larger"),
    (write_with(growth="pow2"), "not the old scale doubled until it fits",
     "a hundred times larger"),
    (write_with(need_of="call"), "only the tokens written into that block",
     "a second sequence"),
])
def test_11_3_rules_read_from_the_invariants_get_a_named_hint(capsys, wrong, hint, state):
    """Readings of 'at least doubles, nothing clips, one growth per call' that break one."""
    out = verdict(capsys, ch11.check_write_int8_blocks, wrong)
    assert out.startswith("❌ [11.3]") and hint in out and state in out, out


def test_11_3_a_rule_right_on_one_token_but_not_on_a_prefill_is_named(capsys):
    def one_token_at_a_time_past_four(x, data, scale, slots):
        if len(slots) > 4:  # a prompt: token by token (one growth each)
            for i in range(len(slots)):
                write_with()(x[i:i + 1], data, scale, slots[i:i + 1])
        else:
            write_with()(x, data, scale, slots)
    out = verdict(capsys, ch11.check_write_int8_blocks, one_token_at_a_time_past_four)
    assert out.startswith("❌ [11.3]") and "generated case" in out \
        and "taken together" in out, out


def test_11_3_requantising_in_the_other_order_is_told_why_only_serving_shows_it(capsys):
    """q * old / new misses true ties by a rounding error: the comparison lets a code one
    off at a tie through, serving (random int8 workloads) does not, and the hint names the
    order of step 4."""
    out = verdict(capsys, ch11.check_write_int8_blocks, write_with(ratio_first=False))
    assert out.startswith("❌ [11.3]") and "random workload" in out \
        and "kv_cache_dtype='int8'" in out and "round(q * (old / new))" in out, out


def test_11_3_ties_rounded_up_are_told_to_round_half_to_even(capsys):
    """floor(v + 0.5) differs from torch.round only at exact ties (a code of 61 carried to a
    doubled scale): only serving shows it, and the hint names the rounding too."""
    out = verdict(capsys, ch11.check_write_int8_blocks,
                  write_with(rnd=lambda t: torch.floor(t + 0.5)))
    assert out.startswith("❌ [11.3]") and "random workload" in out \
        and "ties round half to even (torch.round, not floor(v + 0.5))" in out, out


# ------------------------------------------------------------------ 11.4 the window


def drop_with(gone="floor", copy="partial", rotate="new", shift=1, free="one",
              shared="after", short=True, free_first=False):
    """A drop_oldest with one planted mistake (defaults: correct)."""
    from paged_lib.blocks import BlockTable
    from paged_lib.engine.window import WindowOp

    def fn(table, sinks):
        bs, pool = table.block_size, table.allocator
        if short and table.num_tokens < sinks + bs:
            raise ValueError("short")
        blocks = table.blocks
        g = {"floor": sinks // bs, "ceil": -(-sinks // bs), "first": 0,
             "last_sink": max(0, (sinks - 1) // bs)}[gone]
        if free_first:  # the release before the check: a ValueError then leaves it freed
            pool.free(blocks[g])
        looked = {"after": blocks[g:], "all": blocks, "none": [],
                  "rewritten": blocks[g + 1:]}[shared]
        if any(pool.refcount(b) > 1 for b in looked):
            raise ValueError("shared")
        kept = blocks[:g] + blocks[g + 1:]
        if free == "table":
            table.free()
        new = BlockTable(pool, bs, kept, table.num_tokens - bs)
        if free == "one" and not free_first:
            pool.free(blocks[g])
        src = kept if rotate == "new" else blocks
        first = g * bs if rotate == "copied" else sinks  # "copied": the moved sinks too
        slots = tuple(src[p // bs] * bs + p % bs for p in range(first, new.num_tokens))
        r = sinks - g * bs if gone == "last_sink" else sinks % bs  # every sink in block g
        if (copy == "partial" and r) or copy == "always":
            return new, WindowOp(slots, shift * bs, blocks[g], blocks[g + 1], r or bs)
        return new, WindowOp(slots, shift * bs)
    return fn


def test_11_4_a_correct_answer_passes_and_the_library_is_refused(capsys):
    out = verdict(capsys, ch11.check_drop_oldest, drop_with())
    assert out.startswith("✅ [11.4]"), out
    from paged_lib.engine import window
    out = verdict(capsys, ch11.check_drop_oldest, lambda t, s: window.drop_oldest(t, s))
    assert out.startswith("❌ [11.4]") and "drop_oldest" in out


@pytest.mark.parametrize("wrong, hint, state", [
    (drop_with(gone="first"), "the sinks are never released", "sinks filling one block"),
    (drop_with(gone="ceil"), "not the first block after every sink", "the spec's example"),
    (drop_with(copy="never"), "copy them to the first r slots", "the spec's example"),
    (drop_with(copy="always"), "nothing is copied", "no sinks"),
    (drop_with(rotate="old"), "in the NEW table", "the spec's example"),
    (drop_with(rotate="copied"), "the sinks copied on into the next block keep their",
     "the spec's example"),
    (drop_with(shift=-1), "shift is block_size", "the spec's example"),
    (drop_with(free="none"), "leaks a block", "reference counts"),
    (drop_with(free="table"), "", "free list"),
    (drop_with(shared="none"), "is a ValueError", "shared with another sequence"),
    (drop_with(shared="all"), "a shared sink block before it is fine", "a sink block shared"),
    (drop_with(short=False), "has no block of recent tokens", "too short"),
])
def test_11_4_wrong_answers_get_a_named_hint(capsys, wrong, hint, state):
    out = verdict(capsys, ch11.check_drop_oldest, wrong)
    assert out.startswith("❌ [11.4]") and hint in out and state in out, out


@pytest.mark.parametrize("wrong, hint, state", [
    (drop_with(gone="last_sink"), "whole sink blocks stay where they are",
     "sinks filling one block"),
    (drop_with(shared="rewritten"), "the released block counts too",
     "the block to release shared"),
    (drop_with(free_first=True), "a ValueError changes nothing",
     "a block after the sinks shared"),
])
def test_11_4_rules_read_from_the_invariants_get_a_named_hint(capsys, wrong, hint, state):
    """Readings of 'sinks then recent tokens, one block freed, nothing shared rewritten'
    that break one: the sinks' own block released, the released block not looked at,
    a ValueError raised after the release."""
    out = verdict(capsys, ch11.check_drop_oldest, wrong)
    assert out.startswith("❌ [11.4]") and hint in out and state in out, out


def test_11_4_a_mistake_no_slip_explains_is_told_by_the_part_that_differs(capsys):
    right = drop_with()

    def no_copy_len(table, sinks):  # the copy's length left at the whole block
        new, op = right(table, sinks)
        if op.copy_len:
            op = type(op)(op.rotate_slots, op.shift, op.copy_src, op.copy_dst,
                          table.block_size)
        return new, op
    out = verdict(capsys, ch11.check_drop_oldest, no_copy_len)
    assert out.startswith("❌ [11.4]") and "the WindowOp's copy_len differ(s)" in out, out


def test_11_4_a_free_list_in_another_order_is_caught_on_blocks_of_2(capsys):
    """The engine's tokens do not show the free list's order (the generated stage misses
    it): the edge of blocks of 2 does."""
    right = drop_with()

    def lifo_free(table, sinks):  # with blocks of 2, frees to the head of the free list
        new, op = right(table, sinks)
        pool = table.allocator
        if table.block_size == 2:
            pool.free_block_ids.appendleft(pool.free_block_ids.pop())
        return new, op
    out = verdict(capsys, ch11.check_drop_oldest, lifo_free)
    assert out.startswith("❌ [11.4]") and "blocks of 2 and 3 sinks" in out \
        and "free list" in out, out


def test_the_engine_releases_window_blocks_through_its_hook():
    from paged_lib.engine import EngineHooks, LLMEngine, SamplingParams
    from paged_lib.engine.window import drop_oldest
    from paged_lib.model import load_tiny_code_llama

    assert EngineHooks().drop_oldest is drop_oldest
    seen = []

    def spy(table, sinks):
        seen.append((table.num_tokens, sinks))
        return drop_oldest(table, sinks)
    engine = LLMEngine(load_tiny_code_llama(), 8, 4, sliding_window=8, num_sink_tokens=2,
                       attention_backend="torch", hooks=EngineHooks(drop_oldest=spy))
    params = SamplingParams(max_tokens=20, ignore_eos=True, temperature=0.0)
    engine.generate([[40, 41, 42, 43, 44]], params)
    # 24 tokens fed (5 + 20 - 1): a block of 4 leaves whenever the next token would make
    # 8 + 4 recent tokens after the 2 sinks, so the table holds 13 each time (fed 14, 18, 22)
    assert seen == [(13, 2), (13, 2), (13, 2)]


def _spec(exercise: str) -> str:
    """The spec cell of an exercise in solutions/11, whitespace collapsed."""
    import json
    from pathlib import Path

    nb = json.loads((Path(__file__).parents[1] / "solutions/11_kv_landscape.ipynb").read_text())
    cell = next("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "markdown"
                and "".join(c["source"]).startswith(f"### Exercise {exercise}:"))
    return " ".join(cell.split())


def test_11_3_the_specs_example_is_the_librarys():
    from paged_lib.kernels.kv_quant import write_int8_blocks

    data = torch.zeros(5, 4, 1, 2, dtype=torch.int8)
    data[3, :2, 0] = torch.tensor([[127, 0], [-64, 32]], dtype=torch.int8)
    scale = torch.full((5, 1), float("nan"))
    scale[3] = 0.01
    write_int8_blocks(torch.tensor([[[2.0, -0.5]]]), data, scale, torch.tensor([14]))
    assert data[3, :3, 0].tolist() == [[64, 0], [-32, 16], [100, -25]]
    assert abs(float(scale[3, 0]) - 0.02) < 1e-9
    text = _spec("11.3")
    for said in ("scale 0.01", "slot 14", "scale is 0.02", "are `[64, 0]`", "and `[-32, 16]`",
                 "token is `[100, -25]`"):
        assert said in text, said


def test_11_4_the_specs_example_is_the_librarys():
    from paged_lib.blocks import BlockAllocator, BlockTable
    from paged_lib.engine.window import drop_oldest

    pool = BlockAllocator(8)
    blocks = [pool.allocate() for _ in range(8)]
    for b in blocks:
        if b not in (7, 3, 5):
            pool.free(b)
    new, op = drop_oldest(BlockTable(pool, 4, [7, 3, 5], 11), 2)
    assert (new.blocks, new.num_tokens, pool.refcount(7)) == ([3, 5], 7, 0)
    assert repr(op) == ("WindowOp(rotate_slots=(14, 15, 20, 21, 22), shift=4, copy_src=7, "
                        "copy_dst=3, copy_len=2)")
    text = _spec("11.4")
    assert "blocks `[7, 3, 5]` holding 11 tokens become `[3, 5]` holding 7" in text
    assert f"`{op!r}`" in text, text
