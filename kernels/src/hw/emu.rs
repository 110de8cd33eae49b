//! The CPU emulator: the same kernel source, run on the host with a grid of real threads.
//!
//! Only built for the host (not for nvptx64). [`launch`] runs a kernel over a grid of
//! blocks: blocks run in parallel (rayon), and each block's threads run as real OS threads (scoped)
//! that share the block's dynamic shared memory, so barriers and warp shuffles behave as on the GPU.
//! The helpers of [`crate::hw`] route here on the host.
//!
//! What it checks, which a GPU would not tell you:
//!
//! * every shared-memory access through [`crate::hw::SharedTile`] stays inside the block's
//!   dynamic shared memory;
//! * a read of shared memory that another thread wrote after the last barrier both have passed
//!   (a block barrier, or a warp barrier when both threads are in one warp) is a *race*; a read
//!   of a word nobody has written is an *uninitialised read*;
//! * every barrier and every warp shuffle is reached by all the threads it waits for, from the
//!   same place in the source; a barrier that waits for threads which have already returned is
//!   reported as abandoned as soon as every thread that has not returned is there, and one that
//!   waits for a thread stuck elsewhere is reported after a timeout instead of hanging.
//!
//! Errors name the kernel, the block, the thread and (for memory) the offset in bytes.
//!
//! What it does not model: timing, memory coalescing, bank conflicts, the hardware's rounding of
//! `ex2.approx`/`lg2.approx` (the host uses `f32::exp2`/`log2`, which are more accurate), the
//! order of atomic additions, and global-memory bounds (host pointers are used as they are).

// Errors end an emulated launch and carry the strings that locate the bug; their size does not
// matter next to a launch's cost.
#![allow(clippy::result_large_err)]

use std::cell::{Cell, RefCell};
use std::fmt;
use std::panic::{AssertUnwindSafe, Location};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use half::f16;
use rayon::prelude::*;

/// Lanes in a warp.
const WARP_SIZE: usize = 32;

/// A kernel argument as the emulator passes it: what the GPU launch would pass by value.
#[derive(Clone, Copy, Debug)]
pub enum Arg {
    /// A pointer to `f32` data in host memory (a device buffer's emulated counterpart).
    Ptr(*mut f32),
    /// A pointer to 16-bit floats (f16 or bf16 bits) in host memory.
    Ptr16(*mut u16),
    /// A pointer to 32-bit integers (sequence lengths, page tables) in host memory.
    PtrU32(*mut u32),
    Usize(usize),
    Isize(isize),
    F32(f32),
}

/// Converts an [`Arg`] back into the kernel parameter's type; `None` for a type mismatch.
pub trait FromArg: Sized {
    fn from_arg(arg: &Arg) -> Option<Self>;
}

impl FromArg for *mut f32 {
    fn from_arg(arg: &Arg) -> Option<Self> {
        if let Arg::Ptr(p) = arg { Some(*p) } else { None }
    }
}

impl FromArg for *const f32 {
    fn from_arg(arg: &Arg) -> Option<Self> {
        if let Arg::Ptr(p) = arg { Some(*p as *const f32) } else { None }
    }
}

impl FromArg for *mut u16 {
    fn from_arg(arg: &Arg) -> Option<Self> {
        if let Arg::Ptr16(p) = arg { Some(*p) } else { None }
    }
}

impl FromArg for *const u16 {
    fn from_arg(arg: &Arg) -> Option<Self> {
        if let Arg::Ptr16(p) = arg { Some(*p as *const u16) } else { None }
    }
}

impl FromArg for *const u32 {
    fn from_arg(arg: &Arg) -> Option<Self> {
        if let Arg::PtrU32(p) = arg { Some(*p as *const u32) } else { None }
    }
}

impl FromArg for usize {
    fn from_arg(arg: &Arg) -> Option<Self> {
        if let Arg::Usize(x) = arg { Some(*x) } else { None }
    }
}

impl FromArg for isize {
    fn from_arg(arg: &Arg) -> Option<Self> {
        if let Arg::Isize(x) = arg { Some(*x) } else { None }
    }
}

impl FromArg for f32 {
    fn from_arg(arg: &Arg) -> Option<Self> {
        if let Arg::F32(x) = arg { Some(*x) } else { None }
    }
}

/// A kernel the emulator can run: the `kernel!` macro defines one, `emu_<name>`, next to every
/// kernel, and [`crate::kernels`] gathers them.
pub struct HostKernel {
    /// The kernel's name, the same as its PTX `.entry`.
    pub name: &'static str,
    /// Decodes the arguments and runs the kernel body for the calling (emulated) thread.
    pub run: fn(&[Arg]) -> Result<(), String>,
}

/// The shape of a launch: a grid of blocks of one-dimensional blocks of threads.
#[derive(Clone, Copy, Debug)]
pub struct Launch {
    /// Blocks along x, y and z.
    pub grid: (usize, usize, usize),
    /// Threads per block (a multiple of 32).
    pub block: usize,
    /// Bytes of dynamic shared memory per block.
    pub shared_bytes: usize,
    /// How long a thread waits at a barrier before the launch is declared stuck.
    pub barrier_timeout: Duration,
}

impl Launch {
    /// A launch with the default barrier timeout (30 s: far beyond any legitimate wait).
    pub fn new(grid: (usize, usize, usize), block: usize, shared_bytes: usize) -> Self {
        Self { grid, block, shared_bytes, barrier_timeout: Duration::from_secs(30) }
    }
}

/// What went wrong in an emulated launch, and where.
#[derive(Clone, Debug)]
pub struct EmuError {
    /// The kernel's name.
    pub kernel: String,
    /// The block (x, y, z), if the error is inside one.
    pub block: Option<(usize, usize, usize)>,
    /// The thread within the block.
    pub thread: Option<usize>,
    /// What happened.
    pub kind: EmuErrorKind,
}

/// The kinds of [`EmuError`].
#[derive(Clone, Debug, PartialEq)]
pub enum EmuErrorKind {
    /// No kernel of that name exists, or the arguments do not match its parameters.
    BadLaunch(String),
    /// A shared-memory access outside the block's dynamic shared memory, at `site` in the source.
    SharedOutOfBounds { offset: isize, bytes: usize, size: usize, site: String },
    /// A read (at `site`) of shared memory written by another thread with no barrier between.
    SharedRace { offset: usize, writer: usize, site: String },
    /// A read (at `site`) of shared memory that no thread has written yet.
    SharedUninitialised { offset: usize, site: String },
    /// Threads reached one barrier (or warp shuffle) from different places in the source.
    DivergentBarrier { here: String, other: String },
    /// Not every thread reached a barrier (or warp shuffle) within the timeout.
    BarrierTimeout { site: String, arrived: usize, expected: usize },
    /// Every thread that a barrier (or warp shuffle) waits for has arrived or returned, and some
    /// returned: the barrier can never complete. Found without waiting for the timeout.
    AbandonedBarrier { site: String, arrived: usize, expected: usize },
    /// The kernel trapped or panicked.
    Panic(String),
    /// A thread ended with `cp.async` copies it never waited for (`copies` of them): on the GPU
    /// they land whenever they land, perhaps on shared memory the kernel has reused meanwhile.
    UnwaitedCopies { copies: usize },
}

impl fmt::Display for EmuError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "emulated kernel `{}`", self.kernel)?;
        if let Some((x, y, z)) = self.block {
            write!(f, ", block ({x}, {y}, {z})")?;
        }
        if let Some(t) = self.thread {
            write!(f, ", thread {t}")?;
        }
        match &self.kind {
            EmuErrorKind::BadLaunch(why) => write!(f, ": {why}"),
            EmuErrorKind::SharedOutOfBounds { offset, bytes, size, site } => write!(
                f,
                ": shared-memory access of {bytes} bytes at offset {offset}, at {site}, is outside the block's {size} bytes"
            ),
            EmuErrorKind::SharedRace { offset, writer, site } => write!(
                f,
                ": race: the read at {site} of shared memory at offset {offset} sees a write by thread {writer} with no barrier in between"
            ),
            EmuErrorKind::SharedUninitialised { offset, site } => write!(
                f,
                ": the read at {site} of shared memory at offset {offset} finds no write by any thread yet \
                 (if another thread writes it, a barrier between that write and this read is probably missing)"
            ),
            EmuErrorKind::DivergentBarrier { here, other } => {
                write!(f, ": divergent barrier: reached at {here} while other threads wait at {other}")
            }
            EmuErrorKind::BarrierTimeout { site, arrived, expected } => write!(
                f,
                ": stuck at the barrier at {site}: {arrived} of {expected} threads arrived (the others wait at another barrier or never got here)"
            ),
            EmuErrorKind::AbandonedBarrier { site, arrived, expected } => write!(
                f,
                ": abandoned barrier at {site}: {arrived} of {expected} threads arrived, and the others have returned"
            ),
            EmuErrorKind::Panic(message) => write!(f, ": {message}"),
            EmuErrorKind::UnwaitedCopies { copies } => write!(
                f,
                ": the thread ended with {copies} asynchronous copies it never waited for (cp.async.wait_group)"
            ),
        }
    }
}

impl std::error::Error for EmuError {}

/// Runs `kernel` over the grid of `launch` with `args` (as the GPU launch would pass them).
/// Returns the first error any thread met; the kernel's writes up to that point stay in place.
///
/// # Safety
/// The pointers in `args` must be valid for everything the kernel reads and writes, as for a GPU
/// launch.
pub unsafe fn launch(kernel: &HostKernel, launch: Launch, args: &[Arg]) -> Result<(), EmuError> {
    let bad = |why: String| EmuError {
        kernel: kernel.name.to_string(),
        block: None,
        thread: None,
        kind: EmuErrorKind::BadLaunch(why),
    };
    if launch.block == 0 || !launch.block.is_multiple_of(WARP_SIZE) {
        return Err(bad(format!("{} threads per block: the emulator needs a multiple of 32", launch.block)));
    }
    let (gx, gy, gz) = launch.grid;
    let args = SendArgs(args);
    (0..gx * gy * gz).into_par_iter().try_for_each(|b| {
        let block = (b % gx, (b / gx) % gy, b / (gx * gy));
        run_block(kernel, launch, block, &args)
    })
}

/// Raw pointers are not `Send`; the launch's contract makes sharing them across threads sound.
struct SendArgs<'a>(&'a [Arg]);
unsafe impl Send for SendArgs<'_> {}
unsafe impl Sync for SendArgs<'_> {}

/// Runs one block: one OS thread per GPU thread.
fn run_block(
    kernel: &HostKernel,
    launch: Launch,
    block: (usize, usize, usize),
    args: &SendArgs,
) -> Result<(), EmuError> {
    let state = BlockState::new(kernel.name, launch, block);
    std::thread::scope(|scope| {
        // The threads are joined, not left to the scope: dropping a handle detaches its thread,
        // and glibc's `pthread_detach` can race with the thread's own exit, which then frees
        // its stack while the detach still reads the thread's descriptor on it (a SIGSEGV in
        // `pthread_detach`, seen under load in `tests/emulated.rs`).
        let mut handles = Vec::with_capacity(launch.block);
        for thread in 0..launch.block {
            let state = &state;
            // Named after the GPU thread it runs ("b<x>.<y>.<z>t<thread>"), so that a debugger's
            // thread list says which one it stopped in.
            let name = format!("b{}.{}.{}t{thread}", block.0, block.1, block.2);
            // 16 MiB of stack (reserved, not committed): a kernel body inlines all of its
            // helpers, and the tensor-core kernels hold copies of theirs (plain, with a score
            // modification, with sinks), so the default 2 MiB is too tight for some.
            let builder = std::thread::Builder::new().name(name).stack_size(16 << 20);
            let spawned = builder.spawn_scoped(scope, move || {
                let ctx = ThreadCtx {
                    thread,
                    block_epoch: Cell::new(0),
                    warp_epoch: Cell::new(0),
                    copies: RefCell::new(AsyncCopies::default()),
                    state,
                };
                CURRENT.with(|c| c.set(&ctx as *const ThreadCtx as *const ()));
                let result = std::panic::catch_unwind(AssertUnwindSafe(|| (kernel.run)(args.0)));
                CURRENT.with(|c| c.set(std::ptr::null()));
                let unwaited = ctx.copies.borrow().pending();
                match result {
                    Ok(Ok(())) if unwaited > 0 => state.fail(thread, EmuErrorKind::UnwaitedCopies { copies: unwaited }),
                    Ok(Ok(())) => {}
                    Ok(Err(why)) => state.fail(thread, EmuErrorKind::BadLaunch(why)),
                    Err(payload) if payload.is::<Abort>() => {}
                    Err(payload) => {
                        let message = payload
                            .downcast_ref::<String>()
                            .cloned()
                            .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
                            .unwrap_or_else(|| "the kernel panicked".into());
                        state.fail(thread, EmuErrorKind::Panic(message));
                    }
                }
                // A thread that has finished no longer takes part in barriers: let the others
                // find out (a barrier that still waits for it is then abandoned).
                state.finished(thread);
            });
            match spawned {
                Ok(handle) => handles.push(handle),
                Err(e) => {
                    state.fail(thread, EmuErrorKind::Panic(format!("could not start an OS thread: {e}")));
                    break;
                }
            }
        }
        for handle in handles {
            // Each thread catches its own panics (above), so a join has nothing to report.
            let _ = handle.join();
        }
    });
    match state.error.into_inner().unwrap() {
        Some(error) => Err(error),
        None => Ok(()),
    }
}

/// The panic payload with which emulated threads unwind once their block has failed.
struct Abort;

/// One block's shared state.
struct BlockState {
    kernel: &'static str,
    grid: (usize, usize, usize),
    block: (usize, usize, usize),
    /// The dynamic shared memory, 16-byte aligned.
    shared: Box<[u128]>,
    shared_bytes: usize,
    /// Per 4-byte word of shared memory: who wrote it last and when (see [`Writer`]).
    shadow: Box<[AtomicU64]>,
    barrier: Barrier,
    warps: Box<[Warp]>,
    timeout: Duration,
    aborted: AtomicBool,
    error: Mutex<Option<EmuError>>,
}

struct Warp {
    barrier: Barrier,
    lanes: [AtomicU32; WARP_SIZE],
    /// `EXCHANGE_WORDS` words per lane for [`warp_gather`].
    exchange: Box<[AtomicU64]>,
}

impl BlockState {
    fn new(kernel: &'static str, launch: Launch, block: (usize, usize, usize)) -> Self {
        let warps = launch.block / WARP_SIZE;
        Self {
            kernel,
            grid: launch.grid,
            block,
            shared: vec![0u128; launch.shared_bytes.div_ceil(16)].into_boxed_slice(),
            shared_bytes: launch.shared_bytes,
            shadow: (0..launch.shared_bytes.div_ceil(4)).map(|_| AtomicU64::new(0)).collect(),
            barrier: Barrier::new(launch.block),
            warps: (0..warps)
                .map(|_| Warp {
                    barrier: Barrier::new(WARP_SIZE),
                    lanes: std::array::from_fn(|_| AtomicU32::new(0)),
                    exchange: (0..WARP_SIZE * EXCHANGE_WORDS).map(|_| AtomicU64::new(0)).collect(),
                })
                .collect(),
            timeout: launch.barrier_timeout,
            aborted: AtomicBool::new(false),
            error: Mutex::new(None),
        }
    }

    /// Records the first error of the block and wakes every waiting thread so that they unwind.
    fn fail(&self, thread: usize, kind: EmuErrorKind) {
        let mut error = self.error.lock().unwrap();
        if error.is_none() {
            *error =
                Some(EmuError { kernel: self.kernel.to_string(), block: Some(self.block), thread: Some(thread), kind });
        }
        drop(error);
        self.aborted.store(true, Ordering::SeqCst);
        self.barrier.wake_all();
        for warp in self.warps.iter() {
            warp.barrier.wake_all();
        }
    }

    /// Fails and unwinds the calling thread.
    fn abort(&self, thread: usize, kind: EmuErrorKind) -> ! {
        self.fail(thread, kind);
        std::panic::resume_unwind(Box::new(Abort))
    }

    /// Counts `thread` out of its block's barrier and its warp's, and wakes their waiters.
    fn finished(&self, thread: usize) {
        self.barrier.leave();
        if let Some(warp) = self.warps.get(thread / WARP_SIZE) {
            warp.barrier.leave();
        }
    }
}

/// Who wrote a word of shared memory, packed into a `u64` (0: nobody yet): the writer thread,
/// the number of block barriers it had passed, and the number of warp barriers.
struct Writer {
    thread: usize,
    block_epoch: u64,
    warp_epoch: u64,
}

impl Writer {
    fn pack(&self) -> u64 {
        (self.thread as u64 + 1) | (self.block_epoch << 16) | (self.warp_epoch << 40)
    }

    fn unpack(word: u64) -> Option<Self> {
        (word != 0).then(|| Self {
            thread: (word & 0xffff) as usize - 1,
            block_epoch: (word >> 16) & 0xff_ffff,
            warp_epoch: word >> 40,
        })
    }
}

/// A barrier for `n` threads that reports where it was reached from, knows how many of them
/// have returned, and times out.
struct Barrier {
    n: usize,
    state: Mutex<BarrierState>,
    cv: Condvar,
}

struct BarrierState {
    arrived: usize,
    /// Threads of the group that have returned: they will never arrive.
    left: usize,
    generation: u64,
    site: Option<&'static Location<'static>>,
}

impl Barrier {
    fn new(n: usize) -> Self {
        Self {
            n,
            state: Mutex::new(BarrierState { arrived: 0, left: 0, generation: 0, site: None }),
            cv: Condvar::new(),
        }
    }

    fn wake_all(&self) {
        let _guard = self.state.lock().unwrap();
        self.cv.notify_all();
    }

    /// One thread of the group has returned; the waiters look again whether the barrier can
    /// still complete.
    fn leave(&self) {
        let mut state = self.state.lock().unwrap();
        state.left += 1;
        self.cv.notify_all();
    }

    /// Waits until all `n` threads have arrived from the same `site`.
    fn wait(&self, block: &BlockState, thread: usize, site: &'static Location<'static>) {
        let mut state = self.state.lock().unwrap();
        if block.aborted.load(Ordering::SeqCst) {
            drop(state);
            std::panic::resume_unwind(Box::new(Abort));
        }
        match state.site {
            Some(other) if other != site => {
                let kind = EmuErrorKind::DivergentBarrier { here: site.to_string(), other: other.to_string() };
                drop(state);
                block.abort(thread, kind);
            }
            _ => state.site = Some(site),
        }
        state.arrived += 1;
        if state.arrived == self.n {
            state.arrived = 0;
            state.site = None;
            state.generation += 1;
            self.cv.notify_all();
            return;
        }
        let generation = state.generation;
        let deadline = Instant::now() + block.timeout;
        while state.generation == generation {
            if block.aborted.load(Ordering::SeqCst) {
                drop(state);
                std::panic::resume_unwind(Box::new(Abort));
            }
            // Everyone else is here or gone: no one is left to complete the barrier. (Checked
            // here, not only at arrival, because the thread that returns may do so last.)
            if state.arrived + state.left >= self.n {
                let kind =
                    EmuErrorKind::AbandonedBarrier { site: site.to_string(), arrived: state.arrived, expected: self.n };
                drop(state);
                block.abort(thread, kind);
            }
            let now = Instant::now();
            if now >= deadline {
                let kind =
                    EmuErrorKind::BarrierTimeout { site: site.to_string(), arrived: state.arrived, expected: self.n };
                drop(state);
                block.abort(thread, kind);
            }
            state = self.cv.wait_timeout(state, deadline - now).unwrap().0;
        }
    }
}

/// The emulated thread running on this OS thread.
struct ThreadCtx<'a> {
    thread: usize,
    block_epoch: Cell<u64>,
    warp_epoch: Cell<u64>,
    /// The thread's `cp.async` copies not yet done.
    copies: RefCell<AsyncCopies>,
    state: &'a BlockState,
}

/// One `cp.async` not yet done: `bytes` bytes from `src` (or zeros, without `src`) to shared
/// address `dst`.
struct PendingCopy {
    dst: u32,
    src: Option<*const u8>,
    bytes: usize,
}

/// A thread's asynchronous copies: those since its last commit, and its committed groups, oldest
/// first. The emulator does a copy as late as the GPU may: when a wait lets no more groups stay
/// pending. A kernel that reads a tile before waiting for its group reads the old contents, and
/// one that ends with copies in flight is reported ([`EmuErrorKind::UnwaitedCopies`]).
#[derive(Default)]
struct AsyncCopies {
    open: Vec<PendingCopy>,
    groups: std::collections::VecDeque<Vec<PendingCopy>>,
}

impl AsyncCopies {
    fn pending(&self) -> usize {
        self.open.len() + self.groups.iter().map(Vec::len).sum::<usize>()
    }
}

thread_local! {
    static CURRENT: Cell<*const ()> = const { Cell::new(std::ptr::null()) };
}

fn with_ctx<R>(f: impl FnOnce(&ThreadCtx) -> R) -> R {
    let ptr = CURRENT.with(Cell::get);
    assert!(!ptr.is_null(), "a GPU helper was called outside an emulated kernel launch (use emu::launch)");
    // SAFETY: set by `run_block` for the lifetime of the kernel call on this thread.
    f(unsafe { &*(ptr as *const ThreadCtx) })
}

// ---------------------------------------------------------------------------------------------
// The helpers `gpu` calls on the host.
// ---------------------------------------------------------------------------------------------

pub(crate) fn thread_idx_x() -> usize {
    with_ctx(|c| c.thread)
}

pub(crate) fn block_idx() -> (usize, usize, usize) {
    with_ctx(|c| c.state.block)
}

pub(crate) fn opaque(x: u32) -> u32 {
    x
}

pub(crate) fn block_dim_x() -> usize {
    with_ctx(|c| c.state.barrier.n)
}

pub(crate) fn grid_dim_x() -> usize {
    with_ctx(|c| c.state.grid.0)
}

/// 2^x, flushing results below 2⁻¹²⁶ to 0 as the GPU's `ex2.approx.ftz` does.
pub(crate) fn exp2(x: f32) -> f32 {
    let y = x.exp2();
    if y < f32::MIN_POSITIVE { 0.0 } else { y }
}

pub(crate) fn log2(x: f32) -> f32 {
    x.log2()
}

pub(crate) fn reciprocal(x: f32) -> f32 {
    1.0 / x
}

pub(crate) fn fma(a: f32, b: f32, c: f32) -> f32 {
    a.mul_add(b, c)
}

pub(crate) fn trap() -> ! {
    std::panic::panic_any("the kernel executed `trap`".to_string())
}

#[track_caller]
pub(crate) fn sync_threads() {
    let site = Location::caller();
    with_ctx(|c| {
        c.state.barrier.wait(c.state, c.thread, site);
        c.block_epoch.set(c.block_epoch.get() + 1);
    })
}

#[track_caller]
pub(crate) fn sync_warp() {
    let site = Location::caller();
    with_ctx(|c| {
        c.state.warps[c.thread / WARP_SIZE].barrier.wait(c.state, c.thread, site);
        c.warp_epoch.set(c.warp_epoch.get() + 1);
    })
}

/// `shfl.sync.bfly` among the 32 lanes of the calling thread's warp: every lane posts its value,
/// waits for the others, reads its partner's, and waits again before the slots are reused.
#[track_caller]
pub(crate) fn shfl_xor(x: f32, lane_mask: u32) -> f32 {
    let site = Location::caller();
    with_ctx(|c| {
        let warp = &c.state.warps[c.thread / WARP_SIZE];
        let lane = c.thread % WARP_SIZE;
        warp.lanes[lane].store(x.to_bits(), Ordering::Relaxed);
        warp.barrier.wait(c.state, c.thread, site);
        let y = f32::from_bits(warp.lanes[(lane ^ lane_mask as usize) % WARP_SIZE].load(Ordering::Relaxed));
        warp.barrier.wait(c.state, c.thread, site);
        y
    })
}

/// `vote.sync.any` among the 32 lanes of the calling thread's warp.
#[track_caller]
pub(crate) fn warp_any(predicate: bool) -> bool {
    warp_gather([predicate as u64]).iter().any(|&[p]| p != 0)
}

pub(crate) fn dynamic_shared_memory() -> *mut f32 {
    with_ctx(|c| c.state.shared.as_ptr() as *mut f32)
}

/// Checks an access of `words` 4-byte words of shared memory at `ptr` (bounds, and for reads,
/// races and uninitialised data), and records writes. `site` is where the access is in the source.
#[track_caller]
pub(crate) fn check_shared(ptr: *const f32, words: usize, write: bool) {
    let site = Location::caller().to_string();
    with_ctx(|c| {
        let state = c.state;
        let offset = ptr as isize - state.shared.as_ptr() as isize;
        let bytes = words * 4;
        if offset < 0 || offset as usize + bytes > state.shared_bytes {
            state.abort(c.thread, EmuErrorKind::SharedOutOfBounds { offset, bytes, size: state.shared_bytes, site });
        }
        let first = offset as usize / 4;
        let me = Writer { thread: c.thread, block_epoch: c.block_epoch.get(), warp_epoch: c.warp_epoch.get() };
        for (i, slot) in state.shadow[first..first + words].iter().enumerate() {
            if write {
                slot.store(me.pack(), Ordering::Relaxed);
                continue;
            }
            let offset = (first + i) * 4;
            let Some(writer) = Writer::unpack(slot.load(Ordering::Relaxed)) else {
                state.abort(c.thread, EmuErrorKind::SharedUninitialised { offset, site });
            };
            let ordered = writer.thread == c.thread
                || writer.block_epoch < me.block_epoch
                || (writer.thread / WARP_SIZE == c.thread / WARP_SIZE && writer.warp_epoch < me.warp_epoch);
            if !ordered {
                state.abort(c.thread, EmuErrorKind::SharedRace { offset, writer: writer.thread, site });
            }
        }
    })
}

// ---------------------------------------------------------------------------------------------
// Tensor cores and asynchronous copies
// ---------------------------------------------------------------------------------------------

/// 64-bit words per lane in a warp's exchange area (enough for one `mma`'s ten registers).
const EXCHANGE_WORDS: usize = 16;

/// Every lane of the calling thread's warp posts `values`; each receives what all 32 posted
/// (indexed by lane). The collective step that `ldmatrix` and `mma` are built on.
#[track_caller]
fn warp_gather<const N: usize>(values: [u64; N]) -> [[u64; N]; WARP_SIZE] {
    const { assert!(N <= EXCHANGE_WORDS) };
    let site = Location::caller();
    with_ctx(|c| {
        let warp = &c.state.warps[c.thread / WARP_SIZE];
        let lane = c.thread % WARP_SIZE;
        for (i, &v) in values.iter().enumerate() {
            warp.exchange[lane * EXCHANGE_WORDS + i].store(v, Ordering::Relaxed);
        }
        warp.barrier.wait(c.state, c.thread, site);
        let all = std::array::from_fn(|l| {
            std::array::from_fn(|i| warp.exchange[l * EXCHANGE_WORDS + i].load(Ordering::Relaxed))
        });
        warp.barrier.wait(c.state, c.thread, site);
        all
    })
}

/// The offset of `ptr` in the block's shared memory: the emulated shared-state-space address.
pub(crate) fn shared_address<T>(ptr: *const T) -> u32 {
    with_ctx(|c| (ptr as usize - c.state.shared.as_ptr() as usize) as u32)
}

/// The pointer to shared-state-space address `address`.
fn shared_pointer(address: u32) -> *mut u8 {
    with_ctx(|c| (c.state.shared.as_ptr() as *mut u8).wrapping_add(address as usize))
}

/// Reads the 16-bit element at `ptr` of shared memory, checked as a read of its 4-byte word.
#[track_caller]
fn read_shared_u16(ptr: *const u16) -> u16 {
    check_shared((ptr as usize & !3) as *const f32, 1, false);
    // SAFETY: checked to lie inside the block's shared memory.
    unsafe { *ptr }
}

/// `ldmatrix.sync.aligned.m8n8.x4[.trans].shared.b16`: lane `8i + r` names row `r` of matrix `i`;
/// every lane receives its `(lane / 4, 2·(lane % 4))` pair of each matrix, or with `TRANS` the
/// pair `(2·(lane % 4), lane / 4)`, `(2·(lane % 4) + 1, lane / 4)`.
///
/// # Safety
/// Each lane's `address` is the start of 8 elements of the block's shared memory.
#[track_caller]
pub(crate) unsafe fn ldmatrix_x4<const TRANS: bool>(address: u32) -> [u32; 4] {
    let rows = warp_gather([shared_pointer(address) as u64]).map(|[address]| address as *const u16);
    let lane = thread_idx_x() % WARP_SIZE;
    let (g, t) = (lane / 4, lane % 4);
    std::array::from_fn(|i| {
        // SAFETY (both arms): offsets below 8 stay inside the named row.
        let (lo, hi) = if TRANS {
            unsafe { (read_shared_u16(rows[8 * i + 2 * t].add(g)), read_shared_u16(rows[8 * i + 2 * t + 1].add(g))) }
        } else {
            unsafe { (read_shared_u16(rows[8 * i + g].add(2 * t)), read_shared_u16(rows[8 * i + g].add(2 * t + 1))) }
        };
        lo as u32 | (hi as u32) << 16
    })
}

/// `mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16}`: gathers the warp's fragments into whole
/// matrices, multiplies in `f32` (products of 16-bit values are exact in `f32`), and returns this
/// lane's share of D. The layouts are those tabled in `gpu`.
#[track_caller]
pub(crate) fn mma_m16n8k16<const BF16: bool>(a: [u32; 4], b: [u32; 2], c: [f32; 4]) -> [f32; 4] {
    let mine = [a[0], a[1], a[2], a[3], b[0], b[1], c[0].to_bits(), c[1].to_bits(), c[2].to_bits(), c[3].to_bits()];
    let all = warp_gather(mine.map(u64::from));
    let widen = |x: u64| {
        let x = x as u32;
        if BF16 { (f32::from_bits(x << 16), f32::from_bits(x & 0xffff_0000)) } else { unpack_f16x2(x) }
    };
    let (mut am, mut bm, mut cm) = ([[0f32; 16]; 16], [[0f32; 8]; 16], [[0f32; 8]; 16]);
    for (lane, regs) in all.iter().enumerate() {
        let (g, t) = (lane / 4, lane % 4);
        for (i, (row, col)) in [(g, 2 * t), (g + 8, 2 * t), (g, 2 * t + 8), (g + 8, 2 * t + 8)].into_iter().enumerate()
        {
            (am[row][col], am[row][col + 1]) = widen(regs[i]);
        }
        for (i, k) in [2 * t, 2 * t + 8].into_iter().enumerate() {
            (bm[k][g], bm[k + 1][g]) = widen(regs[4 + i]);
        }
        for (i, (row, col)) in [(g, 2 * t), (g, 2 * t + 1), (g + 8, 2 * t), (g + 8, 2 * t + 1)].into_iter().enumerate()
        {
            cm[row][col] = f32::from_bits(regs[6 + i] as u32);
        }
    }
    let lane = thread_idx_x() % WARP_SIZE;
    let (g, t) = (lane / 4, lane % 4);
    [(g, 2 * t), (g, 2 * t + 1), (g + 8, 2 * t), (g + 8, 2 * t + 1)]
        .map(|(row, col)| (0..16).fold(cm[row][col], |acc, k| am[row][k].mul_add(bm[k][col], acc)))
}

/// `movmatrix.sync.aligned.m8n8.trans.b16`: every lane holds the `(lane / 4, 2·(lane % 4))` pair
/// of an 8×8 matrix and receives the same pair of its transpose.
#[track_caller]
pub(crate) fn movmatrix_trans(x: u32) -> u32 {
    let all = warp_gather([x as u64]);
    let element = |row: usize, col: usize| (all[4 * row + col / 2][0] as u32 >> (16 * (col % 2))) & 0xffff;
    let lane = thread_idx_x() % WARP_SIZE;
    let (g, t) = (lane / 4, lane % 4);
    element(2 * t, g) | element(2 * t + 1, g) << 16
}

pub(crate) fn pack_f16x2(lo: f32, hi: f32) -> u32 {
    (f16::from_f32(lo).to_bits() as u32) | (f16::from_f32(hi).to_bits() as u32) << 16
}

pub(crate) fn unpack_f16x2(x: u32) -> (f32, f32) {
    (f16::from_bits(x as u16).to_f32(), f16::from_bits((x >> 16) as u16).to_f32())
}

/// f32 → bfloat16 bits, rounding to nearest, ties to even (NaN stays NaN).
fn to_bf16(x: f32) -> u32 {
    if x.is_nan() {
        return 0x7fc0;
    }
    let bits = x.to_bits();
    (bits + 0x7fff + ((bits >> 16) & 1)) >> 16
}

pub(crate) fn pack_bf16x2(lo: f32, hi: f32) -> u32 {
    to_bf16(lo) | to_bf16(hi) << 16
}

/// `cp.async` of 16 bytes, queued in the thread's open copy group (see [`AsyncCopies`]).
///
/// # Safety
/// `src` is 16 readable bytes when `valid`, until the copy is waited for; `dst` 16 writable
/// bytes of shared memory (checked by the caller).
pub(crate) unsafe fn cp_async_16(dst: u32, src: *const u16, valid: bool) {
    queue_copy(PendingCopy { dst, src: valid.then_some(src as *const u8), bytes: 16 });
}

/// `cp.async` of 4 bytes, queued.
///
/// # Safety
/// As [`cp_async_16`], for 4 bytes.
pub(crate) unsafe fn cp_async_4(dst: u32, src: *const f32, valid: bool) {
    queue_copy(PendingCopy { dst, src: valid.then_some(src as *const u8), bytes: 4 });
}

fn queue_copy(copy: PendingCopy) {
    with_ctx(|c| c.copies.borrow_mut().open.push(copy));
}

/// `cp.async.commit_group`: the copies since the last commit become a group (perhaps empty).
pub(crate) fn cp_async_commit() {
    with_ctx(|c| {
        let mut copies = c.copies.borrow_mut();
        let group = std::mem::take(&mut copies.open);
        copies.groups.push_back(group);
    })
}

/// `cp.async.wait_group PENDING`: does the thread's oldest groups until at most `PENDING` stay
/// pending, and records their bytes as the thread's writes from now (so a reader in another
/// thread needs a barrier after this wait, as on the GPU).
#[track_caller]
pub(crate) fn cp_async_wait<const PENDING: usize>() {
    let done: Vec<PendingCopy> = with_ctx(|c| {
        let mut copies = c.copies.borrow_mut();
        let keep = copies.groups.len().min(PENDING);
        let finished = copies.groups.len() - keep;
        copies.groups.drain(..finished).flatten().collect()
    });
    for copy in done {
        let dst = shared_pointer(copy.dst);
        check_shared(dst as *const f32, copy.bytes / 4, true);
        // SAFETY: the contract of `cp_async_16` / `cp_async_4`, which queued the copy.
        unsafe {
            match copy.src {
                Some(src) => std::ptr::copy_nonoverlapping(src, dst, copy.bytes),
                None => std::ptr::write_bytes(dst, 0, copy.bytes),
            }
        }
    }
}

/// `*ptr += value` atomically (the emulated `red.add.f32`).
///
/// # Safety
/// `ptr` points to a live, 4-byte aligned `f32`.
pub(crate) unsafe fn atomic_fetch_add_u32(ptr: *mut u32, value: u32) -> u32 {
    // SAFETY: the caller's contract; u32 and AtomicU32 have the same size and alignment.
    unsafe { &*(ptr as *const AtomicU32) }.fetch_add(value, Ordering::Relaxed)
}

pub(crate) unsafe fn atomic_add(ptr: *mut f32, value: f32) {
    // SAFETY: f32 and AtomicU32 have the same size and alignment.
    let word = unsafe { &*(ptr as *const AtomicU32) };
    let mut current = word.load(Ordering::Relaxed);
    loop {
        let new = (f32::from_bits(current) + value).to_bits();
        match word.compare_exchange_weak(current, new, Ordering::Relaxed, Ordering::Relaxed) {
            Ok(_) => return,
            Err(seen) => current = seen,
        }
    }
}

/// Kernels with planted bugs, for testing that the emulator reports them. Host-only: they are
/// never part of the PTX. Each takes one pointer to 64 writable floats and runs as one block of
/// 64 threads with 256 bytes of shared memory (that is their `# Safety` contract).
#[allow(clippy::missing_safety_doc)]
pub mod selftest {
    use crate::hw::{self, SharedMemory};

    kernel! {
        /// Every thread writes its own shared-memory word, then reads its neighbour's, but the
        /// barrier between the two is missing: the emulator reports a race (or, if the neighbour
        /// has not written yet, an uninitialised read).
        pub unsafe fn missing_barrier(out: *mut f32) {
            let t = hw::thread_idx_x();
            let tile = SharedMemory::new().tile(1, hw::block_dim_x());
            tile.store(0, t, t as f32);
            // hw::sync_threads() belongs here.
            let neighbour = tile.load(0, (t + 1) % hw::block_dim_x());
            unsafe { *out.add(t) = neighbour };
        }
    }

    kernel! {
        /// The same with the barrier in place: the emulator must accept it.
        pub unsafe fn with_barrier(out: *mut f32) {
            let t = hw::thread_idx_x();
            let tile = SharedMemory::new().tile(1, hw::block_dim_x());
            tile.store(0, t, t as f32);
            hw::sync_threads();
            let neighbour = tile.load(0, (t + 1) % hw::block_dim_x());
            unsafe { *out.add(t) = neighbour };
        }
    }

    kernel! {
        /// Half the threads wait at one barrier and half at another: divergent barriers. (The two
        /// branches are the same code on purpose: what differs is where the barrier is.)
        #[allow(clippy::if_same_then_else)]
        pub unsafe fn divergent_barrier(out: *mut f32) {
            let t = hw::thread_idx_x();
            if t < hw::block_dim_x() / 2 {
                hw::sync_threads();
            } else {
                hw::sync_threads();
            }
            unsafe { *out.add(t) = 1.0 };
        }
    }

    kernel! {
        /// Thread 0 returns before the barrier the others wait at.
        pub unsafe fn early_return(out: *mut f32) {
            let t = hw::thread_idx_x();
            if t == 0 {
                return;
            }
            hw::sync_threads();
            unsafe { *out.add(t) = 1.0 };
        }
    }

    kernel! {
        /// Reads one word past the end of the block's dynamic shared memory.
        pub unsafe fn out_of_bounds(out: *mut f32) {
            let t = hw::thread_idx_x();
            let tile = SharedMemory::new().tile(1, hw::block_dim_x());
            tile.store(0, t, 1.0);
            hw::sync_threads();
            unsafe { *out.add(t) = tile.load(0, t + 1) };
        }
    }
}
