#!/usr/bin/env python3
"""The Hugging Face round trip, both ways, from Python's side:

    python scripts/hf_roundtrip.py RUN_DIR OUT_DIR TOKENS.bin N

Opens a pipewright run directory with `GPT2LMHeadModel.from_pretrained`
(its config.json and model.safetensors, unchanged), prints the mean loss over
the first N windows of an llm.c token file (window i = tokens[i*T : i*T+T+1],
as `pipewright eval` reads them), and writes the model with `save_pretrained`
into OUT_DIR, which `pipewright eval --weights OUT_DIR` then reads with no
--set. scripts/hf_check.sh compares the three losses.
"""
import sys

import numpy as np
import torch
import torch.nn.functional as F
from transformers import GPT2LMHeadModel


def main():
    if len(sys.argv) != 5:
        sys.exit(__doc__)
    run, out, data, n = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    model = GPT2LMHeadModel.from_pretrained(run).eval()
    T = model.config.n_positions
    header = np.fromfile(data, dtype="<i4", count=256)
    dtype = "<u2" if header[1] == 1 else "<u4"
    tokens = np.fromfile(data, dtype=dtype, offset=1024, count=int(header[2])).astype(np.int64)
    total = 0.0
    with torch.no_grad():
        for i in range(n):
            w = torch.from_numpy(tokens[i * T : i * T + T + 1])
            total += F.cross_entropy(model(w[None, :-1]).logits[0], w[1:]).item()
    print(f"{total / n:.9f}")
    model.save_pretrained(out)


if __name__ == "__main__":
    main()
