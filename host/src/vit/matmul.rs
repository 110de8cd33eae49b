//! The matrix products outside attention (patch embedding, QKV and output projections):
//! `Y = X Wᵀ + b`, on the GPU with cuBLAS's SGEMM (a well-kept library; these are not our
//! kernels; loaded at run time by [`super::cublas`]), on the CPU with rayon.

use std::sync::Arc;

use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut};
use rayon::prelude::*;

use super::cublas::{self, Api};
use crate::error::{During, Error, Result};
use crate::runtime::Context;

/// Where a [`Matmul`] computes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MatmulBackend {
    /// cuBLAS SGEMM on the GPU, plain `f32` arithmetic (math mode `CUBLAS_DEFAULT_MATH`: no TF32).
    Cublas,
    /// rayon on the CPU, `f64` accumulation, rounded to `f32` once per element.
    Cpu,
}

impl std::fmt::Display for MatmulBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Cublas => "cuBLAS SGEMM (f32, no TF32)",
            Self::Cpu => "CPU (rayon, f64 accumulation)",
        })
    }
}

/// Computes `Y = X Wᵀ + b` (a linear layer, PyTorch's `nn.Linear`) with cuBLAS or on the CPU.
pub struct Matmul {
    inner: Inner,
}

enum Inner {
    Cublas { blas: Handle, stream: Arc<CudaStream> },
    Cpu,
}

/// A cuBLAS handle bound to a stream, destroyed with it.
struct Handle {
    api: &'static Api,
    raw: cublas::Handle,
}

impl Drop for Handle {
    fn drop(&mut self) {
        // SAFETY: a handle made by `cublasCreate_v2` and not destroyed before; its status is of
        // no use while dropping.
        unsafe { (self.api.destroy)(self.raw) };
    }
}

impl Matmul {
    /// The CPU backend ([`MatmulBackend::Cpu`]).
    pub fn cpu() -> Self {
        Self { inner: Inner::Cpu }
    }

    /// cuBLAS on `ctx`'s stream, so that its products are ordered with the context's kernels.
    /// The math mode is set to `CUBLAS_DEFAULT_MATH`, whose SGEMM computes in plain `f32` (TF32
    /// tensor cores only with `CUBLAS_TF32_TENSOR_OP_MATH`).
    ///
    /// # Errors
    /// [`Error::NotOnEmulator`] on the CPU emulator; [`Error::Cublas`] when the cuBLAS library
    /// cannot be loaded (the message says where it was looked for) or the handle cannot be made.
    pub fn cublas(ctx: &Context) -> Result<Self> {
        let stream = ctx.cuda_stream().ok_or(Error::NotOnEmulator("cuBLAS"))?.clone();
        let api = cublas::api().map_err(Error::Cublas)?;
        let mut raw: cublas::Handle = std::ptr::null_mut();
        // SAFETY: cuBLAS writes a new handle to `raw`; the context of `stream` is current on this
        // thread (cudarc made it so when the context opened).
        cublas::check(unsafe { (api.create)(&mut raw) }, "cublasCreate").map_err(Error::Cublas)?;
        let blas = Handle { api, raw };
        // SAFETY: a valid handle and the context's live stream.
        cublas::check(unsafe { (api.set_stream)(blas.raw, stream.cu_stream()) }, "cublasSetStream")
            .and_then(|()| {
                // SAFETY: a valid handle.
                cublas::check(unsafe { (api.set_math_mode)(blas.raw, cublas::DEFAULT_MATH) }, "cublasSetMathMode")
            })
            .map_err(Error::Cublas)?;
        Ok(Self { inner: Inner::Cublas { blas, stream } })
    }

    /// The cuBLAS library in use (its file, or the name the system's loader resolved), or `None`
    /// for the CPU backend.
    pub fn library(&self) -> Option<&str> {
        match &self.inner {
            Inner::Cublas { blas, .. } => Some(&blas.api.source),
            Inner::Cpu => None,
        }
    }

    /// Where this computes.
    pub fn backend(&self) -> MatmulBackend {
        match self.inner {
            Inner::Cublas { .. } => MatmulBackend::Cublas,
            Inner::Cpu => MatmulBackend::Cpu,
        }
    }

    /// `Y = X Wᵀ + b`: X `[rows, k]`, W `[n, k]` (PyTorch's `nn.Linear` weight layout), b `[n]`;
    /// returns Y `[rows, n]`, all row-major `f32`.
    ///
    /// # Errors
    /// [`Error::Length`] when a slice does not match the sizes; [`Error::Shape`] when a size
    /// exceeds cuBLAS's 32-bit dimensions; [`Error::Driver`] or [`Error::Cublas`] on the GPU.
    pub fn linear(&self, x: &[f32], w: &[f32], b: &[f32], rows: usize, k: usize, n: usize) -> Result<Vec<f32>> {
        for (got, expected) in [(x.len(), rows * k), (w.len(), n * k), (b.len(), n)] {
            if got != expected {
                return Err(Error::Length { expected, got });
            }
        }
        match &self.inner {
            Inner::Cpu => Ok(linear_cpu(x, w, b, rows, k, n)),
            Inner::Cublas { blas, stream } => linear_cublas(blas, stream, x, w, b, (rows, k, n)),
        }
    }
}

/// `Y = X Wᵀ + b` on the CPU (rows in parallel), each element a dot product accumulated in `f64`
/// and rounded once; sizes as [`Matmul::linear`], which checks them.
fn linear_cpu(x: &[f32], w: &[f32], b: &[f32], rows: usize, k: usize, n: usize) -> Vec<f32> {
    let mut y = vec![0.0f32; rows * n];
    if k == 0 {
        y.chunks_mut(n.max(1)).for_each(|row| row.copy_from_slice(&b[..row.len()]));
        return y;
    }
    y.par_chunks_mut(n.max(1)).zip(x.par_chunks(k)).for_each(|(y_row, x_row)| {
        for ((out, w_row), &bias) in y_row.iter_mut().zip(w.chunks_exact(k)).zip(b) {
            let dot: f64 = x_row.iter().zip(w_row).map(|(&a, &c)| a as f64 * c as f64).sum();
            *out = (dot + bias as f64) as f32;
        }
    });
    y
}

/// `Y = X Wᵀ + b` with one SGEMM. cuBLAS is column-major: the row-major `[r, c]` buffers read as
/// column-major are the transposes, so Yᵀ (`[n, rows]` column-major, which is Y row-major) =
/// W Xᵀ = op(W as stored, transposed) · X as stored, with C starting as b broadcast and β = 1.
fn linear_cublas(
    blas: &Handle,
    stream: &Arc<CudaStream>,
    x: &[f32],
    w: &[f32],
    b: &[f32],
    (rows, k, n): (usize, usize, usize),
) -> Result<Vec<f32>> {
    let dim = |v: usize| i32::try_from(v).map_err(|_| Error::Shape(format!("{v} exceeds cuBLAS's 32-bit sizes")));
    let (m_, n_, k_) = (dim(n)?, dim(rows)?, dim(k)?);
    if rows == 0 || n == 0 {
        return Ok(Vec::new());
    }
    let x_dev = stream.clone_htod(x).during("uploading a matrix for cuBLAS")?;
    let w_dev = stream.clone_htod(w).during("uploading a matrix for cuBLAS")?;
    let bias: Vec<f32> = (0..rows).flat_map(|_| b.iter().copied()).collect();
    let mut y_dev = stream.clone_htod(&bias).during("uploading a matrix for cuBLAS")?;
    {
        let (w_ptr, _w_sync) = w_dev.device_ptr(stream);
        let (x_ptr, _x_sync) = x_dev.device_ptr(stream);
        let (y_ptr, _y_sync) = y_dev.device_ptr_mut(stream);
        let (alpha, beta) = (1.0f32, 1.0f32);
        // SAFETY: W is n × k (read as k × n column-major, lda = k), X is rows × k (k × rows,
        // ldb = k), Y is rows × n (n × rows, ldc = n): every buffer holds exactly what the sizes
        // say, and all three live on the handle's stream until the copy back below.
        let status = unsafe {
            (blas.api.sgemm)(
                blas.raw,
                cublas::OP_T,
                cublas::OP_N,
                m_,
                n_,
                k_,
                &alpha,
                w_ptr as *const f32,
                k_.max(1),
                x_ptr as *const f32,
                k_.max(1),
                &beta,
                y_ptr as *mut f32,
                m_,
            )
        };
        cublas::check(status, &format!("SGEMM [{rows}, {k}] × [{n}, {k}]ᵀ")).map_err(Error::Cublas)?;
    }
    stream.clone_dtoh(&y_dev).during("copying a cuBLAS result to the host")
}
