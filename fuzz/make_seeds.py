#!/usr/bin/env python3
"""Writes the seed corpora under fuzz/corpus/ (files named seed-*): small valid
inputs of each target, so the fuzzer starts past the first checks, and a few
rejected ones. The corpus test (tests/fuzz_corpus.rs) requires every
seed-valid-* input to be accepted and every input to be handled without a panic.
Run from anywhere: python3 fuzz/make_seeds.py"""
import json, struct
from pathlib import Path

HERE = Path(__file__).resolve().parent
CORPUS = HERE / "corpus"
SEP = b"\n--8<--\n"  # pipewright::fuzz::CHECKPOINT_SEPARATOR


def write(target, name, data):
    (CORPUS / target / f"seed-{name}").write_bytes(data)


def config_seeds():
    for toml in sorted((HERE.parent / "configs").glob("*.toml")):
        write("config", "valid-" + toml.name, toml.read_bytes())
    # A file, then NUL-separated --set arguments.
    write("config", "valid-overrides", b'[model]\nn_layer = 2\n\0parallel.pp=2\0data.train=2024\0optim.lr=1e-3')


def llmc(version, tokens):
    header = [0] * 256
    header[0:3] = [20240520, version, len(tokens)]
    fmt = "<%dH" if version == 1 else "<%dI"
    return struct.pack("<256i", *header) + struct.pack(fmt % len(tokens), *tokens)


def token_file_seeds():
    write("token_file", "valid-llmc-u16.bin", llmc(1, [0, 1, 255, 50256]))
    write("token_file", "valid-llmc-u32.bin", llmc(2, [0, 65536, 100276]))
    write("token_file", "valid-raw-u16.bin", struct.pack("<4H", 3, 1, 4, 1))
    write("token_file", "truncated-llmc.bin", llmc(1, [1, 2, 3])[:-2])


TINY = dict(n_layer=1, n_head=1, n_embd=2, vocab_size=4, block_size=2)
TINY_CONFIG = """[model]
n_layer = 1
n_head = 1
n_embd = 2
vocab_size = 4
block_size = 2

[data]
builtin = "random"

[parallel]
pp = 1
microbatches = 1
"""


def tensors():
    c, v, t = TINY["n_embd"], TINY["vocab_size"], TINY["block_size"]
    out = {"wte.weight": [v, c], "wpe.weight": [t, c]}
    for s, shape in [("ln_1.weight", [c]), ("ln_1.bias", [c]), ("attn.c_attn.weight", [c, 3 * c]),
                     ("attn.c_attn.bias", [3 * c]), ("attn.c_proj.weight", [c, c]), ("attn.c_proj.bias", [c]),
                     ("ln_2.weight", [c]), ("ln_2.bias", [c]), ("mlp.c_fc.weight", [c, 4 * c]),
                     ("mlp.c_fc.bias", [4 * c]), ("mlp.c_proj.weight", [4 * c, c]), ("mlp.c_proj.bias", [c])]:
        out[f"h.0.{s}"] = shape
    out["ln_f.weight"] = [c]
    out["ln_f.bias"] = [c]
    return out


def safetensors(named_shapes, value):
    header, data = {"__metadata__": {"format": "pt"}}, b""
    for name in sorted(named_shapes):
        shape = named_shapes[name]
        n = 1
        for d in shape:
            n *= d
        blob = struct.pack("<%df" % n, *([value] * n))
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [len(data), len(data) + len(blob)]}
        data += blob
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    return struct.pack("<Q", len(h)) + h + data


def checkpoint_seeds():
    model = safetensors(tensors(), 0.5)
    moments = {}
    for name, shape in tensors().items():
        moments[f"{name}.exp_avg"] = shape
        moments[f"{name}.exp_avg_sq"] = shape
    optim = safetensors(moments, 0.25)
    state = {
        "format_version": 1, "step": 1, "adam_step": 1, "tokens": 8, "skipped_steps": 0, "data_cursor": 4,
        "seed": 1337, "next_lr": 0.001, "config": TINY_CONFIG, "config_hash": "0" * 64,
        # Placeholders: with flag 1 the target writes the true blake3 digests.
        "digests": {"model.safetensors": "", "optimizer.safetensors": ""},
    }
    as_is = json.dumps(state, indent=2).encode()
    write("checkpoint", "valid-tiny-model", b"\x01" + SEP.join([as_is, model, optim]))
    # Flag 0, only state.json: the loader must report the missing model file.
    write("checkpoint", "missing-model", b"\x00" + as_is)


if __name__ == "__main__":
    for target in ["config", "token_file", "checkpoint"]:
        d = CORPUS / target
        if d.exists():
            for f in d.glob("seed-*"):
                f.unlink()
        d.mkdir(parents=True, exist_ok=True)
    config_seeds()
    token_file_seeds()
    checkpoint_seeds()
