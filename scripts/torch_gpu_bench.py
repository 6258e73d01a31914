#!/usr/bin/env python3
"""GPT-2 training throughput in plain PyTorch on one GPU, the yardstick for
`pipewright gpu-bench`: the same model (tied embedding, pre-LayerNorm blocks,
tanh GELU), the same micro-batch and T, bf16 autocast over f32 master weights,
F.scaled_dot_product_attention(is_causal=True), torch.compile, fused AdamW,
global-norm clipping at 1.0. No transformers dependency.

MFU is counted as pipewright counts it (llm.c's): (6·N + 6·L·C·T) FLOPs per
token, N the parameters with the tied embedding once and the vocabulary
unpadded, against 989 TFLOP/s bf16 dense (H100 SXM). The vocabulary is padded
to a multiple of 128 for the products, as in pipewright (there the padding
columns are kept out of the softmax; here they take part in it, which costs
the same).

usage: scripts/torch_gpu_bench.py [--micro-batch B] [--steps N] [--json]
"""
import argparse
import json
import math
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

H100_BF16_PEAK = 989e12


class Block(nn.Module):
    def __init__(self, c, nh):
        super().__init__()
        self.nh = nh
        self.ln_1 = nn.LayerNorm(c)
        self.c_attn = nn.Linear(c, 3 * c)
        self.attn_proj = nn.Linear(c, c)
        self.ln_2 = nn.LayerNorm(c)
        self.c_fc = nn.Linear(c, 4 * c)
        self.mlp_proj = nn.Linear(4 * c, c)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.nh, c // self.nh).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.attn_proj(y.transpose(1, 2).contiguous().view(b, t, c))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, layers, c, nh, vp, t):
        super().__init__()
        self.wte = nn.Embedding(vp, c)
        self.wpe = nn.Embedding(t, c)
        self.h = nn.ModuleList(Block(c, nh) for _ in range(layers))
        self.ln_f = nn.LayerNorm(c)
        self.lm_head = nn.Linear(c, vp, bias=False)
        self.lm_head.weight = self.wte.weight
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                std = 0.02 / math.sqrt(2 * layers) if name.endswith("proj.weight") else 0.02
                nn.init.normal_(p, 0.0, std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, idx, targets):
        t = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(t, device=idx.device))
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.view(-1))


def num_params(layers, c, v, t):
    """Parameters as pipewright counts them: tied wte once, vocabulary unpadded."""
    return v * c + t * c + layers * (12 * c * c + 13 * c) + 2 * c


def matmul_rate(s):
    a = torch.full((s, s), 0.01, device="cuda", dtype=torch.bfloat16)
    b = torch.full((s, s), 0.01, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    best = float("inf")
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            a @ b
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3 / 10)
    return 2 * s**3 / best


def build(args, b, vp):
    model = GPT(args.layers, args.embd, args.heads, vp, args.seq).cuda()
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=6e-4,
        betas=(0.9, 0.95),
        eps=1e-8,
        fused=True,
    )
    step_model = model if args.no_compile else torch.compile(model)
    g = torch.Generator(device="cuda").manual_seed(1337)
    batches = [
        (
            torch.randint(args.vocab, (b, args.seq), device="cuda", generator=g),
            torch.randint(args.vocab, (b, args.seq), device="cuda", generator=g),
        )
        for _ in range(4)
    ]

    def step(k):
        x, y = batches[k % len(batches)]
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = step_model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return model, opt, step


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--embd", type=int, default=768)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--micro-batch", type=int, default=None, help="default: the largest of 64, 32, 16, ... that fits")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5, help="untimed steps first (compilation)")
    ap.add_argument("--matmul-size", type=int, default=8192)
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--json", action="store_true", help="end with one JSON line holding the figures")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("torch_gpu_bench.py: PyTorch sees no CUDA GPU")
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    vp = (args.vocab + 127) // 128 * 128
    log = lambda s: print(s, file=sys.stderr, flush=True)
    log(f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
    mm = matmul_rate(args.matmul_size)
    log(f"torch bf16 {args.matmul_size}³ product: {mm / 1e12:.1f} TFLOP/s")

    sizes = [args.micro_batch] if args.micro_batch else [64, 32, 16, 8, 4, 2, 1]
    chosen = None
    for b in sizes:
        try:
            model, opt, step = build(args, b, vp)
            first = step(0).item()
            for k in range(1, args.warmup):
                step(k)
            torch.cuda.synchronize()
            chosen = (b, model, opt, step, first)
            break
        except torch.cuda.OutOfMemoryError:
            if args.micro_batch:
                raise
            log(f"micro-batch {b}: out of memory, trying a smaller one")
            model = opt = step = None
            torch._dynamo.reset()
            torch.cuda.empty_cache()
    if chosen is None:
        sys.exit("torch_gpu_bench.py: not even a micro-batch of 1 fits")
    b, model, opt, step, first = chosen

    t0 = time.perf_counter()
    for k in range(args.steps):
        loss = step(k)
    torch.cuda.synchronize()
    secs = time.perf_counter() - t0
    last = loss.item()
    n = num_params(args.layers, args.embd, args.vocab, args.seq)
    fpt = 6 * n + 6 * args.layers * args.embd * args.seq
    tps = args.steps * b * args.seq / secs
    report = {
        "impl": "pytorch",
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(),
        "compiled": not args.no_compile,
        "n_layer": args.layers,
        "n_embd": args.embd,
        "n_head": args.heads,
        "vocab_size": args.vocab,
        "padded_vocab": vp,
        "seq": args.seq,
        "micro_batch": b,
        "steps": args.steps,
        "params": n,
        "flops_per_token": fpt,
        "ms_per_step": 1e3 * secs / args.steps,
        "tokens_per_s": tps,
        "mfu": tps * fpt / H100_BF16_PEAK,
        "matmul_flops": mm,
        "mfu_vs_matmul": tps * fpt / mm,
        "first_loss": first,
        "last_loss": last,
        "max_memory_gib": torch.cuda.max_memory_allocated() / 2**30,
    }
    print(
        f"PyTorch GPT-2 L={args.layers} C={args.embd} T={args.seq}, micro-batch {b}: "
        f"{report['ms_per_step']:.1f} ms/step, {tps:.0f} tokens/s, "
        f"MFU {100 * report['mfu']:.1f}% of 989 TFLOP/s, {100 * report['mfu_vs_matmul']:.1f}% of measured; "
        f"loss {first:.4f} → {last:.4f}"
    )
    if args.json:
        print(json.dumps(report))


if __name__ == "__main__":
    main()
