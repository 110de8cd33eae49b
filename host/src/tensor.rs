//! Device tensors: an `f32` buffer in device memory (HBM) that knows its shape.

use cudarc::driver::CudaSlice;

use crate::context::Context;
use crate::error::{During, Error, Result};

/// A row-major `f32` tensor in device memory. Shapes are given outermost first, e.g.
/// `[batch, heads, seqlen, head_dim]` for attention inputs (PyTorch's layout).
///
/// The buffer is freed when the tensor is dropped. Copies to and from the host go through the
/// context's stream, so they are ordered after every kernel queued before them.
pub struct DeviceTensor {
    data: CudaSlice<f32>,
    shape: Vec<usize>,
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
        self.data.len()
    }

    /// Whether the tensor has no elements.
    pub fn is_empty(&self) -> bool {
        self.data.len() == 0
    }

    /// Size of the buffer in device memory, in bytes.
    pub fn bytes(&self) -> usize {
        self.data.num_bytes()
    }

    /// Copies the tensor to the host, waiting for every kernel queued before.
    pub fn to_host(&self) -> Result<Vec<f32>> {
        self.data.stream().clone_dtoh(&self.data).during("copying a tensor to the host")
    }

    /// Overwrites the tensor with `values` (row-major, same number of elements).
    ///
    /// # Errors
    /// [`Error::Length`] when `values` has another length; nothing is copied then.
    pub fn copy_from_host(&mut self, values: &[f32]) -> Result<()> {
        if values.len() != self.len() {
            return Err(Error::Length { expected: self.len(), got: values.len() });
        }
        let stream = self.data.stream().clone();
        stream.memcpy_htod(values, &mut self.data).during("copying a tensor to the device")
    }

    pub(crate) fn data(&self) -> &CudaSlice<f32> {
        &self.data
    }

    pub(crate) fn data_mut(&mut self) -> &mut CudaSlice<f32> {
        &mut self.data
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
        let data = self.stream().clone_htod(values).during("allocating and filling a device tensor")?;
        Ok(DeviceTensor { data, shape: shape.to_vec() })
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
        // SAFETY: `f32` has no invalid bit patterns, and callers overwrite every element before
        // it is read.
        let data = unsafe { self.stream().alloc::<f32>(n) }.during(format!("allocating a {shape:?} tensor"))?;
        Ok(DeviceTensor { data, shape: shape.to_vec() })
    }
}
