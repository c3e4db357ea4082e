//! The Helm chart (deploy/helm/outbox-relay): a list of databases renders one independent relay
//! each, every object held to deploy/validate's invariants by deploy/helm/check; two databases
//! given one slot are refused, by the chart and by the check; and the chart renders the kustomize
//! base's objects, so a change to one that the other lacks fails.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::common::{relay_bin, repo_root};

const RELEASE: &str = "outbox-relay";
// helm built with `go install` assumes Kubernetes 1.20 when no cluster is asked (as deploy/helm/check says)
const KUBE_VERSION: &str = "1.33.0";

fn chart() -> PathBuf {
    repo_root().join("deploy/helm/outbox-relay")
}

/// `helm template` of the chart with `values`: (success, manifests, stderr).
fn helm_template(values: Option<&Path>) -> (bool, String, String) {
    let mut command = Command::new(std::env::var("HELM").unwrap_or_else(|_| "helm".into()));
    command.args(["template", RELEASE]).arg(chart()).args(["--kube-version", KUBE_VERSION]);
    if let Some(values) = values {
        command.arg("-f").arg(values);
    }
    let out = command.output().expect("helm is missing: deploy/local/test installs it (lib.sh, ensure_helm)");
    (
        out.status.success(),
        String::from_utf8(out.stdout).unwrap(),
        String::from_utf8_lossy(&out.stderr).into(),
    )
}

/// deploy/helm/check with `args`: (success, its report).
fn check(args: &[&str]) -> (bool, String) {
    let out = Command::new(repo_root().join("deploy/helm/check"))
        .args(args)
        .env("OUTBOX_RELAY_BIN", relay_bin())
        .output()
        .expect("run deploy/helm/check");
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    (out.status.success(), text)
}

fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    path
}

#[test]
fn three_databases_render_three_independent_relays_that_pass_every_invariant() {
    // given the chart's example of three databases (one polling, one with a verify watch)
    let values = chart().join("ci/three-databases-values.yaml");

    // when it is rendered and checked
    let (ok, report) = check(&["--values", values.to_str().unwrap()]);

    // then every database's relay passes deploy/validate's invariants, and they are apart
    assert!(ok, "deploy/helm/check failed:\n{report}");
    for database in ["orders", "billing", "ledger"] {
        let relay =
            format!("outbox-relay-{database}: relay: configuration and OUTBOX_RELAY__* environment accepted");
        assert!(report.contains(&relay), "no relay checked for {database}:\n{report}");
    }
    assert!(report.contains("outbox-relay-billing: verify-watch"), "{report}");
    assert!(report.contains("3 relay(s) apart"), "{report}");
    let (_, manifests, _) = helm_template(Some(&values));
    assert_eq!(manifests.matches("\nkind: StatefulSet\n").count(), 3, "{manifests}");
    assert_eq!(
        manifests.matches("\nkind: PrometheusRule\n").count(),
        1,
        "one set of alert rules per release"
    );
    // (each slot in the relay's ConfigMap and the setup hook's; ledger polls: no setup)
    for (slot, copies) in
        [("outbox_relay_orders", 2), ("outbox_relay_billing", 2), ("outbox_relay_ledger", 1)]
    {
        assert_eq!(manifests.matches(&format!("slot = \"{slot}\"")).count(), copies, "{slot}");
    }
}

#[test]
fn two_databases_given_one_slot_are_refused_naming_the_field() {
    let dir = tempfile::tempdir().unwrap();
    let values = write(
        dir.path(),
        "values.yaml",
        "databases:\n  - name: orders\n    slot: shared\n  - name: billing\n    slot: shared\n",
    );

    // when the chart renders two databases with one slot, it refuses, naming both and the field
    let (ok, manifests, stderr) = helm_template(Some(&values));
    assert!(!ok, "rendered two relays on one slot:\n{manifests}");
    assert!(
        stderr.contains(r#"databases[0] and databases[1] share the slot (replication.slot) "shared""#),
        "{stderr}"
    );

    // and a rendering whose second relay was given the first's slot afterwards fails the check
    let (ok, three, stderr) = helm_template(Some(&chart().join("ci/three-databases-values.yaml")));
    assert!(ok, "{stderr}");
    let doctored = three.replace(r#"slot = "outbox_relay_billing""#, r#"slot = "outbox_relay_orders""#);
    assert_ne!(doctored, three);
    let manifests = write(dir.path(), "doctored.yaml", &doctored);
    let (ok, report) = check(&["--manifests", manifests.to_str().unwrap()]);
    assert!(!ok, "deploy/helm/check passed two relays on one slot:\n{report}");
    assert!(
        report.contains(r#"share the replication.slot 'outbox_relay_orders'"#),
        "the failure does not name the slot:\n{report}"
    );
}

#[test]
fn the_chart_renders_the_kustomize_base_and_a_drift_fails_the_check() {
    // given the default values' rendering (one database), checked against deploy/kubernetes
    let (ok, one, stderr) = helm_template(None);
    assert!(ok, "{stderr}");
    let dir = tempfile::tempdir().unwrap();
    let manifests = write(dir.path(), "one.yaml", &one);
    let (ok, report) = check(&["--manifests", manifests.to_str().unwrap(), "--drift"]);
    assert!(ok, "the chart drifted from the kustomize base:\n{report}");
    assert!(report.contains("drift: the chart's objects are the kustomize base's"), "{report}");

    // when the chart's StatefulSet differs from the base's where no other invariant looks (the
    // startup probe's patience), then the check names the drift
    let startup = "startupProbe:\n          failureThreshold: 60";
    assert!(one.contains(startup), "the rendered StatefulSet's startup probe changed shape:\n{one}");
    let drifted = write(dir.path(), "drifted.yaml", &one.replacen(startup, &startup.replace("60", "61"), 1));
    let (ok, report) = check(&["--manifests", drifted.to_str().unwrap(), "--drift"]);
    assert!(!ok, "a drifted StatefulSet passed:\n{report}");
    assert!(report.contains("drift: the chart's StatefulSet pod spec differs"), "{report}");
    assert!(report.contains("startupProbe.failureThreshold: 60 -> 61"), "{report}");
}
