//! One GPU as a stage's thread sees it: its context (bound to the thread that
//! made it), one stream, the compiled kernel modules and the cuBLASLt state.
//! Device memory is `DeviceBuffer`, freed on drop. A `Gpu` is not `Send`:
//! each stage thread owns its own, as the design asks.

use super::matmul::Blas;
use super::nvrtc;
use super::{ensure, CudaError, Elem, Result};
use cudarc::driver::{result, sys, CudaContext, CudaStream};
use std::cell::RefCell;
use std::collections::HashMap;
use std::ffi::{c_void, CString};
use std::marker::PhantomData;
use std::sync::Arc;

/// A typed device allocation of `len` elements.
pub struct DeviceBuffer<T> {
    ptr: sys::CUdeviceptr,
    len: usize,
    ctx: Arc<CudaContext>,
    _t: PhantomData<T>,
}

impl<T> DeviceBuffer<T> {
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// The device address of element `i` (for views into one big buffer).
    pub fn ptr_at(&self, i: usize) -> u64 {
        debug_assert!(i <= self.len);
        self.ptr + (i * std::mem::size_of::<T>()) as u64
    }
    pub fn ptr(&self) -> u64 {
        self.ptr
    }
    pub fn bytes(&self) -> usize {
        self.len * std::mem::size_of::<T>()
    }
}

impl<T> Drop for DeviceBuffer<T> {
    fn drop(&mut self) {
        if self.ptr != 0 && self.ctx.bind_to_thread().is_ok() {
            // SAFETY: allocated by malloc_sync in this context, freed once.
            unsafe {
                let _ = result::free_sync(self.ptr);
            }
        }
    }
}

/// A GPU's context, named across stage threads (the source of a copy).
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Context(sys::CUcontext);

// SAFETY: a CUcontext is a process-wide handle the driver accepts from any
// thread; it is only ever used here to name the source of a copy.
unsafe impl Send for Context {}

/// A point on a stream; waiting on it waits for the work queued before it.
pub struct Event(sys::CUevent);

impl Event {
    pub fn wait(&self) -> Result<()> {
        super::counts::host_sync();
        // SAFETY: a live event made by `comm_mark`.
        unsafe { result::event::synchronize(self.0)? };
        Ok(())
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        // SAFETY: destroyed once.
        unsafe {
            let _ = result::event::destroy(self.0);
        }
    }
}

/// A loaded module: its functions by name.
struct Module {
    _module: sys::CUmodule,
    functions: HashMap<&'static str, sys::CUfunction>,
}

pub struct Gpu {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    /// A second stream for sends to other processes (NCCL), so a send waiting
    /// for its receiver never holds up this GPU's compute.
    comm_stream: Arc<CudaStream>,
    /// The driver's number for this GPU (what NCCL's ncclCommInitAll takes).
    pub ordinal: usize,
    /// Compute capability as one number (90 for sm_90).
    pub arch: u32,
    pub name: String,
    modules: RefCell<HashMap<(&'static str, bool), Module>>,
    pub(crate) blas: RefCell<Option<Blas>>,
}

impl Gpu {
    /// Opens GPU `ordinal`, failing with `NoDriver` (not a panic) on a machine
    /// without the CUDA driver.
    pub fn new(ordinal: usize) -> Result<Gpu> {
        if !super::driver_present() {
            return Err(CudaError::NoDriver);
        }
        result::init()?;
        let count = result::device::get_count()? as usize;
        if ordinal >= count {
            return Err(CudaError::NoSuchDevice { ordinal, count });
        }
        let ctx = CudaContext::new(ordinal)?;
        ctx.bind_to_thread()?;
        let (major, minor) = ctx.compute_capability()?;
        let name = ctx.name()?;
        let stream = ctx.new_stream()?;
        let comm_stream = ctx.new_stream()?;
        Ok(Gpu {
            ctx,
            stream,
            comm_stream,
            ordinal,
            arch: (major * 10 + minor) as u32,
            name,
            modules: RefCell::new(HashMap::new()),
            blas: RefCell::new(None),
        })
    }

    /// Makes this GPU's context current on the calling thread (for calls,
    /// such as NCCL's, that act on the current context).
    pub fn bind(&self) -> Result<()> {
        self.ctx.bind_to_thread()?;
        Ok(())
    }

    pub fn comm_stream(&self) -> sys::CUstream {
        self.comm_stream.cu_stream()
    }

    /// The driver's handle of this GPU's context (for copies between GPUs).
    pub fn context(&self) -> Context {
        Context(self.ctx.cu_ctx())
    }

    /// `bytes` from `src` in context `src_ctx` (this GPU's or another's) to
    /// `dst` on this GPU, finished before returning.
    pub fn copy_from_context(&self, dst: u64, src: u64, src_ctx: Context, bytes: usize) -> Result<()> {
        super::counts::d2d();
        super::counts::host_sync();
        // SAFETY: callers pass live ranges of `bytes` bytes in their contexts;
        // synchronized before the source may be reused.
        unsafe {
            if src_ctx == self.context() {
                result::memcpy_dtod_async(dst, src, bytes, self.stream())?;
            } else {
                result::memcpy_peer_async(self.context().0, dst, src_ctx.0, src, bytes, self.stream())?;
            }
            result::stream::synchronize(self.stream())?;
        }
        Ok(())
    }

    /// Makes the comm stream wait for everything queued on the compute stream so far.
    pub fn comm_after_compute(&self) -> Result<()> {
        let e = result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)?;
        // SAFETY: a fresh event recorded on our stream, waited on by our other
        // stream, destroyed after the wait is queued (the driver keeps it alive).
        unsafe {
            result::event::record(e, self.stream())?;
            result::stream::wait_event(
                self.comm_stream(),
                e,
                sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
            )?;
            result::event::destroy(e)?;
        }
        Ok(())
    }

    /// An event recorded now on the comm stream: done when every send queued so far is.
    pub fn comm_mark(&self) -> Result<Event> {
        let e = result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)?;
        // SAFETY: a fresh event on our own stream.
        unsafe { result::event::record(e, self.comm_stream())? };
        Ok(Event(e))
    }

    pub fn stream(&self) -> sys::CUstream {
        self.stream.cu_stream()
    }

    /// Device memory, zeroed.
    pub fn alloc<T>(&self, len: usize) -> Result<DeviceBuffer<T>> {
        self.ctx.bind_to_thread()?;
        let bytes = (len * std::mem::size_of::<T>()).max(1);
        // SAFETY: a fresh allocation in the bound context, zeroed before use.
        let ptr = unsafe { result::malloc_sync(bytes)? };
        super::counts::alloc(bytes);
        let buf = DeviceBuffer { ptr, len, ctx: self.ctx.clone(), _t: PhantomData };
        super::counts::memset();
        unsafe { result::memset_d8_async(ptr, 0, bytes, self.stream())? };
        Ok(buf)
    }

    pub fn upload<T: Copy>(&self, host: &[T]) -> Result<DeviceBuffer<T>> {
        let buf = self.alloc::<T>(host.len())?;
        self.copy_to(&buf, 0, host)?;
        Ok(buf)
    }

    /// host → buf[offset..offset + host.len()], finished before returning.
    pub fn copy_to<T: Copy>(&self, buf: &DeviceBuffer<T>, offset: usize, host: &[T]) -> Result<()> {
        ensure(offset + host.len() <= buf.len, || {
            format!("upload of {} elements at {offset} into a buffer of {}", host.len(), buf.len)
        })?;
        if host.is_empty() {
            return Ok(());
        }
        super::counts::h2d(std::mem::size_of_val(host));
        super::counts::host_sync();
        // SAFETY: bounds checked; the copy completes before `host` can move.
        unsafe {
            result::memcpy_htod_async(buf.ptr_at(offset), host, self.stream())?;
            result::stream::synchronize(self.stream())?;
        }
        Ok(())
    }

    pub fn download<T: Copy + Default>(&self, buf: &DeviceBuffer<T>) -> Result<Vec<T>> {
        let mut host = vec![T::default(); buf.len];
        self.download_at(buf, 0, &mut host)?;
        Ok(host)
    }

    /// buf → host (same length), finished before returning; allocates nothing.
    pub fn download_into<T: Copy>(&self, buf: &DeviceBuffer<T>, host: &mut [T]) -> Result<()> {
        ensure(host.len() == buf.len, || format!("download of {} elements into {}", buf.len, host.len()))?;
        self.download_at(buf, 0, host)
    }

    /// buf[offset..offset + host.len()] → host, finished before returning.
    pub fn download_at<T: Copy>(&self, buf: &DeviceBuffer<T>, offset: usize, host: &mut [T]) -> Result<()> {
        ensure(offset + host.len() <= buf.len, || {
            format!("download of {} elements at {offset} from a buffer of {}", host.len(), buf.len)
        })?;
        if !host.is_empty() {
            super::counts::d2h(std::mem::size_of_val(host));
            super::counts::host_sync();
            // SAFETY: bounds checked; synchronized before `host` is read.
            unsafe {
                result::memcpy_dtoh_async(host, buf.ptr_at(offset), self.stream())?;
                result::stream::synchronize(self.stream())?;
            }
        }
        Ok(())
    }

    /// Device memory as f32 on the host, whatever the storage type.
    pub fn download_f32<X: Elem>(&self, buf: &DeviceBuffer<X>) -> Result<Vec<f32>> {
        Ok(self.download(buf)?.into_iter().map(Elem::to_f32).collect())
    }

    pub fn upload_from_f32<X: Elem>(&self, host: &[f32]) -> Result<DeviceBuffer<X>> {
        let v: Vec<X> = host.iter().map(|&x| X::from_f32(x)).collect();
        self.upload(&v)
    }

    pub fn zero<T>(&self, buf: &DeviceBuffer<T>) -> Result<()> {
        super::counts::memset();
        // SAFETY: the whole allocation, on this GPU's stream.
        unsafe { result::memset_d8_async(buf.ptr, 0, buf.bytes(), self.stream())? };
        Ok(())
    }

    pub fn copy_device<T>(&self, dst: &DeviceBuffer<T>, src: &DeviceBuffer<T>) -> Result<()> {
        ensure(dst.len == src.len, || format!("device copy of {} into {} elements", src.len, dst.len))?;
        super::counts::d2d();
        // SAFETY: equal sizes, same context.
        unsafe { result::memcpy_dtod_async(dst.ptr, src.ptr, src.bytes(), self.stream())? };
        Ok(())
    }

    /// `bytes` from `src` to `dst`, both on this GPU, queued on its stream
    /// (a tensor-parallel exchange between ranks sharing this GPU).
    pub fn copy_raw(&self, dst: u64, src: u64, bytes: usize) -> Result<()> {
        super::counts::d2d();
        // SAFETY: callers pass live device ranges of `bytes` bytes in this context.
        unsafe { result::memcpy_dtod_async(dst, src, bytes, self.stream())? };
        Ok(())
    }

    /// Every element of `buf` set to `value`, on this GPU's stream.
    pub fn fill_f32(&self, buf: &DeviceBuffer<f32>, value: f32) -> Result<()> {
        super::counts::memset();
        // SAFETY: the whole allocation (len f32s), on this GPU's stream.
        unsafe { sys::cuMemsetD32Async(buf.ptr, value.to_bits(), buf.len, self.stream()).result()? };
        Ok(())
    }

    /// Elements `offset..offset + len` of `buf` set to `value`, on this GPU's stream.
    pub fn fill_f32_at(&self, buf: &DeviceBuffer<f32>, offset: usize, len: usize, value: f32) -> Result<()> {
        ensure(offset + len <= buf.len, || {
            format!("a fill of elements {offset}..{} of a buffer of {}", offset + len, buf.len)
        })?;
        super::counts::memset();
        // SAFETY: inside the allocation (checked above), on this GPU's stream.
        unsafe { sys::cuMemsetD32Async(buf.ptr_at(offset), value.to_bits(), len, self.stream()).result()? };
        Ok(())
    }

    pub fn synchronize(&self) -> Result<()> {
        super::counts::host_sync();
        // SAFETY: our own stream.
        unsafe { result::stream::synchronize(self.stream())? };
        Ok(())
    }

    /// The kernel `function` of kernels/`file`.cu compiled for storage type X
    /// (compiled on first use, from the disk cache when it holds it).
    pub(crate) fn function<X: Elem>(
        &self,
        file: &'static str,
        function: &'static str,
    ) -> Result<sys::CUfunction> {
        let key = (file, X::IS_F32);
        let mut modules = self.modules.borrow_mut();
        if let std::collections::hash_map::Entry::Vacant(e) = modules.entry(key) {
            let cubin = nvrtc::cubin_cached(file, self.arch, X::IS_F32)?;
            // SAFETY: a complete CUBIN image from NVRTC, loaded in the bound context.
            let module = unsafe { result::module::load_data(cubin.as_ptr() as *const c_void)? };
            e.insert(Module { _module: module, functions: HashMap::new() });
        }
        let m = modules.get_mut(&key).expect("inserted above");
        if let Some(f) = m.functions.get(function) {
            return Ok(*f);
        }
        let name =
            CString::new(function).map_err(|_| CudaError::Shape(format!("kernel name {function:?}")))?;
        // SAFETY: the module is loaded and outlives the Gpu.
        let f = unsafe { result::module::get_function(m._module, name)? };
        m.functions.insert(function, f);
        Ok(f)
    }

    /// Launches `f` on this GPU's stream. `args` point at the kernel's
    /// arguments in order, each of the type the kernel declares.
    pub(crate) fn launch(
        &self,
        f: sys::CUfunction,
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        args: &mut [*mut c_void],
    ) -> Result<()> {
        self.launch_shared(f, grid, block, 0, args)
    }

    /// [`Gpu::launch`] with `shared` bytes of dynamic shared memory per block
    /// (at most 48 KiB: no kernel here opts in to more).
    pub(crate) fn launch_shared(
        &self,
        f: sys::CUfunction,
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        shared: u32,
        args: &mut [*mut c_void],
    ) -> Result<()> {
        super::counts::launch();
        // SAFETY: callers pass arguments matching the kernel's signature, and
        // device pointers of buffers that outlive the stream's work on them
        // (every buffer is freed only after a synchronize or on the same stream).
        unsafe { result::launch_kernel(f, grid, block, shared, self.stream(), args) }
            .map_err(|err| CudaError::Launch { kernel: self.kernel_name(f), grid, block, err })
    }

    /// "file.cu:function (f32|bf16)" of a function `function` handed out (for errors).
    fn kernel_name(&self, f: sys::CUfunction) -> String {
        let modules = self.modules.borrow();
        let mut names: Vec<String> = modules
            .iter()
            .flat_map(|((file, f32), m)| {
                m.functions.iter().filter(|(_, &g)| g == f).map(move |(name, _)| {
                    format!("kernels/{file}.cu:{name} ({})", if *f32 { "f32" } else { "bf16" })
                })
            })
            .collect();
        names.sort();
        names.pop().unwrap_or_else(|| "an unknown kernel".into())
    }
}

/// Pointers to kernel arguments, in order: `args![a, b, c]` for locals a, b, c.
macro_rules! args {
    ($($a:expr),* $(,)?) => {
        [$(&$a as *const _ as *mut ::std::ffi::c_void),*]
    };
}
pub(crate) use args;

/// Blocks of `threads` covering `n` items.
pub(crate) fn blocks(n: usize, threads: usize) -> u32 {
    n.div_ceil(threads) as u32
}
