//! **Runtime layer**: what needs a device (or the emulator) to exist. Above the base types
//! ([`crate::error`], [`crate::dtype`], [`crate::device`], [`crate::problem`]) and the registry
//! and selection policy ([`crate::kernels`], [`crate::select`]); below the operations
//! ([`crate::ops`]), which it does not know.
//!
//! | module | owns |
//! |---|---|
//! | `tensor` | [`DeviceTensor`]: device memory (or the emulator's host buffer) with a shape |
//! | `kernel_arg` | `KernelArg`: scalars and tensors as kernel arguments |
//! | `tensor_map` | [`TensorMap`] and the tensor-map cache of the Hopper kernels' TMA loads |
//! | `context` | [`Context`]: opening the device, loading the PTX, allocating, launching, the kernel path |
//! | `mask_table` | [`MaskTable`]: masks given per token (documents, prefix-LM, varlen batches) as band tables on a device |
//! | [`timing`] | CUDA-event timing |
//!
//! Inside the folder the order is `tensor` < `kernel_arg` < `tensor_map` < `context` <
//! `mask_table` < `timing` (each uses only those before it).

mod context;
mod kernel_arg;
mod mask_table;
mod tensor;
mod tensor_map;
pub mod timing;

pub use context::Context;
pub(crate) use kernel_arg::{KernelArg, NullPointer};
pub use mask_table::MaskTable;
pub use tensor::DeviceTensor;
pub use tensor_map::TensorMap;
