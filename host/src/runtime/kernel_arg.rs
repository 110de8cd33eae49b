//! **Runtime layer.** What can be passed to a kernel ([`KernelArg`]): scalars and device
//! tensors here, tensor maps in [`super::tensor_map`]; each pushes itself onto a CUDA launch or
//! turns into the emulator's argument.

use attn_kernels::emu::Arg;
use cudarc::driver::PushKernelArg;

use super::tensor::{DeviceTensor, Storage};
use crate::dtype::Scalar;
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

impl<T: Scalar> KernelArg for DeviceTensor<T> {
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
            // The emulated kernels take 16-bit tensors as raw bits, `i32` ones as `u32`.
            Storage::Host(data) => Ok(emulated_pointer(T::NAME, data.as_ptr() as *mut u8)),
            Storage::Cuda(_) => Err(Error::Shape("a GPU tensor was passed to an emulated kernel".into())),
        }
    }
}

/// The emulator's pointer argument for a buffer of the scalar type named `name`.
fn emulated_pointer(name: &str, ptr: *mut u8) -> Arg {
    match name {
        "f32" => Arg::Ptr(ptr as *mut f32),
        "i32" => Arg::PtrU32(ptr as *mut u32),
        _ => Arg::Ptr16(ptr as *mut u16),
    }
}

/// A null pointer in place of an optional tensor the kernel does not read (a decoder's
/// sequence lengths or page table when there are none, its partial results with one split):
/// `f32`, 16-bit or `u32` as the kernel's parameter is.
#[derive(Clone, Copy)]
pub(crate) struct NullPointer(pub(crate) &'static str);

impl KernelArg for NullPointer {
    fn push<'a>(&'a self, builder: &mut cudarc::driver::LaunchArgs<'a>) -> Result<()> {
        builder.arg(&0u64);
        Ok(())
    }

    fn emulated(&self) -> Result<Arg> {
        Ok(emulated_pointer(self.0, std::ptr::null_mut()))
    }
}

/// A mask table: its address (see [`crate::MaskTableRef`]), a `u32` pointer.
impl KernelArg for crate::problem::MaskTableRef<'_> {
    fn push<'a>(&'a self, builder: &mut cudarc::driver::LaunchArgs<'a>) -> Result<()> {
        builder.arg(&self.address);
        Ok(())
    }

    fn emulated(&self) -> Result<Arg> {
        Ok(Arg::PtrU32(self.address as *mut u32))
    }
}

/// Attention sinks: their address (see [`crate::Sinks`]), an `f32` pointer.
impl KernelArg for crate::problem::Sinks<'_> {
    fn push<'a>(&'a self, builder: &mut cudarc::driver::LaunchArgs<'a>) -> Result<()> {
        builder.arg(&self.address);
        Ok(())
    }

    fn emulated(&self) -> Result<Arg> {
        Ok(Arg::Ptr(self.address as *mut f32))
    }
}

/// An additive bias: its address (see [`crate::Bias`]), an `f32` pointer.
impl KernelArg for crate::problem::Bias<'_> {
    fn push<'a>(&'a self, builder: &mut cudarc::driver::LaunchArgs<'a>) -> Result<()> {
        builder.arg(&self.address);
        Ok(())
    }

    fn emulated(&self) -> Result<Arg> {
        Ok(Arg::Ptr(self.address as *mut f32))
    }
}
