"""Chapter 10's walk-throughs of prefix caching, built on the system's classes.

* :func:`worked_example` - the example of vLLM's "Automatic Prefix Caching" design page
  (block size 4, a pool of 10 blocks, three requests), replayed step by step with
  :class:`paged_lib.engine.prefix_cache.PrefixCachingAllocator`: request 1 hits 2 blocks
  of a 10-token shared prefix, request 2 hits 3 and evicts block 3. Each step is a
  :class:`Frame` (free queue head to tail, cached blocks, tables) that the chapter prints
  and draws (:func:`paged_lib.course.viz.prefix_cache.draw_free_queue`).
* :func:`serve_prompt`, :func:`cache_full_blocks` - how a request's table is built from
  a cache hit and its full blocks registered, as the engine's block manager does;
  :func:`hash_chain_rows` - prompts served that way, block by block, for the picture.
* :func:`shared_prefix_prompts`, :func:`serve_one_by_one` - the engine check: six prompts
  with a 40-token shared prefix, served one after another;
* :func:`long_prompt_trace`, :func:`step_loads` - short requests decoding while long
  prompts arrive, and what each engine step computed (for the decode-stall timeline).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from paged_lib.blocks import BlockTable
from paged_lib.engine.prefix_cache import (
    FreeBlockQueue,
    PrefixCachingAllocator,
    block_hashes,
    longest_cache_hit,
)

#: vLLM's example: block size 4 and a pool of 10 blocks.
EXAMPLE_BLOCK_SIZE, EXAMPLE_BLOCKS = 4, 10


@dataclass
class Frame:
    """One step of the worked example."""

    title: str
    free_queue: list[int]             # head (evicted first) to tail
    cached: list[int]                 # blocks that hold a hash, free or in use
    tables: dict[str, list[int]]      # live requests' block tables
    hits: dict[str, list[int]] = field(default_factory=dict)  # the step's cache hits
    evicted: list[int] = field(default_factory=list)          # hashes dropped this step


def cache_full_blocks(allocator: PrefixCachingAllocator, table: BlockTable,
                      tokens: list[int], hashes_fn: Callable = block_hashes) -> None:
    """Register every full block of ``table`` (holding ``tokens``) that is not cached."""
    for block, h in zip(table.blocks, hashes_fn(tokens, table.block_size), strict=False):
        if block not in allocator.block_hash:
            allocator.cache_block(block, h)


def serve_prompt(allocator: PrefixCachingAllocator, tokens: list[int], block_size: int,
                 hashes_fn: Callable = block_hashes, hit_fn: Callable = longest_cache_hit
                 ) -> tuple[BlockTable, list[int]]:
    """A new request's table: the cache hit first (touched), then fresh blocks for the
    rest of the prompt; its full blocks are cached. Returns (table, hit blocks)."""
    hits = hit_fn(hashes_fn(tokens, block_size), allocator.lookup, len(tokens), block_size)
    for block in hits:
        allocator.touch(block)
    table = BlockTable(allocator, block_size, hits, len(hits) * block_size)
    for _ in range(len(tokens) - table.num_tokens):
        table.append_token()
    cache_full_blocks(allocator, table, tokens, hashes_fn)
    return table, hits


def example_prompts() -> dict[str, list[int]]:
    """The example's three prompts: request 0 (15 tokens), request 1 (14, the first 10
    as request 0's), request 2 (29, the first 12 as request 0's)."""
    r0 = list(range(1, 16))
    return {"request 0": r0, "request 1": r0[:10] + [41, 42, 43, 44],
            "request 2": r0[:12] + list(range(51, 68))}


def worked_example(free_queue_cls: type = FreeBlockQueue, hashes_fn: Callable = block_hashes,
                   hit_fn: Callable = longest_cache_hit) -> list[Frame]:
    """vLLM's design-page example, one :class:`Frame` per step (its times 1, 3-7), on
    the given free queue class, hash chain and cache hit (default: the library's)."""
    bs = EXAMPLE_BLOCK_SIZE
    alloc = PrefixCachingAllocator(EXAMPLE_BLOCKS, free_queue_cls=free_queue_cls)
    prompts = example_prompts()
    tokens = {name: list(p) for name, p in prompts.items()}
    tables: dict[str, BlockTable] = {}
    frames: list[Frame] = []

    def frame(title: str, hits: dict | None = None, before: set | None = None) -> None:
        cached = sorted(alloc.block_hash)
        evicted = sorted(before - set(cached)) if before is not None else []
        frames.append(Frame(title, list(alloc.free_block_queue), cached,
                            {n: t.blocks for n, t in tables.items()}, hits or {}, evicted))

    frame("start: 10 free blocks, nothing cached")
    tables["request 0"], hits = serve_prompt(alloc, tokens["request 0"], bs, hashes_fn, hit_fn)
    frame("time 1: request 0 (15 tokens) takes 4 blocks, caches the 3 full ones",
          {"request 0": hits})
    for new in (16, 17):  # two decode steps: block 3 fills, block 4 starts
        tables["request 0"].append_token()
        tokens["request 0"].append(new)
        cache_full_blocks(alloc, tables["request 0"], tokens["request 0"], hashes_fn)
    frame("time 3: request 0 fills block 3 (cached) and takes block 4")
    tables["request 1"], hits = serve_prompt(alloc, tokens["request 1"], bs, hashes_fn, hit_fn)
    frame("time 4: request 1 (14 tokens, 10 shared) hits 2 blocks", {"request 1": hits})
    tables.pop("request 0").free()
    frame("time 5: request 0 ends: blocks 4, 3, 2 go to the tail (2 and 3 stay cached)")
    tables.pop("request 1").free()
    frame("time 6: request 1 ends: blocks 6, 5, 1, 0 go to the tail")
    before = set(alloc.block_hash)
    tables["request 2"], hits = serve_prompt(alloc, tokens["request 2"], bs, hashes_fn, hit_fn)
    frame("time 7: request 2 (29 tokens, 12 shared) hits 3 blocks, evicts from the head",
          {"request 2": hits}, before)
    return frames


@dataclass(frozen=True)
class ChainBlock:
    """One logical block of a prompt served through the cache."""

    tokens: tuple[int, ...]
    hash_value: int | None    # None: a part-filled block (never hashed, never shared)
    physical: int
    hit: bool                 # read from the cache instead of computed


def hash_chain_rows(prompts: dict[str, list[int]], block_size: int,
                    num_blocks: int = 32) -> dict[str, list[ChainBlock]]:
    """Serve ``prompts`` one after another into one caching pool (none finishes) and
    describe each one's blocks: tokens, hash, physical block, hit or computed."""
    alloc = PrefixCachingAllocator(num_blocks)
    rows: dict[str, list[ChainBlock]] = {}
    for name, tokens in prompts.items():
        table, hits = serve_prompt(alloc, list(tokens), block_size)
        hashes = block_hashes(list(tokens), block_size)
        rows[name] = [
            ChainBlock(tuple(tokens[i * block_size:(i + 1) * block_size]),
                       hashes[i].value if i < len(hashes) else None, b, i < len(hits))
            for i, b in enumerate(table.blocks)]
    return rows


#: Chapter 10's engine check: a 40-token shared prefix (5 blocks of 8), then a question.
SHARED_PREFIX_LEN = 40
_HEADER = '"""Helpers for the files."""\nimport os\n'
_QUESTIONS = ("\ndef read_lines(path):\n", "\ndef count_words(text):\n",
              "\ndef first_line(path):\n", "\ndef is_blank(line):\n",
              "\ndef join_path(a, b):\n", "\ndef file_size(path):\n")


def shared_prefix_prompts() -> list[list[int]]:
    """Six prompts (byte ids, :class:`paged_lib.tokenizer.ByteTokenizer`): the same
    :data:`SHARED_PREFIX_LEN` tokens (BOS and a module header), then a function of their own."""
    from paged_lib.tokenizer import ByteTokenizer

    tok = ByteTokenizer()
    prefix = tok.encode(_HEADER)  # BOS + 39 bytes
    return [prefix + tok.encode(q, add_bos=False) for q in _QUESTIONS]


def serve_one_by_one(engine, prompts: list[list[int]], params) -> tuple[list[list[int]], list[int]]:
    """Serve ``prompts`` one ``generate`` call after another on ``engine`` (the cache
    carries over, the stats do not); (each one's tokens, each one's prompt tokens read
    from the prefix cache)."""
    outs, hits = [], []
    for p in prompts:
        outs.append(engine.generate([p], params)[0].outputs[0].token_ids)
        hits.append(engine.stats.prefix_cache_hit_tokens)
    return outs, hits


def long_prompt_trace() -> tuple[list[list[int]], list, list[int]]:
    """Four short requests decoding 32 tokens each while three 121-token prompts arrive
    (steps 6, 14, 22): (prompts, params, arrival steps), code bytes as in chapter 06."""
    from paged_lib.course.demos.engine_compare import CODE_TEXT
    from paged_lib.engine.sequence import SamplingParams
    from paged_lib.tokenizer import BOS_ID

    code = list(CODE_TEXT.encode())
    short = [[BOS_ID] + code[7 * i:7 * i + 10] for i in range(4)]
    long = [[BOS_ID] + code[50 + 40 * i:170 + 40 * i] for i in range(3)]
    params = [SamplingParams(max_tokens=32, ignore_eos=True, temperature=0.0)] * 4 + \
        [SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0)] * 3
    return short + long, params, [0, 0, 0, 0, 6, 14, 22]


def step_loads(stats) -> list[tuple[int, int, int]]:
    """Per engine step of one run: (prompt tokens computed, decode tokens computed,
    running requests that computed nothing: they waited for a prefill)."""
    out = []
    for k in range(stats.steps):
        running = sum(a <= k < b for r in stats.requests for a, b in r.running_intervals())
        decode = stats.decode_seqs[k]
        out.append((stats.computed_tokens[k] - decode, decode,
                    max(0, running - stats.batch_sizes[k])))
    return out
