#!/usr/bin/env python3
"""A pure-Python emulator of kernels/flash_attention.cu's warp code, for
checking the kernels' fragment bookkeeping on a machine without a GPU.

Each kernel is transcribed with the 32 lanes of a warp as a loop; mma.sync
m16n8k16 is emulated from the PTX ISA's fragment layout (A 16x16 row, B 16x8
col, C 16x8), independently of how the kernels pack their registers, and
operands are rounded to bf16 where the kernels round them. The results are
compared with plain causal attention and its gradients in float64. A mistake
in which lane holds which element shows up as an O(1) error; bf16 rounding of
P and dS leaves ~1e-3. It does not check global-memory indexing (the
transcription reads Python lists) or anything about timing: gpu-check does.

usage: scripts/flash_attention_emu.py [T] [head size]   (default 70 64: about 5 s)
It is a transcription: change it with the kernel.
"""
import math, random, struct, sys

def bf16(x):
    u = struct.unpack('<I', struct.pack('<f', x))[0]
    if (u & 0x7fffffff) > 0x7f800000:
        return x
    u = (u + 0x7fff + ((u >> 16) & 1)) & 0xffff0000
    return struct.unpack('<f', struct.pack('<I', u & 0xffffffff))[0]

def f32(x):
    return struct.unpack('<f', struct.pack('<f', x))[0]

# A "register" holding two bf16 values: (lo, hi)
def pack(lo, hi): return (bf16(lo), bf16(hi))

def mma(C, A, B):
    """C: [32][4] floats, A: [32][4] pairs, B: [32][2] pairs. D = A·B + C per PTX layout."""
    Am = [[0.0]*16 for _ in range(16)]
    Bm = [[0.0]*8 for _ in range(16)]
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        a = A[lane]
        Am[g][2*t], Am[g][2*t+1] = a[0]
        Am[g+8][2*t], Am[g+8][2*t+1] = a[1]
        Am[g][2*t+8], Am[g][2*t+9] = a[2]
        Am[g+8][2*t+8], Am[g+8][2*t+9] = a[3]
        b = B[lane]
        Bm[2*t][g], Bm[2*t+1][g] = b[0]
        Bm[2*t+8][g], Bm[2*t+9][g] = b[1]
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        for e in range(4):
            r = g + (8 if e >= 2 else 0); c = 2*t + (e & 1)
            C[lane][e] += sum(Am[r][k]*Bm[k][c] for k in range(16))

NEG = float('-inf')

def forward(q, k, v, T, D, KT=64, ROWS=64):
    scale = 1/math.sqrt(D)
    out = [[0.0]*D for _ in range(T)]; lse = [0.0]*T
    for q0 in range(0, T, ROWS):
        ks = [[bf16(k[j][d]) if j < T else 0.0 for d in range(D)] for j in range(T + KT)]
        vs = [[bf16(v[j][d]) if j < T else 0.0 for d in range(D)] for j in range(T + KT)]
        for warp in range(4):
            rows = lambda lane: (q0 + warp*16 + (lane >> 2), q0 + warp*16 + (lane >> 2) + 8)
            def ld(row, col):
                return (q[row][col], q[row][col+1]) if row < T else (0.0, 0.0)
            qf = [[None]*(D//16) for _ in range(32)]
            for lane in range(32):
                g, t = lane >> 2, lane & 3; r0, r1 = rows(lane)
                for kk in range(D//16):
                    c = kk*16 + 2*t
                    qf[lane][kk] = [pack(*ld(r0, c)), pack(*ld(r1, c)), pack(*ld(r0, c+8)), pack(*ld(r1, c+8))]
            o = [[[0.0]*4 for _ in range(D//8)] for _ in range(32)]
            m0 = [NEG]*32; m1 = [NEG]*32; l0 = [0.0]*32; l1 = [0.0]*32
            kend = min(T, q0 + ROWS)
            for k0 in range(0, kend, KT):
                s = [[[0.0]*4 for _ in range(KT//8)] for _ in range(32)]
                for kk in range(D//16):
                    for nt in range(KT//8):
                        C = [s[lane][nt] for lane in range(32)]
                        A = [qf[lane][kk] for lane in range(32)]
                        B = []
                        for lane in range(32):
                            g, t = lane >> 2, lane & 3
                            kr = ks[k0 + nt*8 + g]; c = kk*16 + 2*t
                            B.append(((kr[c], kr[c+1]), (kr[c+8], kr[c+9])))
                        mma(C, A, B)
                mx0 = list(m0); mx1 = list(m1)
                for lane in range(32):
                    g, t = lane >> 2, lane & 3; r0, r1 = rows(lane)
                    for nt in range(KT//8):
                        for e in range(4):
                            j = k0 + nt*8 + 2*t + (e & 1); row = r0 if e < 2 else r1
                            val = s[lane][nt][e]*scale if (j <= row and j < T) else NEG
                            s[lane][nt][e] = val
                            if e < 2: mx0[lane] = max(mx0[lane], val)
                            else: mx1[lane] = max(mx1[lane], val)
                for arr in (mx0, mx1):
                    for x in (1, 2):
                        new = [max(arr[l], arr[l ^ x]) for l in range(32)]
                        arr[:] = new
                for lane in range(32):
                    c0 = math.exp(m0[lane]-mx0[lane]) if m0[lane] != NEG else 0.0
                    c1 = math.exp(m1[lane]-mx1[lane]) if m1[lane] != NEG else 0.0
                    m0[lane], m1[lane] = mx0[lane], mx1[lane]
                    l0[lane] *= c0; l1[lane] *= c1
                    for dt in range(D//8):
                        o[lane][dt][0] *= c0; o[lane][dt][1] *= c0; o[lane][dt][2] *= c1; o[lane][dt][3] *= c1
                for kk in range(KT//16):
                    A = []
                    for lane in range(32):
                        p = [[0.0]*4, [0.0]*4]
                        for hf in range(2):
                            for e in range(4):
                                x = s[lane][2*kk+hf][e]
                                p[hf][e] = 0.0 if x == NEG else math.exp(x - (m0[lane] if e < 2 else m1[lane]))
                            l0[lane] += p[hf][0] + p[hf][1]; l1[lane] += p[hf][2] + p[hf][3]
                        A.append([pack(p[0][0], p[0][1]), pack(p[0][2], p[0][3]), pack(p[1][0], p[1][1]), pack(p[1][2], p[1][3])])
                    for dt in range(D//8):
                        B = []
                        for lane in range(32):
                            g, t = lane >> 2, lane & 3
                            d = dt*8 + g; key = k0 + kk*16 + 2*t
                            B.append(((vs[key][d], vs[key+1][d]), (vs[key+8][d], vs[key+9][d])))
                        C = [o[lane][dt] for lane in range(32)]
                        mma(C, A, B)
            for arr in (l0, l1):
                for x in (1, 2):
                    arr[:] = [arr[l] + arr[l ^ x] for l in range(32)]
            for lane in range(32):
                g, t = lane >> 2, lane & 3; r0, r1 = rows(lane)
                for dt in range(D//8):
                    col = dt*8 + 2*t
                    if r0 < T: out[r0][col], out[r0][col+1] = o[lane][dt][0]/l0[lane], o[lane][dt][1]/l0[lane]
                    if r1 < T: out[r1][col], out[r1][col+1] = o[lane][dt][2]/l1[lane], o[lane][dt][3]/l1[lane]
                if t == 0 and r0 < T: lse[r0] = m0[lane] + math.log(l0[lane])
                if t == 0 and r1 < T: lse[r1] = m1[lane] + math.log(l1[lane])
    return out, lse

def reference(q, k, v, T, D):
    scale = 1/math.sqrt(D)
    out = []; lse = []; P = []
    for i in range(T):
        s = [sum(q[i][d]*k[j][d] for d in range(D))*scale for j in range(i+1)]
        m = max(s); z = sum(math.exp(x-m) for x in s)
        p = [math.exp(x-m)/z for x in s]
        P.append(p)
        out.append([sum(p[j]*v[j][d] for j in range(i+1)) for d in range(D)])
        lse.append(m + math.log(z))
    return out, lse, P

def ref_backward(q, k, v, dout, T, D):
    scale = 1/math.sqrt(D)
    out, lse, P = reference(q, k, v, T, D)
    dq = [[0.0]*D for _ in range(T)]; dk = [[0.0]*D for _ in range(T)]; dv = [[0.0]*D for _ in range(T)]
    for i in range(T):
        delta = sum(dout[i][d]*out[i][d] for d in range(D))
        for j in range(i+1):
            dp = sum(dout[i][d]*v[j][d] for d in range(D))
            ds = P[i][j]*(dp - delta)
            for d in range(D):
                dv[j][d] += P[i][j]*dout[i][d]
                dq[i][d] += ds*k[j][d]*scale
                dk[j][d] += ds*q[i][d]*scale
    return out, lse, dq, dk, dv

def relerr(a, b):
    fa = [x for r in a for x in r]; fb = [x for r in b for x in r]
    return max(abs(x-y) for x, y in zip(fa, fb)) / max(abs(y) for y in fb)

def frag_a(M, r0, c, T):
    ld = lambda row, col: (M[row][col], M[row][col+1]) if row < T else (0.0, 0.0)
    return [pack(*ld(r0, c)), pack(*ld(r0+8, c)), pack(*ld(r0, c+8)), pack(*ld(r0+8, c+8))]

def dq_kernel(q, k, v, dout, lse, delta, T, D, BT=16, ROWS=64):
    scale = 1/math.sqrt(D)
    dq = [[0.0]*D for _ in range(T)]
    K = [[bf16(k[j][d]) if j < T else 0.0 for d in range(D)] for j in range(T + 64)]
    V = [[bf16(v[j][d]) if j < T else 0.0 for d in range(D)] for j in range(T + 64)]
    for q0 in range(0, T, ROWS):
        for warp in range(4):
            base = q0 + warp*16
            qf = [[frag_a(q, base + (l >> 2), kk*16 + 2*(l & 3), T) for kk in range(D//16)] for l in range(32)]
            df = [[frag_a(dout, base + (l >> 2), kk*16 + 2*(l & 3), T) for kk in range(D//16)] for l in range(32)]
            acc = [[[0.0]*4 for _ in range(D//8)] for _ in range(32)]
            kend = min(T, q0 + ROWS)
            for k0 in range(0, kend, BT):
                if base + 15 < k0: continue
                s = [[[0.0]*4 for _ in range(2)] for _ in range(32)]
                dp = [[[0.0]*4 for _ in range(2)] for _ in range(32)]
                for kk in range(D//16):
                    for nt in range(2):
                        Bk = []; Bv = []
                        for l in range(32):
                            g, t = l >> 2, l & 3; c = kk*16 + 2*t; kr = K[k0 + nt*8 + g]; vr = V[k0 + nt*8 + g]
                            Bk.append(((kr[c], kr[c+1]), (kr[c+8], kr[c+9])))
                            Bv.append(((vr[c], vr[c+1]), (vr[c+8], vr[c+9])))
                        mma([s[l][nt] for l in range(32)], [qf[l][kk] for l in range(32)], Bk)
                        mma([dp[l][nt] for l in range(32)], [df[l][kk] for l in range(32)], Bv)
                A = []
                for l in range(32):
                    g, t = l >> 2, l & 3; r0 = base + g; r1 = r0 + 8
                    ds = [[0.0]*4 for _ in range(2)]
                    for nt in range(2):
                        for e in range(4):
                            j = k0 + nt*8 + 2*t + (e & 1); row = r0 if e < 2 else r1
                            L = lse[row] if row < T else 0.0; Dl = delta[row] if row < T else 0.0
                            p = math.exp(s[l][nt][e]*scale - L) if (j <= row and j < T) else 0.0
                            ds[nt][e] = p*(dp[l][nt][e] - Dl)
                    A.append([pack(ds[0][0], ds[0][1]), pack(ds[0][2], ds[0][3]), pack(ds[1][0], ds[1][1]), pack(ds[1][2], ds[1][3])])
                for dt in range(D//8):
                    B = []
                    for l in range(32):
                        g, t = l >> 2, l & 3; d = dt*8 + g
                        B.append(((K[k0+2*t][d], K[k0+2*t+1][d]), (K[k0+2*t+8][d], K[k0+2*t+9][d])))
                    mma([acc[l][dt] for l in range(32)], A, B)
            for l in range(32):
                g, t = l >> 2, l & 3; r0 = base + g; r1 = r0 + 8
                for dt in range(D//8):
                    col = dt*8 + 2*t
                    if r0 < T: dq[r0][col], dq[r0][col+1] = acc[l][dt][0]*scale, acc[l][dt][1]*scale
                    if r1 < T: dq[r1][col], dq[r1][col+1] = acc[l][dt][2]*scale, acc[l][dt][3]*scale
    return dq

def dkdv_kernel(q, k, v, dout, lse, delta, T, D, BT=16, ROWS=64):
    scale = 1/math.sqrt(D)
    dk = [[0.0]*D for _ in range(T)]; dv = [[0.0]*D for _ in range(T)]
    Q = [[bf16(q[i][d]) if i < T else 0.0 for d in range(D)] for i in range(T + 64)]
    O = [[bf16(dout[i][d]) if i < T else 0.0 for d in range(D)] for i in range(T + 64)]
    Kp = [[bf16(k[j][d]) if j < T else 0.0 for d in range(D)] for j in range(T + 64)]
    Vp = [[bf16(v[j][d]) if j < T else 0.0 for d in range(D)] for j in range(T + 64)]
    for j0 in range(0, T, ROWS):
        for warp in range(4):
            base = j0 + warp*16
            adk = [[[0.0]*4 for _ in range(D//8)] for _ in range(32)]
            adv = [[[0.0]*4 for _ in range(D//8)] for _ in range(32)]
            for i0 in range(j0, T, BT):
                if i0 + BT - 1 < base: continue
                ls = [lse[i0+x] if i0+x < T else 0.0 for x in range(BT)]
                dls = [delta[i0+x] if i0+x < T else 0.0 for x in range(BT)]
                st = [[[0.0]*4 for _ in range(2)] for _ in range(32)]
                dpt = [[[0.0]*4 for _ in range(2)] for _ in range(32)]
                for kk in range(D//16):
                    ka = []; va = []
                    for l in range(32):
                        g, t = l >> 2, l & 3; c = kk*16 + 2*t; r = base + g
                        ka.append([(Kp[r][c], Kp[r][c+1]), (Kp[r+8][c], Kp[r+8][c+1]), (Kp[r][c+8], Kp[r][c+9]), (Kp[r+8][c+8], Kp[r+8][c+9])])
                        va.append([(Vp[r][c], Vp[r][c+1]), (Vp[r+8][c], Vp[r+8][c+1]), (Vp[r][c+8], Vp[r][c+9]), (Vp[r+8][c+8], Vp[r+8][c+9])])
                    for nt in range(2):
                        Bq = []; Bo = []
                        for l in range(32):
                            g, t = l >> 2, l & 3; c = kk*16 + 2*t; qr = Q[i0 + nt*8 + g]; orow = O[i0 + nt*8 + g]
                            Bq.append(((qr[c], qr[c+1]), (qr[c+8], qr[c+9])))
                            Bo.append(((orow[c], orow[c+1]), (orow[c+8], orow[c+9])))
                        mma([st[l][nt] for l in range(32)], ka, Bq)
                        mma([dpt[l][nt] for l in range(32)], va, Bo)
                Ap = []; As = []
                for l in range(32):
                    g, t = l >> 2, l & 3; c0 = base + g; c1 = c0 + 8
                    pt = [[0.0]*4 for _ in range(2)]; dst = [[0.0]*4 for _ in range(2)]
                    for nt in range(2):
                        for e in range(4):
                            qi = nt*8 + 2*t + (e & 1); i = i0 + qi; key = c0 if e < 2 else c1
                            p = math.exp(st[l][nt][e]*scale - ls[qi]) if (key <= i and i < T) else 0.0
                            pt[nt][e] = p; dst[nt][e] = p*(dpt[l][nt][e] - dls[qi])
                    Ap.append([pack(pt[0][0], pt[0][1]), pack(pt[0][2], pt[0][3]), pack(pt[1][0], pt[1][1]), pack(pt[1][2], pt[1][3])])
                    As.append([pack(dst[0][0], dst[0][1]), pack(dst[0][2], dst[0][3]), pack(dst[1][0], dst[1][1]), pack(dst[1][2], dst[1][3])])
                for dt in range(D//8):
                    Bo = []; Bq = []
                    for l in range(32):
                        g, t = l >> 2, l & 3; d = dt*8 + g
                        Bo.append(((O[i0+2*t][d], O[i0+2*t+1][d]), (O[i0+2*t+8][d], O[i0+2*t+9][d])))
                        Bq.append(((Q[i0+2*t][d], Q[i0+2*t+1][d]), (Q[i0+2*t+8][d], Q[i0+2*t+9][d])))
                    mma([adv[l][dt] for l in range(32)], Ap, Bo)
                    mma([adk[l][dt] for l in range(32)], As, Bq)
            for l in range(32):
                g, t = l >> 2, l & 3; c0 = base + g; c1 = c0 + 8
                for dt in range(D//8):
                    col = dt*8 + 2*t
                    if c0 < T:
                        dk[c0][col], dk[c0][col+1] = adk[l][dt][0]*scale, adk[l][dt][1]*scale
                        dv[c0][col], dv[c0][col+1] = adv[l][dt][0], adv[l][dt][1]
                    if c1 < T:
                        dk[c1][col], dk[c1][col+1] = adk[l][dt][2]*scale, adk[l][dt][3]*scale
                        dv[c1][col], dv[c1][col+1] = adv[l][dt][2], adv[l][dt][3]
    return dk, dv

def main():
    T = int(sys.argv[1]) if len(sys.argv) > 1 else 70
    D = int(sys.argv[2]) if len(sys.argv) > 2 else 64
    random.seed(2)
    mk = lambda: [[bf16(random.gauss(0, 1)) for _ in range(D)] for _ in range(T)]
    q, k, v, dout = mk(), mk(), mk(), mk()
    rout, rlse, rdq, rdk, rdv = ref_backward(q, k, v, dout, T, D)
    out, lse = forward(q, k, v, T, D)
    delta = [sum(dout[i][d] * rout[i][d] for d in range(D)) for i in range(T)]
    dq = dq_kernel(q, k, v, dout, rlse, delta, T, D)
    dk, dv = dkdv_kernel(q, k, v, dout, rlse, delta, T, D)
    errors = {
        "forward out": relerr(out, rout),
        "forward lse": relerr([lse], [rlse]),
        "dq": relerr(dq, rdq),
        "dk": relerr(dk, rdk),
        "dv": relerr(dv, rdv),
    }
    for name, e in errors.items():
        print(f"T={T} head size {D}: {name:<12} relative error {e:.2e}")
    # bf16 rounding of P and dS stays near 2^-8 relative; a layout mistake is O(1).
    bad = [n for n, e in errors.items() if not e < 1e-2]
    sys.exit(f"FAILED: {', '.join(bad)}" if bad else 0)


if __name__ == "__main__":
    main()
