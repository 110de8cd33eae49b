//! Device tensors: an `f32` buffer in device memory (HBM) that knows its shape, or, on the CPU
//! emulator, its stand-in in host memory.

use std::ptr::NonNull;

use cudarc::driver::CudaSlice;

use crate::context::Context;
use crate::error::{During, Error, Result};

/// A row-major `f32` tensor on a [`Context`]'s device. Shapes are given outermost first, e.g.
/// `[batch, heads, seqlen, head_dim]` for attention inputs (PyTorch's layout).
///
/// The buffer is freed when the tensor is dropped. On a GPU, copies to and from the host go
/// through the context's stream, so they are ordered after every kernel queued before them.
pub struct DeviceTensor {
    storage: Storage,
    shape: Vec<usize>,
    /// The [`Context`] that made it (its id).
    owner: u64,
}

pub(crate) enum Storage {
    Cuda(CudaSlice<f32>),
    Host(HostBuffer),
}

/// A heap buffer that emulated kernels write through raw pointers (so it is not a `Vec`, whose
/// `&mut` access would assert exclusivity).
pub(crate) struct HostBuffer {
    ptr: NonNull<f32>,
    len: usize,
}

// SAFETY: the buffer is plain memory owned by the tensor; concurrent access only happens inside
// an emulated launch, whose kernels write disjoint elements (as on the GPU).
unsafe impl Send for HostBuffer {}
unsafe impl Sync for HostBuffer {}

impl HostBuffer {
    fn new(values: Vec<f32>) -> Self {
        let len = values.len();
        let ptr = NonNull::new(Box::into_raw(values.into_boxed_slice()) as *mut f32).expect("Box is never null");
        Self { ptr, len }
    }

    pub(crate) fn as_ptr(&self) -> *mut f32 {
        self.ptr.as_ptr()
    }

    fn as_slice(&self) -> &[f32] {
        // SAFETY: `ptr` owns `len` initialised floats; no launch is running while `&self` reads.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    fn as_mut_slice(&mut self) -> &mut [f32] {
        // SAFETY: as `as_slice`, and `&mut self` is exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for HostBuffer {
    fn drop(&mut self) {
        // SAFETY: made by `Box::into_raw` of a boxed slice of `len` floats in `new`.
        drop(unsafe { Box::from_raw(std::ptr::slice_from_raw_parts_mut(self.ptr.as_ptr(), self.len)) });
    }
}

impl std::fmt::Debug for DeviceTensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DeviceTensor{:?}", self.shape)
    }
}

impl DeviceTensor {
    /// Dimensions, outermost first.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// Number of elements (the product of the shape).
    pub fn len(&self) -> usize {
        match &self.storage {
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
        self.len() * size_of::<f32>()
    }

    /// Copies the tensor to the host, waiting for every kernel queued before.
    pub fn to_host(&self) -> Result<Vec<f32>> {
        match &self.storage {
            Storage::Cuda(data) => data.stream().clone_dtoh(data).during("copying a tensor to the host"),
            Storage::Host(data) => Ok(data.as_slice().to_vec()),
        }
    }

    /// Overwrites the tensor with `values` (row-major, same number of elements).
    ///
    /// # Errors
    /// [`Error::Length`] when `values` has another length; nothing is copied then.
    pub fn copy_from_host(&mut self, values: &[f32]) -> Result<()> {
        if values.len() != self.len() {
            return Err(Error::Length { expected: self.len(), got: values.len() });
        }
        match &mut self.storage {
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

    pub(crate) fn storage(&self) -> &Storage {
        &self.storage
    }

    pub(crate) fn storage_mut(&mut self) -> &mut Storage {
        &mut self.storage
    }

    pub(crate) fn owner(&self) -> u64 {
        self.owner
    }
}

fn element_count(shape: &[usize]) -> Result<usize> {
    shape
        .iter()
        .try_fold(1usize, |n, &d| n.checked_mul(d))
        .ok_or_else(|| Error::Shape(format!("{shape:?} has more elements than fit in memory")))
}

impl Context {
    /// Copies host data of the given shape to a new device tensor.
    ///
    /// # Errors
    /// [`Error::Length`] when `values.len()` is not the product of `shape`; [`Error::Driver`]
    /// when the allocation fails (e.g. out of device memory).
    pub fn upload(&self, values: &[f32], shape: &[usize]) -> Result<DeviceTensor> {
        let expected = element_count(shape)?;
        if values.len() != expected {
            return Err(Error::Length { expected, got: values.len() });
        }
        let storage = match self.cuda_stream() {
            Some(stream) => Storage::Cuda(stream.clone_htod(values).during("allocating and filling a device tensor")?),
            None => Storage::Host(HostBuffer::new(values.to_vec())),
        };
        Ok(DeviceTensor { storage, shape: shape.to_vec(), owner: self.id() })
    }

    /// A new device tensor with every element set to `value`: zeros, or NaN to poison an output
    /// so that any element a kernel fails to write shows up.
    pub fn full(&self, shape: &[usize], value: f32) -> Result<DeviceTensor> {
        let n = element_count(shape)?;
        self.upload(&vec![value; n], shape)
    }

    /// A new device tensor whose contents are unspecified; for outputs a kernel overwrites whole.
    pub(crate) fn alloc_output(&self, shape: &[usize]) -> Result<DeviceTensor> {
        let n = element_count(shape)?;
        let storage = match self.cuda_stream() {
            // SAFETY: `f32` has no invalid bit patterns, and callers overwrite every element
            // before it is read.
            Some(stream) => {
                Storage::Cuda(unsafe { stream.alloc::<f32>(n) }.during(format!("allocating a {shape:?} tensor"))?)
            }
            // The emulator's "uninitialised" memory is NaN, so an unwritten element shows.
            None => Storage::Host(HostBuffer::new(vec![f32::NAN; n])),
        };
        Ok(DeviceTensor { storage, shape: shape.to_vec(), owner: self.id() })
    }

    /// Sets every element of `tensor` to zero (queued on the stream on a GPU).
    pub(crate) fn fill_zeros(&self, tensor: &mut DeviceTensor) -> Result<()> {
        match (tensor.storage_mut(), self.cuda_stream()) {
            (Storage::Cuda(data), Some(stream)) => stream.memset_zeros(data).during("zeroing a tensor"),
            (Storage::Host(data), _) => {
                data.as_mut_slice().fill(0.0);
                Ok(())
            }
            (Storage::Cuda(_), None) => Err(Error::Shape("a GPU tensor was given to the CPU emulator".into())),
        }
    }
}
