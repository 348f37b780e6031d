//! JSON text with object fields in the order they are written.
//!
//! `serde_json::Value` sorts object keys unless some crate in the build turns
//! on its `preserve_order` feature, so canned bodies built with it could
//! change byte for byte from one build to the next. Writing them in order
//! keeps them stable and shaped like what the real APIs send.

use std::fmt::Write;

/// A value that can be written as JSON text.
pub(super) trait ToJson {
    fn write_json(&self, out: &mut String);
}

/// Text that already is JSON.
#[derive(Clone, Debug)]
pub(super) struct Raw(pub(super) String);

/// JSON `null`.
#[derive(Clone, Copy, Debug)]
pub(super) struct Null;

impl Raw {
    pub(super) fn into_string(self) -> String {
        self.0
    }
}

impl ToJson for Raw {
    fn write_json(&self, out: &mut String) {
        out.push_str(&self.0);
    }
}

impl ToJson for Null {
    fn write_json(&self, out: &mut String) {
        out.push_str("null");
    }
}

impl ToJson for str {
    fn write_json(&self, out: &mut String) {
        // Escaping is the one part worth not writing by hand.
        out.push_str(&serde_json::Value::from(self).to_string());
    }
}

impl ToJson for String {
    fn write_json(&self, out: &mut String) {
        self.as_str().write_json(out);
    }
}

impl<T: ToJson> ToJson for Option<T> {
    fn write_json(&self, out: &mut String) {
        match self {
            Some(value) => value.write_json(out),
            None => Null.write_json(out),
        }
    }
}

impl<T: ToJson + ?Sized> ToJson for &T {
    fn write_json(&self, out: &mut String) {
        (**self).write_json(out);
    }
}

macro_rules! integers {
    ($($ty:ty),*) => {$(
        impl ToJson for $ty {
            fn write_json(&self, out: &mut String) {
                let _ = write!(out, "{self}");
            }
        }
    )*};
}

integers!(i32, u32, u64, usize);

/// Builds a [`Raw`] JSON object: `object! { "key": value, ... }`.
macro_rules! object {
    ($($key:literal : $value:expr),* $(,)?) => {{
        #[allow(unused_mut)]
        let mut out = ::std::string::String::from("{");
        $(
            if out.len() > 1 {
                out.push(',');
            }
            $crate::mock::json::ToJson::write_json($key, &mut out);
            out.push(':');
            $crate::mock::json::ToJson::write_json(&$value, &mut out);
        )*
        out.push('}');
        $crate::mock::json::Raw(out)
    }};
}

/// Builds a [`Raw`] JSON array: `array![value, ...]`.
macro_rules! array {
    ($($value:expr),* $(,)?) => {{
        #[allow(unused_mut)]
        let mut out = ::std::string::String::from("[");
        $(
            if out.len() > 1 {
                out.push(',');
            }
            $crate::mock::json::ToJson::write_json(&$value, &mut out);
        )*
        out.push(']');
        $crate::mock::json::Raw(out)
    }};
}

pub(super) use {array, object};
