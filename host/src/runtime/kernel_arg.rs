//! **Runtime layer.** What can be passed to a kernel ([`KernelArg`]): scalars and device
//! tensors here, tensor maps in [`super::tensor_map`]; each pushes itself onto a CUDA launch or
//! turns into the emulator's argument.

use attn_kernels::emu::Arg;
use cudarc::driver::PushKernelArg;

use super::tensor::{DeviceTensor, Storage};
use crate::dtype::{DType, Element};
use crate::error::{Error, Result};

/// A value that can be passed to a kernel: a tensor (its address) or a scalar.
pub(crate) trait KernelArg {
    /// Pushes the value onto a CUDA launch.
    fn push<'a>(&'a self, builder: &mut cudarc::driver::LaunchArgs<'a>) -> Result<()>;
    /// The value as the emulator passes it.
    fn emulated(&self) -> Result<Arg>;
}

macro_rules! scalar_kernel_arg {
    ($($t:ty => $variant:ident),*) => {$(
        impl KernelArg for $t {
            fn push<'a>(&'a self, builder: &mut cudarc::driver::LaunchArgs<'a>) -> Result<()> {
                builder.arg(self);
                Ok(())
            }

            fn emulated(&self) -> Result<Arg> {
                Ok(Arg::$variant(*self))
            }
        }
    )*};
}
scalar_kernel_arg!(f32 => F32, usize => Usize, isize => Isize);

impl<T: Element> KernelArg for DeviceTensor<T> {
    fn push<'a>(&'a self, builder: &mut cudarc::driver::LaunchArgs<'a>) -> Result<()> {
        match self.storage() {
            Storage::Cuda(data) => {
                builder.arg(data);
                Ok(())
            }
            Storage::Host(_) => Err(Error::Shape("an emulator tensor was passed to a GPU kernel".into())),
        }
    }

    fn emulated(&self) -> Result<Arg> {
        match self.storage() {
            // The emulated kernels take 16-bit tensors as raw bits.
            Storage::Host(data) => Ok(match T::DTYPE {
                DType::F32 => Arg::Ptr(data.as_ptr() as *mut f32),
                DType::F16 | DType::Bf16 => Arg::Ptr16(data.as_ptr() as *mut u16),
            }),
            Storage::Cuda(_) => Err(Error::Shape("a GPU tensor was passed to an emulated kernel".into())),
        }
    }
}
