#!/usr/bin/env python3
"""PyTorch reference for `pipewright bench --config configs/bench-cpu.toml`.

The same GPT-2 (pre-LN, tanh GELU, tied LM head, learned positions, no
dropout) trained on uniformly random tokens in f32 on all cores, with AdamW
(betas 0.9/0.95, eps 1e-8, weight decay 0.1 on >=2-D tensors only), grad clip
1.0 and lr 3e-4. FLOPs per token are counted as llm.c and pipewright do:
6*N + 6*L*C*T, N = parameters with the tied embedding once.

    /work/venv-torch/bin/python scripts/torch_bench.py [--steps 20] [--compile]

Prints one JSON line: tokens_per_s, ms_per_step, gflops, torch, threads, ...
"""
import argparse, json, math, os, time

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, C, H):
        super().__init__()
        self.H = H
        self.ln_1, self.ln_2 = nn.LayerNorm(C), nn.LayerNorm(C)
        self.c_attn, self.attn_proj = nn.Linear(C, 3 * C), nn.Linear(C, C)
        self.c_fc, self.mlp_proj = nn.Linear(C, 4 * C), nn.Linear(4 * C, C)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.H, C // self.H).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.attn_proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, L, H, C, V, T):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(V, C), nn.Embedding(T, C)
        self.h = nn.ModuleList(Block(C, H) for _ in range(L))
        self.ln_f = nn.LayerNorm(C)
        self.lm_head = nn.Linear(C, V, bias=False)
        self.lm_head.weight = self.wte.weight  # tied
        for name, p in self.named_parameters():  # GPT-2 init
            if p.dim() >= 2:
                std = 0.02 / math.sqrt(2 * L) if name.endswith("proj.weight") else 0.02
                nn.init.normal_(p, 0.0, std)

    def forward(self, idx, targets):
        T = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--compile", action="store_true", help="wrap the model in torch.compile")
    ap.add_argument("--threads", type=int, default=0, help="compute threads (0: all cores)")
    a = ap.parse_args()
    L, H, C, V, T, B = 4, 4, 256, 256, 256, 8  # configs/bench-cpu.toml

    threads = a.threads or os.cpu_count()
    torch.set_num_threads(threads)
    torch.manual_seed(1337)
    model = GPT(L, H, C, V, T)
    params = list(model.parameters())  # the tied tensor appears once
    n_params = sum(p.numel() for p in params)
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(groups, lr=3e-4, betas=(0.9, 0.95), eps=1e-8)
    fwd = torch.compile(model) if a.compile else model

    def step():
        x = torch.randint(0, V, (B, T))
        y = torch.randint(0, V, (B, T))
        loss = fwd(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        return loss.item()

    for _ in range(a.warmup):
        step()
    t0 = time.perf_counter()
    for _ in range(a.steps):
        loss = step()
    secs = time.perf_counter() - t0

    tokens_per_s = a.steps * B * T / secs
    flops_per_token = 6 * n_params + 6 * L * C * T
    print(json.dumps({
        "impl": "torch-compile" if a.compile else "torch-eager",
        "torch": torch.__version__, "threads": threads, "steps": a.steps,
        "params": n_params, "tokens_per_step": B * T,
        "tokens_per_s": tokens_per_s, "ms_per_step": secs * 1e3 / a.steps,
        "gflops": tokens_per_s * flops_per_token / 1e9, "final_loss": loss,
    }))


if __name__ == "__main__":
    main()
