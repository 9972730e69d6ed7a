//! YAML read into JSON values under bounds. serde_yaml_ng caps how many
//! times aliases may be followed, not what they expand to: one anchored
//! list of 200,000 items named 200,000 times (a 1 MB file) expanded to 4
//! x 10^10 values and took the machine's memory before any check ran.
//! Every value the reader builds, and every byte of its strings, is
//! counted here as the document is read, aliases' copies included.

use std::cell::Cell;
use std::fmt;

use serde::de::{self, DeserializeSeed, MapAccess, SeqAccess, Visitor};
use serde_json::{Map, Number, Value};

/// The most values a document may expand to (a package's manifest holds
/// a few thousand at most: per-layer entries of up to 4096 layers).
pub const MAX_VALUES: usize = 1 << 20;

/// The most bytes its strings may hold together (a manifest file is at
/// most 4 MiB; a list of prompts a few).
pub const MAX_STRING_BYTES: usize = 64 << 20;

/// `text` as a JSON value, or the reader's error (with its line and
/// column) or the bound it passed.
pub fn from_str(text: &str) -> Result<Value, serde_yaml_ng::Error> {
    let counts = Counts::default();
    let de = serde_yaml_ng::Deserializer::from_str(text);
    Bounded(&counts).deserialize(de)
}

#[derive(Default)]
struct Counts {
    values: Cell<usize>,
    bytes: Cell<usize>,
}

impl Counts {
    fn value<E: de::Error>(&self, bytes: usize) -> Result<(), E> {
        self.values.set(self.values.get() + 1);
        self.bytes.set(self.bytes.get().saturating_add(bytes));
        if self.values.get() > MAX_VALUES {
            return Err(E::custom(format!(
                "the document expands to more than {MAX_VALUES} values (through YAML aliases?)"
            )));
        }
        if self.bytes.get() > MAX_STRING_BYTES {
            return Err(E::custom(format!(
                "the document's strings expand to more than {MAX_STRING_BYTES} bytes (through YAML aliases?)"
            )));
        }
        Ok(())
    }
}

#[derive(Clone, Copy)]
struct Bounded<'a>(&'a Counts);

impl<'de> DeserializeSeed<'de> for Bounded<'_> {
    type Value = Value;

    fn deserialize<D: de::Deserializer<'de>>(self, deserializer: D) -> Result<Value, D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Bounded<'_> {
    type Value = Value;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a YAML value")
    }

    fn visit_bool<E: de::Error>(self, v: bool) -> Result<Value, E> {
        self.0.value(0)?;
        Ok(Value::Bool(v))
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<Value, E> {
        self.0.value(0)?;
        Ok(Value::Number(v.into()))
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Value, E> {
        self.0.value(0)?;
        Ok(Value::Number(v.into()))
    }

    fn visit_f64<E: de::Error>(self, v: f64) -> Result<Value, E> {
        self.0.value(0)?;
        Ok(Number::from_f64(v).map_or(Value::Null, Value::Number))
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Value, E> {
        self.0.value(v.len())?;
        Ok(Value::String(v.to_string()))
    }

    fn visit_string<E: de::Error>(self, v: String) -> Result<Value, E> {
        self.0.value(v.len())?;
        Ok(Value::String(v))
    }

    fn visit_unit<E: de::Error>(self) -> Result<Value, E> {
        self.0.value(0)?;
        Ok(Value::Null)
    }

    fn visit_none<E: de::Error>(self) -> Result<Value, E> {
        self.visit_unit()
    }

    fn visit_some<D: de::Deserializer<'de>>(self, deserializer: D) -> Result<Value, D::Error> {
        deserializer.deserialize_any(self)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        self.0.value(0)?;
        let mut items = Vec::new();
        while let Some(item) = seq.next_element_seed(self)? {
            items.push(item);
        }
        Ok(Value::Array(items))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        self.0.value(0)?;
        let mut entries = Map::new();
        while let Some(key) = map.next_key::<String>()? {
            self.0.value(key.len())?;
            let value = map.next_value_seed(self)?;
            entries.insert(key, value);
        }
        Ok(Value::Object(entries))
    }
}

#[cfg(test)]
mod tests {
    use super::{from_str, MAX_STRING_BYTES, MAX_VALUES};

    /// The reader gives what serde_yaml_ng gives for a manifest-like
    /// document, anchors and aliases included; a wide anchor named many
    /// times (200 x 200,000 here, 40 million values from 1.6 MB) and a
    /// long string named many times are refused as they expand.
    #[test]
    fn aliases_expand_under_the_bounds() {
        let doc = "a: &a [1, 2.5, \"x\", true, null]\nb: *a\nc: {d: [*a], e: -3}\n";
        let plain: serde_json::Value = serde_yaml_ng::from_str(doc).unwrap();
        assert_eq!(from_str(doc).unwrap(), plain);

        let wide = format!("a: &a [{}]\nb: [{}]\n", vec!["0"; 200_000].join(","), vec!["*a"; 200].join(","));
        let err = from_str(&wide).unwrap_err().to_string();
        assert!(err.contains(&format!("more than {MAX_VALUES} values")), "{err}");
        let long = format!("a: &a \"{}\"\nb: [{}]\n", "x".repeat(1 << 20), vec!["*a"; 100].join(","));
        let err = from_str(&long).unwrap_err().to_string();
        assert!(err.contains(&format!("more than {MAX_STRING_BYTES} bytes")), "{err}");
    }
}
