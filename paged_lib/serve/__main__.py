"""``python -m paged_lib.serve --model MODEL --port 8000``: vLLM's ``vllm serve``, on this engine.

MODEL is a model folder (the shipped one: ``paged_lib/data/tiny-code-llama``, or just
``tiny-code-llama``) or ``SmolLM2-135M-Instruct``. The engine's options are flags made
from :class:`~paged_lib.engine.config.EngineConfig`'s fields, with vLLM's names
(``--num-blocks``, ``--block-size``, ``--max-num-seqs``, ``--threads``, ...; ``--help``
lists them); those left out keep :class:`~paged_lib.engine.llm.LLM`'s defaults, and
``--threads`` the cores this process may use. ``--llm-class`` serves a subclass of ``LLM``
instead; ``--mine`` chapter 13's engine of the learner's own pieces (:data:`MINE`, imported
by name: the system itself never imports the course), which first prints, piece by piece,
whose code it runs (the learner's saved pieces that pass chapter 13's scenarios, the
library's for the rest). Then talk to it with OpenAI's client::

    from openai import OpenAI
    client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="none")
    client.completions.create(model="tiny-code-llama", prompt="def ", max_tokens=32)
"""

from __future__ import annotations

import argparse
import importlib
from pathlib import Path

from paged_lib.data import TINY_CODE_LLAMA_DIR
from paged_lib.engine.config import EngineConfig, default_threads

#: ``--llm-class`` for chapter 13's engine of the learner's own pieces (those saved in
#: ``mine/`` that pass chapter 13's scenarios, the library's for the rest; it says which)
MINE = "paged_lib.course.demos.your_server:ServedLLM"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m paged_lib.serve",
                                description="An OpenAI-compatible server over paged_lib's engine")
    p.add_argument("--model", required=True,
                   help="a model folder, 'tiny-code-llama' or 'SmolLM2-135M-Instruct'")
    p.add_argument("--served-model-name", help="the name clients ask for (default: --model)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--device", help="cpu or cuda (default: cuda when there is one)")
    p.add_argument("--llm-class", metavar="MODULE:CLASS",
                   help="serve this subclass of LLM instead, built with the same flags "
                   f"(your own engine, chapter 13: {MINE})")
    p.add_argument("--mine", action="store_true",
                   help=f"serve your own engine of chapter 13: --llm-class {MINE}")
    p.add_argument("--log-level", default="info",
                   choices=("critical", "error", "warning", "info", "debug"))
    EngineConfig.add_cli_args(p)  # one flag per EngineConfig field, as vLLM's EngineArgs
    return p.parse_args(argv)


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The flags' :class:`EngineConfig`; ``--threads`` defaults to the cores this process
    may use (:func:`~paged_lib.engine.config.default_threads`)."""
    return EngineConfig.from_cli_args(args, threads=args.threads or default_threads())


def build_llm(args: argparse.Namespace):
    """The ``LLM`` the flags ask for: the library's, or ``--llm-class``'s (a subclass,
    given the engine's options as keywords, as chapter 13's ``YourLLM`` takes them). The
    server names the class by its path, never imports the course itself: the system runs
    without it."""
    from paged_lib.engine.llm import LLM

    model = args.model
    if model == TINY_CODE_LLAMA_DIR.name and not Path(model).exists():
        model = TINY_CODE_LLAMA_DIR
    config = engine_config(args)
    llm_class = MINE if args.mine else args.llm_class
    if not llm_class:
        return LLM(model, device=args.device, config=config)
    module, _, name = llm_class.partition(":")
    cls = getattr(importlib.import_module(module), name, None) if name else None
    if not (isinstance(cls, type) and issubclass(cls, LLM)):
        raise SystemExit(f"--llm-class {llm_class}: not MODULE:CLASS naming a subclass "
                         f"of paged_lib.LLM (chapter 13's is {MINE})")
    return cls(model, device=args.device, **config.engine_options())


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import uvicorn

    from paged_lib.serve.api_server import build_app

    llm = build_llm(args)
    app = build_app(llm, args.served_model_name or args.model)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)


if __name__ == "__main__":
    main()
