//! Building a program: the pre-pass, the system C++ compiler into a shared
//! object (the image nvrtcGetCUBIN hands out), and the on-disk cache.
//!
//! The compiler runs in a private temporary directory holding the program
//! under its own name, its headers under their include names and the
//! emulator's two headers in `.pw-emu/`, so its messages name the files as
//! the caller knows them (`layernorm.cu:12:5: error: ...`).

use super::options::Options;
use super::prepass;
use std::collections::HashMap;
use std::hash::Hasher;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;

pub const CUDA_EMU_H: &str = include_str!("../../include/cuda_emu.h");
pub const PW_EMU_ABI_H: &str = include_str!("../../include/pw_emu_abi.h");

/// What the generated code depends on besides the inputs: a change to the
/// pre-pass or the trailer must not reuse an image built by an older one.
const GENERATOR: &[&str] = &[include_str!("prepass.rs"), include_str!("lex.rs"), include_str!("build.rs")];

/// The flags every build gets. -ffp-contract=off: one rounding per float
/// operation, as CUDA's __f*_rn promise and the CPU twins compute;
/// -fno-strict-aliasing: CUDA code reads memory through other types as a
/// matter of course (flash_attention's lds2 loads two bf16 as one u32), and
/// the host compiler's type-based alias analysis must not reorder those
/// reads around the writes they see on a GPU; -fvisibility=hidden: only pw_emu_module_init is exported, so two modules
/// loaded into one process never bind each other's symbols; -z defs: an
/// undefined function is a build error here, not a dlopen failure later.
/// -Wall, like NVRTC's own diagnostics (unused variables, `=` for `==`),
/// less two that only reflect the host compiler: -Wsign-compare (int against
/// threadIdx.x is everyday CUDA, and NVRTC says nothing) and
/// -Wmaybe-uninitialized (a guess of GCC's optimiser, which changes with the
/// optimiser's version). `#pragma unroll`, whose warning would only reflect
/// the emulation too, is removed by the pre-pass.
const FLAGS: &[&str] = &[
    "-x",
    "c++",
    "-O2",
    "-fPIC",
    "-ffp-contract=off",
    "-fno-fast-math",
    "-fno-strict-aliasing",
    "-fvisibility=hidden",
    "-fdiagnostics-color=never",
    "-Wall",
    "-Wno-sign-compare",
    "-Wno-maybe-uninitialized",
    // Every typed load and store checked against its type's alignment: a
    // GPU faults on a misaligned one (CUDA_ERROR_MISALIGNED_ADDRESS) that
    // x86 performs; cuda_emu.h's handler reports it through the runtime.
    "-fsanitize=alignment",
    "-fno-sanitize-recover=alignment",
];

/// The link step, apart from the compile so that no sanitizer runtime is
/// linked (cuda_emu.h defines the handlers the instrumentation calls):
/// -z defs: an undefined function is a build error here, not a dlopen
/// failure later.
const LINK: &[&str] = &["-shared", "-fPIC", "-Wl,-z,defs"];

/// What a PW_EMU_CHECK mode that watches every access (bounds, blocks)
/// adds: ThreadSanitizer's instrumentation, a call per load and store
/// (reads and writes told apart, a read-modify-write reported as both) into
/// cuda_emu.h's hooks; TSan's own runtime is never linked.
const INSTRUMENT: &[&str] =
    &["-fsanitize=thread", "--param=tsan-instrument-func-entry-exit=0", "-DPW_EMU_INSTRUMENT"];

/// The flags of this process's builds: FLAGS, and INSTRUMENT when a check
/// mode needs every access.
fn flags() -> Vec<&'static str> {
    let mut f = FLAGS.to_vec();
    if crate::exec::instrumented_checks() {
        f.extend_from_slice(INSTRUMENT);
    }
    f
}

pub struct Program<'a> {
    pub name: &'a str,
    pub source: &'a str,
    /// (include name, contents)
    pub headers: &'a [(String, String)],
}

pub enum Outcome {
    /// The image, and the compiler's warnings (empty when clean).
    Built { image: Vec<u8>, log: String },
    /// The program is wrong: the log says where.
    Failed { log: String },
    /// The emulator could not build at all (no compiler, no temp dir).
    Broken { log: String },
}

/// The C++ compiler: $PW_EMU_CXX, else `c++`, else `g++`.
fn compiler() -> Result<(String, String), String> {
    static VERSIONS: Mutex<Option<HashMap<String, String>>> = Mutex::new(None);
    let candidates: Vec<String> = match std::env::var("PW_EMU_CXX") {
        Ok(cxx) if !cxx.is_empty() => vec![cxx],
        _ => vec!["c++".into(), "g++".into()],
    };
    let mut tried = vec![];
    for cxx in candidates {
        let mut versions = VERSIONS.lock().unwrap_or_else(|p| p.into_inner());
        let versions = versions.get_or_insert_with(HashMap::new);
        if let Some(v) = versions.get(&cxx) {
            return Ok((cxx, v.clone()));
        }
        match Command::new(&cxx).arg("--version").output() {
            Ok(out) if out.status.success() => {
                let v = String::from_utf8_lossy(&out.stdout).lines().next().unwrap_or("").to_string();
                versions.insert(cxx.clone(), v.clone());
                return Ok((cxx, v));
            }
            Ok(out) => tried.push(format!("`{cxx} --version` exited with {}", out.status)),
            Err(e) => tried.push(format!("`{cxx}`: {e}")),
        }
    }
    Err(format!("no C++ compiler to build kernels with ({}); set PW_EMU_CXX", tried.join("; ")))
}

/// Where built images are kept: $PW_EMU_CACHE, else
/// $XDG_CACHE_HOME/pipewright-emu, else ~/.cache/pipewright-emu.
pub fn cache_dir() -> Option<PathBuf> {
    if let Some(d) = std::env::var_os("PW_EMU_CACHE").filter(|d| !d.is_empty()) {
        return Some(PathBuf::from(d));
    }
    let base = std::env::var_os("XDG_CACHE_HOME")
        .filter(|d| !d.is_empty())
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))?;
    Some(base.join("pipewright-emu"))
}

/// 128 bits from two unrelated 64-bit hashes (SipHash-1-3 with std's fixed
/// keys, FNV-1a) over length-prefixed parts: no cryptographic strength is
/// needed, only that two different builds never share a name.
struct Key {
    sip: std::collections::hash_map::DefaultHasher,
    fnv: u64,
}

impl Key {
    fn new() -> Key {
        Key { sip: Default::default(), fnv: 0xcbf2_9ce4_8422_2325 }
    }

    fn part(&mut self, bytes: &[u8]) {
        let len = (bytes.len() as u64).to_le_bytes();
        for chunk in [&len[..], bytes] {
            self.sip.write(chunk);
            for &b in chunk {
                self.fnv = (self.fnv ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3);
            }
        }
    }

    fn hex(&self) -> String {
        format!("{:016x}{:016x}", self.sip.finish(), self.fnv)
    }
}

fn cache_name(p: &Program, o: &Options, compiler: &str, version: &str) -> String {
    let mut k = Key::new();
    k.part(p.name.as_bytes());
    k.part(p.source.as_bytes());
    for (name, text) in p.headers {
        k.part(name.as_bytes());
        k.part(text.as_bytes());
    }
    k.part(o.arch_name().as_bytes());
    k.part(o.std.as_bytes());
    for d in &o.defines {
        k.part(d.as_bytes());
    }
    k.part(CUDA_EMU_H.as_bytes());
    k.part(PW_EMU_ABI_H.as_bytes());
    for g in GENERATOR {
        k.part(g.as_bytes());
    }
    for f in flags().iter().chain(LINK) {
        k.part(f.as_bytes());
    }
    k.part(compiler.as_bytes());
    k.part(version.as_bytes());
    let stem: String = Path::new(p.name)
        .file_stem()
        .map(|s| s.to_string_lossy().chars().filter(|c| c.is_ascii_alphanumeric() || *c == '_').collect())
        .unwrap_or_default();
    format!("{stem}-{}-{}.so", o.arch_name(), k.hex())
}

fn absolute(p: &str) -> PathBuf {
    let p = Path::new(p);
    if p.is_absolute() {
        p.to_path_buf()
    } else {
        std::env::current_dir().map(|d| d.join(p)).unwrap_or_else(|_| p.to_path_buf())
    }
}

fn is_elf(bytes: &[u8]) -> bool {
    bytes.starts_with(b"\x7fELF")
}

/// A file name for the program inside the build directory: its own name
/// when that is a plain relative path, so messages name it as given.
fn file_name(name: &str) -> Result<PathBuf, String> {
    let p = Path::new(name);
    let plain = !name.is_empty()
        && p.components().all(|c| matches!(c, std::path::Component::Normal(_)))
        && !name.starts_with(".pw-emu");
    if plain {
        Ok(p.to_path_buf())
    } else {
        Err(format!("`{name}` is not a relative path below the program's directory"))
    }
}

pub fn build(p: &Program, o: &Options) -> Outcome {
    let (cxx, version) = match compiler() {
        Ok(c) => c,
        Err(log) => return Outcome::Broken { log },
    };
    // Files found through -I are not part of the key (the pre-pass never
    // reads them), so such a build is never cached rather than maybe stale.
    let cacheable = o.include_paths.is_empty();
    let cached = cache_dir().filter(|_| cacheable).map(|d| d.join(cache_name(p, o, &cxx, &version)));
    if let Some(path) = &cached {
        if let Ok(image) = std::fs::read(path) {
            if is_elf(&image) {
                return Outcome::Built { image, log: String::new() };
            }
        }
    }
    let outcome = compile(p, o, &cxx);
    if let (Outcome::Built { image, log }, Some(path)) = (&outcome, &cached) {
        // Only clean builds are kept, so a cached image never hides a warning.
        if log.is_empty() {
            store(path, image);
        }
    }
    outcome
}

/// Writes under a temporary name and renames, so a reader never sees half a
/// file; a failure only costs a rebuild next time.
fn store(path: &Path, image: &[u8]) {
    let tmp = path.with_extension(format!("tmp{}-{:?}", std::process::id(), std::thread::current().id()));
    let stored = path
        .parent()
        .map(std::fs::create_dir_all)
        .transpose()
        .and_then(|_| std::fs::write(&tmp, image))
        .and_then(|_| std::fs::rename(&tmp, path));
    if let Err(e) = stored {
        let _ = std::fs::remove_file(&tmp);
        eprintln!("pipewright-emu: NVRTC: could not cache a kernel image in {}: {e}", path.display());
    }
}

/// A directory removed when dropped.
struct TempDir(PathBuf);

impl TempDir {
    fn new() -> std::io::Result<TempDir> {
        static COUNTER: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let nanos =
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.subsec_nanos());
        let n = COUNTER.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!(
            "pw-emu-nvrtc-{}-{n}-{}",
            std::process::id(),
            nanos.unwrap_or(0)
        ));
        // Private: the sources may be anyone's, and nobody else may swap a
        // file between the write and the compiler's read.
        std::os::unix::fs::DirBuilderExt::mode(&mut std::fs::DirBuilder::new(), 0o700).create(&dir)?;
        Ok(TempDir(dir))
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn compile(p: &Program, o: &Options, cxx: &str) -> Outcome {
    let main_file = match file_name(p.name) {
        Ok(f) => f,
        Err(e) => return Outcome::Failed { log: format!("error: program name {e}\n") },
    };
    let mut errors = vec![];
    let main = prepass::prepare(p.name, p.source, true);
    let mut headers = vec![];
    for (name, text) in p.headers {
        match (file_name(name), prepass::prepare(name, text, false)) {
            (Err(e), _) => errors.push(format!("error: header name {e}")),
            (Ok(f), Ok(prepared)) => headers.push((f, prepared.text)),
            (Ok(_), Err(e)) => errors.extend(e),
        }
    }
    let main = match main {
        Ok(m) => m,
        Err(e) => {
            errors.splice(0..0, e);
            return Outcome::Failed { log: errors.join("\n") + "\n" };
        }
    };
    if !errors.is_empty() {
        return Outcome::Failed { log: errors.join("\n") + "\n" };
    }
    let dir = match TempDir::new() {
        Ok(d) => d,
        Err(e) => {
            return Outcome::Broken {
                log: format!("could not create a build directory in {}: {e}", std::env::temp_dir().display()),
            }
        }
    };
    let source = main.text + &prepass::trailer(p.name, &o.arch_name(), &main.kernels);
    let mut files: Vec<(PathBuf, &str)> = vec![
        (PathBuf::from(".pw-emu/cuda_emu.h"), CUDA_EMU_H),
        (PathBuf::from(".pw-emu/pw_emu_abi.h"), PW_EMU_ABI_H),
        (main_file.clone(), &source),
    ];
    files.extend(headers.iter().map(|(f, t)| (f.clone(), t.as_str())));
    for (f, text) in &files {
        let path = dir.0.join(f);
        let written =
            path.parent().map(std::fs::create_dir_all).transpose().and_then(|_| std::fs::write(&path, text));
        if let Err(e) = written {
            return Outcome::Broken { log: format!("could not write {}: {e}", path.display()) };
        }
    }
    let mut cmd = Command::new(cxx);
    cmd.current_dir(&dir.0).args(flags()).arg(format!("-std={}", o.std));
    cmd.args(["-include", ".pw-emu/cuda_emu.h", "-I."]);
    // What NVRTC predefines when it compiles device code, so a program's
    // #if on them takes the branch it takes on a GPU.
    cmd.arg(format!("-D__CUDA_ARCH__={}", o.arch * 10));
    cmd.args(["-D__CUDACC__", "-D__CUDACC_RTC__"]);
    cmd.arg(format!("-D__CUDACC_VER_MAJOR__={}", super::VERSION.0));
    cmd.arg(format!("-D__CUDACC_VER_MINOR__={}", super::VERSION.1));
    for d in &o.defines {
        cmd.arg(format!("-D{d}"));
    }
    for i in &o.include_paths {
        cmd.arg("-I").arg(absolute(i));
    }
    cmd.arg("-c").arg("-o").arg("image.o").arg(&main_file);
    let out = match cmd.output() {
        Ok(out) => out,
        Err(e) => return Outcome::Broken { log: format!("could not run `{cxx}`: {e}") },
    };
    let mut log = String::from_utf8_lossy(&out.stderr).into_owned();
    if !out.status.success() {
        return Outcome::Failed { log };
    }
    let linked =
        Command::new(cxx).current_dir(&dir.0).args(LINK).args(["-o", "image.so", "image.o"]).output();
    match linked {
        Ok(out) if out.status.success() => log.push_str(&String::from_utf8_lossy(&out.stderr)),
        Ok(out) => return Outcome::Failed { log: log + &String::from_utf8_lossy(&out.stderr) },
        Err(e) => return Outcome::Broken { log: format!("could not run `{cxx}` to link: {e}") },
    }
    match std::fs::read(dir.0.join("image.so")) {
        Ok(image) if is_elf(&image) => Outcome::Built { image, log },
        Ok(_) => Outcome::Broken { log: format!("`{cxx}` succeeded but wrote no ELF shared object\n{log}") },
        Err(e) => {
            Outcome::Broken { log: format!("`{cxx}` succeeded but its output is unreadable: {e}\n{log}") }
        }
    }
}
