//! Every kernels/*.cu compiles with NVRTC for sm_80 and sm_90, f32 and bf16
//! storage, without a warning. Needs no GPU, only NVRTC (found on
//! LD_LIBRARY_PATH); without it the test says so and passes, unless
//! PIPEWRIGHT_REQUIRE_NVRTC=1 (as in CI), where a skip is a failure.
#![cfg(feature = "cuda")]

use pipewright::kernels::cuda::{nvrtc, nvrtc_present};

#[test]
fn every_kernel_file_compiles_for_sm80_and_sm90_without_warnings() {
    if !nvrtc_present() {
        let required = std::env::var("PIPEWRIGHT_REQUIRE_NVRTC").is_ok_and(|v| v == "1");
        assert!(!required, "PIPEWRIGHT_REQUIRE_NVRTC=1 but NVRTC could not be loaded: put libnvrtc's directory on LD_LIBRARY_PATH");
        eprintln!("skipped: NVRTC could not be loaded (set LD_LIBRARY_PATH to libnvrtc's directory to run this test)");
        return;
    }
    let (major, minor) = nvrtc::version().expect("NVRTC version");
    eprintln!("NVRTC {major}.{minor}");
    let mut problems = vec![];
    for (file, _) in nvrtc::SOURCES {
        for arch in [80, 90] {
            for f32 in [false, true] {
                match nvrtc::compile(file, arch, f32) {
                    Ok(c) if c.cubin.is_empty() => {
                        problems.push(format!("{file} sm_{arch} f32={f32}: empty CUBIN"))
                    }
                    Ok(c) if !c.log.is_empty() => {
                        problems.push(format!("{file} sm_{arch} f32={f32}: {}", c.log))
                    }
                    Ok(_) => {}
                    Err(e) => problems.push(e.to_string()),
                }
            }
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn every_kernel_file_is_listed() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("kernels");
    let mut on_disk: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter_map(|n| n.strip_suffix(".cu").map(str::to_string))
        .collect();
    on_disk.sort();
    let listed: Vec<String> = nvrtc::SOURCES.iter().map(|(n, _)| n.to_string()).collect();
    assert_eq!(on_disk, listed);
}

#[test]
fn a_kernel_error_names_the_file_and_architecture() {
    // sm_20 is long gone from every NVRTC this project supports.
    if !nvrtc_present() {
        eprintln!("skipped: NVRTC could not be loaded");
        return;
    }
    let err = nvrtc::compile("gelu", 20, false).err().expect("sm_20 is refused").to_string();
    assert!(err.contains("gelu") || err.contains("NVRTC"), "{err}");
}

#[test]
fn the_cache_key_changes_with_architecture_precision_and_nvrtc_version() {
    let a = nvrtc::cache_key("attention", 90, false, (13, 0)).unwrap();
    assert_ne!(a, nvrtc::cache_key("attention", 80, false, (13, 0)).unwrap());
    assert_ne!(a, nvrtc::cache_key("attention", 90, true, (13, 0)).unwrap());
    assert_ne!(a, nvrtc::cache_key("attention", 90, false, (12, 8)).unwrap());
    assert!(nvrtc::cache_key("no-such-kernel", 90, false, (13, 0)).is_err());
}

/// The tensor-core attention kernels' registers, shared memory and spills,
/// for sm_80 and sm_90 (bf16), printed as a table (docs/gpu.md keeps the
/// figures): a kernel that spills or needs over 48 KiB of static shared
/// memory fails here, before any GPU sees it.
#[test]
fn tensor_core_attention_fits_registers_and_static_shared_memory_without_spills() {
    if !nvrtc_present() {
        let required = std::env::var("PIPEWRIGHT_REQUIRE_NVRTC").is_ok_and(|v| v == "1");
        assert!(!required, "PIPEWRIGHT_REQUIRE_NVRTC=1 but NVRTC could not be loaded");
        eprintln!("skipped: NVRTC could not be loaded");
        return;
    }
    let mut problems = vec![];
    for arch in [80, 90] {
        let usage = nvrtc::usage("flash_attention", arch, false).expect("flash_attention compiles");
        let mut names: Vec<&str> = usage.iter().map(|u| u.kernel.as_str()).collect();
        names.sort();
        let mut want = vec!["flash_backward_delta".to_string()];
        for hs in [16, 32, 64, 80, 96, 128] {
            for kernel in ["forward", "backward_dq", "backward_dkdv"] {
                if hs == 64 || hs == 128 {
                    want.push(format!("flash_{kernel}_hs{hs}"));
                }
                want.push(format!("flash_{kernel}_window_hs{hs}"));
            }
        }
        want.sort();
        assert_eq!(names, want);
        for u in &usage {
            eprintln!(
                "sm_{arch} {:<28} {:>3} registers {:>6} B smem  spills {}/{} B",
                u.kernel, u.registers, u.smem_bytes, u.spill_stores, u.spill_loads
            );
            if u.spill_stores + u.spill_loads > 0 || u.smem_bytes > 48 * 1024 || u.registers == 0 {
                problems.push(format!("sm_{arch} {u:?}"));
            }
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn ptxas_reports_are_read_per_kernel() {
    let log = "ptxas info    : 0 bytes gmem\n\
        ptxas info    : Compiling entry function 'k1' for 'sm_90'\n\
        ptxas info    : Function properties for k1\n\
        ptxas         .     0 bytes stack frame, 8 bytes spill stores, 4 bytes spill loads\n\
        ptxas info    : Used 225 registers, used 1 barriers, 43648 bytes smem, 404 bytes cmem[0]\n\
        ptxas info    : Compiling entry function 'k2' for 'sm_90'\n\
        ptxas info    : Used 29 registers, used 0 barriers, 392 bytes cmem[0]\n";
    let u = nvrtc::parse_usage(log);
    assert_eq!(u.len(), 2);
    assert_eq!((u[0].kernel.as_str(), u[0].registers, u[0].smem_bytes), ("k1", 225, 43648));
    assert_eq!((u[0].spill_stores, u[0].spill_loads), (8, 4));
    assert_eq!((u[1].kernel.as_str(), u[1].registers, u[1].smem_bytes, u[1].spill_stores), ("k2", 29, 0, 0));
}

/// kernels/tp.cu unrolls one tree per node count so the nodes stay in
/// registers: a stack frame or a spill (an array indexed at run time, or
/// 64 nodes too many for the register file) would put every join through
/// local memory.
#[test]
fn the_tree_join_keeps_its_nodes_in_registers() {
    if !nvrtc_present() {
        let required = std::env::var("PIPEWRIGHT_REQUIRE_NVRTC").is_ok_and(|v| v == "1");
        assert!(!required, "PIPEWRIGHT_REQUIRE_NVRTC=1 but NVRTC could not be loaded");
        eprintln!("skipped: NVRTC could not be loaded");
        return;
    }
    for arch in [80, 90] {
        for f32 in [false, true] {
            let log = nvrtc::compile_with("tp", arch, f32, &["--ptxas-options=-v"]).expect("tp compiles").log;
            let frames: Vec<&str> = log.lines().filter(|l| l.contains("bytes stack frame")).collect();
            assert!(!frames.is_empty(), "no ptxas report in: {log}");
            for line in frames {
                assert!(
                    line.trim_start_matches(['p', 't', 'x', 'a', 's', ' ', '.'])
                        .starts_with("0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads"),
                    "sm_{arch} f32={f32}: {line}"
                );
            }
        }
    }
}
