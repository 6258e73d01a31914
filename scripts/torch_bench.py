#!/usr/bin/env python3
"""PyTorch reference for `pipewright bench --config configs/bench-cpu.toml`
(and, with --llama, `configs/bench-cpu-llama.toml`).

The same GPT-2 (pre-LN, tanh GELU, tied LM head, learned positions, no
dropout) trained on uniformly random tokens in f32 on all cores, with AdamW
(betas 0.9/0.95, eps 1e-8, weight decay 0.1 on >=2-D tensors only), grad clip
1.0 and lr 3e-4. FLOPs per token are counted as llm.c and pipewright do:
6*N + 6*L*C*T, N = parameters with the tied embedding once. --llama trains
the Llama of the same width and depth instead (RMSNorm, rotary embeddings,
4 query heads over 2 key/value heads, a SwiGLU MLP of width 688, no biases,
untied head), written as transformers' LlamaForCausalLM computes it.

    /work/venv-torch/bin/python scripts/torch_bench.py [--steps 20] [--compile] [--llama]

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


class RMSNorm(nn.Module):
    def __init__(self, C, eps=1e-5):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(C)), eps

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


def rope(x, cos, sin):
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class LlamaBlock(nn.Module):
    def __init__(self, C, H, KV, F_):
        super().__init__()
        self.H, self.KV, self.hs = H, KV, C // H
        self.input_layernorm, self.post_attention_layernorm = RMSNorm(C), RMSNorm(C)
        self.q_proj = nn.Linear(C, C, bias=False)
        self.k_proj = nn.Linear(C, KV * self.hs, bias=False)
        self.v_proj = nn.Linear(C, KV * self.hs, bias=False)
        self.o_proj = nn.Linear(C, C, bias=False)
        self.gate_proj, self.up_proj = nn.Linear(C, F_, bias=False), nn.Linear(C, F_, bias=False)
        self.down_proj = nn.Linear(F_, C, bias=False)

    def forward(self, x, cos, sin):
        B, T, C = x.shape
        n = self.input_layernorm(x)
        q = self.q_proj(n).view(B, T, self.H, self.hs).transpose(1, 2)
        k = self.k_proj(n).view(B, T, self.KV, self.hs).transpose(1, 2)
        v = self.v_proj(n).view(B, T, self.KV, self.hs).transpose(1, 2)
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.o_proj(y.transpose(1, 2).reshape(B, T, C))
        n = self.post_attention_layernorm(x)
        return x + self.down_proj(F.silu(self.gate_proj(n)) * self.up_proj(n))


class Llama(nn.Module):
    def __init__(self, L, H, KV, C, F_, V, T, theta=10000.0):
        super().__init__()
        self.embed_tokens = nn.Embedding(V, C)
        self.layers = nn.ModuleList(LlamaBlock(C, H, KV, F_) for _ in range(L))
        self.norm = RMSNorm(C)
        self.lm_head = nn.Linear(C, V, bias=False)
        hs = C // H
        inv = 1.0 / theta ** (torch.arange(0, hs, 2, dtype=torch.float32) / hs)
        freqs = torch.outer(torch.arange(T, dtype=torch.float32), inv)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)
        for p in self.parameters():  # Hugging Face's init
            if p.dim() >= 2:
                nn.init.normal_(p, 0.0, 0.02)

    def forward(self, idx, targets):
        x = self.embed_tokens(idx)
        for block in self.layers:
            x = block(x, self.cos, self.sin)
        logits = self.lm_head(self.norm(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--compile", action="store_true", help="wrap the model in torch.compile")
    ap.add_argument("--threads", type=int, default=0, help="compute threads (0: all cores)")
    ap.add_argument("--llama", action="store_true", help="the Llama of configs/bench-cpu-llama.toml")
    a = ap.parse_args()
    L, H, C, V, T, B = 4, 4, 256, 256, 256, 8  # configs/bench-cpu.toml

    threads = a.threads or os.cpu_count()
    torch.set_num_threads(threads)
    torch.manual_seed(1337)
    model = Llama(L, H, 2, C, 688, V, T) if a.llama else GPT(L, H, C, V, T)
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
        "impl": ("torch-compile" if a.compile else "torch-eager") + ("-llama" if a.llama else ""),
        "torch": torch.__version__, "threads": threads, "steps": a.steps,
        "params": n_params, "tokens_per_step": B * T,
        "tokens_per_s": tokens_per_s, "ms_per_step": secs * 1e3 / a.steps,
        "gflops": tokens_per_s * flops_per_token / 1e9, "final_loss": loss,
    }))


if __name__ == "__main__":
    main()
