//! Interpreted multimodal workflows on the tiny vision-language package:
//! bound images, overrides, the encoder cache, refusals, sessions.

/// What an engine reserves at rest (B2): the KV its idle sessions keep —
/// nothing for a package without KV geometry (A8).
fn resting(e: &Engine) -> u64 {
    if e.package().kv_geometry().is_some() {
        e.idle_kv_bytes()
    } else {
        0
    }
}

use onnx_genai_engine::{
    BackendKind, BoundTensor, ComponentOverride, Engine, EngineError, Flow, GenerateRequest, GenerateResult, Prompt,
};

fn vlm() -> tempfile::TempDir {
    onnx_genai_test_support::build("tiny-vlm").0
}

fn image(seed: u8) -> Vec<u8> {
    (0..8 * 8 * 3).map(|i| (i as u8).wrapping_mul(37).wrapping_add(seed.wrapping_mul(101))).collect()
}

fn ask(e: &mut Engine, prompt: &str, pixels: Option<BoundTensor>) -> Result<GenerateResult, EngineError> {
    let mut r = GenerateRequest::text(prompt);
    r.max_new_tokens = Some(10);
    r.inputs = pixels.into_iter().collect();
    e.generate(&r, &mut |_| Flow::Continue)
}

/// The image reaches the decoder (two different images decode differently),
/// and the encoder cache is keyed by the image bytes: the same image is
/// encoded once, a different one is encoded again.
#[test]
fn images_change_the_output_and_are_encoded_once_each() {
    let dir = vlm();
    let mut e = Engine::open(dir.path(), BackendKind::Ort, 1).unwrap();
    assert!(e.is_workflow());
    let (a, b) = (e.pixel_values(&image(1), 8, 8).unwrap(), e.pixel_values(&image(2), 8, 8).unwrap());
    let with_a = ask(&mut e, "<|image|> What is this?", Some(a.clone())).unwrap();
    assert_eq!(e.encoder_runs(), 1);
    let again = ask(&mut e, "<|image|> What is this?", Some(a)).unwrap();
    assert_eq!(e.encoder_runs(), 1, "the same image and tokens hit the cache");
    assert_eq!(again.token_ids, with_a.token_ids);
    let with_b = ask(&mut e, "<|image|> What is this?", Some(b)).unwrap();
    assert_eq!(e.encoder_runs(), 2, "a different image never shares an entry");
    assert_ne!(with_a.token_ids, with_b.token_ids, "the image must influence generation");
    let text_only = ask(&mut e, " What is this?", None).unwrap();
    assert_eq!(text_only.prompt_tokens + 4, with_a.prompt_tokens, "the placeholder expands to 4 image tokens");
}

/// Overriding the vision component with the features it would compute
/// gives the same generation, without running the encoder.
#[test]
fn an_override_with_precomputed_features_replaces_the_encoder() {
    let dir = vlm();
    let package = onnx_genai_package::Package::open(dir.path()).unwrap();
    let mut e = Engine::open(dir.path(), BackendKind::Ort, 1).unwrap();
    let pixels = e.pixel_values(&image(3), 8, 8).unwrap();
    let bound = ask(&mut e, "<|image|> Describe", Some(pixels.clone())).unwrap();
    let mut vision = onnx_genai_ort::OrtComponent::load(&package, "vision", 1).unwrap();
    let values: Vec<f32> = pixels.bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
    let input = onnx_genai_ort::ComponentInput::F32 { shape: pixels.shape.clone(), values };
    let (shape, features) = vision.run(vec![("pixel_values".into(), input)], "image_embeds").unwrap();
    let runs = e.encoder_runs();
    let mut r = GenerateRequest::text("<|image|> Describe");
    r.max_new_tokens = Some(10);
    r.overrides = vec![ComponentOverride {
        component: "vision".into(),
        outputs: vec![BoundTensor::f32("image_embeds", shape, &features)],
    }];
    let overridden = e.generate(&r, &mut |_| Flow::Continue).unwrap();
    assert_eq!(overridden.token_ids, bound.token_ids);
    assert_eq!(e.encoder_runs(), runs, "an override does not run the encoder");
}

/// Undeclared inputs and overrides of components that forbid them are
/// refused with a clear error — after admission, like any request — and
/// leave nothing reserved; a placeholder/image mismatch is refused before.
#[test]
fn undeclared_bindings_are_refused() {
    let dir = vlm();
    let mut e = Engine::open(dir.path(), BackendKind::Ort, 1).unwrap();
    let pixels = e.pixel_values(&image(4), 8, 8).unwrap();
    let mut undeclared = GenerateRequest::text("<|image|> hi");
    undeclared.inputs = vec![pixels.clone(), BoundTensor::f32("audio_values", vec![1, 4], &[0.0; 4])];
    let mut forbidden = GenerateRequest::text("hi");
    forbidden.overrides = vec![ComponentOverride { component: "embed".into(), outputs: vec![] }];
    let mut wrong_shape = GenerateRequest::text("<|image|> hi");
    wrong_shape.inputs = vec![BoundTensor::f32("pixel_values", vec![1, 3, 4, 4], &[0.0; 48])];
    for (req, want) in [
        (undeclared, "`audio_values` is not an application input of this workflow (declared: pixel_values)"),
        (forbidden, "component `embed` does not allow overrides"),
        (wrong_shape, "expected f32 [1, 3, 8, 8]"),
    ] {
        let mut admitted = 0;
        let err = e.generate_with(&req, &mut |_| admitted += 1, &mut |_| Flow::Continue).unwrap_err().to_string();
        assert!(err.contains(want), "expected `{want}` in: {err}");
        assert_eq!(admitted, 1, "{want}: requests are admitted (or refused) first");
        assert_eq!(e.scheduler().reserved_bytes(), resting(&e));
    }
    let mut missing_mark = GenerateRequest::text("no placeholder");
    missing_mark.inputs = vec![pixels];
    for (req, want) in
        [(missing_mark, "marks 0 image(s)"), (GenerateRequest::text("<|image|> where is it"), "marks 1 image(s)")]
    {
        let mut admitted = 0;
        let err = e.generate_with(&req, &mut |_| admitted += 1, &mut |_| Flow::Continue).unwrap_err().to_string();
        assert!(err.contains(want), "expected `{want}` in: {err}");
        assert_eq!(admitted, 0, "counting fails before admission");
    }
}

/// A workflow session: the second turn prefills only its new tokens and
/// generates what one uninterrupted request would.
#[test]
fn workflow_sessions_continue_on_their_kv() {
    let dir = vlm();
    let mut e = Engine::open(dir.path(), BackendKind::Ort, 1).unwrap();
    let pixels = e.pixel_values(&image(5), 8, 8).unwrap();
    let id = e.create_session().unwrap();
    let mut first = GenerateRequest::text("<|image|> Look");
    first.inputs = vec![pixels.clone()];
    first.session = Some(id);
    first.max_new_tokens = Some(4);
    let one = e.generate(&first, &mut |_| Flow::Continue).unwrap();
    let mut second = GenerateRequest::text(" and then");
    second.session = Some(id);
    second.max_new_tokens = Some(6);
    let two = e.generate(&second, &mut |_| Flow::Continue).unwrap();
    let history = e.session_tokens(id).unwrap().to_vec();
    assert_eq!(two.prompt_tokens, history.len() - two.token_ids.len());
    // The same conversation as one request: image, first prompt, first
    // answer, second prompt.
    let image_id = e.package().tokenizer().token_to_id("<|image|>").unwrap();
    let mut ids = e.encode("<|image|> Look").unwrap();
    ids.extend(&one.token_ids);
    ids.extend(e.encode(" and then").unwrap());
    assert_eq!(ids.iter().filter(|t| **t == image_id).count(), 1);
    let mut whole = GenerateRequest::new(Prompt::TokenIds(ids));
    whole.inputs = vec![pixels];
    whole.max_new_tokens = Some(6);
    let fresh = e.generate(&whole, &mut |_| Flow::Continue).unwrap();
    assert_eq!(fresh.token_ids, two.token_ids);
    e.close_session(id).unwrap();
}

/// Declared preprocessing: RGB8 scaled to [0, 1], normalized with the
/// manifest's mean/std, laid out channels-first.
#[test]
fn pixel_values_follow_the_declared_preprocessing() {
    let dir = vlm();
    let e = Engine::open(dir.path(), BackendKind::Ort, 1).unwrap();
    assert_eq!(e.image_size(), Some((8, 8)));
    let mut rgb = vec![0u8; 8 * 8 * 3];
    rgb[0] = 255; // pixel (0, 0) pure red
    let t = e.pixel_values(&rgb, 8, 8).unwrap();
    let v: Vec<f32> = t.bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
    assert_eq!(t.shape, vec![1, 3, 8, 8]);
    assert_eq!((v[0], v[64], v[128], v[1]), (1.0, -1.0, -1.0, -1.0));
    assert!(matches!(e.pixel_values(&rgb, 4, 4), Err(EngineError::Tensor { .. })));
}

/// A malformed vision package — its manifest's `hidden_size` disagrees
/// with the rows its components produce — fails the request with a
/// backend error (a server's 500: the package's fault, not the client's)
/// that names the component, what it produced and the manifest field,
/// never a panic while image features are spliced into the embeddings
/// (features of the manifest's width from an override, with the image
/// at the end of the prompt, reached past the end of them), and nothing
/// stays reserved.
#[test]
fn an_embedding_component_of_the_wrong_width_is_refused_not_a_panic() {
    let dir = vlm();
    let manifest = dir.path().join("package.yaml");
    let text = std::fs::read_to_string(&manifest).unwrap();
    let hidden: usize = text
        .lines()
        .find_map(|l| l.trim().strip_prefix("hidden_size:"))
        .and_then(|v| v.trim().parse().ok())
        .expect("the tiny vlm's manifest states hidden_size");
    let wide = hidden * 2;
    std::fs::write(&manifest, text.replace(&format!("hidden_size: {hidden}"), &format!("hidden_size: {wide}")))
        .unwrap();
    let mut e = Engine::open(dir.path(), BackendKind::Ort, 1).unwrap();
    let pixels = e.pixel_values(&image(6), 8, 8).unwrap();
    let encoded =
        GenerateRequest { inputs: vec![pixels], ..GenerateRequest::text("What is this, in a few words? <|image|>") };
    let mut overridden = GenerateRequest::text("What is this, in a few words? <|image|>");
    overridden.overrides = vec![ComponentOverride {
        component: "vision".into(),
        outputs: vec![BoundTensor::f32("image_embeds", vec![1, 4, wide], &vec![0.5; 4 * wide])],
    }];
    for (req, want) in [
        (encoded, "component `embed` produced `inputs_embeds` of shape [1, 22, 64] for 22 tokens"),
        (overridden, "component `embed` produced `inputs_embeds` of shape [1, 22, 64] for 22 tokens"),
    ] {
        let err = e.generate(&req, &mut |_| Flow::Continue).unwrap_err();
        assert!(matches!(err, EngineError::Backend(_)), "a package defect, not the request's: {err:?}");
        let err = err.to_string();
        assert!(err.contains(want) && err.contains("architecture.hidden_size"), "expected `{want}` in: {err}");
        assert_eq!(e.scheduler().reserved_bytes(), resting(&e));
    }
}
