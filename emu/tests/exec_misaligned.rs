//! A load or store misaligned for its type faults on a GPU
//! (CUDA_ERROR_MISALIGNED_ADDRESS) where x86 quietly performs it: kernels
//! are built with the compiler's alignment check, and the error names the
//! kernel, thread, address, the access and the source line.

mod exec_compiled;
mod exec_support;
mod nvrtc_support;

use exec_compiled::*;
use exec_support::*;
use pipewright_emu::error::cu;

const PAIRS_CU: &str = r#"
// Two adjacent 16-bit values read as one 32-bit word, as flash_attention's
// lds2 does: aligned only when the first one's index is even.
extern "C" __global__ void pairs(unsigned int* out, const unsigned short* in, int first) {
    out[threadIdx.x] = *reinterpret_cast<const unsigned int*>(in + first + 2 * threadIdx.x);
}

struct __align__(16) Quad { float x, y, z, w; };

// A 16-byte vector load from a float offset: aligned only at multiples of 4.
extern "C" __global__ void quads(float* out, const float* in, int first) {
    Quad q = *reinterpret_cast<const Quad*>(in + first + 4 * threadIdx.x);
    out[threadIdx.x] = q.x + q.y + q.z + q.w;
}
"#;

fn run(gpu: &Gpu, f: Handle, first: i32, threads: u32) -> u32 {
    let out = gpu.alloc(threads as usize * 4);
    let inp = gpu.alloc(4096);
    gpu.upload(inp, &(0..1024u32).collect::<Vec<_>>());
    let (mut o, mut i, mut fi) = (out, inp, first);
    assert_eq!(
        launch(f, (1, 1, 1), (threads, 1, 1), 0, gpu.stream, &mut [p(&mut o), p(&mut i), p(&mut fi)]),
        cu::SUCCESS
    );
    gpu.sync()
}

#[test]
fn a_32_bit_load_at_a_2_byte_aligned_address_is_a_misaligned_address_naming_the_access() {
    let _s = serial();
    let gpu = Gpu::new(0);
    let m = load_cu("pairs.cu", PAIRS_CU);
    let pairs = get(m, "pairs");
    let out = gpu.alloc(32 * 4);
    let inp = gpu.alloc(4096);
    let halves: Vec<u16> = (0..2048u16).collect();
    gpu.upload(inp, &halves);
    let (mut o, mut i, mut first) = (out, inp, 0i32);
    assert_eq!(
        launch(pairs, (1, 1, 1), (32, 1, 1), 0, gpu.stream, &mut [p(&mut o), p(&mut i), p(&mut first)]),
        cu::SUCCESS
    );
    assert_eq!(gpu.sync(), cu::SUCCESS, "{}", error_text(cu::MISALIGNED_ADDRESS));
    let words: Vec<u32> = gpu.download(out, 32);
    assert!(
        words.iter().enumerate().all(|(t, &w)| w == (2 * t as u32) | (2 * t as u32 + 1) << 16),
        "{words:x?}"
    );

    // An odd first index: every lane's word starts 2 bytes into a 4-byte unit.
    let gpu = Gpu::new(0);
    let m = load_cu("pairs.cu", PAIRS_CU);
    let pairs = get(m, "pairs");
    let code = run(&gpu, pairs, 1, 32);
    let text = assert_error(
        code,
        cu::MISALIGNED_ADDRESS,
        &[
            "kernel `pairs` (pairs.cu)",
            "thread 0",
            "misaligned address",
            "load of `const unsigned int`",
            "needs 4-byte alignment",
            "(2 byte(s) off)",
            "pairs.cu:5",
        ],
    );
    assert!(text.contains("byte 2 of GPU 0's 4096-byte allocation"), "{text}");
}

#[test]
fn a_16_byte_load_off_its_alignment_is_a_misaligned_address_not_a_null_pointer() {
    let _s = serial();
    let gpu = Gpu::new(0);
    let m = load_cu("pairs.cu", PAIRS_CU);
    let quads = get(m, "quads");
    assert_eq!(run(&gpu, quads, 4, 8), cu::SUCCESS, "{}", error_text(cu::MISALIGNED_ADDRESS));
    let gpu = Gpu::new(0);
    let m = load_cu("pairs.cu", PAIRS_CU);
    let quads = get(m, "quads");
    assert_error(
        run(&gpu, quads, 2, 8),
        cu::MISALIGNED_ADDRESS,
        &[
            "kernel `quads` (pairs.cu)",
            "thread 0",
            "`const struct Quad`",
            "needs 16-byte alignment",
            "(8 byte(s) off)",
            "byte 8 of GPU 0's 4096-byte allocation",
        ],
    );
}
