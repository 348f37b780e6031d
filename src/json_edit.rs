//! Surgical edits of a JSON request body: the value of one top-level key is replaced and every
//! other byte is left as it was.
//!
//! Prompt caches key on the exact bytes of a request. Parsing a body into a
//! `serde_json::Value` and writing it back would reorder keys, re-escape strings and reformat
//! numbers, so a fallback model or a smaller `max_tokens` would also cost the cache. These
//! functions find the byte span of one top-level value (through `serde_json`'s [`RawValue`],
//! which borrows it from the input) and splice the new value in its place.
//!
//! Every function answers `None` rather than guess when the body is not exactly one JSON
//! object, lacks the key, or names it more than once; the layers built on them then pass the
//! request through untouched.

use std::fmt;
use std::ops::Range;

use bytes::Bytes;
use serde::de::{self, DeserializeSeed, IgnoredAny, MapAccess, Visitor};
use serde::{Deserialize, Deserializer as _, Serialize};
use serde_json::value::RawValue;

/// The byte range of the value of the top-level `key` in `json`.
///
/// `None` when `json` is not a single JSON object (surrounding whitespace aside), when it has
/// no such key, or when the key appears more than once (which value a server would read is
/// then anyone's guess). Keys are compared after unescaping, so `"mod\u0065l"` is `model`.
pub(crate) fn value_span(json: &[u8], key: &str) -> Option<Range<usize>> {
    let mut de = serde_json::Deserializer::from_slice(json);
    let found = de.deserialize_map(FindKey { key }).ok()?;
    de.end().ok()?;
    let text = found?.get();
    // The raw value borrows from `json`, so its address gives its offset.
    let start = (text.as_ptr() as usize).checked_sub(json.as_ptr() as usize)?;
    let end = start.checked_add(text.len())?;
    (end <= json.len()).then_some(start..end)
}

/// Reads the value of the top-level `key` as a `T`; `None` in the cases of [`value_span`] and
/// when the value is not a `T`.
pub(crate) fn read_value<'a, T: Deserialize<'a>>(json: &'a [u8], key: &str) -> Option<T> {
    let span = value_span(json, key)?;
    serde_json::from_slice(&json[span]).ok()
}

/// `json` with the value of the top-level `key` replaced by `value`, serialized compactly;
/// every byte outside that value's span is kept. `None` in the cases of [`value_span`] and
/// when `value` cannot be serialized.
#[cfg_attr(
    not(any(feature = "fallback", feature = "overflow", feature = "continuation")),
    allow(dead_code) // only the layers that rewrite a body use it; its tests run always
)]
pub(crate) fn replace_value<T: Serialize + ?Sized>(
    json: &[u8],
    key: &str,
    value: &T,
) -> Option<Bytes> {
    let span = value_span(json, key)?;
    let new = serde_json::to_vec(value).ok()?;
    let mut out = Vec::with_capacity(json.len() - span.len() + new.len());
    out.extend_from_slice(&json[..span.start]);
    out.extend_from_slice(&new);
    out.extend_from_slice(&json[span.end..]);
    Some(Bytes::from(out))
}

/// Walks one JSON object, keeping the raw value of `key` and skipping the others.
struct FindKey<'k> {
    key: &'k str,
}

impl<'de> Visitor<'de> for FindKey<'_> {
    /// `None` when the key is missing or repeated.
    type Value = Option<&'de RawValue>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut found = None;
        let mut repeated = false;
        while let Some(is_key) = map.next_key_seed(KeyIs(self.key))? {
            if is_key {
                let raw: &'de RawValue = map.next_value()?;
                repeated |= found.replace(raw).is_some();
            } else {
                map.next_value::<IgnoredAny>()?;
            }
        }
        Ok(if repeated { None } else { found })
    }
}

/// Compares an object key with the one sought, without allocating for it.
struct KeyIs<'k>(&'k str);

impl<'de> DeserializeSeed<'de> for KeyIs<'_> {
    type Value = bool;

    fn deserialize<D: de::Deserializer<'de>>(self, d: D) -> Result<bool, D::Error> {
        d.deserialize_str(self)
    }
}

impl Visitor<'_> for KeyIs<'_> {
    type Value = bool;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("an object key")
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<bool, E> {
        Ok(v == self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use serde_json::{json, Map, Value};

    #[test]
    fn edits_one_value_and_reads_another() {
        let body = br#"{ "model" : "claude-opus-4-1", "max_tokens":8192,"messages":[]}"#;
        let edited = replace_value(body, "model", "claude-sonnet-4-5").unwrap();
        assert_eq!(
            &edited[..],
            br#"{ "model" : "claude-sonnet-4-5", "max_tokens":8192,"messages":[]}"#
        );
        assert_eq!(read_value::<u64>(&edited, "max_tokens"), Some(8192));
        assert_eq!(replace_value(b"[1, 2]", "model", "x"), None);
    }

    #[test]
    fn replaces_only_the_value() {
        let body = b"{\n  \"model\":\t\"a\" ,\"x\":{\"model\":\"nested\"}}\n";
        let out = replace_value(body, "model", "bb").unwrap();
        assert_eq!(
            &out[..],
            b"{\n  \"model\":\t\"bb\" ,\"x\":{\"model\":\"nested\"}}\n"
        );
        let out = replace_value(body, "x", &json!(7)).unwrap();
        assert_eq!(&out[..], b"{\n  \"model\":\t\"a\" ,\"x\":7}\n");
    }

    #[test]
    fn escaped_keys_match_after_unescaping() {
        let body = br#"{"mod\u0065l":"a","n":1}"#;
        assert_eq!(read_value::<String>(body, "model").as_deref(), Some("a"));
        let out = replace_value(body, "model", "b").unwrap();
        assert_eq!(&out[..], br#"{"mod\u0065l":"b","n":1}"#);
    }

    #[test]
    fn anything_but_one_object_with_the_key_once_is_left_alone() {
        for body in [
            &b"[1,2]"[..],
            b"\"model\"",
            b"12",
            b"",
            b"not json",
            b"{\"model\":\"a\"",
            b"{\"model\":\"a\"} {}",
            b"{\"model\":\"a\",\"model\":\"b\"}",
            b"{\"other\":1}",
            b"{\"x\":{\"model\":\"a\"}}",
            b"\xff\xfe",
        ] {
            assert_eq!(value_span(body, "model"), None, "{body:?}");
            assert_eq!(replace_value(body, "model", "z"), None, "{body:?}");
        }
    }

    #[test]
    fn read_value_checks_the_type() {
        let body = br#"{"max_tokens":"many","thinking":{"type":"enabled","budget_tokens":4000}}"#;
        assert_eq!(read_value::<u64>(body, "max_tokens"), None);
        #[derive(Deserialize)]
        struct Thinking {
            budget_tokens: u64,
        }
        let t: Thinking = read_value(body, "thinking").unwrap();
        assert_eq!(t.budget_tokens, 4000);
    }

    fn key() -> impl Strategy<Value = String> {
        prop_oneof![
            Just("model".to_owned()),
            Just("max_tokens".to_owned()),
            Just("mo\"del".to_owned()),
            Just("model\n".to_owned()),
            "\\PC{0,6}",
            ".{0,6}",
        ]
    }

    fn value() -> impl Strategy<Value = Value> {
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::from),
            any::<i64>().prop_map(Value::from),
            any::<u64>().prop_map(Value::from),
            (-1e12f64..1e12).prop_map(Value::from),
            ".{0,12}".prop_map(Value::from),
        ];
        leaf.prop_recursive(4, 48, 6, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..5).prop_map(Value::Array),
                prop::collection::vec((key(), inner), 0..5)
                    .prop_map(|kv| Value::Object(kv.into_iter().collect())),
            ]
        })
    }

    /// A JSON object with `target` among its keys, and how to write it out.
    fn document() -> impl Strategy<Value = (Map<String, Value>, String, bool)> {
        (
            prop::collection::vec((key(), value()), 0..8),
            key(),
            value(),
            any::<bool>(),
        )
            .prop_map(|(kv, target, v, pretty)| {
                let mut map: Map<String, Value> = kv.into_iter().collect();
                map.insert(target.clone(), v);
                (map, target, pretty)
            })
    }

    fn render(map: &Map<String, Value>, pretty: bool) -> Vec<u8> {
        if pretty {
            serde_json::to_vec_pretty(map).unwrap()
        } else {
            serde_json::to_vec(map).unwrap()
        }
    }

    proptest! {
        #[test]
        fn only_the_target_span_changes((map, target, pretty) in document(), new in value()) {
            let text = render(&map, pretty);
            let span = value_span(&text, &target).expect("the key is present once");
            let old: Value = serde_json::from_slice(&text[span.clone()]).unwrap();
            prop_assert_eq!(&old, &serde_json::from_slice::<Value>(
                &serde_json::to_vec(&map[&target]).unwrap()).unwrap());

            let out = replace_value(&text, &target, &new).unwrap();
            let new_text = serde_json::to_vec(&new).unwrap();
            prop_assert_eq!(out.len(), text.len() - span.len() + new_text.len());
            prop_assert_eq!(&out[..span.start], &text[..span.start]);
            prop_assert_eq!(&out[span.start..span.start + new_text.len()], &new_text[..]);
            prop_assert_eq!(&out[span.start + new_text.len()..], &text[span.end..]);

            // It parses, and reads as the original with the one value swapped.
            let mut want: Value = serde_json::from_slice(&text).unwrap();
            want[&target] = serde_json::from_slice(&new_text).unwrap();
            let got: Value = serde_json::from_slice(&out).unwrap();
            prop_assert_eq!(got, want);
        }

        #[test]
        fn a_missing_key_leaves_the_body_alone((mut map, target, pretty) in document()) {
            map.remove(&target);
            let text = render(&map, pretty);
            prop_assert_eq!(value_span(&text, &target), None);
            prop_assert_eq!(replace_value(&text, &target, &1), None);
        }

        #[test]
        fn a_body_that_is_not_an_object_is_left_alone(v in value(), key in key()) {
            prop_assume!(!v.is_object());
            let text = serde_json::to_vec(&v).unwrap();
            prop_assert_eq!(replace_value(&text, &key, &1), None);
        }
    }
}
