"""The benchmarks' command line.

    python -m paged_lib.bench attention     # the paged decode kernel (bench/attention.py)
    python -m paged_lib.bench engine ...    # the engine (bench/engine.py), its own options
    python -m paged_lib.bench engine --model SmolLM2-135M-Instruct  # vs transformers
    python -m paged_lib.bench.engine_parts --threads 2  # where that engine's time goes
    python -m paged_lib.bench serve ...     # Poisson load, vllm bench serve's metrics (serve.py)
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Sequence


def run_engine_bench(argv: Sequence[str]) -> int:
    """``python -m paged_lib.bench engine ...``: the engine's own benchmark, imported late."""
    try:
        module = importlib.import_module("paged_lib.bench.engine")
    except ModuleNotFoundError as err:
        if err.name not in ("paged_lib.engine", "paged_lib.bench.engine"):
            raise
        print("The engine benchmark (paged_lib/bench/engine.py, chapter 06) is not in this "
              "checkout yet: nothing to run.")
        return 2
    return int(module.main(list(argv)) or 0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m paged_lib.bench",
                                     description="Benchmarks of the course's kernels and engine.")
    parser.add_argument("what", choices=["attention", "engine", "serve"],
                        help="what to benchmark")
    parser.add_argument("rest", nargs=argparse.REMAINDER,
                        help="for 'engine' and 'serve': their own options (python -m "
                        "paged_lib.bench engine --help)")
    args = parser.parse_args(argv)
    if args.what == "engine":
        return run_engine_bench(args.rest)
    if args.what == "serve":
        from paged_lib.bench.serve import main as serve_main

        return int(serve_main(list(args.rest)) or 0)
    if args.rest:
        parser.error(f"'attention' takes no options, got {args.rest}")
    from paged_lib.bench.attention import attention_report

    print(attention_report())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
