//! Finds and opens libnccl ourselves, instead of through cudarc's loader.
//!
//! cudarc 0.19 tries `libnccl.so`, `libnccl.so.13`, `.so.12`, `.so.11`, `.so.10`,
//! `.so.9`, `.so.1` and some Windows-style names, never `libnccl.so.2`: the
//! soname every NCCL 2.x has, and the only file PyPI's `nvidia-nccl-cu12` /
//! `-cu13` wheels ship (under `site-packages/nvidia/nccl/lib`). It reads no
//! variable to override that, and glibc reads LD_LIBRARY_PATH only at start,
//! so no link made at run time would reach it. Here the soname comes first,
//! then the unversioned name; each is tried through the dynamic loader's own
//! search (LD_LIBRARY_PATH, ld.so.cache, the system folders), then in the
//! folders where pip and conda put the wheel, so `pip install nvidia-nccl-cu13`
//! is enough. Only the few entry points `nccl.rs` calls are bound.

use super::CudaError;
use cudarc::nccl::sys;
use std::ffi::{c_int, c_void, CStr, OsString};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// The file names tried, in order: NCCL 2's soname (all a wheel ships), then the
/// name a distribution's -dev package links to it.
pub const NAMES: &[&str] = &["libnccl.so.2", "libnccl.so"];

/// Names the folder holding libnccl explicitly (tried first among the folders).
pub const DIR_VAR: &str = "PIPEWRIGHT_NCCL_DIR";

/// The folders searched after the dynamic loader's own search failed, in
/// order: $PIPEWRIGHT_NCCL_DIR, then `nvidia/nccl/lib` under each Python
/// package folder of the active virtual environment or conda, the user's,
/// and the system's. `var` reads an environment variable (a parameter, so
/// tests need not change the process's environment).
pub fn search_dirs(var: &dyn Fn(&str) -> Option<OsString>) -> Vec<PathBuf> {
    let mut dirs = vec![];
    if let Some(d) = var(DIR_VAR) {
        dirs.push(PathBuf::from(d));
    }
    let mut prefixes: Vec<PathBuf> = vec![];
    for v in ["VIRTUAL_ENV", "CONDA_PREFIX"] {
        if let Some(p) = var(v) {
            prefixes.push(PathBuf::from(p).join("lib"));
        }
    }
    if let Some(h) = var("HOME") {
        prefixes.push(PathBuf::from(h).join(".local/lib"));
    }
    prefixes.extend(["/usr/local/lib", "/usr/lib", "/opt/conda/lib"].map(PathBuf::from));
    for prefix in prefixes {
        for python in python_dirs(&prefix) {
            for packages in ["site-packages", "dist-packages"] {
                let d = python.join(packages).join("nvidia/nccl/lib");
                if d.is_dir() {
                    dirs.push(d);
                }
            }
        }
    }
    dirs
}

/// `prefix/python3*` folders, sorted (newest Python last, by name).
fn python_dirs(prefix: &Path) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(prefix) else { return vec![] };
    let mut found: Vec<PathBuf> = entries
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().starts_with("python3"))
        .map(|e| e.path())
        .collect();
    found.sort();
    found
}

/// Every file path tried, in order: each name bare (the loader's search), then in each folder.
pub fn candidates(dirs: &[PathBuf]) -> Vec<PathBuf> {
    let bare = NAMES.iter().map(PathBuf::from);
    let in_dirs = dirs.iter().flat_map(|d| NAMES.iter().map(move |n| d.join(n)));
    bare.chain(in_dirs).collect()
}

/// The error when no candidate opened: what was tried and what to do.
pub fn not_found(dirs: &[PathBuf], last_error: &str) -> CudaError {
    let folders = if dirs.is_empty() {
        "no Python nvidia/nccl/lib folder exists".to_string()
    } else {
        dirs.iter().map(|d| d.display().to_string()).collect::<Vec<_>>().join(", ")
    };
    CudaError::NoNccl(format!(
        "tried {} through the dynamic loader (LD_LIBRARY_PATH, ld.so.cache, system folders), then in: {folders} \
         (last error: {last_error}). Install NCCL 2 (`pip install nvidia-nccl-cu13`, or -cu12 for a CUDA 12 \
         driver, puts libnccl.so.2 where this search finds it), or set {DIR_VAR} to the folder holding libnccl.so.2",
        NAMES.join(" and ")
    ))
}

type GetUniqueId = unsafe extern "C" fn(*mut sys::ncclUniqueId) -> c_int;
type CommInitRank = unsafe extern "C" fn(*mut sys::ncclComm_t, c_int, sys::ncclUniqueId, c_int) -> c_int;
type SendFn = unsafe extern "C" fn(
    *const c_void,
    usize,
    sys::ncclDataType_t,
    c_int,
    sys::ncclComm_t,
    sys::cudaStream_t,
) -> c_int;
type RecvFn = unsafe extern "C" fn(
    *mut c_void,
    usize,
    sys::ncclDataType_t,
    c_int,
    sys::ncclComm_t,
    sys::cudaStream_t,
) -> c_int;
type AllReduce = unsafe extern "C" fn(
    *const c_void,
    *mut c_void,
    usize,
    sys::ncclDataType_t,
    sys::ncclRedOp_t,
    sys::ncclComm_t,
    sys::cudaStream_t,
) -> c_int;
type CommInitAll = unsafe extern "C" fn(*mut sys::ncclComm_t, c_int, *const c_int) -> c_int;
type AllGather = unsafe extern "C" fn(
    *const c_void,
    *mut c_void,
    usize,
    sys::ncclDataType_t,
    sys::ncclComm_t,
    sys::cudaStream_t,
) -> c_int;
type Broadcast = unsafe extern "C" fn(
    *const c_void,
    *mut c_void,
    usize,
    sys::ncclDataType_t,
    c_int,
    sys::ncclComm_t,
    sys::cudaStream_t,
) -> c_int;
type Reduce = unsafe extern "C" fn(
    *const c_void,
    *mut c_void,
    usize,
    sys::ncclDataType_t,
    sys::ncclRedOp_t,
    c_int,
    sys::ncclComm_t,
    sys::cudaStream_t,
) -> c_int;
type GroupCall = unsafe extern "C" fn() -> c_int;
type CommDestroy = unsafe extern "C" fn(sys::ncclComm_t) -> c_int;
type GetErrorString = unsafe extern "C" fn(c_int) -> *const std::ffi::c_char;
type GetVersion = unsafe extern "C" fn(*mut c_int) -> c_int;

/// An NCCL release, from the code ncclGetVersion answers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NcclVersion {
    pub major: u32,
    pub minor: u32,
    pub patch: u32,
    pub code: i32,
}

impl NcclVersion {
    /// Decodes NCCL_VERSION_CODE as nccl.h builds it: X*1000 + Y*100 + Z up
    /// to 2.8, X*10000 + Y*100 + Z from 2.9 on (2.8.4 is 2804, 2.23.4 is
    /// 22304; every code of the second form is at least 20900).
    pub fn from_code(code: c_int) -> Option<NcclVersion> {
        let c = u32::try_from(code).ok().filter(|&c| c >= 1000)?;
        let (major, rest) = if c >= 10_000 { (c / 10_000, c % 10_000) } else { (c / 1000, c % 1000) };
        Some(NcclVersion { major, minor: rest / 100, patch: rest % 100, code })
    }
}

impl std::fmt::Display for NcclVersion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}.{}.{}", self.major, self.minor, self.patch)
    }
}

/// The line a run prints when it loads NCCL: which release, from which file.
pub fn loaded_line(version: Result<NcclVersion, String>, path: &Path) -> String {
    let v = match version {
        Ok(v) => format!("{v} (ncclGetVersion {})", v.code),
        Err(e) => format!("of unknown version ({e})"),
    };
    format!("NCCL {v} loaded from {}", path.display())
}

/// The file the loader mapped the code at `address` from (the real path,
/// where a bare name went through LD_LIBRARY_PATH or ld.so.cache), or None.
/// An address, not a pointer: dladdr compares it with the mapped objects'
/// ranges and never reads through it.
pub fn object_path(address: usize) -> Option<PathBuf> {
    // SAFETY: Dl_info is plain pointers, for which all zeros is valid.
    let mut info: libc::Dl_info = unsafe { std::mem::zeroed() };
    // SAFETY: dladdr fills `info`; dli_fname then points into the loader's
    // own records for a mapped object.
    if unsafe { libc::dladdr(address as *const c_void, &mut info) } == 0 || info.dli_fname.is_null() {
        return None;
    }
    let name = unsafe { CStr::from_ptr(info.dli_fname) }.to_string_lossy().into_owned();
    let path = PathBuf::from(name);
    Some(std::fs::canonicalize(&path).unwrap_or(path))
}

/// The entry points `nccl.rs` calls, bound once.
pub struct Nccl {
    pub path: PathBuf,
    pub get_unique_id: GetUniqueId,
    pub comm_init_rank: CommInitRank,
    pub send: SendFn,
    pub recv: RecvFn,
    pub all_reduce: AllReduce,
    pub comm_init_all: CommInitAll,
    pub all_gather: AllGather,
    pub broadcast: Broadcast,
    pub reduce: Reduce,
    pub group_start: GroupCall,
    pub group_end: GroupCall,
    pub comm_destroy: CommDestroy,
    get_error_string: GetErrorString,
    get_version: GetVersion,
    // Keeps the library mapped while the pointers above are used.
    _lib: libloading::Library,
}

impl Nccl {
    /// Turns an ncclResult_t into a Result, with NCCL's own description.
    pub fn check(&self, what: &str, code: c_int) -> super::Result<()> {
        if code == 0 {
            return Ok(());
        }
        // SAFETY: NCCL returns a static string for any code.
        let text = unsafe { CStr::from_ptr((self.get_error_string)(code)) }.to_string_lossy();
        Err(CudaError::Nccl(format!("{what}: {text} (ncclResult_t {code})")))
    }

    /// The release, as ncclGetVersion reports it.
    pub fn version(&self) -> Result<NcclVersion, String> {
        let mut code: c_int = 0;
        // SAFETY: one out-parameter of the right type.
        let rc = unsafe { (self.get_version)(&mut code) };
        self.check("ncclGetVersion", rc).map_err(|e| e.to_string())?;
        NcclVersion::from_code(code).ok_or_else(|| format!("ncclGetVersion answered {code}"))
    }

    /// The file the library was mapped from (where a bare name was found).
    pub fn loaded_from(&self) -> PathBuf {
        object_path(self.get_unique_id as usize).unwrap_or_else(|| self.path.clone())
    }

    fn open(path: &Path) -> Result<Nccl, libloading::Error> {
        // SAFETY: libnccl's initialisers have no preconditions; each symbol is
        // bound with the signature nccl.h declares for NCCL 2.x.
        unsafe {
            let lib = libloading::Library::new(path.as_os_str())?;
            Ok(Nccl {
                path: path.to_path_buf(),
                get_unique_id: *lib.get(b"ncclGetUniqueId\0")?,
                comm_init_rank: *lib.get(b"ncclCommInitRank\0")?,
                send: *lib.get(b"ncclSend\0")?,
                recv: *lib.get(b"ncclRecv\0")?,
                all_reduce: *lib.get(b"ncclAllReduce\0")?,
                comm_init_all: *lib.get(b"ncclCommInitAll\0")?,
                all_gather: *lib.get(b"ncclAllGather\0")?,
                broadcast: *lib.get(b"ncclBroadcast\0")?,
                reduce: *lib.get(b"ncclReduce\0")?,
                group_start: *lib.get(b"ncclGroupStart\0")?,
                group_end: *lib.get(b"ncclGroupEnd\0")?,
                comm_destroy: *lib.get(b"ncclCommDestroy\0")?,
                get_error_string: *lib.get(b"ncclGetErrorString\0")?,
                get_version: *lib.get(b"ncclGetVersion\0")?,
                _lib: lib,
            })
        }
    }
}

/// libnccl, opened on first use: the first candidate that opens and has
/// every entry point. The first use says which file and release it is, once
/// per process: NCCL_DEBUG=INFO says the same from inside NCCL, but only
/// once a communicator is made, and mixed with every other line it prints.
pub fn nccl() -> super::Result<&'static Nccl> {
    static LIB: OnceLock<Result<Nccl, String>> = OnceLock::new();
    let found = LIB.get_or_init(|| {
        let dirs = search_dirs(&|v| std::env::var_os(v));
        let mut last = String::from("none tried");
        for path in candidates(&dirs) {
            match Nccl::open(&path) {
                Ok(n) => {
                    tracing::info!("{}", loaded_line(n.version(), &n.loaded_from()));
                    return Ok(n);
                }
                Err(e) => last = e.to_string(),
            }
        }
        match not_found(&dirs, &last) {
            CudaError::NoNccl(msg) => Err(msg),
            other => Err(other.to_string()),
        }
    });
    found.as_ref().map_err(|msg| CudaError::NoNccl(msg.clone()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn version_codes_decode_in_both_of_nccl_h_s_forms() {
        let v = |c| NcclVersion::from_code(c).map(|v| v.to_string());
        assert_eq!(v(22304).as_deref(), Some("2.23.4"));
        assert_eq!(v(20900).as_deref(), Some("2.9.0"));
        assert_eq!(v(22807).as_deref(), Some("2.28.7"));
        assert_eq!(v(2804).as_deref(), Some("2.8.4"));
        assert_eq!(v(2708).as_deref(), Some("2.7.8"));
        assert_eq!(v(0), None);
        assert_eq!(v(-1), None);
    }

    #[test]
    fn the_loaded_line_names_release_code_and_file() {
        let v = NcclVersion::from_code(22304).unwrap();
        let p = Path::new("/v/nvidia/nccl/lib/libnccl.so.2");
        assert_eq!(
            loaded_line(Ok(v), p),
            "NCCL 2.23.4 (ncclGetVersion 22304) loaded from /v/nvidia/nccl/lib/libnccl.so.2"
        );
        let e = loaded_line(Err("ncclGetVersion answered 7".into()), p);
        assert_eq!(
            e,
            "NCCL of unknown version (ncclGetVersion answered 7) loaded from /v/nvidia/nccl/lib/libnccl.so.2"
        );
    }

    #[test]
    fn a_symbol_opened_by_its_bare_name_is_traced_to_its_file() {
        // What `loaded_from` does for libnccl.so.2 found on LD_LIBRARY_PATH,
        // on a library every Linux process has.
        let lib = unsafe { libloading::Library::new("libc.so.6") }.unwrap();
        let strlen: libloading::Symbol<unsafe extern "C" fn()> = unsafe { lib.get(b"strlen\0") }.unwrap();
        let path = object_path(*strlen as usize).expect("dladdr found strlen");
        assert!(path.is_absolute(), "{}", path.display());
        assert!(path.file_name().unwrap().to_string_lossy().starts_with("libc"), "{}", path.display());
        assert!(object_path(0).is_none());
    }

    #[test]
    fn the_wheels_soname_is_tried_first_then_the_unversioned_name() {
        let c = candidates(&[PathBuf::from("/w/nvidia/nccl/lib")]);
        let c: Vec<String> = c.iter().map(|p| p.display().to_string()).collect();
        assert_eq!(
            c,
            [
                "libnccl.so.2",
                "libnccl.so",
                "/w/nvidia/nccl/lib/libnccl.so.2",
                "/w/nvidia/nccl/lib/libnccl.so"
            ]
        );
    }

    #[test]
    fn a_wheel_in_the_virtual_environment_is_found_after_the_explicit_folder() {
        let venv = tempfile::tempdir().unwrap();
        let lib = venv.path().join("lib/python3.12/site-packages/nvidia/nccl/lib");
        std::fs::create_dir_all(&lib).unwrap();
        // A folder without the wheel is not listed.
        std::fs::create_dir_all(venv.path().join("lib/python3.11/site-packages")).unwrap();
        let var = |v: &str| match v {
            "VIRTUAL_ENV" => Some(venv.path().as_os_str().to_owned()),
            "PIPEWRIGHT_NCCL_DIR" => Some(OsString::from("/opt/nccl/lib")),
            _ => None,
        };
        let dirs = search_dirs(&var);
        assert_eq!(dirs.first(), Some(&PathBuf::from("/opt/nccl/lib")));
        assert_eq!(dirs.get(1), Some(&lib));
        assert!(!dirs.iter().any(|d| d.starts_with(venv.path().join("lib/python3.11"))));
    }

    #[test]
    fn the_user_site_and_dist_packages_are_searched() {
        let home = tempfile::tempdir().unwrap();
        let lib = home.path().join(".local/lib/python3.10/dist-packages/nvidia/nccl/lib");
        std::fs::create_dir_all(&lib).unwrap();
        let var = |v: &str| (v == "HOME").then(|| home.path().as_os_str().to_owned());
        assert!(search_dirs(&var).contains(&lib));
    }

    #[test]
    fn the_not_found_message_names_every_name_and_folder_and_the_fix() {
        let dirs = [PathBuf::from("/v/lib/python3.12/site-packages/nvidia/nccl/lib")];
        let msg = not_found(&dirs, "cannot open shared object file").to_string();
        for want in ["libnccl.so.2", "libnccl.so", "/v/lib/python3.12/site-packages/nvidia/nccl/lib"] {
            assert!(msg.contains(want), "{want} missing from: {msg}");
        }
        assert!(msg.contains("pip install nvidia-nccl-cu13") && msg.contains(DIR_VAR), "{msg}");
    }
}
