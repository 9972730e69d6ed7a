//! What a chat template's tags may hold before it is compiled. minijinja's
//! parser recurses once per unary operator (`-`, `not`) without the depth
//! guard its other rules have, and its compiler once per operand of a
//! chain (`1 + 1 + …`): a tag of a million of them overflowed the stack and
//! aborted every command that opened the package. Bounding the code of
//! each tag bounds both; real templates' longest tags hold 37 to 114
//! bytes of code (SmolLM2, Llama 3.1, Qwen 2.5 and 3; their long texts are
//! string literals, not counted).

/// The most bytes of code (outside string literals) one `{{ … }}` or
/// `{% … %}` tag may hold.
pub(crate) const MAX_TAG_CODE: usize = 1024;

/// Checks every tag of `template`; the error names the first too long.
pub(crate) fn check_tags(template: &str) -> Result<(), String> {
    let bytes = template.as_bytes();
    let mut at = 0;
    while let Some(open) = find(bytes, at, |b, i| b[i] == b'{' && matches!(b.get(i + 1), Some(b'{' | b'%' | b'#'))) {
        // A comment is text: what it holds is no tag (its brackets were
        // counted, and a `{{ (` in one read the rest as one tag's code).
        if bytes[open + 1] == b'#' {
            match template[open + 2..].find("#}") {
                Some(end) => {
                    at = open + 2 + end + 2;
                    continue;
                }
                None => break,
            }
        }
        let close = if bytes[open + 1] == b'{' { b'}' } else { b'%' };
        // (Brackets are counted as minijinja's lexer counts them: a `}}`
        // inside `[{'a': {}}, …]` does not end the tag, and counting ended
        // there let the operators after it through.)
        let (mut i, mut code, mut quote, mut depth) = (open + 2, 0usize, None::<u8>, 0isize);
        while i < bytes.len() {
            let b = bytes[i];
            match quote {
                Some(_) if b == b'\\' => i += 1,
                Some(q) if b == q => quote = None,
                Some(_) => {}
                None if b == b'\'' || b == b'"' => quote = Some(b),
                None if depth == 0 && b == close && bytes.get(i + 1) == Some(&b'}') => break,
                None => {
                    match b {
                        b'(' | b'[' | b'{' => depth += 1,
                        b')' | b']' | b'}' => depth -= 1,
                        _ => {}
                    }
                    code += 1;
                }
            }
            i += 1;
        }
        if code > MAX_TAG_CODE {
            let line = template[..open].matches('\n').count() + 1;
            return Err(format!(
                "the tag on line {line} holds {code} bytes of code, more than the {MAX_TAG_CODE} a template's \
                 tag may (its parser recurses once per operator)"
            ));
        }
        at = i + 2;
    }
    Ok(())
}

/// The first `i >= from` where `at(bytes, i)` holds.
fn find(bytes: &[u8], from: usize, at: impl Fn(&[u8], usize) -> bool) -> Option<usize> {
    (from..bytes.len()).find(|&i| at(bytes, i))
}

#[cfg(test)]
mod tests {
    use super::{check_tags, MAX_TAG_CODE};

    /// Tags of a million unary operators or chained operands are refused
    /// before minijinja sees them (it overflowed the stack on them); string
    /// literals do not count, so a long system prompt in a tag passes; the
    /// templates of real models pass; and tags at the bound compile on a
    /// thread of 1 MiB of stack, half the request threads' 2 MiB (an eighth
    /// of the main thread's 8; unoptimised, minijinja took 680 bytes of
    /// stack an operator).
    #[test]
    fn tags_past_the_bound_are_refused_before_they_are_compiled() {
        for tag in ["-".repeat(1_000_000), "not ".repeat(250_000), "1 + ".repeat(250_000)] {
            let template = format!("Hello\n{{{{ {tag}1 }}}}");
            let err = check_tags(&template).unwrap_err();
            assert!(err.contains("line 2") && err.contains("more than the 1024"), "{err}");
        }
        // A `}}` inside brackets does not end the tag (minijinja reads on).
        let nested = format!("{{{{ [{{'a': {{}}}}, {}1] }}}}", "-".repeat(1_000_000));
        assert!(check_tags(&nested).unwrap_err().contains("more than the 1024"));
        assert_eq!(check_tags("{{ [{'a': {}}, -1] }}{% if x %}}{% endif %}"), Ok(()));
        // A comment's brackets are no tag's.
        let commented = format!("{{# e.g. {{{{ ( #}}{}{{{{ x }}}}", "text ".repeat(500));
        assert_eq!(check_tags(&commented), Ok(()));
        let literal = format!("{{% set system = \"{}\" %}}{{{{ system }}}}", "a }} %} ".repeat(10_000));
        assert_eq!(check_tags(&literal), Ok(()));
        let data = concat!(env!("CARGO_MANIFEST_DIR"), "/../onnx-genai-engine/tests/data/chat_templates");
        for entry in std::fs::read_dir(data).unwrap() {
            let path = entry.unwrap().path();
            if path.extension().is_some_and(|e| e == "jinja") {
                let template = std::fs::read_to_string(&path).unwrap();
                assert_eq!(check_tags(&template), Ok(()), "{}", path.display());
            }
        }
        // ("{{ ", "1" and " }}" around each: 3 bytes of its code.)
        let at_bound =
            ["-".repeat(MAX_TAG_CODE - 3), "not ".repeat((MAX_TAG_CODE - 3) / 4), "1+".repeat((MAX_TAG_CODE - 3) / 2)];
        for tag in at_bound {
            let template = format!("{{{{ {tag}1 }}}}");
            assert_eq!(check_tags(&template), Ok(()), "{} bytes", template.len());
            let compiled = std::thread::Builder::new()
                .stack_size(1 << 20)
                .spawn(move || {
                    minijinja::Environment::new().template_from_str(&template).map(|_| ()).map_err(|e| e.to_string())
                })
                .unwrap()
                .join();
            assert!(matches!(compiled, Ok(Ok(()))), "a tag at the bound failed to compile: {compiled:?}");
        }
    }
}
