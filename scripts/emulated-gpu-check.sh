#!/usr/bin/env bash
# What CI runs on emulated GPUs on every commit (through scripts/emulated-gpu.sh
# --gpus 4): the CUDA backend, unmodified, against its CPU twin and itself.
#   1. gpu-check whole: every kernel against its CPU twin (f32, bf16; each
#      at even shapes and at ragged ones), then the kernel groups again under
#      the order check (PW_EMU_CHECK=order: two thread orders, same bits); whole
#      steps GPU vs CPU, pp 2 = pp 1 and tp = tp 1 bits (ranks taking turns
#      on one GPU, and tp 2 and 4 on as many GPUs over NCCL), the tree join,
#      cross-entropy at V = 50,257;
#   2. train with backend.kind = "cuda" at a small shape: f32 losses equal the
#      CPU backend's (relative 1e-5), bf16 within bf16's rounding (2e-2);
#      pp 2 (1F1B, selective recompute) = pp 1 weights; tp 2 on two emulated
#      GPUs (NCCL) = tp 1;
#      dp 2 across two processes (launch --nodes 2, NCCL between them) runs;
#      a checkpoint and a resume end on the uninterrupted run's weights;
#      greedy generate on the GPU writes the CPU's text; every run keeps
#      an EMA of its weights, compared with the weights; a batch ramp: pp 2
#      gives pp 1's bits, the losses the CPU's, and the EMA is the CPU
#      twin's lerp of the GPU's weights, bit for bit;
#   3. the same for a Llama (grouped-query attention, SwiGLU, RoPE, untied
#      head): f32 and bf16 losses against the CPU's, pp 2 (selective
#      recompute) = full recompute = dp 2 = pp 1, tp 2 on two GPUs (selective
#      recompute) = tp 1, greedy generate = the CPU's text;
#   4. Qwen3 (the per-head q/k norm) and Mistral (a sliding window of 12 of
#      the 64 positions) from their tiny configs, shortened as the Llama's:
#      f32 losses against the CPU's;
#   5. what a steady step asks of the driver (gpu-bench --counts) within
#      scripts/gpu-counts-bounds.json.
# Prints a table last; exits non-zero if any row failed.
# usage: scripts/emulated-gpu.sh --gpus 4 scripts/emulated-gpu-check.sh [--no-gpu-check]
set -uo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
bin="${PIPEWRIGHT_BIN:-${CARGO_TARGET_DIR:-$root/target}/release/pipewright}"
[ -x "$bin" ] || { echo "emulated-gpu-check: no binary at $bin (build with --features cuda)" >&2; exit 2; }
[ -n "${PW_EMU_GPUS:-}" ] || { echo "emulated-gpu-check: run me through scripts/emulated-gpu.sh --gpus 4" >&2; exit 2; }
work="$(mktemp -d "${TMPDIR:-/tmp}/pw-emu-check.XXXXXX")"
rows=()
failed=0
start_all=$(date +%s)

row() { # name status detail seconds
    rows+=("$(printf '%-34s %-5s %7ss  %s' "$1" "$2" "$4" "$3")")
    [ "$2" = ok ] || failed=1
    echo "-- $1: $2 ($3, $4 s)"
}

# run NAME CMD...: output to $work/NAME.log; sets $rc and $secs.
run() {
    local name="$1"; shift
    local t0; t0=$(date +%s)
    "$@" >"$work/$name.log" 2>&1
    rc=$?
    secs=$(( $(date +%s) - t0 ))
    if [ "$rc" -ne 0 ]; then
        echo "== $name failed (exit $rc); its last lines:"
        tail -n 30 "$work/$name.log"
    fi
}

digest() { python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["weights_digest"])' "$1/summary.json" 2>/dev/null || echo none; }
# The EMA's digest (optim.ema_decay), or none.
ema_digest() { python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["ema_weights_digest"])' "$1/summary.json" 2>/dev/null || echo none; }

# losses A B TOL: max relative difference of the per-step losses, and whether it is within TOL.
losses() {
    python3 - "$1/metrics.jsonl" "$2/metrics.jsonl" "$3" <<'PY'
import json, sys
a = [json.loads(l)["loss"] for l in open(sys.argv[1])]
b = [json.loads(l)["loss"] for l in open(sys.argv[2])]
tol = float(sys.argv[3])
if len(a) != len(b) or not a:
    print(f"steps {len(a)} vs {len(b)}"); sys.exit(1)
worst = max(abs(x - y) / max(abs(y), 1e-30) for x, y in zip(a, b))
print(f"max rel diff {worst:.2e} over {len(a)} steps (tol {tol:g})")
sys.exit(0 if worst <= tol else 1)
PY
}

# vs_cpu NAME LABEL REF DTYPE SETS...: 4 steps on the GPU into $work/NAME-DTYPE, its
# losses against the CPU run REF's (f32 to 1e-5 relative, bf16 within its rounding, 2e-2).
vs_cpu() {
    local name="$1-$4" label="$2" ref="$3" dtype="$4" tol=1e-5 detail ok
    shift 4
    [ "$dtype" = bf16 ] && tol=2e-2
    run "$name" "$bin" train "$@" "${cuda[@]}" --set "backend.dtype=\"$dtype\"" --steps 4 --out "$work/$name"
    if [ $rc = 0 ]; then
        detail=$(losses "$work/$name" "$ref" "$tol"); ok=$?
        row "train $label $dtype vs cpu losses" "$([ $ok = 0 ] && echo ok || echo FAIL)" "$detail" "$secs"
    else
        row "train $label $dtype vs cpu losses" FAIL "exit $rc" "$secs"
    fi
}

# same_weights LABEL REF_RUN RUN: a row, ok when both runs end on one weights
# digest and one digest of the EMA of the weights (or both keep none).
same_weights() {
    local a b ea eb
    a=$(digest "$2"); b=$(digest "$3"); ea=$(ema_digest "$2"); eb=$(ema_digest "$3")
    row "$1" "$([ "$a" = "$b" ] && [ "$a" != none ] && [ "$ea" = "$eb" ] && echo ok || echo FAIL)" \
        "${b:0:12} vs ${a:0:12}, EMA ${eb:0:12} vs ${ea:0:12}" "$secs"
}

# same_text LABEL NAME RUN MODEL_SETS...: greedy generation from RUN's weights on
# the CPU and on the GPU (f32); ok when the two texts are the same bytes.
same_text() {
    local label="$1" name="$2" weights="$3"
    shift 3
    local gen=(generate "$@" --weights "$weights" --prompt "ab" --max-new-tokens 24 --temperature 0)
    run "$name-cpu" "$bin" "${gen[@]}"
    run "$name-gpu" "$bin" "${gen[@]}" "${cuda[@]}" --set 'backend.dtype="f32"'
    if [ $rc = 0 ] && cmp -s "$work/$name-cpu.log" "$work/$name-gpu.log"; then
        row "$label" ok "$(wc -c <"$work/$name-gpu.log") bytes" "$secs"
    else
        row "$label" FAIL "$(diff "$work/$name-cpu.log" "$work/$name-gpu.log" | head -n 4 | tr '\n' ' ')" "$secs"
    fi
}

# The model (what generate needs too), then the run.
model=(--set model.n_layer=2 --set model.n_embd=128 --set model.n_head=2 --set model.vocab_size=256
       --set model.block_size=64)
# Every run keeps an EMA of its weights (optim.ema_decay): same_weights
# compares it too, so pp, tp, dp, recompute and a resume check its bits.
small=("${model[@]}" --set train.micro_batch_size=4 --set train.eval_every=0 --set 'data.builtin="random"'
       --set parallel.pp=1 --set parallel.microbatches=2 --set optim.ema_decay=0.9 --force)
cuda=(--set 'backend.kind="cuda"')

# 1. gpu-check (--no-gpu-check skips it: it takes minutes)
if [ "${1:-}" != "--no-gpu-check" ]; then
run gpu-check "$bin" gpu-check
row "gpu-check (all groups)" "$([ $rc = 0 ] && echo ok || echo FAIL)" "$(grep -E 'GPU checks passed|failed' "$work/gpu-check.log" | tail -n 1)" "$secs"
# The kernel groups again under check modes: every launch run in two thread
# orders that must give the same bits (order: a missing barrier the default
# schedule passes by luck is named); and watched: every access inside its
# allocation, slack included (bounds), no byte one block writes touched by
# another block of the launch (blocks), no shared byte two threads of a warp
# touch, one writing, without a barrier or __syncwarp between (warp). Watched
# kernels are built instrumented, into a cache of their own.
# kernel_groups ROW DETAIL ENV...: each kernel group with ENV set, as one row.
kernel_groups() {
    local label="$1" detail="$2" t0 g failed="" log
    shift 2
    t0=$(date +%s)
    for g in layernorm rmsnorm rope swiglu matmul attention elementwise crossentropy embedding adamw ema norm tree exactness; do
        log="$work/gpu-check-${label//[^a-z]/-}-$g.log"
        env "$@" "$bin" gpu-check --only "$g" >"$log" 2>&1 || {
            failed="$failed $g"
            tail -n 20 "$log"
        }
    done
    secs=$(( $(date +%s) - t0 ))
    if [ -z "$failed" ]; then
        row "gpu-check kernels, $label" ok "$detail" "$secs"
    else
        row "gpu-check kernels, $label" FAIL "failed:$failed" "$secs"
    fi
}
kernel_groups "order check" "14 kernel groups, two thread orders each" PW_EMU_CHECK=order
kernel_groups "bounds/blocks/warp" "14 kernel groups, every access watched" PW_EMU_CHECK=bounds,blocks,warp \
    PIPEWRIGHT_KERNEL_CACHE="$PIPEWRIGHT_KERNEL_CACHE-watch"
fi

# 2. training: CPU reference, then the GPU in f32 and bf16.
run cpu "$bin" train "${small[@]}" --steps 4 --out "$work/cpu"
row "train cpu (reference)" "$([ $rc = 0 ] && echo ok || echo FAIL)" "digest $(digest "$work/cpu" | cut -c1-12)" "$secs"
for dtype in f32 bf16; do
    vs_cpu gpu cuda "$work/cpu" "$dtype" "${small[@]}"
done

# pp 2 on one GPU (both stages on GPU 0) against pp 1; the pp 2 run with
# selective recompute (LayerNorm and GELU made again in backward, with the
# forward's bits).
run gpu-pp2 "$bin" train "${small[@]}" "${cuda[@]}" --set 'backend.dtype="f32"' --set parallel.pp=2 \
    --set 'backend.devices=[0,0]' --set train.recompute=selective --steps 4 --out "$work/gpu-pp2"
same_weights "cuda pp 2, selective = pp 1 weights" "$work/gpu-f32" "$work/gpu-pp2"

# tp 2 over two emulated GPUs (NCCL between them) against tp 1, both over 2 slices.
for tp in 1 2; do
    devs="[0]"; [ $tp = 2 ] && devs="[0,1]"
    run "gpu-tp$tp" "$bin" train "${small[@]}" "${cuda[@]}" --set 'backend.dtype="f32"' --set parallel.tp=$tp \
        --set parallel.tp_slices=2 --set "backend.devices=$devs" --steps 3 --out "$work/gpu-tp$tp"
done
same_weights "cuda tp 2 (2 GPUs) = tp 1 weights" "$work/gpu-tp1" "$work/gpu-tp2"

# dp 2 across two processes: launch, NCCL between the processes (GPU 0 and GPU 1).
run gpu-launch-dp2 "$bin" launch --nodes 2 "${small[@]}" "${cuda[@]}" --set 'backend.dtype="f32"' --set parallel.dp=2 \
    --set 'backend.devices=[0,1]' --steps 3 --out "$work/gpu-launch-dp2"
row "cuda dp 2 over 2 processes (launch)" "$([ $rc = 0 ] && [ "$(digest "$work/gpu-launch-dp2")" != none ] && echo ok || echo FAIL)" \
    "digest $(digest "$work/gpu-launch-dp2" | cut -c1-12)" "$secs"

# A checkpoint at step 2, a resume to step 4: the uninterrupted run's weights.
run gpu-ckpt "$bin" train "${small[@]}" "${cuda[@]}" --set 'backend.dtype="f32"' --set checkpoint.every=2 \
    --steps 2 --out "$work/gpu-ckpt"
run gpu-resume "$bin" train --resume "$work/gpu-ckpt" --steps 4
same_weights "cuda checkpoint + resume = whole run" "$work/gpu-f32" "$work/gpu-ckpt"

# Greedy generation on the GPU writes the CPU's text from the same weights.
same_text "cuda greedy generate = cpu text" gen "$work/gpu-f32" "${model[@]}"

# The EMA of the weights (every run above keeps one: see `small`) step by
# step, and a batch ramp, on the device: 2 steps of 1, then 2 microbatches
# (the smaller step's schedule, gradient tree and loss scale), checkpointed
# after each. pp 2 (both stages on GPU 0) ends on pp 1's weights and EMA bit
# for bit; the losses are the CPU backend's within 1e-5; and the GPU's EMA is
# the CPU twin's lerp of the GPU's own weights, bit for bit: step 1's EMA is
# step 1's weights, step 2's is lerp(step 1's EMA, step 2's weights).
ramp=("${small[@]}" --set 'train.batch_ramp={ start = 4, increment = 4, tokens = 200 }' --set checkpoint.every=1)
t_ramp=$(date +%s)
run ramp-cpu "$bin" train "${ramp[@]}" --steps 2 --out "$work/ramp-cpu"
run ramp-gpu "$bin" train "${ramp[@]}" "${cuda[@]}" --set 'backend.dtype="f32"' --steps 2 --out "$work/ramp-gpu"
run ramp-pp2 "$bin" train "${ramp[@]}" "${cuda[@]}" --set 'backend.dtype="f32"' --set parallel.pp=2 \
    --set 'backend.devices=[0,0]' --steps 2 --out "$work/ramp-pp2"
secs=$(( $(date +%s) - t_ramp ))
detail=$(python3 - "$work" <<'PY'
import json, struct, sys
w = sys.argv[1]
f32 = lambda x: struct.unpack("<f", struct.pack("<f", x))[0]
def tensors(path):
    raw = open(path, "rb").read()
    n = struct.unpack("<Q", raw[:8])[0]
    head = json.loads(raw[8:8 + n])
    out = {}
    for name, t in sorted(head.items()):
        if name == "__metadata__": continue
        assert t["dtype"] == "F32", (name, t["dtype"])
        a, b = t["data_offsets"]
        out[name] = struct.unpack(f"<{(b - a) // 4}f", raw[8 + n + a:8 + n + b])
    return out
def lerp(e, p, wt):
    # ATen's vectorized CPU lerp (kernels/cpu/ema.rs): p - e rounded to f32, then one
    # fused multiply-add, exact in f64 (a product of two f32s) and rounded once.
    d = f32(p - e)
    return f32(wt * d + e) if abs(wt) < 0.5 else f32((wt - 1.0) * d + p)
try:
    s = {r: json.load(open(f"{w}/{r}/summary.json")) for r in ("ramp-gpu", "ramp-pp2")}
    key = lambda r: (s[r]["weights_digest"], s[r]["ema_weights_digest"])
    pp2 = "pp 2 = pp 1" if key("ramp-pp2") == key("ramp-gpu") else "pp 2 differs"
    la = [json.loads(l)["loss"] for l in open(f"{w}/ramp-gpu/metrics.jsonl")]
    lb = [json.loads(l)["loss"] for l in open(f"{w}/ramp-cpu/metrics.jsonl")]
    loss = max(abs(x - y) / abs(y) for x, y in zip(la, lb)) if len(la) == len(lb) == 2 else float("inf")
    ck = lambda k, f: tensors(f"{w}/ramp-gpu/checkpoints/step_0000000{k}/{f}.safetensors")
    (w1, e1), (w2, e2) = (ck(1, "model"), ck(1, "model.ema")), (ck(2, "model"), ck(2, "model.ema"))
    wt = f32(1.0 - 0.9)
    bad = sum(x != y for k in w1 for x, y in zip(e1[k], w1[k]))
    bad += sum(lerp(e, p, wt) != got for k in w2 for e, p, got in zip(e1[k], w2[k], e2[k]))
    n = sum(len(v) for v in w2.values())
except Exception as e:
    print(f"no result: {e!r}"); sys.exit(1)
print(f"{pp2}; losses vs cpu {loss:.1e}; EMA = cpu twin's lerp: {n - bad}/{n} elements")
sys.exit(0 if pp2 == "pp 2 = pp 1" and loss <= 1e-5 and bad == 0 else 1)
PY
); ok=$?
row "cuda EMA + batch ramp" "$([ $ok = 0 ] && echo ok || echo FAIL)" "$detail" "$secs"

# 3. A Llama (RMSNorm, RoPE, SwiGLU, two query heads sharing one key/value
# head of size 64, an untied head) on the GPU against the CPU and itself.
llama_model=("${model[@]}" --set 'model.family="llama"' --set model.n_kv_head=1 --set model.intermediate_size=192)
llama=("${small[@]}" --set 'model.family="llama"' --set model.n_kv_head=1 --set model.intermediate_size=192)
run llama-cpu "$bin" train "${llama[@]}" --steps 4 --out "$work/llama-cpu"
row "train llama cpu (reference)" "$([ $rc = 0 ] && echo ok || echo FAIL)" "digest $(digest "$work/llama-cpu" | cut -c1-12)" "$secs"
for dtype in f32 bf16; do
    vs_cpu llama-gpu "llama cuda" "$work/llama-cpu" "$dtype" "${llama[@]}"
done
# pp 2 with selective recompute (RMSNorm and SwiGLU made again in backward).
run llama-gpu-pp2 "$bin" train "${llama[@]}" "${cuda[@]}" --set 'backend.dtype="f32"' --set parallel.pp=2 \
    --set 'backend.devices=[0,0]' --set train.recompute=selective --steps 4 --out "$work/llama-gpu-pp2"
same_weights "cuda llama pp 2, selective = pp 1" "$work/llama-gpu-f32" "$work/llama-gpu-pp2"
# Recompute in backward, and dp 2 (two GPUs, one microbatch each: the same
# global batch; the microbatch tree's sums exchanged in the untied head's
# part order): the same weights.
run llama-gpu-recompute "$bin" train "${llama[@]}" "${cuda[@]}" --set 'backend.dtype="f32"' --set train.recompute=true \
    --steps 4 --out "$work/llama-gpu-recompute"
same_weights "cuda llama recompute = plain weights" "$work/llama-gpu-f32" "$work/llama-gpu-recompute"
run llama-gpu-dp2 "$bin" train "${llama[@]}" "${cuda[@]}" --set 'backend.dtype="f32"' --set parallel.dp=2 \
    --set parallel.microbatches=1 --set 'backend.devices=[0,1]' --steps 4 --out "$work/llama-gpu-dp2"
same_weights "cuda llama dp 2 (2 GPUs) = dp 1 weights" "$work/llama-gpu-f32" "$work/llama-gpu-dp2"
# tp 2 over two emulated GPUs (NCCL) against tp 1, both over 2 slices: a
# rank needs whole key/value groups, so here each query head has its own.
# tp 2 with selective recompute: each rank makes its own share again.
for tp in 1 2; do
    devs="[0]" rc=none; [ $tp = 2 ] && devs="[0,1]" rc=selective
    run "llama-gpu-tp$tp" "$bin" train "${llama[@]}" "${cuda[@]}" --set 'backend.dtype="f32"' --set model.n_kv_head=2 \
        --set parallel.tp=$tp --set parallel.tp_slices=2 --set "backend.devices=$devs" --set train.recompute=$rc \
        --steps 3 --out "$work/llama-gpu-tp$tp"
done
same_weights "cuda llama tp 2 (2 GPUs), selective = tp 1" "$work/llama-gpu-tp1" "$work/llama-gpu-tp2"
same_text "cuda llama greedy generate = cpu" llama-gen "$work/llama-gpu-f32" "${llama_model[@]}"

# 4. Qwen3's and Mistral's settings from their tiny configs, shortened as the
# Llama's above, at head sizes other than 64: Qwen3's head_dim (48, which the
# attention kernels do not take) set to 96, Phi's (two heads of 96 over a
# 128-wide stream), and Mistral's four heads of 32 (its config's). f32
# losses against the CPU's.
for fam in qwen3 mistral; do
    fam_run=(--config "$root/configs/$fam-tiny.toml" "${small[@]}" --set model.n_kv_head=1 \
             --set model.intermediate_size=192)
    [ "$fam" = qwen3 ] && fam_run+=(--set model.head_dim=96)
    [ "$fam" = mistral ] && fam_run+=(--set model.n_head=4)
    run "$fam-cpu" "$bin" train "${fam_run[@]}" --steps 4 --out "$work/$fam-cpu"
    row "train $fam cpu (reference)" "$([ $rc = 0 ] && echo ok || echo FAIL)" "digest $(digest "$work/$fam-cpu" | cut -c1-12)" "$secs"
    vs_cpu "$fam-gpu" "$fam cuda" "$work/$fam-cpu" f32 "${fam_run[@]}"
done

# 5. What a steady step asks of the driver (gpu-bench --counts: launches,
# cuBLASLt calls, host-blocking synchronizes, copies by direction, allocations,
# per step, per microbatch and per block), held to scripts/gpu-counts-bounds.json:
# a change that adds any of them fails here; one that removes some lowers the bounds.
run counts "$bin" gpu-bench --counts --layers 2 --embd 128 --heads 2 --vocab 256 --seq 64 --micro-batch 2 --json
if [ $rc = 0 ]; then
    detail=$(python3 - "$work/counts.log" "$root/scripts/gpu-counts-bounds.json" <<'PY'
import json, sys
report = json.loads([l for l in open(sys.argv[1]) if l.startswith("{")][-1])
bounds = json.load(open(sys.argv[2]))
over = [f"{part}.{k} {report[part][k]} > {v}" for part, b in bounds.items() if not part.startswith("_")
        for k, v in b.items() if report[part][k] > v]
mb = report["per_microbatch"]
print("; ".join(over) if over else
      f"per microbatch {mb['launches']} launches, {mb['host_syncs']} host syncs, {mb['h2d_copies']} uploads")
sys.exit(1 if over else 0)
PY
); ok=$?
    row "gpu counts within bounds" "$([ $ok = 0 ] && echo ok || echo FAIL)" "$detail" "$secs"
else
    row "gpu counts within bounds" FAIL "exit $rc" "$secs"
fi

echo
echo "emulated GPU checks ($PW_EMU_GPUS emulated GPUs, $(( $(date +%s) - start_all )) s in all; logs in $work)"
printf '%s\n' "${rows[@]}"
passed=0; for r in "${rows[@]}"; do [[ "$r" == *" ok "* ]] && passed=$((passed+1)); done
echo "emulated-gpu: $passed passed, $(( ${#rows[@]} - passed )) failed"
exit $failed
