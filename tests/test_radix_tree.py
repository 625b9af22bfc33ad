"""The radix tree: hand-checked insert / match / split / lock / evict cases, then random
operations checked against a brute-force model (the set of cached prefixes)."""

from __future__ import annotations

import random

import pytest

from paged_lib.studies.radix_tree import RadixTree


def check_sizes(tree: RadixTree) -> None:
    """The running counters agree with a walk over the nodes."""
    nodes = tree._nodes()
    assert tree.total_size() == sum(len(n.key) for n in nodes)
    assert tree.evictable_size() == sum(len(n.key) for n in nodes if n.lock_ref == 0)
    assert tree.protected_size() == sum(len(n.key) for n in nodes if n.lock_ref > 0)
    for n in nodes:
        assert len(n.key) == len(n.value) and len(n.key) % tree.page_size == 0 and n.key
        assert n.parent.lock_ref >= n.lock_ref or n.parent is tree.root
        assert n.parent.last_access_time >= n.last_access_time


# ---------------------------------------------------------------- insert and match


def test_empty_tree_matches_nothing_at_the_root():
    tree = RadixTree()
    values, node = tree.match_prefix([1, 2, 3])
    assert values == [] and node is tree.root and tree.total_size() == 0


def test_insert_then_match_returns_the_values_of_the_longest_cached_prefix():
    tree = RadixTree()
    assert tree.insert([1, 2, 3, 4], [10, 11, 12, 13]) == 0
    values, node = tree.match_prefix([1, 2, 3, 4, 5, 6])
    assert values == [10, 11, 12, 13] and tree.key_of(node) == [1, 2, 3, 4]
    assert tree.match_prefix([2, 3])[0] == []
    check_sizes(tree)


def test_a_partial_match_splits_the_node_and_the_lower_half_keeps_its_identity():
    tree = RadixTree()
    tree.insert([1, 2, 3, 4], [10, 11, 12, 13])
    _, leaf = tree.match_prefix([1, 2, 3, 4])
    values, node = tree.match_prefix([1, 2, 9])
    assert values == [10, 11] and node.key == [1, 2]
    assert leaf.key == [3, 4] and leaf.parent is node and tree.key_of(leaf) == [1, 2, 3, 4]
    assert tree.total_size() == 4  # a split moves tokens, it adds none
    check_sizes(tree)


def test_insert_shares_the_cached_prefix_and_reports_its_length():
    tree = RadixTree()
    tree.insert([1, 2, 3, 4], [10, 11, 12, 13])
    assert tree.insert([1, 2, 7, 8, 9], [20, 21, 22, 23, 24]) == 2
    assert tree.total_size() == 7  # 4 + the 3 new tokens
    assert tree.match_prefix([1, 2, 7, 8, 9])[0] == [10, 11, 22, 23, 24]  # the tree's own
    assert tree.match_prefix([1, 2, 3, 4])[0] == [10, 11, 12, 13]
    assert tree.insert([1, 2, 3], [0, 0, 0]) == 3 and tree.total_size() == 7
    check_sizes(tree)
    assert tree.pretty().splitlines() == [  # the insert of [1, 2, 3] split [3, 4]
        "[1, 2] lock_ref=0", "  [3] lock_ref=0", "    [4] lock_ref=0", "  [7, 8, 9] lock_ref=0"]


def test_page_size_matches_and_inserts_whole_pages_only():
    tree = RadixTree(page_size=4)
    shared = list(range(10))
    assert tree.insert(shared + [50, 51], list(range(100, 112))) == 0  # 12 = 3 pages
    assert tree.total_size() == 12
    values, node = tree.match_prefix(shared + [60, 61, 62])
    assert values == list(range(100, 108)) and len(tree.key_of(node)) == 8
    assert tree.insert([1, 2, 3], [0, 0, 0]) == 0 and tree.total_size() == 12  # < 1 page
    check_sizes(tree)


def test_page_size_one_vs_four_on_a_ten_token_shared_prefix():
    shared = list(range(10))
    for page_size, hit in ((1, 10), (4, 8)):
        tree = RadixTree(page_size=page_size)
        tree.insert(shared + [90, 91, 92, 93, 94, 95], list(range(16)))
        assert len(tree.match_prefix(shared + [70, 71, 72, 73, 74, 75])[0]) == hit


# ---------------------------------------------------------------- locks and eviction


def test_evict_frees_least_recently_used_leaves_first():
    tree = RadixTree()
    tree.insert([1, 1], [10, 11])
    tree.insert([2, 2], [20, 21])
    tree.insert([3, 3], [30, 31])
    tree.match_prefix([1, 1])  # [1, 1] is now the most recent
    assert tree.evict(1) == [20, 21]  # whole nodes: asked 1, freed 2
    assert tree.evict(2) == [30, 31]
    assert tree.match_prefix([1, 1])[0] == [10, 11] and tree.total_size() == 2
    check_sizes(tree)


def test_locked_nodes_and_their_ancestors_are_never_evicted():
    tree = RadixTree()
    tree.insert([1, 2, 3], [10, 11, 12])
    tree.insert([1, 2, 4], [0, 0, 13])
    _, node = tree.match_prefix([1, 2, 3])
    assert tree.inc_lock_ref(node) == -3 and tree.evictable_size() == 1
    assert tree.evict(100) == [13]  # only the unlocked sibling goes
    assert tree.total_size() == 3 and tree.protected_size() == 3
    assert tree.dec_lock_ref(node) == 3 and tree.evictable_size() == 3
    assert sorted(tree.evict(100)) == [10, 11, 12] and tree.total_size() == 0
    check_sizes(tree)


def test_two_users_of_a_node_both_have_to_let_go():
    tree = RadixTree()
    tree.insert([5, 6], [50, 60])
    _, node = tree.match_prefix([5, 6])
    tree.inc_lock_ref(node)
    assert tree.inc_lock_ref(node) == 0  # already protected
    assert tree.dec_lock_ref(node) == 0 and tree.evict(2) == []
    tree.dec_lock_ref(node)
    assert tree.evict(2) == [50, 60]


def test_a_parent_left_without_children_becomes_a_leaf_and_is_evicted_next():
    tree = RadixTree()
    tree.insert([1, 2, 3], [10, 11, 12])
    tree.insert([1, 2, 4], [0, 0, 13])
    tree.insert([7], [70])
    tree.match_prefix([7])  # [7] is the most recent; the [1, 2] family is older
    assert tree.evict(4) == [12, 13, 10, 11]  # both leaves, then their parent [1, 2]
    assert tree.total_size() == 1 and tree.match_prefix([7])[0] == [70]


def test_split_node_copies_the_lock_so_unlocking_stays_balanced():
    tree = RadixTree()
    tree.insert([1, 2, 3, 4], [10, 11, 12, 13])
    _, leaf = tree.match_prefix([1, 2, 3, 4])
    tree.inc_lock_ref(leaf)
    tree.match_prefix([1, 2, 9])  # splits the locked node
    check_sizes(tree)
    assert tree.protected_size() == 4 and tree.evict(10) == []
    tree.dec_lock_ref(leaf)
    assert tree.evictable_size() == 4 and sorted(tree.evict(10)) == [10, 11, 12, 13]


# ---------------------------------------------------------------- bad input


def test_bad_input_raises_value_error_and_changes_nothing():
    tree = RadixTree()
    tree.insert([1, 2], [10, 11])
    _, node = tree.match_prefix([1, 2])
    before = tree.pretty(), tree.total_size(), tree.evictable_size()
    with pytest.raises(ValueError, match="one value per token"):
        tree.insert([1, 2, 3], [1])
    with pytest.raises(ValueError, match="ints"):
        tree.match_prefix([1.5])
    with pytest.raises(ValueError, match=">= 0"):
        tree.insert([-1], [0])
    with pytest.raises(ValueError, match="inc_lock_ref before"):
        tree.dec_lock_ref(node)
    with pytest.raises(ValueError, match="num_tokens"):
        tree.evict(-1)
    with pytest.raises(ValueError, match="not in this tree"):
        RadixTree().inc_lock_ref(node)
    assert (tree.pretty(), tree.total_size(), tree.evictable_size()) == before
    tree.evict(2)
    with pytest.raises(ValueError, match="not in this tree"):
        tree.inc_lock_ref(node)  # evicted
    for bad in (0, -2, 1.0):
        with pytest.raises(ValueError, match="page_size"):
            RadixTree(page_size=bad)


# ---------------------------------------------------------------- random ops vs a model


class Model:
    """The brute-force twin: every cached prefix (a tuple of whole pages) with its value
    list, its last-use time, and the locked prefixes (a list: one entry per lock)."""

    def __init__(self, page_size: int):
        self.p = page_size
        self.values: dict[tuple[int, ...], list[int]] = {(): []}
        self.time: dict[tuple[int, ...], int] = {(): 0}
        self.locks: list[tuple[int, ...]] = []
        self.clock = 0

    def pages(self, tokens):
        return [tuple(tokens[:k]) for k in range(self.p, len(tokens) + 1, self.p)]

    def match(self, tokens):
        self.clock += 1
        best = ()
        for prefix in self.pages(tokens):
            if prefix not in self.values:
                break
            best = prefix
            self.time[prefix] = self.clock
        return best

    def insert(self, tokens, values):
        self.clock += 1
        old = 0
        for prefix in self.pages(tokens):
            if prefix in self.values:
                old = len(prefix)
            else:
                self.values[prefix] = self.values[prefix[:-self.p]] + values[len(prefix) - self.p:
                                                                           len(prefix)]
            self.time[prefix] = self.clock
        return old

    def protected(self):
        return {q for lock in self.locks for q in self.pages(lock)}

    def total(self):
        return self.p * (len(self.values) - 1)

    def evictable(self):
        return self.total() - self.p * len(self.protected())


def tree_prefixes(tree: RadixTree) -> set[tuple[int, ...]]:
    out = {()}
    for node in tree._nodes():
        key = tree.key_of(node)
        out |= {tuple(key[:k]) for k in range(tree.page_size, len(key) + 1, tree.page_size)}
    return out


@pytest.mark.parametrize("page_size", [1, 2, 3])
@pytest.mark.parametrize("seed", range(6))
def test_random_operations_agree_with_the_set_of_cached_prefixes(page_size, seed):
    rng = random.Random(seed)
    tree, model = RadixTree(page_size), Model(page_size)
    locked = []  # (node, prefix) per lock held
    next_value = 0
    for _ in range(150):
        op = rng.choice(["insert", "insert", "match", "lock", "unlock", "evict"])
        tokens = [rng.randrange(3) for _ in range(rng.randrange(10))]
        if op == "insert":
            values = list(range(next_value, next_value + len(tokens)))
            next_value += len(tokens)
            assert tree.insert(tokens, values) == model.insert(tokens, values)
        elif op in ("match", "lock"):
            values, node = tree.match_prefix(tokens)
            best = model.match(tokens)
            assert values == model.values[best] and tuple(tree.key_of(node)) == best
            if op == "lock":
                tree.inc_lock_ref(node)
                model.locks.append(best)
                locked.append(node)
        elif op == "unlock" and locked:
            i = rng.randrange(len(locked))
            tree.dec_lock_ref(locked.pop(i))
            model.locks.pop(i)
        elif op == "evict":
            num = rng.randrange(8)
            evictable = model.evictable()
            freed = tree.evict(num)
            after = tree_prefixes(tree)
            gone = set(model.values) - after
            assert after <= set(model.values) and not gone & model.protected()
            assert len(freed) >= min(num, evictable) and len(freed) == page_size * len(gone)
            assert sorted(freed) == sorted(v for q in gone for v in model.values[q][-page_size:])
            if gone:  # LRU: nothing evicted was used later than an unlocked leaf kept
                leaves = {q for q in after if q and not any(
                    r[:len(q)] == q and len(r) > len(q) for r in after)} - model.protected()
                assert all(max(model.time[q] for q in gone) <= model.time[q] for q in leaves)
            for q in gone:
                del model.values[q], model.time[q]
        assert tree_prefixes(tree) == set(model.values)
        assert tree.total_size() == model.total()
        assert tree.evictable_size() == model.evictable()
        check_sizes(tree)
