//! Standalone graphs (`compile_graph` + `Plan::evaluate`): what ONNX's node
//! cases drive (`cargo xtask onnx-tests`), checked here on kernels those
//! cases cannot reach on native-cpu (their CumSum inputs are f64 and i32)
//! and on the evaluator's own contract.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

use onnx_genai_native::kernels::Runtime;
use onnx_genai_native::value::Value;
use onnx_genai_native::{compile_graph, CompileError};
use onnx_genai_onnx::builder::attr_int;
use onnx_genai_onnx::{DataType, Dim, GraphBuilder, Model};

/// The system allocator, noting the largest single allocation (on any
/// thread): the fold budget's test shows a refused fold allocated nothing
/// of its size first.
struct Peak;

static LARGEST: AtomicUsize = AtomicUsize::new(0);

// SAFETY: every call is forwarded unchanged to the system allocator; the
// maximum is a side effect that touches no allocation.
unsafe impl GlobalAlloc for Peak {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LARGEST.fetch_max(layout.size(), Ordering::Relaxed);
        // SAFETY: forwarded with the caller's layout.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from `System` with this layout.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        LARGEST.fetch_max(layout.size(), Ordering::Relaxed);
        // SAFETY: forwarded with the caller's layout.
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        LARGEST.fetch_max(new_size, Ordering::Relaxed);
        // SAFETY: `ptr` came from `System` with `layout`.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Peak = Peak;

fn graph(build: impl FnOnce(&mut GraphBuilder)) -> Model {
    let mut g = GraphBuilder::new("case", 18);
    build(&mut g);
    g.finish(9, "test")
}

fn run(model: &Model, inputs: Vec<(&str, Value)>) -> Vec<Value> {
    let plan = compile_graph(model).unwrap_or_else(|e| panic!("compile: {e}"));
    let runtime = Runtime::serial();
    let inputs = inputs.into_iter().map(|(n, v)| (n.to_string(), v)).collect();
    let out = plan.evaluate(&mut plan.workspace(), runtime.ctx(), inputs).unwrap_or_else(|e| panic!("run: {e}"));
    out.into_iter().map(|(_, v)| v).collect()
}

fn f32_input(g: &mut GraphBuilder, name: &str, dims: &[i64]) {
    g.input(name, DataType::Float, dims.iter().map(|d| Dim::Fixed(*d)).collect());
}

/// CumSum along axis 1 of a 2x3 f32 tensor, in all four modes, against
/// sums written out by hand.
#[test]
fn cum_sum_runs_forward_backward_inclusive_and_exclusive() {
    let x = Value::f32([2, 3], vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
    let cases = [
        (0, 0, vec![1.0, 3.0, 6.0, 4.0, 9.0, 15.0]),
        (1, 0, vec![0.0, 1.0, 3.0, 0.0, 4.0, 9.0]),
        (0, 1, vec![6.0, 5.0, 3.0, 15.0, 11.0, 6.0]),
        (1, 1, vec![5.0, 3.0, 0.0, 11.0, 6.0, 0.0]),
    ];
    for (exclusive, reverse, want) in cases {
        let model = graph(|g| {
            f32_input(g, "x", &[2, 3]);
            let axis = g.const_i64(&[1]);
            let y = g.op_with(
                "CumSum",
                &["x", &axis],
                vec![attr_int("exclusive", exclusive), attr_int("reverse", reverse)],
            );
            g.output(&y, DataType::Float, vec![Dim::Fixed(2), Dim::Fixed(3)]);
        });
        let out = run(&model, vec![("x", x.clone())]);
        assert_eq!(out[0].as_f32().unwrap(), want.as_slice(), "exclusive={exclusive} reverse={reverse}");
    }
}

/// Softmax over a leading axis normalizes each column, not each row.
#[test]
fn softmax_normalizes_along_any_axis() {
    let model = graph(|g| {
        f32_input(g, "x", &[2, 2]);
        let y = g.op_with("Softmax", &["x"], vec![attr_int("axis", 0)]);
        g.output(&y, DataType::Float, vec![Dim::Fixed(2), Dim::Fixed(2)]);
    });
    let out = run(&model, vec![("x", Value::f32([2, 2], vec![0.0, 5.0, 0.0, -5.0]))]);
    let y = out[0].as_f32().unwrap();
    assert!((y[0] - 0.5).abs() < 1e-6 && (y[2] - 0.5).abs() < 1e-6, "{y:?}");
    assert!((y[1] + y[3] - 1.0).abs() < 1e-6 && y[1] > 0.99, "{y:?}");
}

/// An input the caller leaves out is a named run error, not a kernel
/// reading an empty buffer; an op without a kernel is `NoKernel` at
/// compile time.
#[test]
fn missing_inputs_and_unknown_ops_are_named() {
    let model = graph(|g| {
        f32_input(g, "a", &[2]);
        f32_input(g, "b", &[2]);
        let y = g.op("Add", &["a", "b"]);
        g.output(&y, DataType::Float, vec![Dim::Fixed(2)]);
    });
    let plan = compile_graph(&model).unwrap();
    let runtime = Runtime::serial();
    let err = plan
        .evaluate(&mut plan.workspace(), runtime.ctx(), vec![("a".into(), Value::f32([2], vec![1.0, 2.0]))])
        .unwrap_err();
    assert!(err.to_string().contains("graph input `b` was not given"), "{err}");

    let unknown = graph(|g| {
        f32_input(g, "x", &[2]);
        let y = g.op("Shrink", &["x"]);
        g.output(&y, DataType::Float, vec![Dim::Fixed(2)]);
    });
    assert!(matches!(compile_graph(&unknown), Err(CompileError::NoKernel { op, .. }) if op == "Shrink"));
}

/// Einsum (ONNX's own Einsum cases feed f64, which native-cpu refuses):
/// transpose, row sums, an inner product, a diagonal and a batched matrix
/// product, each against the answer written out.
#[test]
fn einsum_covers_the_common_two_operand_forms() {
    use onnx_genai_onnx::builder::attr_string;
    let m = Value::f32([2, 2], vec![1.0, 2.0, 3.0, 4.0]);
    let v = Value::f32([2], vec![5.0, 6.0]);
    let cases: Vec<(&str, Vec<Value>, Vec<f32>)> = vec![
        ("ij->ji", vec![m.clone()], vec![1.0, 3.0, 2.0, 4.0]),
        ("ij->i", vec![m.clone()], vec![3.0, 7.0]),
        ("i,i->", vec![v.clone(), v.clone()], vec![61.0]),
        ("ii->i", vec![m.clone()], vec![1.0, 4.0]),
        ("ij,j->i", vec![m.clone(), v.clone()], vec![17.0, 39.0]),
        (
            "bij,bjk->bik",
            vec![Value::f32([2, 1, 2], vec![1.0, 2.0, 3.0, 4.0]), Value::f32([2, 2, 1], vec![5.0, 6.0, 7.0, 8.0])],
            vec![17.0, 53.0],
        ),
    ];
    for (equation, operands, want) in cases {
        let names: Vec<String> = (0..operands.len()).map(|i| format!("x{i}")).collect();
        let model = graph(|g| {
            for (n, x) in names.iter().zip(&operands) {
                f32_input(g, n, &x.shape.iter().map(|d| *d as i64).collect::<Vec<_>>());
            }
            let ins: Vec<&str> = names.iter().map(String::as_str).collect();
            let y = g.op_with("Einsum", &ins, vec![attr_string("equation", equation)]);
            g.output(&y, DataType::Float, vec![]);
        });
        let inputs = names.iter().map(String::as_str).zip(operands.iter().cloned()).collect();
        let out = run(&model, inputs);
        assert_eq!(out[0].as_f32().unwrap(), want.as_slice(), "{equation}");
    }
}

/// Issue 20, finding 1: shapes a graph computes from its own constants are
/// checked before anything is allocated. A `ConstantOfShape` of
/// [2^21, 2^21] (now past the fold budget first) and a `Range` of 2^40
/// elements are compile errors naming the
/// node (they used to abort on an 8–35 TB allocation while folding), and a
/// `Slice` with step i64::MAX visits one element instead of overflowing.
#[test]
fn crafted_sizes_are_errors_not_aborts() {
    use onnx_genai_onnx::Tensor;
    let huge_fill = graph(|g| {
        let shape = g.initializer(Tensor::from_i64("shape", vec![2], &[1 << 21, 1 << 21]));
        let y = g.op("ConstantOfShape", &[&shape]);
        g.output(&y, DataType::Float, vec![]);
    });
    let err = compile_graph(&huge_fill).unwrap_err().to_string();
    assert!(err.contains("ConstantOfShape") && err.contains("past the"), "{err}");

    let huge_range = graph(|g| {
        let start = g.scalar_i64(0);
        let limit = g.scalar_i64(1 << 40);
        let delta = g.scalar_i64(1);
        let y = g.op("Range", &[&start, &limit, &delta]);
        g.output(&y, DataType::Int64, vec![]);
    });
    let err = compile_graph(&huge_range).unwrap_err().to_string();
    assert!(err.contains("Range") && err.contains("more than"), "{err}");

    let far_step = graph(|g| {
        f32_input(g, "x", &[5]);
        let starts = g.const_i64(&[1]);
        let ends = g.const_i64(&[5]);
        let axes = g.const_i64(&[0]);
        let steps = g.const_i64(&[i64::MAX]);
        let y = g.op("Slice", &["x", &starts, &ends, &axes, &steps]);
        g.output(&y, DataType::Float, vec![]);
    });
    let out = run(&far_step, vec![("x", Value::f32([5], vec![0.0, 1.0, 2.0, 3.0, 4.0]))]);
    assert_eq!(out[0].as_f32().unwrap(), &[1.0]);
    let back = graph(|g| {
        f32_input(g, "x", &[5]);
        let starts = g.const_i64(&[4]);
        let ends = g.const_i64(&[i64::MIN]);
        let axes = g.const_i64(&[0]);
        let steps = g.const_i64(&[i64::MIN]);
        let y = g.op("Slice", &["x", &starts, &ends, &axes, &steps]);
        g.output(&y, DataType::Float, vec![]);
    });
    let out = run(&back, vec![("x", Value::f32([5], vec![0.0, 1.0, 2.0, 3.0, 4.0]))]);
    assert_eq!(out[0].as_f32().unwrap(), &[4.0]);
}

/// Folding has a budget (compile's `FOLD_ALLOWANCE`: 256 MiB plus 8 bytes
/// per byte of initializers), checked before a fold allocates: a graph of
/// a few bytes asking a gigabyte of constants or more — from a shape
/// (`ConstantOfShape`, `Tile`, `Expand`), a `Range`, or by multiplying or
/// broadcasting two small constants (`Add`, `MatMul`, `Gemm`) — is a
/// compile error naming the node, under
/// the kernels' own 2^32-element bound that alone let each through (and
/// load a machine's memory with them), and before anything of its size is
/// allocated. Four mebibytes still fold; and an
/// operation on a run-time input that broadcasts past that bound is a run
/// error, not an allocation.
#[test]
fn folding_a_gigabyte_from_a_few_bytes_is_an_error() {
    use onnx_genai_onnx::Tensor;
    const SIDE: i64 = 1 << 14;
    type Build = Box<dyn Fn(&mut GraphBuilder) -> String>;
    // `op` of one value spread to [SIDE, SIDE] (its second input says so).
    let spread = |op: &'static str| -> Build {
        Box::new(move |g| {
            let one = g.initializer(Tensor::from_f32("one", vec![1, 1], &[1.0]));
            let to = g.const_i64(&[SIDE, SIDE]);
            g.op(op, &[&one, &to])
        })
    };
    // `op` of a column [SIDE, 1] and a row [1, SIDE]: SIDE^2 values from
    // 2 SIDE (a broadcast or an outer product).
    let outer = |op: &'static str| -> Build {
        Box::new(move |g| {
            let column = g.initializer(Tensor::from_f32("column", vec![SIDE, 1], &vec![1.0; SIDE as usize]));
            let row = g.initializer(Tensor::from_f32("row", vec![1, SIDE], &vec![2.0; SIDE as usize]));
            g.op(op, &[&column, &row])
        })
    };
    let cases: Vec<(&str, Build)> = vec![
        (
            "ConstantOfShape",
            Box::new(|g| {
                let shape = g.const_i64(&[SIDE, SIDE]);
                g.op("ConstantOfShape", &[&shape])
            }),
        ),
        ("Tile", spread("Tile")),
        ("Expand", spread("Expand")),
        ("Add", outer("Add")),
        (
            "Range",
            Box::new(|g| {
                let (start, limit, delta) = (g.scalar_i64(0), g.scalar_i64(1 << 28), g.scalar_i64(1));
                g.op("Range", &[&start, &limit, &delta])
            }),
        ),
        ("Gemm", outer("Gemm")),
        ("MatMul", outer("MatMul")),
    ];
    for (op, build) in &cases {
        let model = graph(|g| {
            let y = build(g);
            g.output(&y, if *op == "Range" { DataType::Int64 } else { DataType::Float }, vec![]);
        });
        // (Other tests running beside this one allocate under a MiB.)
        LARGEST.store(0, Ordering::SeqCst);
        let err = compile_graph(&model).err().unwrap_or_else(|| panic!("{op}: a 1 GiB fold compiled"));
        let largest = LARGEST.load(Ordering::SeqCst);
        assert!(largest < 64 << 20, "{op}: {largest} bytes were allocated before the fold was refused");
        let err = err.to_string();
        assert!(err.contains(op) && err.contains("folded constants") && err.contains("past the"), "{op}: {err}");
    }

    let small = graph(|g| {
        let shape = g.const_i64(&[1024, 1024]);
        let y = g.op("ConstantOfShape", &[&shape]);
        g.output(&y, DataType::Float, vec![]);
    });
    let out = run(&small, vec![]);
    assert_eq!(out[0].shape.as_slice(), &[1024, 1024], "4 MiB is folded");

    let at_run = graph(|g| {
        f32_input(g, "x", &[1 << 16, 1]);
        let row = g.initializer(Tensor::from_f32("row", vec![1, (1 << 16) + 1], &vec![1.0; (1 << 16) + 1]));
        let y = g.op("Add", &["x", &row]);
        g.output(&y, DataType::Float, vec![]);
    });
    let plan = compile_graph(&at_run).unwrap();
    let x = Value::f32([1 << 16, 1], vec![0.0; 1 << 16]);
    let err = plan.evaluate(&mut plan.workspace(), Runtime::serial().ctx(), vec![("x".to_string(), x)]).unwrap_err();
    assert!(err.to_string().contains("more than"), "{err}");
}

/// Kernels that size their work by their inputs' axes check it before
/// allocating or looping: an Einsum's output and its products visited
/// (four vectors of 2^16 make 2^64 products; a repeated output letter,
/// which ONNX forbids, is refused by name), and a Tile of an empty tensor
/// by 2^40 (empty, at once — its index used to grow by the other axes).
#[test]
fn kernels_size_their_work_before_allocating_it() {
    use onnx_genai_onnx::builder::attr_string;
    use onnx_genai_onnx::Tensor;
    let einsum = |equation: &'static str, inputs: usize, len: i64| {
        graph(move |g| {
            let names: Vec<String> = (0..inputs)
                .map(|i| g.initializer(Tensor::from_f32(format!("v{i}"), vec![len], &vec![1.0; len as usize])))
                .collect();
            let ins: Vec<&str> = names.iter().map(String::as_str).collect();
            let y = g.op_with("Einsum", &ins, vec![attr_string("equation", equation)]);
            g.output(&y, DataType::Float, vec![]);
        })
    };
    let err = compile_graph(&einsum("a,b,c,d->abcd", 4, 1 << 16)).unwrap_err().to_string();
    assert!(err.contains("Einsum") && err.contains("more than"), "{err}");
    let err = compile_graph(&einsum("i->iiii", 1, 16)).unwrap_err().to_string();
    assert!(err.contains("Einsum") && err.contains("more than once"), "{err}");

    let empty_tile = graph(|g| {
        let empty = g.initializer(Tensor::from_f32("empty", vec![0, 1], &[]));
        let repeats = g.const_i64(&[1, 1 << 40]);
        let y = g.op("Tile", &[&empty, &repeats]);
        g.output(&y, DataType::Float, vec![]);
    });
    let out = run(&empty_tile, vec![]);
    assert_eq!((out[0].shape.as_slice(), out[0].len()), (&[0, 1 << 40][..], 0));
}

/// SkipSimplifiedLayerNormalization on a batch large enough that its rows
/// split across threads: two threads give the same bits as one (each row
/// is normalized by one thread, in the same order), with and without the
/// bias and the sum output, and the values are the definition's
/// `(x + skip + bias) / rms · gamma`.
#[test]
fn skip_rms_norm_splits_rows_across_threads_exactly() {
    let (rows, d) = (16usize, 576usize);
    let wave = |n: usize, f: f32| -> Vec<f32> { (0..n).map(|i| ((i as f32) * f).sin() * 2.0).collect() };
    let (x, skip, gamma, bias) = (wave(rows * d, 0.37), wave(rows * d, 0.11), wave(d, 0.05), wave(d, 0.9));
    let dims = [rows as i64, d as i64];
    for with_bias in [false, true] {
        let model = graph(|g| {
            g.opset("com.microsoft", 1);
            f32_input(g, "x", &dims);
            f32_input(g, "skip", &dims);
            f32_input(g, "gamma", &[d as i64]);
            f32_input(g, "bias", &[d as i64]);
            let inputs: &[&str] = if with_bias { &["x", "skip", "gamma", "bias"] } else { &["x", "skip", "gamma"] };
            let attrs = vec![onnx_genai_onnx::builder::attr_float("epsilon", 1e-6)];
            g.node_in("com.microsoft", "SkipSimplifiedLayerNormalization", inputs, &["y", "", "", "sum"], attrs);
            for name in ["y", "sum"] {
                g.output(name, DataType::Float, dims.iter().map(|v| Dim::Fixed(*v)).collect());
            }
        });
        let plan = compile_graph(&model).unwrap_or_else(|e| panic!("compile: {e}"));
        let feed = || {
            [
                ("x", &x, vec![rows, d]),
                ("skip", &skip, vec![rows, d]),
                ("gamma", &gamma, vec![d]),
                ("bias", &bias, vec![d]),
            ]
            .into_iter()
            .map(|(n, v, s)| (n.to_string(), Value::f32(s, v.clone())))
            .collect()
        };
        let on = |runtime: Runtime| {
            let out =
                plan.evaluate(&mut plan.workspace(), runtime.ctx(), feed()).unwrap_or_else(|e| panic!("run: {e}"));
            out.into_iter().map(|(_, v)| v.as_f32().unwrap().to_vec()).collect::<Vec<_>>()
        };
        let serial = on(Runtime::serial());
        let parallel = on(Runtime::new(2).unwrap());
        assert_eq!(serial, parallel, "bias {with_bias}: two threads changed the result");
        for r in 0..rows {
            let sum: Vec<f32> =
                (0..d).map(|c| x[r * d + c] + skip[r * d + c] + if with_bias { bias[c] } else { 0.0 }).collect();
            let inv = 1.0 / (sum.iter().map(|v| v * v).sum::<f32>() / d as f32 + 1e-6).sqrt();
            for c in 0..d {
                assert_eq!(parallel[1][r * d + c], sum[c], "bias {with_bias}: sum row {r} col {c}");
                let want = sum[c] * inv * gamma[c];
                let got = parallel[0][r * d + c];
                assert!(
                    (got - want).abs() <= 1e-5 * want.abs().max(1.0),
                    "bias {with_bias}: row {r} col {c}: {got} vs {want}"
                );
            }
        }
    }
}

/// Bad input, not a panic: a normalization over an empty axis (inputs of
/// shape [2, 0], gamma and bias of none) is a typed run error naming the
/// shape, for the fused skip-and-normalize with and without its bias, the
/// RMS normalization and the layer normalization.
#[test]
fn empty_normalized_axes_are_errors_not_panics() {
    type Build = fn(&mut GraphBuilder);
    let cases: [(&str, Build); 4] = [
        ("skip norm with bias", |g| {
            g.opset("com.microsoft", 1);
            let attrs = vec![onnx_genai_onnx::builder::attr_float("epsilon", 1e-6)];
            g.node_in(
                "com.microsoft",
                "SkipSimplifiedLayerNormalization",
                &["x", "skip", "gamma", "bias"],
                &["y"],
                attrs,
            );
        }),
        ("skip norm", |g| {
            g.opset("com.microsoft", 1);
            let attrs = vec![onnx_genai_onnx::builder::attr_float("epsilon", 1e-6)];
            g.node_in("com.microsoft", "SkipSimplifiedLayerNormalization", &["x", "skip", "gamma"], &["y"], attrs);
        }),
        ("rms norm", |g| {
            g.node_in("", "RMSNormalization", &["x", "gamma"], &["y"], vec![]);
        }),
        ("layer norm", |g| {
            g.node_in("", "LayerNormalization", &["x", "gamma", "bias"], &["y"], vec![]);
        }),
    ];
    for (name, build) in cases {
        let model = graph(|g| {
            f32_input(g, "x", &[2, 0]);
            f32_input(g, "skip", &[2, 0]);
            f32_input(g, "gamma", &[0]);
            f32_input(g, "bias", &[0]);
            build(g);
            g.output("y", DataType::Float, vec![Dim::Fixed(2), Dim::Fixed(0)]);
        });
        let plan = match compile_graph(&model) {
            Ok(plan) => plan,
            Err(e) => panic!("{name}: compile: {e}"),
        };
        let feed = ["x", "skip", "gamma", "bias"]
            .into_iter()
            .map(|n| (n.to_string(), Value::f32(if matches!(n, "x" | "skip") { vec![2, 0] } else { vec![0] }, vec![])))
            .collect();
        let err = plan.evaluate(&mut plan.workspace(), Runtime::serial().ctx(), feed).map(|_| ()).unwrap_err();
        assert!(err.to_string().contains("[2, 0]"), "{name}: {err}");
    }
}

/// Degenerate shapes and positions a graph can hold are empty results or
/// errors at run time, never panics (from an audit of the compiler on
/// crafted graphs): a 4-bit embedding table of rows with no columns
/// gathers empty rows, a projection to no outputs with its bias gives an
/// empty row (both were `chunks_exact_mut(0)`), and a rotary position id
/// of 2^63 - 1, whose `(p + 1) * half` wrapped to 0 and passed the cache
/// bound before slicing out of range, is an error naming the position.
#[test]
fn degenerate_shapes_and_positions_are_not_panics() {
    use onnx_genai_onnx::{Tensor, TensorData};
    let gathered = graph(|g| {
        g.opset("com.microsoft", 1);
        g.input("ids", DataType::Int64, vec![Dim::Fixed(1), Dim::Fixed(2)]);
        let data = g.initializer(Tensor {
            name: "data".into(),
            dtype: DataType::Uint8,
            dims: vec![4, 0],
            raw: TensorData::from(Vec::new()),
        });
        let scales = g.initializer(Tensor::from_f32("scales", vec![4, 0], &[]));
        g.node_in(
            "com.microsoft",
            "GatherBlockQuantized",
            &[&data, "ids", &scales],
            &["rows"],
            vec![attr_int("bits", 4), attr_int("block_size", 32)],
        );
        g.output("rows", DataType::Float, vec![]);
    });
    let out = run(&gathered, vec![("ids", Value::i64([1, 2], vec![0, 3]))]);
    assert_eq!(out[0].shape.as_slice(), &[1, 2, 0]);

    let narrow = graph(|g| {
        f32_input(g, "x", &[1, 3]);
        let w = g.initializer(Tensor::from_f32("w", vec![3, 0], &[]));
        let b = g.initializer(Tensor::from_f32("b", vec![0], &[]));
        let y = g.op("MatMul", &["x", &w]);
        let y = g.op("Add", &[&y, &b]);
        g.output(&y, DataType::Float, vec![]);
    });
    let out = run(&narrow, vec![("x", Value::f32([1, 3], vec![1.0, 2.0, 3.0]))]);
    assert_eq!(out[0].shape.as_slice(), &[1, 0]);

    let far = graph(|g| {
        g.opset("com.microsoft", 1);
        f32_input(g, "x", &[1, 1, 4]);
        let positions = g.initializer(Tensor::from_i64("positions", vec![1, 1], &[i64::MAX]));
        let cos = g.initializer(Tensor::from_f32("cos", vec![2, 2], &[1.0; 4]));
        let sin = g.initializer(Tensor::from_f32("sin", vec![2, 2], &[0.0; 4]));
        g.node_in("com.microsoft", "RotaryEmbedding", &["x", &positions, &cos, &sin], &["y"], vec![]);
        g.output("y", DataType::Float, vec![]);
    });
    let plan = compile_graph(&far).unwrap_or_else(|e| panic!("compile: {e}"));
    let x = Value::f32([1, 1, 4], vec![1.0; 4]);
    let err = plan.evaluate(&mut plan.workspace(), Runtime::serial().ctx(), vec![("x".to_string(), x)]).unwrap_err();
    assert!(err.to_string().contains("beyond the rotary cache"), "{err}");
}

/// A `RotaryEmbedding` node's 4-D input is `[batch, heads, seq, head_dim]`,
/// as ONNX (opset 23) and ONNX Runtime's com.microsoft op define it, with
/// or without `num_heads`: a decode step's `[1, 2, 1, 4]` at position 3
/// rotates both heads at position 3. (With `num_heads` the ONNX node, and
/// the com.microsoft node always, read it seq-first: head h was rotated at
/// position 3 + h, silently.) Against rotate-half written out.
#[test]
fn a_rotary_nodes_4d_input_is_heads_first() {
    use onnx_genai_onnx::Tensor;
    let (max_pos, half) = (8usize, 2usize);
    let cos: Vec<f32> = (0..max_pos * half).map(|i| ((i as f32) * 0.3).cos()).collect();
    let sin: Vec<f32> = (0..max_pos * half).map(|i| ((i as f32) * 0.3).sin()).collect();
    let x: Vec<f32> = (0..8).map(|i| i as f32 * 0.5 - 1.0).collect();
    let position = 3usize;
    let want: Vec<f32> = x
        .chunks(2 * half)
        .flat_map(|row| {
            let (c, s) = (&cos[position * half..][..half], &sin[position * half..][..half]);
            let (a, b) = row.split_at(half);
            let first: Vec<f32> = (0..half).map(|i| a[i] * c[i] - b[i] * s[i]).collect();
            let second: Vec<f32> = (0..half).map(|i| b[i] * c[i] + a[i] * s[i]).collect();
            first.into_iter().chain(second)
        })
        .collect();
    for (domain, attributes) in [("", vec![attr_int("num_heads", 2)]), ("", vec![]), ("com.microsoft", vec![])] {
        let model = graph(|g| {
            g.opset("", 23);
            g.opset("com.microsoft", 1);
            f32_input(g, "x", &[1, 2, 1, 4]);
            let positions = g.initializer(Tensor::from_i64("positions", vec![1, 1], &[position as i64]));
            let cos = g.initializer(Tensor::from_f32("cos", vec![max_pos as i64, half as i64], &cos));
            let sin = g.initializer(Tensor::from_f32("sin", vec![max_pos as i64, half as i64], &sin));
            let inputs = if domain.is_empty() { ["x", &cos, &sin, &positions] } else { ["x", &positions, &cos, &sin] };
            g.node_in(domain, "RotaryEmbedding", &inputs, &["y"], attributes.clone());
            g.output("y", DataType::Float, vec![]);
        });
        let out = run(&model, vec![("x", Value::f32([1, 2, 1, 4], x.clone()))]);
        let got = out[0].as_f32().unwrap();
        for (g, w) in got.iter().zip(&want) {
            assert!((g - w).abs() < 1e-6, "{domain:?} {attributes:?}: {got:?} vs {want:?}");
        }
    }
}

/// Generic ops as ONNX and ONNX Runtime define them, where native read
/// them otherwise (from an audit of the lowering): a backward Slice whose
/// start lies before the axis starts at element 0 (clamped to -1 it took
/// nothing); SkipSimplifiedLayerNormalization without `epsilon` takes ONNX
/// Runtime's 1e-12 (1e-5 scaled activations of 1e-3 by 0.30 instead of 1);
/// a SimplifiedLayerNormalization whose `inv_std_var` is read, and a float
/// Mod without `fmod`, are refused at compile time naming the node (the
/// one was an empty tensor, the other a Python-style modulo).
#[test]
fn generic_ops_follow_onnx_where_native_read_them_otherwise() {
    use onnx_genai_onnx::Tensor;
    let backward = graph(|g| {
        f32_input(g, "x", &[5]);
        let starts = g.initializer(Tensor::from_i64("starts", vec![1], &[-10]));
        let ends = g.initializer(Tensor::from_i64("ends", vec![1], &[i64::MIN]));
        let axes = g.initializer(Tensor::from_i64("axes", vec![1], &[0]));
        let steps = g.initializer(Tensor::from_i64("steps", vec![1], &[-1]));
        let y = g.op("Slice", &["x", &starts, &ends, &axes, &steps]);
        g.output(&y, DataType::Float, vec![]);
    });
    let out = run(&backward, vec![("x", Value::f32([5], vec![0.0, 1.0, 2.0, 3.0, 4.0]))]);
    assert_eq!(out[0].as_f32().unwrap(), [0.0]);

    let skip_norm = graph(|g| {
        g.opset("com.microsoft", 1);
        f32_input(g, "x", &[1, 4]);
        f32_input(g, "skip", &[1, 4]);
        let gamma = g.initializer(Tensor::from_f32("gamma", vec![4], &[1.0; 4]));
        g.node_in("com.microsoft", "SkipSimplifiedLayerNormalization", &["x", "skip", &gamma], &["y"], vec![]);
        g.output("y", DataType::Float, vec![]);
    });
    let out =
        run(&skip_norm, vec![("x", Value::f32([1, 4], vec![1e-3; 4])), ("skip", Value::f32([1, 4], vec![0.0; 4]))]);
    let want = 1e-3 / (1e-6f32 + 1e-12).sqrt();
    assert!(out[0].as_f32().unwrap().iter().all(|v| (v - want).abs() < 1e-4), "{:?}", out[0].as_f32());

    let statistics = graph(|g| {
        f32_input(g, "x", &[1, 4]);
        let gamma = g.initializer(Tensor::from_f32("gamma", vec![4], &[1.0; 4]));
        g.node_in("", "SimplifiedLayerNormalization", &["x", &gamma], &["y", "inv_std_var"], vec![]);
        g.output("y", DataType::Float, vec![]);
        g.output("inv_std_var", DataType::Float, vec![]);
    });
    let err = compile_graph(&statistics).map(|_| ()).unwrap_err().to_string();
    assert!(err.contains("output 1"), "{err}");

    let modulo = graph(|g| {
        f32_input(g, "a", &[2]);
        f32_input(g, "b", &[2]);
        let y = g.op("Mod", &["a", "b"]);
        g.output(&y, DataType::Float, vec![]);
    });
    let err = compile_graph(&modulo).map(|_| ()).unwrap_err().to_string();
    assert!(err.contains("fmod=1"), "{err}");
}
