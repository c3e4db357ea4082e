//! What the code and the manual tell operators to open must exist.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Component, Path, PathBuf};

fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn files_under(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            files_under(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// Every `sql/...` path in `text` (up to the first character that cannot be in a file name).
fn sql_paths(text: &str) -> Vec<String> {
    let mut paths = Vec::new();
    let mut rest = text;
    while let Some(at) = rest.find("sql/") {
        let preceded_by_word =
            rest[..at].chars().last().is_some_and(|c| c.is_ascii_alphanumeric() || c == '_');
        let tail = &rest[at..];
        let end =
            tail.find(|c: char| !(c.is_ascii_alphanumeric() || "_./-".contains(c))).unwrap_or(tail.len());
        let path = tail[..end].trim_end_matches('.');
        if !preceded_by_word && path.len() > "sql/".len() {
            paths.push(path.to_string());
        }
        rest = &tail[end.max(1)..];
    }
    paths
}

/// The manual: README.md and every page under docs/, as paths relative to the repository.
fn manual_pages() -> Vec<PathBuf> {
    let mut pages = vec![PathBuf::from("README.md")];
    let mut docs: Vec<PathBuf> = std::fs::read_dir(repo_root().join("docs"))
        .unwrap()
        .map(|entry| entry.unwrap().path())
        .filter(|path| path.extension().is_some_and(|e| e == "md"))
        .map(|path| path.strip_prefix(repo_root()).unwrap().to_path_buf())
        .collect();
    docs.sort();
    pages.extend(docs);
    pages
}

/// The manual's text, README.md first, then docs/*.md, each page in full.
fn manual_text() -> String {
    manual_pages().iter().map(|page| std::fs::read_to_string(repo_root().join(page)).unwrap()).collect()
}

#[test]
fn every_sql_path_named_in_src_and_readme_exists() {
    let root = repo_root();
    let mut files: Vec<PathBuf> = manual_pages().iter().map(|page| root.join(page)).collect();
    files.push(root.join("deploy/relay.example.toml"));
    files_under(&root.join("src"), &mut files);
    let mut checked = 0;
    let mut missing = Vec::new();
    for file in &files {
        let text = std::fs::read_to_string(file).unwrap();
        for path in sql_paths(&text) {
            checked += 1;
            if !root.join(&path).exists() {
                missing.push(format!("{}: {path}", file.strip_prefix(&root).unwrap().display()));
            }
        }
    }
    assert!(checked > 10, "found only {checked} sql/ paths: the scan is broken");
    assert!(missing.is_empty(), "paths that do not exist:\n{}", missing.join("\n"));
}

#[test]
fn the_scan_finds_paths_and_skips_lookalikes() {
    let text = "apply sql/001_outbox_events.sql, then sql/100_relay_role.sql. see mysql/x and sql/";
    assert_eq!(sql_paths(text), ["sql/001_outbox_events.sql", "sql/100_relay_role.sql"]);
}

/// docs/admin.md's "Routes" section names every route of `/v1/openapi.json` (as `` `GET /v1/x` ``
/// or `` `GET /v1/x?...` ``), and no route the document lacks.
#[test]
fn the_admin_reference_lists_every_route_of_the_openapi_document() {
    let text = std::fs::read_to_string(repo_root().join("docs/admin.md")).unwrap();
    let routes = text.split("\n## Routes\n").nth(1).expect("a Routes section in docs/admin.md");
    let routes = routes.split("\n## ").next().unwrap();
    let document = outbox_relay::ops::admin::openapi::document();
    let mut described = BTreeSet::new();
    for (path, operations) in document["paths"].as_object().unwrap() {
        for method in operations.as_object().unwrap().keys() {
            let named = format!("`{} {path}", method.to_ascii_uppercase());
            let listed = routes.contains(&format!("{named}`")) || routes.contains(&format!("{named}?"));
            assert!(listed, "docs/admin.md does not list {named}`");
            described.insert(named);
        }
    }
    for mention in routes.split('`').skip(1).step_by(2) {
        let Some((method, rest)) = mention.split_once(' ') else { continue };
        if !["GET", "POST", "PUT", "DELETE", "PATCH"].contains(&method) || !rest.starts_with('/') {
            continue;
        }
        let path = rest.split('?').next().unwrap();
        assert!(
            described.contains(&format!("`{method} {path}")),
            "docs/admin.md lists `{mention}`, which is not served"
        );
    }
}

#[test]
fn the_runbook_explains_every_fatal_reason() {
    let manual = manual_text();
    let runbook = manual.split("#### OutboxRelayFatal").nth(1).expect("an OutboxRelayFatal runbook section");
    let runbook = runbook.split("\n#### ").next().unwrap();
    for reason in outbox_relay::error::FatalReason::ALL {
        let label = format!("`{}`", reason.label());
        assert!(runbook.contains(&label), "the OutboxRelayFatal runbook does not explain reason {label}");
    }
}

#[test]
fn docker_compose_runs_the_kafka_version_the_tests_run() {
    let pom = std::fs::read_to_string(repo_root().join("deploy/local/kafka/pom.xml")).unwrap();
    let version = pom.split("<kafka.version>").nth(1).and_then(|rest| rest.split('<').next()).unwrap();
    let compose = std::fs::read_to_string(repo_root().join("deploy/docker-compose.yml")).unwrap();
    let image = compose.lines().find_map(|l| l.trim().strip_prefix("image: apache/kafka:")).unwrap();
    let tag = image.split_whitespace().next().unwrap();
    assert_eq!(tag, version, "docker-compose's apache/kafka:{tag} is not the {version} the tests run");
}

/// The version in Cargo.toml is the one the CHANGELOG's newest entry names, the binary prints
/// and the image is labelled with (deploy/validate checks the labels and compose's tags).
#[test]
fn changelog_binary_and_cargo_agree_on_the_version() {
    let version = env!("CARGO_PKG_VERSION");
    let changelog = std::fs::read_to_string(repo_root().join("CHANGELOG.md")).unwrap();
    // the newest entry: the first "## [x.y.z]" heading (an "## [Unreleased]" one is not a version)
    let newest = changelog
        .lines()
        .filter_map(|l| l.strip_prefix("## ["))
        .filter_map(|l| l.split(']').next())
        .find(|v| v.chars().next().is_some_and(|c| c.is_ascii_digit()))
        .expect("CHANGELOG.md has no \"## [x.y.z]\" entry");
    assert_eq!(newest, version, "CHANGELOG.md's newest entry is {newest}, Cargo.toml says {version}");

    let out =
        std::process::Command::new(env!("CARGO_BIN_EXE_outbox-relay")).arg("--version").output().unwrap();
    assert!(out.status.success());
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), format!("outbox-relay {version}"));
}

#[test]
fn the_readme_links_the_changelog_and_the_upgrade_notes() {
    let readme = std::fs::read_to_string(repo_root().join("README.md")).unwrap();
    for target in ["CHANGELOG.md", "docs/upgrading.md"] {
        assert!(readme.contains(&format!("]({target}")), "README.md does not link {target}");
        assert!(repo_root().join(target).exists(), "{target} does not exist");
    }
}

/// A heading's anchor as GitHub makes it: lowercase; spaces become '-'; every other character
/// that is not a letter, a digit, '-' or '_' is dropped (backticks, commas, colons, quotes).
pub(crate) fn slug(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
            _ => None,
        })
        .collect()
}

/// The lines of `markdown` outside fenced code blocks.
fn prose_lines(markdown: &str) -> impl Iterator<Item = &str> {
    let mut in_fence = false;
    markdown.lines().filter(move |line| {
        if line.trim_start().starts_with("```") {
            in_fence = !in_fence;
            return false;
        }
        !in_fence
    })
}

/// Every anchor a link may name in `markdown`: each heading's slug (a repeated one gets `-1`,
/// `-2`, ... as on GitHub) and each explicit `<a id="...">` or `<a name="...">`.
pub(crate) fn anchors(markdown: &str) -> BTreeSet<String> {
    let mut found = BTreeSet::new();
    let mut seen: BTreeMap<String, usize> = BTreeMap::new();
    for line in prose_lines(markdown) {
        let hashes = line.chars().take_while(|&c| c == '#').count();
        if (1..=6).contains(&hashes) && line[hashes..].starts_with(' ') {
            let base = slug(&line[hashes..]);
            let repeats = seen.entry(base.clone()).or_insert(0);
            found.insert(if *repeats == 0 { base.clone() } else { format!("{base}-{repeats}") });
            *repeats += 1;
        }
        for attribute in ["<a id=\"", "<a name=\""] {
            for rest in line.split(attribute).skip(1) {
                found.insert(rest.split('"').next().unwrap().to_string());
            }
        }
    }
    found
}

/// The targets of the relative links `[text](target)` in `markdown`, outside code; links with a
/// scheme (`https:`, `mailto:`) are not the manual's to check.
fn relative_links(markdown: &str) -> Vec<String> {
    let mut targets = Vec::new();
    for line in prose_lines(markdown) {
        // drop inline code spans, which may show link syntax without being links
        let prose: String = line.split('`').step_by(2).collect::<Vec<_>>().join(" ");
        for rest in prose.split("](").skip(1) {
            let Some(end) = rest.find(')') else { continue };
            let target = &rest[..end];
            let has_scheme = target.split_once(':').is_some_and(|(scheme, _)| {
                !scheme.is_empty() && scheme.chars().all(|c| c.is_ascii_alphabetic())
            });
            if !has_scheme && !target.contains(' ') {
                targets.push(target.to_string());
            }
        }
    }
    targets
}

/// `path` relative to the repository, with `.` and `..` resolved.
fn normalized(path: &Path) -> PathBuf {
    let mut out = PathBuf::new();
    for component in path.components() {
        match component {
            Component::ParentDir => {
                out.pop();
            }
            Component::CurDir => {}
            other => out.push(other),
        }
    }
    out
}

/// Every link of `pages` (path relative to the repository -> text) that does not resolve: its
/// file neither one of `pages` nor present under `root`, or its anchor no heading or `<a id>` of
/// a page. One line each: `page: target (why)`.
fn broken_links(pages: &BTreeMap<PathBuf, String>, root: &Path) -> Vec<String> {
    let anchors_of: BTreeMap<&PathBuf, BTreeSet<String>> =
        pages.iter().map(|(page, text)| (page, anchors(text))).collect();
    let mut broken = Vec::new();
    for (page, text) in pages {
        for target in relative_links(text) {
            let (path, anchor) = match target.split_once('#') {
                Some((path, anchor)) => (path, Some(anchor)),
                None => (target.as_str(), None),
            };
            let file = if path.is_empty() {
                page.clone()
            } else {
                normalized(&page.parent().unwrap_or(Path::new("")).join(path))
            };
            let why = match (anchors_of.get(&file), anchor) {
                (Some(anchors), Some(anchor)) if !anchors.contains(anchor) => {
                    Some(format!("{} has no heading or <a id> \"{anchor}\"", file.display()))
                }
                (Some(_), _) => None,
                (None, _) if !root.join(&file).exists() => Some(format!("{} does not exist", file.display())),
                (None, Some(anchor)) if file.extension().is_some_and(|e| e == "md") => {
                    let text = std::fs::read_to_string(root.join(&file)).unwrap();
                    (!anchors(&text).contains(anchor))
                        .then(|| format!("{} has no heading or <a id> \"{anchor}\"", file.display()))
                }
                (None, _) => None,
            };
            if let Some(why) = why {
                broken.push(format!("{}: {target} ({why})", page.display()));
            }
        }
    }
    broken
}

#[test]
fn every_link_of_the_readme_and_docs_resolves() {
    let root = repo_root();
    let pages: BTreeMap<PathBuf, String> = manual_pages()
        .into_iter()
        .map(|page| {
            let text = std::fs::read_to_string(root.join(&page)).unwrap();
            (page, text)
        })
        .collect();
    assert!(pages.len() > 10, "found only {} pages of the manual: the scan is broken", pages.len());
    let links: usize = pages.values().map(|text| relative_links(text).len()).sum();
    assert!(links > 100, "found only {links} relative links: the scan is broken");
    let broken = broken_links(&pages, &root);
    assert!(broken.is_empty(), "links that do not resolve:\n{}", broken.join("\n"));
}

#[test]
fn the_link_checker_finds_a_missing_file_and_a_missing_anchor() {
    // given a README and one docs page, with links that resolve and three that do not
    let readme = "# Tool\n\n## Contents\n\nSee [setup](docs/a.md#first-steps-the-slot), \
                  [the replay](docs/a.md#replay), [back](#contents), [b](docs/b.md), \
                  [gone](docs/a.md#no-such-heading), [web](https://example.com/x#y),\n\
                  `[code](not/checked.md)` and [the licence](docs/none.md).\n";
    let page = "# A\n\nBack to [the contents](../README.md#contents) and [nowhere](../README.md#nowhere).\n\n\
                ## First steps: the `slot`!\n\n<a id=\"replay\"></a>**Replay.**\n\n\
                ```sh\n## not a heading\n```\n";
    let pages = BTreeMap::from([
        (PathBuf::from("README.md"), readme.to_string()),
        (PathBuf::from("docs/a.md"), page.to_string()),
        (PathBuf::from("docs/b.md"), "# B\n".to_string()),
    ]);
    // when they are checked against a root where no other file exists
    let broken = broken_links(&pages, Path::new("/nonexistent-outbox-relay-root"));
    // then exactly the three broken ones are named
    assert_eq!(
        broken,
        [
            "README.md: docs/a.md#no-such-heading (docs/a.md has no heading or <a id> \"no-such-heading\")",
            "README.md: docs/none.md (docs/none.md does not exist)",
            "docs/a.md: ../README.md#nowhere (README.md has no heading or <a id> \"nowhere\")",
        ]
    );
    assert!(anchors(page).contains("first-steps-the-slot") && !anchors(page).contains("not-a-heading"));
}
