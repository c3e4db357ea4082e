//! The admin listener over HTTPS with client certificates (mutual TLS), driven by curl against a
//! running relay: a certificate the configured CA signed, whose subject CN is one of
//! `admin.clients`, acts with that client's name and scope; one the CA did not sign fails the
//! handshake; one the CA signed for an unknown CN is refused (401) naming the CN; with neither a
//! certificate nor a token nothing but the page answers; a bearer token still serves alone.

use crate::admin::{READ_TOKEN, setup_with};
use crate::common;

use std::path::Path;
use std::process::Command;

use common::http::free_port;

/// Runs openssl with `args` in `dir`; panics naming the step when it fails.
fn openssl(dir: &Path, args: &[&str]) {
    let out = Command::new("openssl").current_dir(dir).args(args).output().unwrap();
    assert!(out.status.success(), "openssl {args:?}: {}", String::from_utf8_lossy(&out.stderr));
}

/// A key and a certificate for `subject`, signed by `ca` (or self-signed), with `extensions`.
fn certificate(dir: &Path, name: &str, subject: &str, ca: Option<&str>, extensions: &str) {
    let (key, csr, crt, ext) =
        (format!("{name}.key"), format!("{name}.csr"), format!("{name}.crt"), format!("{name}.ext"));
    std::fs::write(dir.join(&ext), extensions).unwrap();
    openssl(
        dir,
        &["req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
            .into_iter()
            .chain(["-keyout", &key, "-out", &csr, "-subj", subject])
            .collect::<Vec<_>>(),
    );
    let mut sign = vec!["x509", "-req", "-in", &csr, "-out", &crt, "-days", "2", "-extfile", &ext];
    let (ca_crt, ca_key) = ca.map(|ca| (format!("{ca}.crt"), format!("{ca}.key"))).unzip();
    match (&ca_crt, &ca_key) {
        (Some(ca_crt), Some(ca_key)) => sign.extend(["-CA", ca_crt, "-CAkey", ca_key, "-CAcreateserial"]),
        _ => sign.extend(["-signkey", &key]),
    }
    openssl(dir, &sign);
}

/// curl's answer: (exit code, HTTP status, body).
fn curl(dir: &Path, url: &str, args: &[&str]) -> (i32, u16, String) {
    let out = Command::new("curl")
        .current_dir(dir)
        .args(["-s", "--cacert", "ca.crt", "-w", "\n%{http_code}", "--max-time", "10"])
        .args(args)
        .arg(url)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    let (body, status) = text.rsplit_once('\n').unwrap_or(("", &text));
    (out.status.code().unwrap_or(-1), status.trim().parse().unwrap_or(0), body.to_string())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_client_certificate_of_the_configured_ca_acts_as_its_client_and_no_other_gets_in() {
    // given a CA, the listener's certificate for 127.0.0.1, a client certificate it signed for
    // CN=robot-cert, one it signed for CN=stranger, and one for CN=robot-cert it did not sign
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    certificate(
        d,
        "ca",
        "/CN=outbox-relay test admin CA",
        None,
        "basicConstraints=critical,CA:TRUE\nkeyUsage=keyCertSign\n",
    );
    let leaf = "basicConstraints=CA:FALSE\nsubjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth\n";
    certificate(d, "server", "/CN=127.0.0.1", Some("ca"), leaf);
    let client = "basicConstraints=CA:FALSE\nextendedKeyUsage=clientAuth\n";
    certificate(d, "robot", "/O=ops/CN=robot-cert", Some("ca"), client);
    certificate(d, "stranger", "/CN=stranger", Some("ca"), client);
    certificate(d, "forged", "/O=ops/CN=robot-cert", None, client);
    let path = |name: &str| d.join(name).display().to_string();

    // and a relay whose admin listener serves HTTPS and knows robot-cert as "robot" (operate)
    let port = free_port();
    let clients = "[{ name = \"robot\", scope = \"operate\", subject_cn = \"robot-cert\" }]";
    let s = setup_with("polling", |toml| {
        toml.set("admin", "tls_cert_file", path("server.crt"))
            .set("admin", "tls_key_file", path("server.key"))
            .set("admin", "tls_client_ca_file", path("ca.crt"))
            .set_literal("admin", "clients", clients)
    })
    .await;
    let listen = format!("127.0.0.1:{port}");
    let relay = s.start_with_env("relay", &[("OUTBOX_RELAY__ADMIN__LISTEN", &listen)]);
    relay.wait_ready("active").await;
    let url = |route: &str| format!("https://{listen}{route}");
    let robot = ["--cert", "robot.crt", "--key", "robot.key"];

    // then the CA's certificate for robot-cert is the client "robot", with its scope
    let (code, status, body) = curl(d, &url("/v1/session"), &robot);
    assert_eq!((code, status), (0, 200), "{body}");
    let session: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!((session["name"].as_str(), session["scope"].as_str()), (Some("robot"), Some("operate")));

    // and it may act: the pause is said to be robot's
    let csrf = format!("X-CSRF-Token: {}", session["csrf_token"].as_str().unwrap());
    let pause = [&robot[..], &["-H", &csrf, "-d", r#"{"reason": "cert test"}"#]].concat();
    let (_, status, body) = curl(d, &url("/v1/pause"), &pause);
    assert_eq!(status, 200, "{body}");
    relay.wait_ready("paused by robot: cert test").await;

    // and a certificate the CA did not sign fails the handshake, whatever its CN
    let (code, status, _) = curl(d, &url("/v1/session"), &["--cert", "forged.crt", "--key", "forged.key"]);
    assert!(code != 0 && status == 0, "a forged certificate got an answer: curl exit {code}, HTTP {status}");

    // and one it signed for a CN no client has is refused, naming the CN
    let (_, status, body) =
        curl(d, &url("/v1/session"), &["--cert", "stranger.crt", "--key", "stranger.key"]);
    assert_eq!(status, 401, "{body}");
    assert!(body.contains("stranger"), "the refusal names the CN: {body}");

    // and with neither a certificate nor a token only the page answers
    assert_eq!(curl(d, &url("/v1/session"), &[]).1, 401);
    assert_eq!(curl(d, &url("/"), &[]).1, 200);

    // and a bearer token still serves alone, with its own scope (a read token may not act)
    let bearer = format!("Authorization: Bearer {READ_TOKEN}");
    let (_, status, body) = curl(d, &url("/v1/session"), &["-H", &bearer]);
    assert_eq!(status, 200, "{body}");
    assert!(body.contains("\"viewer\""), "{body}");
    let both = [&robot[..], &["-H", &bearer, "-H", &csrf, "-X", "POST"]].concat();
    assert_eq!(curl(d, &url("/v1/resume"), &both).1, 403, "a token sent with a certificate decides alone");
    let log = relay.log_text();
    assert!(
        log.contains("who=robot") || log.contains("who=\"robot\""),
        "the act is audited as robot's:\n{log}"
    );
}
