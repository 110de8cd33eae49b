//! **Runtime layer.** Device tensors: a buffer of `f32`, `f16` or `bf16` in device memory (HBM) that knows its
//! shape, or, on the CPU emulator, its stand-in in host memory. The [`Context`](crate::Context) makes them
//! ([`Context::upload`](crate::Context::upload), `runtime/context.rs`); this module does not know the context.

use std::mem::ManuallyDrop;
use std::ptr::NonNull;

use cudarc::driver::CudaSlice;

use crate::dtype::Scalar;
use crate::error::{During, Error, Result};

/// A row-major tensor of `T` (`f32` by default; [`half::f16`] or [`half::bf16`] for the
/// tensor-core kernels; `i32` for a KV cache's lengths and page table) on a [`Context`](crate::Context)'s device. Shapes are given outermost first, e.g.
/// `[batch, heads, seqlen, head_dim]` for attention inputs (PyTorch's layout).
///
/// The buffer is freed when the tensor is dropped, unless the tensor only borrows memory that
/// someone else owns ([`Context::tensor_from_raw_parts`](crate::Context::tensor_from_raw_parts)).
/// On a GPU, copies to and from the host go through the context's stream, so they are ordered
/// after every kernel queued before them.
pub struct DeviceTensor<T: Scalar = f32> {
    /// Dropped by hand (`Drop`): a borrowed buffer must not be freed.
    storage: ManuallyDrop<Storage<T>>,
    shape: Vec<usize>,
    /// The [`Context`](crate::Context) that made it (its id).
    owner: u64,
    /// Whether the memory belongs to someone else (a framework's tensor): never freed here.
    borrowed: bool,
}

impl<T: Scalar> Drop for DeviceTensor<T> {
    fn drop(&mut self) {
        // SAFETY: `storage` is not used again.
        let storage = unsafe { ManuallyDrop::take(&mut self.storage) };
        match storage {
            // `leak` gives the allocation up without freeing it (and releases the slice's
            // stream and events).
            Storage::Cuda(slice) if self.borrowed => {
                slice.leak();
            }
            Storage::Host(buffer) if self.borrowed => std::mem::forget(buffer),
            owned => drop(owned),
        }
    }
}

/// Where a tensor's elements live: device memory, or host memory on the emulator. A tensor of
/// no elements is `Host` on every context: CUDA has no zero-byte buffers, and no kernel is ever
/// launched on one (an empty problem's outputs are written without kernels).
pub(crate) enum Storage<T: Scalar> {
    Cuda(CudaSlice<T>),
    Host(HostBuffer<T>),
}

impl<T: Scalar> Storage<T> {
    /// The storage of a tensor of no elements, on any context (see the type's docs).
    pub(crate) fn empty() -> Self {
        Self::Host(HostBuffer::new(Vec::new()))
    }
}

/// A heap buffer that emulated kernels write through raw pointers (so it is not a `Vec`, whose
/// `&mut` access would assert exclusivity).
pub(crate) struct HostBuffer<T> {
    ptr: NonNull<T>,
    len: usize,
}

// SAFETY: the buffer is plain memory owned by the tensor; concurrent access only happens inside
// an emulated launch, whose kernels write disjoint elements (as on the GPU).
unsafe impl<T: Send> Send for HostBuffer<T> {}
unsafe impl<T: Sync> Sync for HostBuffer<T> {}

impl<T> HostBuffer<T> {
    /// A buffer over `len` elements at `ptr` that the caller owns (the tensor that holds it is
    /// `borrowed` and forgets the buffer instead of dropping it).
    pub(super) fn borrowed(ptr: NonNull<T>, len: usize) -> Self {
        Self { ptr, len }
    }

    pub(super) fn new(values: Vec<T>) -> Self {
        let len = values.len();
        let ptr = NonNull::new(Box::into_raw(values.into_boxed_slice()) as *mut T).expect("Box is never null");
        Self { ptr, len }
    }

    pub(crate) fn as_ptr(&self) -> *mut T {
        self.ptr.as_ptr()
    }

    fn as_slice(&self) -> &[T] {
        // SAFETY: `ptr` owns `len` initialised floats; no launch is running while `&self` reads.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    pub(super) fn as_mut_slice(&mut self) -> &mut [T] {
        // SAFETY: as `as_slice`, and `&mut self` is exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl<T> Drop for HostBuffer<T> {
    fn drop(&mut self) {
        // SAFETY: made by `Box::into_raw` of a boxed slice of `len` floats in `new`.
        drop(unsafe { Box::from_raw(std::ptr::slice_from_raw_parts_mut(self.ptr.as_ptr(), self.len)) });
    }
}

impl<T: Scalar> std::fmt::Debug for DeviceTensor<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DeviceTensor<{}>{:?}", T::NAME, self.shape)
    }
}

impl<T: Scalar> DeviceTensor<T> {
    /// Dimensions, outermost first.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// Number of elements (the product of the shape).
    pub fn len(&self) -> usize {
        match &*self.storage {
            Storage::Cuda(data) => data.len(),
            Storage::Host(data) => data.len,
        }
    }

    /// Whether the tensor has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Size of the buffer, in bytes.
    pub fn bytes(&self) -> usize {
        self.len() * size_of::<T>()
    }

    /// Copies the tensor to the host, waiting for every kernel queued before.
    pub fn to_host(&self) -> Result<Vec<T>> {
        match &*self.storage {
            Storage::Cuda(data) => data.stream().clone_dtoh(data).during("copying a tensor to the host"),
            Storage::Host(data) => Ok(data.as_slice().to_vec()),
        }
    }

    /// Overwrites the tensor with `values` (row-major, same number of elements).
    ///
    /// # Errors
    /// [`Error::Length`] when `values` has another length; nothing is copied then.
    pub fn copy_from_host(&mut self, values: &[T]) -> Result<()> {
        if values.len() != self.len() {
            return Err(Error::Length { expected: self.len(), got: values.len() });
        }
        match &mut *self.storage {
            Storage::Cuda(data) => {
                let stream = data.stream().clone();
                stream.memcpy_htod(values, data).during("copying a tensor to the device")
            }
            Storage::Host(data) => {
                data.as_mut_slice().copy_from_slice(values);
                Ok(())
            }
        }
    }

    /// The device buffer, for use with other CUDA libraries (cuBLAS, NVRTC-compiled kernels) on
    /// the context's stream ([`Context::cuda_stream`](crate::Context::cuda_stream)); `None` on the
    /// emulator, and for a tensor of no elements (which holds no memory).
    pub fn cuda_slice(&self) -> Option<&CudaSlice<T>> {
        match &*self.storage {
            Storage::Cuda(slice) => Some(slice),
            Storage::Host(_) => None,
        }
    }

    /// The device buffer itself, the tensor consumed (`None` on the emulator, and for a tensor
    /// that borrows its memory, which is dropped as usual then): the other way of
    /// [`Context::tensor_from_cuda_slice`](crate::Context::tensor_from_cuda_slice).
    pub fn into_cuda_slice(self) -> Option<CudaSlice<T>> {
        if self.borrowed || !matches!(*self.storage, Storage::Cuda(_)) {
            return None;
        }
        let mut tensor = ManuallyDrop::new(self);
        // SAFETY: `tensor` is never dropped, so its storage is taken once; its shape is dropped
        // here, the rest is plain data.
        let storage = unsafe { ManuallyDrop::take(&mut tensor.storage) };
        drop(std::mem::take(&mut tensor.shape));
        match storage {
            Storage::Cuda(slice) => Some(slice),
            Storage::Host(_) => unreachable!("checked above"),
        }
    }

    /// A borrowed tensor of `shape` over this one's elements from `offset` on (a batch chunk of
    /// a problem too large for one grid, say): it reads and writes this tensor's memory and frees
    /// nothing; this tensor must outlive it.
    pub(crate) fn view(&self, offset: usize, shape: &[usize]) -> Result<DeviceTensor<T>> {
        let n = element_count(shape)?;
        if offset.checked_add(n).is_none_or(|end| end > self.len()) {
            return Err(Error::Shape(format!(
                "a view of {shape:?} at element {offset} does not fit in a tensor of {} elements",
                self.len()
            )));
        }
        let storage = match &*self.storage {
            _ if n == 0 => {
                return Ok(Self::from_storage(Storage::empty(), shape, self.owner));
            }
            Storage::Cuda(slice) => {
                let stream = slice.stream().clone();
                let (base, _record) = cudarc::driver::DevicePtr::device_ptr(slice, &stream);
                let address = base + (offset * size_of::<T>()) as u64;
                // SAFETY: `offset .. offset + n` lies inside this tensor's allocation (checked);
                // the view is borrowed, so the slice is leaked on drop, never freed.
                Storage::Cuda(unsafe { stream.upgrade_device_ptr::<T>(address, n) })
            }
            Storage::Host(buffer) => {
                // SAFETY: as above, inside the buffer.
                let ptr = unsafe { NonNull::new_unchecked(buffer.as_ptr().add(offset)) };
                Storage::Host(HostBuffer::borrowed(ptr, n))
            }
        };
        Ok(Self::from_borrowed_storage(storage, shape, self.owner))
    }

    /// Whether the tensor borrows memory it does not free
    /// ([`Context::tensor_from_raw_parts`](crate::Context::tensor_from_raw_parts)).
    pub fn is_borrowed(&self) -> bool {
        self.borrowed
    }

    /// [`DeviceTensor::cuda_slice`], writable.
    pub fn cuda_slice_mut(&mut self) -> Option<&mut CudaSlice<T>> {
        match &mut *self.storage {
            Storage::Cuda(slice) => Some(slice),
            Storage::Host(_) => None,
        }
    }

    pub(crate) fn storage(&self) -> &Storage<T> {
        &self.storage
    }

    pub(crate) fn storage_mut(&mut self) -> &mut Storage<T> {
        &mut self.storage
    }

    pub(crate) fn owner(&self) -> u64 {
        self.owner
    }

    /// A tensor of `storage` with `shape`, made by the context with id `owner`.
    pub(super) fn from_storage(storage: Storage<T>, shape: &[usize], owner: u64) -> Self {
        Self { storage: ManuallyDrop::new(storage), shape: shape.to_vec(), owner, borrowed: false }
    }

    /// [`DeviceTensor::from_storage`] over memory someone else owns: never freed.
    pub(super) fn from_borrowed_storage(storage: Storage<T>, shape: &[usize], owner: u64) -> Self {
        Self { storage: ManuallyDrop::new(storage), shape: shape.to_vec(), owner, borrowed: true }
    }
}

/// The product of `shape`, checked.
pub(super) fn element_count(shape: &[usize]) -> Result<usize> {
    shape
        .iter()
        .try_fold(1usize, |n, &d| n.checked_mul(d))
        .ok_or_else(|| Error::Shape(format!("{shape:?} has more elements than fit in memory")))
}

/// Attention sinks from an `f32` tensor of shape `[num_heads_q]` ([`crate::Sinks`]), borrowed
/// for as long as the options that hold them.
impl<'a> From<&'a DeviceTensor<f32>> for crate::problem::Sinks<'a> {
    fn from(tensor: &'a DeviceTensor<f32>) -> Self {
        Self { address: tensor.address(), shape: tensor.shape(), owner: tensor.owner() }
    }
}

/// An additive bias from an `f32` tensor of shape `[batch or 1, num_heads_q or 1, seqlen_q,
/// seqlen_k]` ([`crate::Bias`]), borrowed for as long as the options that hold it.
impl<'a> From<&'a DeviceTensor<f32>> for crate::problem::Bias<'a> {
    fn from(tensor: &'a DeviceTensor<f32>) -> Self {
        Self { address: tensor.address(), shape: tensor.shape(), owner: tensor.owner() }
    }
}

impl<T: Scalar> DeviceTensor<T> {
    /// The tensor's address as a kernel argument takes it: on a GPU its device pointer (with
    /// the slice's own stream, the context's for every tensor a context makes or borrows), on
    /// the emulator its host buffer's.
    pub(crate) fn address(&self) -> u64 {
        match self.storage() {
            Storage::Cuda(slice) => {
                let (address, _sync) = cudarc::driver::DevicePtr::device_ptr(slice, slice.stream());
                address
            }
            Storage::Host(buffer) => buffer.as_ptr() as u64,
        }
    }
}
