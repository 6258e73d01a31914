#!/usr/bin/env python3
"""pipewright's Llama against Hugging Face's LlamaForCausalLM and PyTorch's AdamW.

    python scripts/hf_llama.py eval RUN_DIR OUT_DIR TOKENS.bin N
        Opens a pipewright run folder with LlamaForCausalLM.from_pretrained as
        it is, prints the mean loss over the first N windows of an llm.c token
        file (window i = tokens[i*T : i*T+T+1], as `pipewright eval` reads
        them), and writes the model with save_pretrained into OUT_DIR.

    python scripts/hf_llama.py train HF_DIR TOKENS.bin STEPS SEQS LR WD CLIP OUT.safetensors [EPS]
        Trains the model in HF_DIR for STEPS AdamW steps of SEQS sequences
        each, read in order (the g-th sequence is window g), with the mean
        token loss, torch.nn.utils.clip_grad_norm_(CLIP), weight decay WD on
        tensors of two or more dimensions (betas 0.9/0.95, eps EPS, 1e-8 by
        default), and writes the weights under Hugging Face's names.

    python scripts/hf_llama.py compare A.safetensors B.safetensors
        Prints the largest relative difference over all tensors.
"""
import sys

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from transformers import LlamaForCausalLM


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


def evaluate(run, out, data, n):
    model = LlamaForCausalLM.from_pretrained(run, dtype=torch.float32, attn_implementation="eager").eval()
    T = model.config.max_position_embeddings
    tokens = tokens_of(data)
    total = 0.0
    with torch.no_grad():
        for i in range(n):
            w = window(tokens, i, T)
            total += F.cross_entropy(model(w[None, :-1]).logits[0], w[1:]).item()
    print(f"{total / n:.9f}")
    model.save_pretrained(out)


def train(hf, data, steps, seqs, lr, wd, clip, out, eps=1e-8):
    torch.manual_seed(0)
    model = LlamaForCausalLM.from_pretrained(hf, dtype=torch.float32, attn_implementation="eager").train()
    T = model.config.max_position_embeddings
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
        print(f"step {s}: loss {loss.item():.9f}", file=sys.stderr)
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, out)


def compare(a, b):
    x, y = load_file(a), load_file(b)
    if set(x) != set(y):
        sys.exit(f"different tensors: {sorted(set(x) ^ set(y))}")
    worst, name = 0.0, ""
    for k in x:
        d = ((x[k].double() - y[k].double()).abs().max() / y[k].double().abs().max().clamp_min(1e-30)).item()
        if d > worst:
            worst, name = d, k
    print(f"{worst:.3e} {name}")


def main():
    cmd = sys.argv[1] if len(sys.argv) > 1 else ""
    if cmd == "eval" and len(sys.argv) == 6:
        evaluate(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]))
    elif cmd == "train" and len(sys.argv) in (10, 11):
        a = sys.argv
        eps = float(a[10]) if len(a) == 11 else 1e-8
        train(a[2], a[3], int(a[4]), int(a[5]), float(a[6]), float(a[7]), float(a[8]), a[9], eps)
    elif cmd == "compare" and len(sys.argv) == 4:
        compare(sys.argv[2], sys.argv[3])
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main()
