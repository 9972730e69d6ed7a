//! The invalid-package corpus (`conformance/invalid-packages/`): each case is
//! a declarative mutation of a real, valid package; validation must report
//! the expected codes, and the full diagnostics are snapshot-tested
//! (`golden/validator/`, reviewed with `cargo insta review`).

mod support;

use std::path::PathBuf;

use onnx_genai_package::{validate, Package, Severity};
use support::{apply, build, load_case, shipped_packages, workspace, Layout};

fn cases() -> Vec<PathBuf> {
    let mut cases: Vec<PathBuf> = std::fs::read_dir(workspace().join("conformance/invalid-packages"))
        .unwrap()
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    cases.sort();
    cases
}

#[test]
fn corpus_is_large_enough() {
    let cases: Vec<_> = cases().iter().map(|p| load_case(p)).collect();
    let genai = cases.iter().filter(|c| c.layout == Layout::Genai).count();
    assert!(cases.len() - genai >= 15, "at least 15 native cases");
    assert!(genai >= 3, "at least 3 genai_config.json cases");
}

/// Every shipped package, in both layouts, validates with no diagnostics at
/// all — so each corpus case's diagnostics come from its mutation alone.
#[test]
fn shipped_packages_are_clean_in_both_layouts() {
    for name in shipped_packages() {
        let spec = onnx_genai_build::read_spec(&support::spec_path(&name)).unwrap();
        let dtype_bytes = match spec.dtype {
            onnx_genai_package::ElementType::F32 => 4,
            onnx_genai_package::ElementType::F16 => 2,
        };
        let expected_bytes = 2 * u64::from(spec.num_layers * spec.kv_heads() * spec.head_dim()) * dtype_bytes;
        let mut geometries = Vec::new();
        // ONNX Runtime GenAI's config describes a decode core; a
        // vision-language workflow package has only the native layout.
        let layouts = if spec.vision.is_some() {
            vec![Layout::Native]
        } else if spec.variants().contains(&onnx_genai_build::Variant::Genai) {
            vec![Layout::Native, Layout::Genai, Layout::OrtGenai]
        } else {
            vec![Layout::Native, Layout::Genai]
        };
        for layout in layouts {
            let dir = tempfile::tempdir().unwrap();
            build(&name, layout, dir.path());
            let (report, _) = validate(dir.path());
            assert!(report.diagnostics.is_empty(), "{name} ({layout:?}):\n{report}");
            if layout == Layout::OrtGenai {
                // Their int4 CPU export keeps an f32 KV cache whatever the weights.
                continue;
            }
            let geometry =
                Package::open(dir.path()).unwrap().kv_geometry().expect("shipped packages declare a KV cache");
            assert_eq!(geometry.bytes_per_token(), expected_bytes, "{name} ({layout:?})");
            geometries.push(geometry);
        }
        // The genai import reads the KV dtype from the graph; it must land on
        // the same geometry the native manifest declares.
        assert!(geometries.windows(2).all(|w| w[0] == w[1]), "{name}: native and genai layouts disagree");
    }
}

#[test]
fn every_corpus_case_reports_its_codes() {
    let mut failures = Vec::new();
    for path in cases() {
        let case = load_case(&path);
        let stem = path.file_stem().unwrap().to_string_lossy().into_owned();
        let scratch = tempfile::tempdir().unwrap();
        let dir = scratch.path().join("pkg");
        build(&case.base, case.layout, &dir);
        for m in &case.mutations {
            apply(&dir, m);
        }
        let (report, _) = validate(&dir);
        let codes: Vec<String> = report.diagnostics.iter().map(|d| d.code.to_string()).collect();
        for want in &case.expect {
            if !codes.contains(want) {
                failures.push(format!("{stem}: expected {want}, got {codes:?}\n{report}"));
            }
        }
        if !report.has_errors() {
            failures.push(format!("{stem}: no error-level diagnostic"));
        }
        // Opening refuses what validation rejects, carrying the same report.
        match Package::open(&dir) {
            Ok(_) => failures.push(format!("{stem}: Package::open accepted an invalid package")),
            Err(e) => assert!(e.to_string().contains(&report.errors().next().unwrap().message), "{stem}: {e}"),
        }
        for d in &report.diagnostics {
            assert!(!d.hint.is_empty(), "{stem}: {} has no hint", d.code);
            assert!(!d.file.is_empty(), "{stem}: {} names no file", d.code);
        }
        let mut snapshot = format!("# {}\n", case.description);
        for d in &report.diagnostics {
            let sev = if d.severity == Severity::Error { "error" } else { "warning" };
            snapshot
                .push_str(&format!("{sev} {} {} @ {}\n  {}\n  hint: {}\n", d.code, d.file, d.field, d.message, d.hint));
        }
        insta::with_settings!({
            snapshot_path => workspace().join("golden/validator"),
            prepend_module_to_snapshot => false,
            omit_expression => true,
        }, {
            insta::assert_snapshot!(stem, snapshot);
        });
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
