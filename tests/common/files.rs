//! Files for the tests of `attn_host::io` and the `attn` subcommand: a scratch directory, and
//! `.npy` / `.safetensors` files written byte by byte, as NumPy and other writers lay them out,
//! independently of the crates the library uses.

use std::path::{Path, PathBuf};

/// A fresh directory under the system's temporary directory, removed (with its contents) on drop.
pub struct TempDir(PathBuf);

impl TempDir {
    /// `<tmp>/rust-attention-<test>-<pid>`, emptied if it exists.
    pub fn new(test: &str) -> Self {
        let path = std::env::temp_dir().join(format!("rust-attention-{test}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&path);
        std::fs::create_dir_all(&path).unwrap();
        Self(path)
    }

    /// A path inside the directory.
    pub fn join(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }

    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A version-1.0 `.npy` file as NumPy writes it: magic, version, little-endian header length,
/// the header dict padded with spaces to a multiple of 64 bytes and ended by a newline, then
/// `data`. `shape` as Python writes a tuple, e.g. "(2, 3)" or "(5,)".
pub fn npy_bytes(descr: &str, fortran_order: bool, shape: &str, data: &[u8]) -> Vec<u8> {
    let fortran = if fortran_order { "True" } else { "False" };
    let mut header = format!("{{'descr': '{descr}', 'fortran_order': {fortran}, 'shape': {shape}, }}");
    let unpadded = 10 + header.len() + 1;
    header.push_str(&" ".repeat(unpadded.next_multiple_of(64) - unpadded));
    header.push('\n');
    let mut bytes = b"\x93NUMPY\x01\x00".to_vec();
    bytes.extend_from_slice(&(header.len() as u16).to_le_bytes());
    bytes.extend_from_slice(header.as_bytes());
    bytes.extend_from_slice(data);
    bytes
}

/// A `.safetensors` file: 8-byte little-endian header length, the JSON header, then the tensors'
/// data back to back in the order given. Each tensor is (name, dtype as in the format, e.g.
/// "F32", shape, little-endian bytes).
pub fn safetensors_bytes(tensors: &[(&str, &str, &[usize], Vec<u8>)]) -> Vec<u8> {
    let mut entries = Vec::new();
    let mut offset = 0;
    for (name, dtype, shape, data) in tensors {
        let dims: Vec<String> = shape.iter().map(ToString::to_string).collect();
        entries.push(format!(
            "\"{name}\":{{\"dtype\":\"{dtype}\",\"shape\":[{}],\"data_offsets\":[{offset},{}]}}",
            dims.join(","),
            offset + data.len()
        ));
        offset += data.len();
    }
    let mut header = format!("{{{}}}", entries.join(","));
    header.push_str(&" ".repeat(header.len().next_multiple_of(8) - header.len()));
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(header.as_bytes());
    for (_, _, _, data) in tensors {
        bytes.extend_from_slice(data);
    }
    bytes
}

/// Little-endian bytes of `f32` values.
pub fn f32_bytes(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|x| x.to_le_bytes()).collect()
}
