//! What the code and the manual tell operators to open must exist.

use std::path::{Path, PathBuf};

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

#[test]
fn every_sql_path_named_in_src_and_readme_exists() {
    let root = repo_root();
    let mut files = vec![root.join("README.md"), root.join("deploy/relay.example.toml")];
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

#[test]
fn the_runbook_explains_every_fatal_reason() {
    let readme = std::fs::read_to_string(repo_root().join("README.md")).unwrap();
    let runbook = readme.split("#### OutboxRelayFatal").nth(1).expect("an OutboxRelayFatal runbook section");
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
