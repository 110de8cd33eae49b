//! Level 0, what a block does (threads that share one multiprocessor): the block barrier, dynamic
//! shared memory, `f32` tiles carved out of it ([`SharedTile`]), cooperative copies from global
//! memory into a tile, and the commit groups of asynchronous copies (`cp.async`).

use super::backend;
use super::{F32x4, SharedTile16, thread_idx_x};

/// Waits until every thread of the block has reached this point; shared-memory writes made
/// before it are visible to every thread after it (`bar.sync 0`, CUDA's `__syncthreads`).
/// Every thread of the block must reach the same call.
#[inline(always)]
#[cfg_attr(not(target_arch = "nvptx64"), track_caller)]
pub fn sync_threads() {
    backend::sync_threads()
}

/// Start of the block's dynamic shared memory: the bytes the host asked for at launch
/// (`sharedMemBytes` of `cuLaunchKernel`), 16-byte aligned, uninitialised.
#[inline(always)]
pub fn dynamic_shared_memory() -> *mut f32 {
    backend::dynamic_shared_memory()
}

/// A `ROWS × cols` tile of `f32` in shared memory, row-major with a row stride of `stride`
/// floats. A stride longer than the row ("padding") shifts consecutive rows onto different
/// memory banks, so threads that read the same column of different rows do not collide.
#[derive(Clone, Copy)]
pub struct SharedTile {
    ptr: *mut f32,
    stride: usize,
}

impl SharedTile {
    /// Pointer to element `(row, col)`.
    #[inline(always)]
    fn at(self, row: usize, col: usize) -> *mut f32 {
        // SAFETY: only address arithmetic; callers stay within the carved tile.
        unsafe { self.ptr.add(row * self.stride + col) }
    }

    /// Reads `(row, col..col+4)`; `col` must be a multiple of 4 and the stride too.
    #[inline(always)]
    #[cfg_attr(not(target_arch = "nvptx64"), track_caller)]
    pub fn load4(self, row: usize, col: usize) -> F32x4 {
        let ptr = self.at(row, col);
        backend::check_shared(ptr, 4, false);
        // SAFETY: tiles are carved 16-byte aligned with strides that are multiples of 4.
        unsafe { F32x4::load(ptr) }
    }

    /// Writes `(row, col..col+4)`; `col` must be a multiple of 4 and the stride too.
    #[inline(always)]
    #[cfg_attr(not(target_arch = "nvptx64"), track_caller)]
    pub fn store4(self, row: usize, col: usize, value: F32x4) {
        let ptr = self.at(row, col);
        backend::check_shared(ptr, 4, true);
        // SAFETY: as `load4`.
        unsafe { value.store(ptr) }
    }

    /// Reads `(row, col)`.
    #[inline(always)]
    #[cfg_attr(not(target_arch = "nvptx64"), track_caller)]
    pub fn load(self, row: usize, col: usize) -> f32 {
        let ptr = self.at(row, col);
        backend::check_shared(ptr, 1, false);
        // SAFETY: see `at`.
        unsafe { *ptr }
    }

    /// Writes `(row, col)`.
    #[inline(always)]
    #[cfg_attr(not(target_arch = "nvptx64"), track_caller)]
    pub fn store(self, row: usize, col: usize, value: f32) {
        let ptr = self.at(row, col);
        backend::check_shared(ptr, 1, true);
        // SAFETY: see `at`.
        unsafe { *ptr = value }
    }

    /// Block-cooperative copy of `rows` rows of `cols` floats from global memory into rows
    /// `0..rows` of this tile. The source rows are `width` floats long and contiguous (row `r`
    /// starts at `src + r · width`); columns `width..cols` (a head_dim padded up to the compiled
    /// one) and rows `valid_rows..rows` (a ragged last tile) are filled with zeros instead of
    /// being read, so no copy reads past its tensor. Threads take 4-float chunks in turn, so
    /// neighbouring threads read neighbouring addresses (coalesced): 16-byte loads when `width`
    /// is a multiple of 4 (every row then starts 16-byte aligned), one float at a time otherwise.
    /// `cols` must be a multiple of 4. Call from every thread of a block of `THREADS` threads;
    /// the caller places the barrier that publishes the tile.
    ///
    /// # Safety
    /// `src` points to `valid_rows · width` readable floats of global memory, 16-byte aligned
    /// when `width` is a multiple of 4; `width ≤ cols`.
    #[inline(always)]
    pub unsafe fn copy_rows_from<const THREADS: usize>(
        self,
        src: *const f32,
        rows: usize,
        cols: usize,
        width: usize,
        valid_rows: usize,
    ) {
        let aligned = width.is_multiple_of(4);
        let chunks_per_row = cols / 4;
        let mut chunk = thread_idx_x();
        while chunk < rows * chunks_per_row {
            let (row, col) = (chunk / chunks_per_row, (chunk % chunks_per_row) * 4);
            let value = if row >= valid_rows || col >= width {
                F32x4::ZERO
            } else if aligned {
                // SAFETY: the row is valid and, `width` being a multiple of 4, so are all 4 columns.
                unsafe { F32x4::load(src.add(row * width + col)) }
            } else {
                // SAFETY: each float is read only inside the source row.
                F32x4(core::array::from_fn(|e| {
                    if col + e < width { unsafe { *src.add(row * width + col + e) } } else { 0.0 }
                }))
            };
            self.store4(row, col, value);
            chunk += THREADS;
        }
    }
}

impl SharedTile {
    /// Block-cooperative asynchronous copy of `cols` floats from global memory at `src` into row
    /// `row` of this tile, 4 bytes per `cp.async` (so `src` need only be 4-byte aligned); columns
    /// `valid_cols..cols` are zero-filled without reading. Part of the calling thread's current
    /// copy group (see [`SharedTile16::copy_rows_async`]).
    ///
    /// # Safety
    /// `src` points to `valid_cols` readable floats of global memory.
    #[inline(always)]
    pub unsafe fn copy_row_async(self, row: usize, src: *const f32, cols: usize, valid_cols: usize, threads: usize) {
        let mut col = thread_idx_x();
        while col < cols {
            let dst = self.at(row, col);
            backend::check_shared(dst, 1, true);
            let valid = col < valid_cols;
            // SAFETY: a valid column lies inside the source; otherwise nothing is read.
            unsafe { backend::cp_async_4(backend::shared_address(dst), src.add(if valid { col } else { 0 }), valid) };
            col += threads;
        }
    }
}

// ANCHOR: shared_memory
/// Hands out consecutive tiles of the block's dynamic shared memory. The host computes the same
/// total from `layout`, so the carve-up here and the launch's byte count agree.
pub struct SharedMemory {
    next: *mut u8,
}

impl SharedMemory {
    /// Starts at the beginning of the dynamic shared memory.
    #[inline(always)]
    pub fn new() -> Self {
        Self { next: dynamic_shared_memory() as *mut u8 }
    }

    /// The next `rows × stride` floats as a tile. `stride` must be a multiple of 4 so that every
    /// tile and every row stays 16-byte aligned.
    #[inline(always)]
    pub fn tile(&mut self, rows: usize, stride: usize) -> SharedTile {
        let tile = SharedTile { ptr: self.next as *mut f32, stride };
        // SAFETY: the host sized the allocation from the same layout.
        self.next = unsafe { self.next.add(rows * stride * 4) };
        tile
    }

    /// The next `rows × stride` 16-bit floats as a tile for the tensor cores. `stride` must be a
    /// multiple of 8 so that every row starts 16-byte aligned (`ldmatrix` and `cp.async` need it).
    #[inline(always)]
    pub fn tile16(&mut self, rows: usize, stride: usize) -> SharedTile16 {
        let ptr = self.next as *mut u16;
        let tile = SharedTile16 { ptr, address: backend::shared_address(ptr), stride };
        // SAFETY: the host sized the allocation from the same layout.
        self.next = unsafe { self.next.add(rows * stride * 2) };
        tile
    }
}
// ANCHOR_END: shared_memory

impl Default for SharedMemory {
    fn default() -> Self {
        Self::new()
    }
}

/// Closes the calling thread's current group of [`SharedTile16::copy_rows_async`] copies
/// (`cp.async.commit_group`). Every thread commits the same number of groups, even empty ones,
/// so that group counts mean the same tile in every thread.
#[inline(always)]
pub fn cp_async_commit() {
    backend::cp_async_commit()
}

/// Waits until at most `pending` of the calling thread's committed copy groups are still in
/// flight (`cp.async.wait_group`, whose count is an immediate: callers pass a constant, and a
/// count above 8 waits for everything, which is always safe — and serialises a deeper ring). It
/// only covers the thread's own copies: a block barrier must follow before other threads read
/// the data.
#[inline(always)]
pub fn cp_async_wait(pending: usize) {
    match pending {
        8 => backend::cp_async_wait::<8>(),
        7 => backend::cp_async_wait::<7>(),
        6 => backend::cp_async_wait::<6>(),
        5 => backend::cp_async_wait::<5>(),
        4 => backend::cp_async_wait::<4>(),
        3 => backend::cp_async_wait::<3>(),
        2 => backend::cp_async_wait::<2>(),
        1 => backend::cp_async_wait::<1>(),
        _ => backend::cp_async_wait::<0>(),
    }
}
