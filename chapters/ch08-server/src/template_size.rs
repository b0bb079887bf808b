//! How large a chat template kiln compiles: bounds on its source and on each of its tags, checked
//! before minijinja sees it.
//!
//! minijinja parses a run of unary operators (`---x`, `not not x`) by recursion with no depth
//! limit of its own, and compiles any chain of operators (`x-1-1-1`) by recursion too, in work
//! that grows with the square of the chain's depth: 20,000 minus signs overflowed an 8 MiB stack
//! (which aborts the process), and a run of 65,000 before a variable compiled in 103 s, on the
//! 1 GiB stack a compile now runs on. A chain lives inside one tag, so bounding the tags bounds
//! the depth, and the compile's work by about the source's length times the tag's: a source as
//! long as the limit, all tags as long as theirs, each a run of minus signs before a variable,
//! compiled in 1.8 s.

/// The longest template source kiln compiles (256 KiB). The 71 templates llama.cpp ships (in
/// `fixtures/.cache/llama.cpp/src/models/templates` once `fixtures/scripts/build_llama_cpp.sh`
/// has run) are at most 18 KB.
pub const TEMPLATE_SOURCE_LIMIT: usize = 256 << 10;

/// The longest tag kiln compiles: the text inside one `{{ }}` or `{% %}`, its string literals
/// left out (2 KiB). The longest in llama.cpp's templates is 289 bytes.
pub const TEMPLATE_TAG_LIMIT: usize = 2 << 10;

/// Checks `source` against [`TEMPLATE_SOURCE_LIMIT`] and [`TEMPLATE_TAG_LIMIT`]; the message
/// says which and where.
pub fn check(source: &str) -> Result<(), String> {
    if source.len() > TEMPLATE_SOURCE_LIMIT {
        return Err(format!(
            "its source is {} bytes; kiln compiles templates of up to {TEMPLATE_SOURCE_LIMIT}",
            source.len()
        ));
    }
    let (longest, at) = longest_tag(source.as_bytes());
    if longest > TEMPLATE_TAG_LIMIT {
        return Err(format!(
            "the tag at byte {at} holds {longest} bytes besides its strings; kiln compiles tags \
             of up to {TEMPLATE_TAG_LIMIT}"
        ));
    }
    Ok(())
}

/// The longest tag of `source` (its length without string literals, and the byte it starts at).
/// A tag ends at the first `}}` or `%}` outside its strings and its own braces (a dict literal's
/// `}}` does not end it); comments are skipped, and so is the text of a `{% raw %}` block.
fn longest_tag(source: &[u8]) -> (usize, usize) {
    let (mut longest, mut longest_at) = (0, 0);
    let mut i = 0;
    while i + 1 < source.len() {
        let close: &[u8] = match &source[i..i + 2] {
            b"{{" => b"}}",
            b"{%" => b"%}",
            b"{#" => {
                i = find(source, i + 2, b"#}").map_or(source.len(), |end| end + 2);
                continue;
            }
            _ => {
                i += 1;
                continue;
            }
        };
        let (start, mut j, mut length, mut braces) = (i, i + 2, 0, 0usize);
        while j < source.len() && !(braces == 0 && source[j..].starts_with(close)) {
            match source[j] {
                quote @ (b'\'' | b'"') => {
                    j += 1;
                    while j < source.len() && source[j] != quote {
                        j += if source[j] == b'\\' { 2 } else { 1 };
                    }
                }
                b'{' => braces += 1,
                b'}' => braces = braces.saturating_sub(1),
                _ => {}
            }
            length += 1;
            j += 1;
        }
        if length > longest {
            (longest, longest_at) = (length, start);
        }
        let word: Vec<u8> = (source[start + 2..j.min(source.len())].iter())
            .filter(|&&c| !c.is_ascii_whitespace() && c != b'-' && c != b'+')
            .copied()
            .collect();
        i = j + 2;
        if close == b"%}" && word == b"raw" {
            i = end_of_raw(source, i);
        }
    }
    (longest, longest_at)
}

/// Where the text of a `{% raw %}` block that starts at `from` ends: just past the first
/// `{% endraw %}` tag (`{%`, an optional `-` or `+`, whitespace, `endraw`, whitespace, an
/// optional `-` or `+`, `%}`, as minijinja's lexer reads it), or the source's end. A bare
/// `endraw` in the raw text does not end it.
fn end_of_raw(source: &[u8], from: usize) -> usize {
    let mut at = from;
    while let Some(open) = find(source, at, b"{%") {
        let mut j = open + 2;
        let skip_ws = |mut j: usize| {
            while source.get(j).is_some_and(u8::is_ascii_whitespace) {
                j += 1;
            }
            j
        };
        if matches!(source.get(j), Some(b'-' | b'+')) {
            j += 1;
        }
        j = skip_ws(j);
        if source[j..].starts_with(b"endraw") {
            j = skip_ws(j + b"endraw".len());
            if matches!(source.get(j), Some(b'-' | b'+')) {
                j += 1;
            }
            if source[j..].starts_with(b"%}") {
                return j + 2;
            }
        }
        at = open + 2;
    }
    source.len()
}

/// The first `needle` in `haystack` at or after `from`.
fn find(haystack: &[u8], from: usize, needle: &[u8]) -> Option<usize> {
    (haystack.get(from..)?.windows(needle.len()))
        .position(|w| w == needle)
        .map(|p| from + p)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tags_are_measured_without_their_strings_comments_and_raw_text() {
        let long = "x".repeat(5000);
        // A string, a comment, a raw block: none of them counts.
        let source = format!(
            "{{% set s = '{long}' %}}{{# {long} #}}{{% raw %}}{{{{ {long} }}}}{{% endraw %}}{{{{ a }}}}"
        );
        assert_eq!(longest_tag(source.as_bytes()), (11, 0), "{source:.40}");
        assert!(check(&source).is_ok());
        // A dict literal's `}}` does not end its tag; an escaped quote does not end a string.
        let dict = format!(
            "{{{{ {{'a': {{'b': 1}}}} ~ \"\\\"{long}\" ~ {} }}}}",
            "-".repeat(10)
        );
        assert_eq!(longest_tag(dict.as_bytes()).0, 30, "{dict:.60}");
    }

    /// A raw block ends at an `{% endraw %}` tag, not at the word: a deep tag after the word
    /// `endraw` inside raw text, hidden from a scanner that stopped there, is measured.
    #[test]
    fn a_raw_block_ends_only_at_its_endraw_tag() {
        let deep = "-".repeat(TEMPLATE_TAG_LIMIT + 10);
        for raw_end in ["{% endraw %}", "{%- endraw -%}", "{%+endraw+%}"] {
            let source = format!("{{% raw %}}endraw{{#{raw_end}{{{{ {deep}n }}}}#}}");
            assert!(check(&source).is_err(), "{source:.60}");
        }
        let unclosed = format!("{{% raw %}}{{{{ {deep}n }}}}");
        assert!(check(&unclosed).is_ok(), "all raw text");
    }

    #[test]
    fn a_tag_longer_than_the_limit_is_refused_and_says_where() {
        let at_limit = format!("hello {{{{{}}}}}", "-".repeat(TEMPLATE_TAG_LIMIT));
        assert!(check(&at_limit).is_ok());
        let over = format!("hello {{{{{}}}}}", "-".repeat(TEMPLATE_TAG_LIMIT + 1));
        let err = check(&over).unwrap_err();
        assert!(
            err.contains("the tag at byte 6 holds 2049 bytes") && err.contains("up to 2048"),
            "{err}"
        );
        let big = "a".repeat(TEMPLATE_SOURCE_LIMIT + 1);
        assert!(check(&big).unwrap_err().contains("up to 262144"));
    }
}
