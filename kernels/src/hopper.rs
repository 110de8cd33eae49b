//! Level 7 (sm_90a only): Hopper's asynchronous building blocks, as small documented wrappers over
//! PTX, and three probe kernels that check them against the CPU.
//!
//! Hopper adds three things that the `mma.sync` kernels of levels 5 and 6 do not use:
//!
//! * **`wgmma`**: a *warpgroup* (4 consecutive warps, the first one's index a multiple of 4)
//!   multiplies a 64 × K tile of A by a K × N tile of B and accumulates into 64 × N `f32` values
//!   spread over its 128 threads' registers. A and B are read straight from shared memory,
//!   described by 64-bit *matrix descriptors* ([`matrix_descriptor`]), so no thread loads
//!   fragments. The instruction is asynchronous: it is issued, then committed in a group, and its
//!   results may only be read after waiting for the group.
//! * **TMA** (the tensor memory accelerator): one thread asks it for a whole 2-D box
//!   of a tensor (`cp.async.bulk.tensor`), described by a *tensor map* the host made
//!   (`cuTensorMapEncodeTiled`). The engine writes shared memory and reports the bytes it wrote to
//!   an `mbarrier`.
//! * **`mbarrier`**: a barrier object in shared memory that counts arrivals *and* transaction
//!   bytes; threads wait on one of its phases (parity). It is how copies and consumers meet
//!   without `__syncthreads`.
//!
//! ## Contracts (who calls what, and what it orders)
//!
//! | wrapper | called by | orders |
//! |---|---|---|
//! | [`Accumulator::pin`] | every thread, on the accumulators of the `wgmma`s about to be issued, and after a wait on those just finished | the compiler's register accesses: none moves across it |
//! | [`wgmma_fence`] | every thread of the warpgroup, before the first `wgmma` of a batch | earlier register writes to the accumulators (and A in registers) before the `wgmma`s read them |
//! | [`Accumulator::mma`], [`Accumulator::mma_register_a`], [`Accumulator::mma_mn_major`] | every thread of the warpgroup, same operands | nothing: it only issues |
//! | [`wgmma_commit`] | every thread of the warpgroup | closes the group of `wgmma`s issued since the last commit |
//! | [`wgmma_wait`] | every thread of the warpgroup | returns when at most `N` committed groups are pending; then their accumulators may be read, and their shared memory overwritten |
//! | [`fence_proxy_async`] | each thread that wrote shared memory with ordinary stores, before the barrier that publishes it | those stores before reads by `wgmma` or TMA (the *async proxy*) |
//! | [`mbarrier_init`] | one thread, then a barrier (and [`fence_mbarrier_init`]) before anyone uses it | the barrier's initial state before every use |
//! | [`mbarrier_arrive_expect_tx`] | the thread that issues the copies of a phase | announces the bytes that phase must receive; counts as one arrival |
//! | [`tma_load_2d`] | one thread | nothing by itself: completion is the `mbarrier`'s phase flipping |
//! | [`tma_load_3d`] | one thread | as [`tma_load_2d`] |
//! | [`tma_reduce_add_3d`] | one thread, after the writers' [`fence_proxy_async`] and a barrier | nothing by itself: [`bulk_commit_group`] closes its group, [`bulk_wait_group_read`] frees its source, [`bulk_wait_group`] completes it |
//! | [`mbarrier_wait`] | every consumer | returns once the phase of the given parity completed: the copy's bytes are visible to the waiting thread |
//! | [`mbarrier_arrive`] | each consumer thread, once per phase, after its last read of the slot | counts one arrival: the producer waiting on the phase may overwrite the slot |
//! | [`named_barrier_sync`] | every thread of the part of the block named by the thread count | a `__syncthreads` for that part only (the producer warpgroup never waits on it) |
//! | [`named_barrier_arrive`] | threads that signal a named barrier others wait on | their earlier work before the waiters continue (one-way: the consumers' ping-pong turns) |
//! | [`registers_decrease`], [`registers_increase`] | every thread of the warpgroup, once, first thing | moves registers from the producer warpgroup to the consumers |
//!
//! The wrappers are only compiled for nvptx64: the CPU emulator does not model asynchronous
//! copies or warpgroup matrix units, so the kernels here are tested on Hopper GPUs only
//! (`tests/gpu_hopper.rs`). Their PTX is built with `llc -mcpu=sm_90a` into a module of its own,
//! which the host loads only on compute capability 9.0.

use core::arch::asm;

use crate::gpu::{self, FragA, FragC, HalfFloat};

/// Threads in a warpgroup: the unit that issues `wgmma`.
pub const WARPGROUP_THREADS: usize = 128;

/// Bytes of one *core matrix* row: 8 16-bit elements. `wgmma` reads shared memory in core
/// matrices of 8 rows × 16 bytes, stored as 128 contiguous bytes.
pub const CORE_MATRIX_ROW_BYTES: usize = 16;

/// Bytes of one core matrix (8 rows of 16 bytes).
pub const CORE_MATRIX_BYTES: usize = 8 * CORE_MATRIX_ROW_BYTES;

/// The shared-state-space (32-bit) address of a pointer into the block's shared memory.
pub use crate::gpu::shared_address;

/// A `wgmma` matrix descriptor for an operand in shared memory without swizzling (PTX ISA,
/// "Matrix Descriptor Format"): bits 0–13 the start address, 16–29 the *leading dimension byte
/// offset* (between core matrices adjacent along K), 32–45 the *stride dimension byte offset*
/// (between core matrices adjacent along M or N), each stored divided by 16; bits 62–63 the
/// swizzle mode, 0 here. Addresses and offsets must be multiples of 16 bytes.
#[inline(always)]
pub fn matrix_descriptor(shared_address: u32, leading_byte_offset: u32, stride_byte_offset: u32) -> u64 {
    let field = |bytes: u32| (bytes as u64 >> 4) & 0x3fff;
    field(shared_address) | field(leading_byte_offset) << 16 | field(stride_byte_offset) << 32
}

/// A `wgmma` matrix descriptor for an operand stored with the *128-byte swizzle* that TMA writes
/// with `CU_TENSOR_MAP_SWIZZLE_128B` (PTX ISA, "Shared Memory Matrix Layout"): rows of 128 bytes
/// (64 16-bit values) in *atoms* of 8 rows (1024 bytes, 1024-byte aligned), where the 16-byte
/// chunk `c` of row `r` is stored at chunk `c ^ (r % 8)`, so that the 8 rows of a column of core
/// matrices fall in different shared-memory banks. Bits 62–63 = 1 select this mode.
///
/// * K-major operand (Q and K in S = Q·Kᵀ): `stride_byte_offset` = 1024 steps 8 rows; the
///   leading offset is unused (one atom spans 64 values of K). Stepping 16 values along K
///   inside the atom adds 32 bytes to the start address: the hardware applies the XOR to the
///   address it computes, as TMA did when it wrote.
/// * MN-major operand (V in O += P·V): `stride_byte_offset` = 1024 steps 8 rows of K, and
///   `leading_byte_offset` steps 64 values along N (to the next atom column).
#[inline(always)]
pub fn swizzled_descriptor(shared_address: u32, leading_byte_offset: u32, stride_byte_offset: u32) -> u64 {
    matrix_descriptor(shared_address, leading_byte_offset, stride_byte_offset) | 1 << 62
}

/// `descriptor` with its start address moved `bytes` further (a multiple of 16 that keeps the
/// address inside shared memory, so the 14-bit field cannot carry into the next). Only the low
/// 32 bits change: a single 32-bit add per `wgmma`, where rebuilding the descriptor from an
/// address costs ptxas a handful of 64-bit instructions.
///
/// The add is written in PTX: as Rust arithmetic, LLVM proves that the low word cannot carry
/// and turns the whole thing back into a 64-bit add, which ptxas does in two instructions plus
/// moves before every `wgmma`.
#[inline(always)]
pub fn advance_descriptor(descriptor: u64, bytes: u32) -> u64 {
    let mut low = descriptor as u32;
    // SAFETY: arithmetic on registers only.
    unsafe {
        asm!("add.u32 {l}, {l}, {b};", l = inout(reg32) low, b = in(reg32) bytes >> 4, options(pure, nomem, nostack))
    };
    (descriptor & !0xffff_ffff) | low as u64
}

/// The descriptor of a *K-major* operand in a tile written by TMA with the 128-byte swizzle (see
/// [`swizzled_descriptor`]), at `address`: rows of 128 bytes, groups of 8 rows one atom apart;
/// the leading offset is unused (given as 16 bytes).
#[inline(always)]
pub fn k_major_descriptor(address: u32) -> u64 {
    swizzled_descriptor(address, 16, SWIZZLE_ATOM_BYTES as u32)
}

/// The descriptor of an *MN-major* operand in such a tile, at `address`, whose column blocks (64
/// values of N each) are `rows` rows apart: groups of 8 rows (along K) one atom apart.
#[inline(always)]
pub fn mn_major_descriptor(address: u32, rows: usize) -> u64 {
    swizzled_descriptor(address, (rows * SWIZZLE_ROW_BYTES) as u32, SWIZZLE_ATOM_BYTES as u32)
}

/// The ring slot of the `use_index`-th tile that goes round a ring of `stages` slots, and the
/// parity of that use of the slot (0, 1, 0, …): the phase of the slot's `mbarrier`s to wait for.
#[inline(always)]
pub fn ring_slot(use_index: usize, stages: usize) -> (usize, u32) {
    (use_index % stages, ((use_index / stages) % 2) as u32)
}

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

/// Bytes of one row of a 128-byte swizzled tile, and of the swizzle span.
pub const SWIZZLE_ROW_BYTES: usize = 128;

/// Bytes of one 128-byte swizzle atom: 8 rows.
pub const SWIZZLE_ATOM_BYTES: usize = 8 * SWIZZLE_ROW_BYTES;

/// The PTX operand list `{d0, d1, …}` of an accumulator of `$tiles` fragments (8 or 16), for
/// the templates of [`asm_with_accumulator`].
macro_rules! accumulator_list {
    (8) => {
        "{{{d0}, {d1}, {d2}, {d3}, {d4}, {d5}, {d6}, {d7}, {d8}, {d9}, {d10}, {d11}, {d12}, \
         {d13}, {d14}, {d15}, {d16}, {d17}, {d18}, {d19}, {d20}, {d21}, {d22}, {d23}, {d24}, \
         {d25}, {d26}, {d27}, {d28}, {d29}, {d30}, {d31}}}"
    };
    (16) => {
        "{{{d0}, {d1}, {d2}, {d3}, {d4}, {d5}, {d6}, {d7}, {d8}, {d9}, {d10}, {d11}, {d12}, \
         {d13}, {d14}, {d15}, {d16}, {d17}, {d18}, {d19}, {d20}, {d21}, {d22}, {d23}, {d24}, \
         {d25}, {d26}, {d27}, {d28}, {d29}, {d30}, {d31}, {d32}, {d33}, {d34}, {d35}, {d36}, \
         {d37}, {d38}, {d39}, {d40}, {d41}, {d42}, {d43}, {d44}, {d45}, {d46}, {d47}, {d48}, \
         {d49}, {d50}, {d51}, {d52}, {d53}, {d54}, {d55}, {d56}, {d57}, {d58}, {d59}, {d60}, \
         {d61}, {d62}, {d63}}}"
    };
}

/// `asm!` with the `f32` accumulator registers of a 64 × N `wgmma` tile, `$d: [FragC; N / 8]`
/// (`$tiles` = 8 or 16), bound as `{d0}`, `{d1}`, … (read and written), after the template and
/// the other operands given. Every instruction that touches an accumulator (the two `wgmma`
/// forms and [`Accumulator::pin`]) goes through here, so the bindings are written once per size.
macro_rules! asm_with_accumulator {
    (8, $d:ident, [$($template:tt)*], $($operands:tt)*) => {
        asm!(
            $($template)*
            $($operands)*
            d0 = inout(reg32) $d[0][0], d1 = inout(reg32) $d[0][1], d2 = inout(reg32) $d[0][2], d3 = inout(reg32) $d[0][3],
            d4 = inout(reg32) $d[1][0], d5 = inout(reg32) $d[1][1], d6 = inout(reg32) $d[1][2], d7 = inout(reg32) $d[1][3],
            d8 = inout(reg32) $d[2][0], d9 = inout(reg32) $d[2][1], d10 = inout(reg32) $d[2][2], d11 = inout(reg32) $d[2][3],
            d12 = inout(reg32) $d[3][0], d13 = inout(reg32) $d[3][1], d14 = inout(reg32) $d[3][2], d15 = inout(reg32) $d[3][3],
            d16 = inout(reg32) $d[4][0], d17 = inout(reg32) $d[4][1], d18 = inout(reg32) $d[4][2], d19 = inout(reg32) $d[4][3],
            d20 = inout(reg32) $d[5][0], d21 = inout(reg32) $d[5][1], d22 = inout(reg32) $d[5][2], d23 = inout(reg32) $d[5][3],
            d24 = inout(reg32) $d[6][0], d25 = inout(reg32) $d[6][1], d26 = inout(reg32) $d[6][2], d27 = inout(reg32) $d[6][3],
            d28 = inout(reg32) $d[7][0], d29 = inout(reg32) $d[7][1], d30 = inout(reg32) $d[7][2], d31 = inout(reg32) $d[7][3],
            options(nostack)
        )
    };
    (16, $d:ident, [$($template:tt)*], $($operands:tt)*) => {
        asm!(
            $($template)*
            $($operands)*
            d0 = inout(reg32) $d[0][0], d1 = inout(reg32) $d[0][1], d2 = inout(reg32) $d[0][2], d3 = inout(reg32) $d[0][3],
            d4 = inout(reg32) $d[1][0], d5 = inout(reg32) $d[1][1], d6 = inout(reg32) $d[1][2], d7 = inout(reg32) $d[1][3],
            d8 = inout(reg32) $d[2][0], d9 = inout(reg32) $d[2][1], d10 = inout(reg32) $d[2][2], d11 = inout(reg32) $d[2][3],
            d12 = inout(reg32) $d[3][0], d13 = inout(reg32) $d[3][1], d14 = inout(reg32) $d[3][2], d15 = inout(reg32) $d[3][3],
            d16 = inout(reg32) $d[4][0], d17 = inout(reg32) $d[4][1], d18 = inout(reg32) $d[4][2], d19 = inout(reg32) $d[4][3],
            d20 = inout(reg32) $d[5][0], d21 = inout(reg32) $d[5][1], d22 = inout(reg32) $d[5][2], d23 = inout(reg32) $d[5][3],
            d24 = inout(reg32) $d[6][0], d25 = inout(reg32) $d[6][1], d26 = inout(reg32) $d[6][2], d27 = inout(reg32) $d[6][3],
            d28 = inout(reg32) $d[7][0], d29 = inout(reg32) $d[7][1], d30 = inout(reg32) $d[7][2], d31 = inout(reg32) $d[7][3],
            d32 = inout(reg32) $d[8][0], d33 = inout(reg32) $d[8][1], d34 = inout(reg32) $d[8][2], d35 = inout(reg32) $d[8][3],
            d36 = inout(reg32) $d[9][0], d37 = inout(reg32) $d[9][1], d38 = inout(reg32) $d[9][2], d39 = inout(reg32) $d[9][3],
            d40 = inout(reg32) $d[10][0], d41 = inout(reg32) $d[10][1], d42 = inout(reg32) $d[10][2], d43 = inout(reg32) $d[10][3],
            d44 = inout(reg32) $d[11][0], d45 = inout(reg32) $d[11][1], d46 = inout(reg32) $d[11][2], d47 = inout(reg32) $d[11][3],
            d48 = inout(reg32) $d[12][0], d49 = inout(reg32) $d[12][1], d50 = inout(reg32) $d[12][2], d51 = inout(reg32) $d[12][3],
            d52 = inout(reg32) $d[13][0], d53 = inout(reg32) $d[13][1], d54 = inout(reg32) $d[13][2], d55 = inout(reg32) $d[13][3],
            d56 = inout(reg32) $d[14][0], d57 = inout(reg32) $d[14][1], d58 = inout(reg32) $d[14][2], d59 = inout(reg32) $d[14][3],
            d60 = inout(reg32) $d[15][0], d61 = inout(reg32) $d[15][1], d62 = inout(reg32) $d[15][2], d63 = inout(reg32) $d[15][3],
            options(nostack)
        )
    };
}

/// One `wgmma.mma_async` on accumulator `$d` of `$tiles` fragments (N = `$n`), element type
/// `$ty`: the A operand's template (a descriptor `{a}`, or a register fragment), then B and the
/// immediates (`$tail`), then the operands they name.
macro_rules! wgmma_issue {
    ($tiles:tt, $n:literal, $ty:literal, $d:ident, $scale_d:ident, [$($a_template:expr),*], [$($tail:expr),*], $($operands:tt)*) => {
        // SAFETY: the caller's contract (see `Accumulator::mma`).
        unsafe {
            asm_with_accumulator!(
                $tiles,
                $d,
                [
                    "{{",
                    ".reg .pred p;",
                    "setp.ne.b32 p, {scale_d}, 0;",
                    concat!("wgmma.mma_async.sync.aligned.m64n", $n, "k16.f32.", $ty, ".", $ty),
                    concat!(accumulator_list!($tiles), ","),
                    $($a_template,)*
                    $($tail,)*
                    "}}",
                ],
                $($operands)*
                scale_d = in(reg32) $scale_d,
            )
        }
    };
}

/// A warpgroup's `f32` accumulator of a 64 × N `wgmma` tile, as this thread holds it: N / 8
/// fragments with the layout of `mma.sync`'s m16n8 C tiles. Warp w of the warpgroup owns rows
/// 16w … 16w + 15; lane l holds, for fragment j, entries 0 and 1 at row 16w + l/4, columns
/// 8j + 2(l%4) and + 1, and entries 2 and 3 eight rows lower. Implemented for N = 64
/// (`[FragC; 8]`) and N = 128 (`[FragC; 16]`).
pub trait Accumulator {
    /// D (64 × N) = A (64 × 16) · B (16 × N) + D if `accumulate`, else A · B, on the warpgroup's
    /// tensor cores (`wgmma.mma_async.m64nNk16.f32.f16.f16`, or `.bf16`, as `T` is). A and B
    /// are shared-memory operands given by their descriptors ([`matrix_descriptor`],
    /// [`swizzled_descriptor`]), both *K-major*: A stored as rows of K, B as N rows of K (as Kᵀ
    /// is stored when S = Q·Kᵀ).
    ///
    /// # Safety
    /// Every thread of the warpgroup issues it with the same descriptors, which describe
    /// initialised shared memory (written by TMA, or published with [`fence_proxy_async`] and a
    /// barrier); the accumulator may be read only after [`wgmma_commit`], [`wgmma_wait`] and
    /// [`Accumulator::pin`].
    unsafe fn mma<T: HalfFloat>(&mut self, a: u64, b: u64, accumulate: bool);

    /// As [`Accumulator::mma`], with A from registers and B *MN-major* (`imm-trans-b` = 1,
    /// stored with N contiguous, as V's rows are): how P, computed in registers by the softmax,
    /// multiplies V. `a` is this thread's fragment of its warp's 16 rows of A, laid out as
    /// `mma.sync`'s m16n8k16 A fragment (see [`crate::gpu::FragA`]).
    ///
    /// # Safety
    /// As [`Accumulator::mma`], for the B descriptor; `a` must not change until the wait.
    unsafe fn mma_register_a<T: HalfFloat>(&mut self, a: FragA, b: u64, accumulate: bool);

    /// As [`Accumulator::mma`], with both operands *MN-major* (`imm-trans-a` = `imm-trans-b` =
    /// 1): A stored with M contiguous (as Aᵀ row-major), B with N contiguous. How the backward
    /// pass multiplies dS, staged in shared memory as dSᵀ, by K.
    ///
    /// # Safety
    /// As [`Accumulator::mma`].
    unsafe fn mma_mn_major<T: HalfFloat>(&mut self, a: u64, b: u64, accumulate: bool);

    /// Ties the accumulator's registers to this point of the program (an empty `asm!` that reads
    /// and writes them). Called after [`wgmma_wait`] it keeps the compiler from reading them
    /// earlier; called before [`wgmma_fence`] it keeps the compiler from writing them (zeroing,
    /// rescaling) after the fence, where ptxas would have to serialise the `wgmma`s.
    fn pin(&mut self);
}

/// The [`Accumulator`] of `$tiles` fragments, N = `$n`.
macro_rules! accumulator {
    ($tiles:tt, $n:literal) => {
        impl Accumulator for [FragC; $tiles] {
            #[inline(always)]
            unsafe fn mma<T: HalfFloat>(&mut self, a: u64, b: u64, accumulate: bool) {
                let (d, scale_d) = (self, accumulate as u32);
                if T::IS_BF16 {
                    wgmma_issue!($tiles, $n, "bf16", d, scale_d, ["{a}, {b},"], ["p, 1, 1, 0, 0;"], a = in(reg64) a, b = in(reg64) b,);
                } else {
                    wgmma_issue!($tiles, $n, "f16", d, scale_d, ["{a}, {b},"], ["p, 1, 1, 0, 0;"], a = in(reg64) a, b = in(reg64) b,);
                }
            }

            #[inline(always)]
            unsafe fn mma_mn_major<T: HalfFloat>(&mut self, a: u64, b: u64, accumulate: bool) {
                let (d, scale_d) = (self, accumulate as u32);
                if T::IS_BF16 {
                    wgmma_issue!($tiles, $n, "bf16", d, scale_d, ["{a}, {b},"], ["p, 1, 1, 1, 1;"], a = in(reg64) a, b = in(reg64) b,);
                } else {
                    wgmma_issue!($tiles, $n, "f16", d, scale_d, ["{a}, {b},"], ["p, 1, 1, 1, 1;"], a = in(reg64) a, b = in(reg64) b,);
                }
            }

            #[inline(always)]
            unsafe fn mma_register_a<T: HalfFloat>(&mut self, a: FragA, b: u64, accumulate: bool) {
                let (d, scale_d) = (self, accumulate as u32);
                if T::IS_BF16 {
                    wgmma_issue!($tiles, $n, "bf16", d, scale_d, ["{{{a0}, {a1}, {a2}, {a3}}}, {b},"], ["p, 1, 1, 1;"],
                        a0 = in(reg32) a[0], a1 = in(reg32) a[1], a2 = in(reg32) a[2], a3 = in(reg32) a[3], b = in(reg64) b,);
                } else {
                    wgmma_issue!($tiles, $n, "f16", d, scale_d, ["{{{a0}, {a1}, {a2}, {a3}}}, {b},"], ["p, 1, 1, 1;"],
                        a0 = in(reg32) a[0], a1 = in(reg32) a[1], a2 = in(reg32) a[2], a3 = in(reg32) a[3], b = in(reg64) b,);
                }
            }

            #[inline(always)]
            fn pin(&mut self) {
                let d = self;
                // SAFETY: no instruction (the operand list sits in a PTX comment); every operand
                // must appear in the template.
                unsafe { asm_with_accumulator!($tiles, d, [concat!("// pinned: ", accumulator_list!($tiles)),],) };
            }
        }
    };
}

accumulator!(8, "64");
accumulator!(16, "128");

/// Orders earlier register accesses of the warpgroup before the `wgmma`s that follow
/// (`wgmma.fence`). Every thread of the warpgroup calls it, after pinning ([`Accumulator::pin`])
/// the accumulators the following `wgmma`s use.
#[inline(always)]
pub fn wgmma_fence() {
    // SAFETY: no operands; all threads of the warpgroup execute it (the callers' contract).
    unsafe { asm!("wgmma.fence.sync.aligned;", options(nostack)) };
}

/// Closes the group of `wgmma`s issued since the last commit (`wgmma.commit_group`).
#[inline(always)]
pub fn wgmma_commit() {
    // SAFETY: as `wgmma_fence`.
    unsafe { asm!("wgmma.commit_group.sync.aligned;", options(nostack)) };
}

/// Waits until at most `PENDING` committed `wgmma` groups are unfinished (`wgmma.wait_group`);
/// groups finish in the order they were committed. Pin ([`Accumulator::pin`]) the accumulators
/// of the finished groups afterwards, before reading them.
#[inline(always)]
pub fn wgmma_wait<const PENDING: u32>() {
    // SAFETY: no memory access; every thread of the warpgroup executes it.
    unsafe { asm!("wgmma.wait_group.sync.aligned {n};", n = const PENDING, options(nostack)) };
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

/// Waits until `threads` threads (a multiple of 32) have arrived at named barrier `id`
/// (`bar.sync id, threads`): a barrier for part of the block, such as one warpgroup. Id 0 is
/// the one `__syncthreads` uses.
#[inline(always)]
pub fn named_barrier_sync(id: u32, threads: u32) {
    // SAFETY: synchronisation only; the callers use each id with one thread count.
    unsafe { asm!("bar.sync {id}, {n};", id = in(reg32) id, n = in(reg32) threads, options(nostack)) };
}

/// Arrives at named barrier `id` without waiting (`bar.arrive id, threads`): the signalling half
/// of a barrier whose other threads call [`named_barrier_sync`] with the same count.
#[inline(always)]
pub fn named_barrier_arrive(id: u32, threads: u32) {
    // SAFETY: synchronisation only; as `named_barrier_sync`.
    unsafe { asm!("bar.arrive {id}, {n};", id = in(reg32) id, n = in(reg32) threads, options(nostack)) };
}

/// Lowers this warpgroup's per-thread register limit to `COUNT` (`setmaxnreg.dec`), returning
/// the rest to the block's pool for [`registers_increase`]. Every thread of the warpgroup calls
/// it; `COUNT` is a multiple of 8 in 24…256.
#[inline(always)]
pub fn registers_decrease<const COUNT: u32>() {
    // SAFETY: a register-budget hint; executed by the whole warpgroup (the callers' contract).
    unsafe { asm!("setmaxnreg.dec.sync.aligned.u32 {n};", n = const COUNT, options(nostack)) };
}

/// Raises this warpgroup's per-thread register limit to `COUNT` (`setmaxnreg.inc`), waiting
/// until the block's pool has them. As [`registers_decrease`].
#[inline(always)]
pub fn registers_increase<const COUNT: u32>() {
    // SAFETY: as `registers_decrease`.
    unsafe { asm!("setmaxnreg.inc.sync.aligned.u32 {n};", n = const COUNT, options(nostack)) };
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

/// Loads two `f32` from shared-state-space `address` (8-byte aligned): `ld.shared.v2.f32`.
///
/// # Safety
/// `address` lies in this block's shared memory, 8-byte aligned.
#[inline(always)]
pub unsafe fn load_shared_f32x2(address: u32) -> [f32; 2] {
    let (x, y): (f32, f32);
    // SAFETY: the caller's contract.
    unsafe {
        asm!(
            "ld.shared.v2.f32 {{{x}, {y}}}, [{a}];",
            a = in(reg32) address, x = out(reg32) x, y = out(reg32) y, options(nostack, readonly)
        )
    };
    [x, y]
}

/// Stores two `f32` to shared-state-space `address` (8-byte aligned): `st.shared.v2.f32`.
///
/// # Safety
/// `address` lies in this block's shared memory, 8-byte aligned, and no other thread accesses
/// those bytes until a barrier.
#[inline(always)]
pub unsafe fn store_shared_f32x2(address: u32, values: [f32; 2]) {
    // SAFETY: the caller's contract.
    unsafe {
        asm!(
            "st.shared.v2.f32 [{a}], {{{x}, {y}}};",
            a = in(reg32) address, x = in(reg32) values[0], y = in(reg32) values[1], options(nostack)
        )
    };
}

/// Stores one 32-bit word (e.g. two packed 16-bit values) to shared-state-space `address`
/// (4-byte aligned): `st.shared.b32`.
///
/// # Safety
/// As [`store_shared_f32x2`], 4-byte aligned.
#[inline(always)]
pub unsafe fn store_shared_u32(address: u32, value: u32) {
    // SAFETY: the caller's contract.
    unsafe { asm!("st.shared.b32 [{a}], {v};", a = in(reg32) address, v = in(reg32) value, options(nostack)) };
}

/// `x`, hidden from the compiler: an empty `asm!` that returns its input. Values computed from
/// the result inside a loop are computed there, where they are used, instead of being hoisted
/// out of the loop and held in registers across it (LLVM hoists without regard to register
/// pressure, and ptxas then spills what it hoisted).
#[inline(always)]
pub fn opaque(x: u32) -> u32 {
    let mut x = x;
    // SAFETY: no instruction (the operand sits in a PTX comment).
    unsafe { asm!("// opaque {x}", x = inout(reg32) x, options(nostack, nomem, preserves_flags)) };
    x
}

/// Which warpgroup of the block this thread belongs to. Read from lane 0 of the warp
/// (`shfl.sync`), so that ptxas knows every lane has the same value: the shared-memory addresses
/// and descriptors derived from it then live in uniform registers, where `wgmma` takes its
/// descriptors, instead of being computed per thread and moved over before every `wgmma`.
#[inline(always)]
pub fn warpgroup_id() -> usize {
    let mut index = (gpu::thread_idx_x() / WARPGROUP_THREADS) as u32;
    // SAFETY: every lane of the warp executes it (warpgroups are whole warps).
    unsafe {
        asm!("shfl.sync.idx.b32 {i}, {i}, 0, 0x1f, 0xffffffff;", i = inout(reg32) index, options(nostack, nomem, pure))
    };
    index as usize
}

// ---------------------------------------------------------------------------------------------
// Probe kernels: each building block against the CPU (tests/gpu_hopper.rs)
// ---------------------------------------------------------------------------------------------

/// Byte offset of element (row, k) of a K-major operand stored as core matrices without
/// swizzling: the core matrix of 8-row block `row / 8` and 8-column block `k / 8` starts at
/// `(row / 8 · k_blocks + k / 8) · 128` bytes, so core matrices adjacent along K are 128 bytes
/// apart (the leading dimension byte offset) and those adjacent along rows `k_blocks · 128`
/// apart (the stride dimension byte offset); within one, row `row % 8` starts at 16-byte steps.
#[inline(always)]
pub fn core_matrix_offset(row: usize, k: usize, k_blocks: usize) -> usize {
    ((row / 8) * k_blocks + k / 8) * CORE_MATRIX_BYTES + (row % 8) * CORE_MATRIX_ROW_BYTES + (k % 8) * 2
}

/// C (64 × 64, `f32`, row-major) = A (64 × K) · Bᵀ, with A and B (64 × K) row-major 16-bit
/// floats (`f16`, or `bf16` when `bf16 != 0`), K a multiple of 16 from 16 to 128. One block of one
/// warpgroup: A and B are copied to shared memory as core matrices by ordinary stores, then
/// multiplied by K/16 `wgmma`s in one commit group. `leading_bytes` and `stride_bytes` are the
/// descriptors' offsets (the test passes the layout's: 128 and K/8 · 128).
///
/// # Safety
/// A and B hold 64 · K values, C 64 · 64; launched with one block of 128 threads and
/// 2 · 64 · K · 2 bytes of dynamic shared memory.
#[unsafe(no_mangle)]
pub unsafe extern "gpu-kernel" fn hopper_probe_wgmma(
    a: *const u16,
    b: *const u16,
    c: *mut f32,
    k: usize,
    bf16: usize,
    leading_bytes: usize,
    stride_bytes: usize,
) {
    let t = gpu::thread_idx_x();
    let k_blocks = k / 8;
    let shared = gpu::dynamic_shared_memory() as *mut u8;
    let b_shared = unsafe { shared.add(64 * k * 2) };
    // Ordinary stores into the core-matrix layout (thread t copies column t of every row), then
    // published to the async proxy.
    let mut row = 0;
    while row < 64 {
        if t < k {
            let offset = core_matrix_offset(row, t, k_blocks);
            // SAFETY: row < 64 and t < k: in bounds by the launch contract.
            unsafe {
                *(shared.add(offset) as *mut u16) = *a.add(row * k + t);
                *(b_shared.add(offset) as *mut u16) = *b.add(row * k + t);
            }
        }
        row += 1;
    }
    fence_proxy_async();
    gpu::sync_threads();

    let mut d = [[0.0f32; 4]; 8];
    let (a_address, b_address) = (shared_address(shared), shared_address(b_shared));
    d.pin();
    wgmma_fence();
    let mut step = 0;
    while step < k / 16 {
        // Each step consumes two core matrices along K: 256 bytes further.
        let offset = (step * 2 * CORE_MATRIX_BYTES) as u32;
        let a_desc = matrix_descriptor(a_address + offset, leading_bytes as u32, stride_bytes as u32);
        let b_desc = matrix_descriptor(b_address + offset, leading_bytes as u32, stride_bytes as u32);
        // SAFETY: the whole warpgroup issues it on the tiles published above.
        unsafe {
            if bf16 != 0 {
                d.mma::<gpu::Bf16>(a_desc, b_desc, step > 0);
            } else {
                d.mma::<gpu::F16>(a_desc, b_desc, step > 0);
            }
        }
        step += 1;
    }
    wgmma_commit();
    wgmma_wait::<0>();
    d.pin();

    store_accumulator(c, &d);
}

/// C (64 × 64, `f32`, row-major) = A (64 × K) · B (K × 64), A and B row-major 16-bit floats,
/// K a multiple of 16 up to 128: A from registers (each warp loads its 16 rows as `mma.sync`
/// A fragments), B from shared memory *MN-major* (B's rows, 64 values of N each, stored as core
/// matrices of 8 K-rows × 8 N-values: the one at K-block `kb`, N-block `nb` at
/// `(kb · 8 + nb) · 128` bytes). `leading_bytes` and `stride_bytes` are the descriptor's offsets
/// ([`DescriptorOffsets::mn_major_n64`] on the host).
///
/// # Safety
/// A holds 64 · K values, B K · 64, C 64 · 64; one block of 128 threads with K · 64 · 2 bytes of
/// dynamic shared memory.
#[unsafe(no_mangle)]
pub unsafe extern "gpu-kernel" fn hopper_probe_wgmma_register_a(
    a: *const u16,
    b: *const u16,
    c: *mut f32,
    k: usize,
    bf16: usize,
    leading_bytes: usize,
    stride_bytes: usize,
) {
    let t = gpu::thread_idx_x();
    let shared = gpu::dynamic_shared_memory() as *mut u8;
    // B into MN-major core matrices: thread t copies column t (t < 64) of every row of B.
    let mut row = 0;
    while row < k {
        if t < 64 {
            // Rows are K, columns N: the same core-matrix placement as a K-major tile of 8 blocks.
            let offset = core_matrix_offset(row, t, 8);
            // SAFETY: row < k and t < 64: in bounds by the launch contract.
            unsafe { *(shared.add(offset) as *mut u16) = *b.add(row * 64 + t) };
        }
        row += 1;
    }
    fence_proxy_async();
    gpu::sync_threads();

    let (warp, lane) = (gpu::warp_id(), gpu::lane_id());
    let (g, q) = (lane / 4, lane % 4);
    let a_row = |r: usize, col: usize| -> u32 {
        // SAFETY: r < 64 and col + 1 < k: in bounds by the launch contract.
        unsafe { (*a.add(r * k + col) as u32) | (*a.add(r * k + col + 1) as u32) << 16 }
    };
    let b_address = shared_address(shared);
    let mut d = [[0.0f32; 4]; 8];
    d.pin();
    wgmma_fence();
    let mut step = 0;
    while step < k / 16 {
        let (r, col) = (16 * warp + g, 16 * step + 2 * q);
        let fragment = [a_row(r, col), a_row(r + 8, col), a_row(r, col + 8), a_row(r + 8, col + 8)];
        // Each step consumes two K-blocks of B: 2 · 8 core matrices further.
        let offset = (step * 2 * 8 * CORE_MATRIX_BYTES) as u32;
        let b_desc = matrix_descriptor(b_address + offset, leading_bytes as u32, stride_bytes as u32);
        // SAFETY: the whole warpgroup issues it on the tile published above.
        unsafe {
            if bf16 != 0 {
                d.mma_register_a::<gpu::Bf16>(fragment, b_desc, step > 0);
            } else {
                d.mma_register_a::<gpu::F16>(fragment, b_desc, step > 0);
            }
        }
        step += 1;
    }
    wgmma_commit();
    wgmma_wait::<0>();
    d.pin();
    store_accumulator(c, &d);
}

/// Writes a warpgroup's 64 × 64 accumulator (the layout of [`Accumulator`]) to `c`,
/// row-major.
#[inline(always)]
fn store_accumulator(c: *mut f32, d: &[FragC; 8]) {
    let (warp, lane) = (gpu::warp_id(), gpu::lane_id());
    let row = 16 * warp + lane / 4;
    let mut j = 0;
    while j < 8 {
        let col = 8 * j + 2 * (lane % 4);
        // SAFETY: row + 8 < 64 and col + 1 < 64; the callers' `c` holds 64 · 64 values.
        unsafe {
            *c.add(row * 64 + col) = d[j][0];
            *c.add(row * 64 + col + 1) = d[j][1];
            *c.add((row + 8) * 64 + col) = d[j][2];
            *c.add((row + 8) * 64 + col + 1) = d[j][3];
        }
        j += 1;
    }
}

/// Copies the 64 × 64 box of 16-bit values at (`x`, `y`) of the 2-D tensor described by
/// `tensor_map` into shared memory with one TMA load completing on an `mbarrier`, then writes
/// the box to `out` (64 × 64, row-major) with ordinary loads: zeros where the box leaves the
/// tensor.
///
/// # Safety
/// `tensor_map` points to a `CUtensorMap` in device memory with a 64 × 64 box of 2-byte
/// elements; `out` holds 64 · 64 values; one block of 128 threads with 8192 + 128 bytes of
/// dynamic shared memory.
#[unsafe(no_mangle)]
pub unsafe extern "gpu-kernel" fn hopper_probe_tma(tensor_map: *const u8, out: *mut u16, x: isize, y: isize) {
    const BOX_BYTES: usize = 64 * 64 * 2;
    let t = gpu::thread_idx_x();
    let shared = gpu::dynamic_shared_memory() as *mut u8;
    // The box first (128-byte aligned: the start of dynamic shared memory), the barrier after it.
    let barrier = shared_address(shared) + BOX_BYTES as u32;
    if t == 0 {
        // SAFETY: one thread initialises the barrier before anyone else touches it.
        unsafe { mbarrier_init(barrier, 1) };
        fence_mbarrier_init();
    }
    gpu::sync_threads();
    if t == 0 {
        // SAFETY: the barrier is initialised; the box fits at `shared`.
        unsafe {
            mbarrier_arrive_expect_tx(barrier, BOX_BYTES as u32);
            tma_load_2d(shared_address(shared), tensor_map, x as i32, y as i32, barrier);
        }
    }
    // SAFETY: initialised above; the first phase has parity 0.
    unsafe { mbarrier_wait(barrier, 0) };
    let mut i = t;
    while i < 64 * 64 {
        // SAFETY: in bounds by the launch contract.
        unsafe { *out.add(i) = *(shared.add(2 * i) as *const u16) };
        i += WARPGROUP_THREADS;
    }
}
