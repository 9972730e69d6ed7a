//! The device: driver and library probing, NVRTC compilation of the kernel
//! source (cached by digest), the loaded kernels, raw device buffers.

use std::collections::HashMap;
use std::ffi::{CStr, CString};
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::cublas::CudaBlas;
use cudarc::driver::{sys, CudaContext, CudaFunction, CudaSlice, CudaStream, DevicePtr, LaunchConfig};
use sha2::{Digest, Sha256};

use crate::error::CudaError;

/// The CUDA C source of every kernel.
pub fn kernel_source() -> &'static str {
    concat!(
        include_str!("kernels/common.cu"),
        include_str!("kernels/pointwise.cu"),
        include_str!("kernels/projections.cu"),
        include_str!("kernels/attention.cu"),
    )
}

/// The kernels a model loads (each an `extern "C"` function of the source).
pub const KERNELS: &[&str] = &[
    "binary",
    "unary",
    "permute",
    "rms_norm",
    "layer_norm",
    "gather_rows",
    "gather_q4",
    "select_rows",
    "rotary",
    "gemv_f16",
    "gemv_q4",
    "gemv_q4_gated",
    "quantize_blocks",
    "gemv_q4_int8",
    "dequant_q4",
    "widen_f16",
    "add_bias",
    "silu_mul",
    "kv_append",
    "attend",
];

/// What NVRTC made of the source for one architecture.
#[derive(Clone, Debug)]
pub struct Compiled {
    /// PTX text (for a virtual architecture, `compute_XY`).
    pub ptx: Option<String>,
    /// The compiler's log (empty when it had nothing to say).
    pub log: String,
}

fn nvrtc_present() -> Result<(), CudaError> {
    // SAFETY: only tries to dlopen the candidate library names.
    if unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        Ok(())
    } else {
        Err(CudaError::Unavailable(
            "NVRTC (libnvrtc.so) was not found: install the CUDA toolkit, or the `nvidia-cuda-nvrtc-cu12` wheel with \
             its lib folder on LD_LIBRARY_PATH"
                .into(),
        ))
    }
}

/// Compiles the kernel source for `arch` (`sm_90`, `compute_90`, ...). Any
/// diagnostic, warnings included, is an error: the source must compile
/// cleanly for every architecture CI names.
pub fn compile_kernels(arch: &str) -> Result<Compiled, CudaError> {
    nvrtc_present()?;
    let fail = |log: String| CudaError::Compile { arch: arch.into(), log };
    let src = CString::new(kernel_source()).map_err(|e| fail(e.to_string()))?;
    let prog = cudarc::nvrtc::result::create_program(&src, Some(c"kernels.cu")).map_err(|e| fail(e.to_string()))?;
    let options = [format!("--gpu-architecture={arch}"), "--std=c++17".to_string()];
    // SAFETY: `prog` is a live program; each call reads it and the options.
    let (compiled, log, ptx) = unsafe {
        let compiled = cudarc::nvrtc::result::compile_program(prog, &options);
        let log = cudarc::nvrtc::result::get_program_log(prog)
            .map(|l| CStr::from_ptr(l.as_ptr()).to_string_lossy().into_owned())
            .unwrap_or_default();
        let ptx = if compiled.is_ok() && arch.starts_with("compute_") {
            cudarc::nvrtc::result::get_ptx(prog).ok().map(|p| CStr::from_ptr(p.as_ptr()).to_string_lossy().into_owned())
        } else {
            None
        };
        let _ = cudarc::nvrtc::result::destroy_program(prog);
        (compiled, log, ptx)
    };
    let log = log.trim().to_string();
    if let Err(e) = compiled {
        return Err(fail(format!("{e}: {log}")));
    }
    if !log.is_empty() {
        return Err(fail(log));
    }
    Ok(Compiled { ptx, log })
}

/// PTX for `compute_{major}{minor}`, compiled once per process and source
/// digest.
fn ptx_for(major: i32, minor: i32) -> Result<String, CudaError> {
    static CACHE: OnceLock<Mutex<HashMap<String, String>>> = OnceLock::new();
    let arch = format!("compute_{major}{minor}");
    let mut digest = Sha256::new();
    digest.update(kernel_source().as_bytes());
    digest.update(arch.as_bytes());
    let key: String = digest.finalize().iter().map(|b| format!("{b:02x}")).collect();
    let cache = CACHE.get_or_init(Default::default);
    if let Some(ptx) = cache.lock().unwrap_or_else(|p| p.into_inner()).get(&key) {
        return Ok(ptx.clone());
    }
    let ptx = compile_kernels(&arch)?
        .ptx
        .ok_or_else(|| CudaError::Compile { arch: arch.clone(), log: "NVRTC returned no PTX".into() })?;
    cache.lock().unwrap_or_else(|p| p.into_inner()).insert(key, ptx.clone());
    Ok(ptx)
}

/// The first device's name and compute capability, or why there is none.
pub fn probe() -> Result<String, CudaError> {
    // SAFETY: only tries to dlopen the candidate library names.
    if !unsafe { sys::is_culib_present() } {
        return Err(CudaError::Unavailable(
            "no CUDA driver was found (libcuda.so is not installed): native-cuda needs an NVIDIA GPU and its driver"
                .into(),
        ));
    }
    cudarc::driver::result::init()
        .map_err(|e| CudaError::Unavailable(format!("the CUDA driver did not initialize: {e}")))?;
    let count = CudaContext::device_count()
        .map_err(|e| CudaError::Unavailable(format!("the CUDA driver cannot count devices: {e}")))?;
    if count < 1 {
        return Err(CudaError::Unavailable("the CUDA driver found no device".into()));
    }
    let ctx = CudaContext::new(0)?;
    let (major, minor) = ctx.compute_capability()?;
    Ok(format!("{} (sm_{major}{minor})", ctx.name()?))
}

/// Whether the first device supports programmatic dependent launch.
pub fn overlap_supported() -> Result<bool, CudaError> {
    probe()?;
    Ok(overlap_capable(CudaContext::new(0)?.compute_capability()?.0))
}

/// Programmatic dependent launch needs compute capability 9.0 or later.
fn overlap_capable(major: i32) -> bool {
    major >= 9
}

/// The first device's copy bandwidth in bytes per second (bytes read plus
/// bytes written by device-to-device copies of 1 GiB, best of 10).
pub fn copy_bandwidth() -> Result<f64, CudaError> {
    let dev = Device::open()?;
    dev.bind()?;
    let bytes = 1usize << 30;
    let (a, b) = (dev.alloc(bytes)?, dev.alloc(bytes)?);
    dev.zero(a.ptr(), bytes)?;
    dev.copy(b.ptr(), a.ptr(), bytes)?;
    dev.sync()?;
    let mut best = f64::INFINITY;
    for _ in 0..10 {
        let t = std::time::Instant::now();
        dev.copy(b.ptr(), a.ptr(), bytes)?;
        dev.sync()?;
        best = best.min(t.elapsed().as_secs_f64());
    }
    Ok(2.0 * bytes as f64 / best)
}

/// A device allocation of raw bytes; kernels see its address. Clones share
/// the allocation (freed with the last one).
#[derive(Clone)]
pub(crate) struct DBuf {
    _slice: Arc<CudaSlice<u8>>,
    ptr: u64,
    bytes: usize,
}

impl DBuf {
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    pub fn bytes(&self) -> usize {
        self.bytes
    }
}

impl std::fmt::Debug for DBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DBuf({} bytes)", self.bytes)
    }
}

/// `buf`, replaced by a new allocation when it holds fewer than `bytes`
/// (buffers only grow, so a warmed-up run allocates nothing).
pub(crate) fn grown<'a>(dev: &Device, buf: &'a mut Option<DBuf>, bytes: usize) -> Result<&'a DBuf, CudaError> {
    if buf.as_ref().is_none_or(|b| b.bytes() < bytes) {
        *buf = None;
        *buf = Some(dev.alloc(bytes)?);
    }
    buf.as_ref().ok_or_else(|| CudaError::Unsupported("a buffer allocation vanished".into()))
}

/// One GPU, its stream, cuBLAS handle and loaded kernels.
pub(crate) struct Device {
    pub ctx: Arc<CudaContext>,
    pub stream: Arc<CudaStream>,
    pub blas: CudaBlas,
    funcs: HashMap<&'static str, CudaFunction>,
    pub description: String,
    /// Largest dynamic shared memory a block may take (after opting in).
    pub max_shared: usize,
    /// Streaming multiprocessors (kernels that loop over their work size
    /// their grids by it).
    pub sm_count: usize,
    allocations: std::sync::atomic::AtomicU64,
    /// Whether the device can start a kernel while the one before it runs
    /// (programmatic dependent launch, compute capability 9.0 and later).
    overlap_supported: bool,
    /// Whether kernels are launched so (on where supported; see
    /// [`Device::launch_raw`]).
    overlap: std::sync::atomic::AtomicBool,
    /// The driver's CUDA version (12030 for 12.3).
    pub driver_version: i32,
}

// SAFETY: the device is used behind the model's mutex, one thread at a time;
// the context is bound to the calling thread before each use.
unsafe impl Send for Device {}
unsafe impl Sync for Device {}

impl Device {
    /// Opens device 0 and loads the kernels (compiled for its
    /// architecture).
    pub fn open() -> Result<Self, CudaError> {
        let description = probe()?;
        // SAFETY: only tries to dlopen the candidate library names.
        if !unsafe { cudarc::cublas::sys::is_culib_present() } {
            return Err(CudaError::Unavailable("cuBLAS (libcublas.so) was not found: install the CUDA toolkit".into()));
        }
        let ctx = CudaContext::new(0)?;
        // One stream, used in order: no cross-stream events are needed (and
        // none may be recorded into a captured graph).
        // SAFETY: called before any slice of this context exists.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.new_stream()?;
        let blas = CudaBlas::new(stream.clone())?;
        let (major, minor) = ctx.compute_capability()?;
        let module = ctx.load_module(cudarc::nvrtc::Ptx::from_src(ptx_for(major, minor)?))?;
        let mut funcs = HashMap::new();
        for name in KERNELS {
            funcs.insert(*name, module.load_function(name)?);
        }
        // Leave room for the kernels' static shared memory (reductions).
        let max_shared =
            (ctx.attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)? as usize)
                .saturating_sub(1024);
        // Kernels that may take more than the default 48 KiB of dynamic
        // shared memory (scores over the context; staged input rows).
        for name in ["attend", "gemv_q4", "gemv_q4_gated"] {
            if let Some(f) = funcs.get(name) {
                f.set_attribute(
                    sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    max_shared as i32,
                )?;
            }
        }
        let sm_count =
            ctx.attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?.max(1) as usize;
        let overlap_supported = overlap_capable(major);
        let mut driver_version = 0;
        // SAFETY: writes one integer.
        unsafe { sys::cuDriverGetVersion(&mut driver_version) }.result()?;
        Ok(Self {
            ctx,
            stream,
            blas,
            funcs,
            description,
            max_shared,
            sm_count,
            allocations: Default::default(),
            overlap_supported,
            overlap: std::sync::atomic::AtomicBool::new(overlap_supported),
            driver_version,
        })
    }

    /// Whether kernels launch with programmatic dependent launch.
    pub fn overlap(&self) -> bool {
        self.overlap.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Whether this device can launch with programmatic dependent launch.
    pub fn overlap_supported(&self) -> bool {
        self.overlap_supported
    }

    /// Turns programmatic dependent launch on or off (it stays off where
    /// the device does not support it: compute capability below 9.0). Graphs captured before keep the
    /// launches they were captured with: their owner drops them.
    pub fn set_overlap(&self, on: bool) {
        self.overlap.store(on && self.overlap_supported, std::sync::atomic::Ordering::Relaxed);
    }

    /// Launches `f` on the stream. With overlap on, the launch carries
    /// programmatic stream serialization (`cuLaunchKernelEx`): the kernel
    /// may start while the kernel before it still runs and holds at its
    /// `GRID_WAIT` — every kernel in kernels/ waits there before it reads
    /// another's output — so its launch, and for the 4-bit projections the
    /// loads of their first weights, overlap the kernel before. Stream
    /// capture records such launches as programmatic graph edges. With
    /// overlap off, a plain `cuLaunchKernel`.
    ///
    /// # Safety
    /// `params` point at values of exactly the kernel's parameter types, in
    /// order; every pointer among them addresses a live device buffer sized
    /// for the launch.
    pub unsafe fn launch_raw(
        &self,
        f: &CudaFunction,
        cfg: LaunchConfig,
        params: &mut [*mut std::ffi::c_void],
    ) -> Result<(), CudaError> {
        let (grid, block) = (cfg.grid_dim, cfg.block_dim);
        if !self.overlap() {
            // SAFETY: the caller vouches for `params` (see above); `f`
            // belongs to this device's context.
            unsafe {
                cudarc::driver::result::launch_kernel(
                    f.cu_function(),
                    grid,
                    block,
                    cfg.shared_mem_bytes,
                    self.stream.cu_stream(),
                    params,
                )
            }?;
            return Ok(());
        }
        // SAFETY: a zeroed attribute is a valid plain-data value; its id and
        // the union member that id selects are set next.
        let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
        attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
        attr.value.programmaticStreamSerializationAllowed = 1;
        let config = sys::CUlaunchConfig {
            gridDimX: grid.0,
            gridDimY: grid.1,
            gridDimZ: grid.2,
            blockDimX: block.0,
            blockDimY: block.1,
            blockDimZ: block.2,
            sharedMemBytes: cfg.shared_mem_bytes,
            hStream: self.stream.cu_stream(),
            attrs: &mut attr,
            numAttrs: 1,
        };
        // SAFETY: `config` and `attr` outlive the call; the caller vouches
        // for `params` (see above); `f` belongs to this device's context.
        unsafe { sys::cuLaunchKernelEx(&config, f.cu_function(), params.as_mut_ptr(), std::ptr::null_mut()) }
            .result()?;
        Ok(())
    }

    pub fn func(&self, name: &str) -> Result<&CudaFunction, CudaError> {
        self.funcs.get(name).ok_or_else(|| CudaError::Unsupported(format!("kernel `{name}` is not loaded")))
    }

    pub fn bind(&self) -> Result<(), CudaError> {
        self.ctx.bind_to_thread()?;
        Ok(())
    }

    /// `bytes` of uninitialized device memory (at least 1), counted in
    /// [`Device::allocations`].
    pub fn alloc(&self, bytes: usize) -> Result<DBuf, CudaError> {
        self.allocations.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.alloc_uncounted(bytes)
    }

    /// Buffers [`Device::alloc`] has made: a captured graph stays valid
    /// while this count (and so every buffer address it baked in) holds.
    pub fn allocations(&self) -> u64 {
        self.allocations.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// An allocation kernels reach only through an address table (KV
    /// caches), so it never invalidates a captured graph.
    pub fn alloc_uncounted(&self, bytes: usize) -> Result<DBuf, CudaError> {
        let bytes = bytes.max(1);
        // SAFETY: every kernel writes an output before anything reads it.
        let slice = unsafe { self.stream.alloc::<u8>(bytes)? };
        let ptr = {
            let (ptr, _guard) = slice.device_ptr(&self.stream);
            ptr
        };
        Ok(DBuf { ptr, _slice: Arc::new(slice), bytes })
    }

    /// A new buffer holding `data`.
    pub fn upload<T: Copy>(&self, data: &[T]) -> Result<DBuf, CudaError> {
        let buf = self.alloc(std::mem::size_of_val(data))?;
        self.write(buf.ptr(), data)?;
        Ok(buf)
    }

    /// Copies `data` to the device address `dst`.
    pub fn write<T: Copy>(&self, dst: u64, data: &[T]) -> Result<(), CudaError> {
        if data.is_empty() {
            return Ok(());
        }
        // SAFETY: `dst` addresses at least `size_of_val(data)` bytes (the
        // callers size their buffers); a pageable source is copied before
        // the call returns.
        unsafe { cudarc::driver::result::memcpy_htod_async(dst, data, self.stream.cu_stream())? };
        Ok(())
    }

    /// Copies from the device address `src` into `out` and waits for it.
    pub fn read<T: Copy>(&self, src: u64, out: &mut [T]) -> Result<(), CudaError> {
        if out.is_empty() {
            return Ok(());
        }
        // SAFETY: `src` addresses at least `size_of_val(out)` bytes.
        unsafe { cudarc::driver::result::memcpy_dtoh_async(out, src, self.stream.cu_stream())? };
        self.stream.synchronize()?;
        Ok(())
    }

    pub fn copy(&self, dst: u64, src: u64, bytes: usize) -> Result<(), CudaError> {
        if bytes == 0 {
            return Ok(());
        }
        // SAFETY: both addresses cover `bytes` (the callers size them).
        unsafe { cudarc::driver::result::memcpy_dtod_async(dst, src, bytes, self.stream.cu_stream())? };
        Ok(())
    }

    pub fn zero(&self, dst: u64, bytes: usize) -> Result<(), CudaError> {
        // SAFETY: `dst` covers `bytes`.
        unsafe { cudarc::driver::result::memset_d8_async(dst, 0, bytes, self.stream.cu_stream())? };
        Ok(())
    }

    pub fn sync(&self) -> Result<(), CudaError> {
        self.stream.synchronize()?;
        Ok(())
    }
}

/// A one-dimensional launch of `n` work items, `threads` per block.
pub(crate) fn grid(n: usize, threads: u32) -> LaunchConfig {
    let blocks = n.div_ceil(threads as usize).clamp(1, 65_535 * 8) as u32;
    LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (threads, 1, 1), shared_mem_bytes: 0 }
}

/// A kernel parameter: the address of a value the device can take
/// (`DeviceRepr`: u64 pointers, i32, f32, the `#[repr(C)]` structs).
pub(crate) fn param<T: cudarc::driver::DeviceRepr>(value: &T) -> *mut std::ffi::c_void {
    value as *const T as *mut std::ffi::c_void
}

/// Launches kernel `$name` with the listed arguments (locals of exactly the
/// kernel's parameter types: u64 for pointers, i32, f32, or the `#[repr(C)]`
/// structs of `runner.rs`) through [`Device::launch_raw`].
macro_rules! launch {
    ($dev:expr, $name:literal, $cfg:expr, $($arg:ident),* $(,)?) => {{
        let f = $dev.func($name)?;
        let mut params = [$( crate::device::param(&$arg) ),*];
        // SAFETY: the arguments match the kernel's parameter list in
        // kernels/ in number, order and type, and every pointer addresses
        // a live device buffer sized for the launch.
        unsafe { $dev.launch_raw(f, $cfg, &mut params) }
    }};
}
pub(crate) use launch;

#[cfg(test)]
mod tests {
    use super::{kernel_source, KERNELS};

    /// The body of the function whose definition starts at `at` (its
    /// outermost braces).
    fn body(src: &str, at: usize) -> &str {
        let open = at + src[at..].find('{').expect("a function body");
        let mut depth = 0;
        for (i, c) in src[open..].char_indices() {
            match c {
                '{' => depth += 1,
                '}' => {
                    depth -= 1;
                    if depth == 0 {
                        return &src[open + 1..open + i];
                    }
                }
                _ => {}
            }
        }
        panic!("unbalanced braces after byte {at}");
    }

    /// What launches with programmatic stream serialization (and the
    /// programmatic graph edges they are captured as) rest on: every kernel
    /// in kernels/ reaches `GRID_DEPEND()` — the wait for the kernel before
    /// it — before any of its threads can return, and the template a
    /// kernel forwards to does too. A kernel without it would read its
    /// producer's output before that was written, or finish first and let
    /// the kernel after it overtake the one before. The check is textual:
    /// it does not see a wait inside a condition, or a read of another
    /// kernel's output placed before the wait (review keeps what precedes
    /// it to weights: `q4_load` in `gemv_q4_body`).
    #[test]
    fn every_kernel_waits_for_the_kernel_before_it() {
        let src = kernel_source();
        let mut checked = Vec::new();
        for (at, _) in src.match_indices("extern \"C\" __global__") {
            let mut sig = &src[at..at + src[at..].find('{').expect("a body")];
            // `__launch_bounds__(...)` comes before the name.
            if let Some(lb) = sig.find("__launch_bounds__(") {
                let mut depth = 0;
                let close = sig[lb..]
                    .char_indices()
                    .find(|&(_, c)| {
                        depth += i32::from(c == '(') - i32::from(c == ')');
                        c == ')' && depth == 0
                    })
                    .expect("launch bounds close");
                sig = &sig[lb + close.0 + 1..];
            }
            let head = &sig[..sig.find('(').expect("a parameter list")];
            let name = head.rsplit(|c: char| c.is_whitespace()).next().expect("a kernel name").to_string();
            let mut code = body(src, at);
            // A kernel that forwards to a template: check the template.
            if let Some(call) = code.find("_body<") {
                let template = &code[..call].rsplit(|c: char| !c.is_alphanumeric() && c != '_').next().expect("a name");
                let def = src.find(&format!("void {template}_body(")).expect("the template's definition");
                code = body(src, def);
            }
            let wait = code.find("GRID_DEPEND();").unwrap_or_else(|| panic!("kernel `{name}` never waits"));
            assert!(!code[..wait].contains("return"), "kernel `{name}` may return before it waits");
            checked.push(name);
        }
        checked.sort();
        let mut listed: Vec<String> = KERNELS.iter().map(|k| k.to_string()).collect();
        listed.sort();
        assert_eq!(checked, listed, "every loaded kernel is checked");
    }
}
