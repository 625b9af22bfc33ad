"""A GGUF file converted once into a Hugging Face-format folder, then reused.

Reading and dequantising a GGUF takes seconds; loading fp32 safetensors takes well under
one. So the first load writes the converted model into a folder:

    config.json             Hugging Face LlamaConfig (TinyLlama.from_pretrained reads it)
    model.safetensors       every weight dequantised to fp32, Hugging Face's names
    tokenizer.json          the byte-level BPE tokenizer (the ``tokenizers`` library)
    tokenizer_config.json   special tokens and the chat template
    source.json             what the folder was made from (written last)

and later loads read the folder. (transformers can read it too:
``LlamaForCausalLM.from_pretrained(folder)``, ``AutoTokenizer.from_pretrained(folder)``.)

The folder is written into a temporary folder beside it and renamed into place, so a
reader never sees half of it, and two processes converting at once both end with one
good folder. It is made again when it is missing, when ``source.json`` does not name this
file (its name, size and this module's :data:`FORMAT`), when a file is missing or has not
the size ``source.json`` recorded, or when loading it fails (say, a damaged header).
Deleting the folder is always safe: the next load rebuilds it.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch

from paged_lib.model import TinyLlama
from paged_lib.models.chat_tokenizer import ChatTokenizer, tokenizer_from_gguf
from paged_lib.models.gguf_file import hf_config, hf_state_dict, read_gguf

#: Bumped when the converted folder's contents change, so old folders are rebuilt.
FORMAT = 1
FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
RECORD = "source.json"


def source_of(gguf: Path) -> dict:
    """What identifies the converted folder's source: the file's name and size, and the
    conversion's format (a reinstalled package of the same version has both)."""
    return {"format": FORMAT, "gguf": gguf.name, "size": gguf.stat().st_size}


def convert(gguf: str | Path, folder: str | Path, name: str) -> dict[str, float]:
    """Write ``gguf``'s model, as ``name``, into ``folder`` (which must exist): every file
    of :data:`FILES`, then :data:`RECORD`. Returns seconds spent reading and writing."""
    from safetensors.torch import save_file

    gguf, folder = Path(gguf), Path(folder)
    start = time.perf_counter()
    g = read_gguf(gguf)
    config = hf_config(g, name)
    state = hf_state_dict(g)
    tokenizer = ChatTokenizer(*tokenizer_from_gguf(g.metadata))
    read = time.perf_counter() - start
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save(folder)
    record = {**source_of(gguf), "name": name,
              "files": {f: (folder / f).stat().st_size for f in FILES}}
    (folder / RECORD).write_text(json.dumps(record, indent=2) + "\n")
    return {"read_s": read, "write_s": time.perf_counter() - start - read}


def is_current(folder: Path, gguf: Path) -> bool:
    """Does ``folder`` hold a complete conversion of ``gguf`` (cheap checks only: the
    record, the files and their sizes; a damaged file is found when it is loaded)?"""
    try:
        record = json.loads((folder / RECORD).read_text())
        if {k: record.get(k) for k in ("format", "gguf", "size")} != source_of(gguf):
            return False
        return all((folder / f).stat().st_size == record["files"][f] for f in FILES)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def build(gguf: Path, folder: Path, name: str) -> Path:
    """Convert ``gguf`` into ``folder``, replacing whatever is there, atomically."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
    tmp.chmod(0o755)  # mkdtemp's 0o700 would hide the folder from the user's other tools
    try:
        convert(gguf, tmp, name)
        if folder.exists():  # a stale or damaged folder: move it aside, then delete it
            old = Path(tempfile.mkdtemp(prefix=f".{folder.name}-old-", dir=folder.parent))
            try:
                os.replace(folder, old / "stale")
            except FileNotFoundError:  # another process moved it first
                pass
            shutil.rmtree(old, ignore_errors=True)
        try:
            os.replace(tmp, folder)
        except OSError:  # another process put its own in place first: keep that if good
            if not is_current(folder, gguf):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def load_converted(gguf: str | Path, folder: str | Path, name: str,
                   dtype: torch.dtype = torch.float32):
    """``(TinyLlama, ChatTokenizer)`` of ``gguf``, from its converted ``folder``, which is
    (re)built first when it is not a current conversion, or when loading it fails."""
    gguf, folder = Path(gguf), Path(folder)
    if not is_current(folder, gguf):
        build(gguf, folder, name)
    try:
        return TinyLlama.from_pretrained(folder, dtype), ChatTokenizer.from_folder(folder)
    except Exception:  # damaged inside though the sizes are right: convert again, once
        build(gguf, folder, name)
        return TinyLlama.from_pretrained(folder, dtype), ChatTokenizer.from_folder(folder)
