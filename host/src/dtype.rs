//! **Base layer.** Element types of device tensors: `f32`, and the two 16-bit formats the
//! tensor-core kernels take, IEEE half ([`half::f16`]) and bfloat16 ([`half::bf16`]); and
//! [`HostData`], values of one of them in host memory. Imports nothing of this crate.

use cudarc::driver::{DeviceRepr, ValidAsZeroBits};

/// The element type of a tensor, as a value (for messages, tables and kernel lookup).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DType {
    /// 32-bit IEEE float: the f32 kernels (CUDA cores).
    F32,
    /// 16-bit IEEE half (5 exponent bits, 10 mantissa bits; largest finite 65504): tensor cores.
    F16,
    /// bfloat16 (8 exponent bits, 7 mantissa bits; the range of `f32`): tensor cores.
    Bf16,
}

impl DType {
    /// Bytes per element.
    pub const fn size(self) -> usize {
        match self {
            Self::F32 => 4,
            Self::F16 | Self::Bf16 => 2,
        }
    }

    /// The name used in kernel names, tables and on the command line: `f32`, `f16`, `bf16`.
    pub const fn name(self) -> &'static str {
        match self {
            Self::F32 => "f32",
            Self::F16 => "f16",
            Self::Bf16 => "bf16",
        }
    }

    /// Every type, in the order above.
    pub const ALL: [Self; 3] = [Self::F32, Self::F16, Self::Bf16];
}

impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for DType {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        Self::ALL.into_iter().find(|d| d.name() == s).ok_or_else(|| format!("`{s}` is not one of f32, f16, bf16"))
    }
}

/// Values in host memory, in one of the three element types: the data of a file-level tensor
/// ([`HostTensor`](crate::io::HostTensor)).
#[derive(Clone, Debug, PartialEq)]
pub enum HostData {
    /// 32-bit floats.
    F32(Vec<f32>),
    /// IEEE half floats.
    F16(Vec<half::f16>),
    /// bfloat16.
    Bf16(Vec<half::bf16>),
}

#[cfg_attr(not(feature = "io"), allow(dead_code))] // the file readers' and writers' helpers
impl HostData {
    /// The element type of the values.
    pub(crate) fn dtype(&self) -> DType {
        match self {
            Self::F32(_) => DType::F32,
            Self::F16(_) => DType::F16,
            Self::Bf16(_) => DType::Bf16,
        }
    }

    /// Number of values.
    pub(crate) fn len(&self) -> usize {
        match self {
            Self::F32(v) => v.len(),
            Self::F16(v) => v.len(),
            Self::Bf16(v) => v.len(),
        }
    }
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for half::f16 {}
    impl Sealed for half::bf16 {}
    impl Sealed for i32 {}
}

/// A type a [`crate::DeviceTensor`] can hold (sealed): the [`Element`]s the attention kernels
/// compute on, and `i32` for the index tensors of a KV cache (sequence lengths, page tables; the
/// layout PyTorch and FlashAttention give them).
pub trait Scalar: sealed::Sealed + DeviceRepr + ValidAsZeroBits + Copy + Default + Send + Sync + 'static {
    /// The type's name in messages: `f32`, `f16`, `bf16`, `i32`.
    const NAME: &'static str;
    /// A value that shows when a kernel failed to write an element: NaN, or `i32::MIN`.
    const POISON: Self;
}

impl Scalar for f32 {
    const NAME: &'static str = "f32";
    const POISON: Self = f32::NAN;
}

impl Scalar for half::f16 {
    const NAME: &'static str = "f16";
    const POISON: Self = half::f16::NAN;
}

impl Scalar for half::bf16 {
    const NAME: &'static str = "bf16";
    const POISON: Self = half::bf16::NAN;
}

impl Scalar for i32 {
    const NAME: &'static str = "i32";
    const POISON: Self = i32::MIN;
}

/// A type a [`crate::DeviceTensor`] can hold: `f32`, [`half::f16`] or [`half::bf16`] (sealed).
/// Conversions round to nearest, ties to even; widening to `f32` is exact.
pub trait Element: Scalar {
    /// The type as a value.
    const DTYPE: DType;
    /// Rounds an `f32` to this type.
    fn from_f32(x: f32) -> Self;
    /// Widens to `f32` (exact).
    fn to_f32(self) -> f32;
    /// Wraps values of this type, without copying, as file-level tensor data.
    fn into_host_data(values: Vec<Self>) -> HostData;
    /// The values of `data`, if they are of this type.
    fn host_slice(data: &HostData) -> Option<&[Self]>;
}

/// The [`Element`] methods that name a [`HostData`] variant: one line per type.
macro_rules! host_data_variant {
    ($variant:ident) => {
        fn into_host_data(values: Vec<Self>) -> HostData {
            HostData::$variant(values)
        }
        fn host_slice(data: &HostData) -> Option<&[Self]> {
            match data {
                HostData::$variant(values) => Some(values),
                _ => None,
            }
        }
    };
}

impl Element for f32 {
    const DTYPE: DType = DType::F32;
    host_data_variant!(F32);
    fn from_f32(x: f32) -> Self {
        x
    }
    fn to_f32(self) -> f32 {
        self
    }
}

impl Element for half::f16 {
    const DTYPE: DType = DType::F16;
    host_data_variant!(F16);
    fn from_f32(x: f32) -> Self {
        half::f16::from_f32(x)
    }
    fn to_f32(self) -> f32 {
        half::f16::to_f32(self)
    }
}

impl Element for half::bf16 {
    const DTYPE: DType = DType::Bf16;
    host_data_variant!(Bf16);
    fn from_f32(x: f32) -> Self {
        half::bf16::from_f32(x)
    }
    fn to_f32(self) -> f32 {
        half::bf16::to_f32(self)
    }
}

/// Rounds every value to `T`.
pub fn from_f32_slice<T: Element>(values: &[f32]) -> Vec<T> {
    values.iter().map(|&x| T::from_f32(x)).collect()
}

/// Widens every value to `f32` (exact).
pub fn to_f32_vec<T: Element>(values: &[T]) -> Vec<f32> {
    values.iter().map(|&x| x.to_f32()).collect()
}
