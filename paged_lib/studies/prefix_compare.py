"""vLLM's block-hash chain vs SGLang's radix tree on the same workloads and memory.

Two caches replay a workload of :class:`~paged_lib.studies.prefix_workloads.PrefixRequest`:

* :class:`HashChainCache` - ``num_blocks`` blocks of ``block_size`` slots with
  :class:`~paged_lib.engine.prefix_cache.PrefixCachingAllocator` (vLLM v1, chapter 10):
  a request looks up its longest run of cached full blocks, allocates the rest, registers
  its full blocks, then frees its table tail first (freed blocks stay cached, LRU).
* :class:`RadixCache` - a :class:`~paged_lib.studies.radix_tree.RadixTree` (SGLang) over a pool of
  the same ``num_blocks * block_size`` slots handed out in pages of ``page_size``: a
  request matches, locks the node, allocates pages (evicting LRU leaves when the pool is
  short), inserts ``prompt + output`` and unlocks.

Both keep the last prompt token to compute (its logits give the first output token), and
both cache what the request computed, output included. Requests run **one at a time**:
the hit a request gets then depends only on the order and the memory, so the two caches
are compared on the cache alone. With several requests running at once, what one can
reuse of another that is still running depends on when each system makes a running
request's blocks findable, an engine detail this comparison leaves out; the order of the
waiting queue, which matters too, is :func:`schedule`'s subject.

They evict differently: the tree drops whole leaf nodes (as SGLang does), so a long
shared prefix in one node goes all at once; the chain's free queue reuses a freed
sequence's blocks tail first, so under pressure it loses a prefix's last blocks and keeps
its first ones.

:func:`compare` gives, per workload and cache: hit rate (prompt tokens served from the
cache / prompt tokens), prefill tokens saved, the peak memory a request held and the
memory held altogether (in use + cached), and the tokens evicted.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

from paged_lib.blocks import BlockTable
from paged_lib.engine import prefix_cache
from paged_lib.engine.prefix_cache import (
    PrefixCachingAllocator,
    block_hashes,
    longest_cache_hit,
)
from paged_lib.studies import radix_tree
from paged_lib.studies.prefix_workloads import (
    PREFIX_WORKLOADS,
    PrefixRequest,
    two_prompt_burst,
)
from paged_lib.studies.radix_tree import RadixTree
from paged_lib.util import cdiv


@dataclass
class CacheStats:
    """What a replay counted, all in tokens (a block or page counts its slots)."""

    name: str
    prompt_tokens: int = 0
    hit_tokens: int = 0           # prompt tokens read from the cache = prefill saved
    evicted_tokens: int = 0       # cached tokens dropped to make room
    peak_used_tokens: int = 0     # most slots one request held (hits + its own)
    peak_held_tokens: int = 0     # most slots in use or cached at once
    hits: list[int] = field(default_factory=list)  # hit tokens per request

    def add(self, prompt_len: int, hit: int, used: int, held: int) -> None:
        """Count one request: its prompt, its hit, the slots it held and all held."""
        self.prompt_tokens += prompt_len
        self.hit_tokens += hit
        self.hits.append(hit)
        self.peak_used_tokens = max(self.peak_used_tokens, used)
        self.peak_held_tokens = max(self.peak_held_tokens, held)

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def prefill_tokens(self) -> int:
        """Prompt tokens the model still computed."""
        return self.prompt_tokens - self.hit_tokens


def _check_fits(num_tokens: int, unit: int, capacity: int, units: str) -> None:
    """A request larger than the whole pool can never be served: say so before it starts."""
    if cdiv(num_tokens, unit) > capacity:
        raise ValueError(f"a request of {num_tokens} tokens needs {cdiv(num_tokens, unit)} "
                         f"{units}; the pool has {capacity}")


class HashChainCache:
    """vLLM v1's prefix cache: chained block hashes over a pool of ``num_blocks``."""

    def __init__(self, num_blocks: int, block_size: int):
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")
        self.allocator = PrefixCachingAllocator(num_blocks)
        self.block_size = block_size
        self.capacity_tokens = num_blocks * block_size
        self.stats = CacheStats(f"hash chain, block {block_size}")

    def match_len(self, prompt: list[int]) -> int:
        """Prompt tokens a request would read from the cache now (changes nothing)."""
        hashes = block_hashes(prompt, self.block_size)
        hits = longest_cache_hit(hashes, self.allocator.lookup, len(prompt), self.block_size)
        return len(hits) * self.block_size

    def serve(self, request: PrefixRequest) -> int:
        """Run one request through the cache; returns its hit tokens."""
        prompt, tokens = request.prompt, request.prompt + request.output
        bs, alloc = self.block_size, self.allocator
        _check_fits(len(tokens), bs, alloc.num_blocks, "blocks")
        hits = longest_cache_hit(block_hashes(prompt, bs), alloc.lookup, len(prompt), bs)
        for block in hits:
            alloc.touch(block)
        table = BlockTable(alloc, bs, hits, len(hits) * bs)
        for _ in range(len(tokens) - len(hits) * bs):
            cached = alloc.num_cached
            table.append_token()
            self.stats.evicted_tokens += (cached - alloc.num_cached) * bs
        for block, h in zip(table.blocks, block_hashes(tokens, bs), strict=False):
            alloc.cache_block(block, h)
        held = alloc.num_blocks - sum(b not in alloc.block_hash for b in alloc.free_block_queue)
        self.stats.add(len(prompt), len(hits) * bs, len(table.blocks) * bs, held * bs)
        table.free()
        return len(hits) * bs

    def in_use_tokens(self) -> int:
        """Slots some request still holds (0 between requests)."""
        return (self.allocator.num_blocks - self.allocator.num_free) * self.block_size


class RadixCache:
    """SGLang's radix cache over ``capacity_tokens`` slots in pages of ``page_size``."""

    def __init__(self, capacity_tokens: int, page_size: int = 1):
        self.tree = RadixTree(page_size)
        if not isinstance(capacity_tokens, int) or capacity_tokens < page_size:
            raise ValueError(f"capacity_tokens={capacity_tokens} holds no page of {page_size}")
        self.page_size = page_size
        self.num_pages = capacity_tokens // page_size
        self.capacity_tokens = self.num_pages * page_size
        self.free_pages = list(range(self.num_pages))
        self.stats = CacheStats(f"radix tree, page {page_size}")

    def match_len(self, prompt: list[int]) -> int:
        """Prompt tokens a request would read from the cache now (marks them used)."""
        return len(self.tree.match_prefix(prompt[:len(prompt) - 1])[0])

    def serve(self, request: PrefixRequest) -> int:
        """Run one request through the cache; returns its hit tokens."""
        prompt, tokens = request.prompt, request.prompt + request.output
        p, tree = self.page_size, self.tree
        _check_fits(len(tokens), p, self.num_pages, "pages")
        values, node = tree.match_prefix(prompt[:len(prompt) - 1])
        hit = len(values)
        tree.inc_lock_ref(node)
        need = cdiv(len(tokens) - hit, p)
        if need > len(self.free_pages):
            freed = tree.evict((need - len(self.free_pages)) * p)
            self.stats.evicted_tokens += len(freed)
            self.free_pages += sorted({slot // p for slot in freed})
        pages, self.free_pages = self.free_pages[:need], self.free_pages[need:]
        slots = [page * p + i for page in pages for i in range(p)]
        held = self.capacity_tokens - len(self.free_pages) * p
        self.stats.add(len(prompt), hit, hit + need * p, held)
        values += slots[:len(tokens) - hit]
        kept = tree.insert(tokens, values)  # the tree keeps its own slots for [:kept]
        stored = len(tokens) - len(tokens) % p
        spare = values[hit:kept] + values[stored:]  # copies the tree did not take
        self.free_pages += sorted({slot // p for slot in spare})
        tree.dec_lock_ref(node)
        return hit

    def in_use_tokens(self) -> int:
        """Slots neither free nor in the tree: some request holds them (0 between)."""
        return self.capacity_tokens - len(self.free_pages) * self.page_size \
            - self.tree.total_size()


def replay(requests: list[PrefixRequest], cache: HashChainCache | RadixCache) -> CacheStats:
    """Serve ``requests`` in order, one at a time; the cache's stats after the last."""
    for r in requests:
        cache.serve(r)
    return cache.stats


def compare(num_blocks: int = 64, block_size: int = 16, seed: int = 0,
            workloads: dict | None = None) -> list[tuple[str, CacheStats]]:
    """Each workload (default: the four of :mod:`paged_lib.studies.prefix_workloads`) replayed on
    the hash chain, the radix tree at page ``block_size`` (equal granularity) and the radix
    tree at page 1 (SGLang's default), all over ``num_blocks * block_size`` slots."""
    rows = []
    for name, make in (workloads or PREFIX_WORKLOADS).items():
        requests = make(seed=seed)
        for cache in (HashChainCache(num_blocks, block_size),
                      RadixCache(num_blocks * block_size, block_size),
                      RadixCache(num_blocks * block_size, 1)):
            rows.append((name, replay(requests, cache)))
    return rows


def format_rows(rows: list[tuple[str, CacheStats]]) -> str:
    """The comparison as a plain-text table."""
    head = (f"{'workload':<14}{'cache':<22}{'hit rate':>9}{'saved':>7}{'prefill':>8}"
            f"{'peak req':>9}{'held':>6}{'evicted':>8}")
    lines = [head]
    for name, s in rows:
        lines.append(f"{name:<14}{s.name:<22}{s.hit_rate:>9.1%}{s.hit_tokens:>7}"
                     f"{s.prefill_tokens:>8}{s.peak_used_tokens:>9}{s.peak_held_tokens:>6}"
                     f"{s.evicted_tokens:>8}")
    return "\n".join(lines)


def code_size() -> dict[str, dict[str, int]]:
    """Lines of the two caches' modules: ``lines`` (all) and ``code`` (neither blank,
    nor a comment, nor a docstring)."""
    out = {}
    for name, module in (("radix_tree", radix_tree), ("prefix_cache", prefix_cache)):
        source = inspect.getsource(module)
        out[name] = {"lines": len(source.splitlines()), "code": _code_lines(source)}
    return out


def _code_lines(source: str) -> int:
    import ast

    doc_lines: set[int] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) \
                and isinstance(node.value.value, str):
            doc_lines |= set(range(node.lineno, node.end_lineno + 1))
    return sum(1 for i, line in enumerate(source.splitlines(), 1)
               if line.strip() and not line.strip().startswith("#") and i not in doc_lines)



# ---------------------------------------------------------------- cache-aware scheduling

#: Orders for the waiting queue: first come first served; longest prefix match first
#: (SGLang's cache-aware "lpm"); lpm, but a request waiting ``max_wait`` steps goes first.
SCHEDULE_POLICIES = ("fcfs", "lpm", "lpm+aging")


@dataclass(frozen=True)
class ScheduleResult:
    """One scheduling run: the cache's hit rate and each request's wait in steps."""

    policy: str
    hit_rate: float
    waits: list[int]         # per request, in the order given
    order: list[int]         # indices of the requests in the order they were served
    outsider_wait: int       # wait of the request that shares no prefix (-1: none)

    @property
    def max_wait(self) -> int:
        return max(self.waits)

    @property
    def mean_wait(self) -> float:
        return sum(self.waits) / len(self.waits)


def schedule(timed: list, cache: RadixCache | HashChainCache, policy: str = "lpm",
             max_wait: int = 8) -> ScheduleResult:
    """Serve ``timed`` (:class:`~paged_lib.studies.prefix_workloads.TimedRequest`) one request
    per step from a waiting queue, picking by ``policy`` (see
    :data:`SCHEDULE_POLICIES`); ties go to the request that arrived first.

    ``"lpm"`` asks the cache for every waiting request's match each step, as SGLang's
    scheduler does, and serves the longest: the hit rate goes up, but a request that
    matches nothing waits as long as matching ones keep arriving. ``"lpm+aging"`` serves
    a request that has waited ``max_wait`` steps or more first (oldest first).
    A request takes one step whatever its hit, so the order changes the hits and each
    request's wait, not the mean wait: this measures who waits, not prefill speed.
    """
    if policy not in SCHEDULE_POLICIES:
        raise ValueError(f"policy must be one of {SCHEDULE_POLICIES}, got {policy!r}")
    if not isinstance(max_wait, int) or max_wait < 0:
        raise ValueError(f"max_wait must be an int >= 0, got {max_wait!r}")
    pending = sorted(range(len(timed)), key=lambda i: (timed[i].arrival, i))
    waiting: list[int] = []
    waits, order, step = [0] * len(timed), [], 0
    while pending or waiting:
        while pending and timed[pending[0]].arrival <= step:
            waiting.append(pending.pop(0))
        if waiting:
            overdue = [i for i in waiting if step - timed[i].arrival >= max_wait]
            if policy == "fcfs":
                pick = waiting[0]
            elif policy == "lpm+aging" and overdue:
                pick = overdue[0]
            else:
                matches = [cache.match_len(timed[i].request.prompt) for i in waiting]
                pick = waiting[matches.index(max(matches))]
            waiting.remove(pick)
            cache.serve(timed[pick].request)
            waits[pick], order = step - timed[pick].arrival, order + [pick]
        step += 1
    outsider = [i for i, t in enumerate(timed) if t.group == "outsider"]
    return ScheduleResult(policy, cache.stats.hit_rate, waits, order,
                          waits[outsider[0]] if outsider else -1)


def schedule_demo(capacity_tokens: int = 128, max_wait: int = 8,
                  seed: int = 0) -> list[ScheduleResult]:
    """:func:`~paged_lib.studies.prefix_workloads.two_prompt_burst` served by each policy on a
    radix tree (page 1) of ``capacity_tokens`` slots: room for one system prompt's
    requests, not both, so the order decides the hits."""
    timed = two_prompt_burst(seed=seed)
    return [schedule(timed, RadixCache(capacity_tokens, 1), policy, max_wait)
            for policy in SCHEDULE_POLICIES]


def format_schedule(results: list[ScheduleResult]) -> str:
    lines = [f"{'policy':<11}{'hit rate':>9}{'outsider wait':>14}{'max wait':>9}"
             f"{'mean wait':>10}"]
    for r in results:
        lines.append(f"{r.policy:<11}{r.hit_rate:>9.1%}{r.outsider_wait:>14}"
                     f"{r.max_wait:>9}{r.mean_wait:>10.1f}")
    return "\n".join(lines)
