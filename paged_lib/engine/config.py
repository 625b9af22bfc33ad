"""One engine configuration: :class:`EngineConfig`, as vLLM's ``EngineArgs`` builds its configs.

The engine's options (the pool, the scheduler's budgets, the chapters' features) live in
one frozen dataclass, checked once when it is built; :class:`~paged_lib.engine.llm.LLM`,
:class:`~paged_lib.engine.llm_engine.LLMEngine`, the
:class:`~paged_lib.engine.scheduler.Scheduler` (:meth:`Scheduler.from_config`) and the
server take it, and the server's command-line flags are generated from its fields
(:meth:`EngineConfig.add_cli_args`, as vLLM's ``EngineArgs.add_cli_args``)::

    config = EngineConfig(num_blocks=256, enable_prefix_caching=True)
    engine = LLMEngine(model, config=config)       # or LLMEngine(model, 256, ...) as before

What depends on the model (``max_model_len`` at most its ``max_position``, a sliding
window's blocks) is checked when the engine is built, with the model in hand.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import types
import typing
from dataclasses import dataclass, field, fields

from paged_lib.engine.reservation import RESERVATIONS
from paged_lib.engine.sampling_params import MAX_LOGPROBS
from paged_lib.kernels import BACKENDS
from paged_lib.kernels.kv_quant import KV_CACHE_DTYPES, check_kv_cache_dtype

PREEMPTION_MODES = ("recompute", "swap")
_AT_LEAST_ONE = ("num_blocks", "block_size", "max_num_seqs", "max_num_batched_tokens",
                 "tensor_parallel_size", "max_model_len", "threads")
SCHEDULING_MODES = ("mixed", "prefill_first")
SCHEDULING_POLICIES = ("fcfs", "priority")


def default_threads() -> int:
    """The CPU cores this process may use (``len(os.sched_getaffinity(0))``; the CPU count
    where the platform has no affinity): the server's default ``--threads``."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _opt(default, help: str, choices: tuple | None = None):
    return field(default=default, metadata={"help": help, "choices": choices})


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """The engine's options, checked once (vLLM's messages where vLLM has the check).

    ``threads`` sets PyTorch's intra-op threads (``torch.set_num_threads``) when the engine
    is built; ``None`` (the default here) leaves the process's setting alone, so a notebook
    or test that chose its own keeps it. The server's ``--threads`` defaults to
    :func:`default_threads`, the cores this process may use, as vLLM's CPU worker does.
    """

    num_blocks: int | None = _opt(None, "GPU blocks in the KV pool (LLM: room for 16 "
                                  "sequences of max_model_len, at most 512 MiB)")
    block_size: int = _opt(16, "tokens per block")
    num_cpu_blocks: int = _opt(0, "CPU blocks for --preemption swap")
    preemption: str = _opt("recompute", "what a preempted request loses", PREEMPTION_MODES)
    attention_backend: str = _opt("auto", "attention kernels ('auto': the fastest that "
                                  "works here)", ("auto", *BACKENDS))
    max_num_seqs: int = _opt(256, "sequences per step")
    max_num_batched_tokens: int = _opt(4096, "tokens computed per step, decodes included")
    watermark: float = _opt(0.01, "fraction of the pool admission keeps free")
    scheduling: str = _opt("mixed", "prefills batched with decodes (Orca) or apart "
                           "(vLLM v0)", SCHEDULING_MODES)
    scheduling_policy: str = _opt("fcfs", "waiting requests first come first served, or by "
                                  "priority (lower first), as vLLM v1", SCHEDULING_POLICIES)
    enable_prefix_caching: bool = _opt(False, "keep freed full blocks for reuse (chapter 10)")
    enable_chunked_prefill: bool = _opt(False, "long prompts in chunks beside the decodes")
    kv_cache_dtype: str = _opt("auto", "K/V storage (chapter 11)", KV_CACHE_DTYPES)
    tensor_parallel_size: int = _opt(1, "worker processes sharing the heads (chapter 12)")
    sliding_window: int | None = _opt(None, "attend to the last W tokens only (chapter 11)")
    num_sink_tokens: int = _opt(0, "first tokens kept beside the window")
    max_model_len: int | None = _opt(None, "longest prompt + output (default: the model's)")
    reservation: str = _opt("paged", "KV reserved at admission (chapter 14: Orca's "
                            "baselines)", RESERVATIONS)
    max_logprobs: int = _opt(MAX_LOGPROBS, "most top logprobs a request may ask for (-1: "
                             "the whole vocabulary)")
    threads: int | None = _opt(None, "PyTorch intra-op threads (default: leave as is; the "
                               "server's: the cores this process may use)")

    def __post_init__(self):
        if problem := self._problem():
            raise ValueError(problem)

    def _problem(self) -> str | None:
        for f in fields(self):
            value, kind = getattr(self, f.name), _kind(f)
            if value is None and _optional(f):
                continue
            if kind is bool and not isinstance(value, bool):
                return f"{f.name} must be True or False, got {value!r}"
            if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
                at_least = " >= 1" if f.name in _AT_LEAST_ONE else ""
                return f"{f.name} must be an integer{at_least}, got {value!r}"
            if f.metadata["choices"] and value not in f.metadata["choices"]:
                if f.name == "attention_backend":
                    return (f"attention_backend must be 'auto' or one of {BACKENDS}, "
                            f"got {value!r}")
                if f.name == "kv_cache_dtype":
                    check_kv_cache_dtype(value)
                choices = RESERVATIONS if f.name == "reservation" else f.metadata["choices"]
                return f"{f.name} must be one of {choices}, got {value!r}"
        for name in _AT_LEAST_ONE:
            if (v := getattr(self, name)) is not None and v < 1:
                return f"{name} must be an integer >= 1, got {v!r}"
        if self.num_cpu_blocks < 0:
            return f"num_cpu_blocks must be an integer >= 0, got {self.num_cpu_blocks}"
        if not 0 <= self.watermark < 1:
            return f"watermark is a fraction of the pool in [0, 1), got {self.watermark}"
        if self.max_logprobs < -1:
            return f"max_logprobs must be non-negative or -1, got {self.max_logprobs}"
        if self.max_num_batched_tokens < self.max_num_seqs:
            return (f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                    f"max_num_seqs ({self.max_num_seqs}): every running sequence decodes "
                    "one token a step, and all of them must fit in one step's budget")
        if self.enable_chunked_prefill and self.scheduling != "mixed":
            return ("enable_chunked_prefill batches chunks with decodes: it needs "
                    f"scheduling='mixed', got {self.scheduling!r}")
        if self.preemption == "swap" and not self.num_cpu_blocks:
            return "preemption='swap' needs a CPU pool: set num_cpu_blocks > 0"
        mml = self.max_model_len
        if mml is not None and not self.enable_chunked_prefill \
                and self.max_num_batched_tokens < mml:
            return (  # vLLM's SchedulerConfig check, in its words
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) is smaller than "
                f"max_model_len ({mml}). This effectively limits the maximum sequence length "
                "to max_num_batched_tokens and makes the engine reject longer sequences. "
                "Please increase max_num_batched_tokens, decrease max_model_len, or set "
                "enable_chunked_prefill=True")
        return None

    @classmethod
    def of(cls, config: EngineConfig | None, options: dict) -> EngineConfig:
        """The config of an engine built with ``config`` or with keyword ``options`` (each
        an option's value; not both)."""
        if config is None:
            return cls(**options)
        if not isinstance(config, EngineConfig):
            raise ValueError(f"config must be an EngineConfig, got {type(config).__name__}")
        if given := [k for k, v in options.items() if v != _defaults()[k]]:
            raise ValueError(f"give the engine's options in config or as keywords, not both "
                             f"(got config and {', '.join(given)})")
        return config

    def check_priority(self, request_id, priority) -> None:
        """A request's ``priority``: an int, and 0 unless ``scheduling_policy="priority"``
        (vLLM's message)."""
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise ValueError(f"request {request_id}: priority must be an int, got {priority!r}")
        if priority != 0 and self.scheduling_policy != "priority":
            raise ValueError(f"request {request_id}: Got priority {priority} but Priority "
                             "scheduling is not enabled.")

    def replace(self, **changes) -> EngineConfig:
        """A copy with ``changes`` (checked again)."""
        return dataclasses.replace(self, **changes)

    def engine_options(self) -> dict:
        """The fields that differ from their defaults, as keywords."""
        return {f.name: getattr(self, f.name) for f in fields(self)
                if getattr(self, f.name) != f.default}

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        """One flag per field (``--num-blocks``, ``--enable-prefix-caching``, ...), as vLLM's
        ``EngineArgs.add_cli_args``; a flag left out keeps the field's default."""
        group = parser.add_argument_group("engine", "EngineConfig's fields")
        for f in fields(cls):
            flag, kind = "--" + f.name.replace("_", "-"), _kind(f)
            help_text = f.metadata["help"]
            if "default" not in help_text:
                help_text += f" (default: {f.default})"
            if kind is bool:
                group.add_argument(flag, action="store_true", default=None, help=help_text)
            else:
                group.add_argument(flag, type=kind, default=None, help=help_text,
                                   choices=f.metadata["choices"])
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace, **overrides) -> EngineConfig:
        """The config of the flags given (the rest at their defaults), then ``overrides``."""
        given = {f.name: getattr(args, f.name) for f in fields(cls)
                 if getattr(args, f.name, None) is not None}
        return cls(**{**given, **overrides})


@functools.cache
def _defaults() -> dict:
    return {f.name: f.default for f in fields(EngineConfig)}


@functools.cache
def _hints() -> dict:
    return typing.get_type_hints(EngineConfig)


def _kind(f: dataclasses.Field) -> type:
    """``int`` for ``int | None``, ``bool``, ``float``, ``str``."""
    hint = _hints()[f.name]
    if isinstance(hint, types.UnionType):
        hint = next(a for a in hint.__args__ if a is not type(None))
    return hint


def _optional(f: dataclasses.Field) -> bool:
    hint = _hints()[f.name]
    return isinstance(hint, types.UnionType) and type(None) in hint.__args__


#: the option names (an engine's keywords that go into its config)
ENGINE_FIELDS = frozenset(f.name for f in fields(EngineConfig))
