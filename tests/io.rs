//! `attn_host::io`: tensors through `.npy` and `.safetensors` files. Round trips of every element
//! type through both formats; files laid out byte by byte as NumPy and safetensors writers make
//! them (so the reader is checked against the formats, not against our own writer); and every
//! error case naming the file and the tensor: unsupported dtype, the bf16 file-name mark missing or
//! misused, Fortran order, truncated and damaged files, missing tensors and files. No GPU needed.

mod common;

use attn_host::check::random_normal;
use attn_host::io::{self, HostData, HostTensor};
use attn_host::{Context, DType, Error, bf16, f16};
use common::files::{TempDir, f32_bytes, npy_bytes, safetensors_bytes};

/// A tensor of seeded normal values of `dtype` (rounded from `f32`).
fn random_tensor(name: &str, shape: &[usize], dtype: DType, seed: u64) -> HostTensor {
    let values = random_normal(shape.iter().product(), seed);
    HostTensor::new(name, shape, values).unwrap().converted(dtype)
}

/// The message of an [`Error::TensorFile`], after checking that it names `path` and `tensor`.
fn file_error(result: Result<impl std::fmt::Debug, Error>, path: &std::path::Path, tensor: Option<&str>) -> String {
    let error = result.expect_err("expected an error");
    let message = error.to_string();
    match &error {
        Error::TensorFile { path: p, tensor: t, .. } => {
            assert_eq!(p, &path.display().to_string(), "{message}");
            assert_eq!(t.as_deref(), tensor, "{message}");
        }
        other => panic!("expected Error::TensorFile, got {other:?}"),
    }
    assert!(message.contains(&path.display().to_string()), "the message names the file: {message}");
    if let Some(tensor) = tensor {
        assert!(message.contains(&format!("`{tensor}`")), "the message names the tensor: {message}");
    }
    message
}

#[test]
fn npy_round_trip_every_dtype_and_rank() {
    let dir = TempDir::new("npy_round_trip");
    for dtype in DType::ALL {
        for shape in [vec![2, 3, 5, 7], vec![4, 33], vec![9], vec![]] {
            let tensor = random_tensor("x", &shape, dtype, shape.len() as u64);
            let path = dir.join(&io::npy_file_name("x", dtype));
            io::write_npy(&path, &tensor).unwrap();
            let back = io::read_npy(&path).unwrap();
            assert_eq!(back, tensor, "{dtype} {shape:?}");
            assert_eq!(back.dtype(), dtype);
        }
    }
    assert_eq!(io::npy_file_name("o", DType::Bf16), "o.bf16.npy");
    assert_eq!(io::npy_file_name("o", DType::F16), "o.npy");
}

#[test]
fn npy_files_are_what_numpy_writes() {
    let dir = TempDir::new("npy_layout");
    let values = [1.5f32, -2.0, 0.25, 3.0, 1e-3, -7.5];
    // Our writer's bytes equal NumPy's layout for the same array.
    for (dtype, descr, data) in [
        (DType::F32, "<f4", f32_bytes(&values)),
        (DType::F16, "<f2", values.iter().flat_map(|&x| f16::from_f32(x).to_le_bytes()).collect()),
        (DType::Bf16, "<u2", values.iter().flat_map(|&x| bf16::from_f32(x).to_bits().to_le_bytes()).collect()),
    ] {
        let tensor = HostTensor::new("t", &[2, 3], values.to_vec()).unwrap().converted(dtype);
        let path = dir.join(&io::npy_file_name("t", dtype));
        io::write_npy(&path, &tensor).unwrap();
        let written = std::fs::read(&path).unwrap();
        let header_len = u16::from_le_bytes([written[8], written[9]]) as usize;
        let header = std::str::from_utf8(&written[10..10 + header_len]).unwrap();
        assert!(written.starts_with(b"\x93NUMPY"), "{dtype}");
        assert!(header.contains(&format!("'descr': '{descr}'")), "{dtype}: {header}");
        assert!(header.contains("'fortran_order': False"), "{dtype}: {header}");
        // npyz writes the tuple as "(2, 3, )": another spelling of the same Python literal.
        assert!(header.contains("'shape': (2, 3)") || header.contains("'shape': (2, 3, )"), "{dtype}: {header}");
        assert_eq!((10 + header_len) % 64, 0, "{dtype}: NumPy aligns the data to 64 bytes");
        assert_eq!(&written[10 + header_len..], &data[..], "{dtype}");
        // And a file laid out by hand reads back as the same tensor.
        let hand = dir.join(&format!("hand{}", io::npy_file_name("", dtype)));
        std::fs::write(&hand, npy_bytes(descr, false, "(2, 3)", &data)).unwrap();
        let read = io::read_npy(&hand).unwrap();
        assert_eq!(read.shape(), &[2, 3]);
        assert_eq!(read.data(), tensor.data(), "{dtype}");
        assert_eq!(read.name(), "hand");
    }
    // Big-endian files are converted; a 1-D array in "Fortran order" is the same as in C order.
    let big: Vec<u8> = values.iter().flat_map(|x| x.to_be_bytes()).collect();
    std::fs::write(dir.join("big.npy"), npy_bytes(">f4", false, "(6,)", &big)).unwrap();
    assert_eq!(io::read_npy(dir.join("big.npy")).unwrap().to_f32(), values);
    std::fs::write(dir.join("f1.npy"), npy_bytes("<f4", true, "(6,)", &f32_bytes(&values))).unwrap();
    assert_eq!(io::read_npy(dir.join("f1.npy")).unwrap().to_f32(), values);
}

#[test]
fn safetensors_round_trip_every_dtype() {
    let dir = TempDir::new("safetensors_round_trip");
    let tensors = vec![
        random_tensor("q", &[2, 4, 33, 64], DType::F32, 1),
        random_tensor("k", &[2, 2, 17, 64], DType::F16, 2),
        random_tensor("v", &[2, 2, 17, 64], DType::Bf16, 3),
        random_tensor("lse", &[2, 4, 33], DType::F32, 4),
        random_tensor("scalar", &[], DType::Bf16, 5),
    ];
    let path = dir.join("all.safetensors");
    io::write_safetensors(&path, &tensors).unwrap();
    let back = io::read_safetensors(&path).unwrap();
    assert_eq!(back.len(), tensors.len());
    for tensor in &tensors {
        let found = back.iter().find(|t| t.name() == tensor.name()).unwrap();
        assert_eq!(found, tensor);
        assert_eq!(&io::read_safetensors_tensor(&path, tensor.name()).unwrap(), tensor);
        assert_eq!(&io::read_tensor(&path, tensor.name()).unwrap(), tensor);
    }
}

#[test]
fn safetensors_files_written_by_hand_are_read() {
    let dir = TempDir::new("safetensors_by_hand");
    let a = [1.0f32, -2.5, 3.25, 0.5];
    let b: Vec<u8> = [0.5f32, -1.0, 2.0].iter().flat_map(|&x| bf16::from_f32(x).to_le_bytes()).collect();
    let c: Vec<u8> = [4.0f32, 8.0].iter().flat_map(|&x| f16::from_f32(x).to_le_bytes()).collect();
    let path = dir.join("hand.safetensors");
    std::fs::write(
        &path,
        safetensors_bytes(&[("a", "F32", &[2, 2], f32_bytes(&a)), ("b", "BF16", &[3], b), ("c", "F16", &[1, 2], c)]),
    )
    .unwrap();
    let tensors = io::read_safetensors(&path).unwrap();
    let names: Vec<&str> = tensors.iter().map(HostTensor::name).collect();
    assert_eq!(names, ["a", "b", "c"], "in the order of their data");
    assert_eq!(tensors[0].data(), &HostData::F32(a.to_vec()));
    assert_eq!(tensors[1].dtype(), DType::Bf16);
    assert_eq!(tensors[1].to_f32(), [0.5, -1.0, 2.0]);
    assert_eq!(tensors[2].shape(), &[1, 2]);
    assert_eq!(tensors[2].to_f32(), [4.0, 8.0]);
}

#[test]
fn write_tensors_to_a_directory_of_npy_files_or_one_safetensors_file() {
    let dir = TempDir::new("write_tensors");
    let tensors =
        vec![random_tensor("o", &[1, 2, 5, 8], DType::Bf16, 1), random_tensor("lse", &[1, 2, 5], DType::F32, 2)];
    let written = io::write_tensors(dir.join("out"), &tensors).unwrap();
    assert_eq!(written, [dir.join("out").join("o.bf16.npy"), dir.join("out").join("lse.npy")]);
    assert_eq!(io::read_npy(&written[0]).unwrap(), tensors[0]);
    assert_eq!(io::read_tensor(&written[1], "lse").unwrap(), tensors[1]);
    let file = dir.join("out.safetensors");
    assert_eq!(io::write_tensors(&file, &tensors).unwrap(), std::slice::from_ref(&file));
    assert_eq!(io::read_safetensors_tensor(&file, "o").unwrap(), tensors[0]);
    file_error(io::write_tensors(dir.join("x.npy"), &tensors), &dir.join("x.npy"), None);
    // Another extension is refused up front, unless it names an existing directory.
    file_error(io::check_output_path(&dir.join("out.txt")), &dir.join("out.txt"), None);
    assert!(!dir.join("out.txt").exists(), "nothing was created");
    std::fs::create_dir(dir.join("run.1")).unwrap();
    assert!(!io::check_output_path(&dir.join("run.1")).unwrap(), "an existing directory");
    assert!(!io::check_output_path(&dir.join("new")).unwrap(), "a new directory");
    assert!(io::check_output_path(&file).unwrap(), "a safetensors file");
}

#[test]
fn host_tensors_convert_and_move_to_and_from_devices() {
    let values = random_normal(2 * 3 * 4, 7);
    let tensor = HostTensor::new("x", &[2, 3, 4], values.clone()).unwrap();
    assert!(matches!(HostTensor::new("x", &[2, 3, 5], values.clone()), Err(Error::Length { expected: 30, got: 24 })));
    // Rounding to 16 bits and back is what `half` does; widening is exact.
    let rounded: Vec<bf16> = tensor.to_vec();
    assert_eq!(rounded, values.iter().map(|&x| bf16::from_f32(x)).collect::<Vec<_>>());
    assert_eq!(tensor.converted(DType::Bf16).to_f32(), rounded.iter().map(|x| x.to_f32()).collect::<Vec<_>>());
    assert_eq!(tensor.as_slice::<f32>(), Some(&values[..]));
    assert_eq!(tensor.as_slice::<f16>(), None);
    let from_f64 = HostTensor::from_f64("y", &[2], &[1.0 + 1e-12, -3.0], DType::F16).unwrap();
    assert_eq!(from_f64.to_f32(), [1.0, -3.0]);
    // Through a device (the CPU emulator's memory here; the same calls on a GPU).
    let ctx = Context::cpu_emulated();
    let device = tensor.upload::<f16>(&ctx).unwrap();
    assert_eq!(device.shape(), &[2, 3, 4]);
    let back = HostTensor::from_device("x", &device).unwrap();
    assert_eq!(back, tensor.converted(DType::F16));
}

#[test]
fn unsupported_npy_dtypes_name_the_file_and_the_tensor() {
    let dir = TempDir::new("npy_dtypes");
    let f64_data: Vec<u8> = [1.0f64, 2.0].iter().flat_map(|x| x.to_le_bytes()).collect();
    let path = dir.join("q.npy");
    std::fs::write(&path, npy_bytes("<f8", false, "(2,)", &f64_data)).unwrap();
    let message = file_error(io::read_npy(&path), &path, Some("q"));
    assert!(message.contains("<f8") && message.contains("float32"), "{message}");

    let i32_path = dir.join("k.npy");
    std::fs::write(&i32_path, npy_bytes("<i4", false, "(2,)", &[0; 8])).unwrap();
    assert!(file_error(io::read_npy(&i32_path), &i32_path, Some("k")).contains("<i4"));

    // uint16 without the bf16 mark is refused (it could be anything) ...
    let u16_path = dir.join("v.npy");
    std::fs::write(&u16_path, npy_bytes("<u2", false, "(2,)", &[0; 4])).unwrap();
    assert!(file_error(io::read_npy(&u16_path), &u16_path, Some("v")).contains("v.bf16.npy"));
    // ... and the mark on anything but uint16 too.
    let marked = dir.join("o.bf16.npy");
    std::fs::write(&marked, npy_bytes("<f2", false, "(2,)", &[0; 4])).unwrap();
    assert!(file_error(io::read_npy(&marked), &marked, Some("o")).contains("<f2"));

    let fortran = dir.join("f.npy");
    std::fs::write(&fortran, npy_bytes("<f4", true, "(2, 3)", &[0; 24])).unwrap();
    assert!(file_error(io::read_npy(&fortran), &fortran, Some("f")).contains("Fortran"));

    let named = dir.join("q.txt");
    file_error(io::read_npy(&named), &named, None);
    file_error(io::read_tensor(&named, "q"), &named, Some("q"));
}

#[test]
fn writing_keeps_the_bf16_mark_symmetric() {
    let dir = TempDir::new("npy_mark");
    let bf16_tensor = random_tensor("o", &[3], DType::Bf16, 1);
    let f32_tensor = random_tensor("o", &[3], DType::F32, 1);
    let plain = dir.join("o.npy");
    let marked = dir.join("o.bf16.npy");
    assert!(file_error(io::write_npy(&plain, &bf16_tensor), &plain, Some("o")).contains(".bf16.npy"));
    file_error(io::write_npy(&marked, &f32_tensor), &marked, Some("o"));
    file_error(io::write_npy(dir.join("o.bin"), &f32_tensor), &dir.join("o.bin"), Some("o"));
    assert!(!plain.exists() && !marked.exists(), "a refused write leaves no file");
}

#[test]
fn truncated_and_damaged_npy_files_name_the_file_and_the_tensor() {
    let dir = TempDir::new("npy_truncated");
    let path = dir.join("q.npy");
    io::write_npy(&path, &random_tensor("q", &[2, 3, 4, 8], DType::F32, 1)).unwrap();
    let full = std::fs::read(&path).unwrap();
    // Cut in the data, in the header, in the magic; and one byte too many.
    for (cut, expect) in [(full.len() - 5, "truncated"), (40, "not a valid .npy"), (3, "not a valid .npy")] {
        std::fs::write(&path, &full[..cut]).unwrap();
        let message = file_error(io::read_npy(&path), &path, Some("q"));
        assert!(message.contains(expect), "cut at {cut}: {message}");
    }
    let mut longer = full.clone();
    longer.push(0);
    std::fs::write(&path, &longer).unwrap();
    assert!(file_error(io::read_npy(&path), &path, Some("q")).contains("damaged"));
    let missing = dir.join("missing.npy");
    assert!(file_error(io::read_npy(&missing), &missing, Some("missing")).contains("cannot read"));
}

#[test]
fn safetensors_errors_name_the_file_and_the_tensor() {
    let dir = TempDir::new("safetensors_errors");
    let path = dir.join("in.safetensors");
    let tensors = vec![
        random_tensor("q", &[1, 2, 8, 16], DType::F32, 1),
        random_tensor("k", &[1, 2, 8, 16], DType::F32, 2),
        random_tensor("v", &[1, 2, 8, 16], DType::F32, 3),
    ];
    io::write_safetensors(&path, &tensors).unwrap();
    // A missing tensor: the message lists those there are.
    let message = file_error(io::read_safetensors_tensor(&path, "do"), &path, Some("do"));
    assert!(message.contains("k, q, v"), "{message}");
    // Truncated in the data: the first tensor cut off is named (data order k, q, v; 1 KiB each).
    let full = std::fs::read(&path).unwrap();
    std::fs::write(&path, &full[..full.len() - 1500]).unwrap();
    let message = file_error(io::read_safetensors(&path), &path, Some("q"));
    assert!(message.contains("truncated"), "{message}");
    file_error(io::read_safetensors_tensor(&path, "k"), &path, Some("q"));
    // Truncated in the header, and too short for one.
    std::fs::write(&path, &full[..20]).unwrap();
    assert!(file_error(io::read_safetensors(&path), &path, None).contains("truncated"));
    std::fs::write(&path, &full[..5]).unwrap();
    file_error(io::read_safetensors(&path), &path, None);
    // An unsupported dtype.
    let f64_data: Vec<u8> = [1.0f64, 2.0].iter().flat_map(|x| x.to_le_bytes()).collect();
    std::fs::write(&path, safetensors_bytes(&[("a", "F32", &[1], f32_bytes(&[1.0])), ("x", "F64", &[2], f64_data)]))
        .unwrap();
    assert!(file_error(io::read_safetensors(&path), &path, Some("x")).contains("F64"));
    assert_eq!(io::read_safetensors_tensor(&path, "a").unwrap().to_f32(), [1.0], "the other tensors still read");
    // Two tensors of one name are refused before anything is written.
    let twice = dir.join("twice.safetensors");
    file_error(io::write_safetensors(&twice, &[tensors[0].clone(), tensors[0].clone()]), &twice, Some("q"));
    assert!(!twice.exists());
    let missing = dir.join("missing.safetensors");
    assert!(file_error(io::read_safetensors_tensor(&missing, "q"), &missing, Some("q")).contains("cannot read"));
}
