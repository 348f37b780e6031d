//! Reading and splicing one top-level value of a JSON body, written apart from the crate's own
//! editor so that the tests check its output against a second implementation.

use std::collections::BTreeMap;
use std::ops::Range;

use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;

/// The byte range of the value of the top-level `key`, when `json` is one object that has it.
pub fn value_span(json: &[u8], key: &str) -> Option<Range<usize>> {
    let map: BTreeMap<String, &RawValue> = serde_json::from_slice(json).ok()?;
    let text = map.get(key)?.get();
    // The raw value borrows from `json`, so its address gives its offset.
    let start = text.as_ptr() as usize - json.as_ptr() as usize;
    Some(start..start + text.len())
}

/// The value of the top-level `key` as a `T`.
pub fn read_value<'a, T: Deserialize<'a>>(json: &'a [u8], key: &str) -> Option<T> {
    serde_json::from_slice(&json[value_span(json, key)?]).ok()
}

/// `json` with the value of the top-level `key` replaced by `value`, serialized compactly.
pub fn replace_value<T: Serialize + ?Sized>(json: &[u8], key: &str, value: &T) -> Option<Vec<u8>> {
    let span = value_span(json, key)?;
    let mut out = json[..span.start].to_vec();
    out.extend_from_slice(&serde_json::to_vec(value).ok()?);
    out.extend_from_slice(&json[span.end..]);
    Some(out)
}
