"""Chapter 14's server: ``python -m paged_lib.serve`` started as a subprocess on 127.0.0.1.

    with local_server(num_blocks=96) as base_url:       # e.g. "http://127.0.0.1:51234"
        client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="none")

The server runs the shipped tiny model on a free port (or ``model=``, e.g.
``"SmolLM2-135M-Instruct"``; ``mine=True`` adds ``--mine``: chapter 13's engine of your
pieces); the block waits for ``/health`` and stops the process on the way out (also when
the block raises). ``echo=True`` prints what the server said while it started (``--mine``'s
list of whose pieces it runs).
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from paged_lib.model import TINY_CODE_LLAMA_DIR


def free_port() -> int:
    """A TCP port nobody listens on now, on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def local_server(name: str = "tiny-code-llama", num_blocks: int = 96, max_num_seqs: int = 16,
                 startup_s: float = 120.0, extra_args: tuple[str, ...] = (),
                 model: str | Path = TINY_CODE_LLAMA_DIR, mine: bool = False,
                 echo: bool = False) -> Iterator[str]:
    """Start the server on ``model`` (default: the tiny model) as ``name`` (more flags in
    ``extra_args``, e.g. ``("--reservation", "orca-max")``; ``mine``: ``--mine``); yields
    its base URL, once ``/health`` answers (``echo``: after printing the server's output
    so far)."""
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    log = tempfile.TemporaryFile(mode="w+")
    proc = subprocess.Popen(
        [sys.executable, "-m", "paged_lib.serve", "--model", str(model),
         "--served-model-name", name, "--host", "127.0.0.1", "--port", str(port),
         "--num-blocks", str(num_blocks), "--max-num-seqs", str(max_num_seqs),
         "--device", "cpu", "--log-level", "warning", *(("--mine",) if mine else ()),
         *extra_args],
        stdout=log, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + startup_s
        while True:
            if proc.poll() is not None:
                log.seek(0)
                raise RuntimeError(f"the server exited:\n{log.read()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"no /health from {base} in {startup_s} s")
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        if echo:
            log.seek(0)
            print(log.read(), end="")
            log.seek(0, os.SEEK_END)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=15)
        log.close()
