//! Unit tests of the connection settings: what each `sslmode` verifies, when a password needs
//! channel binding, root certificates and password files.

use super::*;

fn pg(sslmode: SslMode, sslrootcert: &str) -> PostgresConfig {
    PostgresConfig { sslmode, sslrootcert: sslrootcert.into(), ..Default::default() }
}

#[test]
fn sslmode_decides_what_is_verified_as_libpq_does() {
    assert_eq!(cert_check(&pg(SslMode::Disable, "")), CertCheck::Nothing);
    assert_eq!(cert_check(&pg(SslMode::Prefer, "ca.pem")), CertCheck::Nothing);
    assert_eq!(cert_check(&pg(SslMode::Require, "")), CertCheck::Nothing);
    assert_eq!(cert_check(&pg(SslMode::Require, "ca.pem")), CertCheck::Chain);
    assert_eq!(cert_check(&pg(SslMode::VerifyCa, "")), CertCheck::Chain);
    assert_eq!(cert_check(&pg(SslMode::VerifyFull, "")), CertCheck::ChainAndName);
    use pgwire_replication::SslMode as R;
    assert_eq!(replication_tls(&pg(SslMode::Require, "ca.pem")).mode, R::VerifyCa);
    assert_eq!(replication_tls(&pg(SslMode::VerifyFull, "")).mode, R::VerifyFull);
    assert_eq!(replication_tls(&pg(SslMode::Disable, "")).mode, R::Disable);
}

#[test]
fn a_password_goes_only_by_channel_binding_over_unverified_tls() {
    let with_password = |sslmode, sslrootcert: &str| PostgresConfig {
        password: Some(crate::config::Secret::new("pw")),
        ..pg(sslmode, sslrootcert)
    };
    let endpoint = Endpoint { host: "db".into(), port: 5432 };
    let binding = |config: &PostgresConfig| {
        config.client_config(&endpoint, TargetSessionAttrs::Any).unwrap().get_channel_binding()
    };
    for (sslmode, root, required) in [
        (SslMode::Prefer, "", true),
        (SslMode::Require, "", true),
        (SslMode::Require, "ca.pem", false),
        (SslMode::VerifyCa, "ca.pem", false),
        (SslMode::VerifyFull, "", false),
        (SslMode::Disable, "", false),
    ] {
        let required_here = binding(&with_password(sslmode, root)) == ChannelBinding::Require;
        assert_eq!(required_here, required, "{sslmode} {root}");
    }
    // without a password there is nothing to protect (certificate or trust authentication)
    assert_ne!(binding(&pg(SslMode::Require, "")), ChannelBinding::Require);
}

#[test]
fn a_missing_root_certificate_is_fatal_and_names_the_setting() {
    let err = client_tls(&pg(SslMode::VerifyFull, "/nonexistent/ca.pem")).unwrap_err();
    assert!(err.to_string().starts_with("postgres.sslrootcert /nonexistent/ca.pem"), "{err}");
    assert_eq!(err.action(), crate::error::Action::Fatal(FatalReason::Tls));
}

#[test]
fn the_password_comes_from_the_file_when_not_set() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("pw");
    std::fs::write(&file, "s3cret\n").unwrap();
    let config = PostgresConfig { password_file: file.display().to_string(), ..Default::default() };
    assert_eq!(config.password().unwrap().as_deref(), Some("s3cret"));
    let missing = PostgresConfig { password_file: "/nonexistent/pw".into(), ..Default::default() };
    assert!(missing.password().unwrap_err().to_string().starts_with("postgres.password_file"));
}
