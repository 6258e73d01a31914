#!/usr/bin/env python3
"""Every family of pipewright against transformers' own classes, in f64.

    python scripts/hf_families.py make FAMILY DIR [--bf16] [--shard BYTES]
        Writes a tiny random model of FAMILY (gpt2, llama, llama3 — a Llama
        with rope_type "llama3" —, qwen2, qwen3, mistral) with
        save_pretrained into DIR: sharded when --shard is given (transformers'
        max_shard_size, in bytes), stored in bf16 with --bf16.

    python scripts/hf_families.py eval DIR TOKENS.bin N
        The mean loss over the first N windows of an llm.c token file (window
        i = tokens[i*T : i*T+T+1], as `pipewright eval` reads them), the model
        opened with AutoModelForCausalLM.from_pretrained in float64.

    python scripts/hf_families.py train DIR TOKENS.bin STEPS SEQS LR WD CLIP EPS OUT.safetensors [float32]
        STEPS AdamW steps in float64 (or float32: the floor f32 itself reaches) of SEQS sequences each read in order (the
        g-th sequence is window g), the mean token loss, clip_grad_norm_(CLIP),
        weight decay WD on tensors of two or more dimensions (betas 0.9/0.95);
        writes the weights under Hugging Face's names in f64.

    python scripts/hf_families.py opens RUN_DIR
        Prints the class AutoModelForCausalLM.from_pretrained opens RUN_DIR as.

    python scripts/hf_families.py compare A B
        The largest relative difference over all tensors of two safetensors
        files or folders (sharded ones included), names as either writes them.
"""
import glob
import json
import os
import sys

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
import transformers
from transformers import AutoModelForCausalLM


def config_of(family):
    common = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    if family == "gpt2":
        return transformers.GPT2Config(n_layer=2, n_head=4, n_embd=64, vocab_size=256, n_positions=32,
                                       resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    if family == "llama":
        return transformers.LlamaConfig(**common, rope_theta=10000.0)
    if family == "llama3":
        rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8}
        return transformers.LlamaConfig(**common, rope_parameters=rope)
    if family == "qwen2":
        return transformers.Qwen2Config(**common, tie_word_embeddings=True, rope_theta=1000000.0)
    if family == "qwen3":
        return transformers.Qwen3Config(**common, head_dim=32, rope_theta=1000000.0)
    if family == "mistral":
        return transformers.MistralConfig(**common, sliding_window=8, head_dim=24)
    sys.exit(f"unknown family {family!r}")


def make(family, out, bf16, shard):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config_of(family), attn_implementation="eager")
    # transformers draws N(0, 0.02): scaled up, the tiny model's logits and
    # gradients are far from zero, so a mistake cannot hide under rounding.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.mul_(10.0)
            elif "bias" in name:
                p.normal_(0.0, 0.1)
            else:
                p.add_(torch.randn_like(p) * 0.1)
    if bf16:
        model = model.to(torch.bfloat16)
    kw = {"max_shard_size": shard} if shard else {}
    model.save_pretrained(out, **kw)
    print(f"{family}: {type(model).__name__}, {sum(p.numel() for p in model.parameters())} parameters")


def tokens_of(path):
    header = np.fromfile(path, dtype="<i4", count=256)
    if header[0] != 20240520 or header[1] not in (1, 2):
        sys.exit(f"{path}: not an llm.c token file (magic {header[0]}, version {header[1]})")
    dtype = "<u2" if header[1] == 1 else "<u4"
    return np.fromfile(path, dtype=dtype, offset=1024, count=int(header[2])).astype(np.int64)


def window(tokens, i, T):
    n = (len(tokens) - 1) // T
    i %= n
    return torch.from_numpy(tokens[i * T : i * T + T + 1])


def positions(model):
    c = model.config
    return getattr(c, "n_positions", None) or c.max_position_embeddings


def opened(path, dtype=torch.float64):
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="eager")


def evaluate(path, data, n):
    model = opened(path).eval()
    T = positions(model)
    tokens = tokens_of(data)
    total = 0.0
    with torch.no_grad():
        for i in range(n):
            w = window(tokens, i, T)
            total += F.cross_entropy(model(w[None, :-1]).logits[0], w[1:]).item()
    print(f"{total / n:.12f}")


def train(path, data, steps, seqs, lr, wd, clip, eps, out, dtype=torch.float64):
    model = opened(path, dtype).train()
    T = positions(model)
    tokens = tokens_of(data)
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": wd},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=eps)
    for s in range(steps):
        batch = torch.stack([window(tokens, s * seqs + j, T) for j in range(seqs)])
        logits = model(batch[:, :-1]).logits
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(params, clip)
        opt.step()
        print(f"step {s}: loss {loss.item():.12f}", file=sys.stderr)
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, out)


def tensors_of(path):
    if os.path.isdir(path):
        files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    else:
        files = [path]
    out = {}
    for f in files:
        for k, v in load_file(f).items():
            for prefix in ("transformer.", "model."):
                k = k[len(prefix):] if k.startswith(prefix) else k
            out[k] = v
    return out


def compare(a, b):
    x, y = tensors_of(a), tensors_of(b)
    for d in (x, y):
        for k in [k for k in d if k.endswith(".attn.bias") or k.endswith(".attn.masked_bias")]:
            del d[k]
    if set(x) != set(y):
        sys.exit(f"different tensors: {sorted(set(x) ^ set(y))}")
    worst, name = 0.0, ""
    for k in x:
        d = ((x[k].double() - y[k].double()).abs().max() / y[k].double().abs().max().clamp_min(1e-30)).item()
        if d > worst:
            worst, name = d, k
    print(f"{worst:.3e} {name}")


def main():
    a = sys.argv
    cmd = a[1] if len(a) > 1 else ""
    if cmd == "make" and len(a) >= 4:
        shard = int(a[a.index("--shard") + 1]) if "--shard" in a else None
        make(a[2], a[3], "--bf16" in a, shard)
    elif cmd == "eval" and len(a) == 5:
        evaluate(a[2], a[3], int(a[4]))
    elif cmd == "train" and len(a) in (11, 12):
        dtype = getattr(torch, a[11]) if len(a) == 12 else torch.float64
        train(a[2], a[3], int(a[4]), int(a[5]), float(a[6]), float(a[7]), float(a[8]), float(a[9]), a[10], dtype)
    elif cmd == "opens" and len(a) == 3:
        print(type(AutoModelForCausalLM.from_pretrained(a[2])).__name__)
    elif cmd == "compare" and len(a) == 4:
        compare(a[2], a[3])
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main()
