//! Built images are kept on disk by a hash of everything they depend on;
//! a damaged entry only costs a rebuild, and a build with warnings is never
//! kept (a cached image would hide them).

mod nvrtc_support;
use nvrtc_support::*;
use pipewright_emu::nvrtc::NVRTC_SUCCESS;

fn entries(stem: &str) -> Vec<std::path::PathBuf> {
    let Ok(dir) = std::fs::read_dir(cache()) else { return vec![] };
    dir.filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.file_name().unwrap().to_string_lossy().starts_with(&format!("{stem}-sm_90-")))
        .collect()
}

#[test]
fn a_clean_build_is_cached_and_a_damaged_cache_entry_is_rebuilt() {
    setup();
    let src = "extern \"C\" __global__ void cached_probe(float* x) { x[0] = 2.0f; }\n";
    for stale in entries("cacheprobe") {
        std::fs::remove_file(stale).unwrap();
    }
    let first = compile("cacheprobe.cu", src, &[], &["--gpu-architecture=sm_90"]);
    assert_eq!(first.code, NVRTC_SUCCESS, "{}", first.log);
    let kept = entries("cacheprobe");
    assert_eq!(kept.len(), 1, "one cache entry for one build");
    assert_eq!(std::fs::read(&kept[0]).unwrap(), first.image.clone().unwrap());

    std::fs::write(&kept[0], b"not an image").unwrap();
    let second = compile("cacheprobe.cu", src, &[], &["--gpu-architecture=sm_90"]);
    assert_eq!(second.code, NVRTC_SUCCESS, "{}", second.log);
    let image = second.image.unwrap();
    assert!(image.starts_with(b"\x7fELF"));
    assert_eq!(load(&image).kernel("cached_probe").params.len(), 1);
    assert_eq!(std::fs::read(&kept[0]).unwrap(), image, "the damaged entry was replaced");

    let other_define = compile("cacheprobe.cu", src, &[], &["--gpu-architecture=sm_90", "-DOTHER"]);
    assert_eq!(other_define.code, NVRTC_SUCCESS);
    assert_eq!(entries("cacheprobe").len(), 2, "options are part of the key");
}

#[test]
fn a_build_with_include_directories_is_not_cached_since_their_files_are_not_in_the_key() {
    setup();
    let dir = tempfile::tempdir().unwrap();
    let inc = dir.path().to_str().unwrap();
    let src = "#include \"value.h\"\nextern \"C\" __global__ void inc_probe(float* x) { x[0] = VALUE; }\n";
    for value in ["1.0f", "2.0f"] {
        std::fs::write(dir.path().join("value.h"), format!("#define VALUE {value}\n")).unwrap();
        let c = compile("incprobe.cu", src, &[], &["--gpu-architecture=sm_90", "-I", inc]);
        assert_eq!(c.code, NVRTC_SUCCESS, "{}", c.log);
        let m = load(&c.image.unwrap());
        let mut x = [0f32];
        let mut p = x.as_mut_ptr();
        let mut args = [&mut p as *mut *mut f32 as *mut std::ffi::c_void];
        (m.kernel("inc_probe").entry)(args.as_mut_ptr());
        assert_eq!(x[0].to_string(), value.trim_end_matches(".0f"), "the header as it is now");
    }
    assert!(entries("incprobe").is_empty());
}

#[test]
fn a_build_with_warnings_is_not_cached_so_its_log_comes_back_every_time() {
    setup();
    let src = "extern \"C\" __global__ void warn_probe(float* x) { int unused_w = 1; x[0] = 2.0f; }\n";
    for _ in 0..2 {
        let c = compile("warnprobe.cu", src, &[], &["--gpu-architecture=sm_90"]);
        assert_eq!(c.code, NVRTC_SUCCESS, "{}", c.log);
        assert!(c.log.contains("unused_w"), "{}", c.log);
    }
    assert!(entries("warnprobe").is_empty());
}
