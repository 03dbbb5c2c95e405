"""Train ``byte-llama``: a tiny byte-level Llama that vLLM loads from a local directory.

Its job is to give attention-based eviction policies (H2O and friends) real, non-uniform attention to
work with -- randomly initialised weights attend almost uniformly. It is a language model of Python
source: trained on the ``.py`` files of the running interpreter's standard library, which every machine
has (``sysconfig.get_paths()["stdlib"]``; ``site-packages`` excluded; sorted, so deterministic for a given
Python build).

Tokens are raw bytes: ``vocab_size`` 256, no tokenizer files (vLLM runs with ``skip_tokenizer_init``).
Special ids are byte values that do not occur in Python source: ``bos`` = 2 (STX), ``eos`` = 3 (ETX).
Each file in the training stream is framed as ``[bos] + bytes + [eos]``; windows are cut anywhere in it.
Every 20th file (sorted order) is held out for validation.

    python integration/vllm/models/train_byte_llama.py [--minutes 12] [--seed 0] [--out DIR]

Training stops on the wall-clock budget (one torch thread by default, see ``--threads``); the learning
rate warms up, then follows a cosine over the elapsed fraction of that budget. At the end it prints the held-out loss in nats/byte (and bits/byte) on a
fixed, seeded sample of windows, and saves ``config.json`` + ``model.safetensors`` (float32) and
``training.json``. The module-level functions are reused by ``tests/test_byte_model.py``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import sys
import sysconfig
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEFAULT_OUT = HERE / "byte-llama"

VOCAB = 256
BOS_ID = 2  # STX: never occurs in Python source
EOS_ID = 3  # ETX: never occurs in Python source
CONTEXT = 256
HOLDOUT_EVERY = 20  # files with index % 20 == 0 (in sorted order) are the validation split
EVAL_WINDOWS = 64
EVAL_SEED = 1234
UNIFORM_NATS = math.log(VOCAB)  # 5.545

MODEL_CONFIG = dict(
    vocab_size=VOCAB, hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    head_dim=32, intermediate_size=384, max_position_embeddings=2048, rope_theta=10000.0, rms_norm_eps=1e-6,
    hidden_act="silu", tie_word_embeddings=False, bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=None,
    attention_bias=False, mlp_bias=False, initializer_range=0.02,
)


def source_files(stdlib: str | None = None) -> list[Path]:
    """Every ``.py`` file of the standard library, sorted by relative path (site/dist-packages excluded)."""
    root = Path(stdlib or sysconfig.get_paths()["stdlib"])
    files = []
    for p in root.rglob("*.py"):
        rel = p.relative_to(root)
        if any(part in ("site-packages", "dist-packages", "__pycache__") for part in rel.parts):
            continue
        if p.is_file():
            files.append(rel)
    return [root / rel for rel in sorted(files, key=lambda r: r.as_posix())]


def split_files(files: list[Path], split: str) -> list[Path]:
    if split == "val":
        return [f for i, f in enumerate(files) if i % HOLDOUT_EVERY == 0]
    if split == "train":
        return [f for i, f in enumerate(files) if i % HOLDOUT_EVERY != 0]
    raise ValueError(split)


def load_stream(split: str, stdlib: str | None = None):
    """The split's files concatenated, each as ``[bos] + bytes + [eos]``: a 1-D uint8 tensor."""
    import torch
    parts = []
    for f in split_files(source_files(stdlib), split):
        try:
            data = f.read_bytes()
        except OSError:
            continue
        if data:
            parts.append(bytes([BOS_ID]) + data + bytes([EOS_ID]))
    buf = bytearray(b"".join(parts))
    return torch.frombuffer(buf, dtype=torch.uint8).clone()


def sample_windows(stream, n: int, length: int, generator):
    """``n`` windows of ``length`` tokens at uniformly random offsets (int64, shape [n, length])."""
    import torch
    starts = torch.randint(0, stream.numel() - length, (n,), generator=generator)
    idx = starts[:, None] + torch.arange(length)[None, :]
    return stream[idx].long()


def heldout_windows(n: int = EVAL_WINDOWS, length: int = CONTEXT, seed: int = EVAL_SEED, stream=None):
    """The fixed held-out sample: ``n`` windows of ``length`` bytes (plus one for the last target)."""
    import torch
    stream = load_stream("val") if stream is None else stream
    return sample_windows(stream, n, length + 1, torch.Generator().manual_seed(seed))


def mean_loss(model, windows, batch: int = 16) -> float:
    """Mean next-byte cross-entropy (nats/byte) over all positions of ``windows`` [n, L+1]."""
    import torch
    import torch.nn.functional as F
    total, count = 0.0, 0
    was_training = model.training
    model.eval()
    with torch.no_grad():
        for i in range(0, windows.shape[0], batch):
            w = windows[i:i + batch]
            logits = model(input_ids=w[:, :-1]).logits.float()
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), w[:, 1:].reshape(-1), reduction="sum")
            total += loss.item()
            count += w[:, 1:].numel()
    model.train(was_training)
    return total / count


def build_model(seed: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    config = LlamaConfig(**MODEL_CONFIG)
    config.architectures = ["LlamaForCausalLM"]
    model = LlamaForCausalLM(config).float()
    return model


def load_model(path: str | Path = DEFAULT_OUT):
    from transformers import LlamaForCausalLM
    model = LlamaForCausalLM.from_pretrained(str(path), dtype="float32")
    model.eval()
    return model


def lr_at(frac: float, step: int, peak: float, warmup: int, floor: float = 0.1) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    frac = min(max(frac, 0.0), 1.0)
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * frac)))


def train(minutes: float, seed: int, out: Path, batch: int, lr: float, threads: int, log_every: int) -> dict:
    import torch
    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    t_load = time.time()
    train_stream = load_stream("train")
    val_stream = load_stream("val")
    n_train_files = len(split_files(source_files(), "train"))
    n_val_files = len(split_files(source_files(), "val"))
    print(f"data: {n_train_files} train files ({train_stream.numel():,} bytes), {n_val_files} val files "
          f"({val_stream.numel():,} bytes), loaded in {time.time() - t_load:.1f}s", flush=True)
    eval_w = heldout_windows(stream=val_stream)

    model = build_model(seed)
    model.config._attn_implementation = "sdpa"
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params:,} parameters", flush=True)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=lr, betas=(0.9, 0.95), eps=1e-8)
    gen = torch.Generator().manual_seed(seed)
    budget = minutes * 60.0
    warmup = 50
    model.train()
    start = time.time()
    step, ema, last = 0, None, float("nan")
    while True:
        elapsed = time.time() - start
        if elapsed >= budget:
            break
        cur_lr = lr_at(elapsed / budget, step, lr, warmup)
        for g in opt.param_groups:
            g["lr"] = cur_lr
        w = sample_windows(train_stream, batch, CONTEXT + 1, gen)
        logits = model(input_ids=w[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), w[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        last = loss.item()
        ema = last if ema is None else 0.95 * ema + 0.05 * last
        if step % log_every == 0 or step == 1:
            print(f"step {step:5d}  loss {last:.4f}  (ema {ema:.4f})  lr {cur_lr:.2e}  "
                  f"elapsed {time.time() - start:6.1f}s", flush=True)
    train_s = time.time() - start
    held = mean_loss(model, eval_w)
    print(f"done: {step} steps in {train_s:.1f}s; final train loss {last:.4f} (ema {ema:.4f})", flush=True)
    print(f"held-out loss: {held:.4f} nats/byte = {held / math.log(2):.4f} bits/byte "
          f"(uniform baseline ln 256 = {UNIFORM_NATS:.3f})", flush=True)

    out.mkdir(parents=True, exist_ok=True)
    model.config.torch_dtype = "float32"
    model.config.use_cache = True
    model.save_pretrained(str(out), safe_serialization=True)
    os.chmod(out / "model.safetensors", 0o644)  # safetensors writes 0600; it ships as package data
    gen_cfg = out / "generation_config.json"
    if gen_cfg.exists():
        gen_cfg.unlink()  # only config.json + model.safetensors (+ training.json) are shipped
    # transformers 5 writes "dtype"; also keep the older key that vLLM/transformers 4 read.
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["architectures"] = ["LlamaForCausalLM"]
    cfg["torch_dtype"] = "float32"
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")

    import transformers
    info = {
        "command": "python " + " ".join([Path(sys.argv[0]).as_posix()] + sys.argv[1:]),
        "seed": seed, "minutes": minutes, "steps": step, "train_seconds": round(train_s, 1),
        "batch": batch, "context": CONTEXT, "peak_lr": lr, "warmup_steps": warmup, "threads": threads,
        "final_train_loss": round(last, 4), "final_train_loss_ema": round(ema, 4),
        "heldout_loss_nats_per_byte": round(held, 4), "heldout_loss_bits_per_byte": round(held / math.log(2), 4),
        "heldout_sample": {"windows": int(eval_w.shape[0]), "bytes_per_window": CONTEXT, "seed": EVAL_SEED,
                           "split": f"every {HOLDOUT_EVERY}th stdlib .py file (sorted), index % {HOLDOUT_EVERY} == 0"},
        "uniform_baseline_nats_per_byte": round(UNIFORM_NATS, 4),
        "data": {"source": "Python standard library .py files (sysconfig stdlib, site-packages excluded)",
                 "python": platform.python_version(), "train_files": n_train_files,
                 "train_bytes": int(train_stream.numel()), "val_files": n_val_files,
                 "val_bytes": int(val_stream.numel())},
        "tokens": {"vocab": "raw bytes 0..255", "bos_token_id": BOS_ID, "eos_token_id": EOS_ID},
        "model": {"parameters": n_params, "float32_bytes": n_params * 4,
                  "safetensors_bytes": (out / "model.safetensors").stat().st_size,
                  **{k: MODEL_CONFIG[k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                                   "num_key_value_heads", "head_dim", "intermediate_size")}},
        "torch": torch.__version__, "transformers": transformers.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }
    (out / "training.json").write_text(json.dumps(info, indent=2) + "\n")
    print(f"saved to {out}", flush=True)
    return info


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=12.0, help="wall-clock training budget (default 12)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (default 1: on a shared 2-core box under nice, 2 OpenMP threads stall "
                         "at barriers and ran ~20x slower per step than 1)")
    ap.add_argument("--log-every", type=int, default=25)
    a = ap.parse_args(argv)
    train(a.minutes, a.seed, a.out, a.batch, a.lr, a.threads, a.log_every)
    return 0


if __name__ == "__main__":
    sys.exit(main())
