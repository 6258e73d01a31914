//! Loss curves as a self-contained SVG, written next to a run's results.
//! Owns the drawing only: it never reads metrics files or writes anything, and
//! the SVG it makes never refers to anything outside itself (no scripts, no
//! fonts, no images), so it opens anywhere, offline.

use std::fmt::Write as _;

const WIDTH: f64 = 900.0;
const HEIGHT: f64 = 600.0;
const LEFT: f64 = 80.0;
const RIGHT: f64 = 30.0;
const TOP: f64 = 50.0;
const BOTTOM: f64 = 65.0;
const TRAIN_COLOR: &str = "#1f77b4";
const VAL_COLOR: &str = "#d62728";

/// Draws training loss (a thin line) and validation loss (markers on a line)
/// against step. Non-finite losses are left out, and the line breaks there,
/// so a divergence shows as a gap rather than as a fake straight segment.
pub fn loss_svg(train: &[(usize, f64)], val: &[(usize, f64)], title: &str) -> String {
    let finite = || train.iter().chain(val).filter(|(_, y)| y.is_finite());
    let x_range = bounds(finite().map(|&(x, _)| x as f64));
    let y_range = bounds(finite().map(|&(_, y)| y));
    // Steps are integers: a tick every half step would be a lie.
    let x_axis = Axis::new(x_range, 1.0);
    // Headroom so the highest and lowest losses do not sit on the frame.
    let y_axis = Axis::new(y_range.map(|(lo, hi)| (lo - (hi - lo) * 0.04, hi + (hi - lo) * 0.04)), 0.0);
    let plot = Frame { x0: LEFT, x1: WIDTH - RIGHT, y0: TOP, y1: HEIGHT - BOTTOM };
    let sx = |x: f64| plot.x0 + (x - x_axis.lo) / (x_axis.hi - x_axis.lo) * (plot.x1 - plot.x0);
    let sy = |y: f64| plot.y1 - (y - y_axis.lo) / (y_axis.hi - y_axis.lo) * (plot.y1 - plot.y0);

    let mut svg = String::new();
    let w = &mut svg;
    // Writing to a String cannot fail; the results are ignored throughout.
    let _ = writeln!(
        w,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" viewBox="0 0 {WIDTH} {HEIGHT}" font-family="sans-serif" font-size="13">"#
    );
    let _ = writeln!(w, r#"<rect width="100%" height="100%" fill="white"/>"#);
    let _ = writeln!(
        w,
        r#"<text class="title" x="{}" y="30" text-anchor="middle" font-size="17">{}</text>"#,
        WIDTH / 2.0,
        escape(title)
    );

    // Grid and tick labels first, so the data is drawn over them.
    for t in x_axis.ticks() {
        let x = sx(t);
        let _ = writeln!(
            w,
            r##"<line x1="{x:.1}" y1="{:.1}" x2="{x:.1}" y2="{:.1}" stroke="#e6e6e6"/>"##,
            plot.y0, plot.y1
        );
        let _ = writeln!(
            w,
            r#"<text x="{x:.1}" y="{:.1}" text-anchor="middle">{}</text>"#,
            plot.y1 + 20.0,
            x_axis.label(t)
        );
    }
    for t in y_axis.ticks() {
        let y = sy(t);
        let _ = writeln!(
            w,
            r##"<line x1="{:.1}" y1="{y:.1}" x2="{:.1}" y2="{y:.1}" stroke="#e6e6e6"/>"##,
            plot.x0, plot.x1
        );
        let _ = writeln!(
            w,
            r#"<text x="{:.1}" y="{:.1}" text-anchor="end">{}</text>"#,
            plot.x0 - 8.0,
            y + 4.5,
            y_axis.label(t)
        );
    }
    let _ = writeln!(
        w,
        r##"<rect x="{:.1}" y="{:.1}" width="{:.1}" height="{:.1}" fill="none" stroke="#333"/>"##,
        plot.x0,
        plot.y0,
        plot.x1 - plot.x0,
        plot.y1 - plot.y0
    );
    let _ = writeln!(
        w,
        r#"<text class="axis-title" x="{:.1}" y="{:.1}" text-anchor="middle">step</text>"#,
        (plot.x0 + plot.x1) / 2.0,
        HEIGHT - 18.0
    );
    let (cx, cy) = (22.0, (plot.y0 + plot.y1) / 2.0);
    let _ = writeln!(
        w,
        r#"<text class="axis-title" x="{cx}" y="{cy:.1}" text-anchor="middle" transform="rotate(-90 {cx} {cy:.1})">loss</text>"#
    );

    let (train_path, lone) = polyline(train, &sx, &sy);
    let _ = writeln!(
        w,
        r#"<path class="train" d="{train_path}" fill="none" stroke="{TRAIN_COLOR}" stroke-width="1.2" stroke-linejoin="round"/>"#
    );
    // A thin line through one point draws nothing: give such points a dot.
    if !lone.is_empty() {
        let _ = writeln!(w, r#"<g class="train-dots" fill="{TRAIN_COLOR}">"#);
        for (x, y) in lone {
            let _ = writeln!(w, r#"<circle cx="{x:.1}" cy="{y:.1}" r="2"/>"#);
        }
        let _ = writeln!(w, "</g>");
    }
    if !val.is_empty() {
        let (val_path, _) = polyline(val, &sx, &sy);
        let _ = writeln!(
            w,
            r#"<path class="val" d="{val_path}" fill="none" stroke="{VAL_COLOR}" stroke-width="2" stroke-linejoin="round" stroke-linecap="round"/>"#
        );
        let _ = writeln!(w, r#"<g class="val-markers" fill="{VAL_COLOR}">"#);
        for &(x, y) in val.iter().filter(|(_, y)| y.is_finite()) {
            let _ = writeln!(w, r#"<circle cx="{:.1}" cy="{:.1}" r="3.5"/>"#, sx(x as f64), sy(y));
        }
        let _ = writeln!(w, "</g>");
    }
    if finite().next().is_none() {
        let _ = writeln!(
            w,
            r##"<text x="{:.1}" y="{:.1}" text-anchor="middle" fill="#888">no finite loss values</text>"##,
            (plot.x0 + plot.x1) / 2.0,
            (plot.y0 + plot.y1) / 2.0
        );
    }

    legend(w, &plot, !val.is_empty());
    let _ = writeln!(w, "</svg>");
    svg
}

struct Frame {
    x0: f64,
    x1: f64,
    y0: f64,
    y1: f64,
}

fn legend(w: &mut String, plot: &Frame, with_val: bool) {
    let rows = if with_val { 2.0 } else { 1.0 };
    let (x, y) = (plot.x1 - 120.0, plot.y0 + 10.0);
    let _ = writeln!(
        w,
        r##"<g class="legend"><rect x="{x:.1}" y="{y:.1}" width="110" height="{:.1}" fill="white" fill-opacity="0.85" stroke="#bbb"/>"##,
        8.0 + 20.0 * rows
    );
    let ty = y + 18.0;
    let _ = writeln!(
        w,
        r#"<line x1="{:.1}" y1="{:.1}" x2="{:.1}" y2="{:.1}" stroke="{TRAIN_COLOR}" stroke-width="1.2"/><text x="{:.1}" y="{:.1}">train</text>"#,
        x + 10.0,
        ty - 4.5,
        x + 40.0,
        ty - 4.5,
        x + 48.0,
        ty
    );
    if with_val {
        let ty = ty + 20.0;
        let _ = writeln!(
            w,
            r#"<line x1="{:.1}" y1="{:.1}" x2="{:.1}" y2="{:.1}" stroke="{VAL_COLOR}" stroke-width="2"/><circle cx="{:.1}" cy="{:.1}" r="3.5" fill="{VAL_COLOR}"/><text x="{:.1}" y="{:.1}">val</text>"#,
            x + 10.0,
            ty - 4.5,
            x + 40.0,
            ty - 4.5,
            x + 25.0,
            ty - 4.5,
            x + 48.0,
            ty
        );
    }
    let _ = writeln!(w, "</g>");
}

/// Path data through the finite points in step order, starting a new subpath
/// after every non-finite one; also the points left alone between gaps, which
/// a line cannot show.
fn polyline(
    points: &[(usize, f64)],
    sx: &impl Fn(f64) -> f64,
    sy: &impl Fn(f64) -> f64,
) -> (String, Vec<(f64, f64)>) {
    let mut sorted = points.to_vec();
    sorted.sort_by_key(|&(x, _)| x);
    let mut d = String::new();
    let mut lone = Vec::new();
    let mut run: Vec<(f64, f64)> = Vec::new();
    let mut flush = |run: &mut Vec<(f64, f64)>| {
        if let [point] = run[..] {
            lone.push(point);
        } else {
            for (i, (x, y)) in run.iter().enumerate() {
                let _ = write!(d, "{}{x:.1},{y:.1} ", if i == 0 { "M" } else { "L" });
            }
        }
        run.clear();
    };
    for &(x, y) in &sorted {
        if y.is_finite() {
            run.push((sx(x as f64), sy(y)));
        } else {
            flush(&mut run);
        }
    }
    flush(&mut run);
    (d.trim_end().to_string(), lone)
}

/// (min, max) of the values, or None when there are none.
fn bounds(values: impl Iterator<Item = f64>) -> Option<(f64, f64)> {
    values.fold(None, |acc, v| match acc {
        None => Some((v, v)),
        Some((lo, hi)) => Some((lo.min(v), hi.max(v))),
    })
}

/// A linear axis whose ends and ticks are round numbers.
struct Axis {
    lo: f64,
    hi: f64,
    step: f64,
}

impl Axis {
    /// Fits nice bounds around `range`; `min_step` keeps integer axes integral.
    fn new(range: Option<(f64, f64)>, min_step: f64) -> Axis {
        let (mut lo, mut hi) = range.unwrap_or((0.0, 1.0));
        if hi - lo <= (hi.abs().max(lo.abs())) * 1e-9 {
            // A constant series still needs an axis with some height.
            let pad = if lo == 0.0 { 1.0 } else { lo.abs() * 0.1 };
            lo -= pad;
            hi += pad;
        }
        let step = nice(nice(hi - lo, false) / 5.0, true).max(min_step);
        Axis {
            // The slack keeps 1.8 / 0.1 = 17.999… from adding a tick below.
            lo: (lo / step + 1e-9).floor() * step,
            hi: (hi / step - 1e-9).ceil() * step,
            step,
        }
    }

    fn ticks(&self) -> impl Iterator<Item = f64> + '_ {
        let n = ((self.hi - self.lo) / self.step).round() as usize;
        (0..=n).map(move |i| self.lo + i as f64 * self.step)
    }

    /// As many decimals as the tick spacing needs, and no more.
    fn label(&self, v: f64) -> String {
        let decimals = (-self.step.log10().floor()).clamp(0.0, 12.0) as usize;
        let v = if v.abs() < self.step * 1e-6 { 0.0 } else { v };
        format!("{v:.decimals$}")
    }
}

/// Heckbert's "nice number": 1, 2, 5 or 10 times a power of ten, near `x`
/// (rounded to the nearest when `round`, else the next one up).
fn nice(x: f64, round: bool) -> f64 {
    let exp = x.log10().floor();
    let f = x / 10f64.powf(exp);
    let nf = if round {
        match f {
            f if f < 1.5 => 1.0,
            f if f < 3.0 => 2.0,
            f if f < 7.0 => 5.0,
            _ => 10.0,
        }
    } else {
        match f {
            f if f <= 1.0 => 1.0,
            f if f <= 2.0 => 2.0,
            f if f <= 5.0 => 5.0,
            _ => 10.0,
        }
    };
    nf * 10f64.powf(exp)
}

fn escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&apos;"),
            // XML 1.0 cannot carry most control characters at all.
            c if c.is_control() && !matches!(c, '\t' | '\n' | '\r') => {}
            c => out.push(c),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(svg: &str) -> roxmltree::Document<'_> {
        roxmltree::Document::parse(svg).unwrap_or_else(|e| panic!("not XML: {e}\n{svg}"))
    }

    fn path_d<'a>(doc: &'a roxmltree::Document, class: &str) -> Option<&'a str> {
        doc.descendants()
            .find(|n| n.has_tag_name("path") && n.attribute("class") == Some(class))
            .and_then(|n| n.attribute("d"))
    }

    fn texts(doc: &roxmltree::Document) -> Vec<String> {
        doc.descendants()
            .filter(|n| n.has_tag_name("text"))
            .filter_map(|n| n.text().map(str::to_string))
            .collect()
    }

    fn curve(n: usize) -> Vec<(usize, f64)> {
        (0..n).map(|s| (s, 4.0 * (-(s as f64) / 300.0).exp() + 2.5)).collect()
    }

    #[test]
    fn svg_is_xml_with_both_series() {
        let train = curve(1000);
        let val: Vec<_> = train.iter().copied().step_by(250).map(|(s, l)| (s, l + 0.1)).collect();
        let svg = loss_svg(&train, &val, "gpt2 <tiny> & \"friends\"");
        let doc = parse(&svg);
        assert_eq!(path_d(&doc, "train").unwrap().matches('L').count(), 999);
        assert_eq!(path_d(&doc, "val").unwrap().matches('L').count(), 3);
        assert_eq!(doc.descendants().filter(|n| n.has_tag_name("circle")).count(), 4 + 1);
        let texts = texts(&doc);
        for want in ["gpt2 <tiny> & \"friends\"", "step", "loss", "train", "val", "0", "1000"] {
            assert!(texts.iter().any(|t| t == want), "missing {want:?} in {texts:?}");
        }
    }

    #[test]
    fn svg_refers_to_nothing_outside_itself() {
        let svg = loss_svg(&curve(10), &curve(3), "t");
        for banned in ["<script", "href", "@import", "url(", "<image"] {
            assert!(!svg.contains(banned), "{banned}");
        }
    }

    #[test]
    fn empty_val_draws_train_only() {
        let doc_text = loss_svg(&curve(50), &[], "t");
        let doc = parse(&doc_text);
        assert!(path_d(&doc, "train").is_some());
        assert!(path_d(&doc, "val").is_none());
        assert!(!texts(&doc).iter().any(|t| t == "val"));
    }

    #[test]
    fn no_data_at_all_still_draws_axes() {
        let svg = loss_svg(&[], &[], "empty");
        let doc = parse(&svg);
        assert!(texts(&doc).iter().any(|t| t == "no finite loss values"));
    }

    #[test]
    fn single_point_is_drawn_as_a_dot() {
        let svg = loss_svg(&[(7, 3.25)], &[], "one");
        let doc = parse(&svg);
        let dots = doc
            .descendants()
            .find(|n| n.attribute("class") == Some("train-dots"))
            .expect("a dot for the lone point");
        assert_eq!(dots.children().filter(|n| n.has_tag_name("circle")).count(), 1);
        assert!(!svg.contains("NaN") && !svg.contains("inf"));
    }

    #[test]
    fn non_finite_values_are_skipped_and_break_the_line() {
        let train = [(0, 5.0), (1, 4.0), (2, f64::NAN), (3, f64::INFINITY), (4, 3.0), (5, 2.9)];
        let val = [(0, f64::NEG_INFINITY), (5, 3.1)];
        let svg = loss_svg(&train, &val, "nan");
        let doc = parse(&svg);
        assert!(!svg.contains("NaN") && !svg.contains("inf"));
        assert_eq!(path_d(&doc, "train").unwrap().matches('M').count(), 2);
        assert_eq!(doc.descendants().filter(|n| n.has_tag_name("circle")).count(), 1 + 1);
    }

    #[test]
    fn constant_values_get_an_axis_with_height() {
        let train: Vec<_> = (0..20).map(|s| (s, 2.0)).collect();
        let svg = loss_svg(&train, &[], "flat");
        let doc = parse(&svg);
        assert!(!svg.contains("NaN"));
        let labels = texts(&doc);
        assert!(labels.iter().any(|t| t.starts_with("1.8")), "{labels:?}");
        assert!(labels.iter().any(|t| t.starts_with("2.2")), "{labels:?}");
    }

    #[test]
    fn ticks_are_round_numbers() {
        let axis = Axis::new(Some((2.37, 10.93)), 0.0);
        assert_eq!((axis.lo, axis.hi, axis.step), (2.0, 12.0, 2.0));
        let labels: Vec<_> = axis.ticks().map(|t| axis.label(t)).collect();
        assert_eq!(labels, ["2", "4", "6", "8", "10", "12"]);
        let axis = Axis::new(Some((0.0, 1.0)), 1.0);
        assert_eq!(axis.step, 1.0);
        let axis = Axis::new(Some((3.41, 3.47)), 0.0);
        assert!(axis.ticks().all(|t| axis.label(t).len() <= 4), "{}", axis.step);
    }
}
