"""TinyLlama: the Llama architecture, small, reading and writing a *paged* KV cache.

The layers are the ones every Llama has (RMSNorm, rotary position embeddings, grouped-
query attention, a SwiGLU MLP). The one difference from a textbook Llama is where K and
V live: each attention layer writes the new tokens' K/V into a paged cache through
``slot_mapping`` (:func:`paged_lib.kernels.reshape_and_cache`) and reads it back through
block tables (:func:`paged_lib.kernels.paged_prefill` / :func:`paged_attention`).

Which slots and which blocks is not the model's business: the engine's model runner
builds an :class:`AttentionMetadata` per step and passes it *explicitly* to
:meth:`TinyLlama.forward` (no global context), so a learner can print it.

Weights come from a transformers ``LlamaForCausalLM`` (:meth:`TinyLlama.from_hf`) or
from a Hugging Face-format folder of ``config.json`` + ``model.safetensors``
(:meth:`TinyLlama.from_pretrained`, which does not need transformers).
"""

from __future__ import annotations

import inspect
import json
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

from paged_lib.data import TINY_CODE_LLAMA_DIR  # where the course's trained model lives
from paged_lib.kernels import cpu_layer, paged_attention, paged_prefill, reshape_and_cache
from paged_lib.kernels.cpu_linear import linear, stacked_weights
from paged_lib.model_config import TinyLlamaConfig

#: the kernels' decode attention; another in its place (not a wrapper) keeps layers apart
LIBRARY_ATTENTION = paged_attention


@dataclass
class AttentionMetadata:
    """Everything attention needs to find this step's tokens in the paged cache.

    One step runs ``num_seqs`` sequences; sequence ``s`` brings ``query_lens[s]`` new
    tokens (its whole prompt in a prefill, 1 in a decode), packed back to back.

    * ``slot_mapping`` int64 ``[num_tokens]``: where each new token's K/V is written
      (``block * block_size + offset``);
    * ``block_tables`` int32 ``[num_seqs, max_blocks]``, padded with ``-1``;
    * ``seq_lens`` int32 ``[num_seqs]``: tokens in the cache after this step's writes;
    * ``query_lens`` int32 ``[num_seqs]``: new tokens per sequence;
    * ``positions`` int64 ``[num_tokens]``: each new token's position (for RoPE).

    When every ``query_len`` is 1 (a pure decode step) attention uses the decode kernel.
    ``max_seq_len`` / ``max_query_len`` are the same lengths as plain ints, known on the
    host (the model runner fills them in after checking the tensors), so a GPU step never
    waits to read them back. ``num_decodes`` (also filled in by the runner) counts the
    leading sequences with one new token: in a mixed step they take the decode kernel
    and only the rest the prefill kernel.
    """

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_lens: torch.Tensor
    positions: torch.Tensor
    max_seq_len: int | None = None
    max_query_len: int | None = None
    num_decodes: int = 0

    @property
    def is_decode(self) -> bool:
        if self.max_query_len is not None:
            return self.max_query_len == 1
        return bool(self.query_lens.numel()) and int(self.query_lens.max()) == 1

    @property
    def logits_indices(self) -> torch.Tensor:
        """Row of each sequence's last new token: the only one whose logits we sample."""
        return (torch.cumsum(self.query_lens.long(), 0) - 1)


class RMSNorm(nn.Module):
    """``x / rms(x) * weight`` in fp32 as Hugging Face's Llama (fp32: fused ``F.rms_norm``)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        f = x.float()
        return self.weight * (f * torch.rsqrt(f.pow(2).mean(-1, True) + self.eps)).to(x.dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin ``[num_tokens, head_dim]`` of each position's rotation angles.

    Dimension pair ``(i, i + head_dim/2)`` turns by ``position * theta^(-2i/head_dim)``
    (the "rotate half" layout Hugging Face uses).
    """
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((angles, angles), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[num_tokens, heads, head_dim]`` by its tokens' angles."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


class Attention(nn.Module):
    """GQA self-attention whose K/V history lives in the paged cache."""

    def __init__(self, cfg: TinyLlamaConfig):
        super().__init__()
        self.cfg = cfg
        h, d = cfg.hidden_size, cfg.head_dim
        self.q_proj = nn.Linear(h, cfg.num_heads * d, bias=False)
        self.k_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * d, h, bias=False)

    def maps(self) -> tuple:  # inference's, stacked and packed once: QKV as one, o_proj
        return (stacked_weights(self, "qkv", [self.q_proj.weight, self.k_proj.weight,
                                              self.v_proj.weight]),
                stacked_weights(self, "o", [self.o_proj.weight]))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
                backend: str, validate: bool = True) -> torch.Tensor:
        cfg, n = self.cfg, x.shape[0]
        heads, kv_heads, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        k_cache, v_cache = kv_cache
        if torch.is_grad_enabled():  # autograd through the modules themselves
            q = apply_rope(self.q_proj(x).view(n, heads, d), cos, sin)
            k = apply_rope(self.k_proj(x).view(n, kv_heads, d), cos, sin)
            v = self.v_proj(x).view(n, kv_heads, d)
        else:  # inference: Q, K and V as one prepacked map
            qkv = linear(x, self.maps()[0])
            if cpu_layer.applies(qkv, backend, validate) and cpu_layer.fits(k_cache, v_cache):
                # backend="cpu": the rotation and step 1 below in one C pass (cpu_layer)
                q = cpu_layer.rope_and_write(qkv, cos, sin, k_cache, v_cache,
                                             meta.slot_mapping, heads, kv_heads)
                k = v = None
            else:  # Q and K rotated together
                qk = apply_rope(qkv[:, :(heads + kv_heads) * d].view(n, heads + kv_heads, d),
                                cos, sin)
                q, k = qk[:, :heads], qk[:, heads:]
                v = qkv[:, (heads + kv_heads) * d:].view(n, kv_heads, d)
        if k is not None:
            # 1. write: this step's K/V go to their slots (the cache now holds seq_lens tokens)
            write_kv(k, v, k_cache, v_cache, meta.slot_mapping, backend, validate)
        q = q.contiguous()
        # 2. read: attend over the whole history through the block tables
        if meta.is_decode:
            out = paged_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                                  backend=backend, validate=validate,
                                  max_seq_len=meta.max_seq_len)
        elif meta.num_decodes == 0:
            out = paged_prefill(q, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                                meta.query_lens, backend=backend, validate=validate,
                                max_query_len=meta.max_query_len)
        else:  # mixed step: the leading decodes (one token each), then the prefills
            nd = meta.num_decodes
            out = torch.cat([
                paged_attention(q[:nd], k_cache, v_cache, meta.block_tables[:nd],
                                meta.seq_lens[:nd], backend=backend, validate=validate,
                                max_seq_len=meta.max_seq_len),
                paged_prefill(q[nd:], k_cache, v_cache, meta.block_tables[nd:],
                              meta.seq_lens[nd:], meta.query_lens[nd:], backend=backend,
                              validate=validate, max_query_len=meta.max_query_len)])
        out = out.reshape(n, heads * d)
        if torch.is_grad_enabled():
            return self.o_proj(out)
        return linear(out, self.maps()[1])


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache, v_cache, slot_mapping: torch.Tensor,
             backend: str, validate: bool) -> None:
    """This step's K/V into their slots: :func:`~paged_lib.kernels.reshape_and_cache`, or,
    for a step whose slots the model runner has checked (``validate=False``: every slot
    in the pool, none skipped) on plain CPU caches, one ``index_copy_`` per cache (the
    same writes without the kernel's per-layer checks)."""
    if (validate or backend == "triton" or not isinstance(k_cache, torch.Tensor)
            or k_cache.device.type != "cpu" or k.dtype != k_cache.dtype
            or not (k_cache.is_contiguous() and v_cache.is_contiguous())):
        reshape_and_cache(k, v, k_cache, v_cache, slot_mapping, backend=backend,
                          validate=validate)
        return
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v)


class MLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, cfg: TinyLlamaConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def maps(self) -> tuple:  # inference's, stacked and packed once: gate-up as one, down
        return (stacked_weights(self, "gate_up", [self.gate_proj.weight, self.up_proj.weight]),
                stacked_weights(self, "down", [self.down_proj.weight]))

    def forward(self, x: torch.Tensor, fused: bool = False) -> torch.Tensor:
        """``fused``: the activation as one C pass (``backend="cpu"``, see ``cpu_layer``)."""
        if torch.is_grad_enabled():
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        weights, down = self.maps()
        gate_up = linear(x, weights)  # one prepacked map for both
        if fused:
            h = cpu_layer.silu_mul(gate_up)
        else:
            gate, up = weights.split(gate_up)
            h = F.silu(gate) * up
        return linear(h, down)


class DecoderLayer(nn.Module):
    """Pre-norm residual block: attention, then MLP."""

    def __init__(self, cfg: TinyLlamaConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, kv_cache, meta, backend, validate=True, all_reduce=None):
        h = self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, meta, backend,
                           validate)
        x = x + (h if all_reduce is None else all_reduce(h))
        h = self.mlp(self.post_attention_layernorm(x))
        return x + (h if all_reduce is None else all_reduce(h))

    def forward_fused(self, x, normed, cos, sin, kv_cache, meta, backend, next_norm,
                      all_reduce=None):
        """:meth:`forward` for a step :func:`paged_lib.kernels.cpu_layer.applies` to
        (``backend="cpu"``, checked by the runner), on the residual stream ``x`` and its
        input norm ``normed``: each residual add and the RMSNorm after it (this layer's
        second, then ``next_norm``: the next layer's first, or the model's final norm) are
        one C pass over the rows, and so is SwiGLU's activation. Returns the new ``x``
        and its ``next_norm``. (A decode step takes all layers in one C call instead.)"""
        norm2 = self.post_attention_layernorm
        h = self.self_attn(normed, cos, sin, kv_cache, meta, backend, False)
        h = (h if all_reduce is None else all_reduce(h)).contiguous()
        x, h = cpu_layer.add_rms_norm(x, h, norm2.weight, norm2.eps)
        h = self.mlp(h, fused=True)
        h = (h if all_reduce is None else all_reduce(h)).contiguous()
        return cpu_layer.add_rms_norm(x, h, next_norm.weight, next_norm.eps)


class TinyLlama(nn.Module):
    """A Llama decoder over packed tokens and a paged KV cache (see the module docstring).

    Parameter names follow Hugging Face's ``LlamaForCausalLM`` without the ``model.``
    prefix, so loading weights is a rename, not a conversion.
    """

    #: ``backend="cpu"``: a decode step's layers in one C call (False: apart, to time them)
    decode_layers_in_one_call: bool = True

    def __init__(self, config: TinyLlamaConfig):
        super().__init__()
        if not isinstance(config, TinyLlamaConfig):
            raise ValueError(f"TinyLlama needs a TinyLlamaConfig, got {type(config).__name__}")
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        #: tensor parallelism (chapter 12): on a rank holding a shard, sums each layer's
        #: partial attention and MLP outputs over the ranks (``None``: one device)
        self.all_reduce = None
        self._follow_dtype()

    def _follow_dtype(self) -> None:
        """Keep ``config.dtype_bytes`` equal to the weights' element size."""
        size = self.embed_tokens.weight.element_size()
        if self.config.dtype_bytes != size:
            self.config = replace(self.config, dtype_bytes=size)

    def _apply(self, fn, *args, **kwargs):  # every .to() / .half() / .float() comes here
        out = super()._apply(fn, *args, **kwargs)
        self._follow_dtype()
        return out

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    def forward(self, input_ids: torch.Tensor, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                meta: AttentionMetadata, backend: str = "torch",
                validate: bool = True) -> torch.Tensor:
        """Hidden states ``[num_tokens, hidden_size]`` of the packed new tokens.

        ``kv_caches[layer] = (k_cache, v_cache)``, each ``[num_blocks, block_size,
        num_kv_heads, head_dim]``; this call writes the new tokens' K/V into them.
        ``validate=False`` (for a caller that checked ``meta`` once for the step) lets
        the kernels skip their per-layer checks that read values back from the device.
        """
        if len(kv_caches) != self.config.num_layers:
            raise ValueError(f"need one (k_cache, v_cache) per layer: {self.config.num_layers}"
                             f", got {len(kv_caches)}")
        x = self.embed_tokens(input_ids)
        cos, sin = rope_cos_sin(meta.positions, self.config.head_dim, self.config.rope_theta,
                                x.dtype)
        if cpu_layer.applies(x, backend, validate):  # the small steps in C
            first = self.layers[0].input_layernorm
            h = cpu_layer.rms_norm(x, first.weight, first.eps)
            norms = [layer.input_layernorm for layer in list(self.layers)[1:]] + [self.norm]
            if (self.decode_layers_in_one_call and self.all_reduce is None and meta.is_decode
                    and inspect.unwrap(paged_attention) is LIBRARY_ATTENTION):  # (ch. 13)
                plan = cpu_layer.decode_plan(self, norms)
                if done := cpu_layer.decode_layers(x, h, plan, kv_caches, cos, sin, meta):
                    return done[1]
            for layer, kv_cache, next_norm in zip(self.layers, kv_caches, norms, strict=True):
                x, h = layer.forward_fused(x, h, cos, sin, kv_cache, meta, backend, next_norm,
                                           self.all_reduce)
            return h
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x = layer(x, cos, sin, kv_cache, meta, backend, validate, self.all_reduce)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Next-token logits ``[rows, vocab_size]`` (fp32) from hidden states."""
        if torch.is_grad_enabled():
            return self.lm_head(hidden).float()
        return linear(hidden, stacked_weights(self, "lm_head", [self.lm_head.weight])).float()

    # ------------------------------------------------------------- loading weights

    @classmethod
    def from_hf(cls, hf_model) -> TinyLlama:
        """The same weights as a transformers ``LlamaForCausalLM`` (exact copy, same dtype)."""
        cfg = TinyLlamaConfig.from_hf_dict(hf_model.config.to_dict())
        state = hf_model.state_dict()
        model = cls(cfg).to(next(iter(state.values())).dtype)
        model.load_hf_state_dict(state)
        return model.eval()

    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: torch.dtype = torch.float32) -> TinyLlama:
        """Load a Hugging Face-format folder (``config.json`` + ``*.safetensors``).

        Needs only ``safetensors``, not transformers: the course's shipped model loads on
        any machine. Pickled ``.bin`` checkpoints are refused (they can run code).
        """
        from safetensors.torch import load_file

        path = Path(path)
        if not (path / "config.json").is_file():
            raise ValueError(f"{path} has no config.json: not a Hugging Face model folder")
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise ValueError(f"{path} has no .safetensors weights (pickle files are not read)")
        cfg = TinyLlamaConfig.from_hf_dict(json.loads((path / "config.json").read_text()))
        state: dict[str, torch.Tensor] = {}
        for f in files:
            state.update(load_file(f))
        model = cls(cfg).to(dtype)
        model.load_hf_state_dict({k: v.to(dtype) for k, v in state.items()})
        return model.eval()

    def load_hf_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Copy Hugging Face Llama weights in (``model.`` prefix dropped; tied head ok)."""
        ours = {k.removeprefix("model."): v for k, v in state.items()
                if "rotary_emb" not in k}
        if "lm_head.weight" not in ours:
            if not self.config.tie_word_embeddings:
                raise ValueError("the checkpoint has no lm_head.weight and does not tie it "
                                 "to the embeddings (tie_word_embeddings=False)")
            ours["lm_head.weight"] = ours["embed_tokens.weight"]
        missing, unexpected = self.load_state_dict(ours, strict=False)
        if missing or unexpected:
            raise ValueError(f"weights do not match TinyLlama: missing {missing}, "
                             f"unexpected {unexpected}")


def load_tiny_code_llama(dtype: torch.dtype = torch.float32) -> TinyLlama:
    """The course's small model trained on Python source (byte tokenizer:
    :class:`paged_lib.tokenizer.ByteTokenizer`)."""
    if not TINY_CODE_LLAMA_DIR.is_dir():
        raise FileNotFoundError(
            f"{TINY_CODE_LLAMA_DIR} does not exist yet: the shipped model has not been "
            "trained into the repo (see its training script)")
    return TinyLlama.from_pretrained(TINY_CODE_LLAMA_DIR, dtype)
