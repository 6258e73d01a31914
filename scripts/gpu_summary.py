#!/usr/bin/env python3
"""The summary of one device phase (scripts/gpu-device.sh): summary.json with
the fields docs/gpu.md lists, and a short table. Reads only what the phase left
in its work folder, so a step that failed or timed out leaves its fields null
and the others stand.

usage: gpu_summary.py first|check|bench WORKDIR COMMIT OUT.json OUT.txt
exit status: 0 when every step of the phase that ran passed, 1 otherwise. A
step the budget skipped (exit status 125, phase `first`) is listed under
`skipped` and its figures are null: not run is not failed.
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
    # True: same bits; False: different, or a run failed; None: not run (budget).
    def same(a, b):
        one, two = digests.get(a), digests.get(b)
        if one is None or two is None:
            return None
        return one != "FAILED" and one == two

    bits = {}
    for dtype in ("f32", "bf16"):
        one = (dtype, "pp1-1f1b")
        bits[f"{dtype} pp2-1f1b = pp1"] = same(one, (dtype, "pp2-1f1b"))
        bits[f"{dtype} pp2-gpipe = pp1"] = same(one, (dtype, "pp2-gpipe"))
        bits[f"{dtype} tp2 = tp1 (2 slices)"] = same((dtype, "tp1-s2"), (dtype, "tp2-s2"))
        bits[f"{dtype} llama pp2 = pp1"] = same((dtype, "llama-pp1"), (dtype, "llama-pp2"))
        bits[f"{dtype} llama tp2 = tp1 (2 slices)"] = same((dtype, "llama-tp1-s2"), (dtype, "llama-tp2-s2"))
    ran = [v for v in bits.values() if v is not None]
    check_rc = rc(work, "gpu-check")
    summary = {
        "gpu_check_passed": None if check_rc in (None, 125) else check_rc == 0,
        "gpu_checks_ok": passed,
        "gpu_checks_failed": failed,
        "gpu_check_error": errors[-1] if errors else None,
        "gpu_pipeline_bits_match": bool(ran) and all(ran),
        "gpu_pipeline": bits,
    }
    verdict = {True: "same bits", False: "NO", None: "not run"}
    if summary["gpu_check_passed"] is None:
        check_row = "not run"
    elif summary["gpu_check_passed"]:
        check_row = f"passed ({passed} checks)"
    else:
        check_row = f"FAILED ({len(failed)} failed, {passed} ok)"
    rows = [("gpu-check", check_row)] + [(k, verdict[v]) for k, v in bits.items()]
    if errors:
        rows.append(("gpu-check stopped", errors[-1][:90]))
    rows += [("failed: " + f.split()[1], " ".join(f.split()[2:])) for f in failed[:8]]
    ok = summary["gpu_check_passed"] is not False and all(v is not False for v in bits.values())
    return summary, rows, ok


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
    return summary, rows, all(v in (0, 125, None) for v in summary["steps_rc"].values())


def skipped(work):
    names = sorted(f[:-3] for f in os.listdir(work) if f.endswith(".rc"))
    return [n for n in names if rc(work, n) == 125]


def main():
    phase, work, commit, out_json, out_txt = sys.argv[1:6]
    if phase == "first":
        # The figures first (MFU, tokens/s), then the bits.
        bench, bench_rows, bench_ok = bench_summary(work)
        check, check_rows, check_ok = check_summary(work)
        summary, rows, ok = {**bench, **check}, bench_rows + check_rows, bench_ok and check_ok
    else:
        summary, rows, ok = (check_summary if phase == "check" else bench_summary)(work)
    summary = {"commit": commit, "phase": phase, "passed": ok, "skipped": skipped(work), **summary}
    if summary["skipped"]:
        rows.append(("skipped (budget)", " ".join(summary["skipped"])[:90]))
    json.dump(summary, open(out_json, "w"), indent=1)
    rows = [("commit", commit[:12]), ("phase " + phase, "passed" if ok else "FAILED")] + rows
    open(out_txt, "w").write("\n".join(f"{k:<32} {v}" for k, v in rows) + "\n")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
