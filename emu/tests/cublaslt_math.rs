//! The emulated cuBLASLt product against a plain f64 triple loop: every
//! transpose, bf16/f16/f32 storage, bias, alpha/beta, leading dimensions
//! above the row count, and the one rounding to D's type.

use half::{bf16, f16};
use pipewright_emu::cublaslt::problem::{
    compute, compute_type as ct, data_type as dt, Elem, LayoutSpec, OpSpec, Problem,
};

/// A deterministic stream of values in [-1, 1) (an LCG: no test depends on a seed file).
struct Values(u64);

impl Values {
    fn next(&mut self) -> f32 {
        self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        ((self.0 >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
}

fn encode(elem: Elem, v: &[f32]) -> Vec<u8> {
    v.iter()
        .flat_map(|&x| match elem {
            Elem::F32 => x.to_le_bytes().to_vec(),
            Elem::F16 => f16::from_f32(x).to_le_bytes().to_vec(),
            Elem::Bf16 => bf16::from_f32(x).to_le_bytes().to_vec(),
        })
        .collect()
}

fn decode(elem: Elem, bytes: &[u8]) -> Vec<f32> {
    match elem {
        Elem::F32 => bytes.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect(),
        Elem::F16 => bytes.chunks_exact(2).map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
        Elem::Bf16 => bytes.chunks_exact(2).map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
    }
}

/// Values as the storage type holds them (so the reference sees the same inputs).
fn stored(elem: Elem, v: Vec<f32>) -> Vec<f32> {
    decode(elem, &encode(elem, &v))
}

struct Case {
    m: usize,
    n: usize,
    k: usize,
    trans_a: bool,
    trans_b: bool,
    ab: Elem,
    cd: Elem,
    bias: bool,
    alpha: f32,
    beta: f32,
    /// Extra rows of padding in each layout's leading dimension (A, B, C, D).
    pad: [usize; 4],
}

fn layout(elem: Elem, rows: usize, cols: usize, pad: usize) -> LayoutSpec {
    LayoutSpec { data_type: elem.cuda(), rows: rows as u64, cols: cols as u64, ld: (rows + pad) as i64 }
}

/// Runs `case` through `compute` and checks every element of D against
/// the f64 reference, and that D's padding is untouched.
fn check(case: &Case, seed: u64) {
    let Case { m, n, k, trans_a, trans_b, ab, cd, bias, alpha, beta, pad } = *case;
    let (ar, ac) = if trans_a { (k, m) } else { (m, k) };
    let (br, bc) = if trans_b { (n, k) } else { (k, n) };
    let la = layout(ab, ar, ac, pad[0]);
    let lb = layout(ab, br, bc, pad[1]);
    let lc = layout(cd, m, n, pad[2]);
    let ld = layout(cd, m, n, pad[3]);
    let op = OpSpec {
        compute_type: ct::C32F,
        scale_type: dt::R_32F,
        trans_a,
        trans_b,
        bias_type: bias.then_some(-1),
    };
    let p = Problem::new("test", &op, [&la, &lb, &lc, &ld]).expect("a supported problem");
    assert_eq!((p.m, p.n, p.k), (m, n, k));
    let mut vals = Values(seed);
    let mut fill = |elem: Elem, count: usize| stored(elem, (0..count).map(|_| vals.next()).collect());
    let a = fill(ab, p.a.extent());
    let b = fill(ab, p.b.extent());
    let c = fill(cd, p.c.extent());
    let bias_v = fill(cd, m);
    const SENTINEL: u8 = 0xa5;
    let mut d = vec![SENTINEL; p.d.extent_bytes()];
    let (a_b, b_b, c_b, bias_b) = (encode(ab, &a), encode(ab, &b), encode(cd, &c), encode(cd, &bias_v));
    compute(&p, alpha, beta, &a_b, &b_b, Some(&c_b), bias.then_some(&bias_b[..]), &mut d).unwrap();

    let at = |i: usize, l: usize| if trans_a { a[l + i * la.ld as usize] } else { a[i + l * la.ld as usize] };
    let bt = |l: usize, j: usize| if trans_b { b[j + l * lb.ld as usize] } else { b[l + j * lb.ld as usize] };
    let size = cd.bytes();
    for j in 0..n {
        for i in 0..m {
            let (mut sum, mut mag) = (0f64, 0f64);
            for l in 0..k {
                let t = at(i, l) as f64 * bt(l, j) as f64;
                sum += t;
                mag += t.abs();
            }
            let cij = c[i + j * lc.ld as usize] as f64;
            let bi = if bias { bias_v[i] as f64 } else { 0.0 };
            let want = alpha as f64 * sum + beta as f64 * cij + bi;
            let mag = alpha.abs() as f64 * mag + (beta as f64 * cij).abs() + bi.abs();
            let at_d = (i + j * ld.ld as usize) * size;
            let got = decode(cd, &d[at_d..at_d + size])[0] as f64;
            // f32 accumulation error, plus half an ulp of the output type.
            let rounding = match cd {
                Elem::F32 => 0.0,
                Elem::Bf16 => want.abs() * 2f64.powi(-8),
                Elem::F16 => want.abs() * 2f64.powi(-11),
            };
            let tol = 1e-6 * (k as f64 + 2.0) * mag + rounding + 1e-30;
            assert!(
                (got - want).abs() <= tol,
                "D({i},{j}) = {got}, reference {want} (tolerance {tol}) for m={m} n={n} k={k} \
                 ta={trans_a} tb={trans_b} {ab:?}->{cd:?} bias={bias}"
            );
        }
        // The bytes between this column's m elements and the next column stay as they were.
        let gap = ((j * ld.ld as usize + m) * size)..(((j + 1) * ld.ld as usize) * size).min(d.len());
        assert!(d[gap].iter().all(|&x| x == SENTINEL), "column {j}'s padding was written");
    }
}

#[test]
fn every_transpose_and_storage_type_matches_an_f64_triple_loop() {
    let mut seed = 1;
    for (ab, cd) in
        [(Elem::Bf16, Elem::Bf16), (Elem::Bf16, Elem::F32), (Elem::F32, Elem::F32), (Elem::F16, Elem::F16)]
    {
        for trans_a in [false, true] {
            for trans_b in [false, true] {
                let case = Case {
                    m: 19,
                    n: 7,
                    k: 33,
                    trans_a,
                    trans_b,
                    ab,
                    cd,
                    bias: false,
                    alpha: 1.0,
                    beta: 0.0,
                    pad: [0; 4],
                };
                check(&case, seed);
                seed += 1;
            }
        }
    }
}

#[test]
fn alpha_beta_bias_and_padded_leading_dimensions_match_the_reference() {
    let mut seed = 100;
    for (ab, cd) in [(Elem::Bf16, Elem::Bf16), (Elem::Bf16, Elem::F32), (Elem::F32, Elem::F32)] {
        for trans_a in [false, true] {
            for trans_b in [false, true] {
                for bias in [false, true] {
                    let case = Case {
                        m: 12,
                        n: 9,
                        k: 17,
                        trans_a,
                        trans_b,
                        ab,
                        cd,
                        bias,
                        alpha: 0.75,
                        beta: -1.5,
                        pad: [3, 5, 2, 4],
                    };
                    check(&case, seed);
                    seed += 1;
                }
            }
        }
    }
}

#[test]
fn a_product_larger_than_gemms_blocks_matches_the_reference() {
    let case = Case {
        m: 130,
        n: 70,
        k: 300,
        trans_a: true,
        trans_b: false,
        ab: Elem::Bf16,
        cd: Elem::F32,
        bias: true,
        alpha: 1.0,
        beta: 1.0,
        pad: [8, 0, 0, 0],
    };
    check(&case, 7);
}

/// A 1×1 product with k = 1 whose result is `a·b + bias`, all bf16.
fn bf16_one(a: f32, b: f32, bias: f32) -> f32 {
    let l = LayoutSpec { data_type: dt::R_16BF, rows: 1, cols: 1, ld: 1 };
    let op = OpSpec {
        compute_type: ct::C32F,
        scale_type: dt::R_32F,
        trans_a: false,
        trans_b: false,
        bias_type: Some(dt::R_16BF as i32),
    };
    let p = Problem::new("test", &op, [&l, &l, &l, &l]).unwrap();
    let (a, b, bias) = (encode(Elem::Bf16, &[a]), encode(Elem::Bf16, &[b]), encode(Elem::Bf16, &[bias]));
    let mut d = vec![0u8; 2];
    compute(&p, 1.0, 0.0, &a, &b, None, Some(&bias), &mut d).unwrap();
    decode(Elem::Bf16, &d)[0]
}

#[test]
fn bf16_output_is_the_f32_result_rounded_once_to_nearest_even() {
    // 1 + 2⁻⁸ lies halfway between bf16 1 and 1 + 2⁻⁷: the even one is 1.
    assert_eq!(bf16_one(1.0, 1.0, 2f32.powi(-8)), 1.0);
    // 1 + 3·2⁻⁸ lies halfway between 1 + 2⁻⁷ (odd) and 1 + 2⁻⁶ (even).
    assert_eq!(bf16_one(1.0, 1.0, 3.0 * 2f32.powi(-8)), 1.0 + 2f32.powi(-6));
    // Just above the halfway point rounds up: nothing was rounded before the end.
    assert_eq!(bf16_one(1.0 + 2f32.powi(-7), 1.0 + 2f32.powi(-7), 0.0), 1.0 + 2f32.powi(-6));
}

#[test]
fn beta_zero_never_reads_c_so_nans_there_do_not_reach_d() {
    let l = LayoutSpec { data_type: dt::R_32F, rows: 2, cols: 2, ld: 2 };
    let op = OpSpec {
        compute_type: ct::C32F,
        scale_type: dt::R_32F,
        trans_a: false,
        trans_b: false,
        bias_type: None,
    };
    let p = Problem::new("test", &op, [&l, &l, &l, &l]).unwrap();
    let ident = encode(Elem::F32, &[1.0, 0.0, 0.0, 1.0]);
    let x = encode(Elem::F32, &[1.0, 2.0, 3.0, 4.0]);
    let nans = encode(Elem::F32, &[f32::NAN; 4]);
    let mut d = vec![0u8; 16];
    compute(&p, 2.0, 0.0, &ident, &x, Some(&nans), None, &mut d).unwrap();
    assert_eq!(decode(Elem::F32, &d), vec![2.0, 4.0, 6.0, 8.0]);
    // With beta nonzero the same NaNs do reach D, as they must.
    compute(&p, 2.0, 1.0, &ident, &x, Some(&nans), None, &mut d).unwrap();
    assert!(decode(Elem::F32, &d).iter().all(|v| v.is_nan()));
}

#[test]
fn fast_tf32_rounds_f32_inputs_to_ten_mantissa_bits_and_plain_32f_does_not() {
    let l = LayoutSpec { data_type: dt::R_32F, rows: 1, cols: 1, ld: 1 };
    let run = |compute_type: u32| {
        let op =
            OpSpec { compute_type, scale_type: dt::R_32F, trans_a: false, trans_b: false, bias_type: None };
        let p = Problem::new("test", &op, [&l, &l, &l, &l]).unwrap();
        let (a, b) = (encode(Elem::F32, &[1.0 + 2f32.powi(-12)]), encode(Elem::F32, &[1.0]));
        let mut d = vec![0u8; 4];
        compute(&p, 1.0, 0.0, &a, &b, None, None, &mut d).unwrap();
        decode(Elem::F32, &d)[0]
    };
    assert_eq!(run(ct::C32F), 1.0 + 2f32.powi(-12));
    assert_eq!(run(ct::C32F_FAST_TF32), 1.0);
    // 1 + 3·2⁻¹¹ is halfway between TF32 neighbours 1 + 2⁻¹⁰ (odd) and 1 + 2⁻⁹ (even).
    let op = OpSpec {
        compute_type: ct::C32F_FAST_TF32,
        scale_type: dt::R_32F,
        trans_a: false,
        trans_b: false,
        bias_type: None,
    };
    let p = Problem::new("test", &op, [&l, &l, &l, &l]).unwrap();
    let (a, b) = (encode(Elem::F32, &[1.0 + 3.0 * 2f32.powi(-11)]), encode(Elem::F32, &[1.0]));
    let mut d = vec![0u8; 4];
    compute(&p, 1.0, 0.0, &a, &b, None, None, &mut d).unwrap();
    assert_eq!(decode(Elem::F32, &d)[0], 1.0 + 2f32.powi(-9));
}

#[test]
fn k_zero_gives_beta_c_plus_bias() {
    let la = LayoutSpec { data_type: dt::R_32F, rows: 2, cols: 0, ld: 2 };
    let lb = LayoutSpec { data_type: dt::R_32F, rows: 0, cols: 1, ld: 1 };
    let lc = LayoutSpec { data_type: dt::R_32F, rows: 2, cols: 1, ld: 2 };
    let op = OpSpec {
        compute_type: ct::C32F,
        scale_type: dt::R_32F,
        trans_a: false,
        trans_b: false,
        bias_type: Some(-1),
    };
    let p = Problem::new("test", &op, [&la, &lb, &lc, &lc]).unwrap();
    let c = encode(Elem::F32, &[1.0, 2.0]);
    let bias = encode(Elem::F32, &[10.0, 20.0]);
    let mut d = vec![0u8; 8];
    compute(&p, 1.0, 3.0, &[], &[], Some(&c), Some(&bias), &mut d).unwrap();
    assert_eq!(decode(Elem::F32, &d), vec![13.0, 26.0]);
}

#[test]
fn operand_slices_shorter_than_their_layout_are_refused_not_read_past() {
    let l = LayoutSpec { data_type: dt::R_32F, rows: 4, cols: 4, ld: 4 };
    let op = OpSpec {
        compute_type: ct::C32F,
        scale_type: dt::R_32F,
        trans_a: false,
        trans_b: false,
        bias_type: None,
    };
    let p = Problem::new("test", &op, [&l, &l, &l, &l]).unwrap();
    let full = vec![0u8; 64];
    let mut d = vec![0u8; 64];
    let err = compute(&p, 1.0, 0.0, &full[..60], &full, None, None, &mut d).unwrap_err();
    assert!(err.message.contains("A holds 60 bytes but its layout spans 64"), "{}", err.message);
}
