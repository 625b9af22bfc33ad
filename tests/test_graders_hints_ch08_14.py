"""Chapters 08-14's graders: wrong answers whose hint once named another mistake get theirs;
right answers of shapes no other test has get ✅."""

from __future__ import annotations

import pytest
import torch
from test_graders_ch10 import alloc
from test_graders_ch11 import drop_with, levels_with, write_with
from test_graders_ch14 import Det

from paged_lib.accounting import kv_bytes_per_token
from paged_lib.course.grading import ch08, ch10, ch11, ch14
from paged_lib.engine.window import WindowOp

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def verdict(capsys, check, answer) -> str:
    check(answer)
    return capsys.readouterr().out


def apply_through_fp16(k_cache, v_cache, slot, key, value):
    """08.1 with the new token routed through float16 (rounded before the cache casts it)."""
    if slot.copy is not None:
        src, dst = slot.copy
        k_cache[dst], v_cache[dst] = k_cache[src], v_cache[src]
    k_cache[slot.block, slot.offset] = key.half()
    v_cache[slot.block, slot.offset] = value.half()


def alloc_evicting_the_newest(pool, token_ids, hashes, block_size, max_new_tokens):
    """10.4 whose eviction drops the value's newest block (list.pop()), not the one evicted."""
    queue, popleft = pool.free_block_queue, pool.free_block_queue.popleft

    def pop_evicting():
        block = popleft()
        old = pool.block_hash.pop(block, None)
        if old is not None:
            same = pool.cached_blocks[old.value]
            same.pop()
            if not same:
                del pool.cached_blocks[old.value]
        return block

    queue.popleft = pop_evicting
    try:
        return alloc(pool, token_ids, hashes, block_size, max_new_tokens, evict=False)
    finally:
        del queue.popleft


def levels_sinks_apart(spec, lengths, *, max_len, kv_dtype_bytes, block_size, window=None,
                       sinks=0):
    """11.1 whose paged level rounds the sinks and the recent tokens up to blocks apart."""
    got = levels_with()(spec, lengths, max_len=max_len, kv_dtype_bytes=kv_dtype_bytes,
                        block_size=block_size, window=window, sinks=sinks)
    if window is None:
        return got
    keep, up = min(max_len, window + sinks), lambda n: -(-n // block_size) * block_size
    slots = sum(up(min(n, sinks)) + up(min(n, keep) - min(n, sinks)) for n in lengths)
    return (*got[:3], slots * kv_bytes_per_token(spec.with_dtype(kv_dtype_bytes)))


def write_fresh_per_call(x, data, scale, slots):
    """11.3 that decides "offset 0: a fresh block" once for the call, for every block in it."""
    tiny, bs = torch.finfo(torch.float32).tiny, data.shape[1]
    blocks, offsets = slots // bs, slots % bs
    fresh = bool((offsets == 0).any())
    for b in torch.unique(blocks).tolist():
        here = blocks == b
        vals = x[here].float()
        need = vals.abs().amax(dim=(0, 2)) / 127
        old = torch.nan_to_num(torch.zeros_like(need) if fresh else scale[b].clone(), nan=0.0)
        new = torch.where(need > old, torch.maximum(need, 2 * old), old).clamp(min=tiny)
        ratio = torch.where(old > 0, old / new, torch.zeros_like(old))
        data[b] = (data[b].float() * ratio[None, :, None]).round().clamp(-127, 127).to(torch.int8)
        scale[b] = new
        data[b, offsets[here]] = (vals / new[None, :, None]).round().clamp(-127, 127).to(
            torch.int8)


def alloc_crashing(pool, token_ids, hashes, block_size, max_new_tokens):
    """10.4 that crashes (ref_counts read as a dict): the crash is told, not 'return a pair'."""
    dict(pool.ref_counts)
    return alloc(pool, token_ids, hashes, block_size, max_new_tokens)


def write_in_float64(x, data, scale, slots):
    """11.3 right but for its arithmetic, done in float64 (the spec fixes fp32)."""
    tiny, bs = torch.finfo(torch.float32).tiny, data.shape[1]
    blocks, offsets = slots // bs, slots % bs
    for b in torch.unique(blocks).tolist():
        here = blocks == b
        vals = x[here].double()
        need = vals.abs().amax(dim=(0, 2)) / 127
        old = torch.nan_to_num(torch.zeros_like(need) if bool((offsets[here] == 0).any())
                               else scale[b].double(), nan=0.0)
        new = torch.where(need > old, torch.maximum(need, 2 * old), old).clamp(min=tiny)
        ratio = torch.where(old > 0, old / new, torch.zeros_like(old))
        data[b] = (data[b].double() * ratio[None, :, None]).round().clamp(-127, 127).to(
            torch.int8)
        scale[b] = new.float()
        data[b, offsets[here]] = (vals / new[None, :, None]).round().clamp(-127, 127).to(
            torch.int8)


def drop_then(edit):
    """11.4 right but for one field of the WindowOp, edited by ``edit(op)``."""
    def fn(table, sinks):
        new, op = drop_with()(table, sinks)
        return new, edit(op)
    return fn


@pytest.mark.parametrize("check, wrong, hint", [
    (ch08.check_apply_slot, apply_through_fp16, "not through another dtype such as float16"),
    (ch10.check_allocate_slots, alloc_evicting_the_newest,
     "take out the very block evicted (list.remove(block)), not the list's first or last"),
    (ch11.check_kv_levels, levels_sinks_apart, "not the sinks' blocks plus the window's"),
    (ch11.check_write_int8_blocks, write_fresh_per_call,
     "decide it for each block on its own, not once for the whole call"),
    (ch10.check_allocate_slots, alloc_crashing, "your function raised TypeError("),
    (ch11.check_write_int8_blocks, write_in_float64, "both in fp32 (in float64 the need"),
    (ch11.check_drop_oldest, drop_then(lambda op: WindowOp(
        tuple(sorted(op.rotate_slots)), op.shift, op.copy_src, op.copy_dst, op.copy_len)),
     "(not sorted by slot)"),
], ids=["08.1-through-float16", "10.4-evicts-the-newest", "11.1-sinks-in-blocks-apart",
        "11.3-fresh-once-per-call", "10.4-a-crash", "11.3-float64", "11.4-sorted-slots"])
def test_a_wrong_answer_gets_a_hint_naming_its_mistake(capsys, check, wrong, hint):
    out = verdict(capsys, check, wrong)
    assert out.startswith("❌") and hint in out, out


def write_held_slots_only(x, data, scale, slots):
    """11.3 requantising only the slots below the first one written (the rest are never read)."""
    tiny, bs = torch.finfo(torch.float32).tiny, data.shape[1]
    for b in sorted(set((slots // bs).tolist())):
        idx = (slots // bs == b).nonzero().flatten()
        offs = slots[idx] % bs
        first, vals = int(offs.min()), x[idx].float()
        need = vals.abs().amax(dim=(0, 2)) / 127
        old = (torch.zeros_like(need) if first == 0 or bool(scale[b].isnan().any())
               else scale[b].clone())
        new = torch.where(need > old, torch.maximum(need, 2 * old), old).clamp(min=tiny)
        ratio = torch.where(old > 0, old / new, torch.zeros_like(old))
        data[b, :first] = (data[b, :first].float() * ratio[None, :, None]).round().clamp(
            -127, 127).to(torch.int8)
        scale[b] = new
        data[b, offs] = (vals / new[None, :, None]).round().clamp(-127, 127).to(torch.int8)


class TokenByToken(Det):
    """14.1 as vLLM does it: each token decoded and checked for stops on its own."""

    def add(self, token_ids):
        return "".join(Det.add(self, [t]) for t in token_ids)


@pytest.mark.parametrize("check, right", [
    (ch11.check_write_int8_blocks, write_held_slots_only),
    (ch11.check_write_int8_blocks, write_with()),
    (ch14.check_detokenizer, TokenByToken),
], ids=["11.3-held-slots-only", "11.3-block-by-block", "14.1-token-by-token"])
def test_a_right_answer_of_another_shape_passes(capsys, check, right):
    out = verdict(capsys, check, right)
    assert out.startswith("✅"), out
