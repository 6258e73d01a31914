//! The block against an f64 reference written from the formulas, its
//! backward against finite differences in f64, and the split's promises
//! (any rank count dividing the slices gives one rank's bits; I then W gives
//! B's bits; the thread count changes nothing; selective recompute changes
//! nothing), for each kind of block the settings choose.

use super::*;
use crate::kernels::cpu::testutil::*;
use crate::model::arch::{Init, RopeScaling};
use crate::model::section::ModelSection;
use crate::model::tp::TpShape;

const B: usize = 2;

/// The blocks the families choose, at test size.
fn archs() -> Vec<(&'static str, Arch)> {
    let gpt2 = Arch::gpt2(1, 4, 16, 32, 6);
    let llama = Arch::llama(1, 4, 2, 16, 24, 32, 6, 10_000.0);
    let biased = Arch { qkv_bias: true, o_bias: true, mlp_bias: true, ..llama };
    // Qwen2's: q, k and v biased, o not; a head size not C/NH.
    let wide_heads = Arch { qkv_bias: true, head_dim: 6, ..llama };
    let scaled = Arch {
        rope_scaling: RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 16,
        },
        ..llama
    };
    // Qwen3's: per-head RMSNorm on q and k before RoPE, a head size not C/NH.
    let qk_normed = Arch { qk_norm: true, head_dim: 6, ..llama };
    // Mistral's: each query sees the last `window` positions, itself included.
    let windowed = Arch { window: Some(3), ..llama };
    vec![
        ("gpt2", gpt2),
        ("llama", llama),
        ("llama with biases", biased),
        ("qwen2-like", wide_heads),
        ("llama3 rope", scaled),
        ("qwen3-like", qk_normed),
        ("mistral-like", windowed),
        ("qk norm and window, biased", Arch { qk_norm: true, window: Some(2), ..biased }),
    ]
}

fn params(a: &Arch, seed: u64) -> Vec<Param> {
    crate::model::params::block_tensors(a, 0)
        .into_iter()
        .enumerate()
        .map(|(k, (name, shape))| {
            let numel: usize = shape.iter().product();
            let role = a.role(k);
            // Gains near 1 and biases near 0, as trained ones are; products small.
            let data: Vec<f32> = randn(numel, seed + k as u64)
                .iter()
                .map(|v| {
                    if role.is_gain() {
                        1.0 + 0.1 * v
                    } else if role.is_bias() {
                        0.1 * v
                    } else {
                        0.5 * v
                    }
                })
                .collect();
            Param { name, shape, grad: vec![0.0; numel], data, canonical: k }
        })
        .collect()
}

fn norm64(a: &Arch, x: &[f64], w: &[f64], b: Option<&[f64]>, n: usize, c: usize) -> Vec<f64> {
    let mut out = vec![0.0; n * c];
    for r in 0..n {
        let row = &x[r * c..(r + 1) * c];
        let (mean, var) = match a.norm {
            Norm::LayerNorm => {
                let m = row.iter().sum::<f64>() / c as f64;
                (m, row.iter().map(|v| (v - m) * (v - m)).sum::<f64>() / c as f64)
            }
            Norm::RmsNorm => (0.0, row.iter().map(|v| v * v).sum::<f64>() / c as f64),
        };
        let eps = if a.norm == Norm::LayerNorm { 1e-5 } else { a.norm_eps as f64 };
        let s = 1.0 / (var + eps).sqrt();
        for j in 0..c {
            out[r * c + j] = w[j] * (row[j] - mean) * s + b.map_or(0.0, |b| b[j]);
        }
    }
    out
}

/// y (N, O) = x (N, I) · wᵀ + b, w (O, I).
fn lin(x: &[f64], w: &[f64], b: Option<&[f64]>, n: usize, i: usize, o: usize) -> Vec<f64> {
    let mut y = vec![0.0; n * o];
    for r in 0..n {
        for k in 0..o {
            y[r * o + k] = (0..i).map(|j| x[r * i + j] * w[k * i + j]).sum::<f64>() + b.map_or(0.0, |b| b[k]);
        }
    }
    y
}

/// Hugging Face's rotate_half RoPE on one head vector at position p, with
/// the model's (scaled) frequencies.
fn rope64(v: &mut [f64], p: usize, freqs: &[f32], scale: f32) {
    let half = v.len() / 2;
    for j in 0..half {
        let ang = p as f64 * freqs[j] as f64;
        let (x0, x1) = (v[j], v[j + half]);
        let (c, s) = (ang.cos() * scale as f64, ang.sin() * scale as f64);
        v[j] = x0 * c - x1 * s;
        v[j + half] = x1 * c + x0 * s;
    }
}

/// The block in f64, straight from the formulas (separate q, k, v; heads
/// repeated over their group as `repeat_kv` does).
fn reference(a: &Arch, p: &[Vec<f64>], x: &[f64], b: usize) -> Vec<f64> {
    let ix = a.block_index();
    let w = |r: Role| p[ix.at(r)].as_slice();
    let o = |r: Role| ix.get(r).map(|i| p[i].as_slice());
    let (t, c, f) = (a.block_size, a.n_embd, a.ffn);
    let n = b * t;
    let Heads { nh, nkv, hs } = a.heads();
    let n1 = norm64(a, x, w(Role::AttnNorm), o(Role::AttnNormBias), n, c);
    let mut q = lin(&n1, w(Role::Q), o(Role::QBias), n, c, nh * hs);
    let mut k = lin(&n1, w(Role::K), o(Role::KBias), n, c, nkv * hs);
    let v = lin(&n1, w(Role::V), o(Role::VBias), n, c, nkv * hs);
    if a.qk_norm {
        // Qwen3RMSNorm over each head's vector, with the model's eps.
        let rms = |x: &mut [f64], g: &[f64]| {
            let ms = x.iter().map(|v| v * v).sum::<f64>() / x.len() as f64;
            let s = 1.0 / (ms + a.norm_eps as f64).sqrt();
            x.iter_mut().zip(g).for_each(|(v, g)| *v = *v * s * g);
        };
        q.chunks_mut(hs).for_each(|h| rms(h, w(Role::QNorm)));
        k.chunks_mut(hs).for_each(|h| rms(h, w(Role::KNorm)));
    }
    if a.positions == Positions::Rotary {
        let (freqs, scale) = crate::model::rope::scaled_inv_freq(a);
        for r in 0..n {
            for h in 0..nh {
                rope64(&mut q[(r * nh + h) * hs..][..hs], r % t, &freqs, scale);
            }
            for g in 0..nkv {
                rope64(&mut k[(r * nkv + g) * hs..][..hs], r % t, &freqs, scale);
            }
        }
    }
    let mut atty = vec![0.0; n * nh * hs];
    for bi in 0..b {
        for h in 0..nh {
            let g = h / (nh / nkv);
            for i in 0..t {
                let qi = &q[((bi * t + i) * nh + h) * hs..][..hs];
                // Keys i − W < j ≤ i, as transformers' sliding-window mask.
                let first = a.window.map_or(0, |w| (i + 1).saturating_sub(w));
                let sc: Vec<f64> = (first..=i)
                    .map(|j| {
                        let kj = &k[((bi * t + j) * nkv + g) * hs..][..hs];
                        qi.iter().zip(kj).map(|(a, b)| a * b).sum::<f64>() / (hs as f64).sqrt()
                    })
                    .collect();
                let m = sc.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let z: f64 = sc.iter().map(|v| (v - m).exp()).sum();
                for (j, sj) in (first..).zip(&sc) {
                    for d in 0..hs {
                        atty[((bi * t + i) * nh + h) * hs + d] +=
                            (sj - m).exp() / z * v[((bi * t + j) * nkv + g) * hs + d];
                    }
                }
            }
        }
    }
    let proj = lin(&atty, w(Role::O), o(Role::OBias), n, nh * hs, c);
    let h: Vec<f64> = x.iter().zip(&proj).map(|(a, b)| a + b).collect();
    let n2 = norm64(a, &h, w(Role::MlpNorm), o(Role::MlpNormBias), n, c);
    let up = lin(&n2, w(Role::Up), o(Role::UpBias), n, c, f);
    let act: Vec<f64> = match a.mlp {
        Mlp::SwiGlu => {
            let gate = lin(&n2, w(Role::Gate), o(Role::GateBias), n, c, f);
            gate.iter().zip(&up).map(|(g, u)| g / (1.0 + (-g).exp()) * u).collect()
        }
        Mlp::Gelu => up
            .iter()
            .map(|&u| {
                0.5 * u * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (u + 0.044715 * u * u * u)).tanh())
            })
            .collect(),
    };
    let down = lin(&act, w(Role::Down), o(Role::DownBias), n, f, c);
    h.iter().zip(&down).map(|(a, b)| a + b).collect()
}

/// A forward and a full backward of the whole block (one rank, one slice):
/// the output and the input gradient, weight gradients into `p`.
fn run(a: &Arch, p: &mut [Param], x: &[f32], dout: &[f32], b: usize) -> (Vec<f32>, Vec<f32>) {
    let one = TpShape::WHOLE.single();
    let mut acts = BlockActs::new(b, a, 1, false, Recompute::None);
    let mut g = BlockGrads::new(b * a.block_size, a, 1, false);
    let mut sc = BlockScratch::new(b, a, &one, Recompute::None);
    let mut out = vec![0.0; x.len()];
    block_forward(p, &mut acts, x, &mut out, &mut sc, b, a, &one);
    let mut dres = dout.to_vec();
    block_backward_input(p, &mut acts, x, &mut dres, &mut g, &mut sc, b, a, &one, true);
    (out, dres)
}

#[test]
fn forward_matches_the_f64_reference_for_every_kind_of_block() {
    for (what, a) in archs() {
        let mut p = params(&a, 1);
        let x = randn(B * a.block_size * a.n_embd, 50);
        let (out, _) = with_threads(2, || run(&a, &mut p, &x, &vec![0.0; x.len()], B));
        let p64: Vec<Vec<f64>> = p.iter().map(|q| to64(&q.data)).collect();
        let want = reference(&a, &p64, &to64(&x), B);
        let err = rel_err(&out, &want);
        assert!(err < 1e-5, "{what}: forward differs from the f64 reference by {err:e}");
    }
}

#[test]
fn backward_matches_finite_differences_for_the_input_and_every_weight() {
    for (what, a) in archs() {
        let a = Arch { block_size: 4, ..a };
        let mut p = params(&a, 3);
        let x = randn(B * a.block_size * a.n_embd, 60);
        let g = randn(x.len(), 61);
        let (_, dx) = with_threads(2, || run(&a, &mut p, &x, &g, B));
        // Without RoPE, k's bias shifts every score of a query's row alike,
        // which softmax ignores: its gradient is zero in exact arithmetic,
        // rounding here. (Rotated, the bias differs by position, and counts.)
        let ix = a.block_index();
        let zero_grad = ix.get(Role::KBias).filter(|_| a.positions == Positions::Learned);
        if let Some(kb) = zero_grad {
            let scale = |i: usize| p[i].grad.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            let (k, q) = (scale(kb), scale(ix.at(Role::QBias)));
            assert!(k < 1e-4 * q, "{what}: k's bias has a gradient {k} beside q's {q}");
        }
        let checked: Vec<usize> = (0..p.len()).filter(|&i| Some(i) != zero_grad).collect();
        let mut values: Vec<Vec<f32>> = vec![x.clone()];
        let mut grads = vec![dx];
        for &i in &checked {
            values.push(p[i].data.clone());
            grads.push(p[i].grad.clone());
        }
        let all = |v: &[Vec<f64>]| {
            let mut full: Vec<Vec<f64>> = p.iter().map(|q| to64(&q.data)).collect();
            for (k, &i) in checked.iter().enumerate() {
                full[i] = v[k + 1].clone();
            }
            full
        };
        let loss = |v: &[Vec<f64>]| {
            reference(&a, &all(v), &v[0], B).iter().zip(&g).map(|(o, &g)| o * g as f64).sum::<f64>()
        };
        eprintln!("{what}");
        check_grads(&values, &grads, loss, 1e-3);
    }
}

#[test]
fn results_do_not_depend_on_thread_count() {
    for (what, a) in archs() {
        let a = Arch {
            block_size: 70,
            n_embd: 64,
            n_head: 8,
            n_kv_head: if a.n_kv_head == a.n_head { 8 } else { 2 },
            head_dim: 8,
            ffn: 96,
            ..a
        };
        let x = randn(B * a.block_size * a.n_embd, 70);
        let g = randn(x.len(), 71);
        let once = |threads| {
            with_threads(threads, || {
                let mut p = params(&a, 5);
                let (out, dres) = run(&a, &mut p, &x, &g, B);
                let grads: Vec<Vec<u32>> = p.iter().map(|q| bits(&q.grad)).collect();
                (bits(&out), bits(&dres), grads)
            })
        };
        assert!(once(1) == once(2), "{what}: the bits depend on the thread count");
    }
}

/// What one rank computes: the block's output, the input gradient and its
/// shards' weight gradients.
struct Ranked {
    out: Vec<f32>,
    dx: Vec<f32>,
    grads: Vec<Vec<f32>>,
}

/// How far one rank's backward goes.
#[derive(Clone, Copy, PartialEq)]
enum Backward {
    /// B: input and weight gradients together.
    Full,
    /// I, then W.
    Split,
    /// I alone.
    InputOnly,
}

/// A shape whose heads, groups and MLP rows cut into 4 slices.
fn split_archs() -> Vec<(&'static str, Arch)> {
    archs()
        .into_iter()
        .map(|(what, a)| {
            let kv = if a.n_kv_head == a.n_head { 8 } else { 4 };
            (
                what,
                Arch {
                    n_head: 8,
                    n_kv_head: kv,
                    n_embd: 32,
                    head_dim: if a.head_dim == 4 { 4 } else { 6 },
                    ffn: 48,
                    ..a
                },
            )
        })
        .collect()
}

/// One rank's forward and backward, keeping what `kept` keeps (`none` or `selective`). Between
/// I and W another microbatch's forward runs through the same scratch, as
/// a zero-bubble schedule's would: W must remake what it reads.
fn run_rank_keeping(whole: &[Param], a: &Arch, tp: &TpRank, how: Backward, kept: Recompute) -> Ranked {
    let n = B * a.block_size;
    let c = a.n_embd;
    let mut p: Vec<Param> = whole
        .iter()
        .enumerate()
        .map(|(i, q)| {
            let data = shard(cut_of(a, i), &q.data, *q.shape.last().unwrap(), tp.rank, tp.size);
            Param { grad: vec![0.0; data.len()], data, ..q.clone() }
        })
        .collect();
    let x = randn(n * c, 7);
    let mut acts = BlockActs::new(B, a, tp.size, tp.sp, kept);
    let mut s = BlockScratch::new(B, a, tp, kept);
    let mut out = vec![0.0; n * c];
    block_forward(&p, &mut acts, &x, &mut out, &mut s, B, a, tp);
    let mut dx = randn(n * c, 8);
    let mut g = BlockGrads::new(n, a, tp.size, tp.sp);
    block_backward_input(&mut p, &mut acts, &x, &mut dx, &mut g, &mut s, B, a, tp, how == Backward::Full);
    if how == Backward::Split {
        let mut other = BlockActs::new(B, a, tp.size, tp.sp, kept);
        let mut other_out = vec![0.0; n * c];
        block_forward(&p, &mut other, &randn(n * c, 9), &mut other_out, &mut s, B, a, tp);
        block_backward_weight(&mut p, &mut acts, &x, &g, &mut s, B, a, tp);
    }
    Ranked { out, dx, grads: p.into_iter().map(|q| q.grad).collect() }
}

/// Runs `size` ranks as threads joined by one group; the ranks' results.
fn run_ranks(whole: &[Param], a: &Arch, size: usize, slices: usize, how: Backward) -> Vec<Ranked> {
    run_ranks_keeping(whole, a, TpShape::of(size, slices), how, Recompute::None)
}

fn run_ranks_keeping(
    whole: &[Param],
    a: &Arch,
    shape: TpShape,
    how: Backward,
    kept: Recompute,
) -> Vec<Ranked> {
    let group = ThreadGroup::new(shape.size);
    std::thread::scope(|sc| {
        let hs: Vec<_> = (0..shape.size)
            .map(|rank| {
                let group: &dyn TensorGroup = &group;
                let tp = shape.rank(rank, Some(group));
                sc.spawn(move || run_rank_keeping(whole, a, &tp, how, kept))
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// Panics naming the first element whose bits differ.
fn same_bits(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    if let Some(i) = (0..got.len()).find(|&i| got[i].to_bits() != want[i].to_bits()) {
        panic!("{what}: element {i} is {} where {} was wanted", got[i], want[i]);
    }
}

fn same_results(got: &Ranked, want: &Ranked, what: &str) {
    same_bits(&got.out, &want.out, &format!("{what}: output"));
    same_bits(&got.dx, &want.dx, &format!("{what}: input gradient"));
    for (i, (g, w)) in got.grads.iter().zip(&want.grads).enumerate() {
        same_bits(g, w, &format!("{what}: gradient of tensor {i}"));
    }
}

#[test]
fn input_then_weight_gives_the_bits_of_the_full_backward() {
    for (what, a) in split_archs() {
        let whole = params(&a, 11);
        for slices in [1, 2] {
            let b = run_ranks(&whole, &a, 1, slices, Backward::Full).pop().unwrap();
            let iw = run_ranks(&whole, &a, 1, slices, Backward::Split).pop().unwrap();
            same_results(&iw, &b, &format!("{what}: I then W at {slices} slices"));
            assert!(
                b.grads.iter().all(|g| g.iter().any(|&v| v != 0.0)),
                "{what}: every weight has a gradient"
            );
            // The input half leaves every weight gradient to the weight half.
            let i = run_ranks(&whole, &a, 1, slices, Backward::InputOnly).pop().unwrap();
            same_bits(&i.dx, &b.dx, &format!("{what}: I alone at {slices} slices: input gradient"));
            assert!(
                i.grads.iter().all(|g| g.iter().all(|&v| v == 0.0)),
                "{what}: I alone wrote a weight gradient"
            );
        }
    }
}

#[test]
fn every_rank_count_dividing_the_slices_gives_the_bits_of_one_rank() {
    for (what, a) in split_archs() {
        let whole = params(&a, 12);
        for slices in [2, 4] {
            let one = run_ranks(&whole, &a, 1, slices, Backward::Full).pop().unwrap();
            for size in [2, 4].into_iter().filter(|s| slices % s == 0) {
                for how in [Backward::Full, Backward::Split] {
                    let ranks = run_ranks(&whole, &a, size, slices, how);
                    let at = format!(
                        "{what}: {slices} slices, {size} ranks, {}",
                        if how == Backward::Full { "B" } else { "I+W" }
                    );
                    same_as_one_rank(&ranks, &one, &whole, &a, &at);
                }
            }
        }
    }
}

/// Every rank's output and input gradient, and the ranks' weight gradients
/// joined, have the bits of `one` rank's (a whole tensor's on every rank).
fn same_as_one_rank(ranks: &[Ranked], one: &Ranked, whole: &[Param], a: &Arch, at: &str) {
    for (r, res) in ranks.iter().enumerate() {
        same_bits(&res.out, &one.out, &format!("{at}: output of rank {r}"));
        same_bits(&res.dx, &one.dx, &format!("{at}: input gradient of rank {r}"));
    }
    for (i, want) in one.grads.iter().enumerate() {
        let pieces: Vec<&[f32]> = ranks.iter().map(|res| res.grads[i].as_slice()).collect();
        let cols = *whole[i].shape.last().unwrap();
        let name = &whole[i].name;
        same_bits(&unshard(cut_of(a, i), &pieces, cols), want, &format!("{at}: {name}"));
        if cut_of(a, i) == Cut::Whole {
            for (r, piece) in pieces.iter().enumerate() {
                same_bits(piece, want, &format!("{at}: {name} whole on rank {r}"));
            }
        }
    }
}

/// Sequence parallelism moves rows between the ranks and sums nothing
/// otherwise: the norms' weight gradients go on from rank to rank in row
/// order, so every output, input gradient and weight gradient has the bits
/// of one rank, for B and for I then W, keeping all or selectively.
#[test]
fn sequence_parallel_ranks_give_the_bits_of_one_rank() {
    for (what, a) in split_archs() {
        let whole = params(&a, 15);
        for (size, slices) in [(2, 2), (2, 4), (4, 4)] {
            let one = run_ranks(&whole, &a, 1, slices, Backward::Full).pop().unwrap();
            for kept in [Recompute::None, Recompute::Selective] {
                for how in [Backward::Full, Backward::Split] {
                    let ranks = run_ranks_keeping(&whole, &a, TpShape { size, slices, sp: true }, how, kept);
                    let at = format!(
                        "{what}: sequence parallel, {slices} slices, {size} ranks, {kept:?}, {}",
                        if how == Backward::Full { "B" } else { "I+W" }
                    );
                    same_as_one_rank(&ranks, &one, &whole, &a, &at);
                }
            }
        }
        // What a rank keeps: its rows of both norms' outputs and statistics and of the residual.
        let n = B * a.block_size;
        let stats = if a.norm == Norm::LayerNorm { 2 } else { 1 };
        let rows = 4 * n * (3 * a.n_embd + 2 * stats);
        let (tp, sp) = (
            BlockActs::bytes_for(B, &a, 4, false, Recompute::None),
            BlockActs::bytes_for(B, &a, 4, true, Recompute::None),
        );
        assert_eq!(tp - sp, rows - rows / 4, "{what}");
        assert_eq!(BlockActs::new(B, &a, 4, true, Recompute::None).bytes(), sp, "{what}");
    }
}

/// Selective recompute keeps no norm output and no MLP activation, and
/// remakes them for the weight gradients with the same kernels on the same
/// inputs: every output, input gradient and weight gradient keeps the bits
/// of keeping everything, for B, for I then W, and split over ranks.
#[test]
fn selective_recompute_gives_the_bits_of_keeping_everything() {
    for (what, a) in split_archs() {
        let whole = params(&a, 14);
        for (size, slices) in [(1, 1), (1, 2), (2, 2)] {
            for how in [Backward::Full, Backward::Split, Backward::InputOnly] {
                let shape = TpShape::of(size, slices);
                let kept = run_ranks_keeping(&whole, &a, shape, how, Recompute::None);
                let remade = run_ranks_keeping(&whole, &a, shape, how, Recompute::Selective);
                for (r, (got, want)) in remade.iter().zip(&kept).enumerate() {
                    same_results(got, want, &format!("{what}: {size} ranks, {slices} slices, rank {r}"));
                }
            }
        }
        // What it keeps: GPT-2's block without 2·C + F of its floats a token.
        let (n, s) = (B * a.block_size, Share::of(&a, 1));
        let (none, selective) = (
            BlockActs::bytes_for(B, &a, 1, false, Recompute::None),
            BlockActs::bytes_for(B, &a, 1, false, Recompute::Selective),
        );
        assert_eq!(none - selective, 4 * n * (2 * s.c + s.f), "{what}");
        assert_eq!(BlockActs::new(B, &a, 1, false, Recompute::Selective).bytes(), selective, "{what}");
    }
}

#[test]
fn more_slices_change_only_the_rounding() {
    for (what, a) in split_archs() {
        let whole = params(&a, 13);
        let one = run_ranks(&whole, &a, 1, 1, Backward::Full).pop().unwrap();
        // Relative to the tensor's scale: an element that cancels to near zero
        // carries the rounding of the large terms it summed. Without RoPE k's
        // bias has no gradient in exact arithmetic (see the finite-difference
        // test): all of it is rounding, which other sums round otherwise.
        let zero_grad = a.block_index().get(Role::KBias).filter(|_| a.positions == Positions::Learned);
        let close = |got: &[f32], want: &[f32], at: &str| {
            let scale = want.iter().fold(0.0f32, |m, w| m.max(w.abs()));
            let worst =
                got.iter().zip(want).map(|(g, w)| (g - w).abs()).fold(0.0, f32::max) / scale.max(1e-30);
            assert!(
                worst < 1e-5,
                "{what}: {at}: sliced sums are the same sums, yet differ by {worst} of the largest"
            );
        };
        for slices in [2, 4] {
            let sliced = run_ranks(&whole, &a, 1, slices, Backward::Full).pop().unwrap();
            close(&sliced.out, &one.out, &format!("output at {slices} slices"));
            close(&sliced.dx, &one.dx, &format!("input gradient at {slices} slices"));
            for (i, (g, w)) in
                sliced.grads.iter().zip(&one.grads).enumerate().filter(|(i, _)| Some(*i) != zero_grad)
            {
                close(g, w, &format!("{} at {slices} slices", whole[i].name));
            }
        }
    }
}

#[test]
fn a_model_section_gives_each_family_its_kinds() {
    let gpt2 = ModelSection::default().arch().unwrap();
    assert_eq!(
        (gpt2.norm, gpt2.positions, gpt2.mlp, gpt2.tied),
        (Norm::LayerNorm, Positions::Learned, Mlp::Gelu, true)
    );
    assert!(gpt2.qkv_bias && gpt2.o_bias && gpt2.mlp_bias);
    assert_eq!(gpt2.init, Init { std: 0.02, scaled_residual: true });
    let llama = Arch::llama(1, 4, 2, 16, 24, 32, 6, 1e4);
    assert_eq!(
        (llama.norm, llama.positions, llama.mlp, llama.tied),
        (Norm::RmsNorm, Positions::Rotary, Mlp::SwiGlu, false)
    );
}
