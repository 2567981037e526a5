//! Pure partitioning logic: the server's FNV-1a hash, key ↔ subject-token
//! encoding, subject patterns and pcgroups' partition → member assignment.
//!
//! Nothing here does I/O; everything is checked against the vectors read
//! back from nats-server (`tests/vectors/partition-vectors.json`) and
//! against a live server in the integration tests.

use std::collections::BTreeMap;
use std::fmt::Write as _;

/// Longest key accepted, in UTF-8 bytes, before encoding. Encoding can triple
/// it; the subject must still fit the server's control line (4 KiB).
pub const MAX_KEY_BYTES: usize = 1024;

/// Prefix of the token keygate puts in the key slot of a keyless message.
/// `%` followed by a non-hex character never comes out of [`encode_key`], so a
/// delivery can tell "no key" apart from every real key.
const KEYLESS_PREFIX: &str = "%_";

/// FNV-1a 32-bit, the hash behind the server's `{{partition(…)}}` transform.
pub fn fnv1a32(bytes: &[u8]) -> u32 {
    use core::hash::Hasher as _;
    use hash32::Hasher as _;
    let mut hasher = hash32::FnvHasher::default();
    hasher.write(bytes);
    hasher.finish32()
}

/// The partition the server stamps for these tokens: they are concatenated
/// with no separator, hashed, and taken modulo the partition count.
pub fn partition_of_tokens<'a>(tokens: impl IntoIterator<Item = &'a str>, partitions: u32) -> u32 {
    use core::hash::Hasher as _;
    use hash32::Hasher as _;
    let mut hasher = hash32::FnvHasher::default();
    for token in tokens {
        hasher.write(token.as_bytes());
    }
    hasher.finish32() % partitions.max(1)
}

/// Why a key cannot become a subject token.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KeyError {
    #[error("key must not be empty; omit it to spread messages over partitions")]
    Empty,
    #[error("key is {0} bytes long; the limit is {MAX_KEY_BYTES}")]
    TooLong(usize),
}

/// Turns any UTF-8 key into one subject token, reversibly.
///
/// Keys that are already valid tokens stay as they are, so keygate lands a key
/// in the same partition as a Go producer publishing the raw subject. Only the
/// bytes a token cannot hold (`.`, whitespace, control characters), the escape
/// character `%` itself, and keys that are exactly a wildcard (`*`, `>`) are
/// percent-escaped.
pub fn encode_key(key: &str) -> Result<String, KeyError> {
    if key.is_empty() {
        return Err(KeyError::Empty);
    }
    if key.len() > MAX_KEY_BYTES {
        return Err(KeyError::TooLong(key.len()));
    }
    if key == "*" || key == ">" {
        return Ok(format!("%{:02X}", key.as_bytes()[0]));
    }
    let mut token = String::with_capacity(key.len());
    for ch in key.chars() {
        if needs_escape(ch) {
            let mut buf = [0u8; 4];
            for byte in ch.encode_utf8(&mut buf).as_bytes() {
                let _ = write!(token, "%{byte:02X}");
            }
        } else {
            token.push(ch);
        }
    }
    Ok(token)
}

fn needs_escape(ch: char) -> bool {
    ch == '.' || ch == '%' || ch.is_whitespace() || ch.is_control()
}

/// The key a subject token stands for: `None` for keygate's keyless marker.
/// Tokens that were not produced by [`encode_key`] (a Go producer's raw
/// subject with a stray `%`) come back unchanged where they do not decode.
pub fn decode_key(token: &str) -> Option<String> {
    if is_keyless_token(token) {
        return None;
    }
    if !token.contains('%') {
        return Some(token.to_owned());
    }
    let bytes = token.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' && i + 2 < bytes.len() {
            if let (Some(hi), Some(lo)) = (hex_value(bytes[i + 1]), hex_value(bytes[i + 2])) {
                out.push(hi << 4 | lo);
                i += 3;
                continue;
            }
        }
        out.push(bytes[i]);
        i += 1;
    }
    Some(String::from_utf8(out).unwrap_or_else(|_| token.to_owned()))
}

fn hex_value(byte: u8) -> Option<u8> {
    match byte {
        b'0'..=b'9' => Some(byte - b'0'),
        b'A'..=b'F' => Some(byte - b'A' + 10),
        b'a'..=b'f' => Some(byte - b'a' + 10),
        _ => None,
    }
}

/// Whether a subject token is keygate's keyless marker.
pub fn is_keyless_token(token: &str) -> bool {
    token.starts_with(KEYLESS_PREFIX)
}

/// The token keygate puts in the key slot of the `n`th keyless message.
pub fn keyless_token(n: u64) -> String {
    format!("{KEYLESS_PREFIX}{n}")
}

/// A subject filter such as `orders.*` or `vm.*.*.>`, split into tokens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SubjectPattern {
    tokens: Vec<String>,
}

/// Why a subject or filter was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SubjectError {
    #[error("subject {0:?} is not a valid NATS subject")]
    Invalid(String),
    #[error("subject {subject:?} does not match {pattern:?}")]
    NoMatch { subject: String, pattern: String },
}

impl SubjectPattern {
    /// Parses a filter: non-empty tokens without whitespace, `>` only last.
    pub fn parse(filter: &str) -> Result<Self, SubjectError> {
        let invalid = || SubjectError::Invalid(filter.to_owned());
        if filter.is_empty() || filter.len() > 4096 {
            return Err(invalid());
        }
        let tokens: Vec<String> = filter.split('.').map(str::to_owned).collect();
        for (i, token) in tokens.iter().enumerate() {
            if token.is_empty() || token.chars().any(|c| c.is_whitespace() || c.is_control()) {
                return Err(invalid());
            }
            if token == ">" && i + 1 != tokens.len() {
                return Err(invalid());
            }
        }
        Ok(Self { tokens })
    }

    /// The filter as written.
    pub fn as_string(&self) -> String {
        self.tokens.join(".")
    }

    /// Number of `*` tokens (what the 1-based wildcard indexes refer to).
    pub fn star_count(&self) -> usize {
        self.tokens.iter().filter(|t| *t == "*").count()
    }

    /// Whether the pattern ends in `>`.
    pub fn has_tail(&self) -> bool {
        self.tokens.last().is_some_and(|t| t == ">")
    }

    /// Whether the pattern is a literal subject one can publish to.
    pub fn is_literal(&self) -> bool {
        self.star_count() == 0 && !self.has_tail()
    }

    /// The tokens a literal subject has at each `*` of this pattern, in
    /// wildcard order, if it matches.
    pub fn captures<'s>(&self, subject: &'s str) -> Option<Vec<&'s str>> {
        let parts: Vec<&str> = subject.split('.').collect();
        let mut captured = Vec::new();
        for (i, token) in self.tokens.iter().enumerate() {
            match token.as_str() {
                ">" => return (parts.len() > i).then_some(captured),
                "*" => captured.push(*parts.get(i)?),
                literal => {
                    if parts.get(i) != Some(&literal) {
                        return None;
                    }
                }
            }
        }
        (parts.len() == self.tokens.len()).then_some(captured)
    }

    /// Whether some subject matches both patterns.
    pub fn overlaps(&self, other: &SubjectPattern) -> bool {
        let (a, b) = (&self.tokens, &other.tokens);
        for i in 0..a.len().max(b.len()) {
            match (a.get(i).map(String::as_str), b.get(i).map(String::as_str)) {
                (Some(">"), Some(_)) | (Some(_), Some(">")) => return true,
                (Some(x), Some(y)) if x == "*" || y == "*" || x == y => continue,
                _ => return false,
            }
        }
        true
    }

    /// The server's partitioning transform destination for this filter.
    pub fn partition_transform(&self, partitions: u32, wildcards: &[u32], spelling: TransformSpelling) -> String {
        let (partition_fn, wildcard_fn) = match spelling {
            TransformSpelling::Stream => ("partition", "wildcard"),
            TransformSpelling::Pcgroups => ("Partition", "Wildcard"),
        };
        let mut index = 0;
        let rest: Vec<String> = self
            .tokens
            .iter()
            .map(|token| {
                if token == "*" {
                    index += 1;
                    format!("{{{{{wildcard_fn}({index})}}}}")
                } else {
                    token.clone()
                }
            })
            .collect();
        let rest = rest.join(".");
        if wildcards.is_empty() {
            format!("{{{{{partition_fn}({partitions})}}}}.{rest}")
        } else {
            let list: Vec<String> = wildcards.iter().map(u32::to_string).collect();
            format!("{{{{{partition_fn}({partitions},{})}}}}.{rest}", list.join(","))
        }
    }
}

/// How a transform destination spells its functions. The server accepts
/// both; a repeated create must match byte for byte, so elastic work-queue
/// streams use pcgroups' spelling.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TransformSpelling {
    /// `{{partition(N,1)}}.orders.{{wildcard(1)}}`, as docs/architecture.md writes it.
    Stream,
    /// `{{Partition(N,1)}}.orders.{{Wildcard(1)}}`, as pcgroups writes it.
    Pcgroups,
}

/// What a partitioning transform says: the partition count and the wildcard
/// indexes it hashes (empty: the whole subject).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PartitionSpec {
    pub partitions: u32,
    pub wildcards: Vec<u32>,
}

impl PartitionSpec {
    /// Reads `{{partition(N,w…)}}` from a transform destination, in any case
    /// and spacing the server accepts. `None` when it has no such function.
    pub fn from_transform(destination: &str) -> Option<Self> {
        let lower = destination.to_ascii_lowercase();
        let start = lower.find("{{")?;
        let end = lower[start..].find("}}")? + start;
        let inner: String = lower[start + 2..end].chars().filter(|c| !c.is_whitespace()).collect();
        let args = inner.strip_prefix("partition(")?.strip_suffix(')')?;
        let mut numbers = args.split(',').map(|n| n.parse::<u32>());
        let partitions = numbers.next()?.ok()?;
        let wildcards = numbers.collect::<Result<Vec<_>, _>>().ok()?;
        (partitions > 0).then_some(Self { partitions, wildcards })
    }

    /// The partition of a literal subject published on `pattern`.
    pub fn partition_of_subject(&self, pattern: &SubjectPattern, subject: &str) -> Option<u32> {
        if self.wildcards.is_empty() {
            return Some(partition_of_tokens([subject], self.partitions));
        }
        let captured = pattern.captures(subject)?;
        let mut tokens = Vec::with_capacity(self.wildcards.len());
        for w in &self.wildcards {
            tokens.push(*captured.get((*w as usize).checked_sub(1)?)?);
        }
        Some(partition_of_tokens(tokens, self.partitions))
    }
}

/// pcgroups' balanced assignment: members de-duplicated, sorted byte-wise,
/// at most `partitions` of them; each gets a contiguous run of `per`
/// partitions and the remainder is dealt round-robin from the first member.
pub fn balanced_assignment(members: &[String], partitions: u32) -> BTreeMap<String, Vec<u32>> {
    let mut sorted: Vec<&String> = members.iter().collect();
    sorted.sort();
    sorted.dedup();
    sorted.truncate(partitions as usize);
    let mut owned: BTreeMap<String, Vec<u32>> = BTreeMap::new();
    let n = sorted.len() as u32;
    if n == 0 {
        return owned;
    }
    let per = partitions / n;
    for i in 0..partitions {
        let owner = if i < n * per { sorted[(i / per) as usize] } else { sorted[((i - n * per) % n) as usize] };
        owned.entry(owner.clone()).or_default().push(i);
    }
    owned
}

/// The partitions `member` owns under balanced assignment, ascending.
pub fn member_partitions(members: &[String], partitions: u32, member: &str) -> Vec<u32> {
    balanced_assignment(members, partitions).remove(member).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use serde_json::Value;

    fn vectors() -> Value {
        serde_json::from_str(include_str!("../tests/vectors/partition-vectors.json")).unwrap()
    }

    #[test]
    fn compat_md_vectors_hold() {
        assert_eq!(partition_of_tokens(["42"], 10), 1);
        assert_eq!(partition_of_tokens(["foo.42"], 10), 7);
        let parity: Vec<u32> = (0..10).map(|k| partition_of_tokens([k.to_string().as_str()], 2)).collect();
        assert_eq!(parity, vec![1, 0, 1, 0, 1, 0, 1, 0, 1, 0]);
    }

    #[test]
    fn single_wildcard_vectors_from_the_server_match() {
        let v = vectors();
        let cases = v["single"].as_array().unwrap();
        assert!(cases.len() > 600);
        for case in cases {
            let key = case["key"].as_str().unwrap();
            let n = case["partitions"].as_u64().unwrap() as u32;
            let want = case["partition"].as_u64().unwrap() as u32;
            let token = encode_key(key).unwrap();
            assert_eq!(partition_of_tokens([token.as_str()], n), want, "key {key:?} mod {n}");
        }
    }

    #[test]
    fn multi_wildcard_vectors_from_the_server_match() {
        let v = vectors();
        for case in v["multi"].as_array().unwrap() {
            let transform = case["transform"].as_str().unwrap();
            let (source, dest) = transform.split_once(" -> ").unwrap();
            let spec = PartitionSpec::from_transform(dest).unwrap();
            let pattern = SubjectPattern::parse(source).unwrap();
            let tokens: Vec<&str> = case["tokens"].as_array().unwrap().iter().map(|t| t.as_str().unwrap()).collect();
            let subject = format!("vm.{}", tokens.join("."));
            let want = case["partition"].as_u64().unwrap() as u32;
            assert_eq!(spec.partition_of_subject(&pattern, &subject), Some(want), "{subject}");
        }
    }

    #[test]
    fn assignment_matches_the_worked_examples() {
        let v = vectors();
        for case in v["assignment"].as_array().unwrap() {
            let n = case["partitions"].as_u64().unwrap() as u32;
            let members: Vec<String> =
                case["members"].as_array().unwrap().iter().map(|m| m.as_str().unwrap().to_owned()).collect();
            let want: BTreeMap<String, Vec<u32>> = serde_json::from_value(case["owned"].clone()).unwrap();
            assert_eq!(balanced_assignment(&members, n), want, "{members:?} over {n}");
        }
    }

    #[test]
    fn assignment_examples_in_compat_md() {
        let abc: Vec<String> = ["a", "b", "c"].map(String::from).to_vec();
        assert_eq!(member_partitions(&abc, 10, "a"), vec![0, 1, 2, 9]);
        assert_eq!(member_partitions(&abc, 4, "a"), vec![0, 3]);
        assert_eq!(member_partitions(&abc, 4, "c"), vec![2]);
        assert_eq!(member_partitions(&abc, 4, "z"), Vec::<u32>::new());
    }

    #[test]
    fn keys_that_are_tokens_stay_raw_and_others_are_escaped() {
        assert_eq!(encode_key("alice").unwrap(), "alice");
        assert_eq!(encode_key("ключ").unwrap(), "ключ");
        assert_eq!(encode_key("a>b").unwrap(), "a>b");
        assert_eq!(encode_key("a.b c").unwrap(), "a%2Eb%20c");
        assert_eq!(encode_key("50%").unwrap(), "50%25");
        assert_eq!(encode_key("*").unwrap(), "%2A");
        assert_eq!(encode_key(">").unwrap(), "%3E");
        assert_eq!(encode_key(""), Err(KeyError::Empty));
        assert!(matches!(encode_key(&"x".repeat(MAX_KEY_BYTES + 1)), Err(KeyError::TooLong(_))));
        assert_eq!(decode_key(&keyless_token(7)), None);
        assert_eq!(decode_key("raw%zz"), Some("raw%zz".to_owned()));
    }

    #[test]
    fn transform_destinations_parse_in_both_spellings() {
        let spec = PartitionSpec::from_transform("{{partition(10,1)}}.orders.{{wildcard(1)}}").unwrap();
        assert_eq!(spec, PartitionSpec { partitions: 10, wildcards: vec![1] });
        let spec = PartitionSpec::from_transform("{{Partition( 7, 2,1 )}}.vm.{{Wildcard(1)}}").unwrap();
        assert_eq!(spec, PartitionSpec { partitions: 7, wildcards: vec![2, 1] });
        assert_eq!(PartitionSpec::from_transform("{{Partition(4)}}.>").unwrap().wildcards, Vec::<u32>::new());
        assert_eq!(PartitionSpec::from_transform("orders.{{wildcard(1)}}"), None);
        let pattern = SubjectPattern::parse("orders.*").unwrap();
        assert_eq!(
            pattern.partition_transform(10, &[1], TransformSpelling::Pcgroups),
            "{{Partition(10,1)}}.orders.{{Wildcard(1)}}"
        );
        assert_eq!(
            pattern.partition_transform(10, &[1], TransformSpelling::Stream),
            "{{partition(10,1)}}.orders.{{wildcard(1)}}"
        );
        assert_eq!(
            SubjectPattern::parse(">").unwrap().partition_transform(3, &[], TransformSpelling::Pcgroups),
            "{{Partition(3)}}.>"
        );
    }

    #[test]
    fn patterns_capture_wildcards_and_reject_strangers() {
        let p = SubjectPattern::parse("vm.*.*.>").unwrap();
        assert_eq!(p.captures("vm.eu.alice.x.y"), Some(vec!["eu", "alice"]));
        assert_eq!(p.captures("vm.eu.alice"), None);
        assert_eq!(p.captures("xx.eu.alice.x"), None);
        assert!(SubjectPattern::parse("a..b").is_err());
        assert!(SubjectPattern::parse("a.>.b").is_err());
        assert!(SubjectPattern::parse("a b").is_err());
        let overlap = |a: &str, b: &str| SubjectPattern::parse(a).unwrap().overlaps(&SubjectPattern::parse(b).unwrap());
        assert!(overlap("*.orders.*", "*.orders.>"));
        assert!(overlap("orders.*", "orders.x"));
        assert!(!overlap("*.orders.*", "orders.*"));
        assert!(!overlap("a.b", "a.b.c"));
        assert!(overlap(">", "a.b.c"));
    }

    /// FNV-1a 32 as its specification states it, to check the crate against.
    fn reference_fnv1a32(bytes: &[u8]) -> u32 {
        bytes.iter().fold(0x811c_9dc5u32, |hash, byte| (hash ^ u32::from(*byte)).wrapping_mul(0x0100_0193))
    }

    proptest! {
        #[test]
        fn hash_matches_the_fnv1a_specification(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
            prop_assert_eq!(fnv1a32(&bytes), reference_fnv1a32(&bytes));
        }

        #[test]
        fn multi_token_partitions_hash_the_concatenation(a in "\\PC{1,20}", b in "\\PC{1,20}", n in 1u32..500) {
            let joined = format!("{a}{b}");
            prop_assert_eq!(partition_of_tokens([a.as_str(), b.as_str()], n), reference_fnv1a32(joined.as_bytes()) % n);
        }

        #[test]
        fn every_key_round_trips_through_its_token(key in "\\PC{1,64}|[ .%*>\\t]{1,8}|.{1,32}") {
            let token = encode_key(&key).unwrap();
            prop_assert!(!token.is_empty());
            prop_assert!(!token.contains('.'));
            prop_assert!(!token.chars().any(char::is_whitespace));
            prop_assert!(token != "*" && token != ">");
            prop_assert_eq!(decode_key(&token), Some(key));
        }

        #[test]
        fn assignment_covers_every_partition_exactly_once(
            partitions in 1u32..200,
            members in proptest::collection::vec("[a-z0-9]{1,6}", 1..40),
        ) {
            let owned = balanced_assignment(&members, partitions);
            let mut all: Vec<u32> = owned.values().flatten().copied().collect();
            all.sort_unstable();
            prop_assert_eq!(all, (0..partitions).collect::<Vec<_>>());
            let distinct: std::collections::BTreeSet<&String> = members.iter().collect();
            prop_assert_eq!(owned.len(), distinct.len().min(partitions as usize));
            let sizes: Vec<usize> = owned.values().map(Vec::len).collect();
            prop_assert!(sizes.iter().max().unwrap() - sizes.iter().min().unwrap() <= 1);
        }

        #[test]
        fn partition_is_always_in_range(key in ".{1,40}", partitions in 1u32..1000) {
            let token = encode_key(&key).unwrap();
            prop_assert!(partition_of_tokens([token.as_str()], partitions) < partitions);
        }
    }
}
