//! Modules and functions (cuModuleLoadData, cuModuleGetFunction).
//!
//! An image is the bytes of an x86-64 ELF shared object built by the NVRTC
//! stand-in (see include/pw_emu_abi.h); anything else (a real CUBIN, PTX
//! text) is refused with what it is. The image is written to a memfd and
//! loaded with dlopen from /proc/self/fd, so no file is left behind; its
//! `pw_emu_module_init` gets the runtime table and hands back the kernels.

use crate::abi;
use crate::error::{cu, EmuError, Result};
use std::collections::HashMap;
use std::ffi::{c_int, c_void, CStr, CString};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

pub const MODULE_TAG: usize = 0xA0_0000_0000;
pub const FUNCTION_TAG: usize = 0xF0_0000_0000;

#[derive(Clone, Debug)]
pub struct ParamInfo {
    pub name: String,
    pub type_: String,
    pub size: usize,
    pub align: usize,
    pub is_pointer: bool,
    pub pointee_is_const: bool,
}

#[derive(Clone, Debug)]
pub struct KernelInfo {
    pub name: String,
    pub entry: extern "C" fn(args: *mut *mut c_void),
    /// `__launch_bounds__`'s max threads per block, 0 when not declared.
    pub launch_bounds: u32,
    pub params: Vec<ParamInfo>,
}

pub struct Module {
    pub handle: usize,
    /// The context that loaded it (0 for a module made from Rust functions
    /// with none bound): its functions launch only there, as the driver's.
    pub ctx: usize,
    pub source_name: String,
    pub kernels: Vec<KernelInfo>,
    /// Touches the module's thread_local block (its static shared memory)
    /// on the calling thread and returns an address inside it.
    pub touch_shared: Option<extern "C" fn() -> *mut c_void>,
    /// The module's TLS module id and the length of its PT_TLS block: each
    /// thread's block of the module (its static shared memory) is found by
    /// asking the loader for offset 0 of that module (`__tls_get_addr`),
    /// which allocates it on first use. dl_iterate_phdr's `dlpi_tls_data`
    /// was used before: it is glibc's best-effort answer and came back null
    /// for a block this thread had just touched while another thread was
    /// loading modules (seen once in CI, in the pp 2 run).
    pub tls: Option<(usize, usize)>,
    /// Built with PW_EMU_INSTRUMENT: every load and store calls the runtime.
    pub instrumented: bool,
    /// dlopen's handle; null for a module made from Rust functions.
    lib: *mut c_void,
    /// The memfd the image was loaded from, never closed (one fd per module
    /// for the process's life): the loader knows a library by its path
    /// (/proc/self/fd/N), and a library it cannot unload (C++ objects with
    /// STB_GNU_UNIQUE symbols never are) would be handed back for the next
    /// image whose fd got the same number.
    _memfd: c_int,
}

// SAFETY: the dlopen handle is only used to dlclose once, in Drop; the
// kernel table is immutable after load.
unsafe impl Send for Module {}
unsafe impl Sync for Module {}

impl Drop for Module {
    fn drop(&mut self) {
        if !self.lib.is_null() {
            // SAFETY: our own dlopen handle; no function of the module can be
            // running (every queued launch holds an Arc of the module).
            unsafe { libc::dlclose(self.lib) };
        }
    }
}

pub struct Function {
    pub handle: usize,
    pub module: Arc<Module>,
    pub index: usize,
    /// CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES (48 KiB unless raised).
    pub max_dynamic_shared: AtomicU32,
}

impl Function {
    pub fn kernel(&self) -> &KernelInfo {
        &self.module.kernels[self.index]
    }

    /// "name (source.cu)" for errors.
    pub fn label(&self) -> String {
        format!("kernel `{}` ({})", self.kernel().name, self.module.source_name)
    }

    pub fn max_dynamic_shared(&self) -> u32 {
        self.max_dynamic_shared.load(Ordering::Relaxed)
    }
}

/// Shared memory a block may use without opting in (48 KiB), and the opt-in maximum (227 KiB), as sm_90's.
pub const SHARED_DEFAULT: u32 = 48 << 10;
pub const SHARED_OPTIN_MAX: u32 = 227 << 10;

struct Registry {
    modules: HashMap<usize, Arc<Module>>,
    functions: HashMap<usize, Arc<Function>>,
    /// (module, kernel index) → function handle, so a name looked up twice is one function.
    by_kernel: HashMap<(usize, usize), usize>,
    /// Unloaded modules and their functions (handles are never reused): what
    /// each was and why it is gone, to say so when one is used again.
    dead: HashMap<usize, String>,
    next: usize,
}

fn registry() -> MutexGuard<'static, Registry> {
    static R: OnceLock<Mutex<Registry>> = OnceLock::new();
    R.get_or_init(|| {
        Mutex::new(Registry {
            modules: HashMap::new(),
            functions: HashMap::new(),
            by_kernel: HashMap::new(),
            dead: HashMap::new(),
            next: 1,
        })
    })
    .lock()
    .unwrap_or_else(|p| p.into_inner())
}

const EM_X86_64: u16 = 62;
const EM_CUDA: u16 = 190;
const ET_DYN: u16 = 3;

/// Reads the image's ELF header and returns the image's length (the header
/// does not say it; the section headers are last in what a linker writes,
/// and the program headers' file ranges are inside it).
///
/// # Safety
/// `image` must point at a readable ELF header (64 bytes) and the whole image.
unsafe fn elf_len(image: *const u8) -> Result<usize> {
    let h = std::slice::from_raw_parts(image, 64);
    let u16_at = |o: usize| u16::from_le_bytes([h[o], h[o + 1]]);
    let u64_at = |o: usize| u64::from_le_bytes(h[o..o + 8].try_into().expect("8 bytes"));
    if h[4] != 2 || h[5] != 1 {
        return Err(EmuError::new(
            cu::INVALID_IMAGE,
            "cuModuleLoadData: the image is an ELF file but not 64-bit little-endian (expected an x86-64 shared object from the NVRTC stand-in)",
        ));
    }
    let machine = u16_at(18);
    if machine == EM_CUDA {
        return Err(EmuError::new(
            cu::NO_BINARY_FOR_GPU,
            "cuModuleLoadData: the image is a real CUBIN (ELF for EM_CUDA); the emulated GPU runs only x86-64 shared objects built by the NVRTC stand-in",
        ));
    }
    if machine != EM_X86_64 || u16_at(16) != ET_DYN {
        return Err(EmuError::new(
            cu::NO_BINARY_FOR_GPU,
            format!(
                "cuModuleLoadData: the image is an ELF file for machine {machine}, type {} (expected an x86-64 shared object, machine 62, type 3)",
                u16_at(16)
            ),
        ));
    }
    let (phoff, shoff) = (u64_at(32) as usize, u64_at(40) as usize);
    let (phentsize, phnum) = (u16_at(54) as usize, u16_at(56) as usize);
    let (shentsize, shnum) = (u16_at(58) as usize, u16_at(60) as usize);
    let mut len = (shoff + shentsize * shnum).max(phoff + phentsize * phnum).max(64);
    for i in 0..phnum {
        let ph = std::slice::from_raw_parts(image.add(phoff + i * phentsize), phentsize.max(56));
        let off = u64::from_le_bytes(ph[8..16].try_into().expect("8 bytes")) as usize;
        let filesz = u64::from_le_bytes(ph[32..40].try_into().expect("8 bytes")) as usize;
        len = len.max(off + filesz);
    }
    Ok(len)
}

/// Says what a non-ELF image looks like.
///
/// # Safety
/// `image` must point at a NUL-terminated string or at least 64 readable bytes.
unsafe fn not_elf(image: *const u8) -> EmuError {
    let mut head = Vec::new();
    for i in 0..64 {
        let b = *image.add(i);
        if b == 0 {
            break;
        }
        head.push(b);
    }
    let text = String::from_utf8_lossy(&head);
    let trimmed = text.trim_start();
    if trimmed.starts_with("//") || trimmed.starts_with(".version") || trimmed.starts_with(".target") {
        return EmuError::new(
            cu::INVALID_IMAGE,
            format!(
                "cuModuleLoadData: the image is PTX text ({:?}...); the emulated GPU runs only x86-64 shared objects built by the NVRTC stand-in",
                trimmed.chars().take(24).collect::<String>()
            ),
        );
    }
    EmuError::new(
        cu::INVALID_IMAGE,
        format!("cuModuleLoadData: the image starts with {:02x?}, not an ELF header (expected an x86-64 shared object from the NVRTC stand-in)", &head[..head.len().min(8)]),
    )
}

/// Loads a module image (cuModuleLoadData) into context `ctx`; returns its handle.
///
/// # Safety
/// `image` must point at a complete image, as cuModuleLoadData requires.
pub unsafe fn load_data(image: *const c_void, ctx: usize) -> Result<usize> {
    if image.is_null() {
        return Err(EmuError::new(cu::INVALID_VALUE, "cuModuleLoadData: the image pointer is null"));
    }
    let image = image as *const u8;
    if std::slice::from_raw_parts(image, 4) != b"\x7fELF" {
        return Err(not_elf(image));
    }
    let len = elf_len(image)?;
    let bytes = std::slice::from_raw_parts(image, len);
    let name = CString::new("pw-emu-module").expect("no NUL");
    let fd = libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC);
    if fd < 0 {
        return Err(EmuError::new(
            cu::OUT_OF_MEMORY,
            format!("cuModuleLoadData: memfd_create failed: {}", std::io::Error::last_os_error()),
        ));
    }
    let mut written = 0;
    while written < len {
        let n = libc::write(fd, bytes[written..].as_ptr() as *const c_void, len - written);
        if n <= 0 {
            let e = std::io::Error::last_os_error();
            libc::close(fd);
            return Err(EmuError::new(
                cu::OUT_OF_MEMORY,
                format!("cuModuleLoadData: writing the image to a memfd: {e}"),
            ));
        }
        written += n as usize;
    }
    let path = CString::new(format!("/proc/self/fd/{fd}")).expect("no NUL");
    let lib = libc::dlopen(path.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL);
    if lib.is_null() {
        libc::close(fd);
        let why = CStr::from_ptr(libc::dlerror()).to_string_lossy().into_owned();
        return Err(EmuError::new(
            cu::INVALID_IMAGE,
            format!("cuModuleLoadData: dlopen of the {len}-byte image: {why}"),
        ));
    }
    let init_name = CString::new(abi::MODULE_INIT).expect("no NUL");
    let init = libc::dlsym(lib, init_name.as_ptr());
    if init.is_null() {
        libc::dlclose(lib);
        libc::close(fd);
        return Err(EmuError::new(
            cu::INVALID_IMAGE,
            format!(
                "cuModuleLoadData: the shared object exports no `{}` (not built by the NVRTC stand-in)",
                abi::MODULE_INIT
            ),
        ));
    }
    let init: abi::ModuleInitFn = std::mem::transmute(init);
    let info = init(&crate::exec::RUNTIME);
    let module = match read_info(info) {
        Ok(m) => m,
        Err(e) => {
            libc::dlclose(lib);
            libc::close(fd);
            return Err(e);
        }
    };
    let (source_name, kernels, touch, instrumented) = module;
    if crate::exec::instrumented_checks() && !instrumented {
        libc::dlclose(lib);
        libc::close(fd);
        return Err(EmuError::new(
            cu::INVALID_IMAGE,
            format!(
                "cuModuleLoadData: module {source_name} was built without the per-access instrumentation \
                 PW_EMU_CHECK={} needs (an image cached by a run without the check? clear the kernel cache \
                 or rebuild it in this mode)",
                crate::exec::instrumented_check_names()
            ),
        ));
    }
    let tls = match tls_of(lib, bytes) {
        Ok(t) => t,
        Err(e) => {
            libc::dlclose(lib);
            libc::close(fd);
            return Err(e);
        }
    };
    Ok(register(Module {
        handle: 0,
        ctx,
        source_name,
        kernels,
        touch_shared: Some(touch),
        tls: Some(tls),
        instrumented,
        lib,
        _memfd: fd,
    }))
}

const PT_TLS: u32 = 7;

/// The loaded module's TLS module id (from the loader) and the size of its
/// PT_TLS segment (from the image's program headers). A module from the
/// NVRTC stand-in always has one: its shared-memory anchor is a thread_local.
///
/// # Safety
/// `lib` is a live dlopen handle of the image `bytes`.
unsafe fn tls_of(lib: *mut c_void, bytes: &[u8]) -> Result<(usize, usize)> {
    let refuse = |why: String| EmuError::new(cu::INVALID_IMAGE, format!("cuModuleLoadData: {why}"));
    let u16_at = |o: usize| bytes.get(o..o + 2).map(|b| u16::from_le_bytes([b[0], b[1]]));
    let u32_at = |o: usize| bytes.get(o..o + 4).map(|b| u32::from_le_bytes(b.try_into().expect("4 bytes")));
    let u64_at = |o: usize| bytes.get(o..o + 8).map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes")));
    let (Some(phoff), Some(phentsize), Some(phnum)) = (u64_at(32), u16_at(54), u16_at(56)) else {
        return Err(refuse("the image's ELF header is cut short".into()));
    };
    let mut memsz = None;
    for i in 0..phnum as usize {
        let at = phoff as usize + i * phentsize as usize;
        match (u32_at(at), u64_at(at + 40)) {
            (Some(PT_TLS), Some(m)) => memsz = Some(m as usize),
            (Some(_), Some(_)) => {}
            _ => return Err(refuse(format!("program header {i} lies outside the image"))),
        }
    }
    let Some(len) = memsz.filter(|&m| m > 0) else {
        return Err(refuse(
            "the module has no thread_local segment (PT_TLS), so no static shared memory anchor (not built by the NVRTC stand-in)".into(),
        ));
    };
    let mut modid: usize = 0;
    if libc::dlinfo(lib, libc::RTLD_DI_TLS_MODID, &mut modid as *mut usize as *mut c_void) != 0 || modid == 0
    {
        return Err(refuse("the loader gave the module no TLS module id".into()));
    }
    Ok((modid, len))
}

type ModuleParts = (String, Vec<KernelInfo>, extern "C" fn() -> *mut c_void, bool);

unsafe fn text(p: *const std::ffi::c_char, what: &str) -> Result<String> {
    if p.is_null() {
        return Err(EmuError::new(
            cu::INVALID_IMAGE,
            format!("cuModuleLoadData: the module's {what} is null"),
        ));
    }
    Ok(CStr::from_ptr(p).to_string_lossy().into_owned())
}

unsafe fn read_info(info: *const abi::ModuleInfo) -> Result<ModuleParts> {
    if info.is_null() {
        // The generated init refuses a runtime table of another ABI version:
        // an image an older or newer emulator built, most often found in a
        // kernel cache that outlived an emulator upgrade.
        return Err(EmuError::new(
            cu::INVALID_IMAGE,
            format!(
                "cuModuleLoadData: pw_emu_module_init refused this emulator's runtime table (ABI {}): the image \
                 was built by another version of the emulator (a stale kernel cache? clear \
                 $PIPEWRIGHT_KERNEL_CACHE, target/emu-gpu/kernel-cache under scripts/emulated-gpu.sh)",
                abi::ABI_VERSION
            ),
        ));
    }
    let info = &*info;
    if info.abi_version != abi::ABI_VERSION {
        return Err(EmuError::new(
            cu::INVALID_IMAGE,
            format!(
                "cuModuleLoadData: the module speaks emulator ABI {}, this emulator ABI {}",
                info.abi_version,
                abi::ABI_VERSION
            ),
        ));
    }
    let source = text(info.source_name, "source name")?;
    let mut kernels = Vec::with_capacity(info.num_kernels as usize);
    for k in 0..info.num_kernels as usize {
        let kernel = &*info.kernels.add(k);
        let mut params = Vec::with_capacity(kernel.num_params as usize);
        for p in 0..kernel.num_params as usize {
            let param = &*kernel.params.add(p);
            params.push(ParamInfo {
                name: text(param.name, "parameter name")?,
                type_: text(param.type_, "parameter type")?,
                size: param.size,
                align: param.align.max(1),
                is_pointer: param.is_pointer != 0,
                pointee_is_const: param.pointee_is_const != 0,
            });
        }
        kernels.push(KernelInfo {
            name: text(kernel.name, "kernel name")?,
            entry: kernel.entry,
            launch_bounds: kernel.launch_bounds,
            params,
        });
    }
    Ok((source, kernels, info.touch_shared, info.instrumented != 0))
}

fn register(mut module: Module) -> usize {
    let mut r = registry();
    r.next += 1;
    module.handle = MODULE_TAG + r.next;
    let handle = module.handle;
    r.modules.insert(handle, Arc::new(module));
    handle
}

/// A module made from Rust functions, for tests of the execution engine
/// that cannot wait for a C++ compiler: the kernels are called exactly as a
/// loaded module's are. It has no static shared memory. It belongs to the
/// calling thread's current context, as a loaded module would.
#[doc(hidden)]
pub fn from_kernels(source_name: &str, kernels: Vec<KernelInfo>) -> usize {
    register(Module {
        handle: 0,
        ctx: crate::context::current_handle(),
        source_name: source_name.to_string(),
        kernels,
        touch_shared: None,
        tls: None,
        instrumented: false,
        lib: std::ptr::null_mut(),
        _memfd: -1,
    })
}

/// Unloads a module (cuModuleUnload); launches already queued keep it alive.
pub fn unload(handle: usize) -> Result<()> {
    let mut r = registry();
    if !r.modules.contains_key(&handle) {
        let why = r.dead.get(&handle).cloned();
        drop(r);
        return Err(EmuError::new(
            cu::INVALID_HANDLE,
            format!(
                "cuModuleUnload: {handle:#x} is not a loaded module ({})",
                why.unwrap_or_else(|| crate::driver::what_handle(handle))
            ),
        ));
    }
    forget(&mut r, handle, "unloaded by cuModuleUnload".into());
    Ok(())
}

/// Unloads every module of a context being destroyed (cuCtxDestroy frees
/// all its resources): their handles and their functions' are refused from
/// now on, naming the context.
pub fn unload_context(ctx: usize, device: usize) {
    let mut r = registry();
    let of_ctx: Vec<usize> = r.modules.values().filter(|m| m.ctx == ctx).map(|m| m.handle).collect();
    for m in of_ctx {
        forget(
            &mut r,
            m,
            format!("unloaded with its context {ctx:#x} (GPU {device}), destroyed by cuCtxDestroy"),
        );
    }
}

fn forget(r: &mut Registry, handle: usize, why: String) {
    let Some(m) = r.modules.remove(&handle) else { return };
    r.dead.insert(handle, format!("module {handle:#x} ({}) was {why}", m.source_name));
    let gone: Vec<usize> = r.by_kernel.keys().filter(|(m, _)| *m == handle).map(|(_, k)| *k).collect();
    for k in gone {
        if let Some(f) = r.by_kernel.remove(&(handle, k)) {
            r.functions.remove(&f);
            let what =
                format!("kernel `{}` ({}) of module {handle:#x}, {why}", m.kernels[k].name, m.source_name);
            r.dead.insert(f, what);
        }
    }
}

/// The function `name` of a module (cuModuleGetFunction).
pub fn get_function(module: usize, name: &str) -> Result<usize> {
    let (found, dead) = {
        let r = registry();
        (r.modules.get(&module).cloned(), r.dead.get(&module).cloned())
    };
    let m = found.ok_or_else(|| {
        EmuError::new(
            cu::INVALID_HANDLE,
            format!(
                "cuModuleGetFunction({name}): {module:#x} is not a loaded module ({})",
                dead.unwrap_or_else(|| crate::driver::what_handle(module))
            ),
        )
    })?;
    let Some(index) = m.kernels.iter().position(|k| k.name == name) else {
        let names: Vec<&str> = m.kernels.iter().map(|k| k.name.as_str()).collect();
        return Err(EmuError::new(
            cu::NOT_FOUND,
            format!(
                "cuModuleGetFunction: module {} has no kernel `{name}` (it has: {})",
                m.source_name,
                names.join(", ")
            ),
        ));
    };
    let mut r = registry();
    if let Some(&f) = r.by_kernel.get(&(module, index)) {
        return Ok(f);
    }
    r.next += 1;
    let handle = FUNCTION_TAG + r.next;
    let f =
        Arc::new(Function { handle, module: m, index, max_dynamic_shared: AtomicU32::new(SHARED_DEFAULT) });
    r.functions.insert(handle, f);
    r.by_kernel.insert((module, index), handle);
    Ok(handle)
}

pub fn function(handle: usize, call: &str) -> Result<Arc<Function>> {
    let (found, dead) = {
        let r = registry();
        (r.functions.get(&handle).cloned(), r.dead.get(&handle).cloned())
    };
    found.ok_or_else(|| {
        EmuError::new(
            cu::INVALID_HANDLE,
            format!(
                "{call}: {handle:#x} is not a function of a loaded module ({})",
                dead.unwrap_or_else(|| crate::driver::what_handle(handle))
            ),
        )
    })
}

pub fn is_function(h: usize) -> bool {
    registry().functions.contains_key(&h)
}

pub fn is_module(h: usize) -> bool {
    registry().modules.contains_key(&h)
}
