//! `onnx-genai`: validate, build, inspect and generate from model packages.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::{Parser, Subcommand, ValueEnum};
use onnx_genai_engine::{BackendKind, ChatMessage, Engine, Flow, GenerateRequest, KvCache, Prompt, Sampling};
use onnx_genai_package::Package;

/// The longest wait a `serve` flag may set: a day (timeouts beyond are
/// "never" in practice, and a deadline that far overflows a clock).
const MAX_WAIT_S: u64 = 86_400;

/// `println!` that returns a write error instead of panicking on it: a
/// reader that closed the pipe early (`onnx-genai inspect PKG | head -1`)
/// ends the command quietly (see `main`), where `println!` panicked.
macro_rules! outln {
    ($($arg:tt)*) => {
        writeln!(std::io::stdout(), $($arg)*)?
    };
}

/// The most threads `--threads` may ask for (a count past it is a typo:
/// `--threads 100000` started that many threads, and ONNX Runtime's C
/// `int` wrapped 2^32 + 1 to one).
const MAX_THREADS: u64 = 1024;

/// The largest image file `generate --image` reads (a PNG or JPEG the
/// decoder accepts is far smaller; `--image /dev/zero` read until the
/// process was killed).
const MAX_IMAGE_FILE: u64 = 64 << 20;

/// Writes a command's report or closing line where its exit code is the
/// verdict (`validate`, `check`) or its product is already written
/// (`build`, `import`): a reader that closed stdout loses the text, not
/// the code. Other write errors are said on stderr.
fn report_out(text: &str) {
    if let Err(e) = std::io::stdout().write_all(text.as_bytes()).and_then(|()| std::io::stdout().flush()) {
        if e.kind() != std::io::ErrorKind::BrokenPipe {
            eprintln!("error: cannot write to stdout: {e}");
        }
    }
}

fn threads_arg() -> clap::builder::RangedU64ValueParser<usize> {
    clap::builder::RangedU64ValueParser::<usize>::new().range(0..=MAX_THREADS)
}

#[derive(Parser)]
#[command(name = "onnx-genai", version, about = "Compile, validate and run generative ONNX model packages")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Clone, Copy, ValueEnum)]
enum Format {
    Text,
    Json,
}

#[derive(Subcommand)]
enum Command {
    /// Serve packages over an OpenAI-compatible HTTP API (one model per package).
    Serve {
        #[arg(required = true)]
        packages: Vec<PathBuf>,
        #[arg(long, default_value = "127.0.0.1")]
        host: String,
        #[arg(long, default_value_t = 8080)]
        port: u16,
        /// Sessions bound at once; beyond it an idle one is evicted: the least
        /// recently used of the client holding the most.
        #[arg(long, default_value_t = onnx_genai_server::ServerOptions::default().max_sessions)]
        max_sessions: usize,
        /// Choices (`n`) one request may ask for (1 to 16); more is a 400.
        #[arg(long, default_value_t = onnx_genai_server::ServerOptions::default().max_choices,
              value_parser = clap::builder::RangedU64ValueParser::<usize>::new()
                  .range(1..=onnx_genai_engine::MAX_CHOICES as u64))]
        max_choices: usize,
        /// KV cache bytes all models may reserve together (default: half of
        /// the memory available when the server starts).
        #[arg(long)]
        kv_budget_bytes: Option<u64>,
        /// Longest prompt piece a request feeds per model step, so a long
        /// prefill shares steps with running decodes (0: whole prompts).
        #[arg(long, default_value_t = 256)]
        prefill_chunk: usize,
        /// Requests that may wait for a model's driver; beyond it: 429.
        #[arg(long, default_value_t = onnx_genai_server::DriverOptions::default().queue_limit)]
        queue_limit: usize,
        /// Milliseconds a request that does not fit the KV budget waits in
        /// line (first come, first served) before it is refused with 429
        /// (at most a day's).
        #[arg(long, default_value_t = onnx_genai_server::DriverOptions::default().admission_wait.as_millis() as u64,
              value_parser = clap::value_parser!(u64).range(0..=MAX_WAIT_S * 1000))]
        admission_wait_ms: u64,
        /// Seconds a stream may go unread before its request is cancelled
        /// (1 to 86,400).
        #[arg(long, default_value_t = onnx_genai_server::DriverOptions::default().stall_timeout.as_secs(),
              value_parser = clap::value_parser!(u64).range(1..=MAX_WAIT_S))]
        stall_timeout_s: u64,
        /// Decode backend (ort, native-cpu, native-cuda).
        #[arg(long, default_value = "ort")]
        backend: BackendKind,
        /// Intra-op threads of each model (0: the backend decides; at most
        /// 1,024).
        #[arg(long, default_value_t = 0, value_parser = threads_arg())]
        threads: usize,
        /// How the KV cache is stored: `model` (the type the package
        /// declares) or `f16` (half an f32 cache's bytes, so twice the
        /// positions under the budget; native-cpu only).
        #[arg(long, default_value = "model")]
        kv_cache: KvCache,
        /// Require `Authorization: Bearer <KEY>` on every route but /health
        /// (repeatable: any of the keys; each key is one client, and
        /// sessions belong to the key that created them).
        #[arg(long = "api-key", value_parser = clap::builder::NonEmptyStringValueParser::new())]
        api_keys: Vec<String>,
        /// A Host name requests may be addressed to (repeatable). A server on
        /// a loopback address accepts only loopback names and these; one on
        /// another address accepts any Host unless names are given.
        #[arg(long = "allowed-host")]
        allowed_hosts: Vec<String>,
        /// Seconds a client may take to send a request head; also how long an
        /// idle keep-alive connection stays open (1 to 86,400).
        #[arg(long, default_value_t = onnx_genai_server::HttpOptions::default().header_timeout.as_secs(),
              value_parser = clap::value_parser!(u64).range(1..=MAX_WAIT_S))]
        header_timeout_s: u64,
        /// Seconds a request may take until its response starts (504 after;
        /// 1 to 86,400).
        #[arg(long, default_value_t = onnx_genai_server::HttpOptions::default().request_timeout.as_secs(),
              value_parser = clap::value_parser!(u64).range(1..=MAX_WAIT_S))]
        request_timeout_s: u64,
        /// Connections served at once; one more is answered 503.
        #[arg(long, default_value_t = onnx_genai_server::HttpOptions::default().max_connections)]
        max_connections: usize,
        /// Log lines as text or as JSON objects (one per line, with request ids).
        #[arg(long, value_enum, default_value = "text")]
        log_format: Format,
    },
    /// Report every problem of a package (exit 1 when any is an error).
    Validate {
        package: PathBuf,
        #[arg(long, value_enum, default_value = "text")]
        format: Format,
        /// List every diagnostic (by default, ones that differ only by a
        /// layer number print once with a count).
        #[arg(long)]
        verbose: bool,
    },
    /// Build a package from an architecture spec (`packages/<name>/spec.yaml`).
    Build {
        spec: PathBuf,
        out: PathBuf,
        /// Export form: decomposed (standard ops), opset23 (ONNX fused ops) or
        /// contrib (com.microsoft ops, 4-bit weights).
        #[arg(long, default_value = "decomposed", value_parser = parse_variant)]
        variant: onnx_genai_build::Variant,
    },
    /// Import a Hugging Face checkpoint directory (Llama, Mistral, Qwen2,
    /// GPT-2: `config.json`, `model.safetensors` or its shards' index,
    /// `tokenizer.json`, `generation_config.json`) as a package in any
    /// export form.
    Import {
        checkpoint: PathBuf,
        out: PathBuf,
        /// Export form: decomposed, opset23, contrib (4-bit weights) or genai.
        #[arg(long, default_value = "decomposed", value_parser = parse_variant)]
        variant: onnx_genai_build::Variant,
        /// Weights and KV cache: f32 or f16.
        #[arg(long, default_value = "f32", value_parser = parse_dtype)]
        dtype: onnx_genai_package::ElementType,
        /// Package name (default: the checkpoint directory's name).
        #[arg(long)]
        name: Option<String>,
    },
    /// Show components, ports, KV geometry, bytes per token and parameter count.
    Inspect { package: PathBuf },
    /// Generate text, streaming it to stdout.
    Generate {
        package: PathBuf,
        #[arg(long)]
        prompt: String,
        /// Treat the prompt as a user message and apply the chat template.
        #[arg(long)]
        chat: bool,
        #[arg(long)]
        max_new_tokens: Option<u32>,
        /// 0 is greedy decoding (default: the package's sampling default,
        /// else 0).
        #[arg(long)]
        temperature: Option<f32>,
        /// 0 keeps every token (default: the package's, else 0).
        #[arg(long)]
        top_k: Option<usize>,
        /// Default: the package's, else 1.
        #[arg(long)]
        top_p: Option<f32>,
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// Decode backend (ort, native-cpu, native-cuda).
        #[arg(long, default_value = "ort")]
        backend: BackendKind,
        /// Intra-op threads (0: the backend decides; at most 1,024).
        #[arg(long, default_value_t = 0, value_parser = threads_arg())]
        threads: usize,
        /// How the KV cache is stored: `model` (the type the package
        /// declares) or `f16` (native-cpu only).
        #[arg(long, default_value = "model")]
        kv_cache: KvCache,
        /// Print the token ids after the text.
        #[arg(long)]
        show_ids: bool,
        /// An image (PNG) for a vision-language package: resized and
        /// normalized as the manifest declares, bound to `pixel_values`. The
        /// image placeholder is prepended to the prompt unless it has one.
        #[arg(long)]
        image: Option<PathBuf>,
    },
    /// Does native decode match ONNX Runtime on these package directories
    /// (ours or ONNX Runtime GenAI's)? Validate, load, compile, parity on
    /// every prompt, speed side by side. Exit 0: pass (near-ties reported),
    /// 1: a mismatch, 2: could not run.
    Check {
        #[arg(required = true)]
        packages: Vec<PathBuf>,
        /// A YAML list of prompt strings (default: four built in).
        #[arg(long)]
        prompts: Option<PathBuf>,
        /// Greedy decode steps compared after each prompt's prefill.
        #[arg(long, default_value_t = 16)]
        steps: usize,
        /// Tolerance tier: f32, f16, f16deep, int4, int8act (default: what
        /// the compiled plan computes in).
        #[arg(long, value_parser = parse_tier)]
        tier: Option<onnx_genai_conformance::tolerance::Tier>,
        /// Threads of every backend (at most 1,024).
        #[arg(long, default_value_t = 2, value_parser = threads_arg())]
        threads: usize,
        /// Alternatives shown on each side where the backends part (1 to
        /// 100).
        #[arg(long, default_value_t = 5, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=100))]
        top_k: usize,
        #[arg(long, value_enum, default_value = "table")]
        format: CheckFormat,
        /// Write the report here instead of to stdout.
        #[arg(long)]
        out: Option<PathBuf>,
        /// Golden records, one per package and prompt (the format of the
        /// repository's goldens): recorded from ONNX Runtime when missing,
        /// every backend held to them when present.
        #[arg(long)]
        golden: Option<PathBuf>,
    },
}

#[derive(Clone, Copy, ValueEnum)]
enum CheckFormat {
    Table,
    Markdown,
    Json,
    Junit,
}

fn parse_tier(s: &str) -> Result<onnx_genai_conformance::tolerance::Tier, String> {
    use onnx_genai_conformance::tolerance::Tier;
    Tier::ALL
        .into_iter()
        .find(|t| t.name() == s)
        .ok_or_else(|| format!("unknown tier `{s}` ({})", Tier::ALL.map(Tier::name).join(", ")))
}

/// `onnx-genai check`: the conformance crate's stages on each directory.
fn check(
    packages: &[PathBuf],
    prompts: Option<&Path>,
    opts: onnx_genai_conformance::check::CheckOptions,
    format: CheckFormat,
    out: Option<&Path>,
) -> Result<ExitCode> {
    use onnx_genai_conformance::check as c;
    let mut opts = opts;
    if let Some(path) = prompts {
        let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        // Read under the manifest's bounds: YAML aliases could expand a
        // small file into terabytes of prompts.
        let list: Vec<String> = onnx_genai_package::yaml::from_str(&text)
            .map_err(anyhow::Error::from)
            .and_then(|v| serde_json::from_value(v).map_err(anyhow::Error::from))
            .with_context(|| format!("{}: expected a YAML list of prompt strings", path.display()))?;
        if list.is_empty() || list.iter().any(String::is_empty) {
            anyhow::bail!("{}: give at least one prompt, none empty", path.display());
        }
        opts.prompts = list;
    }
    let checks: Vec<c::PackageCheck> = c::check_dirs(packages, &opts);
    let text = match format {
        CheckFormat::Table => c::table(&checks),
        CheckFormat::Markdown => c::markdown(&checks),
        CheckFormat::Json => c::json(&checks),
        CheckFormat::Junit => c::report(&checks).junit(),
    };
    // The verdict's exit code stands even when the report cannot be
    // written: it then goes to stdout (and where stdout is closed too,
    // the code is all that is left).
    match out.map(|path| c::write_whole(path, text.as_bytes()).map_err(|e| (path, e))) {
        Some(Ok(())) => {}
        Some(Err((path, e))) => {
            eprintln!("error: cannot write {}: {e}; the report follows", path.display());
            report_out(&text);
        }
        None => report_out(&text),
    }
    Ok(ExitCode::from(c::exit_code(&checks) as u8))
}

/// Bytes of memory available now (`MemAvailable` in /proc/meminfo).
fn available_memory() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

fn parse_dtype(s: &str) -> Result<onnx_genai_package::ElementType, String> {
    match s {
        "f32" => Ok(onnx_genai_package::ElementType::F32),
        "f16" => Ok(onnx_genai_package::ElementType::F16),
        _ => Err(format!("unknown dtype `{s}` (f32, f16)")),
    }
}

fn parse_variant(s: &str) -> Result<onnx_genai_build::Variant, String> {
    onnx_genai_build::Variant::parse(s)
        .ok_or_else(|| format!("unknown variant `{s}` (decomposed, opset23, contrib, genai)"))
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli) {
        Ok(code) => code,
        // The reader of stdout has gone (`| head`): nothing to tell it.
        Err(e) if closed_stdout(&e) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// Whether `e` is a write to a stdout whose reader has closed it.
fn closed_stdout(e: &anyhow::Error) -> bool {
    e.chain().any(|c| c.downcast_ref::<std::io::Error>().is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe))
}

/// Server logs on stderr: `info` and above, as text or one JSON object per
/// line (spans carry each request's id).
fn init_logs(format: Format) {
    let builder = tracing_subscriber::fmt().with_writer(std::io::stderr).with_max_level(tracing::Level::INFO);
    let _ = match format {
        Format::Text => builder.try_init(),
        Format::Json => builder.json().try_init(),
    };
}

fn run(cli: Cli) -> Result<ExitCode> {
    match cli.command {
        Command::Validate { package, format, verbose } => validate(&package, format, verbose),
        Command::Build { spec, out, variant } => {
            let spec = onnx_genai_build::read_spec(&spec)?;
            onnx_genai_build::build_variant(&spec, variant, &out)?;
            report_out(&format!("built {} ({}) into {}\n", spec.name, variant.name(), out.display()));
            Ok(ExitCode::SUCCESS)
        }
        Command::Inspect { package } => inspect(&package),
        Command::Import { checkpoint, out, variant, dtype, name } => {
            let name = name.unwrap_or_else(|| {
                let dir = std::fs::canonicalize(&checkpoint).unwrap_or_else(|_| checkpoint.clone());
                dir.file_name().map_or_else(|| "imported".into(), |n| n.to_string_lossy().into_owned())
            });
            let mut spec = onnx_genai_build::hf::spec_from_hf(&checkpoint, &name)?;
            spec.dtype = dtype;
            onnx_genai_build::build_variant(&spec, variant, &out)?;
            // What the checkpoint's files hold beside its weights (token
            // ids, tokenizer, template) is checked as every package is: an
            // import that wrote a package `validate` refuses says so now.
            let (report, _) = onnx_genai_package::validate(&out);
            if report.has_errors() {
                anyhow::bail!("the package imported into {} does not validate:\n{report}", out.display());
            }
            report_out(&format!(
                "imported {} ({}, {dtype:?}) into {}\n",
                checkpoint.display(),
                variant.name(),
                out.display()
            ));
            Ok(ExitCode::SUCCESS)
        }
        Command::Check { packages, prompts, steps, tier, threads, top_k, format, out, golden } => {
            let opts = onnx_genai_conformance::check::CheckOptions {
                steps,
                tier,
                threads: threads.max(1),
                top_k,
                golden,
                ..Default::default()
            };
            // Exit 1 means a mismatch: a check that cannot start is a 2.
            check(&packages, prompts.as_deref(), opts, format, out.as_deref()).or_else(|e| {
                eprintln!("error: {e:#}");
                Ok(ExitCode::from(2))
            })
        }
        Command::Serve {
            packages,
            host,
            port,
            max_sessions,
            max_choices,
            kv_budget_bytes,
            prefill_chunk,
            queue_limit,
            admission_wait_ms,
            stall_timeout_s,
            backend,
            threads,
            kv_cache,
            api_keys,
            allowed_hosts,
            header_timeout_s,
            request_timeout_s,
            max_connections,
            log_format,
        } => {
            init_logs(log_format);
            // What the server says as it starts: plain lines, or under
            // `--log-format json` events like every other line it writes
            // (a log shipper reads one JSON object per line).
            let say = |text: String| match log_format {
                Format::Text => eprintln!("{text}"),
                Format::Json => tracing::info!("{text}"),
            };
            let budget = match kv_budget_bytes {
                Some(b) => {
                    say(format!("KV budget: {} MiB (--kv-budget-bytes)", b >> 20));
                    b
                }
                None => match available_memory() {
                    Some(avail) => {
                        say(format!(
                            "KV budget: {} MiB, half of the {} MiB available now (--kv-budget-bytes sets it)",
                            (avail / 2) >> 20,
                            avail >> 20
                        ));
                        avail / 2
                    }
                    None => {
                        say("KV budget: unlimited (available memory unknown; --kv-budget-bytes sets it)".into());
                        u64::MAX
                    }
                },
            };
            let scheduler = onnx_genai_engine::Scheduler::new(budget);
            let mut engines = Vec::new();
            for p in &packages {
                let started = std::time::Instant::now();
                let engine = Engine::open_with(p, backend, threads, kv_cache)
                    .with_context(|| format!("opening {}", p.display()))?;
                say(format!("loaded {} in {:.2} s", p.display(), started.elapsed().as_secs_f64()));
                engines.push(engine.with_scheduler(scheduler.clone()).with_prefill_chunk(prefill_chunk));
            }
            let driver = onnx_genai_server::DriverOptions {
                queue_limit,
                admission_wait: Duration::from_millis(admission_wait_ms),
                stall_timeout: Duration::from_secs(stall_timeout_s),
            };
            let http = onnx_genai_server::HttpOptions {
                api_keys,
                allowed_hosts,
                header_timeout: Duration::from_secs(header_timeout_s),
                request_timeout: Duration::from_secs(request_timeout_s),
                max_connections,
            };
            let options = onnx_genai_server::ServerOptions { max_sessions, max_choices, driver, http };
            let server = onnx_genai_server::start_with(engines, &format!("{host}:{port}"), options)?;
            say(format!("serving on http://{} (Ctrl-C stops)", server.addr));
            server.wait();
            Ok(ExitCode::SUCCESS)
        }
        Command::Generate {
            package,
            prompt,
            chat,
            max_new_tokens,
            temperature,
            top_k,
            top_p,
            seed,
            backend,
            threads,
            kv_cache,
            show_ids,
            image,
        } => {
            let mut engine = Engine::open_with(&package, backend, threads, kv_cache)?;
            let mut inputs = Vec::new();
            let mut prompt = prompt;
            let prompter = engine.prompter();
            if let Some(path) = &image {
                let encoded = read_image(path).with_context(|| format!("cannot read image {}", path.display()))?;
                inputs.push(prompter.image(&encoded).with_context(|| format!("cannot read image {}", path.display()))?);
            }
            let prompt = if chat {
                // The image comes first in the message, as its placeholder
                // token (text that spells it stays text).
                let image_at = if image.is_some() { vec![0] } else { Vec::new() };
                Prompt::Chat(vec![ChatMessage { image_at, ..ChatMessage::new("user", prompt) }].into())
            } else {
                if let Some(placeholder) =
                    prompter.image_placeholder().filter(|p| image.is_some() && !prompt.contains(*p))
                {
                    prompt = format!("{placeholder}{prompt}");
                }
                Prompt::Text(prompt)
            };
            let request = GenerateRequest {
                max_new_tokens,
                sampling: {
                    let d = prompter.sampling_defaults();
                    Sampling {
                        temperature: temperature.or(d.temperature).unwrap_or(0.0),
                        top_k: top_k.or(d.top_k.map(|k| k as usize)).unwrap_or(0),
                        top_p: top_p.or(d.top_p).unwrap_or(1.0),
                        repetition_penalty: d.repetition_penalty.unwrap_or(1.0),
                        seed,
                        ..Sampling::default()
                    }
                },
                inputs,
                ..GenerateRequest::new(prompt)
            };
            let mut stdout = std::io::stdout().lock();
            let result = engine.generate(&request, &mut |event| {
                // A closed stdout (e.g. `| head`) stops generation instead of panicking.
                match write!(stdout, "{}", event.text_delta).and_then(|_| stdout.flush()) {
                    Ok(()) => Flow::Continue,
                    Err(_) => Flow::Stop,
                }
            })?;
            let _ = writeln!(stdout);
            if show_ids {
                let _ = writeln!(stdout, "token ids: {:?}", result.token_ids);
            }
            eprintln!(
                "[{}: {} prompt tokens, {} generated, finish: {:?}]",
                engine.backend_name(),
                result.prompt_tokens,
                result.token_ids.len(),
                result.finish_reason
            );
            Ok(ExitCode::SUCCESS)
        }
    }
}

fn validate(dir: &std::path::Path, format: Format, verbose: bool) -> Result<ExitCode> {
    let (report, _) = onnx_genai_package::validate(dir);
    let text = match format {
        Format::Json => format!("{}\n", serde_json::to_string_pretty(&report)?),
        Format::Text if report.diagnostics.is_empty() => format!("{}: ok\n", dir.display()),
        Format::Text if verbose => report.verbose().to_string(),
        Format::Text => report.to_string(),
    };
    report_out(&text);
    Ok(if report.has_errors() { ExitCode::FAILURE } else { ExitCode::SUCCESS })
}

/// An image file's bytes, at most [`MAX_IMAGE_FILE`] of them.
fn read_image(path: &Path) -> Result<Vec<u8>> {
    use std::io::Read;
    let mut bytes = Vec::new();
    std::fs::File::open(path)?.take(MAX_IMAGE_FILE + 1).read_to_end(&mut bytes)?;
    if bytes.len() as u64 > MAX_IMAGE_FILE {
        anyhow::bail!("it holds more than {} MiB (a PNG or JPEG of at most that)", MAX_IMAGE_FILE >> 20);
    }
    Ok(bytes)
}

fn inspect(dir: &std::path::Path) -> Result<ExitCode> {
    let package = Package::open(dir)?;
    let m = &package.manifest;
    let a = &m.architecture;
    outln!("package   {} {} ({:?} dialect)", m.name, m.version, package.dialect);
    outln!(
        "arch      {:?}: hidden {}, layers {}, heads {}, kv heads {}, head dim {}, vocab {}, context {}",
        a.family,
        a.hidden_size,
        a.num_layers,
        a.num_attention_heads,
        a.num_kv_heads,
        a.head_dim,
        a.vocab_size,
        a.max_sequence_length
    );
    outln!("dtype     weights {:?}", m.dtype);
    match package.kv_geometry() {
        Some(g) => {
            outln!("kv cache  {:?}, {} layers, {} bytes per token", g.dtype, g.layers.len(), g.bytes_per_token())
        }
        None => outln!("kv cache  unknown geometry (admission reserves nothing)"),
    }
    let mut parameters = 0;
    for c in &m.components {
        let (_, path) = package.component(&c.name)?;
        let model = onnx_genai_onnx::read_model(path).with_context(|| format!("reading {}", path.display()))?;
        parameters += model.graph.parameter_count();
        outln!(
            "component {} ({}, {} nodes, {} parameters)",
            c.name,
            c.file,
            model.graph.nodes.len(),
            model.graph.parameter_count()
        );
        for p in &c.ports {
            outln!("  {:<15} {}", p.role.as_str(), p.name);
        }
    }
    outln!("params    {parameters}");
    // What native-cpu makes of the decoder: a compile error here is the same
    // one `generate --backend native-cpu` would report.
    match onnx_genai_native::compile_package(&package) {
        Ok(plan) => {
            let s = &plan.stats;
            let fused: Vec<String> = s.fusions.iter().map(|(k, n)| format!("{k} x{n}")).collect();
            outln!(
                "native    {} nodes -> {} steps ({} folded; fused: {}); {} values in {} buffer slots",
                s.imported_nodes,
                s.planned_steps,
                s.folded_nodes,
                if fused.is_empty() { "none".to_string() } else { fused.join(", ") },
                plan.values,
                plan.slots()
            );
        }
        Err(e) => outln!("native    not compilable: {e}"),
    }
    for w in &package.warnings {
        outln!("{w}");
    }
    Ok(ExitCode::SUCCESS)
}
