//! The matrix products outside attention (patch embedding, QKV and output projections):
//! `Y = X Wᵀ + b`, on the GPU with cuBLAS's SGEMM through cudarc (a well-kept library; these are
//! not our kernels), on the CPU with rayon.

use std::sync::Arc;

use cudarc::cublas::sys::{cublasMath_t, cublasOperation_t};
use cudarc::cublas::{CudaBlas, Gemm, GemmConfig};
use cudarc::driver::CudaStream;
use rayon::prelude::*;

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
    Cublas { blas: CudaBlas, stream: Arc<CudaStream> },
    Cpu,
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
        // SAFETY: only tries to open the library; `CudaBlas::new` would panic without it. (Linked
        // rather than loaded, the library was there when the program started.)
        #[cfg(feature = "dynamic-loading")]
        if !unsafe { cudarc::cublas::sys::is_culib_present() } {
            return Err(Error::Cublas(missing_library_message()));
        }
        let blas = CudaBlas::new(stream.clone()).map_err(|e| Error::Cublas(format!("creating a handle: {e}")))?;
        // SAFETY: a valid handle made just above.
        unsafe { cudarc::cublas::sys::cublasSetMathMode(*blas.handle(), cublasMath_t::CUBLAS_DEFAULT_MATH) }
            .result()
            .map_err(|e| Error::Cublas(format!("setting the math mode: {e}")))?;
        Ok(Self { inner: Inner::Cublas { blas, stream } })
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
    blas: &CudaBlas,
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
    let config = GemmConfig {
        transa: cublasOperation_t::CUBLAS_OP_T,
        transb: cublasOperation_t::CUBLAS_OP_N,
        m: m_,
        n: n_,
        k: k_,
        alpha: 1.0f32,
        lda: k_.max(1),
        ldb: k_.max(1),
        beta: 1.0f32,
        ldc: m_,
    };
    // SAFETY: W is n × k (read as k × n column-major, lda = k), X is rows × k (k × rows, ldb = k),
    // Y is rows × n (n × rows, ldc = n): every buffer holds exactly what the sizes say.
    unsafe { blas.gemm(config, &w_dev, &x_dev, &mut y_dev) }
        .map_err(|e| Error::Cublas(format!("SGEMM [{rows}, {k}] × [{n}, {k}]ᵀ: {e}")))?;
    stream.clone_dtoh(&y_dev).during("copying a cuBLAS result to the host")
}

/// Why cuBLAS is missing and what to do, naming any copy of the library in the usual places.
#[cfg(feature = "dynamic-loading")]
fn missing_library_message() -> String {
    let tried = cudarc::get_lib_name_candidates("cublas");
    let mut dirs: Vec<std::path::PathBuf> = ["CUDA_HOME", "CUDA_PATH"]
        .iter()
        .filter_map(std::env::var_os)
        .flat_map(|root| [std::path::Path::new(&root).join("lib64"), std::path::Path::new(&root).join("lib")])
        .collect();
    dirs.extend(["/usr/local/cuda/lib64", "/usr/local/cuda/targets/x86_64-linux/lib"].map(Into::into));
    let found: Vec<String> = dirs
        .iter()
        .filter_map(|dir| std::fs::read_dir(dir).ok())
        .flatten()
        .flatten()
        .map(|entry| entry.path())
        .filter(|path| path.file_name().is_some_and(|name| name.to_string_lossy().starts_with("libcublas.so")))
        .map(|path| path.display().to_string())
        .collect();
    let hint = if found.is_empty() {
        "none found in $CUDA_HOME, $CUDA_PATH or /usr/local/cuda".to_string()
    } else {
        format!(
            "found {}: put a `libcublas.so` link to it in a folder on LD_LIBRARY_PATH (cudarc only loads the names \
             above)",
            found.join(", ")
        )
    };
    format!(
        "the cuBLAS library could not be loaded (looked for {}); {hint} (`scripts/with-cublas COMMAND` looks in more places and sets this up)",
        tried.join(", ")
    )
}
