//! Images over real HTTP on loopback (issue 19): `image_url` content parts
//! with PNG or JPEG `data:` URLs reach a vision-language package's encoder
//! through the same workflow path and admission counting as the CLI; bad
//! images are 400s naming the part, with nothing held.

mod support;

use base64::Engine as _;
use onnx_genai_engine::Scheduler;
use onnx_genai_server::start;
use serde_json::{json, Value};
use support::{call, engine, package, post, Gate};

const VLM: &str = "tiny-vlm";
const LM: &str = "tiny-llama-gqa";

fn serve() -> (Vec<tempfile::TempDir>, onnx_genai_server::RunningServer) {
    let scheduler = Scheduler::new(u64::MAX / 2);
    let (vlm_dir, vlm) = package(VLM);
    let (lm_dir, lm) = package(LM);
    let engines = vec![engine(&vlm, &Gate::default(), scheduler.clone()), engine(&lm, &Gate::default(), scheduler)];
    (vec![vlm_dir, lm_dir], start(engines, "127.0.0.1:0", 8).unwrap())
}

/// An image of `seed`'s pattern, encoded as `format`, as a `data:` URL.
fn data_url(seed: u8, format: image::ImageFormat) -> String {
    let img = image::RgbImage::from_fn(16, 12, |x, y| image::Rgb([(x * 16) as u8 ^ seed, (y * 20) as u8, seed]));
    let mut bytes = std::io::Cursor::new(Vec::new());
    img.write_to(&mut bytes, format).unwrap();
    let mime = if format == image::ImageFormat::Png { "image/png" } else { "image/jpeg" };
    format!("data:{mime};base64,{}", base64::engine::general_purpose::STANDARD.encode(bytes.into_inner()))
}

fn ask(model: &str, url: &str) -> Value {
    json!({
        "model": model,
        "max_tokens": 6,
        "temperature": 0,
        "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": url, "detail": "low"}},
            {"type": "text", "text": "What is it?"}
        ]}]
    })
}

/// Issue 19, images: a PNG and a JPEG `data:` URL each reach the decoder
/// (different images, different log-probabilities of the first token; the
/// same image, the same), and admission counts the image's tokens: the placeholder is
/// expanded to the workflow's 4 image tokens (A7): 4 more than the same
/// question without the image.
#[test]
fn inline_images_reach_the_decoder_and_are_counted() {
    let (_d, s) = serve();
    // The answer's first log-probability: any change in what the decoder
    // sees moves it (this tiny model's greedy text barely depends on it).
    let answer = |body: &Value| {
        let mut body = body.clone();
        body["logprobs"] = json!(true);
        let r = post(s.addr, "/v1/chat/completions", &body);
        assert_eq!(r.status, 200, "{}", r.body);
        let v = r.json();
        (v["choices"][0]["logprobs"]["content"][0]["logprob"].as_f64().unwrap(), v["usage"]["prompt_tokens"].clone())
    };
    let png = data_url(7, image::ImageFormat::Png);
    let (a, tokens) = answer(&ask(VLM, &png));
    let (b, _) = answer(&ask(VLM, &data_url(200, image::ImageFormat::Png)));
    let (c, _) = answer(&ask(VLM, &data_url(90, image::ImageFormat::Jpeg)));
    let mut text_only = ask(VLM, &png);
    text_only["messages"][0]["content"][0] = json!({"type": "text", "text": ""});
    let (d, without) = answer(&text_only);
    assert_eq!(tokens.as_u64(), without.as_u64().map(|n| n + 4), "an image is its 4 tokens in the count");
    assert!(a != b && b != c && c != d && a != d, "each image must reach the decoder: {a} {b} {c} {d}");
    assert_eq!(answer(&ask(VLM, &png)).0, a, "deterministic");
}

/// Issue 19, images (bad input): a remote URL, a type other than PNG or
/// JPEG, bad base64, bytes that do not decode, an image wider than 4096
/// pixels (decoding is bounded), a second image, an image in
/// an assistant message, a bad `detail`, a key no part or message has, and
/// an image to a package without an image input are 400s naming the part, before anything is admitted,
/// reserved or leased (A2, L1).
#[test]
fn bad_images_are_refused_naming_the_part() {
    let (_d, s) = serve();
    let png = data_url(7, image::ImageFormat::Png);
    let not_png = format!(
        "data:image/png;base64,{}",
        base64::engine::general_purpose::STANDARD.encode(b"\x89PNG\r\n\x1a\nbroken")
    );
    let wide = {
        let img = image::RgbImage::new(4097, 1);
        let mut bytes = std::io::Cursor::new(Vec::new());
        img.write_to(&mut bytes, image::ImageFormat::Png).unwrap();
        format!("data:image/png;base64,{}", base64::engine::general_purpose::STANDARD.encode(bytes.into_inner()))
    };
    let before = s.gauges();
    let part = "messages[0].content[0].image_url";
    let mut cases: Vec<(Value, &str, &str)> = vec![
        (ask(VLM, "https://example.com/cat.png"), part, "fetches no URL"),
        (ask(VLM, "data:image/webp;base64,UklG"), part, "PNG or JPEG"),
        (ask(VLM, "data:image/png;base64,%%%"), part, "base64"),
        (ask(VLM, &not_png), part, "does not decode"),
        (ask(VLM, &wide), part, "larger than 4096x4096"),
        (ask(LM, &png), part, "takes no images"),
    ];
    let mut two = ask(VLM, &png);
    two["messages"][0]["content"][1] = json!({"type": "image_url", "image_url": {"url": png}});
    cases.push((two, "messages[0].content[1].image_url", "at most 1 image"));
    let mut assistant = ask(VLM, &png);
    assistant["messages"] =
        json!([{"role": "assistant", "content": [{"type": "image_url", "image_url": {"url": png}}]}]);
    cases.push((assistant, "messages[0].content[0]", "only a user message"));
    let mut detail = ask(VLM, &png);
    detail["messages"][0]["content"][0]["image_url"]["detail"] = json!("ultra");
    cases.push((detail, "messages[0].content[0].image_url.detail", "auto, low or high"));
    let mut extra = ask(VLM, &png);
    extra["messages"][0]["content"][1]["cache_control"] = json!({"type": "ephemeral"});
    cases.push((extra, "messages[0].content[1].cache_control", "has no field"));
    let mut unknown_key = ask(VLM, &png);
    unknown_key["messages"][0]["mood"] = json!("curious");
    cases.push((unknown_key, "messages[0].mood", "unknown field `mood`"));
    let mut audio = ask(VLM, &png);
    audio["messages"][0]["content"][0] = json!({"type": "input_audio", "input_audio": {}});
    cases.push((audio, "messages[0].content[0].type", "not supported"));
    for (body, param, want) in cases {
        let r = call(s.addr, "POST", "/v1/chat/completions", &[], &body.to_string());
        assert_eq!(r.status, 400, "{param}: {}", r.body);
        assert_eq!(r.json()["error"]["param"], param, "{}", r.body);
        assert!(r.body.contains(want), "expected `{want}`: {}", r.body);
    }
    let after = s.gauges();
    assert_eq!((after.admitted, after.reserved_bytes, after.leases), (before.admitted, before.reserved_bytes, 0));
}
