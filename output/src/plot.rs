//! Minimal SVG line charts for reports: stacked panels sharing one time axis. Written by
//! hand because the reports need only lines, axes and a legend, and a plotting crate
//! would cost more build time than this file.

use std::fmt::Write;

/// One line of a panel.
#[derive(Clone, Debug)]
pub struct Series {
    pub name: String,
    pub points: Vec<(f64, f64)>,
    /// Draw as a step function (replica counts), not straight segments.
    pub step: bool,
}

/// One chart of the stack.
#[derive(Clone, Debug)]
pub struct Panel {
    pub y_label: String,
    pub series: Vec<Series>,
}

const PALETTE: [&str; 8] = [
    "#d62728", "#1f77b4", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
];

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// A "nice" tick step for a range: 1, 2 or 5 × 10^k, about five ticks.
fn tick_step(range: f64) -> f64 {
    if !(range.is_finite() && range > 0.0) {
        return 1.0;
    }
    let raw = range / 5.0;
    let mag = 10f64.powf(raw.log10().floor());
    let n = raw / mag;
    mag * if n < 1.5 {
        1.0
    } else if n < 3.5 {
        2.0
    } else if n < 7.5 {
        5.0
    } else {
        10.0
    }
}

fn fmt_num(v: f64) -> String {
    if v.abs() >= 10_000.0 {
        format!("{:.0}k", v / 1000.0)
    } else if v.fract().abs() < 1e-9 {
        format!("{v:.0}")
    } else {
        format!("{v:.1}")
    }
}

/// The `<svg>` element, a white background and the title centred at `title_x`.
fn open_svg(w: f64, h: f64, title: &str, title_x: f64) -> String {
    let mut o = String::new();
    let _ = writeln!(
        o,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(o, r#"<rect width="{w}" height="{h}" fill="white"/>"#);
    let _ = writeln!(
        o,
        r#"<text x="{title_x}" y="22" font-size="15" text-anchor="middle">{}</text>"#,
        esc(title)
    );
    o
}

/// Series with at most this many points are drawn with a mark at each point.
const MAX_MARKED_POINTS: usize = 24;

/// Charts made by this module, one above the other in one SVG (each keeps its own
/// axes: a chart of points against cost beside one against time).
#[must_use]
pub fn stack(charts: &[String]) -> String {
    let size = |c: &str, key: &str| -> f64 {
        c.split_once(&format!("{key}=\""))
            .and_then(|(_, rest)| rest.split_once('"'))
            .and_then(|(v, _)| v.parse().ok())
            .unwrap_or(0.0)
    };
    let w = charts.iter().map(|c| size(c, "width")).fold(0.0, f64::max);
    let h: f64 = charts.iter().map(|c| size(c, "height")).sum();
    let mut o = format!(
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}">"#
    );
    o.push('\n');
    let mut y = 0.0;
    for c in charts {
        // A nested <svg> placed at its offset: the chart's own markup, unchanged.
        let inner = c
            .trim_end()
            .replacen("<svg ", &format!(r#"<svg y="{y}" "#), 1);
        o.push_str(&inner);
        o.push('\n');
        y += size(c, "height");
    }
    o.push_str("</svg>\n");
    o
}

/// Renders the panels one above the other; series keep their colour across panels by
/// name, so one legend serves all.
#[must_use]
pub fn svg(title: &str, x_label: &str, panels: &[Panel]) -> String {
    let (w, panel_h, left, right, top, gap) = (960.0, 200.0, 70.0, 170.0, 40.0, 40.0);
    let h = top + panels.len() as f64 * (panel_h + gap) + 20.0;
    let plot_w = w - left - right;
    let mut names: Vec<&str> = Vec::new();
    for s in panels.iter().flat_map(|p| &p.series) {
        if !names.contains(&s.name.as_str()) {
            names.push(&s.name);
        }
    }
    let color = |name: &str| {
        let i = names.iter().position(|n| *n == name).unwrap_or(0);
        PALETTE[i % PALETTE.len()]
    };
    let all = panels
        .iter()
        .flat_map(|p| &p.series)
        .flat_map(|s| &s.points)
        .map(|p| p.0)
        .filter(|x| x.is_finite());
    let (x0, x1) = all.fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), x| {
        (a.min(x), b.max(x))
    });
    let (x0, x1) = if x0.is_finite() && x1 > x0 {
        (x0, x1)
    } else {
        (0.0, 1.0)
    };
    let sx = |x: f64| left + (x - x0) / (x1 - x0) * plot_w;
    let mut o = open_svg(w, h, title, left + plot_w / 2.0);
    for (pi, panel) in panels.iter().enumerate() {
        let py = top + pi as f64 * (panel_h + gap);
        let ymax = panel
            .series
            .iter()
            .flat_map(|s| &s.points)
            .map(|p| p.1)
            .filter(|y| y.is_finite())
            .fold(0.0f64, f64::max);
        let ystep = tick_step(ymax.max(1.0));
        let ymax = (ymax / ystep).ceil().max(1.0) * ystep;
        let sy = |y: f64| py + panel_h - (y / ymax) * panel_h;
        let _ = writeln!(
            o,
            r##"<rect x="{left}" y="{py}" width="{plot_w}" height="{panel_h}" fill="none" stroke="#888"/>"##
        );
        let mut y = 0.0;
        while y <= ymax + 1e-9 {
            let yy = sy(y);
            let _ = writeln!(
                o,
                r##"<line x1="{left}" y1="{yy}" x2="{}" y2="{yy}" stroke="#eee"/><text x="{}" y="{}" text-anchor="end">{}</text>"##,
                left + plot_w,
                left - 6.0,
                yy + 4.0,
                fmt_num(y)
            );
            y += ystep;
        }
        let _ = writeln!(
            o,
            r#"<text transform="translate(18,{}) rotate(-90)" text-anchor="middle">{}</text>"#,
            py + panel_h / 2.0,
            esc(&panel.y_label)
        );
        for s in &panel.series {
            let mut d = String::new();
            let mut prev: Option<(f64, f64)> = None;
            // Series of a few points (a sweep, a single reference) get a mark at each:
            // a line through one point draws nothing.
            let marks = !s.step && s.points.len() <= MAX_MARKED_POINTS;
            for &(x, y) in s
                .points
                .iter()
                .filter(|p| p.0.is_finite() && p.1.is_finite())
            {
                let (px, pyy) = (sx(x), sy(y));
                if marks {
                    let _ = writeln!(
                        o,
                        r#"<circle cx="{px:.1}" cy="{pyy:.1}" r="3" fill="{}"/>"#,
                        color(&s.name)
                    );
                }
                match prev {
                    None => {
                        let _ = write!(d, "M{px:.1},{pyy:.1}");
                    }
                    Some((_, ly)) if s.step => {
                        let _ = write!(d, " L{px:.1},{ly:.1} L{px:.1},{pyy:.1}");
                    }
                    Some(_) => {
                        let _ = write!(d, " L{px:.1},{pyy:.1}");
                    }
                }
                prev = Some((px, pyy));
            }
            let _ = writeln!(
                o,
                r#"<path d="{d}" fill="none" stroke="{}" stroke-width="1.4"/>"#,
                color(&s.name)
            );
        }
        // x ticks on every panel's bottom edge.
        let xstep = tick_step(x1 - x0);
        let mut x = (x0 / xstep).ceil() * xstep;
        while x <= x1 + 1e-9 {
            let _ = writeln!(
                o,
                r#"<text x="{}" y="{}" text-anchor="middle">{}</text>"#,
                sx(x),
                py + panel_h + 14.0,
                fmt_num(x)
            );
            x += xstep;
        }
    }
    let _ = writeln!(
        o,
        r#"<text x="{}" y="{}" text-anchor="middle">{}</text>"#,
        left + plot_w / 2.0,
        h - 4.0,
        esc(x_label)
    );
    for (i, n) in names.iter().enumerate() {
        let y = top + 10.0 + i as f64 * 18.0;
        let x = left + plot_w + 14.0;
        let _ = writeln!(
            o,
            r#"<line x1="{x}" y1="{y}" x2="{}" y2="{y}" stroke="{}" stroke-width="3"/><text x="{}" y="{}">{}</text>"#,
            x + 18.0,
            color(n),
            x + 24.0,
            y + 4.0,
            esc(n)
        );
    }
    o.push_str("</svg>\n");
    o
}

/// Horizontal stacked bars: one bar per row, one segment per (phase, seconds), colour by
/// phase name; each bar is labelled with its total (short bars stay readable), and an
/// optional vertical marker line shows a target.
#[must_use]
pub fn stacked_bars(
    title: &str,
    x_label: &str,
    rows: &[(String, Vec<(String, f64)>)],
    marker: Option<(String, f64)>,
) -> String {
    let (w, left, right, top, bar_h, gap) = (960.0, 90.0, 170.0, 40.0, 28.0, 14.0);
    let plot_w = w - left - right;
    let plot_h = rows.len() as f64 * (bar_h + gap) + gap;
    let h = top + plot_h + 50.0;
    let mut names: Vec<&str> = Vec::new();
    for (_, segs) in rows {
        for (n, _) in segs {
            if !names.contains(&n.as_str()) {
                names.push(n);
            }
        }
    }
    let color =
        |name: &str| PALETTE[names.iter().position(|n| *n == name).unwrap_or(0) % PALETTE.len()];
    let total = |segs: &[(String, f64)]| segs.iter().map(|s| s.1.max(0.0)).sum::<f64>();
    let xmax = rows
        .iter()
        .map(|(_, s)| total(s))
        .chain(marker.as_ref().map(|m| m.1))
        .filter(|v| v.is_finite())
        .fold(0.0f64, f64::max);
    let step = tick_step(xmax.max(1e-3));
    let xmax = (xmax / step).ceil().max(1.0) * step;
    let sx = |x: f64| left + x / xmax * plot_w;
    let mut o = open_svg(w, h, title, left + plot_w / 2.0);
    let _ = writeln!(
        o,
        r##"<rect x="{left}" y="{top}" width="{plot_w}" height="{plot_h}" fill="none" stroke="#888"/>"##
    );
    let mut t = 0.0;
    while t <= xmax + step / 2.0 {
        let x = sx(t);
        let _ = writeln!(
            o,
            r##"<line x1="{x}" y1="{top}" x2="{x}" y2="{}" stroke="#eee"/><text x="{x}" y="{}" text-anchor="middle">{}</text>"##,
            top + plot_h,
            top + plot_h + 16.0,
            fmt_num(t)
        );
        t += step;
    }
    let _ = writeln!(
        o,
        r#"<text x="{}" y="{}" text-anchor="middle">{}</text>"#,
        left + plot_w / 2.0,
        top + plot_h + 36.0,
        esc(x_label)
    );
    for (i, (label, segs)) in rows.iter().enumerate() {
        let y = top + gap + i as f64 * (bar_h + gap);
        let _ = writeln!(
            o,
            r#"<text x="{}" y="{}" text-anchor="end">{}</text>"#,
            left - 8.0,
            y + bar_h / 2.0 + 4.0,
            esc(label)
        );
        let mut at = 0.0;
        for (name, v) in segs {
            let v = v.max(0.0);
            let _ = writeln!(
                o,
                r#"<rect x="{}" y="{y}" width="{}" height="{bar_h}" fill="{}"><title>{}: {v:.3} s</title></rect>"#,
                sx(at),
                (sx(at + v) - sx(at)).max(0.0),
                color(name),
                esc(name)
            );
            at += v;
        }
        let _ = writeln!(
            o,
            r#"<text x="{}" y="{}">{:.3} s</text>"#,
            sx(at) + 4.0,
            y + bar_h / 2.0 + 4.0,
            at
        );
    }
    if let Some((label, x)) = marker {
        let px = sx(x);
        let _ = writeln!(
            o,
            r##"<line x1="{px}" y1="{top}" x2="{px}" y2="{}" stroke="#000" stroke-dasharray="5,4"/><text x="{}" y="{}" font-size="11">{}</text>"##,
            top + plot_h,
            px + 4.0,
            top + 12.0,
            esc(&label)
        );
    }
    for (i, n) in names.iter().enumerate() {
        let y = top + 10.0 + i as f64 * 18.0;
        let x = left + plot_w + 16.0;
        let _ = writeln!(
            o,
            r#"<rect x="{x}" y="{}" width="12" height="12" fill="{}"/><text x="{}" y="{}">{}</text>"#,
            y - 10.0,
            color(n),
            x + 18.0,
            y,
            esc(n)
        );
    }
    o.push_str("</svg>\n");
    o
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ticks_are_round() {
        assert_eq!(tick_step(100.0), 20.0);
        assert_eq!(tick_step(3600.0), 500.0);
        assert_eq!(tick_step(7.0), 1.0);
        assert_eq!(tick_step(0.0), 1.0);
    }

    #[test]
    fn renders_every_series_once_in_the_legend() {
        let p = |name: &str| Series {
            name: name.into(),
            points: vec![(0.0, 1.0), (10.0, 3.0), (20.0, f64::NAN)],
            step: true,
        };
        let s = svg(
            "t <&>",
            "seconds",
            &[
                Panel {
                    y_label: "a".into(),
                    series: vec![p("x"), p("y")],
                },
                Panel {
                    y_label: "b".into(),
                    series: vec![p("x")],
                },
            ],
        );
        assert!(s.starts_with("<svg") && s.ends_with("</svg>\n"));
        assert_eq!(s.matches("<path").count(), 3);
        assert_eq!(
            s.matches(">x</text>").count(),
            1,
            "one legend entry per name"
        );
        assert!(s.contains("t &lt;&amp;&gt;"));
    }
}

#[cfg(test)]
mod stack_tests {
    use super::*;

    #[test]
    fn stacked_charts_sit_one_below_the_other() {
        let chart = |name: &str| {
            svg(
                name,
                "x",
                &[Panel {
                    y_label: "y".into(),
                    series: vec![Series {
                        name: name.into(),
                        points: vec![(0.0, 1.0), (1.0, 2.0)],
                        step: false,
                    }],
                }],
            )
        };
        let (a, b) = (chart("a"), chart("b"));
        let s = stack(&[a, b]);
        // One chart's height is 40 + 240 + 20.
        assert!(
            s.starts_with(r#"<svg xmlns="http://www.w3.org/2000/svg" width="960" height="600""#),
            "{}",
            &s[..120]
        );
        assert!(s.contains(r#"<svg y="0" xmlns"#) && s.contains(r#"<svg y="300" xmlns"#));
        assert_eq!(s.matches("<svg").count(), 3);
        assert_eq!(s.matches("</svg>").count(), 3);
    }
}
