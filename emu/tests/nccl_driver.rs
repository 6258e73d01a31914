//! The NCCL stand-in as the backend meets it: libpipewright_emu.so opened
//! at run time, the driver's and NCCL's entry points looked up by name,
//! called with the backend's patterns: a tensor-parallel stage's grouped
//! calls from one thread (ncclCommInitAll), pipeline ranks on two threads
//! sending on one stream and receiving on another (ncclCommInitRank), and
//! the checks against the driver's state (allocations, streams' GPUs), with
//! a mismatch failing both streams.

use std::ffi::{c_char, c_int, c_uint, c_void, CStr, CString};
use std::sync::OnceLock;

type Handle = *mut c_void;
const F32: c_int = 7;
const BF16: c_int = 9;
const SUM: c_int = 0;
const NON_BLOCKING: c_uint = 1;
const INVALID_ARGUMENT: c_int = 4;
const INVALID_USAGE: c_int = 5;
const CUDA_ERROR_LAUNCH_FAILED: u32 = 719;

#[repr(C)]
#[derive(Clone, Copy)]
struct UniqueId([c_char; 128]);

/// The entry points used here, bound from the shared object.
struct Lib {
    cu_init: unsafe extern "C" fn(c_uint) -> u32,
    cu_ctx_create: unsafe extern "C" fn(*mut Handle, c_uint, c_int) -> u32,
    cu_ctx_set_current: unsafe extern "C" fn(Handle) -> u32,
    cu_stream_create: unsafe extern "C" fn(*mut Handle, c_uint) -> u32,
    cu_stream_synchronize: unsafe extern "C" fn(Handle) -> u32,
    cu_mem_alloc: unsafe extern "C" fn(*mut u64, usize) -> u32,
    cu_memcpy_htod: unsafe extern "C" fn(u64, *const c_void, usize) -> u32,
    cu_memcpy_dtoh: unsafe extern "C" fn(*mut c_void, u64, usize) -> u32,
    cu_get_error_string: unsafe extern "C" fn(u32, *mut *const c_char) -> u32,
    get_unique_id: unsafe extern "C" fn(*mut UniqueId) -> c_int,
    comm_init_rank: unsafe extern "C" fn(*mut Handle, c_int, UniqueId, c_int) -> c_int,
    comm_init_all: unsafe extern "C" fn(*mut Handle, c_int, *const c_int) -> c_int,
    comm_destroy: unsafe extern "C" fn(Handle) -> c_int,
    all_reduce:
        unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, c_int, Handle, Handle) -> c_int,
    reduce:
        unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, c_int, c_int, Handle, Handle) -> c_int,
    broadcast: unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, c_int, Handle, Handle) -> c_int,
    all_gather: unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, Handle, Handle) -> c_int,
    send: unsafe extern "C" fn(*const c_void, usize, c_int, c_int, Handle, Handle) -> c_int,
    recv: unsafe extern "C" fn(*mut c_void, usize, c_int, c_int, Handle, Handle) -> c_int,
    group_start: unsafe extern "C" fn() -> c_int,
    group_end: unsafe extern "C" fn() -> c_int,
    get_error_string: unsafe extern "C" fn(c_int) -> *const c_char,
}

// SAFETY: plain function pointers into a library that stays loaded.
unsafe impl Sync for Lib {}

fn lib() -> &'static Lib {
    static LIB: OnceLock<Lib> = OnceLock::new();
    LIB.get_or_init(|| {
        // The emulator reads its machine once, at the first driver call.
        std::env::set_var("PW_EMU_GPUS", "4");
        let exe = std::env::current_exe().unwrap();
        let path = [exe.parent().unwrap(), exe.parent().unwrap().parent().unwrap()]
            .iter()
            .map(|d| d.join("libpipewright_emu.so"))
            .find(|p| p.exists())
            .expect("libpipewright_emu.so beside the test binary (cargo builds it with the rlib)");
        let cpath = CString::new(path.to_str().unwrap()).unwrap();
        // SAFETY: a shared object built from this crate; its initialisers have no preconditions.
        let handle = unsafe { libc::dlopen(cpath.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        assert!(!handle.is_null(), "dlopen {}", path.display());
        let sym = |name: &str| {
            let c = CString::new(name).unwrap();
            // SAFETY: a live handle and a C string.
            let p = unsafe { libc::dlsym(handle, c.as_ptr()) };
            assert!(!p.is_null(), "{} exports no {name} (is the driver built into it yet?)", path.display());
            p
        };
        macro_rules! bind {
            ($name:literal) => {{
                let p = sym($name);
                // SAFETY: a function pointer has a data pointer's size here; each
                // symbol is bound with the signature its header declares.
                unsafe { std::mem::transmute_copy(&p) }
            }};
        }
        Lib {
            cu_init: bind!("cuInit"),
            cu_ctx_create: bind!("cuCtxCreate_v2"),
            cu_ctx_set_current: bind!("cuCtxSetCurrent"),
            cu_stream_create: bind!("cuStreamCreate"),
            cu_stream_synchronize: bind!("cuStreamSynchronize"),
            cu_mem_alloc: bind!("cuMemAlloc_v2"),
            cu_memcpy_htod: bind!("cuMemcpyHtoD_v2"),
            cu_memcpy_dtoh: bind!("cuMemcpyDtoH_v2"),
            cu_get_error_string: bind!("cuGetErrorString"),
            get_unique_id: bind!("ncclGetUniqueId"),
            comm_init_rank: bind!("ncclCommInitRank"),
            comm_init_all: bind!("ncclCommInitAll"),
            comm_destroy: bind!("ncclCommDestroy"),
            all_reduce: bind!("ncclAllReduce"),
            reduce: bind!("ncclReduce"),
            broadcast: bind!("ncclBroadcast"),
            all_gather: bind!("ncclAllGather"),
            send: bind!("ncclSend"),
            recv: bind!("ncclRecv"),
            group_start: bind!("ncclGroupStart"),
            group_end: bind!("ncclGroupEnd"),
            get_error_string: bind!("ncclGetErrorString"),
        }
    })
}

fn nccl_error(rc: c_int) -> String {
    // SAFETY: NCCL's error strings are NUL-terminated and live on.
    unsafe { CStr::from_ptr((lib().get_error_string)(rc)) }.to_string_lossy().into_owned()
}

fn cu(rc: u32) -> Result<(), String> {
    if rc == 0 {
        return Ok(());
    }
    let mut s = std::ptr::null();
    // SAFETY: one out-parameter.
    unsafe { (lib().cu_get_error_string)(rc, &mut s) };
    let text =
        if s.is_null() { "?".into() } else { unsafe { CStr::from_ptr(s) }.to_string_lossy().into_owned() };
    Err(format!("CUresult {rc}: {text}"))
}

/// One GPU as the backend holds it: a context and a stream.
struct Gpu {
    ctx: Handle,
    stream: Handle,
}

impl Gpu {
    fn new(device: c_int) -> Gpu {
        let l = lib();
        let (mut ctx, mut stream) = (std::ptr::null_mut(), std::ptr::null_mut());
        // SAFETY: out-parameters of the right types.
        unsafe {
            cu((l.cu_init)(0)).unwrap();
            cu((l.cu_ctx_create)(&mut ctx, 0, device)).unwrap();
            cu((l.cu_ctx_set_current)(ctx)).unwrap();
            cu((l.cu_stream_create)(&mut stream, NON_BLOCKING)).unwrap();
        }
        Gpu { ctx, stream }
    }

    fn bind(&self) {
        // SAFETY: a live context.
        cu(unsafe { (lib().cu_ctx_set_current)(self.ctx) }).unwrap();
    }

    fn new_stream(&self) -> Handle {
        self.bind();
        let mut s = std::ptr::null_mut();
        // SAFETY: an out-parameter.
        cu(unsafe { (lib().cu_stream_create)(&mut s, NON_BLOCKING) }).unwrap();
        s
    }

    fn upload(&self, v: &[f32]) -> u64 {
        self.bind();
        let mut p = 0;
        // SAFETY: an out-parameter, then a copy of v's bytes into the new allocation.
        unsafe {
            cu((lib().cu_mem_alloc)(&mut p, v.len() * 4)).unwrap();
            cu((lib().cu_memcpy_htod)(p, v.as_ptr() as *const c_void, v.len() * 4)).unwrap();
        }
        p
    }

    fn sync(&self) -> Result<(), String> {
        // SAFETY: a live stream.
        cu(unsafe { (lib().cu_stream_synchronize)(self.stream) })
    }

    fn download(&self, p: u64, n: usize) -> Vec<u32> {
        self.sync().unwrap();
        self.bind();
        let mut v = vec![0f32; n];
        // SAFETY: n f32s of host memory from a live allocation of at least that many.
        cu(unsafe { (lib().cu_memcpy_dtoh)(v.as_mut_ptr() as *mut c_void, p, n * 4) }).unwrap();
        bits(&v)
    }
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn piece(r: usize, n: usize) -> Vec<f32> {
    (0..n).map(|i| (r * 1000 + i) as f32 * 0.25).collect()
}

fn init_all(n: usize) -> Vec<Handle> {
    let mut comms = vec![std::ptr::null_mut(); n];
    let devs: Vec<c_int> = (0..n as c_int).collect();
    // SAFETY: room for n handles; n ordinals.
    let rc = unsafe { (lib().comm_init_all)(comms.as_mut_ptr(), n as c_int, devs.as_ptr()) };
    assert_eq!(rc, 0, "{}", nccl_error(rc));
    comms
}

/// One collective over every rank's communicator, grouped, each rank's GPU current.
fn grouped(gpus: &[Gpu], call: impl Fn(usize) -> c_int) {
    let l = lib();
    // SAFETY: no arguments.
    assert_eq!(unsafe { (l.group_start)() }, 0);
    for (r, g) in gpus.iter().enumerate() {
        g.bind();
        let rc = call(r);
        assert_eq!(rc, 0, "rank {r}: {}", nccl_error(rc));
    }
    // SAFETY: closes the group.
    assert_eq!(unsafe { (l.group_end)() }, 0);
}

#[test]
fn a_tensor_parallel_stage_gathers_sums_and_broadcasts_from_one_thread() {
    let l = lib();
    let (n, count) = (3, 40);
    let gpus: Vec<Gpu> = (0..n as c_int).map(Gpu::new).collect();
    let comms = init_all(n);
    // Each rank's slot of its gathered buffer holds its piece; the rest is -0.0.
    let bufs: Vec<u64> = (0..n)
        .map(|r| {
            let full: Vec<f32> =
                (0..n).flat_map(|o| if o == r { piece(r, count) } else { vec![-0.0; count] }).collect();
            gpus[r].upload(&full)
        })
        .collect();
    // SAFETY (all calls below): live allocations of the rank's GPU, its stream.
    grouped(&gpus, |r| unsafe {
        let slot = (bufs[r] + (r * count * 4) as u64) as *const c_void;
        (l.all_gather)(slot, bufs[r] as *mut c_void, count, F32, comms[r], gpus[r].stream)
    });
    let all: Vec<f32> = (0..n).flat_map(|r| piece(r, count)).collect();
    for (r, g) in gpus.iter().enumerate() {
        assert_eq!(g.download(bufs[r], n * count), bits(&all), "gathered on rank {r}");
    }
    // Sums into rank 0 of values owned by one rank each (-0.0 elsewhere) are exact.
    let owned: Vec<u64> = (0..n)
        .map(|r| {
            gpus[r].upload(
                &(0..count).map(|i| if i % n == r { i as f32 + 0.1 } else { -0.0 }).collect::<Vec<_>>(),
            )
        })
        .collect();
    grouped(&gpus, |r| unsafe {
        let p = owned[r] as *mut c_void;
        (l.reduce)(p, p, count, F32, SUM, 0, comms[r], gpus[r].stream)
    });
    let expected: Vec<f32> = (0..count).map(|i| i as f32 + 0.1).collect();
    assert_eq!(gpus[0].download(owned[0], count), bits(&expected));
    // A bf16 broadcast of rank 0's first count × 2 bytes.
    grouped(&gpus, |r| unsafe {
        let p = bufs[r] as *mut c_void;
        (l.broadcast)(p, p, count, BF16, 0, comms[r], gpus[r].stream)
    });
    let head = gpus[0].download(bufs[0], count / 2);
    for (r, g) in gpus.iter().enumerate() {
        assert_eq!(g.download(bufs[r], count / 2), head, "broadcast on rank {r}");
    }
    for c in comms {
        // SAFETY: a live communicator.
        assert_eq!(unsafe { (l.comm_destroy)(c) }, 0);
    }
}

#[test]
fn pipeline_ranks_on_two_threads_send_on_one_stream_and_receive_on_another() {
    let l = lib();
    let mut id = UniqueId([0; 128]);
    // SAFETY: an out-parameter.
    assert_eq!(unsafe { (l.get_unique_id)(&mut id) }, 0);
    let count = 1000;
    let results: Vec<(Vec<u32>, Vec<u32>)> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..2usize)
            .map(|r| {
                s.spawn(move || {
                    let g = Gpu::new(r as c_int + 2);
                    let comm_stream = g.new_stream();
                    let mut comm = std::ptr::null_mut();
                    g.bind();
                    // SAFETY (all calls below): live handles and allocations of this GPU.
                    unsafe {
                        let rc = (l.comm_init_rank)(&mut comm, 2, id, r as c_int);
                        assert_eq!(rc, 0, "{}", nccl_error(rc));
                        let mine = g.upload(&piece(r, count));
                        let theirs = g.upload(&vec![0.0; count]);
                        let peer = 1 - r as c_int;
                        assert_eq!((l.send)(mine as *const c_void, count, F32, peer, comm, comm_stream), 0);
                        assert_eq!((l.recv)(theirs as *mut c_void, count, F32, peer, comm, g.stream), 0);
                        let got = g.download(theirs, count);
                        let p = mine as *mut c_void;
                        assert_eq!((l.all_reduce)(p, p, count, F32, SUM, comm, g.stream), 0);
                        let summed = g.download(mine, count);
                        cu((l.cu_stream_synchronize)(comm_stream)).unwrap();
                        assert_eq!((l.comm_destroy)(comm), 0);
                        (got, summed)
                    }
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let sum: Vec<f32> = (0..count).map(|i| piece(0, count)[i] + piece(1, count)[i]).collect();
    for (r, (got, summed)) in results.iter().enumerate() {
        assert_eq!(got, &bits(&piece(1 - r, count)), "received on rank {r}");
        assert_eq!(summed, &bits(&sum), "summed on rank {r}");
    }
}

#[test]
fn buffers_and_streams_of_another_gpu_are_refused_and_a_mismatch_fails_both_streams() {
    let l = lib();
    let gpus: Vec<Gpu> = (0..2).map(Gpu::new).collect();
    let comms = init_all(2);
    let on1 = gpus[1].upload(&[1.0; 8]) as *mut c_void;
    let on0 = gpus[0].upload(&[1.0; 8]) as *mut c_void;
    gpus[0].bind();
    // SAFETY (all calls below): the arguments are what is under test; the
    // stand-in checks them before touching anything.
    unsafe {
        let rc = (l.all_reduce)(on1, on1, 8, F32, SUM, comms[0], gpus[0].stream);
        assert_eq!(rc, INVALID_ARGUMENT);
        assert!(nccl_error(rc).contains("ncclAllReduce (rank 0 of 2 on GPU 0): sendbuff (32 bytes)"));
        let rc = (l.all_reduce)(on0, on0, 9, F32, SUM, comms[0], gpus[0].stream);
        assert_eq!(rc, INVALID_ARGUMENT, "one element past the allocation");
        let rc = (l.all_reduce)(on0, on0, 8, F32, SUM, comms[0], gpus[1].stream);
        assert_eq!(rc, INVALID_USAGE);
        assert!(nccl_error(rc).contains("belongs to GPU 1"), "{}", nccl_error(rc));
        // Rank 0 all-reduces, rank 1 broadcasts: both streams fail, naming both calls.
        assert_eq!((l.group_start)(), 0);
        assert_eq!((l.all_reduce)(on0, on0, 8, F32, SUM, comms[0], gpus[0].stream), 0);
        assert_eq!((l.broadcast)(on1, on1, 8, F32, 0, comms[1], gpus[1].stream), 0);
        assert_eq!((l.group_end)(), 0);
    }
    for g in &gpus {
        let e = g.sync().unwrap_err();
        assert!(e.starts_with(&format!("CUresult {CUDA_ERROR_LAUNCH_FAILED}")), "{e}");
        assert!(e.contains("rank 0: ncclAllReduce #1") && e.contains("rank 1: ncclBroadcast #1"), "{e}");
    }
}

#[test]
fn a_call_from_another_thread_while_a_group_holds_the_communicator_is_refused() {
    let l = lib();
    let gpus: Vec<Gpu> = (0..2).map(Gpu::new).collect();
    let comms = init_all(2);
    let buf = gpus[0].upload(&[1.0; 4]) as *mut c_void;
    gpus[0].bind();
    // SAFETY (all calls below): live handles and allocations of GPU 0.
    unsafe {
        assert_eq!((l.group_start)(), 0);
        assert_eq!((l.all_reduce)(buf, buf, 4, F32, SUM, comms[0], gpus[0].stream), 0);
    }
    let (comm, stream, ctx, addr) =
        (comms[0] as usize, gpus[0].stream as usize, gpus[0].ctx as usize, buf as usize);
    let (rc, msg) = std::thread::spawn(move || {
        // SAFETY: as above, from another thread with GPU 0 current.
        unsafe {
            cu((lib().cu_ctx_set_current)(ctx as Handle)).unwrap();
            let p = addr as *mut c_void;
            let rc = (lib().all_reduce)(p, p, 4, F32, SUM, comm as Handle, stream as Handle);
            (rc, nccl_error(rc))
        }
    })
    .join()
    .unwrap();
    assert_eq!(rc, INVALID_USAGE);
    assert!(msg.contains("open group holds calls of this communicator"), "{msg}");
    // SAFETY: closes the group; rank 1 joins the all-reduce so it completes.
    unsafe {
        assert_eq!((l.group_end)(), 0);
        gpus[1].bind();
        let other = gpus[1].upload(&[2.0; 4]) as *mut c_void;
        assert_eq!((l.all_reduce)(other, other, 4, F32, SUM, comms[1], gpus[1].stream), 0);
    }
    assert_eq!(gpus[0].download(buf as u64, 4), bits(&[3.0; 4]));
}

#[test]
fn one_thread_inits_every_rank_inside_a_group_without_blocking() {
    let l = lib();
    let gpus: Vec<Gpu> = (0..2).map(Gpu::new).collect();
    let mut id = UniqueId([0; 128]);
    let mut comms = [std::ptr::null_mut(); 2];
    // SAFETY (all calls below): out-parameters and live handles; each rank
    // with its GPU current, as ncclCommInitRank needs.
    unsafe {
        assert_eq!((l.get_unique_id)(&mut id), 0);
        assert_eq!((l.group_start)(), 0);
        for (r, g) in gpus.iter().enumerate() {
            g.bind();
            let rc = (l.comm_init_rank)(&mut comms[r], 2, id, r as c_int);
            assert_eq!(rc, 0, "{}", nccl_error(rc));
        }
        assert_eq!((l.group_end)(), 0);
    }
    let bufs: Vec<u64> = (0..2).map(|r| gpus[r].upload(&piece(r, 8))).collect();
    grouped(&gpus, |r| unsafe {
        let p = bufs[r] as *mut c_void;
        (l.all_reduce)(p, p, 8, F32, SUM, comms[r], gpus[r].stream)
    });
    let sum: Vec<f32> = (0..8).map(|i| piece(0, 8)[i] + piece(1, 8)[i]).collect();
    for (r, g) in gpus.iter().enumerate() {
        assert_eq!(g.download(bufs[r], 8), bits(&sum), "rank {r}");
    }
}
