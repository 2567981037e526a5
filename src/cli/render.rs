//! How the admin commands print: tables, partition ranges, times, JSON.

use comfy_table::{presets, Table};
use serde::Serialize;

pub fn table(headers: &[&str]) -> Table {
    let mut table = Table::new();
    table.load_preset(presets::NOTHING).set_header(headers.to_vec());
    table
}

pub fn yes_no(value: bool) -> &'static str {
    if value {
        "yes"
    } else {
        "no"
    }
}

/// Partitions as compact ranges: `0-3,7,9-10`.
pub fn ranges(partitions: &[u32]) -> String {
    let mut sorted = partitions.to_vec();
    sorted.sort_unstable();
    let mut out: Vec<String> = Vec::new();
    let mut i = 0;
    while i < sorted.len() {
        let start = sorted[i];
        let mut end = start;
        while i + 1 < sorted.len() && sorted[i + 1] == end + 1 {
            i += 1;
            end = sorted[i];
        }
        out.push(if start == end { start.to_string() } else { format!("{start}-{end}") });
        i += 1;
    }
    if out.is_empty() {
        "-".into()
    } else {
        out.join(",")
    }
}

pub fn print_json(value: &impl Serialize) -> anyhow::Result<()> {
    write_stdout(format!("{}\n", serde_json::to_string_pretty(value)?).as_bytes())?;
    Ok(())
}

/// `println!` through [`write_stdout`], for functions returning a `Result`.
macro_rules! out {
    ($($arg:tt)*) => {
        $crate::cli::render::write_stdout(format!("{}\n", format_args!($($arg)*)).as_bytes())?
    };
}
pub(crate) use out;

/// Writes to stdout; a reader that went away (`| head`) ends the output
/// quietly instead of with a panic.
pub fn write_stdout(bytes: &[u8]) -> std::io::Result<()> {
    use std::io::Write as _;
    let mut out = std::io::stdout().lock();
    match out.write_all(bytes).and_then(|()| out.flush()) {
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
        other => other,
    }
}

/// A time as RFC 3339 (`2026-12-01T10:54:27.5Z`), as the API answers it.
pub fn timestamp(t: time::OffsetDateTime) -> String {
    t.format(&time::format_description::well_known::Rfc3339).unwrap_or_else(|_| t.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn partitions_print_as_compact_ranges() {
        assert_eq!(ranges(&[]), "-");
        assert_eq!(ranges(&[3, 0, 1, 2, 7, 9, 10]), "0-3,7,9-10");
        assert_eq!(ranges(&[5]), "5");
    }

    #[test]
    fn times_print_as_rfc3339() {
        let t = time::OffsetDateTime::from_unix_timestamp(1_796_208_460).unwrap();
        assert_eq!(timestamp(t), "2026-12-02T10:47:40Z");
    }
}
