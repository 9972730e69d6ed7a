//! Builds real packages and applies declarative mutations to them (the
//! invalid-package corpus format, `conformance/invalid-packages/*.yaml`).

#![allow(dead_code)]

use std::path::{Path, PathBuf};

use serde::Deserialize;

pub fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

pub fn spec_path(name: &str) -> PathBuf {
    workspace().join("packages").join(name).join("spec.yaml")
}

/// The shipped packages' names; never empty (a loop over none would pass
/// without checking anything).
pub fn shipped_packages() -> Vec<String> {
    let names: Vec<String> = onnx_genai_build::spec_files(&workspace().join("packages"))
        .unwrap()
        .iter()
        .filter_map(|p| p.parent()?.file_name().map(|n| n.to_string_lossy().into_owned()))
        .collect();
    assert!(names.len() >= 4, "expected the shipped packages under packages/, found {names:?}");
    names
}

#[derive(Clone, Copy, Debug, Deserialize, PartialEq)]
#[serde(rename_all = "lowercase")]
pub enum Layout {
    Native,
    /// The decomposed graph described by a `genai_config.json` only.
    Genai,
    /// The builder's `genai` export: what ONNX Runtime GenAI's own model
    /// builder writes.
    OrtGenai,
    /// The builder's `contrib` export (com.microsoft ops, 4-bit weights),
    /// with the native manifest.
    Contrib,
}

/// Builds `name` into `dir` in the given layout.
pub fn build(name: &str, layout: Layout, dir: &Path) {
    let spec = onnx_genai_build::read_spec(&spec_path(name)).unwrap();
    let variant = match layout {
        Layout::OrtGenai => Some(onnx_genai_build::Variant::Genai),
        Layout::Contrib => Some(onnx_genai_build::Variant::Contrib),
        Layout::Native | Layout::Genai => None,
    };
    if let Some(variant) = variant {
        onnx_genai_build::build_variant(&spec, variant, dir).unwrap();
        return;
    }
    onnx_genai_build::build_package(&spec, dir).unwrap();
    if layout == Layout::Genai {
        let config = onnx_genai_build::genai_config::genai_config(&spec, onnx_genai_build::Variant::Contrib);
        std::fs::write(dir.join("genai_config.json"), config).unwrap();
        std::fs::remove_file(dir.join("package.yaml")).unwrap();
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Case {
    pub description: String,
    pub base: String,
    #[serde(default = "native")]
    pub layout: Layout,
    pub mutations: Vec<Mutation>,
    /// Codes that must be among the diagnostics.
    pub expect: Vec<String>,
}

fn native() -> Layout {
    Layout::Native
}

#[derive(Debug, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case", deny_unknown_fields)]
pub enum Mutation {
    Set {
        file: String,
        path: String,
        value: serde_json::Value,
    },
    Remove {
        file: String,
        path: String,
    },
    Rename {
        file: String,
        path: String,
        to: String,
    },
    Delete {
        file: String,
    },
    Write {
        file: String,
        text: String,
    },
    Truncate {
        file: String,
        bytes: usize,
    },
    /// Replace `file` with a named pipe (nothing ever writes to it).
    Fifo {
        file: String,
    },
    /// Replace `file` with a symlink to a copy of it outside the package.
    SymlinkOutside {
        file: String,
    },
    /// Rewrite the ONNX `file` with its initializers in `<file>.data`
    /// (external data).
    Externalize {
        file: String,
    },
    /// Point every external initializer of the ONNX `file` at `location`.
    ExternalLocation {
        file: String,
        location: String,
    },
}

pub fn load_case(path: &Path) -> Case {
    let text = std::fs::read_to_string(path).unwrap();
    serde_yaml_ng::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

pub fn apply(dir: &Path, mutation: &Mutation) {
    match mutation {
        Mutation::Set { file, path, value } => edit(dir, file, |tree| {
            let (parent, key) = navigate(tree, path);
            match (parent, key) {
                (serde_json::Value::Object(map), Key::Name(k)) => {
                    map.insert(k, value.clone());
                }
                (serde_json::Value::Array(items), Key::Index(i)) => items[i] = value.clone(),
                _ => panic!("cannot set {path}"),
            }
        }),
        Mutation::Remove { file, path } => edit(dir, file, |tree| match navigate(tree, path) {
            (serde_json::Value::Object(map), Key::Name(k)) => {
                map.remove(&k).unwrap_or_else(|| panic!("no {path}"));
            }
            (serde_json::Value::Array(items), Key::Index(i)) => {
                items.remove(i);
            }
            _ => panic!("cannot remove {path}"),
        }),
        Mutation::Rename { file, path, to } => edit(dir, file, |tree| match navigate(tree, path) {
            (serde_json::Value::Object(map), Key::Name(k)) => {
                let v = map.remove(&k).unwrap_or_else(|| panic!("no {path}"));
                map.insert(to.clone(), v);
            }
            _ => panic!("cannot rename {path}"),
        }),
        Mutation::Delete { file } => std::fs::remove_file(dir.join(file)).unwrap(),
        Mutation::Write { file, text } => std::fs::write(dir.join(file), text).unwrap(),
        Mutation::Truncate { file, bytes } => {
            let data = std::fs::read(dir.join(file)).unwrap();
            std::fs::write(dir.join(file), &data[..*bytes.min(&data.len())]).unwrap();
        }
        Mutation::Externalize { file } => {
            let model = onnx_genai_onnx::read_model(&dir.join(file)).unwrap();
            onnx_genai_onnx::write_model_external(&dir.join(file), &model, 1024).unwrap();
        }
        Mutation::ExternalLocation { file, location } => {
            use prost::Message;
            let path = dir.join(file);
            let mut proto =
                onnx_genai_onnx::proto::ModelProto::decode(std::fs::read(&path).unwrap().as_slice()).unwrap();
            for t in &mut proto.graph.as_mut().unwrap().initializer {
                for e in t.external_data.iter_mut().filter(|e| e.key == "location") {
                    e.value = location.clone();
                }
            }
            std::fs::write(&path, proto.encode_to_vec()).unwrap();
        }
        Mutation::Fifo { file } => {
            let path = dir.join(file);
            std::fs::remove_file(&path).unwrap();
            let made = std::process::Command::new("mkfifo").arg(&path).status().unwrap();
            assert!(made.success(), "mkfifo {}", path.display());
        }
        Mutation::SymlinkOutside { file } => {
            let outside = dir.parent().unwrap().join(format!("outside-{file}"));
            std::fs::rename(dir.join(file), &outside).unwrap();
            std::os::unix::fs::symlink(&outside, dir.join(file)).unwrap();
        }
    }
}

enum Key {
    Name(String),
    Index(usize),
}

fn split(path: &str) -> Vec<Key> {
    let mut keys = Vec::new();
    for part in path.split('.') {
        let (name, rest) = part.split_once('[').map_or((part, ""), |(n, r)| (n, r));
        if !name.is_empty() {
            keys.push(Key::Name(name.to_string()));
        }
        for idx in rest.split('[').filter(|s| !s.is_empty()) {
            keys.push(Key::Index(idx.trim_end_matches(']').parse().unwrap()));
        }
    }
    keys
}

fn navigate<'a>(tree: &'a mut serde_json::Value, path: &str) -> (&'a mut serde_json::Value, Key) {
    let mut keys = split(path);
    let last = keys.pop().expect("empty path");
    let mut node = tree;
    for k in keys {
        node = match k {
            Key::Name(n) => node.get_mut(&n).unwrap_or_else(|| panic!("no `{n}` in {path}")),
            Key::Index(i) => node.get_mut(i).unwrap_or_else(|| panic!("no [{i}] in {path}")),
        };
    }
    (node, last)
}

fn edit(dir: &Path, file: &str, f: impl FnOnce(&mut serde_json::Value)) {
    let path = dir.join(file);
    let text = std::fs::read_to_string(&path).unwrap();
    let json = file.ends_with(".json");
    let mut tree: serde_json::Value =
        if json { serde_json::from_str(&text).unwrap() } else { serde_yaml_ng::from_str(&text).unwrap() };
    f(&mut tree);
    let out =
        if json { serde_json::to_string_pretty(&tree).unwrap() } else { serde_yaml_ng::to_string(&tree).unwrap() };
    std::fs::write(&path, out).unwrap();
}
