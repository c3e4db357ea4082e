//! The container image (deploy/Dockerfile) builds from exactly the files it copies. No Docker
//! engine runs here, so deploy/check-image-build does what the builder stages do: it copies the
//! paths the COPY lines name into an empty directory and runs the stages' cargo commands there
//! (as `cargo check --offline`; the script says why that proves enough).

use std::process::Command;

use crate::common::repo_root;

fn check_image_build(extra: &[&str]) -> (bool, String) {
    let out = Command::new(repo_root().join("deploy/check-image-build"))
        .args(extra)
        .output()
        .expect("run deploy/check-image-build");
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    (out.status.success(), text)
}

#[test]
fn the_image_builds_from_exactly_what_the_dockerfile_copies() {
    let (ok, output) = check_image_build(&[]);
    assert!(ok, "deploy/Dockerfile does not copy everything its cargo builds need:\n{output}");
}

/// The check fails when the Dockerfile leaves out a path the build reads: here the vendored
/// transport that Cargo.toml patches from, which the Dockerfile once left out.
#[test]
fn a_dockerfile_without_the_vendored_crate_fails_the_check() {
    let dockerfile = std::fs::read_to_string(repo_root().join("deploy/Dockerfile")).unwrap();
    let without: Vec<&str> = dockerfile.lines().filter(|l| !l.starts_with("COPY vendor/")).collect();
    assert_eq!(
        without.len() + 1,
        dockerfile.lines().count(),
        "deploy/Dockerfile has no `COPY vendor/...` line"
    );
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("Dockerfile");
    std::fs::write(&path, without.join("\n")).unwrap();

    let (ok, output) = check_image_build(&["--dockerfile", path.to_str().unwrap(), "--no-fetch"]);
    assert!(!ok, "the check passed a Dockerfile that does not copy vendor/:\n{output}");
    assert!(
        output.contains("vendor/pgwire-replication"),
        "the failure does not name the missing path:\n{output}"
    );
}

/// Every platform's image holds its own platform's binary: a `cargo build` without
/// `--target "$RUST_TARGET"` would put the builder's (amd64) binary into the arm64 image, and the
/// check refuses it before building anything.
#[test]
fn a_dockerfile_building_for_the_builders_platform_only_fails_the_check() {
    let dockerfile = std::fs::read_to_string(repo_root().join("deploy/Dockerfile")).unwrap();
    let target = r#" --target "$RUST_TARGET""#;
    assert!(dockerfile.contains(target), "deploy/Dockerfile builds no --target \"$RUST_TARGET\"");
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("Dockerfile");
    std::fs::write(&path, dockerfile.replacen(target, "", 1)).unwrap();

    let (ok, output) = check_image_build(&["--dockerfile", path.to_str().unwrap(), "--no-fetch"]);
    assert!(!ok, "the check passed a Dockerfile that builds for the builder's platform only:\n{output}");
    assert!(output.contains(r#"build --target "$RUST_TARGET""#), "the failure does not say why:\n{output}");
}
