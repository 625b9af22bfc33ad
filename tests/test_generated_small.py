"""The generated stage of the small exercises' graders (03.1, 03.2, 03.3, 04.1, 04.2, 05.6,
05.7, 09.2, 11.2, 12.1): paged_lib.course.grading.generated.small_*.

For each exercise: a plausible wrong answer passes every fixed case (✅ with the generated
stage patched out) and gets ❌ from the generated stage, with a shrunk story that names
the state; and a correct answer of another shape than the solution's passes.
"""

import math
from collections import deque

import pytest
import torch
from stage_verdicts import caught_only_by_the_stage, verdict

import paged_lib  # noqa: F401  # isort: split
from paged_lib import attention as A
from paged_lib.blocks import Slot
from paged_lib.course.grading import (
    ch00,
    ch01,
    ch02,
    ch03,
    ch04,
    ch05,
    ch06,
    ch09,
    ch10,
    ch11,
    ch12,
    ch14,
)
from paged_lib.course.grading.generated import (
    numeric,
    small_attention,
    small_blocks,
    small_counts,
    small_ints,
    small_sim,
)
from paged_lib.engine.prefix_cache import hash_block_tokens
from paged_lib.model import AttentionMetadata
from paged_lib.util import cdiv

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_cases_are_seeded_and_reach_states_the_fixed_cases_do_not():
    for cases in (small_attention.merge_cases, small_attention.paged_cases,
                  small_attention.slot_cases, small_attention.partials_cases):
        assert cases() == cases()
    merge = numeric.states(small_attention.merge_cases())
    assert merge["b masked, a real"] and merge["masked and real rows together"]
    assert merge["float32"] and merge["tied maxima"]
    paged = numeric.states(small_attention.paged_cases())
    assert paged["a scale that is not 1 / sqrt(head_dim)"] and paged["3 padding entries"]
    assert numeric.states(small_attention.slot_cases())["slots past 2**31"]
    partials = numeric.states(small_attention.partials_cases())
    assert partials["an empty segment first"] and partials["several empty segments"]
    assert partials["log-sum-exps hundreds apart"]
    for cases in (small_counts.choice_cases, small_counts.token_cases, small_counts.rank_cases):
        assert cases() == cases()
    choice = numeric.states(small_counts.choice_cases())
    assert choice["a budget below a waste"] and choice["a pool past 2**32 slots"]
    assert numeric.states(small_counts.token_cases())["head_dim not hidden / heads"]
    rank = numeric.states(small_counts.rank_cases())
    assert rank["head_dim not hidden / heads"] and rank["more ranks than KV heads"]
    assert ch06.metadata_cases() == ch06.metadata_cases()
    batch = numeric.states(ch06.metadata_cases())
    assert batch["slots past 2**31"] and batch["a chunk in the middle of a prompt"]
    assert ch06.required_cases() == ch06.required_cases()
    waiting = numeric.states(ch06.required_cases())
    assert waiting["samples that agree"] and waiting["block size 7"]
    assert ch14.stream_cases() == ch14.stream_cases()
    assert numeric.states(ch14.stream_cases())["a tie, the shorter stop listed first"]
    assert ch10.prompt_cases() == ch10.prompt_cases()
    prompts = numeric.states(ch10.prompt_cases())
    assert numeric.states(ch10.hit_cases())["more than 1,000 cached blocks"]
    assert small_sim.trace_cases() == small_sim.trace_cases()
    traces = numeric.states(small_sim.trace_cases())
    assert small_ints.count_cases() == small_ints.count_cases()
    assert numeric.states(small_ints.count_cases())["n past 2**53"]
    assert traces["two or more preemptions"] and traces["capacity not a multiple of block_size"]
    assert prompts["2 extra keys"] and prompts["a text hashed again at another block size"]


# ------------------------------------------------------------------ 04.1 merge_states

def merge_stacked(a, b):
    """Right, another shape: both states stacked, NaN weights of all-masked rows zeroed."""
    m, den, acc = (torch.stack([x, y]) for x, y in zip(a, b, strict=True))
    top = m.amax(0)
    w = torch.nan_to_num(torch.exp(m - top), nan=0.0)
    return top, (w * den).sum(0), (w[..., None] * acc).sum(0)


def merge_one_if_for_masked(a, b):
    """Wrong: the fully masked case handled by one ``if`` over the whole tensor, right only
    when every row of both blocks is masked (04.1 has no fixed case left: its generated
    cases are its only stage)."""
    (m_a, l_a, acc_a), (m_b, l_b, acc_b) = a, b
    if torch.isinf(m_a).all() and torch.isinf(m_b).all():
        return m_a.clone(), l_a.clone(), acc_a.clone()
    m = torch.maximum(m_a, m_b)
    wa, wb = torch.exp(m_a - m), torch.exp(m_b - m)
    return m, wa * l_a + wb * l_b, wa[..., None] * acc_a + wb[..., None] * acc_b


def test_04_1_one_if_for_masked_blocks_is_caught_only_by_the_generated_cases(monkeypatch):
    hint = caught_only_by_the_stage(ch04.check_merge_states, merge_one_if_for_masked,
                                    monkeypatch, "both masked, both real", "contains NaN")
    assert "per element with torch.where" in hint


def test_04_1_a_right_answer_of_another_shape_passes():
    assert verdict(ch04.check_merge_states, merge_stacked)[0] == "✅"


# ------------------------------------------------------------------ 04.2 paged_decode

def paged_decode(q, k_cache, v_cache, block_table, seq_len, scale, *, own_scale=False):
    """Right, another shape than the solution's: head by head, one block at a time with
    the library's block_state/merge; ``own_scale``: 1 / sqrt(head_dim) in place of the
    scale given (wrong)."""
    heads, d = q.shape
    _, bs, kv, _ = k_cache.shape
    scale = d ** -0.5 if own_scale else scale
    state = A.empty_state(q)
    for j in range(cdiv(seq_len, bs)):
        keep = torch.arange(bs) < seq_len - j * bs
        k = torch.where(keep[:, None, None], k_cache[int(block_table[j])], 0.0)
        v = torch.where(keep[:, None, None], v_cache[int(block_table[j])], 0.0)
        kh, vh = (x.repeat_interleave(heads // kv, dim=1).transpose(0, 1) for x in (k, v))
        s = torch.einsum("hd,htd->ht", q, kh) * scale
        state = A.merge(state, A.block_state(s.masked_fill(~keep, -math.inf), vh))
    return A.finalize(state)


def test_04_2_a_scale_of_its_own_is_caught_only_by_the_generated_cases(monkeypatch):
    hint = caught_only_by_the_stage(ch04.check_paged_online,
                                    lambda *a: paged_decode(*a, own_scale=True), monkeypatch,
                                    "scale 1 / sqrt(")
    assert "use the scale argument you are given" in hint


def test_04_2_a_right_answer_of_another_shape_passes():
    assert verdict(ch04.check_paged_online, paged_decode)[0] == "✅"


# ------------------------------------------------------------------ 05.6 slot_mapping

def slots_masked_assign(block_tables, seq_ids, positions, block_size):
    """Right, another shape: -1 everywhere, then the real tokens' slots assigned."""
    out = torch.full(positions.shape, -1, dtype=torch.int64)
    real = positions >= 0
    pos = positions[real]
    out[real] = block_tables[seq_ids[real], pos // block_size].to(torch.int64) * block_size \
        + pos % block_size
    return out


def slots_in_int32(block_tables, seq_ids, positions, block_size):
    """Wrong: the int32 table's block id times block_size, widened only by the int64 offset
    added afterwards (the product has wrapped by then)."""
    pos = positions.clamp(min=0)
    slots = block_tables[seq_ids, pos // block_size] * block_size + pos % block_size
    return torch.where(positions >= 0, slots, -1)


def test_05_6_a_32_bit_product_is_caught_only_by_the_generated_cases(monkeypatch):
    hint = caught_only_by_the_stage(ch05.check_slot_mapping, slots_in_int32, monkeypatch,
                                    "slots past 2**31")
    assert "wraps in 32 bits" in hint


def test_05_6_a_right_answer_of_another_shape_passes():
    assert verdict(ch05.check_slot_mapping, slots_masked_assign)[0] == "✅"


# ------------------------------------------------------------------ 05.7 merge_partials

def partials_softmax(out, lse):
    """Right, another shape: the weights as a softmax of the log-sum-exps."""
    return torch.softmax(lse, 0) @ out


def partials_pairwise(out, lse):
    """Wrong: the segments merged pairwise from the first one, with no guard for -inf:
    right while the empty segment is last (05.7's generated cases are its only stage)."""
    m, den, acc = lse[0], torch.ones((), dtype=out.dtype), out[0]
    for j in range(1, len(lse)):
        top = torch.maximum(m, lse[j])
        a, b = torch.exp(m - top), torch.exp(lse[j] - top)
        m, den, acc = top, a * den + b, a * acc + b * out[j]
    return acc / den


def test_05_7_pairwise_merges_are_caught_only_by_the_generated_cases(monkeypatch):
    hint = caught_only_by_the_stage(ch05.check_merge_partials, partials_pairwise, monkeypatch,
                                    "(empty: [0, 1])", "NaN")
    assert "first or several in a row" in hint


def test_05_7_a_right_answer_of_another_shape_passes():
    assert verdict(ch05.check_merge_partials, partials_softmax)[0] == "✅"


# ------------------------------------------------------------------ 09.2 choose_block_size

def waste(lengths, b):
    held = sum(cdiv(n, b) * b for n in lengths)
    return (held - sum(lengths)) / held


def choose_largest_first(lengths, allowed, max_waste):
    """Right, another shape: the sizes tried from the largest down."""
    if len(allowed) == 0 or not 0 <= max_waste < 1:
        raise ValueError("bad input")
    for b in sorted(set(allowed), reverse=True):
        if waste(lengths, b) <= max_waste:
            return b
    return min(sorted(set(allowed)), key=lambda b: waste(lengths, b))


def choose_with_isclose(lengths, allowed, max_waste):
    """Wrong: "never compare floats exactly", so a waste close to the budget fits: right
    on every budget that is exactly a waste or far from one."""
    if len(allowed) == 0 or not 0 <= max_waste < 1:
        raise ValueError("bad input")
    w = {b: waste(lengths, b) for b in allowed}
    fits = [b for b in w if w[b] < max_waste or math.isclose(w[b], max_waste)]
    return max(fits) if fits else min(sorted(w), key=lambda b: w[b])


def test_09_2_a_tolerance_is_caught_only_by_the_generated_cases(monkeypatch):
    hint = caught_only_by_the_stage(ch09.check_choose_block_size, choose_with_isclose,
                                    monkeypatch, "less one slot")
    assert "math.isclose" in hint


def test_09_2_a_right_answer_of_another_shape_passes():
    assert verdict(ch09.check_choose_block_size, choose_largest_first)[0] == "✅"


# ------------------------------------------------------------------ 11.2 and 12.1

def head_dim_from_hidden(spec):
    """Wrong: the head size derived as hidden_size // num_heads, which every fixed case's
    model has (not Gemma's, Mistral NeMo's or Qwen3 32B's)."""
    return spec.hidden_size // spec.num_heads


def bytes_per_token(spec, head_dim=lambda s: s.head_dim):
    """Right, another shape (numbers per layer first, then bytes)."""
    per_layer = spec.kv_lora_rank + spec.qk_rope_head_dim if spec.kv_lora_rank else \
        2 * spec.num_kv_heads * head_dim(spec)
    return per_layer * spec.dtype_bytes * spec.num_layers


def bytes_per_rank(spec, tp, tokens, head_dim=lambda s: s.head_dim):
    """Right, another shape: the KV heads per rank from the replicas."""
    heads, kv = spec.num_heads, spec.num_kv_heads
    if tp < 1 or heads % tp or (tp <= kv and kv % tp) or (tp > kv and tp % kv):
        raise ValueError("vLLM refuses this tp_size")
    replicas = tp // kv if tp > kv else 1
    return 2 * (kv * replicas // tp) * head_dim(spec) * spec.num_layers * spec.dtype_bytes \
        * tokens


def test_11_2_head_dim_from_hidden_is_caught_only_by_the_generated_cases(monkeypatch):
    hint = caught_only_by_the_stage(
        ch11.check_kv_bytes_per_token,
        lambda s: bytes_per_token(s, head_dim_from_hidden), monkeypatch, "(not 3072 / 16 = 192)")
    assert "use spec.head_dim" in hint


def test_12_1_head_dim_from_hidden_is_caught_only_by_the_generated_cases(monkeypatch):
    hint = caught_only_by_the_stage(
        ch12.check_kv_bytes_per_rank,
        lambda s, tp, n: bytes_per_rank(s, tp, n, head_dim_from_hidden), monkeypatch,
        "(not 3584 / 16 = 224)")
    assert "use spec.head_dim" in hint


def test_11_2_and_12_1_right_answers_of_another_shape_pass():
    assert verdict(ch11.check_kv_bytes_per_token, bytes_per_token)[0] == "✅"
    assert verdict(ch12.check_kv_bytes_per_rank, bytes_per_rank)[0] == "✅"


# ------------------------------------------------------------------ 06.1 build_metadata

def metadata_vectorised(block_tables, seq_lens, query_lens, block_size, widen=True):
    """Right, another shape than the solution's loop: every token at once in tensors;
    ``widen=False``: the int32 table's ids times block_size (wrong: it wraps)."""
    width = max(len(t) for t in block_tables)
    bt = torch.tensor([list(t) + [-1] * (width - len(t)) for t in block_tables],
                      dtype=torch.int32)
    sl, ql = torch.tensor(seq_lens, dtype=torch.int32), torch.tensor(query_lens,
                                                                      dtype=torch.int32)
    q = ql.long()
    seq = torch.repeat_interleave(torch.arange(len(seq_lens)), q)
    pos = torch.repeat_interleave(sl.long() - q, q) + torch.arange(int(q.sum())) \
        - torch.repeat_interleave(torch.cumsum(q, 0) - q, q)
    table = bt.long() if widen else bt
    slots = table[seq, pos // block_size] * block_size + pos % block_size
    return AttentionMetadata(slot_mapping=slots.long(), block_tables=bt, seq_lens=sl,
                             query_lens=ql, positions=pos)


def test_06_1_slots_in_int32_are_caught_only_by_the_generated_batches(monkeypatch):
    hint = caught_only_by_the_stage(ch06.check_build_metadata,
                                    lambda *a: metadata_vectorised(*a, widen=False),
                                    monkeypatch, "slots past 2**31")
    assert "wraps in 32 bits" in hint


def test_06_1_a_right_answer_of_another_shape_passes():
    assert verdict(ch06.check_build_metadata, metadata_vectorised)[0] == "✅"


# ------------------------------------------------------------------ 06.2 num_required_blocks

def blocks_over_common_prefix(group, block_size):
    """Wrong: the part shared by the sequences taken as their longest common prefix, so
    generated tokens the samples agree on are counted once: right whenever the outputs
    differ from their first token (every fixed group, and the workloads' groups)."""
    seqs = group.live_seqs()
    if len(seqs) == 1:
        return cdiv(seqs[0].num_tokens, block_size)
    texts = [list(s.prompt_token_ids) + list(s.output_token_ids) for s in seqs]
    common = 0
    while all(len(t) > common for t in texts) and len({t[common] for t in texts}) == 1:
        common += 1
    shared = cdiv(common, block_size)
    copies = len(seqs) - 1 if common % block_size else 0
    return shared + sum(cdiv(len(t), block_size) - shared for t in texts) + copies


def blocks_by_sequence(group, block_size):
    """Right, another shape: each live sequence's own blocks, less the full prompt blocks
    every sequence but the first shares."""
    seqs = group.live_seqs()
    prompt = len(group.prompt_token_ids)
    return sum(cdiv(s.num_tokens, block_size) for s in seqs) \
        - (len(seqs) - 1) * (prompt // block_size)


def test_06_2_a_common_prefix_is_caught_only_by_the_generated_groups(monkeypatch):
    hint = caught_only_by_the_stage(ch06.check_num_required_blocks, blocks_over_common_prefix,
                                    monkeypatch, "generated tokens the same in every sequence")
    assert "even the ones it has in common" in hint


def test_06_2_a_right_answer_of_another_shape_passes():
    assert verdict(ch06.check_num_required_blocks, blocks_by_sequence)[0] == "✅"


# ------------------------------------------------------------------ 14.1 the detokenizer

class Detokenizer:
    """Right, another shape than the solution's: the bytes kept, the text decoded again
    on each add, the stop found by scanning the text once for the first stop to complete.
    ``LONGEST``: when two complete at one character the longer wins (wrong: the one listed
    first does)."""

    LONGEST = False

    def __init__(self, decode, stop=()):
        self.decode, self.stops = decode, [s for s in stop if s]
        self.ids, self.sent, self.text, self.stopped = [], 0, "", None

    def add(self, token_ids):
        if self.stopped is not None:
            return ""
        self.ids.extend(token_ids)
        text = self.decode(self.ids)
        return self._out(text.rstrip("\ufffd"), final=False)

    def finish(self):
        return "" if self.stopped is not None else self._out(self.decode(self.ids), True)

    def _out(self, text, final):
        for end in range(1, len(text) + 1):  # the stop that completes first
            here = [s for s in self.stops if text[:end].endswith(s)]
            if here:
                self.stopped = max(here, key=len) if self.LONGEST else here[0]
                text, final = text[:end - len(self.stopped)], True
                break
        hold = 0 if final or not self.stops else max(map(len, self.stops)) - 1
        self.text = text
        end = max(self.sent, len(text) - hold)
        piece, self.sent = text[self.sent:end], end
        return piece


class LongestOnATie(Detokenizer):
    LONGEST = True


def test_14_1_the_longest_stop_on_a_tie_is_caught(monkeypatch):
    """Found by the generated cases first; 14.1's named cases now hold a tie at one
    character too (vLLM's rule: the stop that completes first, the first listed on a
    tie), so the fixed stage already names it."""
    assert verdict(ch14.check_detokenizer, LongestOnATie)[0] == "❌"


def test_14_1_a_right_answer_of_another_shape_passes():
    assert verdict(ch14.check_detokenizer, Detokenizer)[0] == "✅"


# ------------------------------------------------------------------ 10.1 block_hashes

def hashes_folded(token_ids, block_size, extra_keys=()):
    """Right, another shape: the blocks cut first, then each hashed on the list's last."""
    blocks = [token_ids[i:i + block_size]
              for i in range(0, len(token_ids) - block_size + 1, block_size)]
    out = []
    for b in blocks:
        out.append(hash_block_tokens(out[-1] if out else None, b, extra_keys))
    return out


def hashes_sorted_extras(token_ids, block_size, extra_keys=()):
    """Wrong: the extra keys sorted "to make them canonical": right with none or one, as
    every fixed prompt and the workloads have them."""
    return hashes_folded(token_ids, block_size, tuple(sorted(extra_keys, key=str)))


def test_10_1_sorted_extra_keys_are_caught_only_by_the_generated_prompts(monkeypatch):
    hint = caught_only_by_the_stage(ch10.check_block_hashes, hashes_sorted_extras, monkeypatch,
                                    "extra keys ('salt-9', 'lora-7')")
    assert "as given (order" in hint


def test_10_1_a_right_answer_of_another_shape_passes():
    assert verdict(ch10.check_block_hashes, hashes_folded)[0] == "✅"


# ------------------------------------------------------------------ 02.5 the simulator

def simulator(requests, capacity_tokens, block_size, victim=None):
    """Right, another shape than the solution's: requests as dicts, an admission stamp on
    each, the victim the running request with the highest stamp. ``victim(running)``: the
    running request to preempt instead (wrong ones)."""
    reqs = sorted(({"p": r.prompt_len, "o": r.output_len, "at": max(0, math.ceil(r.arrival)),
                    "arrival": r.arrival, "done": 0, "blocks": 0, "stamp": 0}
                   for r in requests), key=lambda r: r["arrival"])
    pending, queue, running = deque(reqs), deque(), []
    free, stamp, t = capacity_tokens // block_size, 0, 0
    out = dict.fromkeys(("token_states", "reserved", "internal", "external", "preemptions"),
                        0)

    def need(r):
        return cdiv(r["p"] + r["done"] + 1, block_size)

    while pending or queue or running:
        while pending and pending[0]["at"] <= t:
            queue.append(pending.popleft())
        if not queue and not running:
            t = pending[0]["at"]
            continue
        while sum(need(r) - r["blocks"] for r in running) > free:
            out["preemptions"] += 1
            v = victim(running) if victim else max(running, key=lambda r: r["stamp"])
            running.remove(v)
            free, v["blocks"] = free + v["blocks"], 0
            queue.appendleft(v)
        for r in running:
            free, r["blocks"] = free - (need(r) - r["blocks"]), need(r)
        while queue and need(queue[0]) <= free:
            r = queue.popleft()
            stamp += 1
            r["blocks"], r["stamp"] = need(r), stamp
            free -= r["blocks"]
            running.append(r)
        for r in running:
            tokens, held = r["p"] + r["done"] + 1, r["blocks"] * block_size
            use = min(held, r["p"] + r["o"])
            out["token_states"] += tokens
            out["reserved"] += use - tokens
            out["internal"] += held - use
        if queue:
            out["external"] += free * block_size + capacity_tokens % block_size
        t += 1
        for r in running:
            r["done"] += 1
            if r["done"] == r["o"]:
                free, r["blocks"] = free + r["blocks"], 0
        running = [r for r in running if r["done"] < r["o"]]
    return {**out, "num_steps": t}


def latest_arrival(running):
    """Wrong: the victim chosen by arrival time alone; of two that arrived at the same
    step, max() keeps the first, the one admitted earlier."""
    return max(running, key=lambda r: r["arrival"])


def test_02_5_a_victim_by_arrival_time_is_caught_only_by_the_generated_traces(monkeypatch):
    hint = caught_only_by_the_stage(ch02.check_paged_simulator,
                                    lambda *a: simulator(*a, victim=latest_arrival),
                                    monkeypatch, "preemption(s)")
    assert "most recently *admitted*" in hint


def test_02_5_a_right_answer_of_another_shape_passes():
    assert verdict(ch02.check_paged_simulator, simulator)[0] == "✅"


# ------------------------------------------------------------------ 00.1, 01.2, 01.3 counts

def blocks_float_then_remainder(n, b):
    """Wrong: the float quotient's integer part, plus one for a remainder: right wherever
    n / b is exact as a float (every named case), wrong past 2**53 where the float quotient
    rounds across a whole number."""
    return int(n / b) + (n % b > 0)


def blocks_divmod(n, b):
    """Right, another shape."""
    q, r = divmod(n, b)
    return q + (1 if r else 0)


def fill_float_fraction(n, b):
    """Wrong: the fill as the fractional part of the float n / b."""
    if n == 0:
        return 0.0
    return (n / b) % 1 or 1.0


def fill_remainder(n, b):
    """Right, another shape: the remainder, a full block when it is 0."""
    return 0.0 if n == 0 else (n % b or b) / b


@pytest.mark.parametrize("check, wrong, right", [
    (ch00.check_ceil_div, blocks_float_then_remainder, blocks_divmod),
    (ch01.check_logical_blocks, blocks_float_then_remainder, blocks_divmod),
    (ch01.check_last_block_fill, fill_float_fraction, fill_remainder),
])
def test_00_1_01_2_01_3_float_quotients_are_caught_only_by_the_generated_counts(
        monkeypatch, check, wrong, right):
    hint = caught_only_by_the_stage(check, wrong, monkeypatch, "as a float")
    assert "stay in integers" in hint
    assert verdict(check, right)[0] == "✅"


# ------------------------------------------------------------------ 10.2 longest_cache_hit

def hit_recursive(hashes, lookup, num_tokens, block_size, i=0):
    """Wrong: one call deeper per cached block: right on every prompt of fewer than about
    1,000 blocks."""
    if i >= min(len(hashes), (num_tokens - 1) // block_size):
        return []
    block = lookup(hashes[i])
    return [] if block is None else [block] + hit_recursive(hashes, lookup, num_tokens,
                                                            block_size, i + 1)


def hit_while(hashes, lookup, num_tokens, block_size):
    """Right, another shape: a while loop over the usable blocks."""
    usable, hits = max(num_tokens - 1, 0) // block_size, []
    while len(hits) < min(usable, len(hashes)):
        block = lookup(hashes[len(hits)])
        if block is None:
            break
        hits.append(block)
    return hits


def test_10_2_a_recursion_is_caught_only_by_the_generated_long_prompts(monkeypatch):
    hint = caught_only_by_the_stage(ch10.check_longest_cache_hit, hit_recursive, monkeypatch,
                                    "full blocks), cached: every full block",
                                    "RecursionError")
    assert "not one call deep per block" in hint


def test_10_2_a_right_answer_of_another_shape_passes():
    assert verdict(ch10.check_longest_cache_hit, hit_while)[0] == "✅"


# ------------------------------------------------------------------ 03.1 / 03.2 block tables

def append_token(table, *, bit_mask=False):
    """Right, another shape than the solution's: the copy-on-write case first, divmod for
    the place; ``bit_mask``: the offset as num_tokens & (block_size - 1) (wrong: right
    only for the named scenarios' block sizes, all powers of two)."""
    index, offset = divmod(table._num_tokens, table.block_size)
    if bit_mask:
        offset = table._num_tokens & (table.block_size - 1)
    copy = None
    if offset and table.allocator.refcount(table._blocks[index]) > 1:
        new = table.allocator.allocate()
        copy = (table._blocks[index], new)
        table.allocator.free(copy[0])
        table._blocks[index] = new
    elif not offset:
        table._blocks.append(table.allocator.allocate())
    table._num_tokens += 1
    return Slot(table._blocks[-1], offset, copy)


def fork(table):
    """Right, another shape: a new table filled block by block."""
    child = type(table)(table.allocator, table.block_size)
    for b in table._blocks:
        table.allocator.incref(b)
        child._blocks.append(b)
    child._num_tokens = table._num_tokens
    return child


def test_03_block_scenarios_reach_states_the_named_ones_do_not():
    seen = numeric.states(small_blocks.block_scenarios())
    assert {"block size 3", "block size 5", "block size 6", "block size 7",
            "block size 12", "a fork of a fork", "the pool runs out",
            "blocks handed out of order"} <= set(seen), seen


def test_03_1_a_bit_mask_offset_is_caught_only_by_the_generated_scenarios(monkeypatch):
    hint = caught_only_by_the_stage(ch03.check_append_token,
                                    lambda t: append_token(t, bit_mask=True), monkeypatch,
                                    "block size 3")
    assert "only for powers of two" in hint


def fork_through_a_set(table):
    """Wrong: one reference per distinct block, the child's blocks taken from the set,
    which puts them in the order of their ids; right only while the pool hands blocks out
    in increasing order, as it does in every named scenario."""
    blocks = set(table.blocks)
    for b in blocks:
        table.allocator.incref(b)
    return type(table)(table.allocator, table.block_size, sorted(blocks), table.num_tokens)


def test_03_2_a_fork_through_a_set_is_caught_only_by_the_generated_scenarios(monkeypatch):
    hint = caught_only_by_the_stage(ch03.check_fork, fork_through_a_set, monkeypatch,
                                    "free list")
    assert "in the table's order" in hint


def test_03_1_and_03_2_right_answers_of_another_shape_pass():
    assert verdict(ch03.check_append_token, append_token)[0] == "✅"
    assert verdict(ch03.check_fork, fork)[0] == "✅"


def free_two_holders(block, ref_counts, free_block_ids):
    """Wrong: the count read as shared or not, a shared block left with one holder whatever
    its count; right while no block has more than two holders (a fork of a fork has three)."""
    if not 0 <= block < len(ref_counts) or ref_counts[block] == 0:
        raise ValueError(f"block {block} cannot be freed")
    if ref_counts[block] > 1:
        ref_counts[block] = 1
    else:
        ref_counts[block] = 0
        free_block_ids.append(block)


def test_03_3_a_shared_block_left_with_one_holder_is_caught_only_by_the_scenarios(monkeypatch):
    hint = caught_only_by_the_stage(ch03.check_free_block, free_two_holders, monkeypatch,
                                    "('fork', 's1', 's2')", "ref counts: expected [1, 2]")
    assert "whatever the count: a block with k holders keeps k - 1" in hint
