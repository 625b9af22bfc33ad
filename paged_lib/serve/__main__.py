"""``python -m paged_lib.serve --model MODEL --port 8000``: vLLM's ``vllm serve``, on this engine.

MODEL is a model folder (the shipped one: ``paged_lib/data/tiny-code-llama``, or just
``tiny-code-llama``) or ``SmolLM2-135M-Instruct``. The engine's options are flags with
vLLM's names (``--num-blocks``, ``--block-size``, ``--max-num-seqs``, ...); those left out
keep :class:`~paged_lib.engine.llm.LLM`'s defaults. Then talk to it with OpenAI's client::

    from openai import OpenAI
    client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="none")
    client.completions.create(model="tiny-code-llama", prompt="def ", max_tokens=32)
"""

from __future__ import annotations

import argparse
from pathlib import Path

from paged_lib.data import TINY_CODE_LLAMA_DIR

#: flags that become LLM(...) keywords when given (the rest keep their defaults)
ENGINE_FLAGS = ("num_blocks", "block_size", "num_cpu_blocks", "max_num_seqs",
                "max_num_batched_tokens", "max_model_len", "preemption", "attention_backend",
                "device", "reservation")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m paged_lib.serve",
                                description="An OpenAI-compatible server over paged_lib's engine")
    p.add_argument("--model", required=True,
                   help="a model folder, 'tiny-code-llama' or 'SmolLM2-135M-Instruct'")
    p.add_argument("--served-model-name", help="the name clients ask for (default: --model)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--num-blocks", type=int, help="GPU blocks in the KV pool")
    p.add_argument("--block-size", type=int, help="tokens per block (default 16)")
    p.add_argument("--num-cpu-blocks", type=int, help="CPU blocks for --preemption swap")
    p.add_argument("--max-num-seqs", type=int, help="sequences per step (default 256)")
    p.add_argument("--max-num-batched-tokens", type=int, help="tokens per step (default 4096)")
    p.add_argument("--max-model-len", type=int, help="longest prompt + output")
    p.add_argument("--enable-prefix-caching", action="store_true")
    p.add_argument("--enable-chunked-prefill", action="store_true")
    p.add_argument("--preemption", choices=("recompute", "swap"))
    p.add_argument("--attention-backend", choices=("auto", "torch", "triton", "cpu"))
    p.add_argument("--device", help="cpu or cuda (default: cuda when there is one)")
    p.add_argument("--reservation", choices=("paged", "orca-max", "orca-pow2", "orca-oracle"),
                   help="KV reservation at admission (chapter 14: Orca's baselines; default "
                   "paged)")
    p.add_argument("--log-level", default="info",
                   choices=("critical", "error", "warning", "info", "debug"))
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import uvicorn

    from paged_lib.engine.llm import LLM
    from paged_lib.serve.api_server import build_app

    model = args.model
    if model == TINY_CODE_LLAMA_DIR.name and not Path(model).exists():
        model = TINY_CODE_LLAMA_DIR
    options = {k: getattr(args, k) for k in ENGINE_FLAGS if getattr(args, k) is not None}
    if args.enable_prefix_caching:
        options["enable_prefix_caching"] = True
    if args.enable_chunked_prefill:
        options["enable_chunked_prefill"] = True
    llm = LLM(model, **options)
    app = build_app(llm, args.served_model_name or args.model)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)


if __name__ == "__main__":
    main()
