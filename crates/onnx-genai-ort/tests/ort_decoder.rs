//! The reference backend on every shipped tiny package, with real ONNX Runtime.

use std::sync::Arc;

use onnx_genai_backend::Decoder;
use onnx_genai_ort::OrtModel;
use onnx_genai_package::Package;

fn load(package: &Package) -> Decoder {
    Decoder::new(Arc::new(OrtModel::load(package, 1).expect("session loads")))
}

fn specs() -> Vec<String> {
    let specs = onnx_genai_test_support::shipped();
    assert!(specs.len() >= 3, "expected the shipped tiny packages, found {specs:?}");
    specs
}

/// Feeds `tokens` as ids, or — for a decoder that reads embeddings — as
/// deterministic embedding rows derived from them.
fn feed(d: &mut Decoder, package: &Package, tokens: &[u32]) -> Result<Vec<f32>, onnx_genai_backend::BackendError> {
    let h = package.manifest.architecture.hidden_size as usize;
    let takes_embeds = package.decoder().unwrap().0.port(onnx_genai_package::Role::InputsEmbeds).is_some();
    if takes_embeds {
        let rows: Vec<f32> = tokens
            .iter()
            .flat_map(|t| (0..h).map(move |i| ((*t as usize * 31 + i * 7) % 17) as f32 / 17.0 - 0.5))
            .collect();
        d.forward_embeds(&rows, h)
    } else {
        d.forward(tokens)
    }
}

/// Carrying the KV cache between steps gives the same logits as running the
/// whole prefix at once: the cache is fed back, not dropped or duplicated
/// (token ids, or embeddings for a vision-language decoder).
#[test]
fn incremental_decode_matches_full_prefix_on_every_package() {
    for spec in specs() {
        let (_dir, package) = onnx_genai_test_support::build(&spec);
        let tokens = [5u32, 77, 300, 12, 9, 150];
        let mut full = load(&package);
        let expected = feed(&mut full, &package, &tokens).expect("full prefix runs");
        assert_eq!(expected.len(), package.manifest.architecture.vocab_size as usize);
        assert!(expected.iter().all(|v| v.is_finite()), "{}: non-finite logits", spec);

        let mut step = load(&package);
        feed(&mut step, &package, &tokens[..3]).unwrap();
        feed(&mut step, &package, &tokens[3..5]).unwrap();
        assert_eq!(step.kv_len(), 5);
        let got = feed(&mut step, &package, &tokens[5..]).unwrap();
        assert_eq!(step.kv_len(), 6);
        assert_eq!(expected.len(), got.len(), "{}", spec);
        let max_diff = expected.iter().zip(&got).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
        // f16 packages round the cached KV to f16 in both runs identically.
        assert!(max_diff < 1e-4, "{}: incremental logits differ by {max_diff}", spec);
        let spread =
            expected.iter().cloned().fold(f32::MIN, f32::max) - expected.iter().cloned().fold(f32::MAX, f32::min);
        assert!(spread > 1e-3, "{}: logits are flat ({spread}); the model computes nothing", spec);

        step.reset();
        assert_eq!(step.kv_len(), 0);
        let again = feed(&mut step, &package, &tokens).unwrap();
        assert_eq!(again, expected, "{}: reset does not give a fresh sequence", spec);
    }
}

/// Running past `max_sequence_length` is a typed capacity error, not a crash.
#[test]
fn exceeding_the_context_is_a_capacity_error() {
    let spec = &specs()[0];
    let (_dir, package) = onnx_genai_test_support::build(spec);
    let mut d = load(&package);
    let max = package.manifest.architecture.max_sequence_length as usize;
    let err = d.forward(&vec![1u32; max + 1]).unwrap_err();
    assert!(matches!(err, onnx_genai_backend::BackendError::Capacity { .. }), "{err}");
    assert_eq!(d.kv_len(), 0);
}

/// A decoder graph whose present K/V output holds only the step's new
/// positions (its `Concat` onto the past replaced by the new rows alone —
/// ONNX Runtime runs it without complaint) is refused at the first step
/// where that differs from the whole cache: a typed run error naming the
/// output, its shape and the one expected, the sequence left as it was.
/// Before, the short cache was kept, and copying a prefix of it (a fork
/// for `n` choices, a session trimmed) sliced past its end and panicked.
#[test]
fn a_present_output_that_is_not_the_whole_cache_is_refused() {
    let (_dir, package) = onnx_genai_test_support::build("tiny-llama-gqa");
    let (decoder, path) = package.decoder().unwrap();
    let present = package.kv_ports(decoder).unwrap()[0].present_key.clone();
    let mut model = onnx_genai_onnx::read_model(path).unwrap();
    let node =
        model.graph.nodes.iter_mut().find(|n| n.outputs.contains(&present)).expect("a node makes the present key");
    assert_eq!(node.op_type, "Concat", "the decomposed export concatenates the past and the new keys");
    let new_rows = node.inputs.last().cloned().unwrap();
    node.op_type = "Identity".into();
    node.inputs = vec![new_rows];
    node.attributes.clear();
    onnx_genai_onnx::write_model(path, &model).unwrap();
    let mut d = load(&package);
    // The first step's cache is its new rows: nothing to tell apart yet.
    d.forward(&[5, 77, 300]).expect("a first step's present is the whole cache");
    let err = d.forward(&[12]).unwrap_err().to_string();
    assert!(
        err.contains(&format!("`{present}` has shape [1, ")) && err.contains(", 1, ") && err.contains(", 4, "),
        "the error names the output, its shape and the whole cache's: {err}"
    );
    assert_eq!(d.kv_len(), 3, "a refused step leaves the sequence as it was");
}

/// A `Cast` of `input` to `to`, written to `output`.
fn cast(input: String, output: String, to: onnx_genai_onnx::DataType) -> onnx_genai_onnx::Node {
    use onnx_genai_onnx::{AttrValue, Attribute, Node};
    let to = Attribute { name: "to".into(), value: AttrValue::Int(to.onnx_code().into()) };
    Node {
        name: format!("cast {input}"),
        op_type: "Cast".into(),
        domain: String::new(),
        inputs: vec![input],
        outputs: vec![output],
        attributes: vec![to],
    }
}

/// Makes graph input `name` take `to` and cast it back to its type, for
/// every node that read it.
fn retype_input(model: &mut onnx_genai_onnx::Model, name: &str, to: onnx_genai_onnx::DataType) {
    let input = model.graph.inputs.iter_mut().find(|i| i.name == name).expect("the input exists");
    let was = std::mem::replace(&mut input.dtype, to);
    let wide = format!("{name}.as_declared");
    for node in &mut model.graph.nodes {
        node.inputs.iter_mut().filter(|i| *i == name).for_each(|i| i.clone_from(&wide));
    }
    model.graph.nodes.insert(0, cast(name.into(), wide, was));
}

/// Makes graph output `name` a cast of what it was to `to`.
fn retype_output(model: &mut onnx_genai_onnx::Model, name: &str, to: onnx_genai_onnx::DataType) {
    let output = model.graph.outputs.iter_mut().find(|o| o.name == name).expect("the output exists");
    output.dtype = to;
    let computed = format!("{name}.as_computed");
    for node in &mut model.graph.nodes {
        node.outputs.iter_mut().chain(&mut node.inputs).filter(|o| *o == name).for_each(|o| o.clone_from(&computed));
    }
    model.graph.value_infos.retain(|v| v.name != name);
    model.graph.nodes.push(cast(computed, name.into(), to));
}

/// Every element type validation accepts for a non-KV port runs: a
/// decoder graph that takes int32 attention masks and positions (as well
/// as ids) and f16 embeddings, and returns f16 logits, decodes on ONNX
/// Runtime, its values converted at the session's edge — the masks and
/// positions exactly, the embeddings and logits as f16 rounds them.
/// Before, the backend always sent int64 masks and positions, f32
/// embeddings and read f32 logits: such a package passed `validate` and
/// then failed every request with ONNX Runtime's type error.
#[test]
fn every_port_type_the_package_may_declare_runs() {
    use onnx_genai_onnx::DataType;
    use onnx_genai_package::Role;
    let mut embeds_retyped = false;
    for spec in specs() {
        let (_dir, package) = onnx_genai_test_support::build(&spec);
        let (decoder, path) = package.decoder().unwrap();
        let tokens = [5u32, 77, 300, 12, 9, 150];
        let h = package.manifest.architecture.hidden_size as usize;
        let takes_embeds = decoder.port(Role::InputsEmbeds).is_some();
        // The reference: the graph as built, on inputs as the narrowed
        // graph will see them (embeddings rounded to f16).
        let rounded = |d: &mut Decoder| {
            if takes_embeds {
                let rows: Vec<f32> = tokens
                    .iter()
                    .flat_map(|t| (0..h).map(move |i| ((*t as usize * 31 + i * 7) % 17) as f32 / 17.0 - 0.5))
                    .map(|v| half::f16::from_f32(v).to_f32())
                    .collect();
                d.forward_embeds(&rows[..3 * h], h)?;
                d.forward_embeds(&rows[3 * h..], h)
            } else {
                d.forward(&tokens[..3])?;
                d.forward(&tokens[3..])
            }
        };
        let expected: Vec<f32> = rounded(&mut load(&package)).expect("the built graph runs");
        let mut model = onnx_genai_onnx::read_model(path).unwrap();
        let mut retyped = Vec::new();
        for (role, to) in [
            (Role::AttentionMask, DataType::Int32),
            (Role::PositionIds, DataType::Int32),
            (Role::InputsEmbeds, DataType::Float16),
        ] {
            if let Some(name) = decoder.port(role) {
                retype_input(&mut model, name, to);
                retyped.push(role);
            }
        }
        retype_output(&mut model, decoder.port(Role::Logits).unwrap(), DataType::Float16);
        onnx_genai_onnx::write_model(path, &model).unwrap();
        let package = onnx_genai_package::Package::open(&package.root).expect("the retyped package validates");
        let got = rounded(&mut load(&package)).unwrap_or_else(|e| panic!("{spec} with {retyped:?} retyped: {e}"));
        let want: Vec<f32> = expected.iter().map(|v| half::f16::from_f32(*v).to_f32()).collect();
        assert_eq!(got, want, "{spec}: logits through the retyped ports differ beyond f16 rounding");
        embeds_retyped |= retyped.contains(&Role::InputsEmbeds);
    }
    assert!(embeds_retyped, "no shipped package's decoder reads embeddings: f16 embeddings went untried");
}

/// A workflow's stateless components take the same latitude as the
/// decoder: an embedding component that reads int32 token ids and writes
/// f16 embeddings runs, its ids converted exactly and its embeddings the
/// f16 rounding of the built graph's (before, ids always went in as int64
/// and outputs were read as f32: a type error at every request).
#[test]
fn a_component_takes_int32_ids_and_gives_f16_values() {
    use onnx_genai_onnx::DataType;
    use onnx_genai_ort::{ComponentInput, OrtComponent};
    use onnx_genai_package::Role;
    let (_dir, package) = onnx_genai_test_support::build("tiny-vlm");
    let decoder = package.decoder().unwrap().0.name.clone();
    let embed = package
        .manifest
        .components
        .iter()
        .find(|c| c.name != decoder && c.port(Role::TokenIds).is_some() && c.port(Role::InputsEmbeds).is_some())
        .expect("tiny-vlm has an embedding component")
        .clone();
    let (ids, values) = (embed.port(Role::TokenIds).unwrap(), embed.port(Role::InputsEmbeds).unwrap());
    let run = |package: &onnx_genai_package::Package| {
        let mut component = OrtComponent::load(package, &embed.name, 1).expect("the component loads");
        let input = ComponentInput::I64 { shape: vec![1, 4], values: vec![5, 77, 300, 12] };
        component.run(vec![(ids.to_string(), input)], values).expect("the component runs")
    };
    let (shape, built) = run(&package);
    let (_, path) = package.component(&embed.name).unwrap();
    let mut model = onnx_genai_onnx::read_model(path).unwrap();
    retype_input(&mut model, ids, DataType::Int32);
    retype_output(&mut model, values, DataType::Float16);
    onnx_genai_onnx::write_model(path, &model).unwrap();
    let retyped = onnx_genai_package::Package::open(&package.root).expect("the retyped package validates");
    let (retyped_shape, got) = run(&retyped);
    assert_eq!(retyped_shape, shape);
    let want: Vec<f32> = built.iter().map(|v| half::f16::from_f32(*v).to_f32()).collect();
    assert_eq!(got, want, "the embeddings through the retyped ports differ beyond f16 rounding");
}
