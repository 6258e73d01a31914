//! Every kernels/*.cu builds, unmodified, into a module whose table lists
//! exactly its extern "C" __global__ kernels with their parameters and
//! launch bounds, for each architecture and storage precision the backend
//! compiles (src/kernels/cuda/nvrtc.rs's options), with an empty log.

mod nvrtc_support;
use nvrtc_support::*;

/// The kernels of a file by a reading independent of the pre-pass: the
/// identifier before the first `(` after each `extern "C" __global__`,
/// skipping a __launch_bounds__(...).
fn declared_kernels(src: &str) -> Vec<String> {
    let mut names = vec![];
    for (at, _) in src.match_indices("extern \"C\" __global__") {
        let mut rest = &src[at + "extern \"C\" __global__".len()..];
        if let Some(lb) = rest.find("__launch_bounds__(") {
            if rest[..lb].trim() == "void" || rest[..lb].trim().is_empty() {
                let after = &rest[lb + "__launch_bounds__(".len()..];
                rest = &after[after.find(')').unwrap() + 1..];
            }
        }
        let open = rest.find('(').unwrap();
        names.push(rest[..open].split_whitespace().last().unwrap().to_string());
    }
    names
}

/// sizeof a parameter type on x86-64 (the kernels' scalar types and pointers).
fn expected_size(ty: &str) -> usize {
    if ty.ends_with('*') || ty.ends_with("__restrict__") {
        return 8;
    }
    match ty {
        "int" | "unsigned int" | "float" => 4,
        "long long" | "double" => 8,
        other => panic!("a kernel parameter of type {other}: add it here"),
    }
}

#[test]
fn every_kernel_file_compiles_for_sm80_and_sm90_in_both_precisions_with_an_empty_log() {
    for file in kernel_files(".cu") {
        let file = file.as_str();
        let src = kernel_source(file);
        let common = kernel_source("common.cuh");
        let expected = declared_kernels(&src);
        assert!(!expected.is_empty(), "{file} declares no kernel");
        for arch in ["sm_80", "sm_90"] {
            for f32 in [false, true] {
                let arch_opt = format!("--gpu-architecture={arch}");
                let mut opts = vec![arch_opt.as_str(), "--std=c++17"];
                if f32 {
                    opts.push("-DPW_F32");
                }
                let what = format!("{file} {arch} f32={f32}");
                let c = compile(file, &src, &[("common.cuh", &common)], &opts);
                assert_eq!(c.code, pipewright_emu::nvrtc::NVRTC_SUCCESS, "{what}: {}", c.log);
                assert_eq!(c.log, "", "{what}: the log is not empty");
                let image = c.image.unwrap();
                assert!(image.starts_with(b"\x7fELF"), "{what}: the image is not ELF");
                let m = load(&image);
                assert_eq!((m.source_name(), m.arch()), (file.to_string(), arch.to_string()), "{what}");
                let kernels = m.kernels();
                let names: Vec<&str> = kernels.iter().map(|k| k.name.as_str()).collect();
                assert_eq!(names, expected, "{what}");
                for k in &kernels {
                    for (name, ty, size, align, is_pointer, is_const) in &k.params {
                        let at = format!("{what}: {}({name}: {ty})", k.name);
                        assert!(!name.is_empty(), "{at}: unnamed");
                        assert_eq!(*size, expected_size(ty), "{at}: size");
                        assert_eq!(*align, *size, "{at}: align");
                        assert_eq!(*is_pointer, ty.ends_with('*'), "{at}: is_pointer");
                        assert_eq!(*is_const, ty.starts_with("const ") && ty.ends_with('*'), "{at}: const");
                    }
                }
            }
        }
    }
}

#[test]
fn attention_forward_records_its_launch_bounds_and_parameters_as_declared() {
    let c = compile(
        "attention.cu",
        &kernel_source("attention.cu"),
        &[("common.cuh", &kernel_source("common.cuh"))],
        &["--gpu-architecture=sm_90", "--std=c++17"],
    );
    let m = load(&c.image.expect("attention.cu compiles"));
    let k = m.kernel("attention_forward_hs64");
    assert_eq!(k.launch_bounds, 128, "__launch_bounds__(64 * 2): 64 rows of two threads");
    assert_eq!(m.kernel("attention_forward_hs256").launch_bounds, 256, "__launch_bounds__(32 * 8)");
    let params: Vec<(&str, &str, usize, bool, bool)> =
        k.params.iter().map(|p| (p.0.as_str(), p.1.as_str(), p.2, p.4, p.5)).collect();
    assert_eq!(
        params,
        [
            ("out", "floatX*", 8, true, false),
            ("lse", "float*", 8, true, false),
            ("qkv", "const floatX*", 8, true, true),
            ("B", "int", 4, false, false),
            ("T", "int", 4, false, false),
            ("NH", "int", 4, false, false),
            ("NKV", "int", 4, false, false),
            ("WIN", "int", 4, false, false),
        ]
    );
    assert_eq!(m.kernel("attention_backward_delta").launch_bounds, 0, "declared without bounds");
}

#[test]
fn flash_attention_kernels_carry_launch_bounds_given_on_the_line_before_their_names() {
    let c = compile(
        "flash_attention.cu",
        &kernel_source("flash_attention.cu"),
        &[("common.cuh", &kernel_source("common.cuh"))],
        &["--gpu-architecture=sm_80", "--std=c++17"],
    );
    let m = load(&c.image.expect("flash_attention.cu compiles"));
    for k in m.kernels() {
        let want = if k.name == "flash_backward_delta" { 0 } else { 128 };
        assert_eq!(k.launch_bounds, want, "{}", k.name);
    }
}

#[test]
fn a_kernel_runs_through_its_entry_with_arguments_read_as_declared() {
    // residual_forward(floatX* out, const floatX* a, const floatX* b, long long n), f32 storage.
    let c = compile(
        "residual.cu",
        &kernel_source("residual.cu"),
        &[("common.cuh", &kernel_source("common.cuh"))],
        &["--gpu-architecture=sm_90", "--std=c++17", "-DPW_F32"],
    );
    let m = load(&c.image.expect("residual.cu compiles"));
    let k = m.kernel("residual_forward");
    let (a, b) = ([1.5f32], [2.25f32]);
    let mut out = [0f32];
    let (mut po, mut pa, mut pb, mut n) = (out.as_mut_ptr(), a.as_ptr(), b.as_ptr(), 1i64);
    let mut args: Vec<*mut std::ffi::c_void> = vec![
        &mut po as *mut _ as *mut _,
        &mut pa as *mut _ as *mut _,
        &mut pb as *mut _ as *mut _,
        &mut n as *mut _ as *mut _,
    ];
    (k.entry)(args.as_mut_ptr());
    assert_eq!(out[0], 3.75, "lane 0 of a one-lane grid adds element 0");
}
