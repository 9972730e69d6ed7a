//! Runs a compiled plan on the device, step by step. Every slot of the plan
//! holds its value either on the device (f32 storage; a value of f16 type
//! is kept rounded to f16, as native-cpu stores it; i64 as i64) or on the
//! host. The ops that carry the work (projections, norms, rotary,
//! attention, gathers, elementwise math, layout copies) run as kernels;
//! what is left — shape arithmetic on i64 tensors, masks — runs on the host
//! through native-cpu's evaluator, so both backends compute those alike.

use std::collections::HashMap;
use std::sync::Arc;

use cudarc::driver::{sys, CudaGraph};

use onnx_genai_native::kernels::Runtime;
use onnx_genai_native::value::{DType, Shape, Value};
use onnx_genai_native::{Op, Plan, Ref};

use crate::device::{grown, DBuf, Device};
use crate::error::CudaError;
use crate::kv::SeqKv;
use crate::weights::{Projection, Scratch};

mod attention;
mod ops;

/// Kernel error codes (kernels/).
const ERR_INDEX: i32 = 1;
const ERR_POSITION: i32 = 2;

const MAX_RANK: usize = 6;

#[repr(C)]
#[derive(Clone, Copy, Default)]
struct Broadcast {
    rank: i32,
    out_dims: [i32; MAX_RANK],
    a_strides: [i32; MAX_RANK],
    b_strides: [i32; MAX_RANK],
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
struct Permute {
    rank: i32,
    out_dims: [i32; MAX_RANK],
    in_strides: [i32; MAX_RANK],
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
struct Heads {
    heads_first: i32,
    heads: i32,
    rows: i32,
    dim: i32,
    stride: i32,
    offset: i32,
}

// SAFETY: plain `#[repr(C)]` integers, laid out as the structs of the same
// name in kernels/.
unsafe impl cudarc::driver::DeviceRepr for Broadcast {}
unsafe impl cudarc::driver::DeviceRepr for Permute {}
unsafe impl cudarc::driver::DeviceRepr for Heads {}

/// A value on the device.
pub(crate) struct DTensor {
    pub shape: Shape,
    pub dtype: DType,
    pub buf: DBuf,
}

impl DTensor {
    fn len(&self) -> usize {
        self.shape.iter().product()
    }
}

#[derive(Default)]
pub(crate) enum Slot {
    #[default]
    Empty,
    Host(Value),
    Dev(DTensor),
}

/// One sequence's rows in a run.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Segment {
    pub start: usize,
    pub len: usize,
    pub past: usize,
}

fn unsupported(what: impl Into<String>) -> CudaError {
    CudaError::Unsupported(what.into())
}

fn i32_of(v: usize) -> Result<i32, String> {
    i32::try_from(v).map_err(|_| format!("size {v} does not fit the kernels' 32-bit sizes"))
}

fn is_float(t: DType) -> bool {
    matches!(t, DType::F32 | DType::F16)
}

/// Host values as device storage: f32 (f16 widened) or i64.
fn host_bytes(v: &Value) -> Result<(Vec<u8>, DType), String> {
    let bytes = match v.dtype() {
        DType::F32 => v.as_f32()?.iter().flat_map(|x| x.to_ne_bytes()).collect(),
        DType::F16 => v.as_f16()?.iter().flat_map(|x| x.to_f32().to_ne_bytes()).collect(),
        DType::I64 => v.as_i64()?.iter().flat_map(|x| x.to_ne_bytes()).collect(),
        other => return Err(format!("a {other} value cannot move to the device")),
    };
    Ok((bytes, v.dtype()))
}

/// A decode step of one batch width, captured.
struct Captured {
    graph: CudaGraph,
    /// [`Device::allocations`] when captured: the addresses it baked in are
    /// valid while the count holds.
    allocations: u64,
}

/// The state of runs of one plan on one device.
pub(crate) struct Runner {
    pub device: Arc<Device>,
    pub plan: Arc<Plan>,
    /// The projection of each step that has one.
    projections: Vec<Option<Projection>>,
    consts: Vec<Option<DTensor>>,
    slots: Vec<Slot>,
    scratch: Scratch,
    host: Runtime,
    // Per-run metadata.
    row_seg: Option<DBuf>,
    row_pos: Option<DBuf>,
    seg_total: Option<DBuf>,
    kv_table: Option<DBuf>,
    picked_rows: Option<DBuf>,
    picked: Option<DBuf>,
    err: DBuf,
    /// When set, each run replaces this with every step's first output.
    pub trace: Option<Vec<Value>>,
    /// Steps that ran on the host in the last run (for `inspect` and tests).
    pub host_steps: usize,
    /// Token ids and positions, in buffers that outlive runs (a captured
    /// step reads them where it was captured).
    ids: Option<DBuf>,
    positions: Option<DBuf>,
    /// Replay decode steps as CUDA graphs (on by default).
    pub use_graphs: bool,
    /// Decode steps captured, by batch width.
    graphs: HashMap<usize, Captured>,
    /// Batch widths whose last eager decode step allocated nothing and ran
    /// nothing on the host (the next one is captured), with the count then.
    warm: HashMap<usize, u64>,
    /// Whether the run in progress may be captured (no host step, attention
    /// of a fixed launch shape).
    capturable: bool,
    /// Decode steps replayed from a graph so far.
    pub replays: u64,
    /// Page-locked host buffer the logits of a batch come out through (the
    /// copy runs at the link's speed: a pageable one went at ~4 GB/s,
    /// 0.7 ms for 16 sequences' logits).
    logits_out: Option<cudarc::driver::PinnedHostSlice<f32>>,
    /// When set, every step is timed alone (the stream drained around it)
    /// and its time added under its op's name.
    pub profile: Option<HashMap<String, (std::time::Duration, u64)>>,
}

// SAFETY: a runner is used behind its model's mutex, one thread at a time;
// the graphs it holds belong to its device's stream.
unsafe impl Send for Runner {}

impl Runner {
    pub fn new(device: Arc<Device>, plan: Arc<Plan>) -> Result<Self, CudaError> {
        device.bind()?;
        let mut projections = Vec::new();
        for step in plan.steps() {
            projections.push(match step.op {
                Op::Linear { weight, bias } => {
                    Some(Projection::upload(&device, weight, bias.as_deref().map(Vec::as_slice))?)
                }
                Op::GatedMlp { weight } => Some(Projection::upload(&device, weight, None)?),
                _ => None,
            });
        }
        let host = Runtime::new(1).map_err(|e| unsupported(format!("host evaluator: {e}")))?;
        let err = device.alloc(4)?;
        let consts = (0..plan.constants()).map(|_| None).collect();
        let slots = (0..plan.slots()).map(|_| Slot::Empty).collect();
        Ok(Self {
            device,
            plan,
            projections,
            consts,
            slots,
            scratch: Scratch::default(),
            host,
            row_seg: None,
            row_pos: None,
            seg_total: None,
            kv_table: None,
            picked_rows: None,
            picked: None,
            err,
            trace: None,
            host_steps: 0,
            ids: None,
            positions: None,
            use_graphs: true,
            graphs: HashMap::new(),
            warm: HashMap::new(),
            capturable: true,
            replays: 0,
            logits_out: None,
            profile: None,
        })
    }

    /// Forgets every captured decode step (and which widths were warm).
    pub fn drop_graphs(&mut self) {
        self.graphs.clear();
        self.warm.clear();
    }

    /// The nodes, edges and programmatic edges (those a kernel may start
    /// across: programmatic dependent launch) of the decode step captured
    /// for batch width `b`; `None` before a driver of CUDA 12.3, which
    /// cannot list edge types.
    pub fn graph_shape(&self, b: usize) -> Option<(usize, usize, usize)> {
        if self.device.driver_version < 12030 {
            return None;
        }
        let graph = self.graphs.get(&b)?.graph.cu_graph();
        let null = std::ptr::null_mut::<sys::CUgraphNode>();
        let (mut nodes, mut edges) = (0usize, 0usize);
        // SAFETY: `graph` is alive while `self.graphs` holds it; the first
        // calls only count, the last fills buffers of the counted length.
        unsafe {
            sys::cuGraphGetNodes(graph, null, &mut nodes).result().ok()?;
            sys::cuGraphGetEdges_v2(graph, null, null, std::ptr::null_mut(), &mut edges).result().ok()?;
            let mut from: Vec<sys::CUgraphNode> = vec![std::ptr::null_mut(); edges];
            let mut to: Vec<sys::CUgraphNode> = vec![std::ptr::null_mut(); edges];
            let mut data: Vec<sys::CUgraphEdgeData> = vec![std::mem::zeroed(); edges];
            sys::cuGraphGetEdges_v2(graph, from.as_mut_ptr(), to.as_mut_ptr(), data.as_mut_ptr(), &mut edges)
                .result()
                .ok()?;
            let programmatic = sys::CUgraphDependencyType::CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC as u8;
            Some((nodes, edges, data.iter().take(edges).filter(|d| d.type_ == programmatic).count()))
        }
    }

    /// Bytes of projection weights on the device.
    pub fn weight_bytes(&self) -> usize {
        self.projections.iter().flatten().map(Projection::bytes).sum()
    }

    /// Runs `tokens[i]` after what `kvs[i]` holds for every sequence at
    /// once (each cache has room reserved) and writes each one's last
    /// logits. Cache lengths are advanced by the caller on success.
    pub fn run(&mut self, kvs: &[&SeqKv], tokens: &[&[u32]], logits: &mut [&mut Vec<f32>]) -> Result<(), String> {
        let dev = self.device.clone();
        dev.bind().map_err(|e| e.to_string())?;
        let mut segments = Vec::with_capacity(kvs.len());
        let mut rows = 0;
        for (kv, t) in kvs.iter().zip(tokens) {
            segments.push(Segment { start: rows, len: t.len(), past: kv.len() });
            rows += t.len();
        }
        let started = self.profile.is_some().then(std::time::Instant::now);
        self.feed(&segments, tokens, rows).map_err(|e| e.to_string())?;
        self.upload_batch(kvs, &segments, rows).map_err(|e| e.to_string())?;
        if let Some(t) = started {
            dev.sync().map_err(|e| e.to_string())?;
            self.profiled("(host) inputs", t);
        }
        dev.zero(self.err.ptr(), 4).map_err(|e| e.to_string())?;
        let ports = self.plan.ports();
        // Decode steps (one new position per sequence) of a batch width run
        // the same launches on the same buffers every time: the third is
        // captured, later ones replay it.
        let key =
            (self.use_graphs && self.trace.is_none() && self.profile.is_none() && segments.iter().all(|s| s.len == 1))
                .then_some(segments.len());
        if let Some(b) = key {
            match self.graphs.get(&b) {
                Some(c) if c.allocations == dev.allocations() => {
                    c.graph.launch().map_err(|e| e.to_string())?;
                    self.replays += 1;
                    return self.collect(ports.logits, ports.head.is_some(), &segments, rows, logits);
                }
                Some(_) => {
                    self.graphs.remove(&b);
                }
                None => {}
            }
        }
        let before = dev.allocations();
        if let Some(b) = key.filter(|b| self.warm.get(b) == Some(&before)) {
            if self.capture(b, &segments, rows, before).map_err(|e| e.to_string())? {
                return self.collect(ports.logits, ports.head.is_some(), &segments, rows, logits);
            }
        }
        self.run_steps(&segments, rows)?;
        if let Some(b) = key {
            if self.capturable && dev.allocations() == before {
                self.warm.insert(b, before);
            } else {
                self.warm.remove(&b);
            }
        }
        let started = self.profile.is_some().then(std::time::Instant::now);
        self.collect(ports.logits, ports.head.is_some(), &segments, rows, logits)?;
        if let Some(t) = started {
            self.profiled("(host) logits out", t);
        }
        Ok(())
    }

    /// Adds the time since `started` to the profile under `key`.
    fn profiled(&mut self, key: &str, started: std::time::Instant) {
        let spent = started.elapsed();
        if let Some(p) = self.profile.as_mut() {
            let e = p.entry(key.to_string()).or_default();
            e.0 += spent;
            e.1 += 1;
        }
    }

    /// Captures this decode step as a graph and launches it; `false` when
    /// the step could not be captured (it then runs eagerly instead).
    fn capture(&mut self, b: usize, segments: &[Segment], rows: usize, before: u64) -> Result<bool, CudaError> {
        let dev = self.device.clone();
        dev.stream.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)?;
        // Launches with programmatic stream serialization are captured as
        // programmatic edges (into each of our kernels; an edge into a
        // cuBLAS kernel, launched without it, stays a full dependency).
        let ran = self.run_steps(segments, rows);
        let graph = dev.stream.end_capture(sys::CUgraphInstantiate_flags(0));
        match (ran, graph) {
            (Ok(()), Ok(Some(graph))) if self.capturable && dev.allocations() == before => {
                graph.launch()?;
                self.graphs.insert(b, Captured { graph, allocations: before });
                self.warm.remove(&b);
                Ok(true)
            }
            _ => {
                self.warm.remove(&b);
                Ok(false)
            }
        }
    }

    /// Every step of the plan, launched in order.
    fn run_steps(&mut self, segments: &[Segment], rows: usize) -> Result<(), String> {
        if let Some(t) = self.trace.as_mut() {
            t.clear();
        }
        self.host_steps = 0;
        self.capturable = true;
        let ports = self.plan.ports();
        let plan = self.plan.clone();
        for (index, step) in plan.steps().enumerate() {
            let head = ports.head == Some(index) && segments.len() < rows;
            let started = match self.profile.is_some() {
                true => {
                    self.device.sync().map_err(|e| e.to_string())?;
                    Some(std::time::Instant::now())
                }
                false => None,
            };
            self.step(index, step.op, step.inputs, step.outputs, segments, rows, head)
                .map_err(|e| format!("{} ({}): {e}", step.name, step.op.name()))?;
            if let Some(t) = started {
                self.device.sync().map_err(|e| e.to_string())?;
                // Projections by shape: one op name covers weights of very
                // different sizes (the logits head is 85 times an O).
                let key = match &self.projections[index] {
                    Some(p) => format!("{} {}x{}", step.op.name(), p.k, p.n),
                    None => step.op.name(),
                };
                self.profiled(&key, t);
            }
            if self.trace.is_some() {
                let first = match step.outputs.first() {
                    Some(s) => self.host_value(&Slot::clone_ref(&self.slots[*s])).map_err(|e| e.to_string())?,
                    None => Value::default(),
                };
                if let Some(t) = self.trace.as_mut() {
                    t.push(first);
                }
            }
        }
        Ok(())
    }

    /// The token ids and positions, written to the device buffers their
    /// slots read, and (for a plan that reads one) the attention mask as a
    /// host value.
    fn feed(&mut self, segments: &[Segment], tokens: &[&[u32]], rows: usize) -> Result<(), CudaError> {
        let ports = self.plan.ports();
        let dev = self.device.clone();
        let shape: Shape = [1, rows].into_iter().collect();
        if let Some(s) = ports.token_ids {
            let ids: Vec<i64> = tokens.iter().flat_map(|t| t.iter().map(|id| i64::from(*id))).collect();
            let buf = grown(&dev, &mut self.ids, rows * 8)?.clone();
            dev.write(buf.ptr(), &ids)?;
            self.slots[s] = Slot::Dev(DTensor { shape: shape.clone(), dtype: DType::I64, buf });
        }
        if let Some(s) = ports.position_ids {
            let pos: Vec<i64> =
                segments.iter().flat_map(|seg| (seg.past..seg.past + seg.len).map(|p| p as i64)).collect();
            let buf = grown(&dev, &mut self.positions, rows * 8)?.clone();
            dev.write(buf.ptr(), &pos)?;
            self.slots[s] = Slot::Dev(DTensor { shape, dtype: DType::I64, buf });
        }
        if let (Some(s), Some(seg)) = (ports.attention_mask, segments.first()) {
            let total = seg.past + seg.len;
            self.slots[s] = Slot::Host(Value::i64([1, total], vec![1; total]));
        }
        Ok(())
    }

    /// Each row's sequence and position, each sequence's total, and the KV
    /// address table `[key | value][layer][sequence]`.
    fn upload_batch(&mut self, kvs: &[&SeqKv], segments: &[Segment], rows: usize) -> Result<(), CudaError> {
        let dev = self.device.clone();
        let mut row_seg = Vec::with_capacity(rows);
        let mut row_pos = Vec::with_capacity(rows);
        for (s, seg) in segments.iter().enumerate() {
            for i in 0..seg.len {
                row_seg.push(s as i32);
                row_pos.push((seg.past + i) as i32);
            }
        }
        let totals: Vec<i32> = segments.iter().map(|s| (s.past + s.len) as i32).collect();
        let layers = self.plan.binding.layers.len();
        let mut table = vec![0u64; 2 * layers * segments.len()];
        for (s, kv) in kvs.iter().enumerate() {
            for l in 0..layers {
                let (k, v) = kv.pointers(l).ok_or_else(|| unsupported(format!("KV layer {l} is not allocated")))?;
                table[l * segments.len() + s] = k;
                table[(layers + l) * segments.len() + s] = v;
            }
        }
        dev.write(grown(&dev, &mut self.row_seg, rows * 4)?.ptr(), &row_seg)?;
        dev.write(grown(&dev, &mut self.row_pos, rows * 4)?.ptr(), &row_pos)?;
        dev.write(grown(&dev, &mut self.seg_total, totals.len() * 4)?.ptr(), &totals)?;
        dev.write(grown(&dev, &mut self.kv_table, table.len() * 8)?.ptr(), &table)?;
        Ok(())
    }

    /// A host copy of a slot's value.
    fn host_value(&self, slot: &SlotRef<'_>) -> Result<Value, CudaError> {
        match slot {
            SlotRef::Host(v) => Ok((*v).clone()),
            SlotRef::Empty => Ok(Value::default()),
            SlotRef::Dev(t) => download(&self.device, t),
        }
    }

    /// The device form of input `r`, uploading a host value (and caching a
    /// constant's upload).
    fn device_input(&mut self, r: Ref) -> Result<(u64, Shape, DType), CudaError> {
        match r {
            Ref::Const(c) => {
                if self.consts[c].is_none() {
                    let v = self.plan.constant(c);
                    self.consts[c] = Some(upload(&self.device, v)?);
                }
                let t = self.consts[c].as_ref().ok_or_else(|| unsupported("constant upload vanished"))?;
                Ok((t.buf.ptr(), t.shape.clone(), t.dtype))
            }
            Ref::Slot(s) => {
                if let Slot::Host(v) = &self.slots[s] {
                    let t = upload(&self.device, v)?;
                    self.slots[s] = Slot::Dev(t);
                }
                match &self.slots[s] {
                    Slot::Dev(t) => Ok((t.buf.ptr(), t.shape.clone(), t.dtype)),
                    _ => Err(unsupported(format!("slot {s} holds no value"))),
                }
            }
        }
    }

    /// An input's element type and shape without moving it.
    fn input_meta(&self, r: Option<Ref>) -> Option<(DType, Shape)> {
        match r? {
            Ref::Const(c) => {
                let v = self.plan.constant(c);
                Some((v.dtype(), v.shape.clone()))
            }
            Ref::Slot(s) => match &self.slots[s] {
                Slot::Host(v) => Some((v.dtype(), v.shape.clone())),
                Slot::Dev(t) => Some((t.dtype, t.shape.clone())),
                Slot::Empty => None,
            },
        }
    }

    /// An input's i64 values on the host (shape operands).
    fn host_ints(&self, r: Option<Ref>) -> Result<Vec<i64>, CudaError> {
        let v = match r.ok_or_else(|| unsupported("a shape operand is missing"))? {
            Ref::Const(c) => self.plan.constant(c).clone(),
            Ref::Slot(s) => self.host_value(&Slot::clone_ref(&self.slots[s]))?,
        };
        v.ints().map(<[i64]>::to_vec).ok_or_else(|| unsupported("a shape operand is not i64"))
    }

    /// A device buffer of at least `bytes` for output slot `s`, reusing
    /// what the slot held.
    fn out_buf(&mut self, s: usize, bytes: usize) -> Result<DBuf, CudaError> {
        let persistent = |b: &DBuf, p: &Option<DBuf>| p.as_ref().is_some_and(|p| p.ptr() == b.ptr());
        match std::mem::take(&mut self.slots[s]) {
            Slot::Dev(t)
                if t.buf.bytes() >= bytes && !persistent(&t.buf, &self.ids) && !persistent(&t.buf, &self.positions) =>
            {
                Ok(t.buf)
            }
            _ => self.device.alloc(bytes),
        }
    }

    fn put(&mut self, s: usize, shape: Shape, dtype: DType, buf: DBuf) {
        self.slots[s] = Slot::Dev(DTensor { shape, dtype, buf });
    }

    #[allow(clippy::too_many_arguments)]
    fn step(
        &mut self,
        index: usize,
        op: &Op,
        inputs: &[Option<Ref>],
        outputs: &[usize],
        segments: &[Segment],
        rows: usize,
        head: bool,
    ) -> Result<(), CudaError> {
        let metas: Vec<Option<(DType, Shape)>> = inputs.iter().map(|r| self.input_meta(*r)).collect();
        let dtype = |i: usize| metas.get(i).and_then(|m| m.as_ref()).map(|m| m.0);
        let on_device =
            |i: usize| matches!(inputs.get(i), Some(Some(Ref::Slot(s))) if matches!(self.slots[*s], Slot::Dev(_)));
        let float = |i: usize| dtype(i).is_some_and(is_float);
        let device = match op {
            Op::Linear { .. } | Op::GatedMlp { .. } | Op::Attention { .. } | Op::GatherQ4 { .. } => true,
            Op::Binary(b) => float(0) && dtype(0) == dtype(1) && ops::binary_code(*b).is_some(),
            Op::Unary(u) => float(0) && ops::unary_code(*u).is_some(),
            Op::Cast(t) => float(0) && is_float(*t),
            Op::Identity | Op::Reshape | Op::Unsqueeze(_) | Op::Squeeze(_) => float(0) && on_device(0),
            Op::Transpose(_) => float(0),
            Op::Gather { axis } => *axis == 0 && float(0) && dtype(1) == Some(DType::I64),
            // The device kernels normalize the last axis and write no
            // statistics outputs.
            Op::RmsNorm { axis: -1, .. } | Op::SkipRmsNorm { .. } => dtype(0) == Some(DType::F32) && inputs.len() >= 2,
            Op::LayerNorm { axis: -1, .. } => dtype(0) == Some(DType::F32) && inputs.len() >= 2 && outputs.len() == 1,
            Op::Rotary { .. } => dtype(0) == Some(DType::F32),
            _ => false,
        };
        if !device {
            return self.host_step(op, inputs, outputs);
        }
        let out = *outputs.first().ok_or_else(|| unsupported("the step has no output"))?;
        let input =
            |i: usize| inputs.get(i).copied().flatten().ok_or_else(|| unsupported(format!("input {i} is missing")));
        match op {
            Op::Linear { .. } if head => self.head_rows(index, input(0)?, out, segments),
            Op::Linear { .. } => self.linear(index, input(0)?, out, false),
            Op::GatedMlp { .. } => self.linear(index, input(0)?, out, true),
            Op::Binary(b) => self.binary(*b, input(0)?, input(1)?, out),
            Op::Unary(u) => {
                let code = ops::unary_code(*u).ok_or_else(|| unsupported(format!("{u:?} on the device")))?;
                self.map(code, input(0)?, out, None)
            }
            Op::Cast(t) => self.map(9, input(0)?, out, Some(*t)),
            Op::Identity | Op::Reshape | Op::Unsqueeze(_) | Op::Squeeze(_) => self.relayout(op, inputs, out),
            Op::Transpose(perm) => self.transpose(perm.as_deref(), input(0)?, out),
            Op::Gather { .. } => self.gather(input(0)?, input(1)?, out),
            Op::GatherQ4 { block } => self.gather_q4(*block, inputs, out),
            Op::RmsNorm { eps, .. } | Op::SkipRmsNorm { eps } | Op::LayerNorm { eps, .. } => {
                self.norm(op, *eps, inputs, outputs)
            }
            Op::Rotary { layout, cached, spec_layout } => self.rotary(*layout, *cached, *spec_layout, inputs, out),
            Op::Attention { spec, layer } => self.attention(spec, *layer, inputs, out, segments, rows),
            _ => self.host_step(op, inputs, outputs),
        }
    }

    /// Runs `op` on host copies of its inputs with native-cpu's evaluator.
    fn host_step(&mut self, op: &Op, inputs: &[Option<Ref>], outputs: &[usize]) -> Result<(), CudaError> {
        if matches!(op, Op::Attention { .. }) {
            return Err(unsupported("attention must run on the device (its KV cache lives there)"));
        }
        self.host_steps += 1;
        self.capturable = false;
        let mut owned: Vec<Option<Value>> = Vec::with_capacity(inputs.len());
        for r in inputs {
            owned.push(match r {
                None => None,
                Some(Ref::Const(_)) => None,
                Some(Ref::Slot(s)) => match &self.slots[*s] {
                    Slot::Dev(t) => Some(download(&self.device, t)?),
                    _ => None,
                },
            });
        }
        let ins: Vec<Option<&Value>> = inputs
            .iter()
            .zip(&owned)
            .map(|(r, o)| match (r, o) {
                (_, Some(v)) => Some(v),
                (Some(Ref::Const(c)), None) => Some(self.plan.constant(*c)),
                (Some(Ref::Slot(s)), None) => match &self.slots[*s] {
                    Slot::Host(v) => Some(v),
                    _ => None,
                },
                (None, None) => None,
            })
            .collect();
        let mut outs: Vec<Value> = outputs.iter().map(|_| Value::default()).collect();
        onnx_genai_native::eval(op, &ins, &mut outs, self.host.ctx()).map_err(unsupported)?;
        drop(ins);
        for (s, v) in outputs.iter().zip(outs) {
            self.slots[*s] = Slot::Host(v);
        }
        Ok(())
    }

    /// Copies each sequence's last-position logits out and checks that no
    /// kernel reported bad input.
    fn collect(
        &mut self,
        slot: usize,
        has_head: bool,
        segments: &[Segment],
        rows: usize,
        logits: &mut [&mut Vec<f32>],
    ) -> Result<(), String> {
        let dev = self.device.clone();
        let mut code = [0i32];
        dev.read(self.err.ptr(), &mut code).map_err(|e| e.to_string())?;
        match code[0] {
            0 => {}
            ERR_INDEX => return Err("a gather index is out of range (token id beyond the vocabulary?)".into()),
            ERR_POSITION => return Err("a position is beyond the rotary cache".into()),
            other => return Err(format!("a kernel reported error {other}")),
        }
        let vocab = self.plan.binding.vocab_size;
        let (shape, total) = match &self.slots[slot] {
            Slot::Dev(t) => (t.shape.clone(), t.len()),
            Slot::Host(v) => (v.shape.clone(), v.len()),
            Slot::Empty => return Err("no step computed the logits".into()),
        };
        let per_sequence = total == segments.len() * vocab && has_head && segments.len() < rows;
        if shape.last() != Some(&vocab) || (!per_sequence && total != rows * vocab) {
            return Err(format!("logits shape {shape:?} does not hold {rows} rows of vocab {vocab}"));
        }
        let row_of = |i: usize, seg: &Segment| if per_sequence { i } else { seg.start + seg.len - 1 };
        // Rows one after another (every decode step) come out in one copy:
        // one transfer and one wait instead of one per sequence.
        let first = segments.first().map_or(0, |seg| row_of(0, seg));
        let contiguous = segments.iter().enumerate().all(|(i, seg)| row_of(i, seg) == first + i);
        if let (true, Slot::Dev(t)) = (contiguous && segments.len() > 1, &self.slots[slot]) {
            if t.dtype == DType::F32 {
                let need = segments.len() * vocab;
                let src = t.buf.ptr() + (first * vocab * 4) as u64;
                let host = pinned(&dev, &mut self.logits_out, need).map_err(|e| e.to_string())?;
                dev.read(src, &mut host[..need]).map_err(|e| e.to_string())?;
                for (i, out) in logits.iter_mut().enumerate().take(segments.len()) {
                    out.clear();
                    out.extend_from_slice(&host[i * vocab..(i + 1) * vocab]);
                }
                return Ok(());
            }
        }
        for (i, (seg, out)) in segments.iter().zip(logits.iter_mut()).enumerate() {
            let row = row_of(i, seg);
            out.clear();
            out.resize(vocab, 0.0);
            match &self.slots[slot] {
                Slot::Dev(t) if t.dtype == DType::F32 => {
                    dev.read(t.buf.ptr() + (row * vocab * 4) as u64, out).map_err(|e| e.to_string())?
                }
                other => {
                    let v = self.host_value(&Slot::clone_ref(other)).map_err(|e| e.to_string())?;
                    let data: Vec<f32> = match v.dtype() {
                        DType::F16 => v.as_f16()?.iter().map(|h| h.to_f32()).collect(),
                        _ => v.as_f32()?.to_vec(),
                    };
                    out.copy_from_slice(&data[row * vocab..(row + 1) * vocab]);
                }
            }
        }
        Ok(())
    }
}

/// A borrowed view of a slot.
pub(crate) enum SlotRef<'a> {
    Empty,
    Host(&'a Value),
    Dev(&'a DTensor),
}

impl Slot {
    fn clone_ref(&self) -> SlotRef<'_> {
        match self {
            Slot::Empty => SlotRef::Empty,
            Slot::Host(v) => SlotRef::Host(v),
            Slot::Dev(t) => SlotRef::Dev(t),
        }
    }
}

fn elem_bytes(t: DType) -> usize {
    match t {
        DType::I64 => 8,
        DType::U8 | DType::Bool => 1,
        DType::F64 => 8,
        DType::I32 => 4,
        _ => 4,
    }
}

fn check_width(shape: &[usize], d: usize) -> Result<(), CudaError> {
    if shape.iter().product::<usize>() != d {
        return Err(unsupported(format!("scale {shape:?} does not match the normalized axis of {d}")));
    }
    Ok(())
}

/// A page-locked host buffer of at least `len` values, grown when short.
fn pinned<'a>(
    dev: &Device,
    buf: &'a mut Option<cudarc::driver::PinnedHostSlice<f32>>,
    len: usize,
) -> Result<&'a mut [f32], CudaError> {
    if buf.as_ref().is_none_or(|b| b.len() < len) {
        *buf = None;
        // SAFETY: the buffer is written by the copy that reads it back
        // before anything reads it. Flags 0: cached, not write-combined
        // (the host reads it).
        *buf = Some(unsafe { dev.ctx.alloc_pinned_with_flags::<f32>(len, 0)? });
    }
    match buf.as_mut() {
        Some(b) => Ok(b.as_mut_slice()?),
        None => Err(unsupported("a pinned buffer vanished")),
    }
}

fn upload(dev: &Device, v: &Value) -> Result<DTensor, CudaError> {
    let (bytes, dtype) = host_bytes(v).map_err(unsupported)?;
    Ok(DTensor { shape: v.shape.clone(), dtype, buf: dev.upload(&bytes)? })
}

fn download(dev: &Device, t: &DTensor) -> Result<Value, CudaError> {
    let n = t.len();
    Ok(match t.dtype {
        DType::I64 => {
            let mut v = vec![0i64; n];
            dev.read(t.buf.ptr(), &mut v)?;
            Value::i64(&t.shape, v)
        }
        DType::F16 => {
            let mut v = vec![0f32; n];
            dev.read(t.buf.ptr(), &mut v)?;
            Value::f16(&t.shape, v.into_iter().map(half::f16::from_f32).collect())
        }
        DType::F32 => {
            let mut v = vec![0f32; n];
            dev.read(t.buf.ptr(), &mut v)?;
            Value::f32(&t.shape, v)
        }
        other => return Err(unsupported(format!("a {other} value on the device"))),
    })
}
