"""Train the course's tiny byte-level code model on the Python standard library.

Chapter 06 onwards needs a real model whose generations a learner can read on a
laptop. This script trains one from scratch, with nothing downloaded: the
training text is the ``.py`` files of the Python that runs it
(``sysconfig.get_paths()["stdlib"]``), the tokenizer is ``paged_lib.tokenizer``
(one token per byte), the model is a plain ``transformers.LlamaForCausalLM``
(GQA, RMSNorm, RoPE, SwiGLU) and the loop is plain PyTorch AdamW.

Not run in CI. The exact command that made the shipped weights is in
``paged_lib/data/tiny-code-llama/README.md``; a plain retrain is

    .venv/bin/python tools/train_tiny_model.py --minutes 22 --out paged_lib/data/tiny-code-llama

Without ``--max-steps``, training stops at the time budget (``--minutes``) and
the learning-rate schedule follows the elapsed fraction of it, so a faster
machine simply takes more steps. With ``--max-steps N`` the schedule follows
steps (a step-for-step rerun) and ``--minutes`` is only a hard cap.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from paged_lib.data import TINY_CODE_LLAMA_DIR  # noqa: E402
from paged_lib.data.held_out import (  # noqa: E402  (the split: defined in the package)
    HELD_OUT_RULE,
    SKIP_DIRS,
    is_held_out,
    stdlib_files,
    stdlib_root,
)
from paged_lib.tokenizer import BOS_ID, EOS_ID, VOCAB_SIZE, ByteTokenizer  # noqa: E402

MAX_BYTES = 10_000_000  # the shipped weights must stay under this (10 MB)
SHIPPED_DIR = TINY_CODE_LLAMA_DIR.relative_to(REPO).as_posix()  # where the weights ship


@dataclass
class TrainConfig:
    seq_len: int = 256  # bytes per window, after BOS
    batch_size: int = 8
    lr: float = 3e-3
    min_lr_frac: float = 0.1  # cosine decays to lr * min_lr_frac
    warmup_steps: int = 50
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    eval_windows: int = 256


def model_config():
    """A small Llama: ~2.3M parameters, fp32 weights ~9.2 MB (under the 10 MB cap)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,  # GQA: 4 query heads share each K/V head
        head_dim=32,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=True,  # lm_head.weight is embed_tokens.weight
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=EOS_ID,
    )


# ----------------------------------------------------------------------------- data


def load_corpus() -> dict:
    """Train and held-out byte streams: each file's bytes followed by EOS (the split:
    :mod:`paged_lib.data.held_out`)."""
    root = stdlib_root()
    parts: dict[str, list[int]] = {"train": [], "held_out": []}
    counts = {"train": [0, 0], "held_out": [0, 0]}  # files, bytes
    for path in stdlib_files():
        split = "held_out" if is_held_out(path.relative_to(root).as_posix()) else "train"
        data = path.read_bytes()
        parts[split].extend(data)
        parts[split].append(EOS_ID)
        counts[split][0] += 1
        counts[split][1] += len(data)
    return {
        "train": torch.tensor(parts["train"], dtype=torch.int16),
        "held_out": torch.tensor(parts["held_out"], dtype=torch.int16),
        "stats": {k: {"files": v[0], "bytes": v[1]} for k, v in counts.items()},
        "stdlib": str(root),
    }


def windows(stream: torch.Tensor, starts: torch.Tensor, seq_len: int) -> torch.Tensor:
    """[len(starts), seq_len + 1] int64: BOS, then seq_len bytes from each start."""
    idx = starts[:, None] + torch.arange(seq_len)[None, :]
    bos = torch.full((len(starts), 1), BOS_ID, dtype=torch.long)
    return torch.cat([bos, stream[idx].long()], dim=1)


def starts_of_lines(stream: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Offsets just after a newline (or EOS), with a full window after them.

    Training windows start at a line start, so "BOS + def " looks to the model
    like a line that begins with ``def`` (code), not like the middle of a
    docstring: chapter prompts are line starts too.
    """
    is_end = (stream[:-1] == ord("\n")) | (stream[:-1] == EOS_ID)
    starts = torch.cat([torch.zeros(1, dtype=torch.long), torch.nonzero(is_end).squeeze(1) + 1])
    return starts[starts <= len(stream) - seq_len]


def eval_starts(stream: torch.Tensor, seq_len: int, count: int) -> torch.Tensor:
    """Evenly spaced window starts: the same windows on every run."""
    last = len(stream) - seq_len
    return torch.linspace(0, last, count).long()


# ----------------------------------------------------------------------------- train


def lr_at(progress: float, step: int, cfg: TrainConfig) -> float:
    """Linear warmup, then cosine decay from lr to lr * min_lr_frac over progress 0..1."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    cos = 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
    return cfg.lr * (cfg.min_lr_frac + (1 - cfg.min_lr_frac) * cos)


@torch.no_grad()
def mean_loss(model, stream: torch.Tensor, cfg: TrainConfig, count: int) -> float:
    """Mean next-byte cross-entropy (nats) over fixed windows of ``stream``."""
    model.eval()
    starts = eval_starts(stream, cfg.seq_len, count)
    total, n = 0.0, 0
    for chunk in starts.split(32):
        batch = windows(stream, chunk, cfg.seq_len)
        out = model(input_ids=batch, labels=batch)
        total += out.loss.item() * len(chunk)
        n += len(chunk)
    model.train()
    return total / n


def param_groups(model, weight_decay: float) -> list[dict]:
    """Decay matrices only; norms (1-D weights) are not decayed."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def train(args: argparse.Namespace) -> None:
    from transformers import LlamaForCausalLM

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    cfg = TrainConfig(seq_len=args.seq_len, batch_size=args.batch_size, lr=args.lr)
    corpus = load_corpus()
    train_stream, held_stream = corpus["train"], corpus["held_out"]
    print(f"stdlib {corpus['stdlib']}: {json.dumps(corpus['stats'])}", flush=True)

    init = load_init(args.init) if args.init else None
    if init:
        model = LlamaForCausalLM.from_pretrained(args.init)  # warm start: weights only
        print(f"warm start from {args.init} ({init['steps']} steps)", flush=True)
    else:
        model = LlamaForCausalLM(model_config())
    model.set_attn_implementation("sdpa")  # as fast as eager or faster here (measured)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"parameters: {n_params:,}", flush=True)
    opt = torch.optim.AdamW(param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(args.seed)
    if args.starts == "line":
        allowed = starts_of_lines(train_stream, cfg.seq_len)
    else:  # any byte offset
        allowed = torch.arange(len(train_stream) - cfg.seq_len)
    budget_s = args.minutes * 60
    t0 = time.perf_counter()
    step, recent = 0, []
    while True:
        elapsed = time.perf_counter() - t0
        progress = step / args.max_steps if args.max_steps else elapsed / budget_s
        if progress >= 1.0 or elapsed >= budget_s:  # with --max-steps, time is a hard cap
            break
        lr = lr_at(progress, step, cfg)
        for group in opt.param_groups:
            group["lr"] = lr
        pick = torch.randint(0, len(allowed), (cfg.batch_size,), generator=gen)
        starts = allowed[pick]
        batch = windows(train_stream, starts, cfg.seq_len)
        loss = model(input_ids=batch, labels=batch).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        recent = (recent + [loss.item()])[-50:]
        step += 1
        if args.checkpoint_every and step % args.checkpoint_every == 0:
            model.save_pretrained(Path(args.out) / "checkpoint")  # a fallback if cut short
            held = mean_loss(model, held_stream, cfg, 64) / math.log(2)
            print(f"step {step:6d}  held-out {held:.3f} bpb (64 windows)", flush=True)
        if step % args.log_every == 0:
            print(
                f"step {step:6d}  loss {loss.item():.3f}  "
                f"bpb(avg50) {sum(recent) / len(recent) / math.log(2):.3f}  "
                f"lr {lr:.2e}  {elapsed / 60:.1f} min",
                flush=True,
            )
    train_time = time.perf_counter() - t0

    train_eval = mean_loss(model, train_stream, cfg, cfg.eval_windows)
    held_eval = mean_loss(model, held_stream, cfg, cfg.eval_windows)
    print(
        f"done: {step} steps in {train_time / 60:.1f} min; "
        f"train {train_eval / math.log(2):.3f} bpb, "
        f"held-out {held_eval / math.log(2):.3f} bpb",
        flush=True,
    )
    save(model, args, cfg, corpus, n_params, step, train_time, train_eval, held_eval, init)


def load_init(path: str) -> dict:
    """The training record of the weights a run starts from (its stages, in order).

    A warm start continues from saved weights with a fresh optimizer and a fresh
    schedule; the record keeps every earlier stage so the README can give the
    whole recipe.
    """
    record_path = Path(path) / "training.json"
    if not record_path.is_file():
        raise SystemExit(f"--init {path}: no training.json there (not weights this script saved)")
    record = json.loads(record_path.read_text())
    return {"stages": record.get("stages") or [stage_of(record)], "steps": record["steps"]}


def stage_of(record: dict) -> dict:
    """One training stage as the README's retrain recipe needs it."""
    keys = ("seed", "minutes", "max_steps", "starts", "threads", "steps", "train_minutes", "init")
    stage = {k: record.get(k) for k in keys}
    stage.update(batch_size=record["train_config"]["batch_size"], lr=record["train_config"]["lr"])
    return stage


def save(model, args, cfg, corpus, n_params, step, train_time, train_eval, held_eval, init) -> None:
    """Weights (safetensors, fp32) + a training record the README is written from."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    weights = out / "model.safetensors"
    size = weights.stat().st_size
    if size > MAX_BYTES:
        raise SystemExit(f"{weights} is {size:,} bytes, over the {MAX_BYTES:,} byte cap")
    record = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "data": corpus["stats"],
        "held_out_rule": HELD_OUT_RULE,
        "train_config": asdict(cfg),
        "seed": args.seed,
        "minutes": args.minutes,
        "max_steps": args.max_steps,
        "starts": args.starts,
        "stopped_by_time": bool(args.max_steps) and step < args.max_steps,
        "threads": args.threads,
        "steps": step,
        "train_minutes": round(train_time / 60, 2),
        "parameters": n_params,
        "weights_bytes": size,
        "train_loss_bpb": round(train_eval / math.log(2), 4),
        "held_out_loss_bpb": round(held_eval / math.log(2), 4),
        "samples": samples(model),
        "init": args.init,
    }
    record["stages"] = (init["stages"] if init else []) + [stage_of(record)]
    (out / "training.json").write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record["samples"], indent=2))
    write_readme(out)


@torch.no_grad()
def samples(model, prompts=("def ", "import ", "class ", "for i in "), n_tokens: int = 80) -> dict:
    """Greedy continuations, to eyeball that the model writes Python-looking code."""
    tok = ByteTokenizer()
    model.eval()
    result = {}
    for prompt in prompts:
        ids = torch.tensor([tok.encode(prompt)])
        out = model.generate(ids, max_new_tokens=n_tokens, do_sample=False, eos_token_id=None)
        result[prompt] = tok.decode(out[0].tolist())
    return result


def write_readme(out: Path) -> None:
    """README.md for the model directory, every number taken from training.json."""
    r = json.loads((out / "training.json").read_text())
    c = json.loads((out / "config.json").read_text())
    t = r["train_config"]
    stages = r.get("stages") or [stage_of(r)]
    tokens = sum(st["steps"] * st["batch_size"] * (t["seq_len"] + 1) for st in stages)
    samples_md = "\n\n".join(f"`{p!r}` →\n\n```text\n{s}\n```" for p, s in r["samples"].items())
    text = README_TEMPLATE.read_text().format(
        **c,
        **r,
        **t,
        tokens=tokens,
        passes=tokens / r["data"]["train"]["bytes"],
        total_steps=sum(st["steps"] for st in stages),
        total_minutes=round(sum(st["train_minutes"] for st in stages), 1),
        stages_md=stages_md(stages),
        retrain_md=retrain_md(stages),
        samples_md=samples_md,
        kv_group=c["num_attention_heads"] // c["num_key_value_heads"],
        train_files=r["data"]["train"]["files"],
        train_bytes=r["data"]["train"]["bytes"],
        held_files=r["data"]["held_out"]["files"],
        held_bytes=r["data"]["held_out"]["bytes"],
        skip=", ".join(sorted(SKIP_DIRS)),
        starts_md=STARTS_MD[r["starts"]],
        schedule_md=(
            "Each stage's learning-rate schedule followed its steps, so this repeats the run step "
            "for step; `--minutes` is only a hard cap."
            if all(st["max_steps"] for st in stages)
            else "A stage without `--max-steps` stops at its time budget, so a faster or less busy "
            "machine takes more steps (and gets a somewhat better model); give each stage "
            "`--max-steps` with the steps listed above to repeat it step for step (the schedule "
            "then follows steps)."
        ),
    )
    (out / "README.md").write_text(text)


def stages_md(stages: list[dict]) -> str:
    """One line per training stage: steps, batch, learning rate, time, where it started."""
    lines = []
    for i, st in enumerate(stages, 1):
        start = "from the previous stage's weights" if i > 1 else "from random weights"
        lines.append(
            f"{i}. {start}: seed {st['seed']}, {st['steps']:,} steps of batch {st['batch_size']}, "
            f"learning rate {st['lr']:g}, {st['train_minutes']:g} minutes on "
            f"{st['threads']} CPU thread(s)"
        )
    return f"Trained in {len(stages)} stage(s):\n\n" + "\n".join(lines)


def retrain_md(stages: list[dict]) -> str:
    """The shell commands that repeat every stage, in order."""
    cmds = []
    for i, st in enumerate(stages, 1):
        out = f"/tmp/tiny-stage{i}" if i < len(stages) else SHIPPED_DIR
        init = f" --init /tmp/tiny-stage{i - 1}" if i > 1 else ""
        steps = f" --max-steps {st['max_steps']}" if st["max_steps"] else ""
        cmds.append(
            f".venv/bin/python tools/train_tiny_model.py --minutes {st['minutes']:g} "
            f"--threads {st['threads']} --seed {st['seed']} --batch-size {st['batch_size']} "
            f"--lr {st['lr']:g} --starts {st['starts']}{steps}{init} --out {out}"
        )
    return "```bash\n" + "\n".join(cmds) + "\n```"


STARTS_MD = {
    "line": "a line start (so BOS + `def ` reads like a line that begins with `def`)",
    "any": "any byte offset",
}

#: README.md of the model directory: str.format fields filled by write_readme.
README_TEMPLATE = Path(__file__).with_name("tiny_model_README.md.in")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=22.0, help="training time budget")
    p.add_argument("--out", default=SHIPPED_DIR)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-steps", type=int, default=None, help="train exactly N steps")
    p.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    p.add_argument("--batch-size", type=int, default=TrainConfig.batch_size)
    p.add_argument("--seq-len", type=int, default=TrainConfig.seq_len)
    p.add_argument("--lr", type=float, default=TrainConfig.lr)
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument(
        "--starts",
        choices=("line", "any"),
        default="line",
        help="where training windows may start: a line start, or any byte",
    )
    p.add_argument("--init", default=None, help="warm start from weights this script saved")
    p.add_argument("--checkpoint-every", type=int, default=0, help="save to OUT/checkpoint")
    p.add_argument(
        "--readme-only", action="store_true", help="rewrite README.md from training.json"
    )
    args = p.parse_args(argv)
    if args.minutes <= 0 and not args.max_steps:
        p.error("--minutes must be positive (or pass --max-steps)")
    return args


if __name__ == "__main__":
    cli = parse_args()
    if cli.readme_only:
        write_readme(Path(cli.out))
    else:
        train(cli)
