"""A real model's tokenizer: byte-level BPE (the ``tokenizers`` library) and a chat template.

:func:`tokenizer_from_gguf` builds it from a GGUF file's metadata, with nothing
downloaded: ``tokenizer.ggml.tokens`` (the vocabulary, spelled in GPT-2's byte alphabet:
every byte is one printable character, so ``Ġ`` is a space), ``tokenizer.ggml.merges``
(BPE's merge rules, best first), ``tokenizer.ggml.token_type`` (3 marks a *control*
token such as ``<|im_start|>``: matched whole in the text, never cut into pieces) and
``tokenizer.ggml.pre`` (how text is split before BPE runs). For SmolLM2 that is
``"smollm"``: every digit alone, then GPT-2's byte-level split (llama.cpp's and the
model's own ``tokenizer.json`` agree on it).

:class:`ChatTokenizer` has the interface of :class:`paged_lib.tokenizer.ByteTokenizer`
(``encode``, ``decode``, ``bos_token_id``, ``eos_token_id``, ``vocab_size``) plus
``apply_chat_template``, which renders the model's own Jinja template
(``tokenizer.chat_template`` in the GGUF; ``chat_template`` in ``tokenizer_config.json``)
as transformers does, and encodes the text.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

CONTROL = 3  # llama.cpp's token type of a control token
#: ``tokenizer.ggml.pre`` -> the pre-tokenizer that splits text the way the merges were
#: learned. Each is a byte-level BPE; llama.cpp knows many more.
PRE_TOKENIZERS = {
    "gpt-2": lambda: pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    "smollm": lambda: pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]),
}


def tokenizer_from_gguf(metadata: dict) -> tuple[Tokenizer, dict]:
    """A ``tokenizers.Tokenizer`` and a ``tokenizer_config.json`` dict (special tokens,
    chat template) from a GGUF's metadata (:attr:`GGUFContents.metadata`)."""
    kind, pre = metadata.get("tokenizer.ggml.model"), metadata.get("tokenizer.ggml.pre")
    if kind != "gpt2" or pre not in PRE_TOKENIZERS:
        raise ValueError(f"only byte-level BPE tokenizers (tokenizer.ggml.model 'gpt2', pre "
                         f"one of {sorted(PRE_TOKENIZERS)}) are built here; this file has "
                         f"{kind!r}, pre {pre!r}")
    tokens = metadata["tokenizer.ggml.tokens"]
    merges = [tuple(m.split(" ")) for m in metadata["tokenizer.ggml.merges"]]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges,
                               fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = PRE_TOKENIZERS[pre]()
    tok.decoder = decoders.ByteLevel()
    types = metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, kind in zip(tokens, types, strict=True) if kind == CONTROL])

    def token(key: str) -> str | None:
        i = metadata.get(f"tokenizer.ggml.{key}")
        return None if i is None else tokens[i]

    config = {"tokenizer_class": "PreTrainedTokenizerFast",
              "bos_token": token("bos_token_id"), "eos_token": token("eos_token_id"),
              "unk_token": token("unknown_token_id"), "pad_token": token("padding_token_id"),
              "add_bos_token": bool(metadata.get("tokenizer.ggml.add_bos_token", False)),
              "chat_template": metadata.get("tokenizer.chat_template")}
    return tok, config


class ChatTokenizer:
    """Text <-> token ids for a real model, and its chat template (module docstring)."""

    def __init__(self, tokenizer: Tokenizer, config: dict):
        self.tokenizer = tokenizer
        self.config = config
        self.chat_template = config.get("chat_template")
        self.add_bos = bool(config.get("add_bos_token", False))
        self.bos_token_id = self._id(config.get("bos_token"))
        self.eos_token_id = self._id(config.get("eos_token"))
        self._template = None

    @classmethod
    def from_folder(cls, path: str | Path) -> ChatTokenizer:
        """Read ``tokenizer.json`` and ``tokenizer_config.json`` (Hugging Face's files)."""
        path = Path(path)
        config_file = path / "tokenizer_config.json"
        config = json.loads(config_file.read_text()) if config_file.is_file() else {}
        return cls(Tokenizer.from_file(str(path / "tokenizer.json")), config)

    def save(self, path: str | Path) -> None:
        """Write ``tokenizer.json`` and ``tokenizer_config.json`` into the folder ``path``."""
        path = Path(path)
        self.tokenizer.save(str(path / "tokenizer.json"))
        (path / "tokenizer_config.json").write_text(json.dumps(self.config, indent=2) + "\n")

    def _id(self, token: str | None) -> int | None:
        return None if token is None else self.tokenizer.token_to_id(token)

    @property
    def vocab_size(self) -> int:
        """Ids the tokenizer can produce (special tokens included)."""
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    # for code written against ByteTokenizer
    @property
    def bos_id(self) -> int | None:
        return self.bos_token_id

    @property
    def eos_id(self) -> int | None:
        return self.eos_token_id

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        """Ids of ``text``; special tokens written in it (``<|im_end|>``) are one id each.
        ``add_bos`` defaults to the model's choice (SmolLM2: no BOS)."""
        if not isinstance(text, str):
            raise ValueError(f"encode expects a str, got {type(text).__name__}")
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        if (self.add_bos if add_bos is None else add_bos) and self.bos_token_id is not None:
            ids.insert(0, self.bos_token_id)
        return ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; special tokens left out unless ``skip_special_tokens=False``.
        Half a UTF-8 character (a sampled byte token) shows as U+FFFD."""
        return self.tokenizer.decode([int(i) for i in ids],
                                     skip_special_tokens=skip_special_tokens)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The chat template applied to ``messages`` (``[{"role": ..., "content": ...}]``),
        rendered as transformers renders it (sandboxed Jinja, ``trim_blocks`` and
        ``lstrip_blocks``)."""
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat template")
        if self._template is None:
            from jinja2.ext import loopcontrols
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            def raise_exception(message):
                raise ValueError(f"chat template: {message}")

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=[loopcontrols])
            env.globals["raise_exception"] = raise_exception
            self._template = env.from_string(self.chat_template)
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not {"role", "content"} <= m.keys():
                raise ValueError(f"message {i} must be a dict with 'role' and 'content', "
                                 f"got {m!r}")
        special = {k: self.config.get(k) for k in ("bos_token", "eos_token", "pad_token",
                                                    "unk_token")}
        return self._template.render(messages=messages,
                                     add_generation_prompt=add_generation_prompt, **special)

    def apply_chat_template(self, messages: list[dict],
                            add_generation_prompt: bool = True) -> list[int]:
        """Ids of :meth:`render_chat`'s text (no BOS added: a template writes its own)."""
        return self.encode(self.render_chat(messages, add_generation_prompt), add_bos=False)

    def __repr__(self) -> str:
        return (f"ChatTokenizer(vocab_size={self.vocab_size}, bos_token_id="
                f"{self.bos_token_id}, eos_token_id={self.eos_token_id})")
