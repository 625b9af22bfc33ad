"""A radix tree of cached prefixes: SGLang's RadixAttention, in pure Python.

SGLang (Zheng et al., arXiv:2312.07104, section 3) keeps the KV cache of finished requests
in a *radix tree*: a trie whose edges hold runs of token ids, so a path from the root
spells a token sequence, and each node holds the KV slots of the tokens on the edge into
it. A new request walks its prompt down the tree (:meth:`RadixTree.match_prefix`) and
reuses the slots of the longest cached prefix; when it finishes, its tokens go into the
tree (:meth:`RadixTree.insert`), sharing every node an earlier request already made.

Three rules keep the tree honest:

* **Split on a partial match.** A match (or an insert) that ends inside an edge cuts that
  node in two, so every match ends exactly at a node. The lower half keeps its identity:
  a node handed out earlier still stands for the same tokens.
* **Locks.** A running request holds the node its match ended at with
  :meth:`~RadixTree.inc_lock_ref`, which counts one more user on every node up to the
  root; :meth:`~RadixTree.evict` never frees a node whose count is above 0.
* **LRU leaves first.** :meth:`~RadixTree.evict` frees the unlocked leaves used longest
  ago, one whole node at a time; a parent whose last child went becomes a leaf and may go
  next (a prefix is never freed while a longer cached sequence still needs it).

Granularity: ``page_size=1`` (SGLang's default) matches token by token. With
``page_size > 1`` keys are compared a page at a time: only whole pages are inserted and a
match is rounded down to whole pages, which is what vLLM's block hashes give at
``block_size == page_size`` (chapter 10 compares the two at equal granularity).

Time is a counter, not a clock, so the order of evictions is the same on every machine.
The values are whatever the caller stores per token (here: KV slot ids); the tree never
frees memory itself, :meth:`~RadixTree.evict` returns the values it dropped.
"""

from __future__ import annotations

import heapq
import operator
from collections.abc import Sequence
from itertools import count


class TreeNode:
    """One node: the token run ``key`` on the edge from ``parent``, their ``value`` (one
    per token), the users holding it (``lock_ref``) and when it was last used."""

    __slots__ = ("id", "key", "value", "parent", "children", "lock_ref", "last_access_time")

    def __init__(self, node_id: int, key: list[int], value: list[int],
                 parent: TreeNode | None, last_access_time: int):
        self.id = node_id
        self.key = key
        self.value = value
        self.parent = parent
        self.children: dict[int | tuple[int, ...], TreeNode] = {}
        self.lock_ref = 0
        self.last_access_time = last_access_time

    def __repr__(self) -> str:
        return (f"TreeNode(id={self.id}, key={self.key}, lock_ref={self.lock_ref}, "
                f"last_access_time={self.last_access_time})")


class RadixTree:
    """Cached token sequences in a compressed trie (see the module docstring)."""

    def __init__(self, page_size: int = 1):
        if not isinstance(page_size, int) or page_size < 1:
            raise ValueError(f"page_size must be an int >= 1, got {page_size!r}")
        self.page_size = page_size
        self._ids = count()
        self._clock = 0
        self.root = TreeNode(next(self._ids), [], [], None, 0)
        self.root.lock_ref = 1  # the root is never evicted
        self._evictable = 0
        self._protected = 0

    # ------------------------------------------------------------------ lookups

    def match_prefix(self, tokens: Sequence[int]) -> tuple[list[int], TreeNode]:
        """Values of the longest cached prefix of ``tokens``, and the node it ends at.

        The match is a whole number of pages; the root is returned when nothing matches.
        A match that ends inside an edge splits that node. Every node on the path counts
        as used now (for LRU).
        """
        tokens = self._check_tokens(tokens)
        tokens = tokens[: len(tokens) - len(tokens) % self.page_size]
        self._clock += 1
        node, values, i = self.root, [], 0
        node.last_access_time = self._clock
        while i < len(tokens) and self._child_key(tokens, i) in node.children:
            child = node.children[self._child_key(tokens, i)]
            n = self._match_len(child.key, tokens, i)
            if n < len(child.key):
                child = self._split(child, n)  # the unmatched rest keeps its old time
            child.last_access_time = self._clock
            values += child.value
            node, i = child, i + n
        return values, node

    def insert(self, tokens: Sequence[int], values: Sequence[int]) -> int:
        """Cache ``tokens`` (whole pages only) with one value per token.

        Returns how many leading tokens were cached already. The tree keeps its own values
        for those (and for a last part page it does not store), so the caller still owns
        ``values[:returned]`` and ``values[stored:]`` and frees them unless they are the
        very values the tree holds (a request that reused a match passes those back).
        """
        tokens = self._check_tokens(tokens)
        values = list(values)
        if len(values) != len(tokens):
            raise ValueError(f"insert needs one value per token: {len(tokens)} tokens, "
                             f"{len(values)} values")
        end = len(tokens) - len(tokens) % self.page_size
        self._clock += 1
        node, i = self.root, 0
        node.last_access_time = self._clock
        while i < end and self._child_key(tokens, i) in node.children:
            child = node.children[self._child_key(tokens, i)]
            n = self._match_len(child.key, tokens[:end], i)
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access_time = self._clock
            node, i = child, i + n
        if i < end:
            leaf = TreeNode(next(self._ids), tokens[i:end], values[i:end], node, self._clock)
            node.children[self._child_key(tokens, i)] = leaf
            self._evictable += end - i
        return i

    # ------------------------------------------------------------------ locks

    def inc_lock_ref(self, node: TreeNode) -> int:
        """One more user of ``node`` and every node above it; returns the change in
        :meth:`evictable_size` (zero or negative)."""
        self._check_node(node)
        delta = 0
        while node is not self.root:
            if node.lock_ref == 0:
                self._evictable -= len(node.key)
                self._protected += len(node.key)
                delta -= len(node.key)
            node.lock_ref += 1
            node = node.parent
        return delta

    def dec_lock_ref(self, node: TreeNode) -> int:
        """One user fewer of ``node`` and every node above it; returns the change in
        :meth:`evictable_size` (zero or positive)."""
        self._check_node(node)
        if node is not self.root and node.lock_ref == 0:
            raise ValueError(f"dec_lock_ref of an unlocked node ({node}): "
                             "each dec_lock_ref needs an inc_lock_ref before it")
        delta = 0
        while node is not self.root:
            if node.lock_ref == 1:
                self._evictable += len(node.key)
                self._protected -= len(node.key)
                delta += len(node.key)
            node.lock_ref -= 1
            node = node.parent
        return delta

    # ------------------------------------------------------------------ eviction

    def evict(self, num_tokens: int) -> list[int]:
        """Free at least ``num_tokens`` tokens' values, least recently used leaves first.

        Whole nodes go, so a little more than asked may be freed; fewer when the unlocked
        part of the tree is smaller (then all of it goes). Returns the freed values, in the
        order their nodes were evicted; the caller returns them to its pool.
        """
        if not isinstance(num_tokens, int) or num_tokens < 0:
            raise ValueError(f"num_tokens must be an int >= 0, got {num_tokens!r}")
        heap = [(n.last_access_time, n.id, n) for n in self._nodes()
                if not n.children and n.lock_ref == 0]
        heapq.heapify(heap)
        freed: list[int] = []
        while len(freed) < num_tokens and heap:
            _, _, node = heapq.heappop(heap)
            freed += node.value
            parent = node.parent
            del parent.children[self._child_key(node.key, 0)]
            node.parent = None  # detached: locking it now is an error
            self._evictable -= len(node.key)
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access_time, parent.id, parent))
        return freed

    # ------------------------------------------------------------------ sizes

    def total_size(self) -> int:
        """Tokens cached in the tree (locked or not)."""
        return self._evictable + self._protected

    def evictable_size(self) -> int:
        """Tokens in nodes no request holds: what :meth:`evict` could free."""
        return self._evictable

    def protected_size(self) -> int:
        """Tokens in nodes some request holds (``lock_ref > 0``)."""
        return self._protected

    def key_of(self, node: TreeNode) -> list[int]:
        """The whole token sequence from the root to ``node``."""
        self._check_node(node)
        parts = []
        while node is not self.root:
            parts.append(node.key)
            node = node.parent
        return [t for part in reversed(parts) for t in part]

    def pretty(self) -> str:
        """The tree as indented lines: each edge's tokens and its node's lock count."""
        lines = []

        def walk(node: TreeNode, depth: int) -> None:
            for child in sorted(node.children.values(), key=lambda n: n.key):
                lines.append(f"{'  ' * depth}{child.key} lock_ref={child.lock_ref}")
                walk(child, depth + 1)

        walk(self.root, 0)
        return "\n".join(lines)

    # ------------------------------------------------------------------ helpers

    def _child_key(self, tokens: Sequence[int], i: int) -> int | tuple[int, ...]:
        """A child is found by its first token (page size 1) or its first page."""
        return tokens[i] if self.page_size == 1 else tuple(tokens[i:i + self.page_size])

    def _match_len(self, key: list[int], tokens: Sequence[int], i: int) -> int:
        """How many tokens of ``key`` match ``tokens[i:]``, rounded down to whole pages."""
        n = 0
        while n < len(key) and i + n < len(tokens) and key[n] == tokens[i + n]:
            n += 1
        return n - n % self.page_size

    def _split(self, child: TreeNode, n: int) -> TreeNode:
        """Cut ``child`` after ``n`` tokens; returns the new upper node (``child`` keeps
        the lower part and its identity). Lock counts copy over: every user of the lower
        part also holds the upper one."""
        parent = child.parent
        upper = TreeNode(next(self._ids), child.key[:n], child.value[:n], parent,
                         child.last_access_time)
        upper.lock_ref = child.lock_ref
        parent.children[self._child_key(child.key, 0)] = upper
        child.key, child.value, child.parent = child.key[n:], child.value[n:], upper
        upper.children[self._child_key(child.key, 0)] = child
        return upper

    def _nodes(self) -> list[TreeNode]:
        out, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    def _check_node(self, node: TreeNode) -> None:
        top = node
        while top.parent is not None:
            top = top.parent
        if top is not self.root:
            raise ValueError(f"{node} is not in this tree (evicted, or from another tree)")

    @staticmethod
    def _check_tokens(tokens: Sequence[int]) -> list[int]:
        try:
            tokens = [operator.index(t) for t in tokens]
        except TypeError:
            raise ValueError("tokens must be a sequence of ints (token ids)") from None
        if any(t < 0 for t in tokens):
            raise ValueError(f"token ids must be >= 0, got {min(tokens)}")
        return tokens
