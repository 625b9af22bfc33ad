"""The chapter map: one list that the README, chapter 00's picture and the tests share."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

#: The checkout this package lives in (paged_lib/course/chapters.py is three levels down).
REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Chapter:
    number: str
    slug: str
    title: str
    core: str
    part: str  # "memory", "kernel", "engine" or "beyond": colours the map
    exercises: bool = True  # False: no exercise of its own (no solutions/, exercises/ file)

    @property
    def notebook(self) -> str:
        return f"notebooks/{self.number}_{self.slug}.ipynb"

    def available(self, root: Path | None = None) -> bool:
        """Whether the chapter's notebook is in ``root`` (default: this checkout)."""
        return ((root or REPO) / self.notebook).exists()


CHAPTERS: tuple[Chapter, ...] = (
    Chapter("00", "setup_and_tour", "Setup and tour",
            "CPU or GPU, the interpreter, how grading works", "memory"),
    Chapter("01", "kv_bytes", "KV bytes",
            "bytes per token for MHA and GQA; 2048 tokens done right", "memory"),
    Chapter("02", "where_memory_goes", "Where memory goes",
            "reserved, internal and external waste; the paper's Fig. 2", "memory"),
    Chapter("03", "block_tables", "Block tables",
            "logical to physical blocks, allocator, ref counts", "memory"),
    Chapter("04", "attention_over_blocks", "Attention over blocks",
            "online softmax block by block; paged gather in PyTorch", "kernel"),
    Chapter("05", "triton_paged_kernel", "The Triton paged kernel",
            "decode through a block table, GQA, split-KV, prefill", "kernel"),
    Chapter("06", "serving_engine", "A serving engine",
            "tiny Llama, continuous batching, scheduler", "engine"),
    Chapter("07", "preemption", "Preemption", "swap vs recompute, watermark", "engine"),
    Chapter("08", "sharing", "Sharing",
            "fork, copy-on-write, parallel sampling, beam search", "engine"),
    Chapter("09", "block_size", "Block size", "fragmentation vs kernel efficiency", "engine"),
    Chapter("10", "prefix_caching", "Prefix caching", "block hashing, LRU, radix tree", "beyond"),
    Chapter("11", "kv_landscape", "The KV landscape",
            "MQA/GQA/MLA, quantised blocks, eviction, claims checked", "beyond"),
    Chapter("12", "beyond_one_device", "Beyond one device",
            "KV sharded by heads across ranks", "beyond"),
    Chapter("13", "your_engine", "Your engine",
            "your saved pieces, each on its scenario, answer chat on SmolLM2", "beyond",
            exercises=False),
    Chapter("14", "serving_online", "Serving online",
            "an OpenAI-compatible server, Poisson load, Fig. 12 on your engine", "beyond"),
)
