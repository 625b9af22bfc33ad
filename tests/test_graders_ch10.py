"""Chapter 10's graders against typical wrong answers: each gets ❌ with a hint naming it."""

from __future__ import annotations

import pytest

from paged_lib.course.demos import prefix_cache as demo
from paged_lib.course.grading import ch10
from paged_lib.engine import prefix_cache as pc
from paged_lib.engine.prefix_cache import FreeBlockQueue, hash_block_tokens


def verdict(capsys, check, answer) -> str:
    check(answer)
    out = capsys.readouterr().out
    assert out.count("\n") <= 2, out  # one verdict line, at most one hint line
    return out


# ---------------------------------------------------------------- 10.1 block_hashes


def chain(token_ids, block_size, extra_keys=(), *, blocks=None, parent_of=None,
          tokens_of=None, extra=True):
    """The hash chain with one piece swappable, to build the wrong answers."""
    n = len(token_ids) // block_size if blocks is None else blocks(len(token_ids), block_size)
    out = []
    for i in range(n):
        parent = parent_of(out, i) if parent_of else (out[-1] if out else None)
        chunk = tokens_of(token_ids, i, block_size) if tokens_of \
            else token_ids[i * block_size:(i + 1) * block_size]
        out.append(hash_block_tokens(parent, chunk, extra_keys if extra else ()))
    return out


def hashes_ok(token_ids, block_size, extra_keys=()):
    return chain(token_ids, block_size, extra_keys)


_memo: dict = {}


def memo_by_tokens(token_ids, block_size, extra_keys=()):
    """Remembers each text's hashes, forgetting that the extra keys name them too."""
    key = (tuple(token_ids), block_size)
    if key not in _memo:
        _memo[key] = chain(token_ids, block_size, extra_keys)
    return list(_memo[key])


_by_block: dict = {}


def memo_by_block(token_ids, block_size, extra_keys=()):
    """Chains each block on its parent, but remembers each hash (at module level) under
    the block's own tokens: a block that repeats, in this text or one hashed before, gets
    the hash of the first block with those tokens, whatever came before it."""
    out = []
    for i in range(len(token_ids) // block_size):
        chunk = tuple(token_ids[i * block_size:(i + 1) * block_size])
        if chunk not in _by_block:
            _by_block[chunk] = hash_block_tokens(out[-1] if out else None, chunk, extra_keys)
        out.append(_by_block[chunk])
    return out


def parent_block_alone(token_ids, block_size, extra_keys=()):
    """Each block's parent is the block before it hashed on its own."""
    out = []
    for i in range(len(token_ids) // block_size):
        parent = hash_block_tokens(None, token_ids[(i - 1) * block_size:i * block_size],
                                   extra_keys) if i else None
        out.append(hash_block_tokens(parent, token_ids[i * block_size:(i + 1) * block_size],
                                     extra_keys))
    return out


def extra_on_first_only(token_ids, block_size, extra_keys=()):
    """The extra keys hashed into block 0 only, since the chain carries them on."""
    out = []
    for i in range(len(token_ids) // block_size):
        out.append(hash_block_tokens(out[-1] if out else None,
                                     token_ids[i * block_size:(i + 1) * block_size],
                                     () if out else extra_keys))
    return out


@pytest.mark.parametrize("answer,hint", [
    # deriving the chain from what a name must guarantee: the plausible other rules
    (lambda t, b, e=(): chain(t, b, e, parent_of=lambda out, i: None,
                              tokens_of=lambda t, i, s: t[:(i + 1) * s]),
     "prompt '11 tokens, block size 4 (a part-filled last block)': block 1's hash differs"),
    (lambda t, b, e=(): chain(t, b, e, parent_of=lambda out, i: None,
                              tokens_of=lambda t, i, s: t[:(i + 1) * s]),
     "you hashed the whole prefix, tokens 0 to 7, with no parent"),
    (parent_block_alone, "prompt '12 tokens, block size 4 (every block full)': block 2's"),
    (parent_block_alone, "stands for block 1's tokens alone, not for the 8 tokens before"),
    (lambda t, b, e=(): chain(t, b, e, parent_of=lambda out, i: out[-1] if out
                              else hash_block_tokens(None, (), e)),
     "block 0 has nothing before it: hash_block_tokens takes parent None"),
    (extra_on_first_only, "extra keys ('lora-2',)': block 1's hash differs"),
    (extra_on_first_only, "extra keys on block 0 only"),
    (lambda t, b, e=(): chain(t, b, e, blocks=lambda n, s: -(-n // s)),
     "you hashed a partial block"),
    (lambda t, b, e=(): chain(t, b, e, parent_of=lambda out, i: None),
     "not chained on the parent"),
    (lambda t, b, e=(): chain(t, b, e, parent_of=lambda out, i: out[0] if out else None),
     "hashed from the wrong parent"),
    (lambda t, b, e=(): chain(t, b, e, parent_of=lambda out, i: out[-2] if i > 1 else
                              (out[-1] if out else None)),
     "hashed from the wrong parent"),
    (lambda t, b, e=(): chain(t, b, e, blocks=lambda n, s: max(n // s - 1, 0)),
     "off by one on full blocks"),
    (lambda t, b, e=(): chain(t, b, e, blocks=lambda n, s: len(range(0, n - s, s))),
     "a block that is exactly full"),
    (lambda t, b, e=(): chain(t, b, e, extra=False), "extra keys forgotten"),
    (lambda t, b, e=(): chain(t, b, e, tokens_of=lambda t, i, s: t[:(i + 1) * s]),
     "only that block's own tokens"),
    (lambda t, b, e=(): chain(t, b, e, tokens_of=lambda t, i, s: t[i * s:(i + 1) * s - 1]),
     "off by one in the block's slice"),
    (lambda t, b, e=(): [h.value for h in chain(t, b, e)], "not its .value"),
    (lambda t, b, e=(): len(chain(t, b, e)), "not how many"),
    (lambda t, b, e=(): chain(t, b, e)[::-1], "wrong order"),
    (memo_by_tokens, "'the same 20 tokens, extra keys ('lora-2',)': block 0's hash differs"),
    # a key given twice (one image twice in a prompt) taken once, or in a set's order
    (lambda t, b, e=(): chain(t, b, tuple(dict.fromkeys(e))), "block 0 was hashed with "
     "('mm:9c01', 4), the request's are ('mm:9c01', 4, 'mm:9c01')"),
    (lambda t, b, e=(): chain(t, b, tuple(set(e))), "as given (order, repeats)"),
    (lambda t, b, e=(): chain(t, b, tuple(sorted(e, key=str))), "as given (order, repeats)"),
])
def test_block_hashes_wrong_answers(capsys, answer, hint):
    out = verdict(capsys, ch10.check_block_hashes, answer)
    assert out.startswith("❌ [10.1]") and hint in out, out


def test_block_hashes_kept_between_blocks_or_calls_get_a_hint_naming_the_memo(capsys):
    """A memo keyed by less than what names a block gives hashes a stateless slip would
    give too (not chained; extra keys forgotten): the hint must name the memo, found by
    asking the same text again under token ids the function has never seen."""
    out = verdict(capsys, ch10.check_block_hashes, memo_by_block)
    assert "'the same 3 tokens, four times over (block size 3)': block 1's" in out, out
    assert "block 1 got block 0's hash" in out and "leaves out the parent" in out, out
    assert "not chained on the parent" not in out, out
    out = verdict(capsys, ch10.check_block_hashes, memo_by_tokens)
    assert "extra keys ('lora-2',)': block 0's hash differs" in out, out
    assert "remembers hashes between calls" in out and "extra keys forgotten" not in out, out
    # a stateless slip keeps its own hint
    out = verdict(capsys, ch10.check_block_hashes, lambda t, b, e=(): chain(t, b, e,
                                                                           extra=False))
    assert "extra keys forgotten" in out and "remembers" not in out, out


def test_block_hashes_right_answers(capsys):
    assert verdict(capsys, ch10.check_block_hashes, hashes_ok).startswith("✅ [10.1]")
    out = verdict(capsys, ch10.check_block_hashes, pc.block_hashes)
    assert out.startswith("❌ [10.1]") and "you passed the library's block_hashes" in out
    out = verdict(capsys, ch10.check_block_hashes,
                  lambda t, b, e=(): pc.block_hashes(t, b, e))
    assert out.startswith("❌ [10.1]") and "called the library's block_hashes" in out


def test_block_hashes_not_attempted(capsys):
    def todo(*args):
        raise NotImplementedError

    assert verdict(capsys, ch10.check_block_hashes, todo).startswith("⏳ [10.1]")


# ---------------------------------------------------------------- 10.2 longest_cache_hit


def hit(hashes, lookup, num_tokens, block_size, *, cap=None, past_miss=False,
        falsy_miss=False):
    limit = (num_tokens - 1) // block_size if cap is None else cap(num_tokens, block_size)
    out = []
    for h in hashes[:max(limit, 0)]:
        b = lookup(h)
        if b is None or (falsy_miss and not b):
            if past_miss:
                continue
            break
        out.append(b)
    return out


@pytest.mark.parametrize("answer,hint", [
    (lambda h, f, n, b: hit(h, f, n, b, past_miss=True), "past the first miss"),
    (lambda h, f, n, b: hit(h, f, n, b, cap=lambda n, s: n // s),
     "its last token must still be computed (its logits give the first new token): the "
     "prompt's last token (token 4, counting from 0) is in block 0, a full block"),
    (lambda h, f, n, b: hit(h, f, n, b, cap=lambda n, s: n // s - 1),
     "cached: every full block: expected [0], got []"),
    # deriving the cap from "the last prompt token is computed": the plausible other rules
    (lambda h, f, n, b: (lambda out: out[:-1] if out and len(out) == len(h) else out)(
        hit(h, f, n, b, cap=lambda n, s: n // s)),
     "the prompt's last token (token 5, counting from 0) is in block 1, part-filled"),
    (lambda h, f, n, b: hit(h, f, n, b, cap=lambda n, s: n // s)[:-1],
     "you stopped after 0 hit(s), the library reads 1"),
    (lambda h, f, n, b: hit(h, f, n, b, cap=lambda n, s: (n - 2) // s),  # (k+1)*s < n-1
     "you stopped after 0 hit(s), the library reads 1"),
    (lambda h, f, n, b: hit(h, f, n, b, falsy_miss=True), "it passes when no cached block is "
     "physical block 0"),
    (lambda h, f, n, b: len(hit(h, f, n, b)), "not how many"),
    (lambda h, f, n, b: hit([x.value for x in h], f, n, b), "pass lookup the BlockHash itself"),
    (lambda h, f, n, b: hit(h, f, n, b)[::-1], "in the order of the hashes"),
    (lambda h, f, n, b: [x for x in hit(h, f, n, b) if x != 0] + [0] * (0 in hit(h, f, n, b)),
     "block 0 is a block like any other"),
])
def test_longest_cache_hit_wrong_answers(capsys, answer, hint):
    out = verdict(capsys, ch10.check_longest_cache_hit, answer)
    assert out.startswith("❌ [10.2]") and hint in out, out


def test_longest_cache_hit_right_answers(capsys):
    assert verdict(capsys, ch10.check_longest_cache_hit, hit).startswith("✅ [10.2]")
    out = verdict(capsys, ch10.check_longest_cache_hit, pc.longest_cache_hit)
    assert out.startswith("❌ [10.2]") and "you passed the library's longest_cache_hit" in out


# ---------------------------------------------------------------- 10.3 the free queue


class QueueOk(FreeBlockQueue):
    def popleft(self):
        block = self.next[self.HEAD]
        if block == self.TAIL:
            raise IndexError("popleft from an empty queue")
        self.remove(block)
        return block

    def remove(self, block_id):
        if block_id not in self.next or block_id in (self.HEAD, self.TAIL):
            raise ValueError(f"block {block_id} is not in the queue")
        before, after = self.prev.pop(block_id), self.next.pop(block_id)
        self.next[before], self.prev[after] = after, before
        self._len -= 1


class PopNoPrev(QueueOk):
    def popleft(self):
        block = self.next[self.HEAD]
        if block == self.TAIL:
            raise IndexError("empty")
        after = self.next.pop(block)
        del self.prev[block]
        self.next[self.HEAD] = after  # prev[after] still names the block taken
        self._len -= 1
        return block


class PopKeepsEntries(QueueOk):
    def popleft(self):
        block = self.next[self.HEAD]
        if block == self.TAIL:
            raise IndexError("empty")
        after = self.next[block]
        self.next[self.HEAD], self.prev[after] = after, self.HEAD
        self._len -= 1
        return block


class PopTail(QueueOk):
    def popleft(self):
        block = self.prev[self.TAIL]
        if block == self.HEAD:
            raise IndexError("empty")
        self.remove(block)
        return block


class PopNoLen(QueueOk):
    def popleft(self):
        block = QueueOk.popleft(self)
        self._len += 1
        return block


class PopEmptyReturnsTail(QueueOk):
    def popleft(self):
        block = self.next[self.HEAD]
        if block != self.TAIL:
            self.remove(block)
        return block


class PopEmptyKeyError(QueueOk):
    def popleft(self):
        block = self.next[self.HEAD]
        before, after = self.prev.pop(block), self.next.pop(block)
        self.next[before], self.prev[after] = after, before
        self._len -= 1
        return block


class RemoveNoRelink(QueueOk):
    def remove(self, block_id):
        if block_id not in self.next or block_id in (self.HEAD, self.TAIL):
            raise ValueError("not queued")
        del self.prev[block_id], self.next[block_id]
        self._len -= 1


class RemoveOnlyNext(QueueOk):
    def remove(self, block_id):
        if block_id not in self.next or block_id in (self.HEAD, self.TAIL):
            raise ValueError("not queued")
        before, after = self.prev.pop(block_id), self.next.pop(block_id)
        self.next[before] = after
        self._len -= 1


class RemoveByListRemove(QueueOk):
    def remove(self, block_id):
        order = list(self)
        order.remove(block_id)  # ValueError when absent, as asked
        self.next, self.prev = {self.HEAD: self.TAIL}, {self.TAIL: self.HEAD}
        self._len = 0
        for b in order:
            self.append(b)


class RemoveByWalk(QueueOk):
    def remove(self, block_id):
        node = self.HEAD
        while self.next[node] != block_id:
            node = self.next[node]
            if node == self.TAIL:
                raise ValueError("not queued")
        after = self.next.pop(block_id)
        del self.prev[block_id]
        self.next[node], self.prev[after] = after, node
        self._len -= 1


class RemoveWithList(QueueOk):
    """Links kept right, plus a list beside them: its list.remove scans."""

    def append(self, block_id):
        super().append(block_id)
        self.__dict__.setdefault("order", []).append(block_id)

    def remove(self, block_id):
        QueueOk.remove(self, block_id)
        self.order.remove(block_id)


class RemoveUnchecked(QueueOk):
    def remove(self, block_id):
        before, after = self.prev.pop(block_id, None), self.next.pop(block_id, None)
        if before is not None:
            self.next[before], self.prev[after] = after, before
        self._len -= 1


class RemoveKeyError(QueueOk):
    def remove(self, block_id):
        before, after = self.prev.pop(block_id), self.next.pop(block_id)
        self.next[before], self.prev[after] = after, before
        self._len -= 1


class InheritsPopleft(FreeBlockQueue):
    def remove(self, block_id):
        QueueOk.remove(self, block_id)


class DelegatesToSuper(QueueOk):
    def popleft(self):
        return super(QueueOk, self).popleft()


class DelegatesRemove(QueueOk):
    def remove(self, block_id):
        return super(QueueOk, self).remove(block_id)


class RemoveSpecialCasesHead(QueueOk):
    """Head, tail and middle handled apart; the head case forgets the new head's prev."""

    def remove(self, block_id):
        if block_id not in self.next or block_id in (self.HEAD, self.TAIL):
            raise ValueError("not queued")
        before, after = self.prev.pop(block_id), self.next.pop(block_id)
        if before == self.HEAD:
            self.next[self.HEAD] = after
        elif after == self.TAIL:
            self.prev[self.TAIL], self.next[before] = before, self.TAIL
        else:
            self.next[before], self.prev[after] = after, before
        self._len -= 1


class RemoveSpecialCasesTail(QueueOk):
    """Head, tail and middle handled apart; the tail case forgets the new tail's next."""

    def remove(self, block_id):
        if block_id not in self.next or block_id in (self.HEAD, self.TAIL):
            raise ValueError("not queued")
        before, after = self.prev.pop(block_id), self.next.pop(block_id)
        if after == self.TAIL:
            self.prev[self.TAIL] = before
        else:
            self.next[before], self.prev[after] = after, before
        self._len -= 1


class RemoveKeepsEntries(QueueOk):
    """Relinks the neighbours, but the block keeps its own next/prev entries."""

    def remove(self, block_id):
        if block_id not in self.next or block_id in (self.HEAD, self.TAIL):
            raise ValueError("not queued")
        before, after = self.prev[block_id], self.next[block_id]
        self.next[before], self.prev[after] = after, before
        self._len -= 1


@pytest.mark.parametrize("answer,hint", [
    (RemoveSpecialCasesHead, "step 1 remove(7) on [7, 3, 9, 1, 5]: prev[3] is 7"),
    (RemoveSpecialCasesHead, "prev of the block after it must point at the block before it"),
    (RemoveSpecialCasesTail, "step 2 remove(5) on [3, 9, 1, 5]: next[1] is 5"),
    (RemoveSpecialCasesTail, "next of the block before it must point at the block after it"),
    (RemoveKeepsEntries, "step 1 remove(7) on [7, 3, 9, 1, 5]: block(s) [7]"),
    (RemoveKeepsEntries, "still have next/prev entries"),
    (PopNoPrev, "popleft did not unlink the new head's prev"),
    (PopKeepsEntries, "still have next/prev entries"),
    (PopTail, "not the tail"),
    (PopNoLen, "keep _len in step"),
    (PopEmptyReturnsTail, "popleft on an empty queue raises IndexError"),
    (PopEmptyKeyError, "popleft on an empty queue raises IndexError"),
    (RemoveNoRelink, "remove left a neighbour pointing at the removed block"),
    (RemoveOnlyNext, "prev of the block after it must point at the block before it"),
    (RemoveByListRemove, "remove is O(n)"),
    (RemoveByWalk, "remove is O(n)"),
    (RemoveWithList, "remove is O(n)"),
    (RemoveUnchecked, "raises ValueError"),
    (RemoveKeyError, "raises ValueError"),
    (InheritsPopleft, "no popleft of its own"),
    (DelegatesToSuper, "called the library's FreeBlockQueue.popleft"),
    (DelegatesRemove, "called the library's FreeBlockQueue.remove"),
    (QueueOk(), "expected a subclass of FreeBlockQueue"),
])
def test_free_queue_wrong_answers(capsys, answer, hint):
    out = verdict(capsys, ch10.check_free_queue, answer)
    assert out.startswith("❌ [10.3]") and hint in out, out


def test_free_queue_right_answer_and_twins_put_back(capsys):
    assert verdict(capsys, ch10.check_free_queue, QueueOk).startswith("✅ [10.3]")
    out = verdict(capsys, ch10.check_free_queue, FreeBlockQueue)
    assert out.startswith("❌ [10.3]"), out
    q = FreeBlockQueue(range(3))  # both twins work again after the checks
    q.remove(1)
    assert q.popleft() == 0 and list(q) == [2]


# ---------------------------------------------------------------- the worked example


def test_worked_example_is_vllms():
    frames = demo.worked_example()
    by_time = {f.title.split(":")[0]: f for f in frames}
    assert by_time["time 4"].hits == {"request 1": [0, 1]}
    assert by_time["time 6"].free_queue == [7, 8, 9, 4, 3, 2, 6, 5, 1, 0]
    last = by_time["time 7"]
    assert last.hits == {"request 2": [0, 1, 2]}
    assert last.tables["request 2"] == [0, 1, 2, 7, 8, 9, 4, 3] and last.evicted == [3]
    assert last.free_queue == [6, 5]
    assert demo.worked_example(free_queue_cls=QueueOk) == frames


# ---------------------------------------------------------------- 10.4 allocate_slots


def alloc(pool, token_ids, hashes, block_size, max_new_tokens, *, cap=True, touch_first=True,
          head=True, evict=True, register="full", by_value=False, budget=True,
          incref=True, dedupe_list=False, unqueue=True, past_miss=False, drop_empty=True,
          evict_oldest=False, cap_minus_one=False, budget_counts_hit=False,
          uncached_first=False, evict_value=False, no_duplicates=False, index_miss=False,
          unqueue_held=False, pop_strict=False, misalign=False, only_fresh=False,
          chunk_from_zero=False):
    """A new request's table, with one rule swappable, to build the wrong answers."""
    queue, refs = pool.free_block_queue, pool.ref_counts

    def lookup(h):
        for b in pool.cached_blocks[h.value] if index_miss else pool.cached_blocks.get(h.value, []):
            if by_value or pool.block_hash[b] == h:
                return b
        return None

    blocks = []
    limit = (len(token_ids) - 1) // block_size if cap else len(token_ids) // block_size
    if cap_minus_one:  # "leave the last full block for the last token"
        limit = max(len(token_ids) // block_size - 1, 0)
    for h in hashes[:limit]:
        b = lookup(h)
        if b is None:
            if past_miss:
                continue
            break
        blocks.append(b)
    computed = len(blocks) * block_size
    end = computed + (min(len(token_ids) - computed, max_new_tokens) if budget
                      else len(token_ids) - computed)
    if budget_counts_hit:  # the budget read as counting the hit's tokens too
        end = min(len(token_ids), max(max_new_tokens, computed))
    if chunk_from_zero and max_new_tokens < len(token_ids) - computed:  # not after the hit
        end = max_new_tokens

    def take_hits():
        for b in blocks[:computed // block_size]:
            if (refs[b] == 0 or unqueue_held) and unqueue:
                queue.remove(b)
            refs[b] = refs[b] + 1 if incref else 1

    if touch_first:
        take_hits()
    while len(blocks) * block_size < end:
        spare = next((x for x in queue if x not in pool.block_hash), None)
        if uncached_first and spare is not None:  # spare the cache: an uncached block first
            queue.remove(spare)
            refs[spare] = 1
            blocks.append(spare)
            continue
        b = queue.popleft() if head else list(queue)[-1]
        if not head:
            queue.remove(b)
        old = (pool.block_hash.pop(b) if pop_strict else pool.block_hash.pop(b, None)) \
            if evict else None
        if old is not None:
            same = pool.cached_blocks[old.value]
            if evict_value:  # the whole value dropped, the other copies with it
                same.clear()
            elif evict_oldest:  # the list's first block, not the one evicted
                same.pop(0)
            else:
                same.remove(b)
            if not same and drop_empty:
                del pool.cached_blocks[old.value]
        refs[b] = 1
        blocks.append(b)
    if not touch_first:
        take_hits()
    n = {"full": end // block_size, "partial": -(-end // block_size), "none": 0}[register]
    for b, h in zip(blocks[computed // block_size * misalign:n], hashes, strict=False):
        if pool.block_hash.get(b) != h:
            if no_duplicates and pool.lookup(h) is not None:
                continue  # "the hash is cached already"
            pool.block_hash[b] = h
            if dedupe_list:
                pool.cached_blocks[h.value] = [b]
            else:
                pool.cached_blocks.setdefault(h.value, []).append(b)
    return blocks[computed // block_size * only_fresh:], computed


def alloc_by_shifts(pool, token_ids, hashes, block_size, max_new_tokens):
    """Right at block sizes that are powers of two: blocks counted with shifts."""
    shift = block_size.bit_length() - 1
    return alloc(pool, token_ids, hashes, 1 << shift, max_new_tokens)


def alloc_evicting_with_the_pool(pool, token_ids, hashes, block_size, max_new_tokens):
    """Evicts each fresh block through the pool's own _evict."""
    popleft = pool.free_block_queue.popleft

    def popleft_evicting():
        block = popleft()
        pool._evict(block)
        return block

    pool.free_block_queue.popleft = popleft_evicting
    return alloc(pool, token_ids, hashes, block_size, max_new_tokens, evict=False)


def alloc_with_pool_methods(pool, token_ids, hashes, block_size, max_new_tokens):
    blocks = []
    for h in hashes[:(len(token_ids) - 1) // block_size]:
        b = pool.lookup(h)
        if b is None:
            break
        blocks.append(b)
    for b in blocks:
        pool.touch(b)
    return blocks, len(blocks) * block_size


@pytest.mark.parametrize("answer,hint", [
    (lambda *a: alloc(*a, cap=False), "a full hit: every block is cached"),
    (lambda *a: alloc(*a, touch_first=False), "must leave the free queue before any fresh"),
    # a hit left in the queue is popped as a fresh block, or stays listed as free
    (lambda *a: alloc(*a, unqueue=False), "a hit on a block with ref count 0"),
    (lambda *a: alloc(*a, head=False), "from the head of the free queue"),
    (lambda *a: alloc(*a, evict=False), "loses its old hash (eviction)"),
    (lambda *a: alloc(*a, register="partial"), "the chunk ends mid-block"),
    (lambda *a: alloc(*a, register="none"), "a request admitted later in the same step"),
    (lambda *a: alloc(*a, by_value=True), "compare the whole BlockHash"),
    (lambda *a: alloc(*a, budget=False), "the rest of a chunked prompt takes its blocks"),
    (lambda *a: alloc(*a, incref=False), "a hit takes one more reference"),
    (lambda *a: alloc(*a, dedupe_list=True), "oldest first"),
    (lambda *a: alloc(*a, past_miss=True), "a hit must be a leading run: after a miss"),
    (lambda *a: alloc(*a, drop_empty=False),
     "a hash with no block left must be deleted from cached_blocks"),
    (lambda *a: alloc(*a)[0], "return a pair"),
    (lambda *a: alloc(*a, evict_oldest=True), "take out the very block evicted"),
    # wrong rules a learner deriving the allocation from the pool's invariants may write
    (lambda *a: alloc(*a, cap_minus_one=True),
     "your hit stops after 0 block(s), the library's after 1"),
    (lambda *a: alloc(*a, budget_counts_hit=True),
     "after its hit of 6 tokens this request computes 2 now (its budget counts only"),
    (lambda *a: alloc(*a, uncached_first=True), "fresh block 1 is 24 in yours, 22 in the "
     "library's, which comes first in the free queue"),
    (lambda *a: alloc(*a, evict_value=True),
     "block 2 is still cached (block_hash), but cached_blocks no longer lists it"),
    (alloc_by_shifts, "block size 3 (not a power of two)', call 2"),
    (lambda *a: alloc(*a, no_duplicates=True),
     "even though it holds the same K/V as block 23, cached before"),
    # the fresh blocks cached under the text's first hashes, the hit's not counted
    (lambda *a: alloc(*a, misalign=True), "hashes[i] names block i of the table"),
    (lambda *a: alloc(*a, only_fresh=True), "the hit's blocks first, then the fresh ones"),
    # crashes, told with the pool and the call: cached_blocks[value] on a miss, a hit held
    # by another table taken out of the free queue, block_hash.pop(block) of an uncached block
    (lambda *a: alloc(*a, index_miss=True), "yours KeyError("),
    (lambda *a: alloc(*a, index_miss=True), "pool.lookup(h) is None then"),
    (lambda *a: alloc(*a, unqueue_held=True), "only when its count is 0"),
    (lambda *a: alloc(*a, pop_strict=True), "pool.block_hash.pop(block, None)"),
])
def test_allocate_slots_wrong_answers(capsys, answer, hint):
    out = verdict(capsys, ch10.check_allocate_slots, answer)
    assert out.startswith("❌ [10.4]") and hint in out, out
    assert "the pool holds" in out or "serving" in out, out  # the state that exposed it


def test_allocate_slots_right_answer_and_twins(capsys):
    assert verdict(capsys, ch10.check_allocate_slots, alloc).startswith("✅ [10.4]")
    out = verdict(capsys, ch10.check_allocate_slots, alloc_with_pool_methods)
    assert out.startswith("❌ [10.4]") and "PrefixCachingAllocator.touch" in out, out
    out = verdict(capsys, ch10.check_allocate_slots, pc.allocate_slots)
    assert out.startswith("❌ [10.4]") and "you passed the library's allocate_slots" in out
    out = verdict(capsys, ch10.check_allocate_slots, alloc_evicting_with_the_pool)
    assert out.startswith("❌ [10.4]") and "PrefixCachingAllocator._evict" in out, out
    pool = pc.PrefixCachingAllocator(4)  # the pool's methods work again after the check
    b = pool.allocate()
    pool.cache_block(b, pc.block_hashes([1, 2], 2)[0])
    pool.touch(b)
    assert pool.ref_counts[b] == 2


def test_allocate_slots_story_names_the_state(capsys):
    out = verdict(capsys, ch10.check_allocate_slots, lambda *a: alloc(*a, cap=False))
    assert "edge state 'two blocks cached under one hash" in out, out
    assert "free queue (head first)" in out and "a full hit" in out, out


def test_allocate_slots_stories_of_the_new_states(capsys):
    out = verdict(capsys, ch10.check_allocate_slots, lambda *a: alloc(*a, past_miss=True))
    assert "edge state 'LRU eviction took a prefix's first block" in out, out
    assert "the library answers ([1, 2], 0), yours ([1, 2, 6, 5], 8)" in out, out
    out = verdict(capsys, ch10.check_allocate_slots, lambda *a: alloc(*a, drop_empty=False))
    assert "cached_blocks (blocks per hash value): the library's one each, yours one each, " \
           "2 hash value(s) kept with an empty list" in out, out
