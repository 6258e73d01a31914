#!/usr/bin/env python3
"""The Python `tokenizers` package on the file `pipewright bench --data`
tokenizes, for the side-by-side figure in docs/benchmarks.md.

usage: RAYON_NUM_THREADS=2 python3 scripts/bench_tokenizers.py TOKENIZER.json FILE

Encodes every line of FILE (one document a line) with encode_batch in
batches of 4096 lines, as transformers' fast tokenizers do, and prints
MB/s over the bytes of the lines. Needs the `tokenizers` package.
"""
import sys
import time

from tokenizers import Tokenizer

tok = Tokenizer.from_file(sys.argv[1])
with open(sys.argv[2], encoding="utf-8") as f:
    lines = [line.rstrip("\n") for line in f]
total = sum(len(line.encode("utf-8")) for line in lines)
start, cpu = time.perf_counter(), time.process_time()
tokens = 0
for i in range(0, len(lines), 4096):
    for enc in tok.encode_batch_fast(lines[i : i + 4096], add_special_tokens=False):
        tokens += len(enc.ids)
elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
print(
    f"python tokenizers: {total / 1e6 / elapsed:.1f} MB/s (wall), {total / 1e6 / cpu:.1f} MB per CPU-s "
    f"({tokens} tokens, {elapsed:.1f} s)"
)
