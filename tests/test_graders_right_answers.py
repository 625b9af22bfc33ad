"""A right answer never gets ❌: each whole-piece grader (06.4, 07.3, 08.2, 09.3, 10.4,
11.3, 11.4, 12.3) is fed five correct answers of different shapes (the solution's loop,
a vectorised one, another iteration order, recursion, other equivalent encodings of the
same answer, an answer that changes the lists it is given: 02.4 too) and all must pass;
so must numpy scalars where the spec asks for an int or a bool (06.2, 06.3, 07.1), and
answers built on library tools that are not the exercise's twin (06.2, 08.1).
"""

import heapq
import math
from collections import deque

import numpy as np
import pytest
import torch

from paged_lib.blocks import BlockAllocator, BlockTable
from paged_lib.course.grading import ch02, ch06, ch07, ch08, ch09, ch10, ch11, ch12
from paged_lib.engine.window import WindowOp
from paged_lib.kernels import paged_prefill, reshape_and_cache
from paged_lib.model import apply_rope

pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.slow]


def passes(capsys, check, answer) -> str:
    check(answer)
    out = capsys.readouterr().out
    assert out.startswith("✅"), out
    return out


# ------------------------------------------------------------------ 06.4 schedule_waiting


def _seqs(group) -> int:
    if any(s.output_token_ids for s in group.seqs):
        return len(group.live_seqs())
    return max(len(group.live_seqs()), group.params.num_seqs)


def _tokens(group, step) -> int:
    tokens = step.prefill_tokens(group)
    return min(tokens, step.tokens_left) if step.chunked_prefill else tokens


def _joins(group, step, tokens) -> bool:
    need = step.blocks_needed(group, tokens)
    fits = (need + step.watermark_blocks <= step.free_blocks
            and step.num_seqs + _seqs(group) <= step.max_num_seqs
            and tokens <= step.tokens_left)
    alone = (step.is_empty() and (not step.prefill_first or not step.running)
             and need <= step.free_blocks and tokens <= step.tokens_left)
    return fits or alone


def waiting_loop(waiting, step):
    """The solution's shape: a while loop on the head."""
    if step.swapped or step.num_preempted:
        return
    while waiting:
        tokens = _tokens(waiting[0], step)
        if (step.chunked_prefill and tokens < 1) or not _joins(waiting[0], step, tokens):
            return
        step.admit(waiting[0], tokens)


def waiting_recursive(waiting, step):
    """One group per call, then the rest."""
    if not waiting or step.swapped or step.num_preempted:
        return None
    tokens = _tokens(waiting[0], step)
    if tokens < 1 or not _joins(waiting[0], step, tokens):
        return None
    step.admit(waiting[0], tokens)
    return waiting_recursive(waiting, step)


def waiting_snapshot(waiting, step):
    """A for loop over a copy of the queue, with break."""
    if len(step.swapped) > 0 or step.num_preempted > 0:
        return
    for group in list(waiting):
        tokens = _tokens(group, step)
        if step.chunked_prefill and tokens == 0:
            break
        if not _joins(group, step, tokens):
            break
        step.admit(group, tokens)


def waiting_with_budget(waiting, step):
    """The fit read from step.budget(), the Budget 06.3 takes."""
    if step.swapped or step.num_preempted:
        return
    while waiting:
        group = waiting[0]
        tokens = _tokens(group, step)
        if step.chunked_prefill and tokens < 1:
            return
        need, b = step.blocks_needed(group, tokens), step.budget()
        fits = (b.free_blocks - need >= b.watermark_blocks
                and b.num_seqs + _seqs(group) <= b.max_num_seqs
                and b.num_batched_tokens + tokens <= b.max_num_batched_tokens)
        alone = (step.is_empty() and (not step.prefill_first or not step.running)
                 and need <= step.free_blocks and tokens <= step.tokens_left)
        if not fits and not alone:
            return
        step.admit(group, tokens)


def waiting_alone_first(waiting, step):
    """The exception tested first, then the rule; the head popped by admit."""
    blocked = bool(step.swapped) or bool(step.num_preempted)
    while waiting and not blocked:
        group = waiting[0]
        tokens = _tokens(group, step)
        need = step.blocks_needed(group, tokens) if tokens > 0 else 0
        alone = (tokens > 0 and step.is_empty() and need <= step.free_blocks
                 and tokens <= step.tokens_left
                 and not (step.prefill_first and step.running))
        blocked = not (alone or (tokens > 0 and _joins(group, step, tokens)))
        if not blocked:
            step.admit(group, tokens)


@pytest.mark.parametrize("answer", [waiting_loop, waiting_recursive, waiting_snapshot,
                                    waiting_with_budget, waiting_alone_first])
def test_06_4_right_answers_pass(capsys, answer):
    passes(capsys, ch06.check_schedule_waiting, answer)


# ------------------------------------------------------------------ 07.3 preempt_until_fits


def _offered(group, step):
    after = step.running[step.running.index(group) + 1:]
    return [group] + [g for g in after if not step.ran(g)]


def _preempt(victim, step, front=deque.appendleft):
    step.running.remove(victim)
    if step.preemption == "swap" and step.is_decoding(victim) and step.can_swap_out(victim):
        step.swap_out(victim)
        front(step.swapped, victim)
    else:
        step.free(victim)
        front(step.waiting, victim)


def preempt_loop(group, step):
    while step.blocks_needed > step.free_blocks:
        victim = step.hooks.choose_victim(_offered(group, step))
        _preempt(victim, step)
        if victim is group:
            return False
    return True


def preempt_recursive(group, step):
    if step.free_blocks >= step.blocks_needed:
        return True
    victim = step.hooks.choose_victim(_offered(group, step))
    _preempt(victim, step)
    return victim is not group and preempt_recursive(group, step)


def preempt_insert(group, step):
    """Candidates by index; victims put back with deque.insert(0, ...)."""
    while not step.free_blocks >= step.blocks_needed:
        me = next(i for i, g in enumerate(step.running) if g is group)
        offered = [step.running[i] for i in range(me, len(step.running))
                   if i == me or not step.ran(step.running[i])]
        victim = step.hooks.choose_victim(offered)
        _preempt(victim, step, front=lambda q, g: q.insert(0, g))
        if victim is group:
            return False
    return True


def preempt_while_true(group, step):
    """while True with break; the swap test written in another order."""
    runs = True
    while True:
        if step.blocks_needed <= step.free_blocks:
            break
        victim = step.hooks.choose_victim(_offered(group, step))
        step.running.remove(victim)
        swap = step.preemption == "swap"
        swap = swap and step.is_decoding(victim)
        if swap and step.can_swap_out(victim):
            step.swap_out(victim)
            step.swapped.appendleft(victim)
        else:
            step.free(victim)
            step.waiting.appendleft(victim)
        if victim is group:
            runs = False
            break
    return runs


def preempt_filter(group, step):
    """The candidates with filter(); the answer as a comparison."""
    victim = None
    while victim is not group and step.blocks_needed > step.free_blocks:
        start = step.running.index(group)
        later = filter(lambda g: not step.ran(g), step.running[start + 1:])
        victim = step.hooks.choose_victim([group, *later])
        _preempt(victim, step)
    return victim is not group


@pytest.mark.parametrize("answer", [preempt_loop, preempt_recursive, preempt_insert,
                                    preempt_while_true, preempt_filter])
def test_07_3_right_answers_pass(capsys, answer):
    passes(capsys, ch07.check_preempt_until_fits, answer)


# ------------------------------------------------------------------ 08.2 beam_step


def _tables_for(picks, tables):
    seen, out = set(), []
    for parent, token, cum in picks:
        out.append((parent, tables[parent].fork() if parent in seen else tables[parent],
                    token, cum))
        seen.add(parent)
    for i, table in enumerate(tables):
        if i not in seen:
            table.free()
    return out


def beam_sorted(tables, cum_logprobs, candidates, beam_width):
    scored = [(cum_logprobs[i] + lp, i, rank, tok) for i, options in enumerate(candidates)
              for rank, (tok, lp) in enumerate(options)]
    scored.sort(key=lambda c: (-c[0], c[1], c[2]))
    return _tables_for([(i, tok, c) for c, i, _, tok in scored[:beam_width]], tables)


def beam_nlargest(tables, cum_logprobs, candidates, beam_width):
    """heapq.nlargest keeps the input's order among equal keys."""
    flat = [(i, tok, cum_logprobs[i] + lp) for i, options in enumerate(candidates)
            for tok, lp in options]
    return _tables_for(heapq.nlargest(beam_width, flat, key=lambda c: c[2]), tables)


def beam_popping(tables, cum_logprobs, candidates, beam_width):
    """A merge of the sorted lists: takes candidates off their fronts as it picks."""
    picks = []
    while len(picks) < beam_width:
        best = None
        for i, options in enumerate(candidates):
            if options and (best is None or cum_logprobs[i] + options[0][1] > best[0]):
                best = (cum_logprobs[i] + options[0][1], i)
        if best is None:
            break
        token, _ = candidates[best[1]].pop(0)
        picks.append((best[1], token, best[0]))
    return _tables_for(picks, tables)


def beam_selection(tables, cum_logprobs, candidates, beam_width):
    """Selection by repeated maximum, ties to the first seen."""
    left = [(i, tok, cum_logprobs[i] + lp) for i, options in enumerate(candidates)
            for tok, lp in options]
    picks = []
    for _ in range(min(beam_width, len(left))):
        k = max(range(len(left)), key=lambda j: (left[j][2], -j))
        picks.append(left.pop(k))
    return _tables_for(picks, tables)


def beam_children_first(tables, cum_logprobs, candidates, beam_width):
    """Counts each parent's children first, then forks the further ones."""
    scored = sorted(((cum_logprobs[i] + lp, i, r, tok) for i, options in enumerate(candidates)
                     for r, (tok, lp) in enumerate(options)),
                    key=lambda c: (-c[0], c[1], c[2]))[:beam_width]
    kids = {}
    for _, parent, _, _ in scored:
        kids[parent] = kids.get(parent, 0) + 1
    for i in range(len(tables)):
        if i not in kids:
            tables[i].free()
    first, out = set(), []
    for cum, parent, _, token in scored:
        table = tables[parent] if parent not in first else tables[parent].fork()
        first.add(parent)
        out.append((parent, table, token, cum))
    return out


@pytest.mark.parametrize("answer", [beam_sorted, beam_nlargest, beam_popping, beam_selection,
                                    beam_children_first])
def test_08_2_right_answers_pass(capsys, answer):
    passes(capsys, ch08.check_beam_step, answer)


# ------------------------------------------------------------------ 09.3 attend_tiles


def _dt(q):
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def tiles_grouped(q, k_cache, v_cache, block_table, seq_len, tile):
    """The solution's shape: query heads viewed as [KV heads, group]."""
    num_heads, head_dim = q.shape
    block_size, kv = k_cache.shape[1], k_cache.shape[2]
    if seq_len == 0:
        return torch.zeros_like(q)
    dt, group = _dt(q), num_heads // kv
    qg = q.to(dt).view(kv, group, head_dim) * head_dim ** -0.5
    m = torch.full((kv, group), -math.inf, dtype=dt)
    den, acc = torch.zeros(kv, group, dtype=dt), torch.zeros(kv, group, head_dim, dtype=dt)
    table = block_table.long()
    for start in range(0, seq_len, tile):
        pos = torch.arange(start, min(start + tile, seq_len))
        k = k_cache[table[pos // block_size], pos % block_size].to(dt)
        v = v_cache[table[pos // block_size], pos % block_size].to(dt)
        s = torch.einsum("kgd,tkd->kgt", qg, k)
        m_new = torch.maximum(m, s.amax(-1))
        alpha, p = torch.exp(m - m_new), torch.exp(s - m_new[..., None])
        den = den * alpha + p.sum(-1)
        acc = acc * alpha[..., None] + torch.einsum("kgt,tkd->kgd", p, v)
        m = m_new
    return (acc / den[..., None]).reshape(num_heads, head_dim).to(q.dtype)


def tiles_kv_head_loop(q, k_cache, v_cache, block_table, seq_len, tile):
    """A loop over KV heads, a token loop inside each tile, a float running max."""
    h, d = q.shape
    bs, kv = k_cache.shape[1], k_cache.shape[2]
    g, dt = h // kv, _dt(q)
    out = torch.zeros(h, d, dtype=dt)
    if seq_len == 0:
        return out.to(q.dtype)
    for kh in range(kv):
        qh = q[kh * g:(kh + 1) * g].to(dt) / math.sqrt(d)
        m, den, acc = [-math.inf] * g, torch.zeros(g, dtype=dt), torch.zeros(g, d, dtype=dt)
        for start in range(0, seq_len, tile):
            rows = [(int(block_table[p // bs]), p % bs)
                    for p in range(start, min(start + tile, seq_len))]
            k = torch.stack([k_cache[b, o, kh] for b, o in rows]).to(dt)
            v = torch.stack([v_cache[b, o, kh] for b, o in rows]).to(dt)
            s = qh @ k.T
            for j in range(g):
                m_new = max(m[j], float(s[j].max()))
                a, p = math.exp(m[j] - m_new), torch.exp(s[j] - m_new)
                den[j] = den[j] * a + p.sum()
                acc[j] = acc[j] * a + p @ v
                m[j] = m_new
        out[kh * g:(kh + 1) * g] = acc / den[:, None]
    return out.to(q.dtype)


def tiles_whole_blocks(q, k_cache, v_cache, block_table, seq_len, tile):
    """Reads the whole blocks a tile spans (index_select), then slices the tile."""
    h, d = q.shape
    bs, kv = k_cache.shape[1], k_cache.shape[2]
    if seq_len == 0:
        return torch.zeros_like(q)
    dt = _dt(q)
    qf = q.to(dt) * d ** -0.5
    m = torch.full((h, 1), -torch.inf, dtype=dt)
    den, acc = torch.zeros(h, 1, dtype=dt), torch.zeros(h, d, dtype=dt)
    for start in range(0, seq_len, tile):
        end = min(start + tile, seq_len)
        b0, b1 = start // bs, (end - 1) // bs
        ids = block_table[b0:b1 + 1].long()
        k = k_cache.index_select(0, ids).reshape(-1, kv, d)[start - b0 * bs:end - b0 * bs]
        v = v_cache.index_select(0, ids).reshape(-1, kv, d)[start - b0 * bs:end - b0 * bs]
        k = k.to(dt).repeat_interleave(h // kv, dim=1)
        v = v.to(dt).repeat_interleave(h // kv, dim=1)
        s = (qf[None] * k).sum(-1).T
        m_new = torch.maximum(m, s.max(-1, keepdim=True).values)
        p, corr = (s - m_new).exp(), (m - m_new).exp()
        den = den * corr + p.sum(-1, keepdim=True)
        acc = acc * corr + torch.bmm(p[:, None, :], v.transpose(0, 1))[:, 0]
        m = m_new
    return (acc / den).to(q.dtype)


def tiles_last_first(q, k_cache, v_cache, block_table, seq_len, tile):
    """The tiles walked from the last to the first (the online softmax is order-free)."""
    h, d = q.shape
    bs, kv = k_cache.shape[1], k_cache.shape[2]
    if seq_len == 0:
        return torch.zeros_like(q)
    dt, heads = _dt(q), torch.arange(h) // (h // kv)
    qf = q.to(dt) * d ** -0.5
    m = torch.full((h,), -math.inf, dtype=dt)
    den, acc = torch.zeros(h, dtype=dt), torch.zeros(h, d, dtype=dt)
    for start in reversed(range(0, seq_len, tile)):
        pos = torch.arange(start, min(start + tile, seq_len))
        blocks = block_table[pos // bs].long()
        k = k_cache[blocks, pos % bs][:, heads].to(dt)
        v = v_cache[blocks, pos % bs][:, heads].to(dt)
        s = torch.einsum("hd,thd->ht", qf, k)
        m_new = torch.maximum(m, s.amax(1))
        p, c = torch.exp(s - m_new[:, None]), torch.exp(m - m_new)
        den, acc, m = c * den + p.sum(1), c[:, None] * acc + torch.einsum("ht,thd->hd", p, v), m_new
    return (acc / den[:, None]).to(q.dtype)


def tiles_logsumexp(q, k_cache, v_cache, block_table, seq_len, tile):
    """Another encoding of the running state: (log-sum-exp, normalised output)."""
    h, d = q.shape
    bs, kv = k_cache.shape[1], k_cache.shape[2]
    if seq_len == 0:
        return torch.zeros_like(q)
    dt, heads = _dt(q), torch.arange(h) // (h // kv)
    qf = q.to(dt) * d ** -0.5
    lse, o = torch.full((h,), -math.inf, dtype=dt), torch.zeros(h, d, dtype=dt)
    for start in range(0, seq_len, tile):
        pos = torch.arange(start, min(start + tile, seq_len))
        blocks = block_table[pos // bs].long()
        k = k_cache[blocks, pos % bs].to(dt)[:, heads]
        v = v_cache[blocks, pos % bs].to(dt)[:, heads]
        s = torch.einsum("hd,thd->ht", qf, k)
        t_lse = torch.logsumexp(s, 1)
        t_o = torch.einsum("ht,thd->hd", torch.softmax(s, 1), v)
        new = torch.logaddexp(lse, t_lse)
        o = o * torch.exp(lse - new)[:, None] + t_o * torch.exp(t_lse - new)[:, None]
        lse = new
    return o.to(q.dtype)


TILES = [tiles_grouped, tiles_kv_head_loop, tiles_whole_blocks, tiles_last_first,
         tiles_logsumexp]


@pytest.mark.parametrize("answer", TILES)
def test_09_3_right_answers_pass(capsys, answer):
    passes(capsys, ch09.check_attend_tiles, answer)


@pytest.mark.parametrize("answer", TILES)
def test_09_3_right_answers_pass_with_tiles_wider_than_the_head(answer):
    from paged_lib.course.grading.generated import numeric

    for c in (numeric.Tiles(21, 4, 20, 70, 4, 2, 8, "fp32", "random", 1.0),
              numeric.Tiles(22, 5, 12, 50, 4, 2, 4, "fp32", "random", 1.0)):
        ch09.check_case(answer, c)


# ------------------------------------------------------------------ 10.4 allocate_slots


def _hits(pool, token_ids, hashes, block_size):
    blocks = []
    for h in hashes[:(len(token_ids) - 1) // block_size]:
        block = pool.lookup(h)
        if block is None:
            break
        blocks.append(block)
    return blocks


def _evict(pool, block):
    old = pool.block_hash.pop(block, None)
    if old is not None:
        same = pool.cached_blocks[old.value]
        same.remove(block)
        if not same:
            del pool.cached_blocks[old.value]


def _register(pool, blocks, hashes, end, block_size):
    for block, h in zip(blocks[:end // block_size], hashes, strict=False):
        if block not in pool.block_hash:
            pool.block_hash[block] = h
            pool.cached_blocks.setdefault(h.value, []).append(block)


def alloc_solution(pool, token_ids, hashes, block_size, max_new_tokens):
    queue, refs = pool.free_block_queue, pool.ref_counts
    blocks = _hits(pool, token_ids, hashes, block_size)
    for block in blocks:
        if refs[block] == 0:
            queue.remove(block)
        refs[block] += 1
    computed = len(blocks) * block_size
    end = computed + min(len(token_ids) - computed, max_new_tokens)
    while len(blocks) * block_size < end:
        block = queue.popleft()
        _evict(pool, block)
        refs[block] = 1
        blocks.append(block)
    _register(pool, blocks, hashes, end, block_size)
    return blocks, computed


def alloc_touch_while_looking(pool, token_ids, hashes, block_size, max_new_tokens):
    """Each hit taken out of the free queue as it is found (a while loop)."""
    blocks, i = [], 0
    limit = min(len(hashes), (len(token_ids) - 1) // block_size)
    while i < limit and (block := pool.lookup(hashes[i])) is not None:
        if pool.ref_counts[block] == 0:
            pool.free_block_queue.remove(block)
        pool.ref_counts[block] += 1
        blocks.append(block)
        i += 1
    computed = i * block_size
    end = min(len(token_ids), computed + max_new_tokens)
    fresh = -(-end // block_size) - len(blocks)
    for _ in range(fresh):
        block = pool.free_block_queue.popleft()
        _evict(pool, block)
        pool.ref_counts[block] = 1
        blocks.append(block)
    _register(pool, blocks, hashes, end, block_size)
    return blocks, computed


def alloc_rebuilt_lists(pool, token_ids, hashes, block_size, max_new_tokens):
    """Eviction by rebuilding the hash's list; registration by index."""
    hits = _hits(pool, token_ids, hashes, block_size)
    for block in hits:
        if pool.ref_counts[block] == 0:
            pool.free_block_queue.remove(block)
        pool.ref_counts[block] += 1
    computed = len(hits) * block_size
    end = computed + min(len(token_ids) - computed, max_new_tokens)
    blocks = list(hits)
    while len(blocks) * block_size < end:
        block = pool.free_block_queue.popleft()
        if block in pool.block_hash:
            value = pool.block_hash.pop(block).value
            rest = [b for b in pool.cached_blocks[value] if b != block]
            if rest:
                pool.cached_blocks[value] = rest
            else:
                del pool.cached_blocks[value]
        pool.ref_counts[block] = 1
        blocks.append(block)
    for j in range(end // block_size):
        if blocks[j] not in pool.block_hash:
            pool.block_hash[blocks[j]] = hashes[j]
            pool.cached_blocks.setdefault(hashes[j].value, []).append(blocks[j])
    return blocks, computed


def alloc_recursive_hits(pool, token_ids, hashes, block_size, max_new_tokens):
    """The hit found recursively; the fresh blocks counted first."""
    def hits(i, limit):
        if i >= limit or (block := pool.lookup(hashes[i])) is None:
            return []
        return [block, *hits(i + 1, limit)]

    found = hits(0, min(len(hashes), (len(token_ids) - 1) // block_size))
    for block in found:
        if not pool.ref_counts[block]:
            pool.free_block_queue.remove(block)
        pool.ref_counts[block] = pool.ref_counts[block] + 1
    computed = block_size * len(found)
    end = computed + min(max_new_tokens, len(token_ids) - computed)
    need = math.ceil(end / block_size) - len(found)
    fresh = [pool.free_block_queue.popleft() for _ in range(need)]
    blocks = found
    for block in fresh:  # evicted one by one, in the order they were taken
        _evict(pool, block)
        pool.ref_counts[block] = 1
        blocks = blocks + [block]
    _register(pool, blocks, hashes, end, block_size)
    return blocks, computed


def alloc_counting_tokens(pool, token_ids, hashes, block_size, max_new_tokens):
    """The fresh blocks taken while counting the tokens they will hold."""
    hit = _hits(pool, token_ids, hashes, block_size)
    for b in hit:
        if pool.ref_counts[b] == 0:
            pool.free_block_queue.remove(b)
        pool.ref_counts[b] += 1
    computed = len(hit) * block_size
    todo = min(len(token_ids) - computed, max_new_tokens)
    out = list(hit)
    filled = computed
    while filled < computed + todo:
        if filled >= len(out) * block_size:
            b = pool.free_block_queue.popleft()
            _evict(pool, b)
            pool.ref_counts[b] = 1
            out.append(b)
        filled = min(computed + todo, len(out) * block_size)
    _register(pool, out, hashes, computed + todo, block_size)
    return list(out), int(computed)


@pytest.mark.parametrize("answer", [alloc_solution, alloc_touch_while_looking,
                                    alloc_rebuilt_lists, alloc_recursive_hits,
                                    alloc_counting_tokens])
def test_10_4_right_answers_pass(capsys, answer):
    passes(capsys, ch10.check_allocate_slots, answer)


# ------------------------------------------------------------------ 11.3 write_int8_blocks

TINY = torch.finfo(torch.float32).tiny


def _write_block(x, data, scale, b, here, offsets):
    vals = x[here].float()
    need = vals.abs().amax(dim=(0, 2)) / 127
    old = scale[b].clone()
    if bool((offsets[here] == 0).any()):
        old.zero_()
    old = torch.nan_to_num(old, nan=0.0)
    new = torch.where(need > old, torch.maximum(need, 2 * old), old).clamp(min=TINY)
    ratio = torch.where(old > 0, old / new, torch.zeros_like(old))
    data[b] = (data[b].float() * ratio[None, :, None]).round().clamp(-127, 127).to(torch.int8)
    scale[b] = new
    data[b, offsets[here]] = (vals / new[None, :, None]).round().clamp(-127, 127).to(torch.int8)


def int8_solution(x, data, scale, slots):
    bs = data.shape[1]
    blocks, offsets = slots // bs, slots % bs
    for b in torch.unique(blocks).tolist():
        _write_block(x, data, scale, b, blocks == b, offsets)


def int8_blocks_reversed(x, data, scale, slots):
    """The blocks in the other order (each block's write is its own)."""
    bs = data.shape[1]
    blocks, offsets = slots // bs, slots % bs
    for b in sorted(set(blocks.tolist()), reverse=True):
        _write_block(x, data, scale, b, blocks == b, offsets)


def int8_head_loop(x, data, scale, slots):
    """One (block, head) at a time, in plain floats where it can."""
    bs, heads = data.shape[1], data.shape[2]
    for b in dict.fromkeys((slots // bs).tolist()):
        rows = [i for i, s in enumerate(slots.tolist()) if s // bs == b]
        offs = [slots[i].item() % bs for i in rows]
        for h in range(heads):
            vals = x[rows, h].float()
            need = vals.abs().max() / 127
            old = scale[b, h].clone()
            if 0 in offs or bool(old.isnan()):
                old = torch.zeros(())
            new = torch.maximum(need, 2 * old) if need > old else old
            new = new.clamp(min=TINY)
            ratio = old / new if old > 0 else torch.zeros(())
            data[b, :, h] = (data[b, :, h].float() * ratio).round().clamp(-127, 127).to(
                torch.int8)
            scale[b, h] = new
            data[b, offs, h] = (vals / new).round().clamp(-127, 127).to(torch.int8)


def int8_fresh_zeroed(x, data, scale, slots):
    """A block started afresh (offset 0 written, or never written) is zeroed first."""
    bs = data.shape[1]
    blocks, offsets = slots // bs, slots % bs
    for b in torch.unique(blocks).tolist():
        here = blocks == b
        fresh = bool((offsets[here] == 0).any())
        never = scale[b].isnan()
        if fresh:
            data[b] = 0
            scale[b] = 0.0
        data[b, :, never] = 0
        scale[b, never] = 0.0
        _write_block(x, data, scale, b, here, offsets)


def int8_garbage_below_first_write(x, data, scale, slots):
    """In a block never written, the codes below the first offset written are never read:
    this answer leaves 55 there (the spec accepts any)."""
    bs = data.shape[1]
    blocks, offsets = slots // bs, slots % bs
    for b in torch.unique(blocks).tolist():
        here = blocks == b
        never = scale[b].isnan()
        _write_block(x, data, scale, b, here, offsets)
        first = int(offsets[here].min())
        data[b, :first, never] = 55


@pytest.mark.parametrize("answer", [int8_solution, int8_blocks_reversed, int8_head_loop,
                                    int8_fresh_zeroed, int8_garbage_below_first_write])
def test_11_3_right_answers_pass(capsys, answer):
    passes(capsys, ch11.check_write_int8_blocks, answer)


# ------------------------------------------------------------------ 11.4 drop_oldest


def _checked(table, sinks):
    bs, pool = table.block_size, table.allocator
    if table.num_tokens < sinks + bs:
        raise ValueError("too short")
    gone = sinks // bs
    if any(pool.refcount(b) > 1 for b in table.blocks[gone:]):
        raise ValueError("shared")
    return bs, pool, gone


def drop_solution(table, sinks):
    bs, pool, gone = _checked(table, sinks)
    blocks = table.blocks
    kept = blocks[:gone] + blocks[gone + 1:]
    new = BlockTable(pool, bs, kept, table.num_tokens - bs)
    pool.free(blocks[gone])
    rotate = tuple(kept[p // bs] * bs + p % bs for p in range(sinks, new.num_tokens))
    if sinks % bs:
        return new, WindowOp(rotate, bs, blocks[gone], blocks[gone + 1], sinks % bs)
    return new, WindowOp(rotate, bs)


def drop_zero_shift_when_nothing_rotates(table, sinks):
    """WindowOp((), 0) when no key moves: the shift is never read then."""
    new, op = drop_solution(table, sinks)
    if not op.rotate_slots:
        return new, WindowOp((), 0, op.copy_src, op.copy_dst, op.copy_len)
    return new, op


def drop_explicit_fields(table, sinks):
    """Every field spelled out, a copy of no slot naming its blocks anyway."""
    bs, pool, gone = _checked(table, sinks)
    blocks = list(table.blocks)
    dropped = blocks.pop(gone)
    new = BlockTable(pool, bs, blocks, table.num_tokens - bs)
    pool.free(dropped)
    rotate = []
    for p in range(sinks, new.num_tokens):
        rotate.append(blocks[p // bs] * bs + p % bs)
    r = sinks - gone * bs
    src, dst = dropped, new.blocks[gone] if gone < len(new.blocks) else -1
    return new, WindowOp(rotate_slots=tuple(rotate), shift=bs, copy_src=src, copy_dst=dst,
                         copy_len=r)


def drop_by_slots(table, sinks):
    """The rotated slots from the kept blocks' slot ranges."""
    bs, pool, gone = _checked(table, sinks)
    old = table.blocks
    kept = [b for i, b in enumerate(old) if i != gone]
    n = table.num_tokens - bs
    new = BlockTable(pool, bs, kept, n)
    pool.free(old[gone])
    slots = [b * bs + o for b in kept for o in range(bs)][:n]
    op = WindowOp(tuple(slots[sinks:]), bs)
    if sinks % bs:
        op = WindowOp(op.rotate_slots, bs, old[gone], old[gone + 1], sinks % bs)
    return new, op


def drop_checks_after_copying(table, sinks):
    """Works on a copy of the block list and checks in another order."""
    blocks, bs = list(table.blocks), table.block_size
    gone = sinks // bs
    shared = [b for b in blocks[gone:] if table.allocator.refcount(b) > 1]
    if table.num_tokens - sinks < bs or shared:
        raise ValueError("nothing to drop" if not shared else f"shared: {shared}")
    return drop_solution(table, sinks)


@pytest.mark.parametrize("answer", [drop_solution, drop_zero_shift_when_nothing_rotates,
                                    drop_explicit_fields, drop_by_slots,
                                    drop_checks_after_copying])
def test_11_4_right_answers_pass(capsys, answer):
    passes(capsys, ch11.check_drop_oldest, answer)


# ------------------------------------------------------------------ 12.3 rank_attention


def _heads(w, rank, tp):
    per = w.num_heads // tp
    q = list(range(rank * per, (rank + 1) * per))
    if w.num_kv_heads >= tp:
        each = w.num_kv_heads // tp
        return q, list(range(rank * each, (rank + 1) * each))
    return q, [rank // (tp // w.num_kv_heads)]


def _attend(x, w, cos, sin, kv_cache, meta, q_heads, kv_heads, proj):
    d, n = w.head_dim, x.shape[0]
    q = apply_rope(proj(w.q, w.q_bias, q_heads).view(n, -1, d), cos, sin)
    k = apply_rope(proj(w.k, w.k_bias, kv_heads).view(n, -1, d), cos, sin)
    v = proj(w.v, w.v_bias, kv_heads).view(n, -1, d)
    reshape_and_cache(k, v, *kv_cache, meta.slot_mapping, backend="torch")
    return paged_prefill(q.contiguous(), *kv_cache, meta.block_tables, meta.seq_lens,
                         meta.query_lens, backend="torch").reshape(n, -1)


def _rows_proj(x, d):
    def proj(weight, bias, heads):
        rows = slice(heads[0] * d, (heads[-1] + 1) * d)
        return x @ weight[rows].T + (0 if bias is None else bias[rows])
    return proj


def rank_solution(x, w, cos, sin, kv_cache, meta, rank, tp, all_reduce):
    q_heads, kv_heads = _heads(w, rank, tp)
    out = _attend(x, w, cos, sin, kv_cache, meta, q_heads, kv_heads, _rows_proj(x, w.head_dim))
    cols = slice(q_heads[0] * w.head_dim, (q_heads[-1] + 1) * w.head_dim)
    partial = out @ w.o[:, cols].T
    all_reduce(partial)
    return partial if w.o_bias is None else partial + w.o_bias


def rank_per_head(x, w, cos, sin, kv_cache, meta, rank, tp, all_reduce):
    """Projections head by head (torch.cat of each head's rows), o by einsum."""
    d = w.head_dim
    q_heads, kv_heads = _heads(w, rank, tp)

    def proj(weight, bias, heads):
        parts = [x @ weight[h * d:(h + 1) * d].T
                 + (0 if bias is None else bias[h * d:(h + 1) * d]) for h in heads]
        return torch.cat(parts, dim=1)

    out = _attend(x, w, cos, sin, kv_cache, meta, q_heads, kv_heads, proj)
    o = torch.stack([w.o[:, h * d:(h + 1) * d] for h in q_heads])  # [heads, hidden, d]
    partial = torch.einsum("nhd,hod->no", out.view(x.shape[0], -1, d), o).contiguous()
    all_reduce(partial)
    return torch.add(partial, w.o_bias) if w.o_bias is not None else partial


def rank_linear(x, w, cos, sin, kv_cache, meta, rank, tp, all_reduce):
    """torch.nn.functional.linear with sliced weights and biases."""
    d = w.head_dim
    q_heads, kv_heads = _heads(w, rank, tp)

    def proj(weight, bias, heads):
        rows = slice(heads[0] * d, (heads[-1] + 1) * d)
        return torch.nn.functional.linear(x, weight[rows], None if bias is None else bias[rows])

    out = _attend(x, w, cos, sin, kv_cache, meta, q_heads, kv_heads, proj)
    cols = slice(q_heads[0] * d, (q_heads[-1] + 1) * d)
    partial = torch.nn.functional.linear(out, w.o[:, cols])
    all_reduce(partial)
    if w.o_bias is not None:
        partial += w.o_bias
    return partial


def rank_manual_cache(x, w, cos, sin, kv_cache, meta, rank, tp, all_reduce):
    """The new K/V written into the cache by indexing its flat slots."""
    d, n = w.head_dim, x.shape[0]
    q_heads, kv_heads = _heads(w, rank, tp)
    proj = _rows_proj(x, d)
    q = apply_rope(proj(w.q, w.q_bias, q_heads).view(n, -1, d), cos, sin)
    k = apply_rope(proj(w.k, w.k_bias, kv_heads).view(n, -1, d), cos, sin)
    v = proj(w.v, w.v_bias, kv_heads).view(n, -1, d)
    k_cache, v_cache = kv_cache
    slots = meta.slot_mapping.long()
    keep = slots >= 0
    k_cache.view(-1, *k_cache.shape[2:])[slots[keep]] = k[keep].to(k_cache.dtype)
    v_cache.view(-1, *v_cache.shape[2:])[slots[keep]] = v[keep].to(v_cache.dtype)
    out = paged_prefill(q.contiguous(), k_cache, v_cache, meta.block_tables, meta.seq_lens,
                        meta.query_lens, backend="torch").reshape(n, -1)
    partial = out @ w.o[:, q_heads[0] * d:(q_heads[-1] + 1) * d].T
    all_reduce(partial)
    return partial + (w.o_bias if w.o_bias is not None else 0)


def rank_bias_on_rank0_before(x, w, cos, sin, kv_cache, meta, rank, tp, all_reduce):
    """o_proj's bias added once, on rank 0 before the sum (vLLM's RowParallelLinear)."""
    q_heads, kv_heads = _heads(w, rank, tp)
    d = w.head_dim
    out = _attend(x, w, cos, sin, kv_cache, meta, q_heads, kv_heads, _rows_proj(x, d))
    partial = out @ w.o[:, q_heads[0] * d:(q_heads[-1] + 1) * d].T
    if w.o_bias is not None and rank == 0:
        partial = partial + w.o_bias
    all_reduce(partial)
    return partial


@pytest.mark.parametrize("answer", [rank_solution, rank_per_head, rank_linear,
                                    rank_manual_cache, rank_bias_on_rank0_before])
def test_12_3_right_answers_pass(capsys, answer):
    passes(capsys, ch12.check_rank_attention, answer)


# ------------------------------------------------ inputs handed to the learner are copies


def tiles_that_zero_the_padding(q, k_cache, v_cache, block_table, seq_len, tile):
    """Right, and it writes into what it is given: NaN slots of the caches set to 0,
    the table's padding to 0, q scaled in place."""
    k_cache.nan_to_num_(0.0)
    v_cache.nan_to_num_(0.0)
    block_table.clamp_(min=0)
    out = tiles_grouped(q, k_cache, v_cache, block_table, seq_len, tile)
    q.mul_(2.0)
    return out


def int8_that_scales_x_in_place(x, data, scale, slots):
    int8_solution(x, data, scale, slots)
    x.mul_(3.0)
    slots.add_(1)


def rank_that_changes_its_inputs(x, w, cos, sin, kv_cache, meta, rank, tp, all_reduce):
    out = rank_solution(x, w, cos, sin, kv_cache, meta, rank, tp, all_reduce)
    x.mul_(2.0)
    w.q.mul_(2.0)
    cos.zero_()
    meta.slot_mapping.zero_()
    return out


def snapshot_popping(prompt_lens, output_lens, step, slots):
    """02.4, right: it pops the requests off the lists it is given."""
    total = [0, 0, 0]
    while prompt_lens:
        p, o = prompt_lens.pop(), output_lens.pop()
        for k, v in enumerate(slots(p + step + 1, p + o) if step < o else ()):
            total[k] += v
    return tuple(total)


@pytest.mark.parametrize("check, answer", [
    (ch02.check_batch_snapshot, snapshot_popping),
    (ch08.check_beam_step, beam_popping),
    (ch09.check_attend_tiles, tiles_that_zero_the_padding),
    (ch11.check_write_int8_blocks, int8_that_scales_x_in_place),
    (ch12.check_rank_attention, rank_that_changes_its_inputs),
], ids=["02.4", "08.2", "09.3", "11.3", "12.3"])
def test_a_right_answer_that_changes_its_inputs_passes(capsys, check, answer):
    passes(capsys, check, answer)


# ------------------------------------------------------------------ numpy scalars


def required_blocks_numpy(group, block_size):
    """06.2, right: a numpy count (np.int64) is an int, as everywhere in the course."""
    live, prompt = group.live_seqs(), len(group.prompt_token_ids)
    shared = -(-prompt // block_size)
    tails = np.array([-(-s.num_tokens // block_size) - shared for s in live])
    return shared + tails.sum() + (len(live) - 1) * (prompt % block_size > 0)


def can_admit_numpy(blocks_needed, num_seqs, num_tokens, budget):
    """06.3, right: the three limits compared at once, a numpy bool."""
    return np.all(np.array([blocks_needed + budget.watermark_blocks, budget.num_seqs + num_seqs,
                            budget.num_batched_tokens + num_tokens])
                  <= [budget.free_blocks, budget.max_num_seqs, budget.max_num_batched_tokens])


def swap_mapping_numpy(tables, allocate):
    """07.1, right: the distinct blocks in the order first met, found with np.unique
    (numpy ints as sources)."""
    flat = np.concatenate([np.asarray(t, dtype=np.int64) for t in tables])
    first = np.sort(np.unique(flat, return_index=True)[1])
    return [(src, allocate()) for src in flat[first]]


@pytest.mark.parametrize("check, answer", [
    (ch06.check_num_required_blocks, required_blocks_numpy),
    (ch06.check_can_admit, can_admit_numpy),
    (ch07.check_swap_mapping, swap_mapping_numpy),
], ids=["06.2", "06.3", "07.1"])
def test_a_numpy_scalar_answer_passes(capsys, check, answer):
    passes(capsys, check, answer)


# ------------------------------------------------------------------ library tools, not twins


def required_blocks_simulated(group, block_size):
    """06.2, right: replay the readmission on a scratch pool with chapter 03's tables (a
    fresh or single sequence: its whole text; several: prompt once, forks, tails)."""
    live, prompt = group.live_seqs(), len(group.prompt_token_ids)
    pool = BlockAllocator(10_000)
    parent = BlockTable(pool, block_size)
    for _ in range(prompt if len(live) > 1 else live[0].num_tokens):
        parent.append_token()
    if len(live) > 1:
        for child, seq in [(parent.fork(), s) for s in live]:
            for _ in range(seq.num_tokens - prompt):
                child.append_token()
        parent.free()
    return pool.num_blocks - pool.num_free


def apply_slot_with_the_write_kernel(k_cache, v_cache, slot, key, value):
    """08.1, right: copy the block with copy_, write the token with chapter 05's kernel."""
    if slot.copy is not None:
        k_cache[slot.copy[1]].copy_(k_cache[slot.copy[0]])
        v_cache[slot.copy[1]].copy_(v_cache[slot.copy[0]])
    where = torch.tensor([slot.block * k_cache.shape[1] + slot.offset])
    reshape_and_cache(key[None], value[None], k_cache, v_cache, where, backend="torch")


@pytest.mark.parametrize("check, answer", [
    (ch06.check_num_required_blocks, required_blocks_simulated),
    (ch08.check_apply_slot, apply_slot_with_the_write_kernel),
], ids=["06.2", "08.1"])
def test_a_right_answer_built_on_library_tools_passes(capsys, check, answer):
    passes(capsys, check, answer)
