//! **Top layer.** Tensors in files: NumPy's `.npy` and Hugging Face's `.safetensors`, read into and written from
//! [`HostTensor`]s (a name, a shape and the values in host memory), which move to and from
//! [`DeviceTensor`]s. This is how tensors made by PyTorch, JAX or NumPy reach the kernels and how
//! their results go back (the `attn` subcommand, `cli::attn`).
//!
//! Tensors are row-major (C order), shapes outermost first; attention inputs are `[batch, heads,
//! seqlen, head_dim]`. Element types:
//!
//! | type | `.npy` | `.safetensors` |
//! |---|---|---|
//! | `f32` | `<f4` (float32) | `F32` |
//! | `f16` | `<f2` (float16) | `F16` |
//! | `bf16` | `<u2` (uint16) holding the bit patterns, in a file named `NAME.bf16.npy` | `BF16` |
//!
//! **bf16 in `.npy`.** NumPy has no bfloat16 type, and the `.npy` header has no room for a note
//! (NumPy refuses headers with keys other than its three). So a bf16 tensor is stored as the
//! `uint16` array of its bit patterns, and the file name carries the type: `NAME.bf16.npy`.
//! Both directions hold to it: [`read_npy`] reads a `NAME.bf16.npy` file as bf16 and refuses one
//! whose dtype is not `<u2`, and refuses a `<u2` file without the `.bf16` mark (its numbers could
//! be anything); [`write_npy`] writes a bf16 tensor only to a `.bf16.npy` name and other types only
//! to other names. In PyTorch: `torch.from_numpy(np.load(p).view(np.int16)).view(torch.bfloat16)`
//! reads such a file, `np.save(p, t.view(torch.int16).numpy().view(np.uint16))` writes one.
//!
//! Big-endian `.npy` files are read (and converted); files are written little-endian. Fortran-order
//! `.npy` files, other dtypes (e.g. float64) and pickled arrays are refused with an error that
//! says what the file holds. Every error is an [`Error::TensorFile`] that names the file and,
//! where there is one, the tensor; a failed write leaves no partial file of ours behind (the
//! whole file is encoded in memory first).

use std::path::{Path, PathBuf};

use half::{bf16, f16};
use npyz::WriterBuilder;
use safetensors::{Dtype as StDtype, SafeTensorError, SafeTensors, tensor::TensorView};

pub use crate::dtype::HostData;
use crate::dtype::{DType, Element};
use crate::error::{Error, Result};
use crate::runtime::{Context, DeviceTensor};

/// A tensor in host memory: a name (the safetensors key, or the role it is read as), a shape
/// (outermost first) and row-major values of one [`DType`]. The number of values always equals
/// the product of the shape.
#[derive(Clone, Debug, PartialEq)]
pub struct HostTensor {
    name: String,
    shape: Vec<usize>,
    data: HostData,
}

impl HostTensor {
    /// A tensor of `values` (row-major) with this shape.
    ///
    /// # Errors
    /// [`Error::Length`] when `values.len()` is not the product of `shape`.
    pub fn new<T: Element>(name: impl Into<String>, shape: &[usize], values: Vec<T>) -> Result<Self> {
        Self::from_data(name, shape, T::into_host_data(values))
    }

    /// A tensor of `data` with this shape.
    ///
    /// # Errors
    /// [`Error::Length`] when the number of values is not the product of `shape`.
    pub fn from_data(name: impl Into<String>, shape: &[usize], data: HostData) -> Result<Self> {
        let expected = shape.iter().try_fold(1usize, |n, &d| n.checked_mul(d)).unwrap_or(usize::MAX);
        if data.len() != expected {
            return Err(Error::Length { expected, got: data.len() });
        }
        Ok(Self { name: name.into(), shape: shape.to_vec(), data })
    }

    /// `f64` values rounded once to `dtype` (round to nearest, ties to even), e.g. a CPU reference
    /// result to be written in the inputs' type.
    ///
    /// # Errors
    /// [`Error::Length`] as [`HostTensor::new`].
    pub fn from_f64(name: impl Into<String>, shape: &[usize], values: &[f64], dtype: DType) -> Result<Self> {
        let data = match dtype {
            DType::F32 => HostData::F32(values.iter().map(|&x| x as f32).collect()),
            DType::F16 => HostData::F16(values.iter().map(|&x| f16::from_f64(x)).collect()),
            DType::Bf16 => HostData::Bf16(values.iter().map(|&x| bf16::from_f64(x)).collect()),
        };
        Self::from_data(name, shape, data)
    }

    /// Copies a device tensor to the host (waiting for the kernels queued before).
    ///
    /// # Errors
    /// [`Error::Driver`] if the copy fails.
    pub fn from_device<T: Element>(name: impl Into<String>, tensor: &DeviceTensor<T>) -> Result<Self> {
        Self::new(name, tensor.shape(), tensor.to_host()?)
    }

    /// Copies the tensor to a new device tensor of `T` on `ctx`, rounding each value to `T` if
    /// the tensor holds another type (widening to `f32` is exact).
    ///
    /// # Errors
    /// As [`Context::upload`].
    pub fn upload<T: Element>(&self, ctx: &Context) -> Result<DeviceTensor<T>> {
        match self.as_slice::<T>() {
            Some(values) => ctx.upload(values, &self.shape),
            None => ctx.upload(&self.to_vec::<T>(), &self.shape),
        }
    }

    /// The name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The same tensor under another name.
    pub fn renamed(self, name: impl Into<String>) -> Self {
        Self { name: name.into(), ..self }
    }

    /// Dimensions, outermost first.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// The values.
    pub fn data(&self) -> &HostData {
        &self.data
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        self.data.dtype()
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.data.len()
    }

    /// Whether the tensor has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The values, if the tensor holds `T`.
    pub fn as_slice<T: Element>(&self) -> Option<&[T]> {
        T::host_slice(&self.data)
    }

    /// The values as `T`: a copy if the tensor holds `T`, otherwise each value rounded to `T`
    /// through `f32` (exact for every widening; one rounding for every narrowing).
    pub fn to_vec<T: Element>(&self) -> Vec<T> {
        if let Some(values) = self.as_slice::<T>() {
            return values.to_vec();
        }
        match &self.data {
            HostData::F32(v) => v.iter().map(|&x| T::from_f32(x)).collect(),
            HostData::F16(v) => v.iter().map(|&x| T::from_f32(x.to_f32())).collect(),
            HostData::Bf16(v) => v.iter().map(|&x| T::from_f32(x.to_f32())).collect(),
        }
    }

    /// The values widened to `f32` (exact).
    pub fn to_f32(&self) -> Vec<f32> {
        self.to_vec()
    }

    /// The tensor in `dtype` (see [`HostTensor::to_vec`]); a copy if it already is.
    pub fn converted(&self, dtype: DType) -> Self {
        let data = match dtype {
            DType::F32 => HostData::F32(self.to_vec()),
            DType::F16 => HostData::F16(self.to_vec()),
            DType::Bf16 => HostData::Bf16(self.to_vec()),
        };
        Self { name: self.name.clone(), shape: self.shape.clone(), data }
    }
}

/// Little-endian bytes of `data`, as both file formats store them.
fn le_bytes(data: &HostData) -> Vec<u8> {
    match data {
        HostData::F32(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        HostData::F16(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        HostData::Bf16(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
    }
}

/// An [`Error::TensorFile`].
fn file_error(path: &Path, tensor: Option<&str>, reason: impl Into<String>) -> Error {
    Error::TensorFile { path: path.display().to_string(), tensor: tensor.map(str::to_string), reason: reason.into() }
}

/// The extension `.bf16.npy` marks a bf16 tensor stored as its `uint16` bit patterns.
const BF16_NPY_SUFFIX: &str = ".bf16.npy";

/// The `.npy` file name of a tensor called `name` of type `dtype`: `NAME.npy`, or `NAME.bf16.npy`
/// for bf16 (see the module documentation).
pub fn npy_file_name(name: &str, dtype: DType) -> String {
    if dtype == DType::Bf16 { format!("{name}{BF16_NPY_SUFFIX}") } else { format!("{name}.npy") }
}

/// The tensor name of a `.npy` path (the file name without `.npy` or `.bf16.npy`) and whether it
/// carries the bf16 mark; `None` if the name does not end in `.npy`.
fn npy_name(path: &Path) -> Option<(String, bool)> {
    let file = path.file_name()?.to_str()?;
    if let Some(stem) = file.strip_suffix(BF16_NPY_SUFFIX) {
        return Some((stem.to_string(), true));
    }
    file.strip_suffix(".npy").map(|stem| (stem.to_string(), false))
}

/// Reads a `.npy` file; the tensor is named after the file (`q.npy` and `q.bf16.npy` give `q`).
///
/// # Errors
/// [`Error::TensorFile`] naming the file and the tensor when the file cannot be read, is not a
/// `.npy` file, holds a dtype other than those of the module table (or a `<u2` array without the
/// `.bf16.npy` mark, or a `.bf16.npy` file that is not `<u2`), is in Fortran order, or holds fewer
/// or more data bytes than its header's shape and dtype say (a truncated or damaged file).
pub fn read_npy(path: impl AsRef<Path>) -> Result<HostTensor> {
    let path = path.as_ref();
    let Some((name, bf16_mark)) = npy_name(path) else {
        return Err(file_error(path, None, "a .npy file name must end in `.npy` (or `.bf16.npy` for bf16)"));
    };
    let error = |reason: String| file_error(path, Some(&name), reason);
    let bytes = std::fs::read(path).map_err(|e| error(format!("cannot read the file: {e}")))?;
    let npy = npyz::NpyFile::new(&bytes[..]).map_err(|e| error(format!("not a valid .npy file: {e}")))?;
    let header = npy.header().clone();
    let descr = match header.dtype() {
        npyz::DType::Plain(type_str) => type_str,
        other => return Err(error(format!("structured dtype {} is not supported", other.descr()))),
    };
    let (kind, size) = (descr.type_char(), descr.size_field());
    let dtype = match (kind, size, bf16_mark) {
        (npyz::TypeChar::Float, 4, false) => DType::F32,
        (npyz::TypeChar::Float, 2, false) => DType::F16,
        (npyz::TypeChar::Uint, 2, true) => DType::Bf16,
        (_, _, true) => {
            return Err(error(format!(
                "a `.bf16.npy` file holds bf16 bit patterns as uint16 (<u2), but this one holds {descr}"
            )));
        }
        (npyz::TypeChar::Uint, 2, false) => {
            return Err(error(format!(
                "dtype {descr} (uint16): bf16 bit patterns are read only from a file named `{}`",
                npy_file_name(&name, DType::Bf16)
            )));
        }
        _ => {
            return Err(error(format!(
                "dtype {descr} is not supported; expected float32 (<f4), float16 (<f2), or bf16 bit \
                 patterns as uint16 (<u2) in a file named `{}`",
                npy_file_name(&name, DType::Bf16)
            )));
        }
    };
    let shape: Vec<usize> =
        header
            .shape()
            .iter()
            .map(|&d| usize::try_from(d))
            .collect::<std::result::Result<_, _>>()
            .map_err(|_| error(format!("shape {:?} does not fit this machine's memory", header.shape())))?;
    if header.order() == npyz::Order::Fortran && shape.iter().filter(|&&d| d > 1).count() > 1 {
        return Err(error(format!(
            "shape {shape:?} is stored in Fortran order; save a C-order copy (numpy.ascontiguousarray)"
        )));
    }
    let expected_bytes = shape
        .iter()
        .try_fold(dtype.size(), |n, &d| n.checked_mul(d))
        .ok_or_else(|| error(format!("shape {shape:?} has more elements than fit in memory")))?;
    let data = npy.into_inner();
    if data.len() != expected_bytes {
        let what = if data.len() < expected_bytes { "truncated" } else { "damaged" };
        return Err(error(format!(
            "{what} file: the header says {dtype} {shape:?}, {expected_bytes} bytes of data, but the file holds {} \
             after the header",
            data.len()
        )));
    }
    let npy = npyz::NpyFile::with_header(header, data);
    let values = match dtype {
        DType::F32 => npy.into_vec::<f32>().map(HostData::F32),
        DType::F16 => npy.into_vec::<f16>().map(HostData::F16),
        DType::Bf16 => {
            npy.into_vec::<u16>().map(|bits| HostData::Bf16(bits.into_iter().map(bf16::from_bits).collect()))
        }
    }
    .map_err(|e| error(format!("reading the data: {e}")))?;
    HostTensor::from_data(name.clone(), &shape, values).map_err(|e| error(e.to_string()))
}

/// Writes `tensor` as a `.npy` file (little-endian, C order; bf16 as `<u2` bit patterns).
///
/// # Errors
/// [`Error::TensorFile`] when `path` does not end in `.npy`, when a bf16 tensor's path does not
/// end in `.bf16.npy` or another type's does (see the module documentation; [`npy_file_name`]
/// gives the right name), or when the file cannot be written.
pub fn write_npy(path: impl AsRef<Path>, tensor: &HostTensor) -> Result<()> {
    let path = path.as_ref();
    let error = |reason: String| file_error(path, Some(tensor.name()), reason);
    let Some((_, bf16_mark)) = npy_name(path) else {
        return Err(error("a .npy file name must end in `.npy` (or `.bf16.npy` for bf16)".into()));
    };
    let is_bf16 = tensor.dtype() == DType::Bf16;
    if bf16_mark != is_bf16 {
        let wanted = if is_bf16 { "`.bf16.npy`, the mark of bf16 bit patterns" } else { "`.npy` but not `.bf16.npy`" };
        return Err(error(format!("a {} tensor's file name must end in {wanted}", tensor.dtype())));
    }
    let shape: Vec<u64> = tensor.shape().iter().map(|&d| d as u64).collect();
    let encoded = match tensor.data() {
        HostData::F32(v) => encode_npy(&shape, v.iter().copied()),
        HostData::F16(v) => encode_npy(&shape, v.iter().copied()),
        HostData::Bf16(v) => encode_npy(&shape, v.iter().map(|x| x.to_bits())),
    }
    .map_err(|e| error(format!("encoding: {e}")))?;
    std::fs::write(path, encoded).map_err(|e| error(format!("cannot write the file: {e}")))
}

/// A whole `.npy` file in memory: header for `shape` and `T`'s little-endian dtype, then `values`.
fn encode_npy<T: npyz::AutoSerialize>(shape: &[u64], values: impl IntoIterator<Item = T>) -> std::io::Result<Vec<u8>> {
    let mut buffer = Vec::new();
    let mut writer = npyz::WriteOptions::<T>::new().default_dtype().shape(shape).writer(&mut buffer).begin_nd()?;
    writer.extend(values)?;
    writer.finish()?;
    Ok(buffer)
}

/// Reads every tensor of a `.safetensors` file, in the order of their data in the file.
///
/// # Errors
/// [`Error::TensorFile`] when the file cannot be read or parsed, is truncated (naming the first
/// tensor whose data is cut off), or holds a tensor of a dtype other than F32, F16 and BF16
/// (naming it).
pub fn read_safetensors(path: impl AsRef<Path>) -> Result<Vec<HostTensor>> {
    let path = path.as_ref();
    let bytes = read_file(path, None)?;
    let file = parse_safetensors(path, &bytes)?;
    let (_, metadata) = SafeTensors::read_metadata(&bytes).map_err(|e| safetensors_error(path, &bytes, e))?;
    metadata.offset_keys().iter().map(|name| tensor_from_view(path, name, &file)).collect()
}

/// Reads the tensor called `name` from a `.safetensors` file.
///
/// # Errors
/// As [`read_safetensors`], and [`Error::TensorFile`] listing the file's tensors when it has
/// none called `name`.
pub fn read_safetensors_tensor(path: impl AsRef<Path>, name: &str) -> Result<HostTensor> {
    let mut tensors = read_safetensors_tensors(path, &[name])?;
    Ok(tensors.pop().expect("one tensor asked for"))
}

/// Reads the tensors called `names`, in that order, from a `.safetensors` file, parsing it once
/// (a model checkpoint from which a few tensors are wanted).
///
/// # Errors
/// As [`read_safetensors_tensor`], for the first name at fault.
pub fn read_safetensors_tensors(path: impl AsRef<Path>, names: &[&str]) -> Result<Vec<HostTensor>> {
    let path = path.as_ref();
    // A file that cannot be read concerns every tensor: name one only if one was asked for.
    let bytes = read_file(path, if let [name] = names { Some(*name) } else { None })?;
    let file = parse_safetensors(path, &bytes)?;
    names.iter().map(|name| tensor_from_view(path, name, &file)).collect()
}

/// Writes `tensors` to one `.safetensors` file (no `__metadata__`).
///
/// # Errors
/// [`Error::TensorFile`] when two tensors share a name or the file cannot be written.
pub fn write_safetensors(path: impl AsRef<Path>, tensors: &[HostTensor]) -> Result<()> {
    let path = path.as_ref();
    for (i, tensor) in tensors.iter().enumerate() {
        if tensors[..i].iter().any(|t| t.name() == tensor.name()) {
            return Err(file_error(path, Some(tensor.name()), "two tensors have this name"));
        }
    }
    let bytes: Vec<Vec<u8>> = tensors.iter().map(|t| le_bytes(t.data())).collect();
    let views = tensors
        .iter()
        .zip(&bytes)
        .map(|(t, data)| {
            let dtype = match t.dtype() {
                DType::F32 => StDtype::F32,
                DType::F16 => StDtype::F16,
                DType::Bf16 => StDtype::BF16,
            };
            TensorView::new(dtype, t.shape().to_vec(), data)
                .map(|view| (t.name().to_string(), view))
                .map_err(|e| file_error(path, Some(t.name()), e.to_string()))
        })
        .collect::<Result<Vec<_>>>()?;
    let encoded = safetensors::serialize(views, None).map_err(|e| file_error(path, None, format!("encoding: {e}")))?;
    std::fs::write(path, encoded).map_err(|e| file_error(path, None, format!("cannot write the file: {e}")))
}

/// Reads the tensor `name` from `path`: the named tensor of a `.safetensors` file, or the one
/// tensor of a `.npy` file, which is then called `name` (the role the caller reads it as, e.g.
/// `q`), whatever the file is called.
///
/// # Errors
/// As [`read_npy`] and [`read_safetensors_tensor`]; [`Error::TensorFile`] for another extension.
pub fn read_tensor(path: impl AsRef<Path>, name: &str) -> Result<HostTensor> {
    let path = path.as_ref();
    match path.extension().and_then(|e| e.to_str()) {
        // Errors too name the tensor by its role.
        Some("npy") => read_npy(path).map(|t| t.renamed(name)).map_err(|e| match e {
            Error::TensorFile { path, reason, .. } => Error::TensorFile { path, tensor: Some(name.into()), reason },
            other => other,
        }),
        Some("safetensors") => read_safetensors_tensor(path, name),
        _ => Err(file_error(path, Some(name), "unknown file type: expected a `.npy` or a `.safetensors` file")),
    }
}

/// Writes `tensors` to `out`: one `.safetensors` file if `out` ends in `.safetensors`, otherwise
/// a directory (created if missing) with one `.npy` file per tensor named by [`npy_file_name`].
/// Returns the paths written.
///
/// # Errors
/// As [`write_safetensors`] and [`write_npy`]; [`Error::TensorFile`] when the directory cannot
/// be created.
pub fn write_tensors(out: impl AsRef<Path>, tensors: &[HostTensor]) -> Result<Vec<PathBuf>> {
    let out = out.as_ref();
    if check_output_path(out)? {
        write_safetensors(out, tensors)?;
        return Ok(vec![out.to_path_buf()]);
    }
    std::fs::create_dir_all(out).map_err(|e| file_error(out, None, format!("cannot create the directory: {e}")))?;
    tensors
        .iter()
        .map(|t| {
            let path = out.join(npy_file_name(t.name(), t.dtype()));
            write_npy(&path, t).map(|()| path)
        })
        .collect()
}

/// Checks an output path of [`write_tensors`] before any work is done: `Ok(true)` for a
/// `.safetensors` file, `Ok(false)` for a directory (an existing one, or a new path without an
/// extension).
///
/// # Errors
/// [`Error::TensorFile`] for any other path (`out.npy`, `out.txt`): several tensors go to a
/// directory of `.npy` files or to one `.safetensors` file.
pub fn check_output_path(out: &Path) -> Result<bool> {
    match out.extension() {
        Some(e) if e == "safetensors" => Ok(true),
        Some(_) if !out.is_dir() => Err(file_error(
            out,
            None,
            "name a directory (for one .npy file per tensor) or a .safetensors file: several tensors are written",
        )),
        _ => Ok(false),
    }
}

fn read_file(path: &Path, tensor: Option<&str>) -> Result<Vec<u8>> {
    std::fs::read(path).map_err(|e| file_error(path, tensor, format!("cannot read the file: {e}")))
}

fn parse_safetensors<'a>(path: &Path, bytes: &'a [u8]) -> Result<SafeTensors<'a>> {
    SafeTensors::deserialize(bytes).map_err(|e| safetensors_error(path, bytes, e))
}

/// A safetensors tensor as a [`HostTensor`].
fn tensor_from_view(path: &Path, name: &str, file: &SafeTensors) -> Result<HostTensor> {
    let error = |reason: String| file_error(path, Some(name), reason);
    let view = file.tensor(name).map_err(|_| {
        let mut names = file.names();
        names.sort_unstable();
        error(format!("no such tensor; the file holds: {}", names.join(", ")))
    })?;
    let bytes = view.data();
    let data = match view.dtype() {
        StDtype::F32 => {
            HostData::F32(bytes.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect())
        }
        StDtype::F16 => HostData::F16(bytes.chunks_exact(2).map(|b| f16::from_le_bytes([b[0], b[1]])).collect()),
        StDtype::BF16 => HostData::Bf16(bytes.chunks_exact(2).map(|b| bf16::from_le_bytes([b[0], b[1]])).collect()),
        other => return Err(error(format!("dtype {other:?} is not supported; expected F32, F16 or BF16"))),
    };
    HostTensor::from_data(name, view.shape(), data).map_err(|e| error(e.to_string()))
}

/// The [`Error::TensorFile`] for a file the safetensors crate refused; for a truncated file it
/// names the first tensor whose data is cut off.
fn safetensors_error(path: &Path, bytes: &[u8], error: SafeTensorError) -> Error {
    match error {
        SafeTensorError::HeaderTooSmall => {
            file_error(path, None, "not a safetensors file: shorter than its 8-byte header length")
        }
        SafeTensorError::InvalidHeaderLength => file_error(
            path,
            None,
            format!("truncated file: its header length points past the end of the file ({} bytes)", bytes.len()),
        ),
        SafeTensorError::MetadataIncompleteBuffer => match cut_off_tensor(bytes) {
            Some((name, end, held)) => file_error(
                path,
                Some(&name),
                format!(
                    "truncated file: the tensor's data ends at byte {end} of the data section, which holds {held} bytes"
                ),
            ),
            None => file_error(path, None, "damaged file: the data section is longer than its tensors"),
        },
        SafeTensorError::InvalidOffset(name) => {
            file_error(path, Some(&name), "damaged file: the tensor's data offsets are invalid")
        }
        other => file_error(path, None, format!("not a valid safetensors file: {other}")),
    }
}

/// For a safetensors file whose data section is shorter than its header says: the tensor whose
/// data starts first among those cut off, where its data ends and how many data bytes there are.
fn cut_off_tensor(bytes: &[u8]) -> Option<(String, u64, u64)> {
    let header_len = u64::from_le_bytes(bytes.get(..8)?.try_into().ok()?);
    let data_start = usize::try_from(header_len).ok()?.checked_add(8)?;
    let header: serde_json::Map<String, serde_json::Value> = serde_json::from_slice(bytes.get(8..data_start)?).ok()?;
    let held = (bytes.len() - data_start) as u64;
    header
        .iter()
        .filter(|(name, _)| *name != "__metadata__")
        .filter_map(|(name, info)| {
            let offsets = info.get("data_offsets")?.as_array()?;
            Some((name.clone(), offsets.first()?.as_u64()?, offsets.get(1)?.as_u64()?))
        })
        .filter(|&(_, _, end)| end > held)
        .min_by_key(|&(_, start, _)| start)
        .map(|(name, _, end)| (name, end, held))
}
