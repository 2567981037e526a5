//! b: uses a back, a planted cycle that string and comment syntax used to
//! hide from the regex-based check.

/// A string continued over a line break.
pub const HELP: &str = "b's help, \
    continued on the next line";

/// A raw string with a quote and what looks like a comment.
pub const RAW: &str = r#"a lone " and // slashes"#;

/* a /* nested */ block comment */

pub fn helper() -> u32 {
    1
}

// The planted edge back to a, just below.
#[allow(unused_imports)]
use crate::a::ANSWER;

pub const LAST: &str = "end";
