//! Why a JSON body was refused, in the words of JSON rather than of Rust:
//! serde names Rust types (`expected u32`, `a sequence`, `struct
//! PublishRequest`) and words syntax errors from the parser's side ("key
//! must be a string"). Pure, so every wording is tested.

/// A body that is not JSON: where, and what is wrong there.
pub fn syntax(error: &serde_json::Error) -> String {
    let what = plain_syntax(message_of(error));
    if error.line() == 0 {
        return format!("invalid JSON: {what}");
    }
    format!("invalid JSON at line {} column {}: {what}", error.line(), error.column())
}

/// JSON whose content does not fit: the field (a dotted path, `.` for the
/// body itself) and what it must be.
pub fn data(path: &str, error: &serde_json::Error) -> String {
    let what = plain_data(message_of(error));
    match path {
        "" | "." => format!("invalid request body: {what}"),
        field => format!("invalid request body: `{field}`: {what}"),
    }
}

/// serde_json's message without the position it appends.
fn message_of(error: &serde_json::Error) -> String {
    let text = error.to_string();
    let position = format!(" at line {} column {}", error.line(), error.column());
    text.strip_suffix(&position).map(str::to_owned).unwrap_or(text)
}

fn plain_syntax(message: String) -> String {
    let plain = match message.as_str() {
        "key must be a string" => "object keys must be quoted strings",
        "expected value" => "expected a JSON value (a string, number, object, array, true, false or null)",
        "expected ident" => "expected true, false or null (strings must be quoted)",
        "trailing comma" => "a comma before a closing bracket or brace",
        "trailing characters" => "more text after the JSON value",
        "expected `:`" => "expected `:` after an object key",
        "recursion limit exceeded" => "nested too deeply",
        m if m.starts_with("EOF while parsing") => "the body ends before the JSON value is complete",
        m if m.starts_with("control character") => "a control character in a string must be escaped",
        _ => return message,
    };
    plain.to_owned()
}

/// The words serde uses for what it wanted, in JSON's words.
fn plain_expected(expected: &str) -> String {
    let plain = match expected {
        "u8" => "a whole number from 0 to 255",
        "u16" => "a whole number from 0 to 65535",
        "u32" => "a whole number from 0 to 4294967295",
        "u64" | "usize" => "a whole number from 0 to 18446744073709551615",
        "i8" => "a whole number from -128 to 127",
        "i16" => "a whole number from -32768 to 32767",
        "i32" => "a whole number from -2147483648 to 2147483647",
        "i64" | "isize" => "a whole number from -9223372036854775808 to 9223372036854775807",
        "f32" | "f64" => "a number",
        "a boolean" => "true or false",
        "a sequence" => "an array",
        "a map" => "an object",
        "a borrowed string" | "a string" => "a string",
        "unit" => "null",
        "a character" | "char" => "a one-character string",
        "option" => "a value or null",
        e if e.starts_with("struct ") => "an object",
        e if e.starts_with("tuple") => "an array",
        _ => return expected.to_owned(),
    };
    plain.to_owned()
}

/// What serde found, in JSON's words.
fn plain_found(found: &str) -> String {
    for (rust, json) in [("integer ", "the number "), ("floating point ", "the number "), ("boolean ", "")] {
        if let Some(value) = found.strip_prefix(rust) {
            return format!("{json}{}", value.trim_matches('`'));
        }
    }
    match found {
        "sequence" => "an array".to_owned(),
        "map" => "an object".to_owned(),
        "unit value" => "null".to_owned(),
        f if f.starts_with("string ") => f.replacen("string ", "the string ", 1),
        f => f.to_owned(),
    }
}

fn plain_data(message: String) -> String {
    for prefix in ["invalid type: ", "invalid value: "] {
        if let Some((found, expected)) = message.strip_prefix(prefix).and_then(|rest| rest.split_once(", expected ")) {
            return format!("must be {}, not {}", plain_expected(expected), plain_found(found));
        }
    }
    if let Some((length, expected)) = message.strip_prefix("invalid length ").and_then(|r| r.split_once(", expected "))
    {
        return format!("must be {}, not {length} items", plain_expected(expected));
    }
    message
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, serde::Deserialize)]
    #[allow(dead_code)]
    struct Body {
        key: String,
        partitions: Option<u32>,
        count: Option<u64>,
        flag: Option<bool>,
        list: Option<Vec<String>>,
        inner: Option<Inner>,
    }

    #[derive(Debug, serde::Deserialize)]
    #[allow(dead_code)]
    struct Inner {
        n: i32,
    }

    fn refused(json: &str) -> String {
        let mut deserializer = serde_json::Deserializer::from_str(json);
        let result: Result<Body, _> = serde_path_to_error::deserialize(&mut deserializer);
        let error = result.expect_err("refused");
        match error.inner().classify() {
            serde_json::error::Category::Data => data(&error.path().to_string(), error.inner()),
            _ => syntax(error.inner()),
        }
    }

    #[test]
    fn syntax_errors_say_where_and_what_in_plain_words() {
        assert_eq!(
            refused(r#"{"key":"alice",data:1}"#),
            "invalid JSON at line 1 column 16: object keys must be quoted strings"
        );
        assert_eq!(
            refused(r#"{"key":"alice""#),
            "invalid JSON at line 1 column 14: the body ends before the JSON value is complete"
        );
        assert_eq!(refused(r#"{"key":alice}"#), "invalid JSON at line 1 column 8: expected a JSON value (a string, number, object, array, true, false or null)");
        assert_eq!(
            refused(r#"{"key":"a",}"#),
            "invalid JSON at line 1 column 12: a comma before a closing bracket or brace"
        );
    }

    #[test]
    fn type_errors_name_json_values_not_rust_types() {
        assert_eq!(
            refused(r#"{"key":"a","partitions":"4"}"#),
            r#"invalid request body: `partitions`: must be a whole number from 0 to 4294967295, not the string "4""#
        );
        assert_eq!(
            refused(r#"{"key":"a","partitions":-1}"#),
            "invalid request body: `partitions`: must be a whole number from 0 to 4294967295, not the number -1"
        );
        assert_eq!(
            refused(r#"{"key":"a","count":1.5}"#),
            "invalid request body: `count`: must be a whole number from 0 to 18446744073709551615, not the number 1.5"
        );
        assert_eq!(
            refused(r#"{"key":"a","flag":"yes"}"#),
            r#"invalid request body: `flag`: must be true or false, not the string "yes""#
        );
        assert_eq!(
            refused(r#"{"key":"a","list":"x"}"#),
            r#"invalid request body: `list`: must be an array, not the string "x""#
        );
        assert_eq!(
            refused(r#"{"key":"a","inner":"x"}"#),
            r#"invalid request body: `inner`: must be an object, not the string "x""#
        );
        assert_eq!(
            refused(r#"{"key":"a","inner":{"n":true}}"#),
            "invalid request body: `inner.n`: must be a whole number from -2147483648 to 2147483647, not true"
        );
        assert_eq!(refused(r#""x""#), r#"invalid request body: must be an object, not the string "x""#);
        assert_eq!(refused(r#"{"key":7}"#), "invalid request body: `key`: must be a string, not the number 7");
        assert_eq!(refused(r#"{}"#), "invalid request body: missing field `key`");
    }
}
