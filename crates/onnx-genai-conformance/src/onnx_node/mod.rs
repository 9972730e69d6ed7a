//! ONNX's own backend test cases for single operators
//! (`onnx/backend/test/data/node/*` in the `onnx` wheel), run on native-cpu
//! and, as a check of this harness, on ONNX Runtime.
//!
//! Each case is a model (usually one node) with input and expected output
//! protobufs. native-cpu compiles it with [`onnx_genai_native::compile_graph`]
//! (the decoder's passes; the inputs stay graph inputs, nothing is folded
//! away) and evaluates it; outputs are held to ONNX's own default tolerance
//! (`|got - want| <= atol + rtol * |want|`, rtol 1e-3, atol 1e-7) unless the
//! ratchet lists an override with its reason. What every case is expected
//! to do lives in `conformance/onnx-node-tests.yaml` (see [`ratchet`]).

pub mod ratchet;

use std::path::{Path, PathBuf};

use onnx_genai_native::{compile_graph, kernels::Runtime, value::Value, CompileError};
use onnx_genai_onnx::{DataType, Model, Tensor};
use onnx_genai_ort::OrtGraph;
use serde::{Deserialize, Serialize};

/// How a case ended on one backend. The order is from best to worst for
/// native-cpu's target: a case of an op it claims must pass or be refused
/// at compile time, never run to a wrong answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Outcome {
    /// Every output of every data set within tolerance.
    Pass,
    /// A typed compile error naming the attribute, input or dtype refused.
    Unsupported,
    /// The op is not one the backend lowers at all.
    NoKernel,
    /// The project's ONNX reader refuses the model or its data (element
    /// types and value kinds the IR does not hold: strings, sequences, …).
    Unreadable,
    /// Compiled, but failed (or panicked) while running.
    Error,
    /// Ran and produced a different answer.
    Wrong,
}

impl Outcome {
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Pass => "pass",
            Outcome::Unsupported => "unsupported",
            Outcome::NoKernel => "no-kernel",
            Outcome::Unreadable => "unreadable",
            Outcome::Error => "error",
            Outcome::Wrong => "wrong",
        }
    }
}

/// An outcome and, unless it passed, why.
#[derive(Clone, Debug, PartialEq)]
pub struct Verdict {
    pub outcome: Outcome,
    pub why: Option<String>,
}

impl Verdict {
    fn pass() -> Self {
        Self { outcome: Outcome::Pass, why: None }
    }
    fn fail(outcome: Outcome, why: impl std::fmt::Display) -> Self {
        Self { outcome, why: Some(why.to_string()) }
    }
}

/// `|got - want| <= atol + rtol * |want|` for floating outputs; integers and
/// booleans must be equal.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Tolerance {
    pub rtol: f64,
    pub atol: f64,
}

/// ONNX's own defaults (`onnx.backend.test.case.node.expect`).
pub const ONNX_DEFAULT: Tolerance = Tolerance { rtol: 1e-3, atol: 1e-7 };

/// One case directory.
#[derive(Clone, Debug)]
pub struct Case {
    pub name: String,
    pub dir: PathBuf,
}

#[derive(Clone, Debug)]
pub struct CaseResult {
    pub name: String,
    /// The operator the case tests (`Op`, `domain::Op`, or `Op (expanded)`
    /// for a function body spelled out in other ops).
    pub op: String,
    pub native: Verdict,
    pub ort: Verdict,
}

/// The case directories under `root` (each holds a `model.onnx`), by name.
pub fn discover(root: &Path) -> std::io::Result<Vec<Case>> {
    let mut cases = Vec::new();
    for entry in std::fs::read_dir(root)? {
        let dir = entry?.path();
        if dir.join("model.onnx").is_file() {
            let name = dir.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
            cases.push(Case { name, dir });
        }
    }
    cases.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(cases)
}

/// Inputs and expected outputs of one `test_data_set_*` directory, named
/// after the graph's inputs and outputs in order.
struct DataSet {
    inputs: Vec<Tensor>,
    outputs: Vec<Tensor>,
}

fn read_tensors(dir: &Path, stem: &str, names: &[String]) -> Result<Vec<Tensor>, String> {
    let mut tensors = Vec::new();
    for (i, name) in names.iter().enumerate() {
        let path = dir.join(format!("{stem}_{i}.pb"));
        if !path.is_file() {
            break;
        }
        let bytes = std::fs::read(&path).map_err(|e| format!("{}: {e}", path.display()))?;
        let mut t = onnx_genai_onnx::decode_tensor(&bytes).map_err(|e| format!("{}: {e}", path.display()))?;
        t.name = name.clone();
        tensors.push(t);
    }
    Ok(tensors)
}

fn data_sets(case: &Case, model: &Model) -> Result<Vec<DataSet>, String> {
    let initialized: std::collections::HashSet<&str> =
        model.graph.initializers.iter().map(|t| t.name.as_str()).collect();
    let inputs: Vec<String> =
        model.graph.inputs.iter().filter(|i| !initialized.contains(i.name.as_str())).map(|i| i.name.clone()).collect();
    let outputs: Vec<String> = model.graph.outputs.iter().map(|o| o.name.clone()).collect();
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(&case.dir)
        .map_err(|e| format!("{}: {e}", case.dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.is_dir() && p.file_name().is_some_and(|n| n.to_string_lossy().starts_with("test_data_set_")))
        .collect();
    dirs.sort();
    dirs.iter()
        .map(|d| {
            Ok(DataSet { inputs: read_tensors(d, "input", &inputs)?, outputs: read_tensors(d, "output", &outputs)? })
        })
        .collect()
}

/// The operator a case tests.
fn case_op(model: &Model, name: &str) -> String {
    let label = |n: &onnx_genai_onnx::Node| {
        if n.domain.is_empty() {
            n.op_type.clone()
        } else {
            format!("{}::{}", n.domain, n.op_type)
        }
    };
    match model.graph.nodes.as_slice() {
        [one] => label(one),
        nodes => {
            let last = nodes.last().map(label).unwrap_or_else(|| "(empty)".into());
            if name.contains("_expanded") {
                format!("{last} (expanded)")
            } else {
                last
            }
        }
    }
}

/// Compares one output with its expected value.
pub fn compare(got: &Tensor, want: &Tensor, tol: Tolerance) -> Result<(), String> {
    if got.dtype != want.dtype {
        return Err(format!("output `{}` is {}, expected {}", want.name, got.dtype, want.dtype));
    }
    if got.dims != want.dims {
        return Err(format!("output `{}` has shape {:?}, expected {:?}", want.name, got.dims, want.dims));
    }
    let (a, b) = (elements(got), elements(want));
    if a.len() != b.len() {
        return Err(format!("output `{}` holds {} elements, expected {}", want.name, a.len(), b.len()));
    }
    let exact = !matches!(want.dtype, DataType::Float | DataType::Float16 | DataType::Double | DataType::Bfloat16);
    for (i, (x, y)) in a.iter().zip(&b).enumerate() {
        let ok = if exact {
            x == y
        } else if y.is_nan() || x.is_nan() {
            x.is_nan() && y.is_nan()
        } else if y.is_infinite() || x.is_infinite() {
            x == y
        } else {
            (x - y).abs() <= tol.atol + tol.rtol * y.abs()
        };
        if !ok {
            return Err(format!("output `{}` element {i}: got {x}, expected {y}", want.name));
        }
    }
    Ok(())
}

/// A tensor's elements widened to f64 (exact for every integer type the IR
/// holds except i64 beyond 2^53, which these cases do not reach).
fn elements(t: &Tensor) -> Vec<f64> {
    fn le<const N: usize, T>(raw: &[u8], f: impl Fn([u8; N]) -> T) -> Vec<T> {
        raw.chunks_exact(N).map(|c| f(c.try_into().unwrap_or([0; N]))).collect()
    }
    let raw: &[u8] = &t.raw;
    match t.dtype {
        DataType::Float => le(raw, |b| f64::from(f32::from_le_bytes(b))),
        DataType::Double => le(raw, f64::from_le_bytes),
        DataType::Float16 => le(raw, |b| half::f16::from_le_bytes(b).to_f64()),
        DataType::Bfloat16 => le(raw, |b| half::bf16::from_le_bytes(b).to_f64()),
        DataType::Int64 => le(raw, |b| i64::from_le_bytes(b) as f64),
        DataType::Int32 => le(raw, |b| f64::from(i32::from_le_bytes(b))),
        DataType::Int8 => raw.iter().map(|b| f64::from(*b as i8)).collect(),
        DataType::Uint8 => raw.iter().map(|b| f64::from(*b)).collect(),
        DataType::Bool => raw.iter().map(|b| f64::from(u8::from(*b != 0))).collect(),
    }
}

fn check_outputs(got: &[Tensor], want: &[Tensor], tol: Tolerance) -> Result<(), String> {
    if got.len() < want.len() {
        return Err(format!("{} outputs, expected {}", got.len(), want.len()));
    }
    got.iter().zip(want).try_for_each(|(g, w)| compare(g, w, tol))
}

fn panic_text(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_else(|| "(no message)".into())
}

fn run_native(model: &Model, sets: &[DataSet], tol: Tolerance, runtime: &Runtime) -> Verdict {
    let plan = match compile_graph(model) {
        Ok(plan) => plan,
        Err(e @ CompileError::NoKernel { .. }) => return Verdict::fail(Outcome::NoKernel, e),
        Err(e) => return Verdict::fail(Outcome::Unsupported, e),
    };
    let mut ws = plan.workspace();
    for set in sets {
        let mut inputs = Vec::with_capacity(set.inputs.len());
        for t in &set.inputs {
            match Value::from_tensor(t) {
                Ok(v) => inputs.push((t.name.clone(), v)),
                Err(e) => return Verdict::fail(Outcome::Unsupported, format!("input `{}`: {e}", t.name)),
            }
        }
        let outputs = match plan.evaluate(&mut ws, runtime.ctx(), inputs) {
            Ok(outputs) => outputs,
            Err(e) => return Verdict::fail(Outcome::Error, e),
        };
        let got: Vec<Tensor> = outputs.iter().map(|(name, v)| v.to_tensor(name)).collect();
        if let Err(e) = check_outputs(&got, &set.outputs, tol) {
            return Verdict::fail(Outcome::Wrong, e);
        }
    }
    Verdict::pass()
}

fn run_ort(path: &Path, sets: &[DataSet], tol: Tolerance) -> Verdict {
    let mut graph = match OrtGraph::load(path, 1) {
        Ok(g) => g,
        Err(e) => return Verdict::fail(Outcome::Unsupported, e),
    };
    for set in sets {
        let got = match graph.run(&set.inputs) {
            Ok(got) => got,
            Err(e) => return Verdict::fail(Outcome::Error, e),
        };
        // ONNX Runtime returns outputs by name; line them up with the
        // expected ones.
        let ordered: Vec<Tensor> =
            set.outputs.iter().filter_map(|w| got.iter().find(|g| g.name == w.name).cloned()).collect();
        if let Err(e) = check_outputs(&ordered, &set.outputs, tol) {
            return Verdict::fail(Outcome::Wrong, e);
        }
    }
    Verdict::pass()
}

/// Runs one case on both backends. A panic inside a backend is caught and
/// reported as that backend's [`Outcome::Error`].
pub fn run_case(case: &Case, tol: Tolerance, runtime: &Runtime) -> CaseResult {
    let path = case.dir.join("model.onnx");
    let unreadable = |why: String| CaseResult {
        name: case.name.clone(),
        op: "(unreadable)".into(),
        native: Verdict::fail(Outcome::Unreadable, &why),
        ort: Verdict::fail(Outcome::Unreadable, &why),
    };
    let model = match onnx_genai_onnx::read_model(&path) {
        Ok(m) => m,
        Err(e) => return unreadable(e.to_string()),
    };
    let op = case_op(&model, &case.name);
    let sets = match data_sets(case, &model) {
        Ok(s) => s,
        Err(e) => return CaseResult { op, ..unreadable(e) },
    };
    let guarded = |f: &dyn Fn() -> Verdict| {
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(f))
            .unwrap_or_else(|p| Verdict::fail(Outcome::Error, format!("panicked: {}", panic_text(&*p))))
    };
    let native = guarded(&|| run_native(&model, &sets, tol, runtime));
    let ort = guarded(&|| run_ort(&path, &sets, tol));
    CaseResult { name: case.name.clone(), op, native, ort }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f32s(name: &str, dims: Vec<i64>, v: &[f32]) -> Tensor {
        Tensor::from_f32(name, dims, v)
    }

    /// ONNX's `|got - want| <= atol + rtol * |want|`: just inside passes,
    /// just outside fails, NaN matches only NaN, and integers are exact.
    #[test]
    fn outputs_are_held_to_onnx_tolerance() {
        let want = f32s("y", vec![3], &[1000.0, 0.0, f32::NAN]);
        let tol = ONNX_DEFAULT;
        assert!(compare(&f32s("y", vec![3], &[1000.9, 0.0, f32::NAN]), &want, tol).is_ok());
        let far = compare(&f32s("y", vec![3], &[1001.1, 0.0, f32::NAN]), &want, tol).unwrap_err();
        assert!(far.contains("element 0"), "{far}");
        assert!(compare(&f32s("y", vec![3], &[1000.0, 1e-6, f32::NAN]), &want, tol).is_err());
        assert!(compare(&f32s("y", vec![3], &[1000.0, 0.0, 1.0]), &want, tol).is_err());
        assert!(compare(&f32s("y", vec![1, 3], &[1000.0, 0.0, f32::NAN]), &want, tol).unwrap_err().contains("shape"));
        let ints = Tensor::from_i64("i", vec![2], &[3, 4]);
        assert!(compare(&Tensor::from_i64("i", vec![2], &[3, 5]), &ints, Tolerance { rtol: 1.0, atol: 1.0 }).is_err());
        assert!(compare(&f32s("i", vec![2], &[3.0, 4.0]), &ints, tol).unwrap_err().contains("expected i64"));
    }
}
