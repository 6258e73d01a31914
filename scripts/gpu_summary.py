#!/usr/bin/env python3
"""The summary of one device phase (scripts/gpu-device.sh): summary.json with
the fields docs/gpu.md lists, and a short table. Reads only what the phase left
in its work folder, so a step that failed or timed out leaves its fields null
and the others stand.

usage: gpu_summary.py check|bench WORKDIR COMMIT OUT.json OUT.txt
exit status: 0 when every step of the phase passed, 1 otherwise.
"""
import json
import os
import sys


def read(work, name):
    try:
        return open(os.path.join(work, name)).read()
    except OSError:
        return None


def rc(work, name):
    text = read(work, name + ".rc")
    return None if text is None else int(text.strip() or 1)


def last_json(work, name):
    text = read(work, name + ".txt") or ""
    for line in reversed(text.splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                return None
    return None


def check_summary(work):
    out = read(work, "gpu-check.txt") or ""
    failed = [line for line in out.splitlines() if line.startswith("FAIL")]
    passed = sum(1 for line in out.splitlines() if line.startswith("ok "))
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    digests = {}
    for line in (read(work, "pipeline.txt") or "").splitlines():
        dtype, layout, digest = line.split()
        digests[(dtype, layout)] = digest
    bits = {}
    for dtype in ("f32", "bf16"):
        one = digests.get((dtype, "pp1-1f1b"))
        for layout in ("pp2-1f1b", "pp2-gpipe"):
            two = digests.get((dtype, layout))
            ok = one is not None and one != "FAILED" and one == two
            bits[f"{dtype} {layout} = pp1"] = ok
        one, two = digests.get((dtype, "tp1-s2")), digests.get((dtype, "tp2-s2"))
        bits[f"{dtype} tp2 = tp1 (2 slices)"] = one is not None and one != "FAILED" and one == two
        one, two = digests.get((dtype, "llama-pp1")), digests.get((dtype, "llama-pp2"))
        bits[f"{dtype} llama pp2 = pp1"] = one is not None and one != "FAILED" and one == two
        one, two = digests.get((dtype, "llama-tp1-s2")), digests.get((dtype, "llama-tp2-s2"))
        bits[f"{dtype} llama tp2 = tp1 (2 slices)"] = one is not None and one != "FAILED" and one == two
    summary = {
        "gpu_check_passed": rc(work, "gpu-check") == 0,
        "gpu_checks_ok": passed,
        "gpu_checks_failed": failed,
        "gpu_check_error": errors[-1] if errors else None,
        "gpu_pipeline_bits_match": all(bits.values()),
        "gpu_pipeline": bits,
    }
    rows = [
        ("gpu-check", f"passed ({passed} checks)" if summary["gpu_check_passed"] else f"FAILED ({len(failed)} failed, {passed} ok)"),
    ] + [(k, "same bits" if v else "NO") for k, v in bits.items()]
    if errors:
        rows.append(("gpu-check stopped", errors[-1][:90]))
    rows += [("failed: " + f.split()[1], " ".join(f.split()[2:])) for f in failed[:8]]
    return summary, rows, summary["gpu_check_passed"] and summary["gpu_pipeline_bits_match"]


def bench_summary(work):
    pw = last_json(work, "gpu-bench")
    eager = last_json(work, "torch-eager")
    comp = last_json(work, "torch-compile")
    llama = last_json(work, "gpu-bench-llama")
    get = lambda d, k: None if d is None else d.get(k)
    ratio = lambda a, b: None if a is None or b is None else a["tokens_per_s"] / b["tokens_per_s"]
    summary = {
        "device": get(pw, "device") or get(comp, "device") or get(eager, "device"),
        "micro_batch": get(pw, "micro_batch"),
        "seq": get(pw, "seq"),
        "pipewright_tokens_per_s": get(pw, "tokens_per_s"),
        "pipewright_mfu": get(pw, "mfu"),
        "pipewright_mfu_vs_matmul": get(pw, "mfu_vs_matmul"),
        "pipewright_ms_per_step": get(pw, "ms_per_step"),
        "matmul_tflops": None if pw is None else pw["matmul_flops"] / 1e12,
        "pytorch_eager_tokens_per_s": get(eager, "tokens_per_s"),
        "pytorch_eager_mfu": get(eager, "mfu"),
        "pytorch_tokens_per_s": get(comp, "tokens_per_s"),
        "pytorch_mfu": get(comp, "mfu"),
        "pytorch_ms_per_step": get(comp, "ms_per_step"),
        "ratio_tokens_per_s": ratio(pw, comp),
        "ratio_tokens_per_s_eager": ratio(pw, eager),
        "llama_tokens_per_s": get(llama, "tokens_per_s"),
        "llama_mfu": get(llama, "mfu"),
        "llama_vs_gpt2_tokens_per_s": ratio(llama, pw),
        "steps_rc": {n: rc(work, n) for n in ("gpu-bench", "torch-eager", "torch-compile", "gpu-bench-llama")},
        "pipewright_report": pw,
        "llama_report": llama,
    }
    f = lambda x, fmt, scale=1: "n/a" if x is None else format(x * scale, fmt)
    rows = [
        ("device", summary["device"] or "n/a"),
        ("micro-batch x T", f'{summary["micro_batch"]} x {summary["seq"]}'),
        ("pipewright tokens/s", f(summary["pipewright_tokens_per_s"], ".0f")),
        ("pipewright MFU (989 TF) %", f(summary["pipewright_mfu"], ".1f", 100)),
        ("PyTorch eager tokens/s", f(summary["pytorch_eager_tokens_per_s"], ".0f")),
        ("PyTorch compile tokens/s", f(summary["pytorch_tokens_per_s"], ".0f")),
        ("PyTorch compile MFU %", f(summary["pytorch_mfu"], ".1f", 100)),
        ("pipewright / compile", f(summary["ratio_tokens_per_s"], ".3f")),
        ("cuBLASLt bf16 TFLOP/s", f(summary["matmul_tflops"], ".1f")),
        ("Llama (same L, C) tokens/s", f(summary["llama_tokens_per_s"], ".0f")),
        ("Llama MFU (989 TF) %", f(summary["llama_mfu"], ".1f", 100)),
    ]
    return summary, rows, all(v == 0 for v in summary["steps_rc"].values())


def main():
    phase, work, commit, out_json, out_txt = sys.argv[1:6]
    summary, rows, ok = (check_summary if phase == "check" else bench_summary)(work)
    summary = {"commit": commit, "phase": phase, "passed": ok, **summary}
    json.dump(summary, open(out_json, "w"), indent=1)
    rows = [("commit", commit[:12]), ("phase " + phase, "passed" if ok else "FAILED")] + rows
    open(out_txt, "w").write("\n".join(f"{k:<30} {v}" for k, v in rows) + "\n")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
