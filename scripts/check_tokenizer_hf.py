#!/usr/bin/env python3
"""Does transformers read a pipewright tokenizer as pipewright does?

usage: python3 scripts/check_tokenizer_hf.py DATASET_DIR TEXT_FILE

DATASET_DIR is `pipewright prepare TEXT_FILE --tokenizer T --out DATASET_DIR
--val-fraction 0` (one text file, one document). Loads DATASET_DIR's
tokenizer.json with PreTrainedTokenizerFast and the folder with
AutoTokenizer, encodes TEXT_FILE, and compares the ids with DATASET_DIR's
train.bin; exits 1 on any difference. Needs transformers (CI has not: the
Rust tests check the file's determinism and round trip without it).
"""
import struct
import sys

from transformers import AutoTokenizer, PreTrainedTokenizerFast

folder, text_file = sys.argv[1], sys.argv[2]
text = open(text_file, encoding="utf-8").read()
raw = open(f"{folder}/train.bin", "rb").read()
magic, version, count = struct.unpack("<3i", raw[:12])
assert magic == 20240520, magic
width = "H" if version == 1 else "I"
ours = list(struct.unpack(f"<{count}{width}", raw[1024:]))
fast = PreTrainedTokenizerFast(tokenizer_file=f"{folder}/tokenizer.json")
auto = AutoTokenizer.from_pretrained(folder)
ok = True
for name, tok in [("PreTrainedTokenizerFast", fast), ("AutoTokenizer", auto)]:
    ids = tok.encode(text, add_special_tokens=False)
    same = ids == ours
    ok &= same and tok.decode(ids) == text
    print(f"{name}: {len(ids)} ids, {'identical to' if same else 'DIFFERENT from'} pipewright's {len(ours)}")
sys.exit(0 if ok else 1)
