//! The Llama family's kernels (RMSNorm, RoPE, SwiGLU), and Qwen3's per-head
//! RMSNorm, against their CPU twins.

use super::{randn, rounded, Ctx};
use crate::kernels::cpu;
use crate::kernels::cuda::{rmsnorm, rope, swiglu, Elem, Result};

const EPS: f32 = 1e-5;

pub(super) fn rmsnorm_checks<X: Elem>(cx: &mut Ctx<X>) -> Result<()> {
    let d = cx.d;
    let gpu = cx.gpu;
    let x = rounded::<X>(&randn(d.n() * d.c, 31, 1.0));
    let w = rounded::<X>(&randn(d.c, 32, 1.0));
    let (mut out, mut rstd) = (vec![0.0; d.n() * d.c], vec![0.0; d.n()]);
    cpu::rmsnorm::rmsnorm_forward(&mut out, &mut rstd, &x, &w, d.n(), d.c, EPS);
    let (gx, gw) = (cx.up(&x)?, cx.up(&w)?);
    let (gout, grstd) = (gpu.alloc::<X>(d.n() * d.c)?, gpu.alloc::<f32>(d.n())?);
    rmsnorm::rmsnorm_forward(gpu, &gout, &grstd, &gx, gw.ptr(), d.n(), d.c, EPS)?;
    cx.push_rows("rmsnorm_forward out", &cx.down(&gout)?, &out, d.c);
    cx.push_rows("rmsnorm_forward rstd", &gpu.download(&grstd)?, &rstd, 1);

    // Backward accumulates: dinp starts from another gradient's share.
    let dout = rounded::<X>(&randn(d.n() * d.c, 33, 1.0));
    let dinp0 = rounded::<X>(&randn(d.n() * d.c, 34, 1.0));
    let (mut dinp, mut dweight) = (dinp0.clone(), vec![0.0; d.c]);
    cpu::rmsnorm::rmsnorm_backward(&mut dinp, &mut dweight, &dout, &x, &w, &rstd, d.n(), d.c);
    let (gdout, gdinp, gdw) = (cx.up(&dout)?, cx.up(&dinp0)?, gpu.alloc::<f32>(d.c)?);
    let partial = gpu.alloc::<f32>(rmsnorm::partial_len(d.n(), d.c))?;
    rmsnorm::rmsnorm_backward_input(gpu, &gdinp, &gdout, &gx, gw.ptr(), &grstd, d.n(), d.c)?;
    rmsnorm::rmsnorm_backward_weight(gpu, gdw.ptr(), &partial, &gdout, &gx, &grstd, d.n(), d.c)?;
    cx.push_rows("rmsnorm_backward dinp", &cx.down(&gdinp)?, &dinp, d.c);
    cx.push("rmsnorm_backward dweight", &gpu.download(&gdw)?, &dweight);
    head_rmsnorm_checks(cx)
}

/// Per-head RMSNorm (Qwen3's q_norm and k_norm) over grouped-query qkv rows
/// of 4 query and 2 key/value heads, head sizes 64 and 128: q's run (the
/// weight's gradient whole) and k's run (in 2 group partials), each with its
/// own weight. N − 7 rows, so the weight gradient's last 64-row chunk is
/// partial; the buffers start full of other values, so a write outside the
/// run, or a missed accumulation, shows.
fn head_rmsnorm_checks<X: Elem>(cx: &mut Ctx<X>) -> Result<()> {
    let d = cx.d;
    use cpu::rmsnorm::HeadRun;
    let gpu = cx.gpu;
    let (nh, nkv, n) = (4, 2, d.n() - 7);
    for hs in [64, 128] {
        let w = (nh + 2 * nkv) * hs;
        let seed = 200 + hs as u64;
        let x = rounded::<X>(&randn(n * w, seed, 1.0));
        let out0 = rounded::<X>(&randn(n * w, seed + 1, 1.0));
        let dout = rounded::<X>(&randn(n * w, seed + 2, 1.0));
        let dinp0 = rounded::<X>(&randn(n * w, seed + 3, 1.0));
        let gx = cx.up(&x)?;
        for (name, first, heads, groups) in [("q", 0, nh, 1), ("k", nh, nkv, 2)] {
            let run = HeadRun { n, w, first, heads, hs };
            let label = |what: &str| format!("head_rmsnorm {what} {name} hs{hs}");
            let wt = rounded::<X>(&randn(hs, seed + 4 + first as u64, 1.0));
            let (mut out, mut rstd) = (out0.clone(), vec![0.0; n * heads]);
            cpu::rmsnorm::head_rmsnorm_forward(&mut out, &mut rstd, &x, &wt, run, EPS);
            let (gw, gout, grstd) = (cx.up(&wt)?, cx.up(&out0)?, gpu.alloc::<f32>(n * heads)?);
            rmsnorm::head_rmsnorm_forward(gpu, &gout, &grstd, &gx, gw.ptr(), run, EPS)?;
            cx.push_rows(&label("forward out"), &cx.down(&gout)?, &out, w);
            cx.push_rows(&label("forward rstd"), &gpu.download(&grstd)?, &rstd, 1);

            let dw0 = randn(groups * hs, seed + 5, 1.0);
            let (mut dinp, mut dw) = (dinp0.clone(), dw0.clone());
            cpu::rmsnorm::head_rmsnorm_backward_input(&mut dinp, &dout, &x, &wt, &rstd, run);
            cpu::rmsnorm::head_rmsnorm_backward_weight(&mut dw, &dout, &x, &rstd, run);
            let (gdout, gdinp, gdw) = (cx.up(&dout)?, cx.up(&dinp0)?, gpu.upload(&dw0)?);
            let partial = gpu.alloc::<f32>(rmsnorm::head_partial_len(run, groups))?;
            rmsnorm::head_rmsnorm_backward_input(gpu, &gdinp, &gdout, &gx, gw.ptr(), &grstd, run)?;
            rmsnorm::head_rmsnorm_backward_weight(
                gpu,
                gdw.ptr(),
                groups,
                &partial,
                &gdout,
                &gx,
                &grstd,
                run,
            )?;
            cx.push_rows(&label("backward dinp"), &cx.down(&gdinp)?, &dinp, w);
            let dweight =
                if groups == 1 { "backward dweight".into() } else { format!("backward dweight/{groups}") };
            cx.push(&label(&dweight), &gpu.download(&gdw)?, &dw);
        }
    }
    Ok(())
}

pub(super) fn rope_checks<X: Elem>(cx: &mut Ctx<X>) -> Result<()> {
    let d = cx.d;
    let gpu = cx.gpu;
    // Grouped-query qkv rows: 4 query heads and 2 key/value heads of 16; RoPE
    // turns the query and key heads (the first 6), not the value heads.
    let (hs, nh, nkv) = (16, 4, 2);
    let w = (nh + 2 * nkv) * hs;
    let table = cpu::rope::RopeTable::new(d.t, &cpu::rope::inv_freq(hs, 500_000.0));
    let dtable = rope::DeviceRope::upload(gpu, &table)?;
    let x = rounded::<X>(&randn(d.n() * w, 35, 1.0));
    let mut want = x.clone();
    cpu::rope::rope_forward(&mut want, &table, d.n(), w, 0, nh + nkv);
    let gx = cx.up(&x)?;
    rope::rope_forward(gpu, &gx, &dtable, d.n(), w, 0, nh + nkv)?;
    cx.push_rows("rope_forward", &cx.down(&gx)?, &want, w);

    let g = rounded::<X>(&randn(d.n() * w, 36, 1.0));
    let mut want = g.clone();
    cpu::rope::rope_backward(&mut want, &table, d.n(), w, 0, nh + nkv);
    let gg = cx.up(&g)?;
    rope::rope_backward(gpu, &gg, &dtable, d.n(), w, 0, nh + nkv)?;
    cx.push_rows("rope_backward", &cx.down(&gg)?, &want, w);
    Ok(())
}

pub(super) fn swiglu_checks<X: Elem>(cx: &mut Ctx<X>) -> Result<()> {
    let d = cx.d;
    let gpu = cx.gpu;
    // The even pass's N · H is a whole number of 256-thread blocks; the ragged
    // pass's leaves one live thread in the last.
    let h = d.h;
    let gate_up = rounded::<X>(&randn(d.n() * 2 * h, 37, 2.0));
    let mut out = vec![0.0; d.n() * h];
    cpu::swiglu::swiglu_forward(&mut out, &gate_up, d.n(), h);
    let (ggu, gout) = (cx.up(&gate_up)?, gpu.alloc::<X>(d.n() * h)?);
    swiglu::swiglu_forward(gpu, &gout, &ggu, d.n(), h)?;
    cx.push_rows("swiglu_forward", &cx.down(&gout)?, &out, h);

    let dout = rounded::<X>(&randn(d.n() * h, 38, 1.0));
    let d0 = rounded::<X>(&randn(d.n() * 2 * h, 39, 1.0));
    let mut dgu = d0.clone();
    cpu::swiglu::swiglu_backward(&mut dgu, &dout, &gate_up, d.n(), h);
    let (gdout, gdgu) = (cx.up(&dout)?, cx.up(&d0)?);
    swiglu::swiglu_backward(gpu, &gdgu, &gdout, &ggu, d.n(), h)?;
    cx.push_rows("swiglu_backward", &cx.down(&gdgu)?, &dgu, 2 * h);
    Ok(())
}
