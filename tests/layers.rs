//! The layers of `src/` hold: no module uses one above it, and no files use each other in a
//! circle.
//!
//! The order is the one `src/lib.rs` writes in its "Layers, top down" list, read from there (the
//! doc and the check cannot drift apart). A file's dependencies are the paths it names from
//! `crate::`, `super::`, `self::` and its own child modules (in `use` trees and inline),
//! resolved to the file that defines the module, comments and string literals left out.
//! - An import points up when its file's top-level module is on a lower line of the list than
//!   the module it names. Modules on one line may use each other.
//! - A circle is two or more files that reach each other. A file's use of a module it is nested
//!   in (a `tests` module's `use super::*`, a child's use of its parent's types) is how Rust
//!   nests modules and is not counted; siblings and cousins are.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

fn src() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("src")
}

/// `src/lib.rs`'s layer list: each top-level module and its line, 0 at the top.
fn layer_order(lib_rs: &str) -> BTreeMap<String, usize> {
    let mut layers = BTreeMap::new();
    let mut in_list = false;
    for line in lib_rs.lines() {
        let Some(doc) = line.strip_prefix("//!") else { continue };
        let doc = doc.trim();
        if doc.starts_with("## ") {
            in_list = doc.starts_with("## Layers, top down");
            continue;
        }
        let Some((number, rest)) = doc.split_once(". ") else { continue };
        let Ok(number) = number.parse::<usize>() else { continue };
        if !in_list {
            continue;
        }
        // the modules are the backticked names before the first colon
        let names = rest.split(':').next().unwrap_or_default();
        for name in names.split('`').skip(1).step_by(2) {
            let name = name.trim_start_matches('[').trim_end_matches(']');
            layers.insert(name.to_string(), number - 1);
        }
    }
    layers
}

/// `text` with comments, string and character literals blanked (newlines kept).
fn code_only(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = String::with_capacity(text.len());
    let mut i = 0;
    while i < bytes.len() {
        let rest = &text[i..];
        let after_word = i > 0 && (bytes[i - 1].is_ascii_alphanumeric() || bytes[i - 1] == b'_');
        let skip_to = |end: usize, out: &mut String| {
            out.push_str(&"\n".repeat(text[i..end].matches('\n').count()));
            end
        };
        if rest.starts_with("//") {
            i = rest.find('\n').map_or(bytes.len(), |n| i + n);
        } else if rest.starts_with("/*") {
            i = skip_to(rest.find("*/").map_or(bytes.len(), |n| i + n + 2), &mut out);
        } else if !after_word && (rest.starts_with("r#") || rest.starts_with("r\"")) {
            let hashes = rest[1..].chars().take_while(|&c| c == '#').count();
            if rest[1 + hashes..].starts_with('"') {
                let close = format!("\"{}", "#".repeat(hashes));
                let body = i + 2 + hashes;
                i = skip_to(
                    text[body..].find(&close).map_or(bytes.len(), |n| body + n + close.len()),
                    &mut out,
                );
            } else {
                out.push('r');
                i += 1;
            }
        } else if bytes[i] == b'"' {
            let mut j = i + 1;
            while j < bytes.len() && bytes[j] != b'"' {
                j += if bytes[j] == b'\\' { 2 } else { 1 };
            }
            i = skip_to((j + 1).min(bytes.len()), &mut out);
        } else if bytes[i] == b'\'' && is_char_literal(rest) {
            i += rest[1..].find('\'').unwrap() + 2;
        } else {
            let c = rest.chars().next().unwrap();
            out.push(c);
            i += c.len_utf8();
        }
    }
    out
}

/// Whether `rest` starts with a character literal (`'a'`, `'\n'`, `'\u{1F600}'`), not a lifetime.
fn is_char_literal(rest: &str) -> bool {
    let mut chars = rest[1..].chars();
    match chars.next() {
        Some('\\') => rest[1..].find('\'').is_some_and(|n| n <= 10),
        Some(_) => chars.next() == Some('\''),
        None => false,
    }
}

/// The paths a `use` tree names: `a::{b, c::d as e}` is `a::b`, `a::c::d`.
fn use_paths(tree: &str, prefix: &[String], out: &mut Vec<Vec<String>>) {
    let tree = tree.trim();
    if let Some(open) = tree.find('{') {
        let mut prefix = prefix.to_vec();
        prefix.extend(segments(&tree[..open]));
        let inner = &tree[open + 1..tree.rfind('}').unwrap_or(tree.len())];
        let (mut depth, mut start) = (0, 0);
        for (at, c) in inner.char_indices() {
            match c {
                '{' => depth += 1,
                '}' => depth -= 1,
                ',' if depth == 0 => {
                    use_paths(&inner[start..at], &prefix, out);
                    start = at + 1;
                }
                _ => {}
            }
        }
        use_paths(&inner[start..], &prefix, out);
    } else if !tree.is_empty() {
        let mut path = prefix.to_vec();
        path.extend(segments(tree.split(" as ").next().unwrap()));
        out.push(path);
    }
}

fn segments(path: &str) -> Vec<String> {
    path.split("::").map(str::trim).filter(|s| !s.is_empty()).map(String::from).collect()
}

/// Every path a file names, with the byte offset it is named at.
fn named_paths(code: &str) -> Vec<(usize, Vec<String>)> {
    let mut found = Vec::new();
    let mut from = 0;
    while let Some(at) = find_word(code, "use", from) {
        // (`+ use<'a>` in a return type is precise capturing, not an import)
        if !code[at + 3..].starts_with(char::is_whitespace) {
            from = at + 3;
            continue;
        }
        let end = code[at..].find(';').map_or(code.len(), |n| at + n);
        let mut paths = Vec::new();
        use_paths(&code[at + 3..end], &[], &mut paths);
        found.extend(paths.into_iter().map(|p| (at, p)));
        from = end;
    }
    // inline paths: `a::b::c` wherever it starts (not after another `::`)
    let is_path_char = |c: char| c.is_ascii_alphanumeric() || c == '_' || c == ':';
    let mut from = 0;
    while let Some(n) = code[from..].find("::") {
        let colons = from + n;
        let start = code[..colons].rfind(|c: char| !is_path_char(c)).map_or(0, |i| i + 1);
        let end = code[colons..].find(|c: char| !is_path_char(c)).map_or(code.len(), |i| colons + i);
        let path = segments(&code[start..end]);
        if path.len() > 1 && !code[start..].starts_with("::") {
            found.push((start, path));
        }
        from = end.max(colons + 2);
    }
    found
}

/// The next `word` at or after `from` that is a whole word.
fn find_word(code: &str, word: &str, mut from: usize) -> Option<usize> {
    let is_word = |c: char| c.is_ascii_alphanumeric() || c == '_';
    while let Some(n) = code[from..].find(word) {
        let at = from + n;
        let before = code[..at].chars().next_back().is_some_and(is_word);
        let after = code[at + word.len()..].chars().next().is_some_and(is_word);
        if !before && !after {
            return Some(at);
        }
        from = at + word.len();
    }
    None
}

/// The inline `mod name { ... }` blocks of a file: (start, end, name).
fn inline_modules(code: &str) -> Vec<(usize, usize, String)> {
    let mut modules = Vec::new();
    let mut from = 0;
    while let Some(at) = find_word(code, "mod", from) {
        from = at + 3;
        let rest = &code[from..];
        let name: String =
            rest.trim_start().chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect();
        let after_name = rest.trim_start()[name.len()..].trim_start();
        if name.is_empty() || !after_name.starts_with('{') {
            continue;
        }
        let open = from + rest.find('{').unwrap();
        let mut depth = 0;
        let mut end = code.len();
        for (n, c) in code[open..].char_indices() {
            depth += match c {
                '{' => 1,
                '}' => -1,
                _ => 0,
            };
            if depth == 0 {
                end = open + n;
                break;
            }
        }
        modules.push((at, end, name));
    }
    modules
}

struct SourceFile {
    module: Vec<String>,
    code: String,
}

/// Every file of `src/` with its module path (`src/sink/kafka/mod.rs` is `sink::kafka`; a
/// `#[path = "x.rs"] mod m;` file is `m` under its declaring module; `main.rs` is `main`).
fn source_files() -> BTreeMap<PathBuf, SourceFile> {
    fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                walk(&path, out);
            } else if path.extension().is_some_and(|e| e == "rs") {
                out.push(path);
            }
        }
    }
    let root = src();
    let mut paths = Vec::new();
    walk(&root, &mut paths);
    let mut files: BTreeMap<PathBuf, SourceFile> = paths
        .into_iter()
        .map(|path| {
            let relative = path.strip_prefix(&root).unwrap().with_extension("");
            let mut module: Vec<String> =
                relative.components().map(|c| c.as_os_str().to_string_lossy().into_owned()).collect();
            if matches!(module.last().map(String::as_str), Some("mod" | "lib")) {
                module.pop();
            }
            let code = code_only(&std::fs::read_to_string(&path).unwrap());
            (path, SourceFile { module, code })
        })
        .collect();
    // `#[path = "x.rs"] mod m;`: x.rs (beside the declaring file) is the module `m` in it
    let renamed: Vec<(PathBuf, Vec<String>)> = files
        .iter()
        .flat_map(|(path, file)| {
            let text = std::fs::read_to_string(path).unwrap();
            let mut renames = Vec::new();
            for (at, _) in text.match_indices("#[path = \"") {
                let rest = &text[at + "#[path = \"".len()..];
                let target = &rest[..rest.find('"').unwrap()];
                let name = rest[rest.find("mod ").unwrap() + 4..].split(';').next().unwrap().trim();
                let mut module = file.module.clone();
                module.push(name.to_string());
                renames.push((path.parent().unwrap().join(target), module));
            }
            renames
        })
        .collect();
    for (path, module) in renamed {
        if let Some(file) = files.get_mut(&path) {
            file.module = module;
        }
    }
    files
}

/// Each file's module and the modules (of files) it names; `main.rs` is the module `main`.
fn file_graph() -> BTreeMap<Vec<String>, BTreeSet<Vec<String>>> {
    let files = source_files();
    let modules: BTreeSet<Vec<String>> = files.values().map(|f| f.module.clone()).collect();
    let resolve = |path: &[String]| -> Option<Vec<String>> {
        (0..=path.len()).rev().map(|n| path[..n].to_vec()).find(|m| modules.contains(m))
    };
    let mut graph = BTreeMap::new();
    for file in files.values() {
        let inline = inline_modules(&file.code);
        let mut targets = BTreeSet::new();
        for (at, path) in named_paths(&file.code) {
            let mut here = file.module.clone();
            here.extend(
                inline.iter().filter(|(start, end, _)| *start < at && at < *end).map(|m| m.2.clone()),
            );
            let target = match path[0].as_str() {
                "crate" => path[1..].to_vec(),
                "super" | "self" => {
                    let ups = path.iter().take_while(|s| *s == "super" || *s == "self");
                    let supers =
                        path.iter().take_while(|s| *s == "super" || *s == "self").filter(|s| *s == "super");
                    let mut base = here.clone();
                    base.truncate(here.len().saturating_sub(supers.count()));
                    base.extend(path[ups.count()..].iter().cloned());
                    base
                }
                // a child module named without `self::` (`use child::Item`, `child::f()`)
                first => {
                    let mut child = here.clone();
                    child.push(first.to_string());
                    if !modules.contains(&child) {
                        continue;
                    }
                    child.extend(path[1..].iter().cloned());
                    child
                }
            };
            if let Some(module) = resolve(&target)
                && module != file.module
            {
                targets.insert(module);
            }
        }
        graph.insert(file.module.clone(), targets);
    }
    graph
}

fn top(module: &[String]) -> String {
    module.first().cloned().unwrap_or_else(|| "lib".into())
}

/// The imports that point up: (file's module, module named, their lines).
fn imports_up(
    graph: &BTreeMap<Vec<String>, BTreeSet<Vec<String>>>,
    layers: &BTreeMap<String, usize>,
) -> Vec<String> {
    let mut up = Vec::new();
    for (from, targets) in graph {
        let Some(&from_layer) = layers.get(&top(from)) else { continue };
        for target in targets {
            let Some(&to_layer) = layers.get(&top(target)) else { continue };
            if to_layer < from_layer {
                up.push(format!(
                    "{} (line {}) uses {} (line {})",
                    from.join("::"),
                    from_layer + 1,
                    target.join("::"),
                    to_layer + 1
                ));
            }
        }
    }
    up
}

/// The circles: sets of two or more files that reach each other (uses of an enclosing module
/// left out), by Tarjan's strongly connected components.
fn circles(graph: &BTreeMap<Vec<String>, BTreeSet<Vec<String>>>) -> Vec<Vec<String>> {
    let names: Vec<&Vec<String>> = graph.keys().collect();
    let index_of: BTreeMap<&Vec<String>, usize> = names.iter().enumerate().map(|(i, m)| (*m, i)).collect();
    let edges: Vec<Vec<usize>> = names
        .iter()
        .map(|from| {
            graph[*from]
                .iter()
                .filter(|to| !from.starts_with(to))
                .filter_map(|to| index_of.get(to).copied())
                .collect()
        })
        .collect();
    struct Tarjan<'a> {
        edges: &'a [Vec<usize>],
        index: Vec<Option<usize>>,
        low: Vec<usize>,
        stack: Vec<usize>,
        on_stack: Vec<bool>,
        next: usize,
        found: Vec<Vec<usize>>,
    }
    impl Tarjan<'_> {
        fn visit(&mut self, v: usize) {
            self.index[v] = Some(self.next);
            self.low[v] = self.next;
            self.next += 1;
            self.stack.push(v);
            self.on_stack[v] = true;
            for &w in &self.edges[v] {
                match self.index[w] {
                    None => {
                        self.visit(w);
                        self.low[v] = self.low[v].min(self.low[w]);
                    }
                    Some(iw) if self.on_stack[w] => self.low[v] = self.low[v].min(iw),
                    Some(_) => {}
                }
            }
            if Some(self.low[v]) == self.index[v] {
                let mut component = Vec::new();
                while let Some(w) = self.stack.pop() {
                    self.on_stack[w] = false;
                    component.push(w);
                    if w == v {
                        break;
                    }
                }
                if component.len() > 1 {
                    self.found.push(component);
                }
            }
        }
    }
    let n = names.len();
    let mut tarjan = Tarjan {
        edges: &edges,
        index: vec![None; n],
        low: vec![0; n],
        stack: Vec::new(),
        on_stack: vec![false; n],
        next: 0,
        found: Vec::new(),
    };
    for v in 0..n {
        if tarjan.index[v].is_none() {
            tarjan.visit(v);
        }
    }
    tarjan
        .found
        .into_iter()
        .map(|c| {
            let mut files: Vec<String> = c.into_iter().map(|i| names[i].join("::")).collect();
            files.sort();
            files
        })
        .collect()
}

#[test]
fn no_module_imports_from_a_layer_above_it_and_no_files_form_a_circle() {
    let lib_rs = std::fs::read_to_string(src().join("lib.rs")).unwrap();
    let layers = layer_order(&lib_rs);
    let graph = file_graph();
    // every top-level module is on the list, and the list names only modules that exist
    let tops: BTreeSet<String> = graph.keys().map(|m| top(m)).filter(|t| t != "lib").collect();
    let listed: BTreeSet<String> = layers.keys().cloned().collect();
    assert_eq!(tops, listed, "src/lib.rs's \"Layers, top down\" list must name every top-level module once");
    let up = imports_up(&graph, &layers);
    assert!(up.is_empty(), "imports that point up (src/lib.rs lists the layers):\n{}", up.join("\n"));
    let circles = circles(&graph);
    assert!(circles.is_empty(), "files that use each other in a circle: {circles:?}");
}

#[test]
fn the_check_sees_an_import_that_points_up_and_a_circle() {
    let layers = layer_order(
        "//! ## Layers, top down\n//! 1. `ops`: top\n//! 2. [`sink`], `record`: middle\n//! 3. `config`: bottom\n",
    );
    assert_eq!(layers["ops"], 0);
    assert_eq!((layers["sink"], layers["record"]), (1, 1));
    let module = |m: &str| segments(m);
    let graph: BTreeMap<Vec<String>, BTreeSet<Vec<String>>> = [
        ("config", vec!["sink::kafka"]),
        ("sink::kafka", vec!["sink::dedup", "record", "sink"]),
        ("sink::dedup", vec!["sink::kafka"]),
        ("sink::kafka::tests", vec!["sink::kafka"]),
        ("record", vec![]),
    ]
    .into_iter()
    .map(|(from, to)| (module(from), to.into_iter().map(module).collect()))
    .collect();
    assert_eq!(imports_up(&graph, &layers), ["config (line 3) uses sink::kafka (line 2)"]);
    // siblings in a circle are one; a tests module using its parent is not a circle
    assert_eq!(circles(&graph), [vec!["sink::dedup".to_string(), "sink::kafka".to_string()]]);
}

#[test]
fn paths_are_read_from_code_not_from_comments_or_strings() {
    let code = code_only(
        "use crate::a::{b, c::{d as e, f}};\n// use crate::nope;\nlet s = \"crate::nope::x\";\n\
         let r = r#\"super::nope\"#;\nlet c = '\"'; let t = crate::g::h();\nfn f<'a>(x: &'a str) { super::i::j() }\nlet y = child::k();\n",
    );
    let paths: Vec<String> = named_paths(&code).into_iter().map(|(_, p)| p.join("::")).collect();
    for expected in
        ["crate::a::b", "crate::a::c::d", "crate::a::c::f", "crate::g::h", "super::i::j", "child::k"]
    {
        assert!(paths.contains(&expected.to_string()), "{expected} in {paths:?}");
    }
    assert!(!paths.iter().any(|p| p.contains("nope")), "{paths:?}");
}
