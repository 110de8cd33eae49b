//! The host crate's modules import each other in layers, without cycles (`host/src/lib.rs` lists
//! the layers; STYLE.md, "A host without cycles"). This test reads `host/src/**/*.rs`, builds the
//! graph of `crate::…` references between the top-level modules (a folder counts as one module;
//! a name re-exported by `lib.rs` counts as the module it comes from), and fails when
//!
//! - a module of a lower layer uses one of a higher layer,
//! - modules use each other in a ring (also within one layer),
//! - the files of a layered folder (`runtime/`, `ops/`) use each other in a ring, or
//! - `lib.rs` declares a module that no layer below lists.
//!
//! Needs no GPU and no build of the host crate: it reads the sources.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};

/// The layers, lowest first, and their top-level modules. A new module goes into one of them.
const LAYERS: &[(&str, &[&str])] = &[
    ("base", &["error", "dtype", "device", "layout", "problem"]),
    ("registry", &["kernels", "select"]),
    ("runtime", &["runtime"]),
    ("ops", &["ops"]),
    ("top", &["io", "cpu", "check", "tune", "cli", "vit"]),
];

/// Folders whose files must not use each other in a ring either.
const ACYCLIC_FOLDERS: &[&str] = &["runtime", "ops"];

fn src_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("host").join("src")
}

/// Every `.rs` file under `dir`, recursively.
fn rust_files(dir: &Path) -> Vec<PathBuf> {
    let mut files = Vec::new();
    for entry in fs::read_dir(dir).unwrap_or_else(|e| panic!("reading {}: {e}", dir.display())) {
        let path = entry.unwrap().path();
        if path.is_dir() {
            files.extend(rust_files(&path));
        } else if path.extension().is_some_and(|e| e == "rs") {
            files.push(path);
        }
    }
    files.sort();
    files
}

/// The source without comments (line, doc and block comments) and without the contents of string
/// literals, so that a path mentioned in prose or a message is not a dependency.
fn code_of(source: &str) -> String {
    let mut out = String::with_capacity(source.len());
    let chars: Vec<char> = source.chars().collect();
    let mut i = 0;
    while i < chars.len() {
        match (chars[i], chars.get(i + 1).copied()) {
            ('/', Some('/')) => {
                while i < chars.len() && chars[i] != '\n' {
                    i += 1;
                }
            }
            ('/', Some('*')) => {
                let mut depth = 0;
                while i < chars.len() {
                    if chars[i] == '/' && chars.get(i + 1) == Some(&'*') {
                        depth += 1;
                        i += 2;
                    } else if chars[i] == '*' && chars.get(i + 1) == Some(&'/') {
                        depth -= 1;
                        i += 2;
                        if depth == 0 {
                            break;
                        }
                    } else {
                        i += 1;
                    }
                }
            }
            ('"', _) => {
                out.push('"');
                i += 1;
                while i < chars.len() && chars[i] != '"' {
                    i += if chars[i] == '\\' { 2 } else { 1 };
                }
                out.push('"');
                i += 1;
            }
            // A char literal such as '"' or '{' (not a lifetime: those have no closing quote).
            ('\'', _) if chars.get(i + 2) == Some(&'\'') || chars.get(i + 1) == Some(&'\\') => {
                // After a backslash the closing quote comes from the fourth character on ('\\').
                let from = if chars[i + 1] == '\\' { i + 3 } else { i + 2 };
                let end = (from..chars.len()).find(|&j| chars[j] == '\'').unwrap_or(chars.len() - 1);
                out.push_str("' '");
                i = end + 1;
            }
            (c, _) => {
                out.push(c);
                i += 1;
            }
        }
    }
    out
}

fn is_ident(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_'
}

/// The first path segments after `prefix::` in `code`: for `prefix::a::b` that is `a`, for
/// `prefix::{a::x, B, c}` it is `a`, `B` and `c` (nested groups are not entered).
fn segments_after(code: &str, prefix: &str) -> Vec<String> {
    let pattern = format!("{prefix}::");
    let mut names = Vec::new();
    let mut start = 0;
    while let Some(at) = code[start..].find(&pattern) {
        let at = start + at;
        start = at + pattern.len();
        // `prefix` must be a whole path segment (not the end of `my_crate::`).
        if code[..at].chars().next_back().is_some_and(|c| is_ident(c) || c == ':') {
            continue;
        }
        let rest = &code[start..];
        if let Some(group) = rest.strip_prefix('{') {
            let mut depth = 0;
            let mut item_start = true;
            let mut chars = group.char_indices().peekable();
            while let Some((i, c)) = chars.next() {
                match c {
                    '{' => depth += 1,
                    '}' if depth == 0 => break,
                    '}' => depth -= 1,
                    ',' if depth == 0 => item_start = true,
                    c if is_ident(c) && depth == 0 && item_start => {
                        let name: String = group[i..].chars().take_while(|&c| is_ident(c)).collect();
                        for _ in 1..name.chars().count() {
                            chars.next();
                        }
                        names.push(name);
                        item_start = false;
                    }
                    _ => {}
                }
            }
        } else {
            let name: String = rest.chars().take_while(|&c| is_ident(c)).collect();
            if !name.is_empty() {
                names.push(name);
            }
        }
    }
    names
}

/// `lib.rs`'s modules and, for every name it re-exports from one of them, that module.
fn lib_declarations(lib: &str) -> (BTreeSet<String>, BTreeMap<String, String>) {
    let code = code_of(lib);
    let mut modules = BTreeSet::new();
    let mut reexports = BTreeMap::new();
    for line in code.lines().map(str::trim) {
        let line = line.strip_prefix("pub(crate) ").or_else(|| line.strip_prefix("pub ")).unwrap_or(line);
        if let Some(name) = line.strip_prefix("mod ") {
            modules.insert(name.trim_end_matches(';').trim().to_string());
        } else if let Some(path) = line.strip_prefix("use ") {
            let path = path.trim_end_matches(';');
            let Some((module, items)) = path.split_once("::") else { continue };
            let items = items.trim_start_matches('{').trim_end_matches('}');
            for item in items.split(',') {
                let item = item.trim();
                let name = item.rsplit(" as ").next().unwrap_or(item).rsplit("::").next().unwrap_or(item);
                reexports.insert(name.trim().to_string(), module.to_string());
            }
        }
    }
    reexports.retain(|_, module| modules.contains(module));
    (modules, reexports)
}

/// The top-level module of a file under `src` (`runtime/context.rs` → `runtime`), and the
/// file's own module inside its folder (`context`; `None` for a top-level file or a `mod.rs`).
fn module_of(src: &Path, file: &Path) -> (String, Option<String>) {
    let relative = file.strip_prefix(src).unwrap();
    let parts: Vec<String> = relative.iter().map(|p| p.to_string_lossy().trim_end_matches(".rs").to_string()).collect();
    let inner = if parts.len() > 1 && parts[1] != "mod" { Some(parts[1].clone()) } else { None };
    (parts[0].clone(), inner)
}

/// A cycle in `edges`, if there is one, as the modules along it.
fn find_cycle(edges: &BTreeMap<String, BTreeSet<String>>) -> Option<Vec<String>> {
    fn visit(
        node: &str,
        edges: &BTreeMap<String, BTreeSet<String>>,
        state: &mut BTreeMap<String, u8>,
        path: &mut Vec<String>,
    ) -> Option<Vec<String>> {
        state.insert(node.to_string(), 1);
        path.push(node.to_string());
        for next in edges.get(node).into_iter().flatten() {
            match state.get(next.as_str()).copied().unwrap_or(0) {
                1 => {
                    let start = path.iter().position(|n| n == next).unwrap();
                    let mut cycle = path[start..].to_vec();
                    cycle.push(next.clone());
                    return Some(cycle);
                }
                0 => {
                    if let Some(cycle) = visit(next, edges, state, path) {
                        return Some(cycle);
                    }
                }
                _ => {}
            }
        }
        path.pop();
        state.insert(node.to_string(), 2);
        None
    }
    let mut state = BTreeMap::new();
    for node in edges.keys() {
        if state.get(node.as_str()).copied().unwrap_or(0) == 0 {
            let mut path = Vec::new();
            if let Some(cycle) = visit(node, edges, &mut state, &mut path) {
                return Some(cycle);
            }
        }
    }
    None
}

/// Where each reference comes from, for the failure messages: (from, to) → a file that has it.
type Evidence = BTreeMap<(String, String), String>;

struct Graph {
    /// Top-level module → the top-level modules it uses.
    modules: BTreeMap<String, BTreeSet<String>>,
    /// Folder → (file module → the sibling file modules it uses).
    folders: BTreeMap<String, BTreeMap<String, BTreeSet<String>>>,
    evidence: Evidence,
}

fn graph() -> Graph {
    let src = src_dir();
    let lib = fs::read_to_string(src.join("lib.rs")).expect("host/src/lib.rs");
    let (declared, reexports) = lib_declarations(&lib);
    let mut graph = Graph { modules: BTreeMap::new(), folders: BTreeMap::new(), evidence: BTreeMap::new() };
    for module in &declared {
        graph.modules.entry(module.clone()).or_default();
    }
    let resolve = |name: &str| -> Option<String> {
        if declared.contains(name) { Some(name.to_string()) } else { reexports.get(name).cloned() }
    };
    for file in rust_files(&src) {
        let (module, inner) = module_of(&src, &file);
        if module == "lib" {
            continue;
        }
        let code = code_of(&fs::read_to_string(&file).unwrap());
        let shown = file.strip_prefix(&src).unwrap().display().to_string();
        for name in segments_after(&code, "crate") {
            if let Some(target) = resolve(&name).filter(|t| *t != module) {
                graph.evidence.entry((module.clone(), target.clone())).or_insert_with(|| shown.clone());
                graph.modules.entry(module.clone()).or_default().insert(target);
            }
        }
        // Siblings inside a folder: `super::sibling::…` from a file of the folder, or
        // `crate::folder::sibling::…` from anywhere in it.
        if let Some(inner) = inner {
            let folder_dir = src.join(&module);
            let is_sibling = |name: &str| {
                name != inner && (folder_dir.join(format!("{name}.rs")).exists() || folder_dir.join(name).is_dir())
            };
            let mut siblings: Vec<String> = segments_after(&code, "super");
            siblings.extend(segments_after(&code, &format!("crate::{module}")));
            for name in siblings.into_iter().filter(|n| is_sibling(n)) {
                let key = (format!("{module}/{inner}"), format!("{module}/{name}"));
                graph.evidence.entry(key).or_insert_with(|| shown.clone());
                graph.folders.entry(module.clone()).or_default().entry(inner.clone()).or_default().insert(name);
            }
        }
    }
    graph
}

fn layer_of(module: &str) -> Option<(usize, &'static str)> {
    LAYERS.iter().enumerate().find(|(_, (_, modules))| modules.contains(&module)).map(|(i, (name, _))| (i, *name))
}

#[test]
fn every_host_module_has_a_layer() {
    let graph = graph();
    let unplaced: Vec<&String> = graph.modules.keys().filter(|m| layer_of(m).is_none()).collect();
    assert!(
        unplaced.is_empty(),
        "host/src/lib.rs declares {unplaced:?}, which no layer of tests/module_layers.rs lists: add each to \
         the layer it belongs to (base, registry, runtime, ops, top)"
    );
}

#[test]
fn host_modules_import_only_from_their_layer_or_below() {
    let graph = graph();
    let mut wrong = Vec::new();
    for (from, targets) in &graph.modules {
        let Some((from_layer, from_name)) = layer_of(from) else { continue };
        for to in targets {
            let Some((to_layer, to_name)) = layer_of(to) else { continue };
            if to_layer > from_layer {
                let file = &graph.evidence[&(from.clone(), to.clone())];
                wrong.push(format!("`{from}` ({from_name}) uses `crate::{to}` ({to_name}), in host/src/{file}"));
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "modules use a higher layer (layers, lowest first: base, registry, runtime, ops, top):\n  {}",
        wrong.join("\n  ")
    );
}

#[test]
fn host_modules_have_no_import_cycle() {
    let graph = graph();
    if let Some(cycle) = find_cycle(&graph.modules) {
        let steps: Vec<String> = cycle
            .windows(2)
            .map(|pair| {
                let file = &graph.evidence[&(pair[0].clone(), pair[1].clone())];
                format!("`{}` uses `{}` (host/src/{file})", pair[0], pair[1])
            })
            .collect();
        panic!("host/src has an import cycle: {}\n  {}", cycle.join(" -> "), steps.join("\n  "));
    }
    for folder in ACYCLIC_FOLDERS {
        let edges = graph.folders.get(*folder).cloned().unwrap_or_default();
        if let Some(cycle) = find_cycle(&edges) {
            panic!("host/src/{folder}/ has an import cycle between its files: {}", cycle.join(" -> "));
        }
    }
}

#[test]
fn the_checker_sees_references_and_cycles() {
    // Guards against a checker that would pass everything: its parts on known inputs.
    let code = code_of("use crate::{a::X, B, c}; // crate::d\nlet s = \"crate::e\"; crate::f::g(); my_crate::h;");
    assert_eq!(segments_after(&code, "crate"), ["a", "B", "c", "f"]);
    let ring: BTreeMap<String, BTreeSet<String>> = [("x", "y"), ("y", "z"), ("z", "x")]
        .into_iter()
        .map(|(a, b)| (a.to_string(), BTreeSet::from([b.to_string()])))
        .collect();
    assert_eq!(find_cycle(&ring).map(|c| c.len()), Some(4));
    let graph = graph();
    // The registry reads the base types, and lib.rs's re-exports are followed.
    assert!(graph.modules["kernels"].contains("problem"), "{:?}", graph.modules["kernels"]);
    assert!(graph.modules["ops"].contains("runtime"), "{:?}", graph.modules["ops"]);
}
