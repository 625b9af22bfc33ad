"""Chapter 13 names the piece: each saved piece, replaced by a plausible wrong version,
is caught on the scenario that exercises it, and no other piece is blamed.

Each wrong version is saved alone into a temporary ``mine/`` folder
(``PAGED_LIB_MINE``-style, as :mod:`paged_lib.course.mine` writes it) and chapter 13's
check of every saved piece (:func:`your_engine_scenarios.check_pieces`) must name
exactly that piece, with a one-line story of the state that exposed it. Every piece of
:data:`SAVED` must have a scenario and at least one wrong version here.
"""

from __future__ import annotations

import textwrap

import pytest

from paged_lib.course import mine
from paged_lib.course.demos import your_engine, your_engine_scenarios
from paged_lib.course.exercises import SAVED

pytestmark = pytest.mark.usefixtures("one_torch_thread")

APPEND_TOKEN = '''
from paged_lib.blocks import Slot

def append_token(table):
    offset = table._num_tokens % table.block_size
    copy = None
    if offset == 0:
        table._blocks.append(table.allocator.allocate())
    elif {shared}:
        src, dst = table._blocks[-1], table.allocator.allocate()
        table.allocator.free(src)
        table._blocks[-1] = dst
        copy = (src, dst)
    table._num_tokens += 1
    return Slot(table._blocks[-1], offset, copy)
'''
FORK = '''
def fork(table):
    for block in table.blocks{which}:
        table.allocator.incref(block)
    return type(table)(table.allocator, table.block_size, table.blocks, table.num_tokens)
'''
FREE_BLOCK = '''
def free_block(block, ref_counts, free_block_ids):
    if ref_counts[block] == 0:
        raise ValueError(f"block {{block}} is already free")
    ref_counts[block] -= 1
    if {last}:
        free_block_ids.{end}(block)
'''
KERNEL = '''
import triton
import triton.language as tl

@triton.jit
def paged_decode_kernel(out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr,
                        seq_lens_ptr, scale, max_blocks,
                        NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr,
                        GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                        BLOCK_SIZE: tl.constexpr):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, HEAD_DIM)
    t = tl.arange(0, BLOCK_SIZE)
    real = (g < GROUP)[:, None]
    q_offs = (seq * NUM_KV_HEADS * GROUP + kv_head * GROUP + g[:, None]) * HEAD_DIM + d[None, :]
    q = tl.load(q_ptr + q_offs, mask=real, other=0.0)
    seq_len = tl.load(seq_lens_ptr + seq)
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    for j in range(0, tl.cdiv(seq_len, BLOCK_SIZE)):
        block = tl.load(block_tables_ptr + seq * max_blocks + j).to(tl.int64)
        valid = j * BLOCK_SIZE + t {cmp} seq_len
        offs = ((block * BLOCK_SIZE + t[:, None]) * NUM_KV_HEADS + kv_head) * HEAD_DIM + d[None, :]
        k = tl.load(k_cache_ptr + offs, mask=valid[:, None], other=0.0)
        v = tl.load(v_cache_ptr + offs, mask=valid[:, None], other=0.0)
        s = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * {scale}
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m_i = m_new
    tl.store(out_ptr + q_offs, acc / l_i[:, None], mask=real)
'''
SLOT_MAPPING = '''
import torch

def slot_mapping(block_tables, seq_ids, positions, block_size):
    pos = positions.clamp(min=0)
    blocks = block_tables.long()[seq_ids, {index}]
    slots = blocks * block_size + {offset}
    return torch.where(positions >= 0, slots, torch.full_like(slots, -1))
'''
BUILD_METADATA = '''
import torch
from paged_lib.model import AttentionMetadata

def build_metadata(block_tables, seq_lens, query_lens, block_size):
    slots, positions = [], []
    for table, seq_len, query_len in zip(block_tables, seq_lens, query_lens):
        for pos in range({start}, seq_len):
            block = table[pos // block_size]
            slots.append(block * block_size + {offset})
            positions.append(pos)
    width = max(len(t) for t in block_tables)
    rows = [list(t) + [-1] * (width - len(t)) for t in block_tables]
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        block_tables=torch.tensor(rows, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        query_lens=torch.tensor(query_lens, dtype=torch.int32),
        positions=torch.tensor(positions, dtype=torch.int64))
'''
NUM_REQUIRED_BLOCKS = '''
def num_required_blocks(group, block_size):
    seqs = group.live_seqs()
    prompt_len = len(group.prompt_token_ids)
    shared = -(-prompt_len // block_size)
    tails = sum(-(-s.num_tokens // block_size) - shared for s in seqs)
    copies = len(seqs) - 1 if prompt_len % block_size else 0
    return {total}
'''
CAN_ADMIT = '''
def can_admit(blocks_needed, num_seqs, num_tokens, budget):
    blocks_ok = budget.free_blocks - blocks_needed >= {watermark}
    seqs_ok = budget.num_seqs + num_seqs {seqs} budget.max_num_seqs
    tokens_ok = {tokens}
    return blocks_ok and seqs_ok and tokens_ok
'''
SWAP_MAPPING = '''
def swap_mapping(tables, allocate):
    copies = {{}}
    for block in (b for table in tables for b in table):
        if {fresh}:
            copies[block] = allocate()
    return list(copies.items())
'''
SWAP_MAPPING_TWICE = '''
def swap_mapping(tables, allocate):
    return [(block, allocate()) for table in tables for block in table]
'''
CHOOSE_VICTIM = '''
def choose_victim(running):
    return {which}
'''
BEAM_STEP = '''
def beam_step(tables, cum_logprobs, candidates, beam_width):
    scored = [(cum_logprobs[i] + lp, i, rank, tok)
              for i, options in enumerate(candidates) for rank, (tok, lp) in enumerate(options)]
    scored.sort(key=lambda c: {key})
    used, new_beams = set(), []
    for cum, parent, _, token in scored[:beam_width]:
        new_beams.append((parent, tables[parent].fork() if parent in used else tables[parent],
                          token, cum))
        used.add(parent)
    for i, table in enumerate(tables):
        if i not in used:
            table.free()
    return new_beams
'''
BLOCK_HASHES = '''
from paged_lib.engine.prefix_cache import hash_block_tokens

def block_hashes(token_ids, block_size, extra_keys=()):
    hashes, parent = [], None
    for i in range({count}):
        parent = hash_block_tokens({parent}, token_ids[i * block_size:(i + 1) * block_size],
                                   extra_keys)
        hashes.append(parent)
    return hashes
'''
LONGEST_CACHE_HIT = '''
def longest_cache_hit(hashes, lookup, num_tokens, block_size):
    hits = []
    for h in hashes[:{cap}]:
        block = lookup(h)
        if block is None:
            {miss}
        hits.append(block)
    return hits
'''
LRU_FREE_QUEUE = '''
from paged_lib.engine.prefix_cache import FreeBlockQueue

class LRUFreeQueue(FreeBlockQueue):
    def popleft(self):
        block = self.{end}
        if block in (self.HEAD, self.TAIL):
            raise IndexError("popleft from an empty free queue")
        self.remove(block)
        return block

    def remove(self, block_id):
        before, after = self.prev.pop(block_id), self.next.pop(block_id)
        self.next[before] = after
        {relink}
        self._len -= 1
'''
ALLOCATE_SLOTS = '''
from paged_lib.engine.prefix_cache import longest_cache_hit

def allocate_slots(pool, token_ids, hashes, block_size, max_new_tokens):
    hits = longest_cache_hit(hashes, pool.lookup, len(token_ids), block_size)
    {touch_first}
    computed = len(hits) * block_size
    end = computed + {new}
    blocks = hits + [pool.allocate() for _ in range(-(-end // block_size) - len(hits))]
    {touch_after}
    for block, h in zip(blocks[:{registered}], hashes, strict=False):
        pool.cache_block(block, h)
    return blocks, computed
'''
TOUCH = "for block in hits:\n        pool.touch(block)"


def allocate_slots(new="min(len(token_ids) - computed, max_new_tokens)",
                   registered="end // block_size", touch_first=TOUCH, touch_after="pass"):
    return ALLOCATE_SLOTS.format(new=new, registered=registered, touch_first=touch_first,
                                 touch_after=touch_after)

SCHEDULE_WAITING = '''
from paged_lib.engine.policy import seqs_to_come

def schedule_waiting(waiting, step):
    if {stop}:
        return
    for group in list(waiting):
        tokens = step.prefill_tokens(group)
        if step.chunked_prefill:
            tokens = min(tokens, step.tokens_left)
            if tokens < 1:
                return
        need = step.blocks_needed(group, tokens)
        fits = step.hooks.can_admit(need, {seqs}, tokens, step.budget())
        alone = (step.is_empty() and (not step.prefill_first or not step.running)
                 and need <= step.free_blocks and tokens <= step.tokens_left)
        if not (fits or alone):
            {blocked}
        step.admit(group, tokens)
'''


def schedule_waiting(stop="step.swapped or step.num_preempted", seqs="seqs_to_come(group)",
                     blocked="return"):
    return SCHEDULE_WAITING.format(stop=stop, seqs=seqs, blocked=blocked)


PREEMPT_UNTIL_FITS = '''
from paged_lib.engine.policy import preempt

def preempt_until_fits(group, step):
    {loop} step.blocks_needed > step.free_blocks:
        later = step.running[step.running.index(group) + 1:]
        candidates = {candidates}
        victim = step.hooks.choose_victim(list(candidates))
        preempt(victim, step)
        if victim is group:
            return {itself}
    return True
'''


def preempt_until_fits(loop="while", itself="False",
                       candidates="[group, *[g for g in later if not step.ran(g)]]"):
    return PREEMPT_UNTIL_FITS.format(loop=loop, itself=itself, candidates=candidates)


WRITE_INT8 = '''
import torch
from paged_lib.kernels.kv_quant import INT8_MAX, quantize_int8

def write_int8_blocks(x, data, scale, slots):
    block_size = data.shape[1]
    blocks, offsets = slots // block_size, slots % block_size
    uniq, inv = torch.unique(blocks, return_inverse=True)
    num_heads = x.shape[1]
    need = torch.zeros(uniq.numel(), num_heads).scatter_reduce_(
        0, inv[:, None].expand(-1, num_heads), x.abs().amax(-1), "amax") / INT8_MAX
    fresh = torch.zeros(uniq.numel(), dtype=torch.int32).scatter_reduce_(
        0, inv, (offsets == 0).int(), "amax").bool()
    old = scale[uniq]
    old = torch.where({fresh}old.isnan(), 0.0, old)
    new = torch.where(need > old, {grow}, old).clamp(min=1e-12)
    ratio = {ratio}
    held = data[uniq].float() * ratio[:, None, :, None]
    data[uniq] = held.round().clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    scale[uniq] = new
    data[blocks, offsets] = quantize_int8(x, new[inv][:, :, None])
'''


def write_int8(fresh="fresh[:, None] | ", grow="torch.maximum(need, 2 * old)",
               ratio="torch.where(old > 0, old / new, 0.0)"):
    return WRITE_INT8.format(fresh=fresh, grow=grow, ratio=ratio)


DROP_OLDEST = '''
from paged_lib.blocks import BlockTable
from paged_lib.engine.window import WindowOp

def drop_oldest(table, num_sink_tokens):
    bs, sinks = table.block_size, num_sink_tokens
    blocks, gone = table.blocks, {gone}
    kept = blocks[:gone] + blocks[gone + 1:]
    new = BlockTable(table.allocator, bs, kept, table.num_tokens - bs)
    table.allocator.free(blocks[gone])
    rotate = tuple(kept[x // bs] * bs + x % bs for x in range(sinks, new.num_tokens))
    r = sinks % bs
    if {no_copy}:
        return new, WindowOp(rotate, {shift})
    return new, WindowOp(rotate, {shift}, blocks[gone], blocks[gone + 1], r)
'''


def drop_oldest(gone="sinks // bs", no_copy="r == 0", shift="bs"):
    return DROP_OLDEST.format(gone=gone, no_copy=no_copy, shift=shift)


RANK_ATTENTION = '''
from paged_lib.parallel import heads_attention, rank_heads

def rank_attention(x, w, cos, sin, kv_cache, meta, rank, tp_size, all_reduce):
    q_heads, kv_heads = rank_heads(w.num_heads, w.num_kv_heads, tp_size, {rank})
    return heads_attention(x, w, cos, sin, kv_cache, meta, q_heads, kv_heads, {reduce})
'''


#: (exercise id, what is wrong, source of the saved section)
WRONG = [
    ("03.1", "no copy-on-write of a shared last block", APPEND_TOKEN.format(shared="False")),
    ("03.1", "copies a block it alone holds", APPEND_TOKEN.format(
        shared="table.allocator.refcount(table._blocks[-1]) >= 1")),
    ("03.2", "forks without a reference to each block", FORK.format(which="[:0]")),
    ("03.2", "forks without a reference to the last block", FORK.format(which="[:-1]")),
    ("03.3", "frees to the front of the free list", FREE_BLOCK.format(
        last="ref_counts[block] == 0", end="appendleft")),
    ("03.3", "frees a block others still hold", FREE_BLOCK.format(last="True", end="append")),
    ("05.5", "attends to one token past the sequence", KERNEL.format(cmp="<=", scale="scale")),
    ("05.5", "no softmax scale", KERNEL.format(cmp="<", scale="1.0")),
    ("05.6", "no offset inside the block", SLOT_MAPPING.format(index="pos // block_size",
                                                               offset="pos")),
    ("05.6", "the first block of every table", SLOT_MAPPING.format(
        index="0", offset="pos % block_size")),
    ("06.1", "the next token's slot", BUILD_METADATA.format(
        start="seq_len - query_len", offset="(pos + 1) % block_size")),
    ("06.1", "positions from 0 for a prefill after a prefix hit", BUILD_METADATA.format(
        start="seq_len - query_len if query_len == 1 else 0", offset="pos % block_size")),
    ("06.2", "the prompt counted once per sample", NUM_REQUIRED_BLOCKS.format(
        total="shared * len(seqs) + tails + copies")),
    ("06.2", "no copy-on-write block for the samples", NUM_REQUIRED_BLOCKS.format(
        total="shared + tails")),
    ("06.3", "no watermark", CAN_ADMIT.format(
        watermark="0", seqs="<=",
        tokens="budget.num_batched_tokens + num_tokens <= budget.max_num_batched_tokens")),
    ("06.3", "no token budget", CAN_ADMIT.format(
        watermark="budget.watermark_blocks", seqs="<=", tokens="True")),
    ("06.3", "one sequence too few", CAN_ADMIT.format(
        watermark="budget.watermark_blocks", seqs="<",
        tokens="budget.num_batched_tokens + num_tokens <= budget.max_num_batched_tokens")),
    ("06.4", "a group that does not fit skipped, the next admitted", schedule_waiting(
        blocked="continue")),
    ("06.4", "admits while groups are swapped out", schedule_waiting(stop="step.num_preempted")),
    ("06.4", "n samples counted as one sequence", schedule_waiting(seqs="1")),
    ("07.3", "the candidates offered newest first", preempt_until_fits(
        candidates="[*reversed([g for g in later if not step.ran(g)]), group]")),
    ("07.3", "one victim, then the step runs", preempt_until_fits(loop="if")),
    ("07.3", "runs after preempting itself", preempt_until_fits(itself="True")),
    ("07.1", "copies shared blocks once per table", SWAP_MAPPING_TWICE),
    ("07.1", "allocates for every block, keeps the last", SWAP_MAPPING.format(fresh="True")),
    ("07.2", "the oldest group first", CHOOSE_VICTIM.format(which="running[0]")),
    ("07.2", "the largest group first", CHOOSE_VICTIM.format(
        which="max(running, key=lambda g: len(g.live_seqs()))")),
    ("08.2", "ties broken by the later parent", BEAM_STEP.format(key="(-c[0], -c[1], c[2])")),
    ("08.2", "ties broken by the larger token", BEAM_STEP.format(key="(-c[0], -c[3])")),
    ("08.2", "the worst beams kept", BEAM_STEP.format(key="(c[0], c[1], c[2])")),
    ("10.1", "hashes not chained", BLOCK_HASHES.format(count="len(token_ids) // block_size",
                                                      parent="None")),
    ("10.1", "the partial last block hashed too", BLOCK_HASHES.format(
        count="-(-len(token_ids) // block_size)", parent="parent")),
    ("10.2", "no cap: the last token's block reused", LONGEST_CACHE_HIT.format(
        cap="len(hashes)", miss="break")),
    ("10.2", "one block short of the cap", LONGEST_CACHE_HIT.format(
        cap="num_tokens // block_size - 1", miss="break")),
    ("10.4", "the hits taken out of the free queue after allocating", allocate_slots(
        touch_first="pass", touch_after=TOUCH)),
    ("10.4", "the whole prompt at once, past the budget", allocate_slots(
        new="len(token_ids) - computed")),
    ("10.4", "blocks not registered until the request ends", allocate_slots(
        registered="0")),
    ("11.3", "the scale grows to the need, not at least double", write_int8(grow="need")),
    ("11.3", "a fresh block keeps the old scale", write_int8(fresh="")),
    ("11.3", "held tokens not rescaled", write_int8(ratio="torch.ones_like(new)")),
    ("11.4", "the sinks not copied", drop_oldest(no_copy="True")),
    ("11.4", "keys not rotated", drop_oldest(shift="0")),
    ("11.4", "the second recent block dropped", drop_oldest(gone="sinks // bs + 1")),
    ("12.3", "no all-reduce", RANK_ATTENTION.format(rank="rank", reduce="lambda t: None")),
    ("12.3", "rank 0's heads on every rank", RANK_ATTENTION.format(rank="0",
                                                                   reduce="all_reduce")),
    ("10.3", "pops the most recently freed block", LRU_FREE_QUEUE.format(
        end="prev[self.TAIL]", relink="self.prev[after] = before")),
    ("10.3", "a taken block's neighbour keeps its old link", LRU_FREE_QUEUE.format(
        end="next[self.HEAD]", relink="self.prev[after] = self.prev.get(after, before)")),
]


def save_alone(folder, ex_id: str, source: str) -> None:
    """``source`` as exercise ``ex_id``'s section of ``folder/chNN.py`` (mine's format)."""
    piece = SAVED[ex_id]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"ch{piece.chapter}.py").write_text(
        f"# >>> {ex_id} {piece.name}: {piece.role}\n{textwrap.dedent(source).strip()}\n"
        f"# <<< {ex_id}\n")


def test_every_piece_has_a_scenario_and_wrong_versions_here():
    assert your_engine_scenarios.missing() == []
    missing = set(SAVED) - {ex for ex, _, _ in WRONG}
    assert not missing, f"pieces without a wrong version here: {sorted(missing)}"
    for name, keys in your_engine_scenarios.PIECE_SCENARIOS.items():
        assert keys and all(k in your_engine_scenarios.SCENARIOS for k in keys), name


@pytest.mark.parametrize("ex_id, what, source", [w for w in WRONG if w[0] in SAVED],
                         ids=[f"{e} {w}" for e, w, _ in WRONG if e in SAVED])
def test_a_wrong_piece_is_named_alone(tmp_path, monkeypatch, capsys, ex_id, what, source):
    folder = tmp_path / "mine"
    save_alone(folder, ex_id, source)
    monkeypatch.setenv(mine.ENV, str(folder))
    pieces, parts = your_engine.gather()
    assert list(pieces) == [ex_id], [p.line() for p in parts]
    verdicts = your_engine_scenarios.check_pieces(pieces)
    out = capsys.readouterr().out.splitlines()
    assert verdicts[0][0] == ex_id and verdicts[0][1] is not None, f"{what}: not caught"
    assert out == [f"❌ your {ex_id} ({SAVED[ex_id].role}) {verdicts[0][1]}"]
    assert verdicts[0][1].startswith("on ") and len(out[0]) < 700  # one line: a story
    assert "Traceback" not in out[0]
