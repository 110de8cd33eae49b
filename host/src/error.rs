//! The one error type of the host crate.

use cudarc::driver::DriverError;

/// Everything that can go wrong in this crate. Messages name the argument at fault and, where
/// there is a choice, the values that are allowed.
///
/// Fields carry the values the message names; they are there for programs that react to them.
///
/// New variants may come (`#[non_exhaustive]`): a `match` outside this crate needs a `_` arm.
#[derive(Debug, thiserror::Error)]
#[allow(missing_docs)] // the fields are described by each variant's message
#[non_exhaustive]
pub enum Error {
    /// The CUDA driver library (`libcuda.so` / `nvcuda.dll`) could not be loaded: no NVIDIA
    /// driver is installed on this machine.
    #[error("no CUDA driver: the NVIDIA driver library (libcuda) could not be loaded")]
    NoDriver,

    /// The driver is there but reports no device with this ordinal.
    #[error("no CUDA device {ordinal}: the driver reports {count} device(s)")]
    NoDevice { ordinal: usize, count: usize },

    /// The device is older than the PTX this crate carries can run on.
    #[error("{name} has compute capability {major}.{minor}; these kernels need {needed} or newer")]
    UnsupportedDevice { name: String, major: i32, minor: i32, needed: &'static str },

    /// A CUDA driver call failed; `during` says which step.
    #[error("CUDA error while {during}: {source}")]
    Driver {
        during: String,
        #[source]
        source: DriverError,
    },

    /// A tensor has the wrong rank or a dimension that disagrees with another tensor.
    #[error("shape error: {0}")]
    Shape(String),

    /// A tensor was made by another context than the one asked to use it.
    #[error(
        "tensor `{tensor}` belongs to another context than this one ({context}); copy it to the host and upload it here"
    )]
    ForeignTensor { tensor: &'static str, context: String },

    /// The operation needs a GPU; the CPU emulator cannot do it.
    #[error("{0} is not available on the CPU emulator")]
    NotOnEmulator(&'static str),

    /// An emulated kernel failed: a shared-memory race or out-of-bounds access, a barrier that
    /// not every thread reached, or a panic; the message names the kernel, block and thread.
    #[error(transparent)]
    Emulated(Box<attn_kernels::emu::EmuError>),

    /// A host slice has a different length from the tensor it is copied into or out of.
    #[error("length mismatch: the tensor holds {expected} elements, the host data {got}")]
    Length { expected: usize, got: usize },

    /// No FlashAttention kernel was compiled for this head dimension, whatever the tile.
    #[error("no flash kernels for head_dim={head_dim}; head_dim {allowed} (the f32 naive kernels take any head_dim)")]
    HeadDimNotCompiled { head_dim: usize, allowed: String },

    /// No kernel was compiled for this tile shape (and pipeline stages) and head dimension.
    #[error(
        "no flash {kernel} kernel for block_m={block_m}, block_n={block_n}, stages={stages}, \
         head_dim={head_dim}; compiled: {allowed}"
    )]
    TileNotCompiled { kernel: String, block_m: usize, block_n: usize, stages: usize, head_dim: usize, allowed: String },

    /// The softmax scale is NaN or infinite.
    #[error("the softmax scale must be finite; got {scale}")]
    InvalidScale { scale: f32 },

    /// A score modification ([`crate::ScoreMod`]) with a bad parameter, or one the chosen
    /// kernels do not take.
    #[error("score modification: {0}")]
    ScoreMod(String),

    /// Attention sinks ([`crate::Sinks`]) of the wrong shape or context, or given to an entry
    /// point that does not take them.
    #[error("attention sinks: {0}")]
    Sinks(String),

    /// An additive bias ([`crate::Bias`]) or its gradient of the wrong shape or context, or given
    /// to an entry point or together with an option that does not take it.
    #[error("bias: {0}")]
    Bias(String),

    /// A mask given per token ([`crate::MaskTable`]: documents, prefix-LM, varlen) with bad input, made
    /// for another shape or context, or given to an entry point that does not take it.
    #[error("mask table: {0}")]
    MaskTable(String),

    /// The tile needs more shared memory per block than the device has.
    #[error(
        "the flash {kernel} kernel with block_m={block_m}, block_n={block_n} at head_dim={head_dim} \
         needs {needed} bytes of shared memory per block; {device} allows {available}; tiles that \
         fit: {fitting}"
    )]
    SharedMemory {
        kernel: String,
        block_m: usize,
        block_n: usize,
        head_dim: usize,
        needed: usize,
        available: usize,
        device: String,
        fitting: String,
    },

    /// The device lacks a feature this call needs.
    #[error("{device} does not support {what}")]
    Unsupported { what: &'static str, device: String },

    /// The tuned-tiles file (`rust-attention --tune`) could not be read, parsed or written.
    #[error("tuned tiles file {}: {reason}", path.display())]
    TunedTiles { path: std::path::PathBuf, reason: String },

    /// A tensor file (`.npy`, `.safetensors`; see [`crate::io`]) could not be read or written, or
    /// a tensor in it is not what was asked for: an unsupported dtype, the wrong rank or shape, a
    /// missing tensor, a truncated or corrupt file. `tensor` is `None` only for what concerns the
    /// whole file (e.g. a safetensors header that does not parse).
    #[error("tensor file `{path}`{}: {reason}", tensor_part(.tensor))]
    TensorFile { path: String, tensor: Option<String>, reason: String },

    /// Arguments that no operation accepts together, e.g. the naive kernels (`f32` only) with a
    /// 16-bit element type.
    #[error("invalid arguments: {0}")]
    Argument(String),

    /// An image could not be read, decoded or written (`vit`).
    #[error("image {path}: {reason}")]
    Image { path: String, reason: String },

    /// A vision-transformer configuration or option that cannot work (`vit`).
    #[error("vit: {0}")]
    Vit(String),

    /// cuBLAS could not be loaded or a cuBLAS call failed; the message says which step.
    #[error("cuBLAS: {0}")]
    Cublas(String),

    /// Rows of the main job or of `attn --check` whose errors against the `f64` reference exceed
    /// the test suite's tolerances (`check::Tolerance`), or whose kernel failed to run.
    #[error("{failed} of {rows} rows FAIL: {what}")]
    CheckFailed { failed: usize, rows: usize, what: &'static str },
}

/// The device crate's shape check ([`crate::AttentionShape::from_qkv`]) as an [`Error::Shape`],
/// so that `?` works in functions that return this crate's [`Result`].
impl From<crate::layout::ShapeError> for Error {
    fn from(error: crate::layout::ShapeError) -> Self {
        Self::Shape(error.to_string())
    }
}

impl Error {
    /// Whether this is the driver running out of device memory (an allocation that did not fit):
    /// the caller can free memory or try a smaller problem; nothing else went wrong.
    pub fn is_out_of_memory(&self) -> bool {
        matches!(
            self,
            Self::Driver { source, .. }
                if source.0 == cudarc::driver::sys::cudaError_enum::CUDA_ERROR_OUT_OF_MEMORY
        )
    }
}

/// `Result` with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// ", tensor `q`" for [`Error::TensorFile`]'s message, or nothing.
fn tensor_part(tensor: &Option<String>) -> String {
    tensor.as_ref().map(|name| format!(", tensor `{name}`")).unwrap_or_default()
}

/// Attaches "what we were doing" to driver errors: `stream.synchronize().during("…")?`.
pub(crate) trait During<T> {
    fn during(self, what: impl Into<String>) -> Result<T>;
}

impl<T> During<T> for Result<T, DriverError> {
    fn during(self, what: impl Into<String>) -> Result<T> {
        self.map_err(|source| Error::Driver { during: what.into(), source })
    }
}
