//! Level 0 for Hopper (sm_90a only), the asynchronous copy units: TMA loads and reductions of
//! boxes described by host-made tensor maps ([`TensorMaps`]), the `mbarrier`s they complete on, the
//! bulk groups of reductions, the proxy fences between ordinary stores and the async proxy, and
//! the release/acquire counter with which blocks take turns at a reduction ([`wait_for_turn`],
//! [`pass_turn`]). The contracts table of [`super::warpgroup`] says who calls what.

use core::arch::asm;

/// The tensor maps (`CUtensorMap`, 128 bytes each) that the host put back to back in device
/// memory for one launch, in the order the kernel documents.
#[derive(Clone, Copy)]
pub struct TensorMaps(pub *const u8);

impl TensorMaps {
    /// The `i`-th map.
    #[inline(always)]
    pub fn get(self, i: usize) -> *const u8 {
        // SAFETY: address arithmetic only; the kernel's contract says how many maps there are.
        unsafe { self.0.add(128 * i) }
    }
}

/// Makes this thread's earlier ordinary stores to shared memory visible to the async proxy
/// (`wgmma` operands, TMA stores): `fence.proxy.async.shared::cta`. Each writing thread calls it
/// before the barrier that publishes the data.
#[inline(always)]
pub fn fence_proxy_async() {
    // SAFETY: a fence, no operands.
    unsafe { asm!("fence.proxy.async.shared::cta;", options(nostack)) };
}

/// Initialises the `mbarrier` at `barrier` (the shared-state-space address, see
/// [`shared_address`], of 8 bytes of shared memory, 8-byte aligned) to expect `arrivals`
/// arrivals per phase (`mbarrier.init`). One thread calls it. The `mbarrier` and TMA wrappers
/// all take such 32-bit addresses, which is what the instructions want.
///
/// # Safety
/// `barrier` is this block's shared memory, used by no one until a barrier after the init.
#[inline(always)]
pub unsafe fn mbarrier_init(barrier: u32, arrivals: u32) {
    // SAFETY: the caller's contract.
    unsafe {
        asm!("mbarrier.init.shared::cta.b64 [{b}], {n};", b = in(reg32) barrier, n = in(reg32) arrivals, options(nostack))
    };
}

/// Makes `mbarrier` initialisations visible to the async proxy (TMA), which will
/// complete transactions on them: `fence.mbarrier_init.release.cluster`. The initialising thread
/// calls it after [`mbarrier_init`].
#[inline(always)]
pub fn fence_mbarrier_init() {
    // SAFETY: a fence, no operands.
    unsafe { asm!("fence.mbarrier_init.release.cluster;", options(nostack)) };
}

/// Arrives on `barrier` and announces `bytes` more bytes of transactions for its current phase
/// (`mbarrier.arrive.expect_tx`): the phase completes when every arrival happened and that many
/// bytes were reported by the copies that name this barrier.
///
/// # Safety
/// `barrier` was initialised with [`mbarrier_init`].
#[inline(always)]
pub unsafe fn mbarrier_arrive_expect_tx(barrier: u32, bytes: u32) {
    // SAFETY: the caller's contract.
    unsafe {
        asm!(
            "mbarrier.arrive.expect_tx.shared::cta.b64 _, [{b}], {n};",
            b = in(reg32) barrier, n = in(reg32) bytes, options(nostack)
        )
    };
}

/// Waits until the phase of `barrier` with parity `phase` (0 for the first, 1 for the second,
/// alternating) has completed (`mbarrier.try_wait.parity`, retried). Afterwards the data that
/// phase's copies wrote is visible to this thread.
///
/// # Safety
/// `barrier` was initialised with [`mbarrier_init`].
#[inline(always)]
pub unsafe fn mbarrier_wait(barrier: u32, phase: u32) {
    let address = barrier;
    loop {
        let done: u32;
        // SAFETY: the caller's contract. `try_wait` may time out and return false; the loop
        // retries (a branch in Rust, so that no PTX label is repeated where this is inlined).
        unsafe {
            asm!(
                "{{",
                ".reg .pred p;",
                "mbarrier.try_wait.parity.shared::cta.b64 p, [{b}], {phase};",
                "selp.u32 {done}, 1, 0, p;",
                "}}",
                b = in(reg32) address, phase = in(reg32) phase, done = out(reg32) done, options(nostack)
            )
        };
        if done != 0 {
            return;
        }
    }
}

/// Arrives on `barrier` (`mbarrier.arrive`): one of the arrivals its phase expects. How
/// consumers tell the producer that a ring slot is free again.
///
/// # Safety
/// `barrier` was initialised with [`mbarrier_init`].
#[inline(always)]
pub unsafe fn mbarrier_arrive(barrier: u32) {
    // SAFETY: the caller's contract.
    unsafe { asm!("mbarrier.arrive.shared::cta.b64 _, [{b}];", b = in(reg32) barrier, options(nostack)) };
}

/// Asks for the tensor map at `tensor_map` to be brought into the cache TMA reads maps from
/// (`prefetch.tensormap`), so that a block's first copy does not wait for it. Only a hint: the
/// copies work without it.
///
/// # Safety
/// `tensor_map` points to a `CUtensorMap` in global memory.
#[inline(always)]
pub unsafe fn prefetch_tensor_map(tensor_map: *const u8) {
    // SAFETY: the caller's contract; a prefetch changes no memory.
    unsafe { asm!("prefetch.tensormap [{map}];", map = in(reg64) tensor_map as u64, options(nostack)) };
}

/// Asks TMA for the box at (`x`, `y`, `z`) (elements; x innermost) of the 3-D
/// tensor that `tensor_map` describes; otherwise as [`tma_load_2d`]. Attention tensors
/// `[batch, heads, seqlen, head_dim]` are 3-D maps of (head_dim, seqlen, batch · heads), so that
/// a box running past a head's last row reads zeros instead of the next head.
///
/// # Safety
/// As [`tma_load_2d`].
#[inline(always)]
pub unsafe fn tma_load_3d(destination: u32, tensor_map: *const u8, x: i32, y: i32, z: i32, barrier: u32) {
    // SAFETY: the caller's contract.
    unsafe {
        asm!(
            "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [{dst}], [{map}, {{{x}, {y}, {z}}}], [{bar}];",
            dst = in(reg32) destination,
            map = in(reg64) tensor_map as u64,
            x = in(reg32) x,
            y = in(reg32) y,
            z = in(reg32) z,
            bar = in(reg32) barrier,
            options(nostack)
        )
    };
}

/// Asks TMA to add the box at `source` (shared memory, laid out as [`tma_load_3d`]
/// would have written it) to the box at (`x`, `y`, `z`) of the 3-D tensor that `tensor_map`
/// describes, element by element in the map's type (`cp.reduce.async.bulk.tensor.3d…add`). The
/// additions are atomic per element; elements outside the tensor are skipped. The copy is
/// asynchronous, in a *bulk group* ([`bulk_commit_group`]): `source` may be overwritten only after
/// [`bulk_wait_group_read`].
///
/// # Safety
/// `tensor_map` points to a valid `CUtensorMap` in global memory whose box lies at `source`
/// (1024-byte aligned shared memory with the 128-byte swizzle); the box's shared memory was
/// written before a [`fence_proxy_async`] and a barrier that ordered it before this call. One
/// thread issues it.
#[inline(always)]
pub unsafe fn tma_reduce_add_3d(tensor_map: *const u8, x: i32, y: i32, z: i32, source: u32) {
    // SAFETY: the caller's contract.
    unsafe {
        asm!(
            "cp.reduce.async.bulk.tensor.3d.global.shared::cta.add.tile.bulk_group [{map}, {{{x}, {y}, {z}}}], [{src}];",
            map = in(reg64) tensor_map as u64,
            x = in(reg32) x,
            y = in(reg32) y,
            z = in(reg32) z,
            src = in(reg32) source,
            options(nostack)
        )
    };
}

/// Closes the bulk group of the bulk copies this thread issued since the last commit
/// (`cp.async.bulk.commit_group`).
#[inline(always)]
pub fn bulk_commit_group() {
    // SAFETY: bookkeeping of this thread's own bulk copies only.
    unsafe { asm!("cp.async.bulk.commit_group;", options(nostack)) };
}

/// Waits until at most `PENDING` of this thread's committed bulk groups still read their shared
/// memory sources (`cp.async.bulk.wait_group.read`): their sources may then be overwritten.
#[inline(always)]
pub fn bulk_wait_group_read<const PENDING: u32>() {
    // SAFETY: waiting only.
    unsafe { asm!("cp.async.bulk.wait_group.read {n};", n = const PENDING, options(nostack)) };
}

/// Waits until at most `PENDING` of this thread's committed bulk groups are incomplete
/// (`cp.async.bulk.wait_group`): their writes to global memory are then done.
#[inline(always)]
pub fn bulk_wait_group<const PENDING: u32>() {
    // SAFETY: waiting only.
    unsafe { asm!("cp.async.bulk.wait_group {n};", n = const PENDING, options(nostack)) };
}

/// Orders this thread's accesses to global memory through the async proxy (TMA loads and
/// reductions) with its ordinary ones (`fence.proxy.async.global`): what one proxy did before
/// the fence is seen by what the other does after it.
#[inline(always)]
pub fn fence_proxy_async_global() {
    // SAFETY: a fence, no operands.
    unsafe { asm!("fence.proxy.async.global;", options(nostack)) };
}

/// Waits until the `u32` turn counter at `counter` (global memory) reaches `turn`, reading it
/// with acquire semantics at GPU scope (`ld.acquire.gpu`), then fences the async proxy: the
/// reductions that the blocks before this one completed (and announced with [`pass_turn`])
/// are then ordered before this thread's next TMA reduction. How the deterministic Hopper
/// backward adds dQ tiles in a fixed order (FlashAttention-3 takes turns the same way).
///
/// # Safety
/// `counter` (a generic address) points to a `u32` in global memory that only [`pass_turn`]
/// changes; whoever holds turns below `turn` runs (or ran) to its [`pass_turn`], so the wait
/// ends. One thread calls it.
#[inline(always)]
pub unsafe fn wait_for_turn(counter: *const u32, turn: u32) {
    loop {
        let seen: u32;
        // SAFETY: the caller's contract.
        unsafe {
            asm!("ld.acquire.gpu.u32 {v}, [{p}];", v = out(reg32) seen, p = in(reg64) counter as u64,
                options(nostack))
        };
        if seen >= turn {
            break;
        }
    }
    fence_proxy_async_global();
}

/// Ends this thread's turn at `counter` ([`wait_for_turn`]): waits until its bulk reductions are
/// complete ([`bulk_wait_group`]), fences the async proxy, and adds 1 to the counter with release
/// semantics at GPU scope (`red.release.gpu`), so that the next in turn sees the sums.
///
/// # Safety
/// As [`wait_for_turn`]; this thread holds the turn. One thread calls it.
#[inline(always)]
pub unsafe fn pass_turn(counter: *mut u32) {
    bulk_wait_group::<0>();
    fence_proxy_async_global();
    // SAFETY: the caller's contract.
    unsafe { asm!("red.release.gpu.add.u32 [{p}], 1;", p = in(reg64) counter as u64, options(nostack)) };
}

/// Asks TMA for the box at (`x`, `y`) (elements; x is the innermost dimension) of
/// the 2-D tensor that `tensor_map` describes, written to `destination` (a shared-state-space
/// address) in the box's row-major order; elements outside the tensor are filled with zeros. Completion is
/// reported, in bytes, to `barrier` (`cp.async.bulk.tensor.2d…mbarrier::complete_tx::bytes`).
///
/// # Safety
/// `tensor_map` points to a valid `CUtensorMap` in global memory (64-byte aligned) whose box fits
/// at `destination` (128-byte aligned shared memory); `barrier` expects these bytes
/// ([`mbarrier_arrive_expect_tx`]). One thread issues it.
#[inline(always)]
pub unsafe fn tma_load_2d(destination: u32, tensor_map: *const u8, x: i32, y: i32, barrier: u32) {
    // SAFETY: the caller's contract.
    unsafe {
        asm!(
            "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [{dst}], [{map}, {{{x}, {y}}}], [{bar}];",
            dst = in(reg32) destination,
            map = in(reg64) tensor_map as u64,
            x = in(reg32) x,
            y = in(reg32) y,
            bar = in(reg32) barrier,
            options(nostack)
        )
    };
}
