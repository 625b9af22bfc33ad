"""``python -m paged_lib.serve --mine``: chapter 13's engine of the learner's pieces behind
the server, saying piece by piece whose code runs, and never failing for a piece that is
missing, broken or wrong (the library's serves in its place)."""

import linecache
import textwrap

import openai
import pytest
from fastapi.testclient import TestClient

from paged_lib.course import mine
from paged_lib.course.demos.your_server import ServedLLM
from paged_lib.course.exercises import SAVED
from paged_lib.data import TINY_CODE_LLAMA_DIR
from paged_lib.serve.__main__ import MINE, build_llm, parse_args
from paged_lib.serve.api_server import build_app

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def cell(source: str, n: int) -> dict:
    """``source`` run as a notebook cell (its text where mine reads it)."""
    source = textwrap.dedent(source)
    name = f"/tmp/ipykernel_4343/{n}.py"
    linecache.cache[name] = (len(source), None, source.splitlines(True), name)
    space = {"__name__": "__main__"}
    exec(compile(source, name, "exec"), space)  # noqa: S102
    return space


def lines_of(out: str) -> dict[str, str]:
    return {line[:4]: line for line in out.splitlines() if line[:2].isdigit()}


def test_a_fresh_clone_serves_the_librarys_pieces_and_says_so(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(mine.ENV, str(tmp_path / "mine"))  # nothing saved: a fresh clone
    args = parse_args(["--mine", "--model", "tiny-code-llama", "--device", "cpu",
                       "--num-blocks", "32", "--threads", "1"])
    assert MINE == "paged_lib.course.demos.your_server:ServedLLM"
    llm = build_llm(args)
    out = capsys.readouterr().out
    assert isinstance(llm, ServedLLM) and "no such folder yet" in out
    rows = lines_of(out)
    assert sorted(rows) == sorted(SAVED)
    assert all("  library  " in row and "not passed yet" in row for row in rows.values())
    assert "0 of 20 pieces of the served engine are yours" in out


def test_a_right_a_wrong_and_a_broken_piece(tmp_path, monkeypatch, capsys):
    """07.2 right: yours runs. 06.3 wrong (forgets the watermark): named with the first
    difference on chapter 13's scenarios, the library's serves. 10.1 saved, then its file
    broken: it does not import, the library's serves. The official client gets answers."""
    folder = tmp_path / "mine"
    monkeypatch.setenv(mine.ENV, str(folder))
    mine.save("07.2", cell("def choose_victim(running):\n    return running[-1]\n", 0)
              ["choose_victim"], folder)
    mine.save("06.3", cell("""
        def can_admit(blocks_needed, num_seqs, num_tokens, budget):
            return (blocks_needed <= budget.free_blocks
                    and budget.num_seqs + num_seqs <= budget.max_num_seqs
                    and budget.num_batched_tokens + num_tokens
                    <= budget.max_num_batched_tokens)
        """, 1)["can_admit"], folder)
    mine.save("10.1", cell("def block_hashes(tokens, block_size, parent=None):\n"
                           "    return []\n", 2)["block_hashes"], folder)
    (folder / "ch10.py").write_text((folder / "ch10.py").read_text() + "\n1 / 0\n")

    llm = ServedLLM(TINY_CODE_LLAMA_DIR, device="cpu", num_blocks=32)
    rows = lines_of(capsys.readouterr().out)
    assert "  yours    " in rows["07.2"]
    assert "  library  " in rows["06.3"] and "yours differs, so the library's serves: " \
        "on the watermark" in rows["06.3"]
    assert "  library  " in rows["10.1"] and "does not import (ZeroDivisionError" in rows["10.1"]
    from paged_lib.engine import hooks as library

    hooks = llm.engine.hooks
    assert hooks.choose_victim.__module__.startswith("mine_ch07")  # yours runs
    assert hooks.can_admit is library.can_admit and hooks.block_hashes is library.block_hashes

    with TestClient(build_app(llm, "mine")) as http:
        client = openai.OpenAI(base_url="http://testserver/v1", api_key="none",
                               http_client=http, max_retries=0)
        r = client.chat.completions.create(model="mine", max_tokens=4, temperature=0,
                                           messages=[{"role": "user", "content": "hi"}])
        assert r.choices[0].finish_reason in ("stop", "length")
        assert r.usage.completion_tokens >= 1
