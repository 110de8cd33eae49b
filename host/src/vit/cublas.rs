//! cuBLAS, loaded at run time from wherever a CUDA installation keeps it: the five functions the
//! vision transformer's linear layers call (`cublasCreate_v2`, `cublasDestroy_v2`,
//! `cublasSetStream_v2`, `cublasSetMathMode`, `cublasSgemm_v2`; their C signatures are in the
//! cuBLAS documentation, "cuBLAS Helper Function Reference" and "cublas<t>gemm()").
//!
//! The library is found by our own search rather than a fixed list of names, so that every
//! CUDA major version (`libcublas.so.11`, `.12`, `.13`) and every usual place works without
//! setting anything up. In this order, the first that loads wins:
//!
//! 1. `RUST_ATTENTION_CUBLAS`, a path to the library file, if set (then nothing else is tried);
//! 2. the names `libcublas.so`, `libcublas.so.13`, `libcublas.so.12`, `libcublas.so.11`, which
//!    the system's loader resolves (`LD_LIBRARY_PATH`, the `ldconfig` cache);
//! 3. any `libcublas.so*` in `$CUDA_HOME`, `$CUDA_PATH`, `/usr/local/cuda` (`lib64`, `lib`,
//!    `targets/x86_64-linux/lib`), `$CONDA_PREFIX/lib`, and the NVIDIA wheels of Python
//!    environments (`site-packages/nvidia/cublas/lib`, `site-packages/nvidia/cu13/lib`) under
//!    `$VIRTUAL_ENV`, `~/.local`, `/usr`, `/usr/local` and `/opt/*`: newest version first.
//!
//! A library found by path is loaded after its `libcublasLt` from the same folder, so that its
//! dependency resolves even when that folder is not on the loader's path. When nothing loads, the
//! error lists every candidate tried and why the last one failed.

use std::ffi::{OsStr, c_void};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use libloading::Library;

/// `cublasHandle_t`.
pub(super) type Handle = *mut c_void;
/// `cublasStatus_t`: 0 is `CUBLAS_STATUS_SUCCESS`.
type Status = i32;
/// `cublasOperation_t`'s `CUBLAS_OP_N`.
pub(super) const OP_N: i32 = 0;
/// `cublasOperation_t`'s `CUBLAS_OP_T`.
pub(super) const OP_T: i32 = 1;
/// `cublasMath_t`'s `CUBLAS_DEFAULT_MATH`: SGEMM in plain `f32`, no TF32.
pub(super) const DEFAULT_MATH: i32 = 0;

type Sgemm = unsafe extern "C" fn(
    Handle,
    i32,
    i32,
    i32,
    i32,
    i32,
    *const f32,
    *const f32,
    i32,
    *const f32,
    i32,
    *const f32,
    *mut f32,
    i32,
) -> Status;

/// The loaded library and the entry points we call. Loaded once per process and never unloaded
/// (the function pointers borrow it for the program's lifetime).
pub(super) struct Api {
    /// The file that was loaded (or the name the loader resolved).
    pub(super) source: String,
    pub(super) create: unsafe extern "C" fn(*mut Handle) -> Status,
    pub(super) destroy: unsafe extern "C" fn(Handle) -> Status,
    pub(super) set_stream: unsafe extern "C" fn(Handle, cudarc::driver::sys::CUstream) -> Status,
    pub(super) set_math_mode: unsafe extern "C" fn(Handle, i32) -> Status,
    pub(super) sgemm: Sgemm,
    _libraries: Vec<Library>,
}

/// The process's cuBLAS, loaded on first use; the error says everything that was tried.
pub(super) fn api() -> Result<&'static Api, String> {
    static API: OnceLock<Result<Api, String>> = OnceLock::new();
    API.get_or_init(load).as_ref().map_err(Clone::clone)
}

/// Turns a cuBLAS status into a `Result`, naming the call.
pub(super) fn check(status: Status, call: &str) -> Result<(), String> {
    if status == 0 { Ok(()) } else { Err(format!("{call} returned status {status}")) }
}

fn load() -> Result<Api, String> {
    let candidates = candidates();
    let mut last_error = String::from("no candidates");
    for candidate in &candidates {
        match open(candidate) {
            Ok(api) => return Ok(api),
            Err(e) => last_error = e,
        }
    }
    let tried: Vec<String> = candidates.iter().map(|c| c.display().to_string()).collect();
    Err(format!(
        "the cuBLAS library could not be loaded; tried {} (the last: {last_error}). Set RUST_ATTENTION_CUBLAS to the \
         path of a libcublas.so* to use another one",
        tried.join(", ")
    ))
}

/// Every candidate, in the order of the module's docs: bare names (for the loader) first, then
/// the files found in the usual folders.
fn candidates() -> Vec<PathBuf> {
    if let Some(path) = std::env::var_os("RUST_ATTENTION_CUBLAS") {
        return vec![PathBuf::from(path)];
    }
    let mut candidates: Vec<PathBuf> =
        ["libcublas.so", "libcublas.so.13", "libcublas.so.12", "libcublas.so.11"].map(PathBuf::from).into();
    for dir in folders() {
        let Ok(entries) = std::fs::read_dir(&dir) else { continue };
        let mut found: Vec<PathBuf> = entries
            .flatten()
            .map(|entry| entry.path())
            .filter(|path| path.file_name().and_then(OsStr::to_str).is_some_and(|n| n.starts_with("libcublas.so")))
            .collect();
        // Newest first: libcublas.so.13.1.0.3 before libcublas.so.12.
        found.sort_by_key(|path| std::cmp::Reverse(version(path)));
        candidates.extend(found);
    }
    candidates.dedup();
    candidates
}

/// The numbers after `.so.` in a library's file name (`[13, 1, 0, 3]`); empty for `libcublas.so`.
fn version(path: &Path) -> Vec<u32> {
    let name = path.file_name().and_then(OsStr::to_str).unwrap_or("");
    name.split_once(".so.").map(|(_, v)| v.split('.').filter_map(|p| p.parse().ok()).collect()).unwrap_or_default()
}

/// The folders searched after the loader's own paths.
fn folders() -> Vec<PathBuf> {
    let mut roots: Vec<PathBuf> =
        ["CUDA_HOME", "CUDA_PATH"].iter().filter_map(std::env::var_os).map(Into::into).collect();
    roots.push("/usr/local/cuda".into());
    let mut folders: Vec<PathBuf> =
        roots.iter().flat_map(|root| ["lib64", "lib", "targets/x86_64-linux/lib"].map(|sub| root.join(sub))).collect();
    if let Some(conda) = std::env::var_os("CONDA_PREFIX") {
        folders.push(Path::new(&conda).join("lib"));
    }
    // Python environments whose NVIDIA wheels (PyTorch's dependencies) hold a cuBLAS.
    let mut prefixes: Vec<PathBuf> = ["VIRTUAL_ENV"].iter().filter_map(std::env::var_os).map(Into::into).collect();
    if let Some(home) = std::env::var_os("HOME") {
        prefixes.push(Path::new(&home).join(".local"));
    }
    prefixes.extend(["/usr", "/usr/local"].map(PathBuf::from));
    if let Ok(opt) = std::fs::read_dir("/opt") {
        prefixes.extend(opt.flatten().map(|entry| entry.path()));
    }
    for prefix in prefixes {
        let Ok(lib) = std::fs::read_dir(prefix.join("lib")) else { continue };
        for python in lib.flatten().map(|e| e.path()) {
            if !python.file_name().and_then(OsStr::to_str).is_some_and(|n| n.starts_with("python3")) {
                continue;
            }
            for packages in ["site-packages", "dist-packages"] {
                for wheel in ["nvidia/cublas/lib", "nvidia/cu13/lib"] {
                    folders.push(python.join(packages).join(wheel));
                }
            }
        }
    }
    folders
}

/// Loads one candidate and looks up the entry points.
fn open(candidate: &Path) -> Result<Api, String> {
    let mut libraries = Vec::new();
    if candidate.is_absolute() {
        // The library's own libcublasLt first (same version suffix), so that its dependency
        // resolves by soname even when this folder is not on the loader's path.
        let name = candidate.file_name().and_then(OsStr::to_str).unwrap_or("");
        let lt = candidate.with_file_name(name.replacen("libcublas", "libcublasLt", 1));
        if lt.exists() {
            // SAFETY: loading cuBLASLt runs only its initialisers, which have no preconditions.
            libraries.push(unsafe { Library::new(&lt) }.map_err(|e| format!("{}: {e}", lt.display()))?);
        }
    }
    // SAFETY: as above, for cuBLAS.
    let library = unsafe { Library::new(candidate) }.map_err(|e| format!("{}: {e}", candidate.display()))?;
    let symbol = |name: &[u8]| -> Result<*const c_void, String> {
        // SAFETY: a symbol's address only; each is given its C signature below.
        unsafe { library.get::<*const c_void>(name) }.map(|s| *s).map_err(|e| format!("{}: {e}", candidate.display()))
    };
    let (create, destroy, set_stream, set_math_mode, sgemm) = (
        symbol(b"cublasCreate_v2\0")?,
        symbol(b"cublasDestroy_v2\0")?,
        symbol(b"cublasSetStream_v2\0")?,
        symbol(b"cublasSetMathMode\0")?,
        symbol(b"cublasSgemm_v2\0")?,
    );
    libraries.push(library);
    // SAFETY: each pointer is the function of that name, whose C signature (cuBLAS's
    // documentation) is the type it is given; the libraries stay loaded with the `Api`.
    unsafe {
        Ok(Api {
            source: candidate.display().to_string(),
            create: std::mem::transmute::<*const c_void, unsafe extern "C" fn(*mut Handle) -> Status>(create),
            destroy: std::mem::transmute::<*const c_void, unsafe extern "C" fn(Handle) -> Status>(destroy),
            set_stream: std::mem::transmute::<
                *const c_void,
                unsafe extern "C" fn(Handle, cudarc::driver::sys::CUstream) -> Status,
            >(set_stream),
            set_math_mode: std::mem::transmute::<*const c_void, unsafe extern "C" fn(Handle, i32) -> Status>(
                set_math_mode,
            ),
            sgemm: std::mem::transmute::<*const c_void, Sgemm>(sgemm),
            _libraries: libraries,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_sort_newest_first() {
        let mut paths: Vec<PathBuf> =
            ["/x/libcublas.so", "/x/libcublas.so.12", "/x/libcublas.so.13.1.0.3", "/x/libcublas.so.13"]
                .map(Into::into)
                .into();
        paths.sort_by_key(|path| std::cmp::Reverse(version(path)));
        let names: Vec<_> = paths.iter().map(|p| p.display().to_string()).collect();
        assert_eq!(names, ["/x/libcublas.so.13.1.0.3", "/x/libcublas.so.13", "/x/libcublas.so.12", "/x/libcublas.so"]);
    }

    #[test]
    fn a_missing_library_names_what_was_tried() {
        // A path that cannot exist: the error names it and the variable to set.
        let e = open(Path::new("/nonexistent/libcublas.so.99")).err().unwrap();
        assert!(e.contains("/nonexistent/libcublas.so.99"), "{e}");
    }
}
