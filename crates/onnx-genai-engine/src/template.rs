//! The Jinja environment chat templates are rendered in: the one Hugging
//! Face's `apply_chat_template` sets up, because a model's template was
//! written (and the model trained) against that renderer. It differs from
//! a plain Jinja environment in ways a real template notices: whitespace
//! after and before block tags is trimmed (`trim_blocks`,
//! `lstrip_blocks`), Python string and dict methods work
//! (`.strip()`, `.split()`, `.items()`: minijinja-contrib's pycompat),
//! `tojson` is Python's `json.dumps` (`", "` and `": "` separators, no
//! HTML escaping, `indent`), and `raise_exception` and `strftime_now` are
//! defined. `tests/chat_templates.rs` holds real models' templates to the
//! Python renderer's output.

use std::fmt::Write as _;

use minijinja::value::Kwargs;
use minijinja::{Environment, Error, ErrorKind, Value};

/// Variables the renderer itself sets: a request's extra variables may not
/// replace them.
pub const RESERVED: [&str; 7] =
    ["messages", "tools", "add_generation_prompt", "bos_token", "eos_token", "raise_exception", "strftime_now"];

/// Instructions one render may run (a package's template could loop
/// without end: three nested `range(100000)` loops pinned a request
/// thread); ample for real conversations (the test renders 2,000
/// messages through Llama 3.1's template within a tenth of it).
pub const RENDER_FUEL: u64 = 20_000_000;

/// The most text one render may make (64 MiB; minijinja repeats a string
/// up to 100 MB at once, and a loop would repeat that): past it the render
/// fails instead of taking the memory.
pub const MAX_RENDERED_BYTES: usize = 64 << 20;

/// A fresh environment with Hugging Face's settings and functions.
pub fn environment() -> Environment<'static> {
    let mut env = Environment::new();
    env.set_fuel(Some(RENDER_FUEL));
    env.set_trim_blocks(true);
    env.set_lstrip_blocks(true);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_filter("tojson", tojson);
    env.add_function("raise_exception", raise_exception);
    env.add_function("strftime_now", strftime_now);
    env
}

/// `template` rendered with `context`, at most [`MAX_RENDERED_BYTES`] of it.
pub fn render_bounded(template: &minijinja::Template<'_, '_>, context: Value) -> Result<String, Error> {
    let mut out = Bounded(Vec::new());
    template.render_captured_to(context, &mut out)?;
    String::from_utf8(out.0).map_err(|e| Error::new(ErrorKind::InvalidOperation, e.to_string()))
}

/// A writer that refuses to grow past [`MAX_RENDERED_BYTES`].
struct Bounded(Vec<u8>);

impl std::io::Write for Bounded {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if self.0.len() + buf.len() > MAX_RENDERED_BYTES {
            return Err(std::io::Error::other(format!("the rendered text passes {MAX_RENDERED_BYTES} bytes")));
        }
        self.0.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// What a template raises: the render fails with the template's message.
fn raise_exception(message: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message))
}

/// `json.dumps(value, ensure_ascii=False, indent=..., separators=...,
/// sort_keys=...)`, as transformers registers `tojson`.
fn tojson(value: Value, kwargs: Kwargs) -> Result<Value, Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let ensure_ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    let separators: Option<Vec<String>> = kwargs.get("separators")?;
    kwargs.assert_all_used()?;
    if indent.is_some_and(|n| n > MAX_TOJSON_INDENT) {
        // A package's template sets it: every line of the output repeats
        // `indent` spaces per level, so a huge one asks for more memory
        // than there is.
        return Err(Error::new(
            ErrorKind::InvalidOperation,
            format!("tojson: indent is at most {MAX_TOJSON_INDENT} spaces"),
        ));
    }
    let (item, key) = match separators.as_deref() {
        Some([item, key]) => (item.clone(), key.clone()),
        Some(_) => return Err(Error::new(ErrorKind::InvalidOperation, "tojson: separators is a pair of strings")),
        None if indent.is_some() => (",".to_string(), ": ".to_string()),
        None => (", ".to_string(), ": ".to_string()),
    };
    let json =
        serde_json::to_value(&value).map_err(|e| Error::new(ErrorKind::InvalidOperation, format!("tojson: {e}")))?;
    let style =
        Style { indent, item, key, ensure_ascii: ensure_ascii.unwrap_or(false), sort_keys: sort_keys.unwrap_or(false) };
    let mut out = String::new();
    style.write(&json, 0, &mut out);
    if out.len() > MAX_TOJSON_BYTES {
        return Err(Error::new(
            ErrorKind::InvalidOperation,
            format!("tojson: the output passes {MAX_TOJSON_BYTES} bytes (its value is too large or too deeply nested)"),
        ));
    }
    // Safe to insert as it is: the output is the template's text, not HTML.
    Ok(Value::from_safe_string(out))
}

/// The widest `tojson` indent a template may ask for (templates use 2 or 4).
const MAX_TOJSON_INDENT: usize = 64;

/// The most text one `tojson` makes (4 MiB, four times the largest request
/// body). Indentation repeats per level and per element, so a request's
/// tool schema nested a hundred levels deep would otherwise render 250
/// times its own size (a 1 MiB body, 260 MB) before anything could
/// refuse it: past this no more indentation is written, and the call
/// fails.
const MAX_TOJSON_BYTES: usize = 4 << 20;

struct Style {
    indent: Option<usize>,
    item: String,
    key: String,
    ensure_ascii: bool,
    sort_keys: bool,
}

impl Style {
    fn write(&self, v: &serde_json::Value, depth: usize, out: &mut String) {
        use serde_json::Value as J;
        match v {
            J::Null => out.push_str("null"),
            J::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
            J::Number(n) => match n.as_f64().filter(|_| n.is_f64()) {
                Some(f) => out.push_str(&python_float(f)),
                None => out.push_str(&n.to_string()),
            },
            J::String(s) => self.string(s, out),
            J::Array(items) if items.is_empty() => out.push_str("[]"),
            J::Object(map) if map.is_empty() => out.push_str("{}"),
            J::Array(items) => {
                out.push('[');
                for (i, item) in items.iter().enumerate() {
                    self.separate(i, depth + 1, out);
                    self.write(item, depth + 1, out);
                }
                self.close(depth, out);
                out.push(']');
            }
            J::Object(map) => {
                let mut entries: Vec<_> = map.iter().collect();
                if self.sort_keys {
                    entries.sort_by(|a, b| a.0.cmp(b.0));
                }
                out.push('{');
                for (i, (k, item)) in entries.into_iter().enumerate() {
                    self.separate(i, depth + 1, out);
                    self.string(k, out);
                    out.push_str(&self.key);
                    self.write(item, depth + 1, out);
                }
                self.close(depth, out);
                out.push('}');
            }
        }
    }

    /// Before the `i`th element of a container at `depth`.
    fn separate(&self, i: usize, depth: usize, out: &mut String) {
        if i > 0 {
            out.push_str(&self.item);
        }
        self.newline(depth, out);
    }

    fn close(&self, depth: usize, out: &mut String) {
        self.newline(depth, out);
    }

    /// A new line indented to `depth` (none past [`MAX_TOJSON_BYTES`]:
    /// the call fails then, and the rest costs no more than its value).
    fn newline(&self, depth: usize, out: &mut String) {
        if let Some(n) = self.indent.filter(|_| out.len() <= MAX_TOJSON_BYTES) {
            out.push('\n');
            out.extend(std::iter::repeat_n(' ', n * depth));
        }
    }

    /// Python escapes the same characters as `serde_json` (quote,
    /// backslash, control characters); with `ensure_ascii` everything
    /// beyond ASCII too, as UTF-16 `\uXXXX` units.
    fn string(&self, s: &str, out: &mut String) {
        let quoted = serde_json::Value::String(s.to_string()).to_string();
        if !self.ensure_ascii {
            out.push_str(&quoted);
            return;
        }
        for c in quoted.chars() {
            // Python's ASCII-only output keeps ' ' to '~' and escapes the
            // rest (DEL included).
            if c.is_ascii() && c != '\x7f' {
                out.push(c);
            } else {
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units) {
                    let _ = write!(out, "\\u{unit:04x}");
                }
            }
        }
    }
}

/// A float as Python's `repr` writes it (what `json.dumps` uses): the
/// shortest digits that read back, positional for exponents -4 to 15
/// (`123.0`, `0.0001`), else `1e-05` / `1.5e+16`.
fn python_float(x: f64) -> String {
    // Values reach `tojson` through JSON, which has no NaN or infinity;
    // written as Python would anyway.
    if x.is_nan() {
        return "NaN".into();
    }
    if x.is_infinite() {
        return if x > 0.0 { "Infinity".into() } else { "-Infinity".into() };
    }
    // `{:e}` gives the shortest round-trip digits: `-1.5e16`, `1e-7`.
    let text = format!("{x:e}");
    let (mantissa, exp) = text.split_once('e').unwrap_or((&text, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let (sign, mantissa) = mantissa.strip_prefix('-').map_or(("", mantissa), |m| ("-", m));
    let digits: String = mantissa.chars().filter(char::is_ascii_digit).collect();
    if (-4..16).contains(&exp) {
        let point = exp + 1; // digits before the decimal point
        let body = if point <= 0 {
            format!("0.{}{digits}", "0".repeat(point.unsigned_abs() as usize))
        } else if point as usize >= digits.len() {
            format!("{digits}{}.0", "0".repeat(point as usize - digits.len()))
        } else {
            format!("{}.{}", &digits[..point as usize], &digits[point as usize..])
        };
        format!("{sign}{body}")
    } else {
        let (first, rest) = digits.split_at(1);
        let mantissa = if rest.is_empty() { first.to_string() } else { format!("{first}.{rest}") };
        format!("{sign}{mantissa}e{}{:02}", if exp < 0 { '-' } else { '+' }, exp.unsigned_abs())
    }
}

/// `strftime_now(format)`: the current time in UTC (templates print
/// today's date with it; transformers uses the local time, which on a
/// server is normally UTC).
fn strftime_now(format: String) -> Result<String, Error> {
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
    strftime(&format, now as i64)
}

const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];
const WEEKDAYS: [&str; 7] = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"];

/// The C `strftime` directives templates use, for a UTC Unix time; any
/// other directive is an error naming it.
fn strftime(format: &str, unix: i64) -> Result<String, Error> {
    let days = unix.div_euclid(86_400);
    let secs = unix.rem_euclid(86_400);
    let (year, month, day) = civil_from_days(days);
    // 1970-01-01 was a Thursday (index 3 from Monday).
    let weekday = (days + 3).rem_euclid(7) as usize;
    let month_name = MONTHS[(month - 1) as usize];
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let _ = match chars.next() {
            Some('d') => write!(out, "{day:02}"),
            Some('m') => write!(out, "{month:02}"),
            Some('Y') => write!(out, "{year}"),
            Some('y') => write!(out, "{:02}", year.rem_euclid(100)),
            Some('b') => write!(out, "{}", &month_name[..3]),
            Some('B') => write!(out, "{month_name}"),
            Some('a') => write!(out, "{}", &WEEKDAYS[weekday][..3]),
            Some('A') => write!(out, "{}", WEEKDAYS[weekday]),
            Some('H') => write!(out, "{:02}", secs / 3600),
            Some('M') => write!(out, "{:02}", secs / 60 % 60),
            Some('S') => write!(out, "{:02}", secs % 60),
            Some('%') => write!(out, "%"),
            other => {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    format!("strftime_now: unsupported directive %{}", other.map(String::from).unwrap_or_default()),
                ))
            }
        };
    }
    Ok(out)
}

/// Days since 1970-01-01 to (year, month, day), proleptic Gregorian
/// (Howard Hinnant's `civil_from_days`).
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Python's `repr` of each float (recorded with CPython 3.11).
    #[test]
    fn floats_are_written_as_python_writes_them() {
        for (x, python) in [
            (123.0, "123.0"),
            (0.1, "0.1"),
            (-2.5, "-2.5"),
            (0.0001, "0.0001"),
            (1e-5, "1e-05"),
            (1.5e-7, "1.5e-07"),
            (1e15, "1000000000000000.0"),
            (1e16, "1e+16"),
            (-1.25e17, "-1.25e+17"),
            (21.5, "21.5"),
            (0.0, "0.0"),
        ] {
            assert_eq!(python_float(x), python, "{x}");
        }
    }

    /// `datetime.fromtimestamp(t, timezone.utc).strftime(f)` (CPython).
    #[test]
    fn strftime_matches_python_on_known_times() {
        assert_eq!(strftime("%d %b %Y", 1_764_633_600).unwrap(), "02 Dec 2025");
        assert_eq!(strftime("%A %B %d, %y %H:%M:%S %%", 951_825_599).unwrap(), "Tuesday February 29, 00 11:59:59 %");
        assert_eq!(strftime("%a %m/%d/%Y", 0).unwrap(), "Thu 01/01/1970");
        assert!(strftime("%Q", 0).unwrap_err().to_string().contains("%Q"));
    }

    fn render(source: &str, ctx: Value) -> String {
        environment().render_str(source, ctx).unwrap()
    }

    /// `tojson` is `json.dumps` (ensure_ascii off): spaced separators, no
    /// HTML escaping, `indent` and `sort_keys` as Python reads them.
    #[test]
    fn tojson_is_pythons_json_dumps() {
        let ctx = Value::from_serialize(serde_json::json!({"v": {"b": [1, 2.5, "<Zürich>"], "a": {}, "c": []}}));
        assert_eq!(render("{{ v | tojson }}", ctx.clone()), r#"{"b": [1, 2.5, "<Zürich>"], "a": {}, "c": []}"#);
        assert_eq!(
            render("{{ v | tojson(indent=2, sort_keys=true) }}", ctx.clone()),
            "{\n  \"a\": {},\n  \"b\": [\n    1,\n    2.5,\n    \"<Zürich>\"\n  ],\n  \"c\": []\n}"
        );
        assert_eq!(render("{{ v.b | tojson(ensure_ascii=true) }}", ctx.clone()), r#"[1, 2.5, "<Z\u00fcrich>"]"#);
        assert_eq!(render("{{ v.b | tojson(separators=[',', ':']) }}", ctx.clone()), r#"[1,2.5,"<Zürich>"]"#);
        assert_eq!(render("{{ v.c | tojson(indent=64) }}", ctx.clone()), "[]");
        // A template's indent beyond any real one is a render error, not
        // a request for petabytes of spaces (a capacity-overflow panic).
        for indent in ["65", "1000000000000000", "9223372036854775807"] {
            let err = environment().render_str(&format!("{{{{ v | tojson(indent={indent}) }}}}"), ctx.clone());
            let err = err.expect_err(indent).to_string();
            assert!(err.contains("indent is at most 64"), "{indent}: {err}");
        }
    }

    /// A request's value nested deep under an indenting `tojson` (tool
    /// schemas reach Llama 3.1's `tojson(indent=4)`): 100 levels around
    /// 20,000 elements would render 8 MB of indentation from 60 KB; the call
    /// fails past `MAX_TOJSON_BYTES` (4 MiB) having written no more than
    /// that and its value, and the same value without the indent renders.
    #[test]
    fn tojson_of_a_deep_value_under_indent_is_bounded() {
        let mut deep = serde_json::json!(vec![0; 20_000]);
        for _ in 0..100 {
            deep = serde_json::json!([deep]);
        }
        let ctx = Value::from_serialize(serde_json::json!({ "v": deep }));
        let err = environment().render_str("{{ v | tojson(indent=4) }}", ctx.clone()).unwrap_err().to_string();
        assert!(err.contains("passes 4194304 bytes"), "{err}");
        assert_eq!(render("{{ v | tojson }}", ctx).len(), 60_000 + 100 * 2);
    }

    /// A template that loops without end runs out of fuel, one that makes
    /// text without end stops at `MAX_RENDERED_BYTES`, each an error
    /// (it pinned a request thread or took the memory), while a real
    /// template renders a long conversation within both.
    #[test]
    fn renders_are_bounded_in_steps_and_text() {
        let env = environment();
        let endless = "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}";
        let err = render_bounded(&env.template_from_str(endless).unwrap(), Value::UNDEFINED).unwrap_err();
        assert!(matches!(err.kind(), ErrorKind::OutOfFuel), "{err}");
        let wide = "{% for i in range(1000) %}{{ 'x' * 100000 }}{% endfor %}";
        let err = render_bounded(&env.template_from_str(wide).unwrap(), Value::UNDEFINED).unwrap_err();
        let cause = std::error::Error::source(&err).map(ToString::to_string).unwrap_or_default();
        assert!(cause.contains("passes 67108864 bytes"), "{err}: {cause}");
        let llama = include_str!("../tests/data/chat_templates/llama-3.1-8b-instruct.jinja");
        let messages: Vec<serde_json::Value> = (0..2000)
            .map(|i| serde_json::json!({"role": if i % 2 == 0 { "user" } else { "assistant" }, "content": format!("message {i}")}))
            .collect();
        let ctx = Value::from_serialize(
            serde_json::json!({"messages": messages, "add_generation_prompt": true, "bos_token": "<s>"}),
        );
        let mut small = environment();
        small.set_fuel(Some(RENDER_FUEL / 10));
        let text = render_bounded(&small.template_from_str(llama).unwrap(), ctx).unwrap();
        assert!(text.contains("message 1999"), "{}", &text[text.len().saturating_sub(200)..]);
    }
}
