//! Just enough of a C++ tokenizer for the pre-pass: identifiers, literals,
//! punctuation and preprocessor directives, each with its byte range in the
//! source, comments skipped. It never fails: what it does not understand
//! becomes single-character punctuation, and the C++ compiler that runs after
//! the pre-pass judges the program.

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Ident,
    /// A string literal, quotes (and any prefix) included.
    Str,
    Char,
    Number,
    Punct(u8),
    /// A whole preprocessor directive line (continuations included).
    Directive,
}

#[derive(Clone, Copy, Debug)]
pub struct Token {
    pub kind: Kind,
    pub start: usize,
    pub end: usize,
}

impl Token {
    pub fn text<'a>(&self, src: &'a str) -> &'a str {
        &src[self.start..self.end]
    }

    pub fn is_ident(&self, src: &str, name: &str) -> bool {
        self.kind == Kind::Ident && self.text(src) == name
    }

    pub fn is_punct(&self, c: u8) -> bool {
        self.kind == Kind::Punct(c)
    }
}

fn is_ident_start(c: u8) -> bool {
    c.is_ascii_alphabetic() || c == b'_' || c >= 0x80
}

fn is_ident_char(c: u8) -> bool {
    c.is_ascii_alphanumeric() || c == b'_' || c >= 0x80
}

pub fn tokenize(src: &str) -> Vec<Token> {
    let b = src.as_bytes();
    let mut out = vec![];
    let mut i = 0;
    // Only whitespace since the start of the line: a '#' here opens a directive.
    let mut line_start = true;
    while i < b.len() {
        let c = b[i];
        if c == b'\n' {
            line_start = true;
            i += 1;
            continue;
        }
        if c.is_ascii_whitespace() {
            i += 1;
            continue;
        }
        if c == b'\\' && b.get(i + 1) == Some(&b'\n') {
            i += 2;
            continue;
        }
        if c == b'/' && b.get(i + 1) == Some(&b'/') {
            while i < b.len() && b[i] != b'\n' {
                i += 1;
            }
            continue;
        }
        if c == b'/' && b.get(i + 1) == Some(&b'*') {
            i += 2;
            while i < b.len() && !(b[i] == b'*' && b.get(i + 1) == Some(&b'/')) {
                i += 1;
            }
            i = (i + 2).min(b.len());
            continue;
        }
        let start = i;
        if c == b'#' && line_start {
            while i < b.len() && b[i] != b'\n' {
                i += if b[i] == b'\\' && b.get(i + 1) == Some(&b'\n') { 2 } else { 1 };
            }
            out.push(Token { kind: Kind::Directive, start, end: i });
            continue;
        }
        line_start = false;
        if is_ident_start(c) {
            while i < b.len() && is_ident_char(b[i]) {
                i += 1;
            }
            let word = &src[start..i];
            // Prefixed literals: u8"..", L'..', R"d(..)d".
            if i < b.len() && (b[i] == b'"' || b[i] == b'\'') && matches!(word, "L" | "u" | "U" | "u8") {
                i = skip_quoted(b, i);
                out.push(Token {
                    kind: if b[start + word.len()] == b'"' { Kind::Str } else { Kind::Char },
                    start,
                    end: i,
                });
                continue;
            }
            if i < b.len()
                && b[i] == b'"'
                && word.ends_with('R')
                && matches!(word, "R" | "LR" | "uR" | "UR" | "u8R")
            {
                i = skip_raw(src, i);
                out.push(Token { kind: Kind::Str, start, end: i });
                continue;
            }
            out.push(Token { kind: Kind::Ident, start, end: i });
            continue;
        }
        if c.is_ascii_digit() || (c == b'.' && b.get(i + 1).is_some_and(|d| d.is_ascii_digit())) {
            while i < b.len() {
                let d = b[i];
                let signed_exponent =
                    (d == b'+' || d == b'-') && matches!(b[i - 1], b'e' | b'E' | b'p' | b'P');
                if is_ident_char(d) || d == b'.' || d == b'\'' || signed_exponent {
                    i += 1;
                } else {
                    break;
                }
            }
            out.push(Token { kind: Kind::Number, start, end: i });
            continue;
        }
        if c == b'"' || c == b'\'' {
            i = skip_quoted(b, i);
            out.push(Token { kind: if c == b'"' { Kind::Str } else { Kind::Char }, start, end: i });
            continue;
        }
        // Non-ASCII bytes are identifier characters above, so c is ASCII here.
        out.push(Token { kind: Kind::Punct(c), start, end: i + 1 });
        i += 1;
    }
    out
}

/// From an opening quote to just past its closing one (or the end of the line).
fn skip_quoted(b: &[u8], open: usize) -> usize {
    let q = b[open];
    let mut i = open + 1;
    while i < b.len() && b[i] != q && b[i] != b'\n' {
        i += if b[i] == b'\\' { 2 } else { 1 };
    }
    (i + 1).min(b.len())
}

fn skip_raw(src: &str, quote: usize) -> usize {
    let rest = &src[quote + 1..];
    let Some(open) = rest.find('(') else { return src.len() };
    let close = format!("){}\"", &rest[..open]);
    match rest[open..].find(&close) {
        Some(at) => quote + 1 + open + at + close.len(),
        None => src.len(),
    }
}

/// The value of a (non-raw, unprefixed) string literal token's text, escapes resolved.
pub fn string_value(lit: &str) -> String {
    let inner = lit.strip_prefix('"').and_then(|s| s.strip_suffix('"')).unwrap_or(lit);
    let mut out = String::new();
    let mut chars = inner.chars();
    while let Some(c) = chars.next() {
        if c != '\\' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('n') => out.push('\n'),
            Some('t') => out.push('\t'),
            Some('r') => out.push('\r'),
            Some('0') => out.push('\0'),
            Some(other) => out.push(other),
            None => {}
        }
    }
    out
}

/// 1-based (line, column) of byte offset `at`.
pub fn line_col(src: &str, at: usize) -> (usize, usize) {
    let before = &src[..at.min(src.len())];
    let line = before.bytes().filter(|&c| c == b'\n').count() + 1;
    let col = at - before.rfind('\n').map(|p| p + 1).unwrap_or(0) + 1;
    (line, col)
}

/// The index of the token closing the bracket opened at `open` (a `(`, `[` or
/// `{`), counting only brackets of the same kind.
pub fn matching(toks: &[Token], open: usize) -> Option<usize> {
    let (o, c) = match toks[open].kind {
        Kind::Punct(b'(') => (b'(', b')'),
        Kind::Punct(b'[') => (b'[', b']'),
        Kind::Punct(b'{') => (b'{', b'}'),
        _ => return None,
    };
    let mut depth = 0usize;
    for (k, t) in toks.iter().enumerate().skip(open) {
        if t.is_punct(o) {
            depth += 1;
        } else if t.is_punct(c) {
            depth -= 1;
            if depth == 0 {
                return Some(k);
            }
        }
    }
    None
}

/// Splits toks at top-level `sep` (outside (), [], {} and, when `angles`, <>).
pub fn split_top(toks: &[Token], sep: u8, angles: bool) -> Vec<&[Token]> {
    let mut parts = vec![];
    let mut depth = 0i32;
    let mut from = 0;
    for (k, t) in toks.iter().enumerate() {
        match t.kind {
            Kind::Punct(b'(' | b'[' | b'{') => depth += 1,
            Kind::Punct(b')' | b']' | b'}') => depth -= 1,
            Kind::Punct(b'<') if angles => depth += 1,
            Kind::Punct(b'>') if angles => depth -= 1,
            Kind::Punct(c) if c == sep && depth == 0 => {
                parts.push(&toks[from..k]);
                from = k + 1;
            }
            _ => {}
        }
    }
    parts.push(&toks[from..]);
    parts
}
