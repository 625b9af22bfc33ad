"""The random stage of the engine pieces' graders (paged_lib.course.grading.generated).

Seeded workloads served side by side with the library's pieces and the learner's: the
library's pieces and other correct answers pass, a wrong piece that every fixed case
lets through gets ❌ with the shrunk story of the state that exposed it, and
the workloads reach the states the stage is there for.
"""

import re

import pytest

import paged_lib  # noqa: F401  # isort: split
from paged_lib.blocks import BlockTable
from paged_lib.course import grading
from paged_lib.course.grading import ch06, ch07, ch08, ch10, ch11, generated
from paged_lib.course.grading.generated import workload
from paged_lib.engine import EngineHooks
from paged_lib.engine.window import WindowOp

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def verdict(check, fn, monkeypatch=None):
    """The grader's verdict on ``fn``; with ``monkeypatch``, without the random stage."""
    if monkeypatch is not None:
        monkeypatch.setattr(generated, "check", lambda *args, **kwargs: None)
    with grading.record_verdicts() as seen:
        check(fn)
    if monkeypatch is not None:
        monkeypatch.undo()
    return seen[-1]


def story_of_a_random_only_catch(check, fn, exercise, monkeypatch):
    """``fn`` passes every fixed case, then the random stage gives it ❌:
    its shrunk story, printed for the record."""
    mark, _, told = verdict(check, fn, monkeypatch)
    assert mark == "✅", f"the fixed cases already catch it: {told}"
    mark, ex, story = verdict(check, fn)
    assert (mark, ex) == ("❌", exercise)
    print(story)
    assert story.startswith("random workload ") and "shrunk to " in story
    assert "at engine step " in story
    return story


def test_workloads_are_seeded_and_span_the_options():
    a = [workload.draw(seed, "choose_victim") for seed in range(40)]
    assert a == [workload.draw(seed, "choose_victim") for seed in range(40)]
    options = {k: {dict(w.options).get(k) for w in a} for k in workload.DEFAULTS}
    assert {"swap", None} <= options["preemption"] and True in options["enable_prefix_caching"]
    assert True in options["enable_chunked_prefill"] and "int8" in options["kv_cache_dtype"]
    assert "fp16" in options["dtype"] and "prefill_first" in options["scheduling"]
    params = [dict(r.params) for w in a for r in w.requests]
    assert {p.get("beam_width") for p in params} >= {2, 3, 4}
    assert {p.get("n") for p in params} >= {2, 3, 4}
    assert any(p.get("stop_token_ids") for p in params)
    assert any(w.requests[i].prompt == w.requests[j].prompt for w in a
               for i in range(len(w.requests)) for j in range(i)), "a duplicated prompt"
    assert any(r.arrival > s.arrival for w in a for i, r in enumerate(w.requests)
               for s in w.requests[i + 1:]), "arrivals out of request order"
    windows = [workload.draw(seed, "can_admit") for seed in range(60)]
    assert any(dict(w.options).get("sliding_window") for w in windows)


def test_the_workloads_reach_the_states_fixed_cases_rarely_do():
    seen = generated.states("preempt_until_fits")
    assert seen["several victims in one step"] > 0 and seen["swaps out"] > 0
    assert seen["admitted next to decodes"] > 0 and seen["copy-on-write copies"] > 0
    assert seen["prefix-cache hit tokens"] > 0


@pytest.mark.parametrize("hook", ["build_metadata", "num_required_blocks", "can_admit",
                                  "schedule_waiting", "swap_mapping", "choose_victim",
                                  "preempt_until_fits", "block_hashes", "longest_cache_hit",
                                  "allocate_slots", "FreeBlockQueue", "beam_step",
                                  "drop_oldest"])
def test_the_librarys_own_pieces_serve_the_same(hook):
    generated.check(hook, getattr(EngineHooks(), hook), "unused", count=3)


# ------------------------------------------------------------------ 06.3 can_admit


def can_admit_decode_tokens_free(need, seqs, tokens, b):
    """Counts one token per sequence already in the step as free (as if only prompts
    used the token budget): right whenever the step holds nothing but what is asked."""
    return (b.free_blocks - need >= b.watermark_blocks
            and b.num_seqs + seqs <= b.max_num_seqs
            and b.num_batched_tokens - b.num_seqs + tokens <= b.max_num_batched_tokens)


def can_admit_by_what_is_left(need, seqs, tokens, b):
    left = {"blocks": b.free_blocks - b.watermark_blocks,
            "seqs": b.max_num_seqs - b.num_seqs,
            "tokens": b.max_num_batched_tokens - b.num_batched_tokens}
    return all(x <= left[k] for k, x in (("blocks", need), ("seqs", seqs), ("tokens", tokens)))


def test_06_3_a_wrong_piece_only_random_workloads_catch(monkeypatch):
    story = story_of_a_random_only_catch(ch06.check_can_admit, can_admit_decode_tokens_free,
                                         "06.3", monkeypatch)
    assert "admitted: the library's" in story and "max_num_batched_tokens=" in story


def can_admit_at_most_six_running(need, seqs, tokens, b):
    """A limit of six sequences of its own: right on every fixed case."""
    return (b.free_blocks - need >= b.watermark_blocks and b.num_seqs + seqs <= 6
            and b.num_seqs + seqs <= b.max_num_seqs
            and b.num_batched_tokens + tokens <= b.max_num_batched_tokens)


def test_06_3_a_limit_of_its_own_only_random_workloads_catch(monkeypatch, capsys):
    story = story_of_a_random_only_catch(ch06.check_can_admit, can_admit_at_most_six_running,
                                         "06.3", monkeypatch)
    assert "admitted: the library's" in story
    assert "sequences and tokens" in capsys.readouterr().out


def test_06_3_a_correct_piece_of_another_shape_passes():
    assert verdict(ch06.check_can_admit, can_admit_by_what_is_left)[0] == "✅"


# ------------------------------------------------------------------ 07.2 choose_victim


def victim_latest_step_then_latest_id(running):
    """The latest admission step, and among groups admitted in the same step the highest
    request id: right while ids follow admission, wrong when a request that arrived
    later (a lower id arriving after a higher one) is admitted in the same step."""
    return max(running, key=lambda g: (g.timeline.admitted_steps[-1], g.request_id))


def victim_by_position(running):
    return max(running, key=lambda g: next(i for i, x in enumerate(running) if x is g))


def test_07_2_ties_broken_by_id_are_caught_by_a_fixed_list_and_by_random_workloads(
        monkeypatch):
    """Once only random workloads caught this rule; a fixed list (two groups admitted in
    the same step, the later one with the lower id) now does too, and the random stage
    still tells it on its own, shrunk, with requests arriving out of id order."""
    mark, _, told = verdict(ch07.check_choose_victim, victim_latest_step_then_latest_id,
                            monkeypatch)
    assert mark == "❌" and "admitted in the same step" in told, told
    hooks = EngineHooks(choose_victim=victim_latest_step_then_latest_id)
    w = next(w for w in generated.workloads("choose_victim")
             if generated.difference(w, hooks) is not None)
    small, story = generated.shrink(w, hooks, generated.difference(w, hooks))
    print(story)
    assert "preempted: the library's" in story
    arrivals = [r.arrival for r in small.requests]
    assert arrivals != sorted(arrivals), "the shrunk workload has requests arriving out of order"


def test_07_2_a_correct_piece_of_another_shape_passes():
    assert verdict(ch07.check_choose_victim, victim_by_position)[0] == "✅"


# ------------------------------------------------------------------ shrinking


def test_a_difference_is_shrunk_to_a_smaller_workload():
    hooks = EngineHooks(choose_victim=victim_latest_step_then_latest_id)
    w = next(w for w in generated.workloads("choose_victim")
             if generated.difference(w, hooks) is not None)
    found = generated.difference(w, hooks)
    small, story = generated.shrink(w, hooks, found)
    assert len(small.requests) <= len(w.requests)
    assert sum(len(r.prompt) for r in small.requests) < sum(len(r.prompt) for r in w.requests)
    assert generated.difference(small, hooks) is not None, "the small one still differs"
    assert story.startswith("at engine step ")


# ------------------------------------------------------------------ 06.4 schedule_waiting


def schedule_waiting_chunks_skip_ahead(waiting, step):
    """The spec's loop, except that with chunked prefill a head that does not fit lets
    the groups behind it try (as if chunking made head-of-line blocking unnecessary):
    right whenever the head fits, or the one behind it does not either."""
    if step.swapped or step.num_preempted:
        return
    for group in list(waiting):
        if any(seq.output_token_ids for seq in group.seqs):
            num_seqs = len(group.live_seqs())
        else:
            num_seqs = max(len(group.live_seqs()), group.params.num_seqs)
        tokens = step.prefill_tokens(group)
        if step.chunked_prefill:
            tokens = min(tokens, step.tokens_left)
            if tokens < 1:
                return
        need = step.blocks_needed(group, tokens)
        tokens_ok = tokens <= step.tokens_left
        fits = (step.free_blocks - need >= step.watermark_blocks
                and step.num_seqs + num_seqs <= step.max_num_seqs and tokens_ok)
        alone = (step.is_empty() and (not step.prefill_first or not step.running)
                 and need <= step.free_blocks and tokens_ok)
        if not (fits or alone):
            if step.chunked_prefill:
                continue
            return
        step.admit(group, tokens)


def schedule_waiting_first_admitted_alone(waiting, step):
    """A right answer of another shape: "alone" as "nothing admitted yet and nobody
    running", which is the same state as the spec's wherever the engine can be."""
    if step.swapped or step.num_preempted:
        return
    admitted = 0
    while waiting:
        group = waiting[0]
        sampled = any(seq.output_token_ids for seq in group.seqs)
        num_seqs = (len(group.live_seqs()) if sampled
                    else max(len(group.live_seqs()), group.params.num_seqs))
        tokens = step.prefill_tokens(group)
        if step.chunked_prefill:
            tokens = min(tokens, step.tokens_left)
        if tokens < 1:
            return
        need = step.blocks_needed(group, tokens)
        within = tokens <= step.tokens_left
        if not ((step.free_blocks - need >= step.watermark_blocks and within
                 and step.num_seqs + num_seqs <= step.max_num_seqs)
                or (admitted == 0 and step.is_empty() and not step.running
                    and need <= step.free_blocks and within)):
            return
        step.admit(group, tokens)
        admitted += 1


def test_06_4_a_wrong_piece_only_random_workloads_catch(monkeypatch, capsys):
    """The shrunk workload is served again call by call: the story is the first call
    that differs, with its state, and the hint names the rule that state exposes."""
    story = story_of_a_random_only_catch(ch06.check_schedule_waiting,
                                         schedule_waiting_chunks_skip_ahead, "06.4", monkeypatch)
    assert "enable_chunked_prefill=True" in story and "chunked prefill on" in story
    assert "the library admits nobody; yours admits request" in story
    assert "head-of-line blocking" in capsys.readouterr().out


def test_06_4_a_correct_piece_of_another_shape_passes():
    assert verdict(ch06.check_schedule_waiting, schedule_waiting_first_admitted_alone)[0] == "✅"


# ------------------------------------------------------------------ 07.3 preempt_until_fits


def preempt_counting_what_victims_hold(group, step):
    """Counts what is still missing once, then takes each victim's blocks off it (the
    distinct blocks its sequences hold) instead of reading step.free_blocks again: right
    unless a victim holds a block another request holds too (a prefix-cache hit), which
    its preemption does not free."""
    short = step.blocks_needed - step.free_blocks
    while short > 0:
        later = step.running[step.running.index(group) + 1:]
        victim = step.hooks.choose_victim([group, *[g for g in later if not step.ran(g)]])
        held = len({b for s in victim.live_seqs() if s.block_table
                    for b in s.block_table.blocks})
        step.running.remove(victim)
        if step.preemption == "swap" and step.is_decoding(victim) and \
                step.can_swap_out(victim):
            step.swap_out(victim)
            step.swapped.appendleft(victim)
        else:
            step.free(victim)
            step.waiting.appendleft(victim)
        if victim is group:
            return False
        short -= held
    return True


def preempt_recursively(group, step):
    """A right answer of another shape: one victim, then ask again."""
    if step.blocks_needed <= step.free_blocks:
        return True
    at = next(i for i, g in enumerate(step.running) if g is group)
    offered = [g for k, g in enumerate(step.running) if k == at or (k > at and not step.ran(g))]
    victim = step.hooks.choose_victim(offered)
    step.running.remove(victim)
    swap = step.preemption == "swap" and step.is_decoding(victim) and step.can_swap_out(victim)
    if swap:
        step.swap_out(victim)
    else:
        step.free(victim)
    (step.swapped if swap else step.waiting).appendleft(victim)
    return victim is not group and preempt_recursively(group, step)


def test_07_3_a_wrong_piece_only_random_workloads_catch(monkeypatch):
    story = story_of_a_random_only_catch(ch07.check_preempt_until_fits,
                                         preempt_counting_what_victims_hold, "07.3",
                                         monkeypatch)
    assert "enable_prefix_caching=True" in story and "free blocks" in story


def test_07_3_a_correct_piece_of_another_shape_passes():
    assert verdict(ch07.check_preempt_until_fits, preempt_recursively)[0] == "✅"


# ------------------------------------------------------------------ 08.2 beam_step


def beam_step_by_heap(tables, cum_logprobs, candidates, beam_width):
    """A right answer of another shape: heapq.nlargest (stable on ties), forks made
    parent by parent, the dead freed after."""
    import heapq

    flat = [(cum_logprobs[i] + lp, i, tok) for i, c in enumerate(candidates) for tok, lp in c]
    best = heapq.nlargest(beam_width, flat, key=lambda c: c[0])
    seen: dict[int, int] = {}
    out = []
    for cum, parent, tok in best:
        seen[parent] = seen.get(parent, 0) + 1
        out.append((parent, tables[parent] if seen[parent] == 1 else tables[parent].fork(),
                    tok, cum))
    for i, table in enumerate(tables):
        if i not in seen:
            table.free()
    return out


def beam_step_frees_the_losers_by_score(tables, cum_logprobs, candidates, beam_width):
    """Frees the beams nobody continues in the order their best candidates lost (then
    those that offered none): the library's order (ascending beam index) wherever at most
    one beam that offered candidates dies, as in every scripted step; with wider beams
    the free list, so the blocks a later copy-on-write takes, differ."""
    scored = sorted(((cum_logprobs[i] + lp, i, tok) for i, c in enumerate(candidates)
                     for tok, lp in c), key=lambda c: -c[0])
    used: set[int] = set()
    out = []
    for cum, parent, tok in scored[:beam_width]:
        out.append((parent, tables[parent] if parent not in used else tables[parent].fork(),
                    tok, cum))
        used.add(parent)
    dead = list(dict.fromkeys(p for _, p, _ in scored[beam_width:] if p not in used))
    for i in dead + [i for i in range(len(tables)) if i not in used and i not in dead]:
        tables[i].free()
    return out


def test_08_2_a_free_order_by_score_only_random_workloads_catch(monkeypatch, capsys):
    story = story_of_a_random_only_catch(ch08.check_beam_step,
                                         beam_step_frees_the_losers_by_score, "08.2",
                                         monkeypatch)
    assert "beams" in story and "copy-on-write copies (src, dst): the library's" in story
    assert "the tables nobody continues are freed, in beam order" in capsys.readouterr().out


def test_08_2_a_correct_piece_of_another_shape_passes():
    assert verdict(ch08.check_beam_step, beam_step_by_heap)[0] == "✅"


def test_beam_workloads_serve_beams_under_pressure_and_sharing():
    ws = generated.workloads("beam_step")
    widths = {dict(r.params).get("beam_width") for w in ws for r in w.requests}
    assert {2, 3, 4} <= widths
    assert any(w.option("enable_prefix_caching") for w in ws)
    assert any(w.option("enable_chunked_prefill") for w in ws)
    seen = generated.states("beam_step")
    assert seen["preempted"] > 0 and seen["swaps out"] > 0
    assert seen["prefix-cache hit tokens"] > 0 and seen["copy-on-write copies"] > 0


# ------------------------------------------------------------------ 10.4 allocate_slots


def alloc_by_a_hash_map(pool, token_ids, hashes, block_size, max_new_tokens):
    """Finds the hits in a map built from pool.block_hash ({hash: block}), where a block
    cached later under an equal hash overwrites the one before: right while each hash
    names one block, wrong once a text was computed twice (two requests with one prompt
    admitted in the same step: the second recomputes the prompt's last full block, cached
    beside the first's) and a later text hits that hash: it adopts the newer copy, where
    pool.lookup, and the engine's admission, take the oldest."""
    by_hash = {h: b for b, h in pool.block_hash.items()}
    queue, refs = pool.free_block_queue, pool.ref_counts
    blocks = []
    for h in hashes[:(len(token_ids) - 1) // block_size]:
        if h not in by_hash:
            break
        blocks.append(by_hash[h])
    for b in blocks:
        if refs[b] == 0:
            queue.remove(b)
        refs[b] += 1
    computed = len(blocks) * block_size
    end = computed + min(len(token_ids) - computed, max_new_tokens)
    while len(blocks) * block_size < end:
        b = queue.popleft()
        old = pool.block_hash.pop(b, None)
        if old is not None:
            same = pool.cached_blocks[old.value]
            same.remove(b)
            if not same:
                del pool.cached_blocks[old.value]
        refs[b] = 1
        blocks.append(b)
    for b, h in zip(blocks[:end // block_size], hashes, strict=False):
        if b not in pool.block_hash:
            pool.block_hash[b] = h
            pool.cached_blocks.setdefault(h.value, []).append(b)
    return blocks, computed


def alloc_block_by_block(pool, token_ids, hashes, block_size, max_new_tokens):
    """A right answer of another shape: its own oldest-first search of cached_blocks,
    membership in the queue, an eviction that rebuilds the value's list, and only the
    fresh full blocks registered (a hit is cached already)."""
    queue = pool.free_block_queue
    limit = min(len(hashes), (len(token_ids) - 1) // block_size)
    hits: list[int] = []
    while len(hits) < limit:
        h = hashes[len(hits)]
        found = [b for b in pool.cached_blocks.get(h.value, []) if pool.block_hash[b] == h]
        if not found:
            break
        hits.append(found[0])
    for b in hits:
        if b in queue:
            queue.remove(b)
        pool.ref_counts[b] += 1
    computed = len(hits) * block_size
    end = min(len(token_ids), computed + max_new_tokens)
    fresh = []
    for _ in range(-(-(end - computed) // block_size)):
        b = queue.popleft()
        if b in pool.block_hash:
            old = pool.block_hash.pop(b)
            left = [x for x in pool.cached_blocks[old.value] if x != b]
            if left:
                pool.cached_blocks[old.value] = left
            else:
                del pool.cached_blocks[old.value]
        pool.ref_counts[b] = 1
        fresh.append(b)
    blocks = hits + fresh
    for i in range(len(hits), end // block_size):
        pool.block_hash[blocks[i]] = hashes[i]
        pool.cached_blocks.setdefault(hashes[i].value, []).append(blocks[i])
    return blocks, computed


def test_10_4_a_wrong_piece_only_random_workloads_catch(monkeypatch, capsys):
    story = story_of_a_random_only_catch(ch10.check_allocate_slots, alloc_by_a_hash_map,
                                         "10.4", monkeypatch)
    assert "enable_prefix_caching=True" in story and "the library answers ([0, 1, 2, " in story
    assert "where two blocks are cached under one hash, the hit is the oldest" in \
        capsys.readouterr().out
    prompts = re.findall(r"a prompt of \d+ tokens (\[[^]]*\])", story)
    assert len(prompts) > len(set(prompts)), "the story shows a prompt asked twice"


def test_10_4_a_correct_piece_of_another_shape_passes():
    assert verdict(ch10.check_allocate_slots, alloc_block_by_block)[0] == "✅"


# ------------------------------------------------------------------ 11.4 drop_oldest


def drop_oldest_by_shifts(table, num_sink_tokens):
    """Block and offset of a position by shifts and masks, as for a block size of 16:
    right for every power of two, wrong for a block of 3, 5 or 6 tokens."""
    bs, sinks, pool = table.block_size, num_sink_tokens, table.allocator
    if table.num_tokens < sinks + bs:
        raise ValueError("too short")
    k, mask = bs.bit_length() - 1, bs - 1
    blocks, gone = table.blocks, sinks >> k
    if any(pool.refcount(b) > 1 for b in blocks[gone:]):
        raise ValueError("shared")
    kept = blocks[:gone] + blocks[gone + 1:]
    new = BlockTable(pool, bs, kept, table.num_tokens - bs)
    pool.free(blocks[gone])
    rotate = tuple((kept[x >> k] << k) + (x & mask) for x in range(sinks, new.num_tokens))
    if sinks & mask:
        return new, WindowOp(rotate, bs, blocks[gone], blocks[gone + 1], sinks & mask)
    return new, WindowOp(rotate, bs)


def drop_oldest_by_divmod(table, num_sink_tokens):
    """A right answer of another shape: divmod, the slots listed block by block."""
    bs, pool = table.block_size, table.allocator
    gone, r = divmod(num_sink_tokens, bs)
    if table.num_tokens - num_sink_tokens < bs:
        raise ValueError("no block of recent tokens")
    if any(pool.refcount(b) != 1 for b in table.blocks[gone:]):
        raise ValueError("shared")
    old = table.blocks
    kept = old[:gone] + old[gone + 1:]
    n = table.num_tokens - bs
    new = BlockTable(pool, bs, kept, n)
    pool.free(old[gone])
    slots = tuple(b * bs + off for i, b in enumerate(kept) for off in range(bs)
                  if num_sink_tokens <= i * bs + off < n)
    return new, WindowOp(slots, bs, *((old[gone], old[gone + 1], r) if r else ()))


def test_11_4_a_wrong_piece_only_random_workloads_catch(monkeypatch):
    story = story_of_a_random_only_catch(ch11.check_drop_oldest, drop_oldest_by_shifts,
                                         "11.4", monkeypatch)
    assert re.search(r"blocks of [356],", story) and "sliding_window=" in story


def test_11_4_a_correct_piece_of_another_shape_passes():
    assert verdict(ch11.check_drop_oldest, drop_oldest_by_divmod)[0] == "✅"


def test_window_workloads_slide_with_every_block_size_and_sink_count():
    ws = generated.workloads("drop_oldest")
    assert all(w.option("sliding_window") for w in ws)
    assert {w.block_size for w in ws} >= {3, 5, 6, 8}
    assert any(w.option("num_sink_tokens") >= 2 * w.block_size and
               w.option("num_sink_tokens") % w.block_size for w in ws), "sinks past 2 blocks"
    calls = []

    def counting(table, sinks):
        calls.append((table.block_size, sinks))
        return EngineHooks().drop_oldest(table, sinks)

    for w in ws[:4]:
        generated.serve(w, EngineHooks(drop_oldest=counting))
    assert len(calls) > 20
