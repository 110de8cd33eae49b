//! **Runtime layer.** Tensor maps, the descriptors from which the Hopper kernels' TMA units
//! load their tiles: the cache of device copies a context keeps ([`TensorMapCache`]), the maps
//! of one launch ([`TensorMaps`]) and the public 2-D map of the probes ([`TensorMap`]). The
//! context encodes and uploads them (`Context::encode_tensor_map`, `Context::upload_tensor_maps`
//! in `runtime/context.rs`), since that needs its stream.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use attn_kernels::emu::Arg;
use cudarc::driver::{CudaSlice, CudaStream, PushKernelArg};

use super::kernel_arg::KernelArg;
use crate::error::{During, Error, Result};

/// The tensor maps of one Hopper kernel launch, in device memory (the kernel's first argument).
pub(crate) struct TensorMaps {
    pub(crate) maps: Arc<CudaSlice<u64>>,
}

/// The tensor maps a context has copied to device memory, by content: a launch whose maps are
/// those of an earlier launch (same tensors, same boxes: every training step, every benchmark
/// repeat) reuses that launch's device copy instead of queueing a host-to-device copy before the
/// kernel, which kept the GPU idle for microseconds per call. A map's content is a function of
/// the tensor's address, shape and box only, and a device copy is never written again, so a hit is
/// always the right map, even for a new tensor at a freed one's address. Holds the last
/// [`TensorMapCache::CAPACITY`] sets.
#[derive(Default)]
pub(crate) struct TensorMapCache {
    entries: Mutex<VecDeque<CachedMaps>>,
}

/// One cached set: the maps' words on the host, and their device copy.
type CachedMaps = (Vec<u64>, Arc<CudaSlice<u64>>);

impl TensorMapCache {
    /// Sets of maps kept (a forward and a backward of a few problems).
    const CAPACITY: usize = 16;

    /// The device copy of `words` (tensor maps back to back), from the cache or copied now on
    /// `stream`. A set that leaves the cache is freed in stream order, after the launches that
    /// read it.
    pub(crate) fn get(&self, stream: &Arc<CudaStream>, words: &[u64]) -> Result<Arc<CudaSlice<u64>>> {
        let mut entries = self.entries.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        if let Some((_, maps)) = entries.iter().find(|(cached, _)| cached == words) {
            return Ok(Arc::clone(maps));
        }
        let maps = Arc::new(stream.clone_htod(words).during("copying tensor maps to the device")?);
        if entries.len() == Self::CAPACITY {
            entries.pop_front();
        }
        entries.push_back((words.to_vec(), Arc::clone(&maps)));
        Ok(maps)
    }
}

impl KernelArg for TensorMaps {
    fn push<'a>(&'a self, builder: &mut cudarc::driver::LaunchArgs<'a>) -> Result<()> {
        builder.arg(&*self.maps);
        Ok(())
    }

    fn emulated(&self) -> Result<Arg> {
        Err(Error::NotOnEmulator("tensor maps (TMA)"))
    }
}

/// A tensor map (`CUtensorMap`, 128 bytes) in device memory, where TMA reads it: the
/// shape, strides and box of a tensor for `cp.async.bulk.tensor`. Kernels take it by pointer
/// (a by-value kernel parameter aligned to 64 bytes would need `__grid_constant__`, which rustc's
/// nvptx backend cannot express).
pub struct TensorMap {
    map: CudaSlice<u64>,
    /// `[box_rows, box_cols]`.
    box_shape: [usize; 2],
}

impl TensorMap {
    /// A map already copied to device memory, for boxes of `box_shape`.
    pub(crate) fn new(map: CudaSlice<u64>, box_shape: [usize; 2]) -> Self {
        Self { map, box_shape }
    }

    /// The box TMA moves per load, `[rows, cols]`.
    pub fn box_shape(&self) -> [usize; 2] {
        self.box_shape
    }
}

impl KernelArg for TensorMap {
    fn push<'a>(&'a self, builder: &mut cudarc::driver::LaunchArgs<'a>) -> Result<()> {
        builder.arg(&self.map);
        Ok(())
    }

    fn emulated(&self) -> Result<Arg> {
        Err(Error::NotOnEmulator("tensor maps (TMA)"))
    }
}
