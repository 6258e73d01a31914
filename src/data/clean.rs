//! Quality filters (`prepare --clean`): Gopher's quality and repetition
//! rules and C4's line rules, with datatrove's published defaults.
//!
//! Owns the decision, for one document at a time, to keep it (perhaps with
//! lines removed, as C4 does) or drop it, and the name of the first rule that
//! dropped it. Pure: a document's fate depends on its text and the settings
//! alone, never on other documents or on which thread looks at it.
//!
//! Words are an approximation of NLTK's Treebank tokenizer, which datatrove
//! uses for English: whitespace-separated pieces, with leading and trailing
//! runs of punctuation split off as words of their own ("dog." is "dog" and
//! "."). Character counts are in Unicode scalar values, as Python's `len`.
//! Repeated n-grams are recognised by a 64-bit hash of their words
//! (`data::hash`).

use std::collections::{BTreeSet, HashMap, HashSet};

use super::hash::{hash_bytes, hash_seq};

/// Every filter by the name a `[clean]` table's `off` list and the
/// manifest's counts use, in the order they run.
pub const FILTERS: [&str; 24] = [
    "dup_para_frac",
    "dup_para_char_frac",
    "dup_line_frac",
    "dup_line_char_frac",
    "top_2_gram",
    "top_3_gram",
    "top_4_gram",
    "dup_5_grams",
    "dup_6_grams",
    "dup_7_grams",
    "dup_8_grams",
    "dup_9_grams",
    "dup_10_grams",
    "min_words",
    "max_words",
    "mean_word_length",
    "symbol_ratio",
    "bullet_lines",
    "ellipsis_lines",
    "alpha_words",
    "stop_words",
    "c4_lorem_ipsum",
    "c4_curly_bracket",
    "c4_min_sentences",
];

/// The `[clean]` table of a prepare config. Every threshold is datatrove's
/// default; a filter named in `off` is skipped.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CleanSettings {
    /// Filters (by name, see [`FILTERS`], plus the C4 line rules
    /// "c4_terminal_punct", "c4_min_words_per_line", "c4_javascript",
    /// "c4_policy", "c4_citations", "c4_max_word_length") not to apply.
    pub off: Vec<String>,
    // Gopher repetition.
    pub max_dup_para_frac: f64,
    pub max_dup_para_char_frac: f64,
    pub max_dup_line_frac: f64,
    pub max_dup_line_char_frac: f64,
    /// (n, the most frequent n-gram's largest share of characters), n = 2, 3, 4.
    pub top_ngram_char_frac: [f64; 3],
    /// (n, the largest share of characters in repeated n-grams), n = 5..=10.
    pub dup_ngram_char_frac: [f64; 6],
    // Gopher quality.
    pub min_words: usize,
    pub max_words: usize,
    pub min_mean_word_length: f64,
    pub max_mean_word_length: f64,
    /// "#" and ellipses per word.
    pub max_symbol_word_ratio: f64,
    pub max_bullet_lines_frac: f64,
    pub max_ellipsis_lines_frac: f64,
    /// Share of words holding at least one letter.
    pub min_alpha_words_frac: f64,
    pub min_stop_words: usize,
    pub stop_words: Vec<String>,
    // C4.
    pub c4_min_words_per_line: usize,
    pub c4_max_word_length: usize,
    pub c4_min_sentences: usize,
}

impl Default for CleanSettings {
    fn default() -> Self {
        CleanSettings {
            off: Vec::new(),
            max_dup_para_frac: 0.3,
            max_dup_para_char_frac: 0.2,
            max_dup_line_frac: 0.3,
            max_dup_line_char_frac: 0.2,
            top_ngram_char_frac: [0.20, 0.18, 0.16],
            dup_ngram_char_frac: [0.15, 0.14, 0.13, 0.12, 0.11, 0.10],
            min_words: 50,
            max_words: 100_000,
            min_mean_word_length: 3.0,
            max_mean_word_length: 10.0,
            max_symbol_word_ratio: 0.1,
            max_bullet_lines_frac: 0.9,
            max_ellipsis_lines_frac: 0.3,
            min_alpha_words_frac: 0.8,
            min_stop_words: 2,
            stop_words: ["the", "be", "to", "of", "and", "that", "have", "with"].map(String::from).to_vec(),
            c4_min_words_per_line: 3,
            c4_max_word_length: 1000,
            c4_min_sentences: 5,
        }
    }
}

/// The C4 line rules' names (they remove lines, not documents).
pub const C4_LINE_RULES: [&str; 6] = [
    "c4_terminal_punct",
    "c4_min_words_per_line",
    "c4_max_word_length",
    "c4_javascript",
    "c4_policy",
    "c4_citations",
];

impl CleanSettings {
    /// Every problem with the settings, each naming its key.
    pub fn problems(&self) -> Vec<String> {
        let mut out = Vec::new();
        for name in &self.off {
            if !FILTERS.contains(&name.as_str()) && !C4_LINE_RULES.contains(&name.as_str()) {
                out.push(format!(
                    "clean.off: {name:?}: no such filter (expected one of {}, {})",
                    FILTERS.join(", "),
                    C4_LINE_RULES.join(", ")
                ));
            }
        }
        let fracs = [
            ("clean.max_dup_para_frac", self.max_dup_para_frac),
            ("clean.max_dup_para_char_frac", self.max_dup_para_char_frac),
            ("clean.max_dup_line_frac", self.max_dup_line_frac),
            ("clean.max_dup_line_char_frac", self.max_dup_line_char_frac),
            ("clean.max_bullet_lines_frac", self.max_bullet_lines_frac),
            ("clean.max_ellipsis_lines_frac", self.max_ellipsis_lines_frac),
            ("clean.min_alpha_words_frac", self.min_alpha_words_frac),
        ];
        let ngram = self.top_ngram_char_frac.iter().chain(&self.dup_ngram_char_frac);
        for (key, v) in fracs.into_iter().chain(ngram.map(|&v| ("clean.*_ngram_char_frac", v))) {
            if !(0.0..=1.0).contains(&v) {
                out.push(format!("{key}: {v}: expected a fraction in [0, 1]"));
            }
        }
        if self.min_words > self.max_words {
            out.push(format!(
                "clean.min_words: {}: expected at most clean.max_words ({})",
                self.min_words, self.max_words
            ));
        }
        if self.min_mean_word_length.is_nan()
            || self.max_mean_word_length.is_nan()
            || self.min_mean_word_length > self.max_mean_word_length
        {
            out.push(format!(
                "clean.min_mean_word_length: {}: expected at most clean.max_mean_word_length ({})",
                self.min_mean_word_length, self.max_mean_word_length
            ));
        }
        if self.max_symbol_word_ratio.is_nan() || self.max_symbol_word_ratio < 0.0 {
            out.push(format!("clean.max_symbol_word_ratio: {}: expected >= 0", self.max_symbol_word_ratio));
        }
        out
    }

    fn on(&self, name: &str) -> bool {
        !self.off.iter().any(|o| o == name)
    }
}

/// What the filters made of a document.
#[derive(Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Kept as it is.
    Keep,
    /// Kept with lines removed (C4's line rules).
    Trimmed(String),
    /// Removed by the named filter (the first that refused it).
    Drop(&'static str),
}

/// The filters, ready to run.
pub struct Cleaner {
    s: CleanSettings,
    stop: HashSet<String>,
    /// C4 line rules in force (any).
    c4_lines: bool,
}

impl Cleaner {
    pub fn new(s: CleanSettings) -> Cleaner {
        let stop = s.stop_words.iter().cloned().collect();
        let c4_lines = C4_LINE_RULES.iter().any(|r| s.on(r));
        Cleaner { s, stop, c4_lines }
    }

    pub fn settings(&self) -> &CleanSettings {
        &self.s
    }

    /// Runs the filters in [`FILTERS`]' order: repetition, quality, C4.
    pub fn check(&self, text: &str) -> Verdict {
        if let Some(name) = self.repetition(text).or_else(|| self.quality(text)) {
            return Verdict::Drop(name);
        }
        self.c4(text)
    }

    fn over(&self, name: &'static str, value: f64, max: f64) -> Option<&'static str> {
        (self.s.on(name) && value > max).then_some(name)
    }

    /// Gopher's repetition rules (datatrove's GopherRepetitionFilter).
    fn repetition(&self, text: &str) -> Option<&'static str> {
        let chars = text.chars().count().max(1) as f64;
        let paragraphs: Vec<&str> = split_runs(text.trim(), '\n', 2);
        let (dup, dup_chars) = duplicates(&paragraphs);
        let n = paragraphs.len().max(1) as f64;
        self.over("dup_para_frac", dup as f64 / n, self.s.max_dup_para_frac)
            .or_else(|| {
                self.over("dup_para_char_frac", dup_chars as f64 / chars, self.s.max_dup_para_char_frac)
            })
            .or_else(|| {
                let lines = split_runs(text, '\n', 1);
                let (dup, dup_chars) = duplicates(&lines);
                let n = lines.len().max(1) as f64;
                self.over("dup_line_frac", dup as f64 / n, self.s.max_dup_line_frac).or_else(|| {
                    self.over("dup_line_char_frac", dup_chars as f64 / chars, self.s.max_dup_line_char_frac)
                })
            })
            .or_else(|| {
                let (hashes, lens) = word_keys(&words(text));
                const TOP: [&str; 3] = ["top_2_gram", "top_3_gram", "top_4_gram"];
                for (i, name) in TOP.into_iter().enumerate() {
                    let top = top_ngram_chars(&hashes, &lens, i + 2) as f64;
                    if let Some(f) = self.over(name, top / chars, self.s.top_ngram_char_frac[i]) {
                        return Some(f);
                    }
                }
                const DUP: [&str; 6] = [
                    "dup_5_grams",
                    "dup_6_grams",
                    "dup_7_grams",
                    "dup_8_grams",
                    "dup_9_grams",
                    "dup_10_grams",
                ];
                for (i, name) in DUP.into_iter().enumerate() {
                    if !self.s.on(name) {
                        continue;
                    }
                    let rep = repeated_ngram_chars(&hashes, &lens, i + 5) as f64;
                    if let Some(f) = self.over(name, rep / chars, self.s.dup_ngram_char_frac[i]) {
                        return Some(f);
                    }
                }
                None
            })
    }

    /// Gopher's quality rules (datatrove's GopherQualityFilter).
    fn quality(&self, text: &str) -> Option<&'static str> {
        let s = &self.s;
        let words = words(text);
        let n_words = words.len().max(1) as f64;
        let content: Vec<&str> = words.iter().copied().filter(|w| w.chars().any(|c| !is_punct(c))).collect();
        if s.on("min_words") && content.len() < s.min_words {
            return Some("min_words");
        }
        if s.on("max_words") && content.len() > s.max_words {
            return Some("max_words");
        }
        if s.on("mean_word_length") && !content.is_empty() {
            let mean = content.iter().map(|w| w.chars().count()).sum::<usize>() as f64 / content.len() as f64;
            if mean < s.min_mean_word_length || mean > s.max_mean_word_length {
                return Some("mean_word_length");
            }
        }
        if s.on("symbol_ratio") {
            let hashes = text.matches('#').count() as f64;
            let ellipses = (text.matches("...").count() + text.matches('…').count()) as f64;
            if hashes / n_words > s.max_symbol_word_ratio || ellipses / n_words > s.max_symbol_word_ratio {
                return Some("symbol_ratio");
            }
        }
        let lines: Vec<&str> = text.lines().collect();
        let n_lines = lines.len().max(1) as f64;
        let bullets = lines
            .iter()
            .filter(|l| {
                let l = l.trim_start();
                l.starts_with('•') || l.starts_with('-')
            })
            .count();
        if let Some(f) = self.over("bullet_lines", bullets as f64 / n_lines, s.max_bullet_lines_frac) {
            return Some(f);
        }
        let ellipsis = lines
            .iter()
            .filter(|l| {
                let l = l.trim_end();
                l.ends_with("...") || l.ends_with('…')
            })
            .count();
        if let Some(f) = self.over("ellipsis_lines", ellipsis as f64 / n_lines, s.max_ellipsis_lines_frac) {
            return Some(f);
        }
        let alpha = words.iter().filter(|w| w.chars().any(char::is_alphabetic)).count();
        if s.on("alpha_words") && (alpha as f64 / n_words) < s.min_alpha_words_frac {
            return Some("alpha_words");
        }
        if s.on("stop_words") && words.iter().filter(|w| self.stop.contains(**w)).count() < s.min_stop_words {
            return Some("stop_words");
        }
        None
    }

    /// C4's rules (datatrove's C4QualityFilter): lines without terminal
    /// punctuation, of too few words, with an overlong word, mentioning
    /// javascript or a policy go; citation marks are cut; lorem ipsum or a
    /// curly bracket drops the document, and so do too few sentences left.
    fn c4(&self, text: &str) -> Verdict {
        let s = &self.s;
        if !self.c4_lines && !s.on("c4_lorem_ipsum") && !s.on("c4_curly_bracket") && !s.on("c4_min_sentences")
        {
            return Verdict::Keep;
        }
        let mut kept: Vec<String> = Vec::new();
        let mut changed = false;
        for line in text.lines() {
            let mut line = line.trim().to_string();
            if s.on("c4_citations") {
                let cut = strip_citations(&line);
                changed |= cut.len() != line.len();
                line = cut;
            }
            let lower = line.to_lowercase();
            if s.on("c4_lorem_ipsum") && lower.contains("lorem ipsum") {
                return Verdict::Drop("c4_lorem_ipsum");
            }
            if s.on("c4_curly_bracket") && line.contains('{') {
                return Verdict::Drop("c4_curly_bracket");
            }
            let n_words = line.split_whitespace().count();
            let drop = (s.on("c4_max_word_length")
                && line.split_whitespace().any(|w| w.chars().count() > s.c4_max_word_length))
                || (s.on("c4_terminal_punct") && !line.ends_with(['.', '?', '!', '"', '\'']))
                || (s.on("c4_min_words_per_line") && n_words < s.c4_min_words_per_line)
                || (s.on("c4_javascript") && lower.contains("javascript"))
                || (s.on("c4_policy") && POLICY.iter().any(|p| lower.contains(p)));
            if drop {
                changed = true;
            } else {
                kept.push(line);
            }
        }
        let joined = kept.join("\n");
        if s.on("c4_min_sentences") && sentences(&joined) < s.c4_min_sentences {
            return Verdict::Drop("c4_min_sentences");
        }
        if changed || joined != text {
            if joined.trim().is_empty() {
                return Verdict::Drop("c4_min_sentences");
            }
            return if joined == text { Verdict::Keep } else { Verdict::Trimmed(joined) };
        }
        Verdict::Keep
    }
}

/// C4's policy phrases (a line holding one is boilerplate).
const POLICY: [&str; 6] =
    ["terms of use", "privacy policy", "cookie policy", "uses cookies", "use of cookies", "use cookies"];

/// Unicode punctuation as datatrove's PUNCTUATION_SET has it, for the
/// characters text holds in practice: ASCII punctuation and the common
/// typographic marks.
fn is_punct(c: char) -> bool {
    c.is_ascii_punctuation()
        || matches!(
            c,
            '…' | '—'
                | '–'
                | '‘'
                | '’'
                | '“'
                | '”'
                | '«'
                | '»'
                | '¿'
                | '¡'
                | '·'
                | '•'
                | '。'
                | '、'
                | '，'
                | '！'
                | '？'
                | '：'
                | '；'
                | '（'
                | '）'
                | '「'
                | '」'
        )
}

/// Whitespace-separated pieces with leading and trailing punctuation runs
/// split off as words of their own.
pub fn words(text: &str) -> Vec<&str> {
    let mut out = Vec::new();
    for piece in text.split_whitespace() {
        let start = piece.find(|c: char| !is_punct(c)).unwrap_or(piece.len());
        if start == piece.len() {
            out.push(piece);
            continue;
        }
        let end = piece
            .rfind(|c: char| !is_punct(c))
            .map(|i| i + piece[i..].chars().next().map_or(1, char::len_utf8));
        let end = end.unwrap_or(piece.len());
        if start > 0 {
            out.push(&piece[..start]);
        }
        out.push(&piece[start..end]);
        if end < piece.len() {
            out.push(&piece[end..]);
        }
    }
    out
}

/// `text` split at runs of at least `min` `sep` characters (Python's
/// `re.split(r"\n{2,}")` for paragraphs, `\n+` for lines).
fn split_runs(text: &str, sep: char, min: usize) -> Vec<&str> {
    let mut out = Vec::new();
    let (mut start, mut run_start, mut run) = (0, 0, 0);
    for (i, c) in text.char_indices() {
        if c == sep {
            if run == 0 {
                run_start = i;
            }
            run += 1;
        } else {
            if run >= min {
                out.push(&text[start..run_start]);
                start = i;
            }
            run = 0;
        }
    }
    if run >= min {
        out.push(&text[start..run_start]);
        out.push("");
    } else {
        out.push(&text[start..]);
    }
    out
}

/// (elements equal to an earlier one, their characters).
fn duplicates(items: &[&str]) -> (usize, usize) {
    let mut seen = HashSet::with_capacity(items.len());
    let (mut n, mut chars) = (0, 0);
    for it in items {
        if !seen.insert(*it) {
            n += 1;
            chars += it.chars().count();
        }
    }
    (n, chars)
}

/// Each word's hash and length in characters.
fn word_keys(words: &[&str]) -> (Vec<u64>, Vec<usize>) {
    (
        words.iter().map(|w| hash_bytes(w.as_bytes())).collect(),
        words.iter().map(|w| w.chars().count()).collect(),
    )
}

/// Characters of the most frequent n-gram (joined by spaces) times its count.
fn top_ngram_chars(hashes: &[u64], lens: &[usize], n: usize) -> usize {
    if hashes.len() < n {
        return 0;
    }
    let mut counts: HashMap<u64, (usize, usize)> = HashMap::new();
    for (i, g) in hashes.windows(n).enumerate() {
        let len = lens[i..i + n].iter().sum::<usize>() + n - 1;
        counts.entry(hash_seq(g)).or_insert((0, len)).0 += 1;
    }
    // The most common; among equal counts datatrove's Counter keeps the
    // first seen, whose length may differ: take the longest so the value
    // does not depend on the map's order.
    let best = counts.values().map(|&(c, _)| c).max().unwrap_or(0);
    counts.values().filter(|&&(c, _)| c == best).map(|&(c, len)| c * len).max().unwrap_or(0)
}

/// Characters in n-grams (joined without spaces) that repeat an earlier
/// one, skipping past each repeat (datatrove's find_all_duplicate).
fn repeated_ngram_chars(hashes: &[u64], lens: &[usize], n: usize) -> usize {
    let mut seen = HashSet::new();
    let (mut rep, mut i) = (0, 0);
    while i + n <= hashes.len() {
        if seen.insert(hash_seq(&hashes[i..i + n])) {
            i += 1;
        } else {
            rep += lens[i..i + n].iter().sum::<usize>();
            i += n;
        }
    }
    rep
}

/// `[1]`, `[edit]`, `[citation needed]` removed (C4's citation rule).
fn strip_citations(line: &str) -> String {
    let mut out = String::with_capacity(line.len());
    let mut rest = line;
    while let Some(open) = rest.find('[') {
        out.push_str(&rest[..open]);
        let tail = &rest[open..];
        let close = tail.find(']');
        let inner = close.map(|c| &tail[1..c]);
        let cite = inner
            .is_some_and(|s| s.chars().all(|c| c.is_ascii_digit()) || s == "edit" || s == "citation needed");
        match (cite, close) {
            (true, Some(c)) => rest = &tail[c + 1..],
            _ => {
                out.push('[');
                rest = &tail[1..];
            }
        }
    }
    out.push_str(rest);
    out
}

/// Sentences, counted by their ends (".", "!", "?" followed by space or the end).
fn sentences(text: &str) -> usize {
    let b = text.as_bytes();
    let mut n = 0;
    for (i, &c) in b.iter().enumerate() {
        if matches!(c, b'.' | b'!' | b'?') && b.get(i + 1).is_none_or(|n| n.is_ascii_whitespace()) {
            // "..." counts once.
            if i > 0 && matches!(b[i - 1], b'.' | b'!' | b'?') {
                continue;
            }
            n += 1;
        }
    }
    n
}

/// Counts of removals per filter, in [`FILTERS`]' order when printed.
pub fn ordered_counts(counts: &std::collections::BTreeMap<String, u64>) -> Vec<(String, u64)> {
    let known: BTreeSet<&str> = FILTERS.iter().copied().collect();
    let mut out: Vec<(String, u64)> =
        FILTERS.iter().filter_map(|f| counts.get(*f).map(|&c| (f.to_string(), c))).collect();
    out.extend(counts.iter().filter(|(k, _)| !known.contains(k.as_str())).map(|(k, &c)| (k.clone(), c)));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A paragraph of ordinary prose: passes every filter (checked by hand:
    /// 68 content words of mean length between 3 and 10, stop words "the", "of", "and",
    /// "to", five sentences).
    const GOOD: &str = "The history of the valley is told in the stones of its old walls. Farmers \
        came to the river and built their homes with the rocks they found. Over many years the \
        village grew, and the people learned to trade wool and grain with the towns beyond the \
        hills. Today the walls still stand, and visitors walk along them to see the fields. It is \
        a quiet place.";

    fn only(off_all_but: &[&str]) -> Cleaner {
        let off = FILTERS
            .iter()
            .chain(&C4_LINE_RULES)
            .filter(|f| !off_all_but.contains(f))
            .map(|f| f.to_string())
            .collect();
        Cleaner::new(CleanSettings { off, ..Default::default() })
    }

    #[test]
    fn ordinary_prose_passes_every_filter() {
        assert_eq!(Cleaner::new(CleanSettings::default()).check(GOOD), Verdict::Keep);
        assert_eq!(words(GOOD).iter().filter(|w| w.chars().any(char::is_alphanumeric)).count(), 68);
    }

    #[test]
    fn words_split_off_leading_and_trailing_punctuation() {
        assert_eq!(
            words("(Hello), world... it's 3.5!"),
            ["(", "Hello", "),", "world", "...", "it's", "3.5", "!"]
        );
        assert_eq!(words("— ..."), ["—", "..."]);
    }

    #[test]
    fn too_few_and_too_many_words_are_removed_by_word_count() {
        let c = only(&["min_words", "max_words"]);
        assert_eq!(c.check("Just a few words here."), Verdict::Drop("min_words"));
        let mut s = only(&["max_words"]).s;
        s.max_words = 60;
        assert_eq!(Cleaner::new(s).check(GOOD), Verdict::Drop("max_words"));
    }

    #[test]
    fn mean_word_length_symbols_alpha_and_stop_words_each_remove_their_document() {
        let long = "Incomprehensibilities notwithstanding, characteristically ".repeat(20);
        assert_eq!(only(&["mean_word_length"]).check(&long), Verdict::Drop("mean_word_length"));
        let short = "a b c d e f g h ".repeat(10);
        assert_eq!(only(&["mean_word_length"]).check(&short), Verdict::Drop("mean_word_length"));
        // 12 hashes over 99 words (68 of GOOD, its 7 marks, 12 "#" and 12 tags): 0.121 > 0.1.
        let tags = format!("{GOOD} {}", "#tag ".repeat(12));
        assert_eq!(words(&tags).len(), 99);
        assert_eq!(only(&["symbol_ratio"]).check(&tags), Verdict::Drop("symbol_ratio"));
        let numbers = "12 34 56 78 90 the cat ".repeat(10);
        assert_eq!(only(&["alpha_words"]).check(&numbers), Verdict::Drop("alpha_words"));
        let no_stop = "Cats sleep. Dogs bark loudly. Birds sing songs.";
        assert_eq!(only(&["stop_words"]).check(no_stop), Verdict::Drop("stop_words"));
        assert_eq!(only(&["stop_words"]).check("The cat and the dog."), Verdict::Keep);
    }

    #[test]
    fn bullet_and_ellipsis_lines_over_their_share_remove_the_document() {
        let bullets =
            "- one item\n- two items\n• three\n- four\n- five\n- six\n- seven\n- eight\n- nine\n- ten";
        assert_eq!(only(&["bullet_lines"]).check(bullets), Verdict::Drop("bullet_lines"));
        // 9 of 10 lines: 0.9 is not over 0.9.
        let nine = format!("{}\nplain line", &bullets[..bullets.rfind('\n').unwrap()]);
        assert_eq!(only(&["bullet_lines"]).check(&nine), Verdict::Keep);
        let ell = "and then...\nwe went\nso it was…\nfine";
        assert_eq!(only(&["ellipsis_lines"]).check(ell), Verdict::Drop("ellipsis_lines"));
    }

    #[test]
    fn duplicate_lines_and_paragraphs_are_counted_as_gopher_counts_them() {
        // Paragraphs a, b, a, a: 2 of 4 repeat (0.5 > 0.3).
        let paras = "alpha beta\n\ngamma delta\n\nalpha beta\n\nalpha beta";
        assert_eq!(only(&["dup_para_frac"]).check(paras), Verdict::Drop("dup_para_frac"));
        assert_eq!(split_runs(paras, '\n', 2).len(), 4);
        // Lines: 1 of 4 repeats (0.25 ≤ 0.3) but it holds 20 of 62 characters (0.32 > 0.2).
        let lines = "a short line\nthe repeated line is long\nanother\nthe repeated line is long";
        assert_eq!(only(&["dup_line_frac"]).check(lines), Verdict::Keep);
        assert_eq!(only(&["dup_line_char_frac"]).check(lines), Verdict::Drop("dup_line_char_frac"));
    }

    #[test]
    fn top_and_repeated_ngrams_are_measured_in_characters() {
        let (h, l) = word_keys(&words("the cat the cat the cat sat"));
        // "the cat": 3 times × 7 characters.
        assert_eq!(top_ngram_chars(&h, &l, 2), 21);
        let (h, l) = word_keys(&words("a b c d e a b c d e x"));
        // "abcde" repeats once at index 5: 5 characters.
        assert_eq!(repeated_ngram_chars(&h, &l, 5), 5);
        let spam = format!("{GOOD} buy cheap pills now buy cheap pills now buy cheap pills now");
        assert_eq!(only(&["top_4_gram"]).check(&spam), Verdict::Keep);
        assert_eq!(only(&["top_2_gram"]).check(&"buy now ".repeat(30)), Verdict::Drop("top_2_gram"));
        assert_eq!(only(&["dup_5_grams"]).check(&format!("{GOOD} {GOOD}")), Verdict::Drop("dup_5_grams"));
    }

    #[test]
    fn c4_drops_lines_without_end_punctuation_and_documents_with_code_or_lorem_ipsum() {
        let c = only(
            &C4_LINE_RULES
                .iter()
                .chain(&["c4_lorem_ipsum", "c4_curly_bracket", "c4_min_sentences"])
                .copied()
                .collect::<Vec<_>>(),
        );
        let text = "Home | About | Contact\nThe first sentence is here. The second one too.\n\
                    Please enable JavaScript to view the page.\nA third sentence ends well. Fourth one! Fifth?\n\
                    Read our privacy policy.\nSee the note[1] and more[citation needed].";
        let want = "The first sentence is here. The second one too.\nA third sentence ends well. Fourth one! Fifth?\n\
                    See the note and more.";
        assert_eq!(c.check(text), Verdict::Trimmed(want.into()));
        assert_eq!(
            c.check(&format!("{text}\nfunction f() {{ return 1; }}")),
            Verdict::Drop("c4_curly_bracket")
        );
        assert_eq!(c.check(&format!("Lorem ipsum dolor sit amet.\n{text}")), Verdict::Drop("c4_lorem_ipsum"));
        assert_eq!(c.check("One sentence only. Two."), Verdict::Drop("c4_min_sentences"));
    }

    #[test]
    fn the_first_filter_that_refuses_a_document_is_the_one_named() {
        // Both too short and without stop words: min_words runs first.
        let c = only(&["min_words", "stop_words"]);
        assert_eq!(c.check("Cats sleep."), Verdict::Drop("min_words"));
        // With every filter on, a two-word text is all one 2-gram: datatrove
        // counts the most common n-gram even when it appears once, and the
        // repetition rules run before the quality rules.
        assert_eq!(Cleaner::new(CleanSettings::default()).check("Cats sleep."), Verdict::Drop("top_2_gram"));
    }

    #[test]
    fn unknown_filter_names_and_bad_thresholds_are_named() {
        let s = CleanSettings {
            off: vec!["gopher".into()],
            max_dup_line_frac: 1.5,
            min_words: 200_000,
            ..Default::default()
        };
        let p = s.problems().join("\n");
        assert!(p.contains("clean.off: \"gopher\": no such filter"), "{p}");
        assert!(p.contains("clean.max_dup_line_frac: 1.5"), "{p}");
        assert!(p.contains("clean.min_words: 200000"), "{p}");
    }
}
