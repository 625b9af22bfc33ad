"""``LLM``: text in, text out, as in vLLM's quickstart.

    from paged_lib import LLM, SamplingParams

    llm = LLM("paged_lib/data/tiny-code-llama")
    params = SamplingParams(max_tokens=40, temperature=0.8, top_p=0.95, seed=0)
    for out in llm.generate(["def ", "class "], params):
        print(out.prompt, out.outputs[0].text)

It wraps an :class:`~paged_lib.engine.llm_engine.LLMEngine` (the token-id API, unchanged)
and the shipped byte tokenizer (:class:`~paged_lib.tokenizer.ByteTokenizer`): each prompt
is encoded with BOS first, and each completion's tokens are decoded into
``CompletionOutput.text`` (EOS and other special ids dropped). Engine options
(``enable_prefix_caching=True``, ``preemption="swap"``, the chapters' hooks, ...) pass
through as keywords.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from paged_lib.engine.llm_engine import LLMEngine
from paged_lib.engine.sequence import RequestOutput, SamplingParams
from paged_lib.model import TinyLlama
from paged_lib.tokenizer import ByteTokenizer
from paged_lib.util import cdiv

#: Sequences at the model's full length the default pool holds at once.
DEFAULT_POOL_SEQS = 16


class LLM:
    """A model, its tokenizer and a paged engine, behind vLLM's ``generate``.

    ``model`` is a Hugging Face-format folder (``config.json`` + ``*.safetensors``, read by
    :meth:`TinyLlama.from_pretrained` in ``dtype``) or a :class:`TinyLlama`. ``num_blocks``
    GPU blocks of ``block_size`` tokens (default: room for ``DEFAULT_POOL_SEQS`` sequences
    at the model's ``max_position``); ``device`` defaults to where the model
    is (a loaded folder goes to ``cuda`` when there is one). Every other keyword goes to
    :class:`LLMEngine`.
    """

    def __init__(self, model: str | Path | TinyLlama, *, tokenizer: ByteTokenizer | None = None,
                 num_blocks: int | None = None, block_size: int = 16,
                 dtype: torch.dtype = torch.float32, device: str | None = None,
                 **engine_options):
        if isinstance(model, str | Path):
            model = TinyLlama.from_pretrained(model, dtype)
            if device is None:
                device = "cuda" if torch.cuda.is_available() else "cpu"
        elif not isinstance(model, TinyLlama):
            raise ValueError(f"model must be a model folder (str or Path) or a TinyLlama, "
                             f"got {type(model).__name__}")
        if device is not None:
            model = model.to(device)
        if num_blocks is None:
            num_blocks = DEFAULT_POOL_SEQS * cdiv(model.config.max_position,
                                                  block_size)
        self.tokenizer = tokenizer or ByteTokenizer()
        if self.tokenizer.vocab_size > model.config.vocab_size:
            raise ValueError(f"the tokenizer has {self.tokenizer.vocab_size} ids but the model "
                             f"only {model.config.vocab_size}")
        self.engine = LLMEngine(model, num_blocks, block_size, **engine_options)

    def generate(self, prompts: str | list[str],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None
                 ) -> list[RequestOutput]:
        """Complete each prompt; one :class:`RequestOutput` per prompt, in order, with
        ``prompt`` and every ``outputs[i].text`` filled in.

        ``prompts`` is a string or a list of strings (not empty); ``sampling_params`` one
        :class:`SamplingParams` for all, or one per prompt (default: greedy, 16 tokens, as
        vLLM's default ``max_tokens``). Bad input raises ``ValueError`` before anything runs.
        """
        if isinstance(prompts, str):
            prompts = [prompts]
        if not isinstance(prompts, list | tuple):
            raise ValueError(f"prompts must be a str or a list of str, "
                             f"got {type(prompts).__name__}")
        for i, p in enumerate(prompts):
            if not isinstance(p, str):
                raise ValueError(f"prompt {i} must be a str, got {type(p).__name__} (for token "
                                 "ids, use LLMEngine.generate)")
            if not p:
                raise ValueError(f"prompt {i} is empty: give the model some text to continue")
        if sampling_params is None:
            sampling_params = SamplingParams(max_tokens=16)
        ids = [self.tokenizer.encode(p) for p in prompts]
        outputs = self.engine.generate(ids, sampling_params)
        decode = self.tokenizer.decode
        return [dataclasses.replace(
            out, prompt=text,
            outputs=[dataclasses.replace(c, text=decode(c.token_ids)) for c in out.outputs])
            for out, text in zip(outputs, prompts, strict=True)]

    @property
    def stats(self):
        """The engine's :class:`~paged_lib.engine.sequence.EngineStats` of the last call."""
        return self.engine.stats
