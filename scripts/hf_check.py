#!/usr/bin/env python3
"""Mean next-token loss of pipewright weights, computed by Hugging Face's
`transformers.GPT2LMHeadModel` instead of by pipewright.

    /work/venv-torch/bin/python scripts/hf_check.py WEIGHTS.safetensors TOKENS.bin N

The model shape comes from the file's `pipewright.config` metadata (the run's
resolved TOML). Windows are read as `pipewright eval` reads them: window i is
tokens[i*T : i*T + T + 1] of an llm.c token file (256 int32 header, magic
20240520, version 1 = uint16 tokens, 2 = uint32). Prints the mean loss over the
first N windows; `scripts/hf_check.sh` compares it with `pipewright eval`.
"""
import sys, tomllib

import numpy as np
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import GPT2Config, GPT2LMHeadModel


def read_tokens(path):
    header = np.fromfile(path, dtype="<i4", count=256)
    if header[0] != 20240520 or header[1] not in (1, 2):
        sys.exit(f"{path}: not an llm.c token file (magic {header[0]}, version {header[1]})")
    dtype = "<u2" if header[1] == 1 else "<u4"
    return np.fromfile(path, dtype=dtype, offset=256 * 4, count=int(header[2])).astype(np.int64)


def main():
    if len(sys.argv) != 4:
        sys.exit(__doc__)
    weights, tokens_path, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    with safe_open(weights, "pt") as f:
        m = tomllib.loads(f.metadata()["pipewright.config"])["model"]
    T = m["block_size"]
    cfg = GPT2Config(
        n_layer=m["n_layer"], n_head=m["n_head"], n_embd=m["n_embd"], vocab_size=m["vocab_size"],
        n_positions=T, activation_function="gelu_new", layer_norm_epsilon=1e-5,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=True,
        bos_token_id=None, eos_token_id=None, attn_implementation="eager",
    )
    model = GPT2LMHeadModel(cfg).eval()
    res = model.transformer.load_state_dict(load_file(weights), strict=False)
    buffers = [k for k in res.missing_keys if k.endswith((".attn.bias", ".attn.masked_bias"))]
    if res.unexpected_keys or len(buffers) != len(res.missing_keys):
        sys.exit(f"key mismatch: missing {res.missing_keys}, unexpected {res.unexpected_keys}")
    model.tie_weights()
    assert model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr()

    tokens = read_tokens(tokens_path)
    if n * T + 1 > len(tokens):
        sys.exit(f"{tokens_path}: holds only {(len(tokens) - 1) // T} windows of {T + 1} tokens")
    total = 0.0
    with torch.no_grad():
        for i in range(n):
            w = torch.from_numpy(tokens[i * T : i * T + T + 1])
            logits = model(w[None, :-1]).logits[0]
            total += F.cross_entropy(logits, w[1:]).item()
    print(f"{total / n:.9f}")


if __name__ == "__main__":
    main()
