"""EngineConfig: the engine's options in one frozen dataclass, checked once, taken by
``LLM``, ``LLMEngine``, the scheduler and the server, whose flags are made from it.

Ports the behaviours of vLLM's ``tests/engine/test_arg_utils.py`` (the command-line flags
come from the config dataclasses' fields, a flag left out keeps the default) and of its
``SchedulerConfig`` checks (a budget below ``max_model_len`` without chunked prefill is
refused, in its words).
"""

import argparse
import dataclasses
import inspect

import pytest
import torch

from paged_lib.data import TINY_CODE_LLAMA_DIR
from paged_lib.engine import LLM, LLMEngine, SamplingParams
from paged_lib.engine.block_manager import BlockManager
from paged_lib.engine.config import ENGINE_FIELDS, EngineConfig, default_threads
from paged_lib.engine.scheduler import Scheduler
from paged_lib.serve.__main__ import engine_config, parse_args

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = [[5, 17, 42], [3, 9, 11, 60, 2, 8, 71], [88]]


def test_the_engines_keywords_are_the_configs_fields_with_the_same_defaults():
    sig = inspect.signature(LLMEngine)
    fields = {f.name: f.default for f in dataclasses.fields(EngineConfig)}
    assert set(fields) == ENGINE_FIELDS
    assert {k: sig.parameters[k].default for k in fields} == fields
    with pytest.raises(dataclasses.FrozenInstanceError):
        EngineConfig().block_size = 8


@pytest.mark.parametrize("kwargs, message", [
    (dict(max_model_len=8192), "max_num_batched_tokens (4096) is smaller than max_model_len "
                               "(8192). This effectively limits the maximum sequence length"),
    (dict(max_num_seqs=64, max_num_batched_tokens=32), "must be >= max_num_seqs (64)"),
    (dict(preemption="swap"), "preemption='swap' needs a CPU pool"),
    (dict(enable_chunked_prefill=True, scheduling="prefill_first"), "it needs scheduling="),
    (dict(attention_backend="cuda"), "attention_backend must be 'auto' or one of"),
    (dict(watermark=1.0), "watermark is a fraction of the pool in [0, 1)"),
    (dict(kv_cache_dtype="int4"), "kv_cache_dtype must be one of"),
    (dict(reservation="orca"), "reservation must be one of"),
    (dict(block_size=0), "block_size must be an integer >= 1, got 0"),
    (dict(block_size=True), "block_size must be an integer >= 1, got True"),
    (dict(sliding_window=16.0), "sliding_window must be an integer, got 16.0"),
    (dict(enable_prefix_caching=1), "enable_prefix_caching must be True or False"),
    (dict(max_logprobs=-2), "max_logprobs must be non-negative or -1"),
    (dict(threads=0), "threads must be an integer >= 1"),
])
def test_bad_options_are_refused_once_when_built(kwargs, message):
    with pytest.raises(ValueError) as err:
        EngineConfig(**kwargs)
    assert message in str(err.value)
    with pytest.raises(ValueError) as err:  # the engine's keywords go through the same check
        LLMEngine(torch.nn.Module(), 16, **kwargs)
    assert message in str(err.value)


def test_an_engine_from_a_config_is_the_engine_from_keywords(tiny_model):
    config = EngineConfig(num_blocks=16, block_size=4, max_num_seqs=2,
                          max_num_batched_tokens=256, enable_prefix_caching=True)
    params = SamplingParams(max_tokens=10, temperature=0.0)
    a = LLMEngine(tiny_model, config=config)
    b = LLMEngine(tiny_model, 16, 4, max_num_seqs=2, max_num_batched_tokens=256,
                  enable_prefix_caching=True)
    assert [o.outputs[0].token_ids for o in a.generate(PROMPTS, params)] == \
        [o.outputs[0].token_ids for o in b.generate(PROMPTS, params)]
    assert a.stats.batch_sizes == b.stats.batch_sizes and max(a.stats.batch_sizes) == 2
    assert a.config == b.config == config.replace(max_model_len=tiny_model.config.max_position)
    assert a.scheduler.max_num_seqs == 2
    with pytest.raises(ValueError, match="not both"):
        LLMEngine(tiny_model, 16, config=config)
    with pytest.raises(ValueError, match="needs num_blocks"):
        LLMEngine(tiny_model)


def test_the_scheduler_takes_the_config():
    config = EngineConfig(num_blocks=8, max_num_seqs=3, max_num_batched_tokens=40,
                          scheduling="prefill_first")
    s = Scheduler.from_config(BlockManager(8, 4), config, watermark_blocks=1)
    assert (s.max_num_seqs, s.max_num_batched_tokens, s.scheduling, s.watermark_blocks) == \
        (3, 40, "prefill_first", 1)


def test_llm_takes_a_config():
    llm = LLM(TINY_CODE_LLAMA_DIR, device="cpu",
              config=EngineConfig(num_blocks=24, block_size=8, max_model_len=128))
    assert (llm.engine.num_blocks, llm.engine.block_size, llm.engine.max_model_len) == \
        (24, 8, 128)


def test_threads_set_torchs_intra_op_threads_only_when_given(tiny_model):
    before = torch.get_num_threads()
    LLMEngine(tiny_model, 8, 4)
    assert torch.get_num_threads() == before  # None: the process's setting stays
    try:
        LLMEngine(tiny_model, 8, 4, threads=2)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_every_field_is_a_flag_and_flags_left_out_keep_the_defaults():
    """test_arg_utils.py: EngineArgs.add_cli_args makes the flags from the fields."""
    parser = EngineConfig.add_cli_args(argparse.ArgumentParser())
    flags = {a.dest for a in parser._actions} - {"help"}
    assert flags == ENGINE_FIELDS
    assert EngineConfig.from_cli_args(parser.parse_args([])) == EngineConfig()
    args = parser.parse_args(["--num-blocks", "7", "--enable-prefix-caching", "--preemption",
                              "swap", "--num-cpu-blocks", "4", "--watermark", "0.0",
                              "--max-model-len", "512", "--threads", "3"])
    assert EngineConfig.from_cli_args(args) == EngineConfig(
        num_blocks=7, enable_prefix_caching=True, preemption="swap", num_cpu_blocks=4,
        watermark=0.0, max_model_len=512, threads=3)


def test_the_servers_threads_default_to_the_cores_this_process_may_use():
    args = parse_args(["--model", "tiny-code-llama", "--max-num-seqs", "8"])
    config = engine_config(args)
    assert config.threads == default_threads() >= 1 and config.max_num_seqs == 8
    assert engine_config(parse_args(["--model", "x", "--threads", "1"])).threads == 1
