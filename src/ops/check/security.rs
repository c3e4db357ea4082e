//! What `check` says about the relay's own exposure: TLS that does not verify a server (to
//! PostgreSQL below `verify-full`, to Kafka with certificate checks off), Kafka without TLS
//! (PLAINTEXT, SASL_PLAINTEXT: the events and the credential in clear), secret files other
//! users can read, the admin API beyond loopback without TLS, dead letters written unsigned (`dead_letter.signing_key_file`), and a role
//! holding more than its mode needs (superuser, the outbox table's owner, REPLICATION in polling
//! mode).
//!
//! Invariant: these are WARNs, never FAILs: each is a deliberate choice somewhere (a test
//! cluster, a sidecar proxy), and the relay works; every WARN names the setting or the statement
//! that removes it.

use tokio_postgres::Client;

use super::Finding;
use crate::config::{OnPoison, RelayConfig, SourceMode, SslMode};
use crate::outboxes::Outbox;
use crate::table::quote_ident;

/// The findings that need no connection: `postgres.sslmode`, Kafka's certificate checks, and
/// the secret files' modes.
pub(super) fn config_findings(config: &RelayConfig) -> Vec<Finding> {
    vec![
        sslmode_finding(config),
        kafka_tls_finding(config),
        secret_files_finding(config),
        letter_signing_finding(config),
        admin_finding(config),
    ]
}

/// Where the admin listener (`[admin]`) listens: beyond loopback without TLS, its bearer tokens
/// and every act cross the network in clear.
fn admin_finding(config: &RelayConfig) -> Finding {
    const CHECK: &str = "admin.listen";
    let admin = &config.admin;
    if !admin.enabled() {
        return Finding::ok(CHECK, "the admin API and console are off (admin.listen is empty)");
    }
    if admin.exposed_without_tls() {
        return Finding::warn(
            CHECK,
            format!(
                "the admin API listens on {} beyond loopback without TLS: its bearer tokens and acts cross the \
                 network in clear",
                admin.listen
            ),
            format!(
                "set admin.tls_cert_file and admin.tls_key_file, or listen on loopback (\"{}\") and reach it \
                 with kubectl port-forward",
                crate::config::SUGGESTED_ADMIN_LISTEN
            ),
        );
    }
    let how = if admin.tls() { "with TLS" } else { "on loopback" };
    Finding::ok(CHECK, format!("the admin API listens on {} {how}", admin.listen))
}

/// Whether the relay signs its dead letters (`dead_letter.signing_key_file`): without a key,
/// `replay-dead-letters` cannot tell the relay's letters from ones any role holding INSERT on
/// the table wrote, and sends none unless the operator vouches for each.
fn letter_signing_finding(config: &RelayConfig) -> Finding {
    const CHECK: &str = "dead_letter.signing";
    let unsigned: Vec<String> = config
        .outboxes()
        .into_iter()
        .filter(|o| {
            o.dead_letter.on_poison == OnPoison::DeadLetter && o.dead_letter.signing_key_file.is_empty()
        })
        .map(|o| o.name)
        .collect();
    if unsigned.is_empty() {
        return Finding::ok(
            CHECK,
            "dead letters are signed (dead_letter.signing_key_file), or none are written",
        );
    }
    Finding::warn(
        CHECK,
        format!(
            "dead letters of {} are written unsigned: replay-dead-letters cannot tell them from letters any role \
             holding INSERT on the dead-letter table wrote, so it sends none unless vouched for (--vouch)",
            unsigned.join(", ")
        ),
        "openssl rand -hex 32 > letters.key (readable by the relay and the operator only); apply \
         sql/011_dead_letter_digest.sql; set dead_letter.signing_key_file = the file",
    )
}

fn sslmode_finding(config: &RelayConfig) -> Finding {
    const CHECK: &str = "postgres.sslmode";
    let pg = &config.postgres;
    let fix = "set postgres.sslmode = \"verify-full\" with postgres.sslrootcert the CA that signed the server's \
               certificate";
    let risk = match pg.sslmode {
        SslMode::VerifyFull => {
            return Finding::ok(CHECK, "verify-full: the chain and the host name are checked");
        }
        SslMode::Disable => {
            "disable: the password (as the server asks for it) and every event cross the network \
                             in clear, and any host answering at postgres.host is believed"
        }
        SslMode::Prefer => {
            "prefer: a man in the middle can decline TLS or present any certificate; the relay then \
                            sends its password only by SCRAM bound to TLS, but it reads events from whoever answers"
        }
        SslMode::Require if pg.sslrootcert.is_empty() => {
            "require: any certificate is accepted, so a man in the middle can read and change every event (the \
             password goes only by SCRAM bound to TLS)"
        }
        SslMode::Require | SslMode::VerifyCa => {
            "the chain is checked but not the host name: any server holding a certificate from that CA can pose as \
             PostgreSQL"
        }
    };
    Finding::warn(CHECK, format!("sslmode {} below verify-full: {risk}", pg.sslmode), fix)
}

fn kafka_tls_finding(config: &RelayConfig) -> Finding {
    const CHECK: &str = "kafka.tls";
    if let Some(cleartext) = kafka_cleartext(config) {
        return Finding::warn(
            CHECK,
            cleartext,
            "set kafka.properties security.protocol = \"SSL\" (or \"SASL_SSL\") with ssl.ca.location the \
             brokers' CA; plaintext only where no one else can reach the network (loopback)",
        );
    }
    let off = config.kafka.certificate_checks_off();
    if off.is_empty() {
        return Finding::ok(CHECK, "TLS to the brokers, with librdkafka's certificate and name checks");
    }
    Finding::warn(
        CHECK,
        format!(
            "the brokers' certificates are not fully checked: {}; a man in the middle can read the events and the \
             SASL exchange",
            off.join(", ")
        ),
        "remove those kafka.properties and set ssl.ca.location to the brokers' CA",
    )
}

/// What crosses the network to the brokers in clear, when the protocol has no TLS: the events,
/// and with SASL_PLAINTEXT the credential as the mechanism sends it. `None` over TLS.
fn kafka_cleartext(config: &RelayConfig) -> Option<String> {
    let kafka = &config.kafka;
    let property = |key: &str| kafka.property(key).map(|v| v.trim().to_ascii_uppercase());
    // ([kafka.auth] makes it SASL_SSL unless the properties say otherwise; librdkafka's own
    // defaults are PLAINTEXT and GSSAPI)
    let sasl_default = if kafka.auth.is_some() { "SASL_SSL" } else { "PLAINTEXT" };
    let protocol = property("security.protocol").unwrap_or_else(|| sasl_default.into());
    let mechanism = property("sasl.mechanisms")
        .or_else(|| property("sasl.mechanism"))
        .unwrap_or_else(|| if kafka.auth.is_some() { "OAUTHBEARER" } else { "GSSAPI" }.into());
    match protocol.as_str() {
        "PLAINTEXT" => Some(
            "security.protocol = PLAINTEXT (librdkafka's default): every event crosses the network in clear, and \
             any host answering at kafka.brokers is believed"
                .into(),
        ),
        "SASL_PLAINTEXT" => {
            let credential = match mechanism.as_str() {
                "PLAIN" => "the SASL password itself (sasl.mechanisms = PLAIN sends it as it is)",
                "OAUTHBEARER" => "the bearer token (anyone who reads it can use it until it expires)",
                _ => "the SASL exchange",
            };
            Some(format!(
                "security.protocol = SASL_PLAINTEXT: every event and {credential} cross the network in clear"
            ))
        }
        _ => None,
    }
}

fn secret_files_finding(config: &RelayConfig) -> Finding {
    const CHECK: &str = "secrets.file_mode";
    let warnings = config.secret_file_warnings();
    if warnings.is_empty() {
        return Finding::ok(CHECK, "no secret file is readable by other users");
    }
    Finding::warn(CHECK, warnings.join("; "), "chmod 600 (or 400) the files named")
}

/// Superuser, owner of the outbox table (or a member of its owner), REPLICATION in polling
/// mode: each is more than the relay needs (docs/outbox-table.md, "The relay's roles").
pub(super) async fn privilege_finding(config: &RelayConfig, outbox: &Outbox, client: &Client) -> Finding {
    const CHECK: &str = "postgres.excess_privilege";
    let table = &outbox.table;
    let row = client
        .query_one(
            "SELECT r.rolsuper, r.rolreplication, \
                    coalesce((SELECT pg_has_role(current_user, c.relowner, 'MEMBER') \
                              FROM pg_class c WHERE c.oid = to_regclass($1)), false) \
             FROM pg_roles r WHERE r.rolname = current_user",
            &[&table.qualified()],
        )
        .await;
    let (superuser, replication, owner): (bool, bool, bool) = match row {
        Ok(row) => (row.get(0), row.get(1), row.get(2)),
        Err(e) => {
            return Finding::warn(
                CHECK,
                format!("cannot read pg_roles: {}", crate::error::describe_pg(&e)),
                "check the role's privileges",
            );
        }
    };
    let role = &config.postgres.user;
    let excess = excess_privileges(config, &table.display_name(), superuser, replication, owner);
    if excess.is_empty() {
        return Finding::ok(CHECK, format!("role {role} holds no more than its mode needs"));
    }
    let (what, fixes): (Vec<String>, Vec<String>) = excess.into_iter().unzip();
    Finding::warn(
        CHECK,
        format!("role {role} {}", what.join("; ")),
        format!("{} (sql/100_relay_role.sql makes least-privilege roles)", fixes.join("; ")),
    )
}

/// Polling mode: whether every role may connect to the database (PUBLIC's CONNECT, granted by
/// default), and so take the polling lock: an advisory lock has no privileges of its own
/// (docs/polling.md, "Who can hold the lock"; issue 46's M9).
pub(super) async fn public_connect_finding(client: &Client) -> Finding {
    const CHECK: &str = "postgres.public_connect";
    let row = client
        .query_one(
            "SELECT current_database()::text, has_database_privilege('public', current_database(), 'CONNECT')",
            &[],
        )
        .await;
    let (database, public): (String, bool) = match row {
        Ok(row) => (row.get(0), row.get(1)),
        Err(e) => {
            return Finding::warn(
                CHECK,
                format!("cannot read the database's privileges: {}", crate::error::describe_pg(&e)),
                "",
            );
        }
    };
    let database = quote_ident(&database);
    if !public {
        return Finding::ok(
            CHECK,
            format!("only roles granted CONNECT on {database} can take the polling lock"),
        );
    }
    Finding::warn(
        CHECK,
        format!(
            "every role may connect to {database} (PUBLIC holds CONNECT, PostgreSQL's default): any login can take \
             the polling lock and keep every relay a standby (the standbys name it in /readyz)"
        ),
        format!(
            "REVOKE CONNECT ON DATABASE {database} FROM PUBLIC, and GRANT CONNECT ON DATABASE {database} to the \
             roles that need it (the relay's, the writers', the readers')"
        ),
    )
}

/// (what the role can do beyond its job, how to take it away), for each excess privilege.
fn excess_privileges(
    config: &RelayConfig,
    table: &str,
    superuser: bool,
    replication: bool,
    owner: bool,
) -> Vec<(String, String)> {
    let role = quote_ident(&config.postgres.user);
    let mut excess = Vec::new();
    if superuser {
        excess.push((
            "is a superuser: it can read and change every table, and run programs on the server".into(),
            format!("run the relay as a role without SUPERUSER (ALTER ROLE {role} NOSUPERUSER)"),
        ));
    }
    if owner && !superuser {
        excess.push((
            format!(
                "owns {table} (or is a member of its owner): it can alter or drop the table and its triggers, \
                 and grant on it"
            ),
            "run `outbox-relay setup` as the owner once, and the relay as a role that does not own the table".into(),
        ));
    }
    if replication && !superuser && config.source.mode == SourceMode::Polling {
        excess.push((
            "has REPLICATION, which polling mode does not use: with it a role can decode every table's changes \
             through a logical slot of its own (test_decoding needs no publication), and where pg_hba.conf allows \
             physical replication copy the whole cluster (pg_basebackup)"
                .into(),
            format!("ALTER ROLE {role} NOREPLICATION, or use the role outbox_relay_polling"),
        ));
    }
    excess
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(mode: SourceMode, sslmode: SslMode) -> RelayConfig {
        let mut config: RelayConfig =
            toml_config("[kafka]\nbrokers = [\"127.0.0.1:9092\"]\n").expect("minimal config");
        config.source.mode = mode;
        config.postgres.sslmode = sslmode;
        config
    }

    fn toml_config(text: &str) -> Option<RelayConfig> {
        let dir = tempfile::tempdir().ok()?;
        let file = dir.path().join("relay.toml");
        std::fs::write(&file, text).ok()?;
        RelayConfig::load_with_env(&file, Default::default()).ok()
    }

    #[test]
    fn every_sslmode_below_verify_full_warns() {
        let ok = sslmode_finding(&config(SourceMode::Polling, SslMode::VerifyFull));
        assert_eq!(ok.status, super::super::Status::Ok);
        for sslmode in [SslMode::Disable, SslMode::Prefer, SslMode::Require] {
            let finding = sslmode_finding(&config(SourceMode::Polling, sslmode));
            assert_eq!(finding.status, super::super::Status::Warn, "{sslmode}");
            assert!(finding.fix.contains("verify-full"), "{finding}");
        }
    }

    #[test]
    fn an_admin_listener_beyond_loopback_without_tls_warns() {
        let mut config = config(SourceMode::Polling, SslMode::VerifyFull);
        assert_eq!(admin_finding(&config).status, super::super::Status::Ok, "off");
        config.admin.listen = "0.0.0.0:9189".into();
        let finding = admin_finding(&config);
        assert_eq!(finding.status, super::super::Status::Warn);
        assert!(finding.fix.contains("admin.tls_cert_file"), "{finding}");
        config.admin.listen = "127.0.0.1:9189".into();
        assert_eq!(admin_finding(&config).status, super::super::Status::Ok, "loopback");
    }

    #[test]
    fn unsigned_dead_letters_warn_naming_the_setting() {
        let mut config = config(SourceMode::Polling, SslMode::VerifyFull);
        let finding = letter_signing_finding(&config);
        assert_eq!(finding.status, super::super::Status::Warn);
        assert!(
            finding.detail.contains("outbox") && finding.fix.contains("dead_letter.signing_key_file"),
            "{finding}"
        );
        config.dead_letter.signing_key_file = "/etc/outbox-relay/letters.key".into();
        assert_eq!(letter_signing_finding(&config).status, super::super::Status::Ok);
        // no letters are written under block: nothing to sign
        config.dead_letter.signing_key_file.clear();
        config.dead_letter.on_poison = OnPoison::Block;
        assert_eq!(letter_signing_finding(&config).status, super::super::Status::Ok);
    }

    #[test]
    fn kafka_certificate_checks_off_warn() {
        let mut c = config(SourceMode::Polling, SslMode::VerifyFull);
        let set = |c: &mut RelayConfig, k: &str, v: &str| {
            c.kafka.properties.insert(k.into(), crate::config::KafkaProperty(v.into()));
        };
        set(&mut c, "security.protocol", "SASL_SSL");
        assert_eq!(kafka_tls_finding(&c).status, super::super::Status::Ok);
        set(&mut c, "enable.ssl.certificate.verification", "false");
        set(&mut c, "ssl.endpoint.identification.algorithm", "none");
        let finding = kafka_tls_finding(&c);
        assert_eq!(finding.status, super::super::Status::Warn);
        assert!(finding.detail.contains("enable.ssl.certificate.verification = false"), "{finding}");
        assert!(finding.detail.contains("identification.algorithm = none"), "{finding}");
        // librdkafka's other spellings of false
        for off in ["f", "0", "F"] {
            set(&mut c, "ssl.endpoint.identification.algorithm", "https");
            set(&mut c, "enable.ssl.certificate.verification", off);
            let finding = kafka_tls_finding(&c);
            assert_eq!(finding.status, super::super::Status::Warn, "{off}: {finding}");
        }
    }

    #[test]
    fn kafka_without_tls_warns_naming_what_crosses_in_clear() {
        let mut c = config(SourceMode::Polling, SslMode::VerifyFull);
        let set = |c: &mut RelayConfig, k: &str, v: &str| {
            c.kafka.properties.insert(k.into(), crate::config::KafkaProperty(v.into()));
        };
        // librdkafka's default is PLAINTEXT
        let finding = kafka_tls_finding(&c);
        assert_eq!(finding.status, super::super::Status::Warn, "{finding}");
        assert!(finding.detail.contains("PLAINTEXT") && finding.fix.contains("SASL_SSL"), "{finding}");
        set(&mut c, "security.protocol", "sasl_plaintext");
        set(&mut c, "sasl.mechanisms", "PLAIN");
        let finding = kafka_tls_finding(&c);
        assert!(finding.detail.contains("the SASL password itself"), "{finding}");
        set(&mut c, "sasl.mechanisms", "SCRAM-SHA-512");
        assert!(kafka_tls_finding(&c).detail.contains("the SASL exchange"));
        set(&mut c, "security.protocol", "SSL");
        assert_eq!(kafka_tls_finding(&c).status, super::super::Status::Ok);
    }

    #[test]
    fn excess_privilege_depends_on_the_mode() {
        let polling = config(SourceMode::Polling, SslMode::VerifyFull);
        let replication = config(SourceMode::Replication, SslMode::VerifyFull);
        assert!(excess_privileges(&polling, "t", false, false, false).is_empty());
        assert!(excess_privileges(&replication, "t", false, true, false).is_empty());
        let polling_with_replication = excess_privileges(&polling, "t", false, true, false);
        assert!(polling_with_replication[0].0.contains("REPLICATION"), "{polling_with_replication:?}");
        assert!(excess_privileges(&replication, "t", false, false, true)[0].0.starts_with("owns t"));
        // a superuser is told once: the rest follows from it
        assert_eq!(excess_privileges(&polling, "t", true, true, true).len(), 1);
    }
}
