//! Connecting to PostgreSQL. Every session the relay opens (claims, slot management, the
//! sampler, `check`, and the replication stream) is configured here, so `sslmode`, the
//! certificates and the credentials are the same everywhere.
//!
//! Invariants:
//! - `postgres.sslmode` means what it means to libpq: `disable` never encrypts; `prefer`
//!   encrypts when the server offers it, without verifying the certificate; `require` always
//!   encrypts (and verifies the chain, like `verify-ca`, when `sslrootcert` is set, as libpq
//!   does); `verify-ca` verifies the chain against `sslrootcert` (never the public roots:
//!   validation refuses it without); `verify-full` (the default) verifies the chain and the
//!   host name;
//! - over TLS that does not authenticate the server (`prefer`, `require` without
//!   `sslrootcert`) a configured password goes only by SCRAM bound to the TLS channel
//!   (`channel_binding = require`): tokio-postgres then refuses, before sending anything, a
//!   cleartext or MD5 request, SCRAM without binding, and a `prefer` session the server did not
//!   encrypt, any of which a man in the middle could use. The replication transport has no
//!   channel binding, so there it sends no password at all over such TLS (the vendored
//!   pgwire-replication's patch); under `disable` the operator chose no protection and the
//!   password goes as the server asks;
//! - one TLS library (rustls with the ring provider) and one reading of the settings for both
//!   the SQL client and the replication transport, but two certificate verifiers: the SQL
//!   client's (`Verifier`, here) and the one inside pgwire-replication, which
//!   [`replication_tls`] configures; a unit test checks both map each `sslmode` to the same
//!   checks;
//! - a certificate the relay cannot trust is a fatal error naming the settings to fix, never a
//!   retry loop; the password never appears in an error.

use std::sync::Arc;

use rustls::client::WebPkiServerVerifier;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::{CertificateError, ClientConfig, DigitallySignedStruct, RootCertStore, SignatureScheme};
use tokio_postgres::Client;
use tokio_postgres::config::{ChannelBinding, SslMode as PgSslMode, TargetSessionAttrs};
use tokio_postgres_rustls::MakeRustlsConnect;

use crate::config::{Endpoint, PostgresConfig, SslMode};
use crate::error::{Action, FatalReason, RelayError};

/// The connection task's type, for callers that read its messages (polling's LISTEN).
pub(crate) type Connection = tokio_postgres::Connection<
    tokio_postgres::Socket,
    <MakeRustlsConnect as tokio_postgres::tls::MakeTlsConnect<tokio_postgres::Socket>>::Stream,
>;

/// Opens a session on the first server of `postgres.host` that accepts writes and spawns its
/// connection task: the one way the example services (`services/`) connect, so `sslmode`,
/// certificates, multi-host and password files mean the same to them as to the relay.
pub async fn connect(pg: &PostgresConfig) -> Result<Client, RelayError> {
    connect_primary(pg).await.map(|(client, _)| client)
}

/// Opens a session on the primary, spawns its connection task, and says which server of
/// `postgres.host` it is (the replication connection must go to the same one).
pub(crate) async fn connect_primary(pg: &PostgresConfig) -> Result<(Client, Endpoint), RelayError> {
    let (client, connection, endpoint) = connect_raw(pg).await?;
    spawn_connection(connection);
    Ok((client, endpoint))
}

/// Opens a session on the first server of `postgres.host` that accepts writes, in order, as
/// libpq does with `target_session_attrs=read-write`; the caller drives the connection. A
/// standby is passed over, so after a promotion the relay finds the new primary by itself.
pub(crate) async fn connect_raw(pg: &PostgresConfig) -> Result<(Client, Connection, Endpoint), RelayError> {
    let tls = MakeRustlsConnect::new(client_tls(pg)?);
    let mut failures = Vec::new();
    for endpoint in pg.endpoints() {
        match pg.client_config(&endpoint, TargetSessionAttrs::ReadWrite)?.connect(tls.clone()).await {
            Ok((client, connection)) => return Ok((client, connection, endpoint)),
            Err(e) => failures.push((endpoint, e)),
        }
    }
    Err(no_primary(pg, failures))
}

/// Opens a session on `endpoint`, primary or standby, and spawns its connection task (to read a
/// standby's copy of the slot).
pub(crate) async fn connect_to(pg: &PostgresConfig, endpoint: &Endpoint) -> Result<Client, RelayError> {
    let tls = MakeRustlsConnect::new(client_tls(pg)?);
    let (client, connection) = pg
        .client_config(endpoint, TargetSessionAttrs::Any)?
        .connect(tls)
        .await
        .map_err(|e| classify_connect(pg, endpoint, e))?;
    spawn_connection(connection);
    Ok(client)
}

/// Why no server of `postgres.host` gave a read-write session. With one server, its error as
/// it is. With several, retried while any of them is a standby or unreachable (a failover is
/// under way); fatal only when every one failed in a way an operator must fix (credentials, TLS).
fn no_primary(pg: &PostgresConfig, failures: Vec<(Endpoint, tokio_postgres::Error)>) -> RelayError {
    let single = failures.len() == 1;
    let mut described = Vec::new();
    let mut fatal = None;
    let mut waiting = false;
    for (endpoint, e) in failures {
        if is_read_only(&e) {
            described.push(format!("{endpoint} is read-only (a standby, or default_transaction_read_only)"));
            waiting = true;
            continue;
        }
        let error = classify_connect(pg, &endpoint, e);
        if single {
            return error;
        }
        described.push(format!("{endpoint}: {error}"));
        match error.action() {
            Action::Fatal(_) => fatal = fatal.or(Some(error)),
            _ => waiting = true,
        }
    }
    match fatal {
        Some(error) if !waiting => error,
        _ => RelayError::Disconnected(format!(
            "no server of postgres.host accepts writes (waiting for a primary): {}",
            described.join("; ")
        )),
    }
}

/// tokio-postgres refused the session because the server does not accept writes
/// (`target_session_attrs = read-write`).
fn is_read_only(e: &tokio_postgres::Error) -> bool {
    std::error::Error::source(e).and_then(|source| source.downcast_ref::<std::io::Error>()).is_some_and(
        |io| io.kind() == std::io::ErrorKind::PermissionDenied && io.to_string().contains("writes"),
    )
}

/// Drives a session's connection until it ends.
fn spawn_connection(connection: Connection) {
    tokio::spawn(async move {
        if let Err(e) = connection.await {
            tracing::debug!(error = %e, "postgres connection ended");
        }
    });
}

/// The replication transport's TLS settings, from the same configuration.
pub(crate) fn replication_tls(pg: &PostgresConfig) -> pgwire_replication::TlsConfig {
    use pgwire_replication::SslMode as R;
    // (validated at load: "system" names a bundle that exists)
    let root = pg.root_cert_file().ok().flatten().map(Into::into);
    let mut tls = pgwire_replication::TlsConfig::disabled();
    tls.mode = match (pg.sslmode, root.is_some()) {
        (SslMode::Disable, _) => R::Disable,
        (SslMode::Prefer, _) => R::Prefer,
        (SslMode::Require, false) => R::Require,
        (SslMode::Require, true) | (SslMode::VerifyCa, _) => R::VerifyCa,
        (SslMode::VerifyFull, _) => R::VerifyFull,
    };
    tls.ca_pem_path = root;
    if !pg.sslcert.is_empty() {
        tls.client_cert_pem_path = Some(pg.sslcert.clone().into());
        tls.client_key_pem_path = Some(pg.sslkey.clone().into());
    }
    tls
}

/// What the server's certificate must prove under `sslmode`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum CertCheck {
    Nothing,
    Chain,
    ChainAndName,
}

/// Whether TLS may be on without proving the server's identity: then a password must not go
/// unless bound to the TLS channel (see the module's invariants).
fn unverified_tls(pg: &PostgresConfig) -> bool {
    matches!(pg.sslmode, SslMode::Prefer | SslMode::Require) && cert_check(pg) == CertCheck::Nothing
}

fn cert_check(pg: &PostgresConfig) -> CertCheck {
    match pg.sslmode {
        SslMode::Disable | SslMode::Prefer => CertCheck::Nothing,
        SslMode::Require if pg.sslrootcert.is_empty() => CertCheck::Nothing,
        SslMode::Require | SslMode::VerifyCa => CertCheck::Chain,
        SslMode::VerifyFull => CertCheck::ChainAndName,
    }
}

/// The rustls configuration of the SQL client.
fn client_tls(pg: &PostgresConfig) -> Result<ClientConfig, RelayError> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = ClientConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|e| tls_setup(format!("cannot set up TLS: {e}")))?;
    let roots = Arc::new(root_store(pg)?);
    let webpki = WebPkiServerVerifier::builder_with_provider(roots, provider.clone())
        .build()
        .map_err(|e| tls_setup(format!("postgres.sslrootcert: {e}")))?;
    let verifier = Arc::new(Verifier { check: cert_check(pg), webpki });
    let builder = builder.dangerous().with_custom_certificate_verifier(verifier);
    if pg.sslcert.is_empty() {
        return Ok(builder.with_no_client_auth());
    }
    let certs = CertificateDer::pem_file_iter(&pg.sslcert)
        .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
        .map_err(|e| tls_setup(format!("postgres.sslcert {}: {e}", pg.sslcert)))?;
    let key = PrivateKeyDer::from_pem_file(&pg.sslkey)
        .map_err(|e| tls_setup(format!("postgres.sslkey {}: {e}", pg.sslkey)))?;
    builder
        .with_client_auth_cert(certs, key)
        .map_err(|e| tls_setup(format!("postgres.sslcert / postgres.sslkey: {e}")))
}

/// `sslrootcert` when set, else the Mozilla roots (webpki-roots), as trust anchors.
fn root_store(pg: &PostgresConfig) -> Result<RootCertStore, RelayError> {
    let mut roots = RootCertStore::empty();
    let file = pg.root_cert_file().map_err(|problem| tls_setup(format!("postgres.sslrootcert {problem}")))?;
    let Some(file) = file else {
        roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned());
        return Ok(roots);
    };
    // "system" names the bundle it was read from
    let named =
        if file == pg.sslrootcert { file.clone() } else { format!("\"{}\" ({file})", pg.sslrootcert) };
    let certs = CertificateDer::pem_file_iter(&file)
        .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
        .map_err(|e| tls_setup(format!("postgres.sslrootcert {named}: {e}")))?;
    let (added, _) = roots.add_parsable_certificates(certs);
    if added == 0 {
        return Err(tls_setup(format!("postgres.sslrootcert {named}: no usable certificate in it")));
    }
    Ok(roots)
}

fn tls_setup(message: String) -> RelayError {
    RelayError::fatal(FatalReason::Tls, message)
}

/// Checks the server certificate as `sslmode` asks.
#[derive(Debug)]
struct Verifier {
    check: CertCheck,
    webpki: Arc<WebPkiServerVerifier>,
}

impl ServerCertVerifier for Verifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        if self.check == CertCheck::Nothing {
            return Ok(ServerCertVerified::assertion());
        }
        match self.webpki.verify_server_cert(end_entity, intermediates, server_name, ocsp, now) {
            Err(rustls::Error::InvalidCertificate(
                CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
            )) if self.check == CertCheck::Chain => Ok(ServerCertVerified::assertion()),
            other => other,
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.webpki.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.webpki.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.webpki.supported_verify_schemes()
    }
}

/// A connection failure as a [`RelayError`]: an untrusted certificate is fatal and names the
/// settings; a server that refuses an unencrypted session says to raise `sslmode`.
fn classify_connect(pg: &PostgresConfig, endpoint: &Endpoint, e: tokio_postgres::Error) -> RelayError {
    if let Some(tls) = rustls_error(&e) {
        return RelayError::fatal(
            FatalReason::Tls,
            format!(
                "postgres {endpoint}: TLS handshake failed: {tls}; check postgres.sslmode ({}), \
                 postgres.sslrootcert and postgres.host against the server's certificate",
                pg.sslmode
            ),
        );
    }
    if let Some(refusal) = client_refusal(pg, endpoint, &e) {
        return refusal;
    }
    let refused_plaintext = e.as_db_error().is_some_and(|db| db.message().contains("no encryption"));
    if refused_plaintext && pg.sslmode == SslMode::Disable {
        return RelayError::fatal(
            FatalReason::Tls,
            format!(
                "postgres {endpoint} accepts only encrypted sessions and postgres.sslmode = disable: set \
                 postgres.sslmode = verify-full (with postgres.sslrootcert) or require"
            ),
        );
    }
    // (after the line above: a server refusing an unencrypted session says so with 28000 too)
    if let Some(db) = e.as_db_error()
        && matches!(
            db.code(),
            &tokio_postgres::error::SqlState::INVALID_PASSWORD
                | &tokio_postgres::error::SqlState::INVALID_AUTHORIZATION_SPECIFICATION
        )
    {
        return RelayError::fatal(FatalReason::Auth, auth_refused(pg, endpoint, db));
    }
    RelayError::Postgres(e)
}

/// What tokio-postgres itself refused, before the server said anything (no server error): a
/// password the server asked for and none configured, a password not sent without channel
/// binding, a server without TLS when `sslmode` requires it; `None` for anything else.
fn client_refusal(pg: &PostgresConfig, endpoint: &Endpoint, e: &tokio_postgres::Error) -> Option<RelayError> {
    if e.as_db_error().is_some() {
        return None;
    }
    // tokio-postgres's "invalid configuration: password missing": the server asked for one
    let cause = std::error::Error::source(e).map(ToString::to_string).unwrap_or_default();
    let text = e.to_string() + &cause;
    if text.contains("password missing") {
        return Some(RelayError::fatal(
            FatalReason::Auth,
            format!(
                "postgres {endpoint} asks for a password for user \"{}\" and no password is configured: set \
                 OUTBOX_RELAY__POSTGRES__PASSWORD, postgres.password_file, or postgres.password",
                pg.user
            ),
        ));
    }
    if text.contains("channel binding") {
        return Some(RelayError::fatal(
            FatalReason::Auth,
            format!(
                "postgres {endpoint}: the password was not sent: postgres.sslmode = {} does not verify the \
                 server, and it asked for the password without SCRAM channel binding (in clear, as MD5, by \
                 SCRAM not bound to TLS, or over an unencrypted session), which a man in the middle could \
                 use; set postgres.sslmode = verify-full with postgres.sslrootcert, or make the server \
                 authenticate by scram-sha-256 over TLS (ssl = on, password_encryption = scram-sha-256)",
                pg.sslmode
            ),
        ));
    }
    // tokio-postgres's words when the server answers the SSLRequest with 'N'
    if text.contains("server does not support TLS") {
        return Some(RelayError::fatal(
            FatalReason::TlsUnavailable,
            format!(
                "postgres {endpoint}: the server does not support SSL, and postgres.sslmode = {} requires it: \
                 turn TLS on at the server (ssl = on, with ssl_cert_file and ssl_key_file), or point \
                 postgres.host at a server or proxy that has it; postgres.sslmode = disable sends the password \
                 and every event in clear",
                pg.sslmode
            ),
        ));
    }
    None
}

/// The server refused the credentials (28P01) or the login (28000: no pg_hba.conf line, no such
/// role): its words, and where each credential comes from.
fn auth_refused(pg: &PostgresConfig, endpoint: &Endpoint, db: &tokio_postgres::error::DbError) -> String {
    let password = if !pg.password_file.is_empty() {
        format!(
            "the password is the first line of postgres.password_file {} (read at each connect: a rotated \
             password or token must be written there before the old one stops working)",
            pg.password_file
        )
    } else if pg.password.is_some() {
        "the password is postgres.password (or OUTBOX_RELAY__POSTGRES__PASSWORD)".into()
    } else {
        "no password is configured (OUTBOX_RELAY__POSTGRES__PASSWORD, postgres.password_file or \
         postgres.password)"
            .into()
    };
    format!(
        "postgres {endpoint} refused user \"{}\" on database \"{}\": {} ({}); check postgres.user and its \
         password ({password}), and that pg_hba.conf on the server lets this user in from this host \
         with this sslmode ({})",
        pg.user,
        pg.database,
        db.message(),
        db.code().code(),
        pg.sslmode
    )
}

fn rustls_error(e: &tokio_postgres::Error) -> Option<String> {
    let mut source: Option<&(dyn std::error::Error + 'static)> = std::error::Error::source(e);
    while let Some(err) = source {
        if let Some(tls) = err.downcast_ref::<rustls::Error>() {
            return Some(tls.to_string());
        }
        if let Some(io) = err.downcast_ref::<std::io::Error>()
            && let Some(tls) = io.get_ref().and_then(|inner| inner.downcast_ref::<rustls::Error>())
        {
            return Some(tls.to_string());
        }
        source = err.source();
    }
    None
}

impl PostgresConfig {
    /// A tokio-postgres configuration for an ordinary (non-replication) session on `endpoint`;
    /// with `attrs` ReadWrite, a server that does not accept writes refuses it.
    pub(crate) fn client_config(
        &self,
        endpoint: &Endpoint,
        attrs: TargetSessionAttrs,
    ) -> Result<tokio_postgres::Config, RelayError> {
        let mut pg = tokio_postgres::Config::new();
        pg.host(&endpoint.host)
            .port(endpoint.port)
            .target_session_attrs(attrs)
            .user(&self.user)
            .dbname(&self.database)
            .application_name(&self.application_name)
            .connect_timeout(std::time::Duration::from_secs(self.connect_timeout_secs))
            .ssl_mode(match self.sslmode {
                SslMode::Disable => PgSslMode::Disable,
                SslMode::Prefer => PgSslMode::Prefer,
                SslMode::Require | SslMode::VerifyCa | SslMode::VerifyFull => PgSslMode::Require,
            });
        if let Some(password) = self.password_for(endpoint)? {
            pg.password(password);
            if unverified_tls(self) {
                pg.channel_binding(ChannelBinding::Require);
            }
        }
        Ok(pg)
    }

    /// The password for `endpoint`: with `auth = "aws_iam"` an RDS IAM token made now
    /// ([`crate::credentials::rds_iam`]), else [`PostgresConfig::password`].
    pub(crate) fn password_for(&self, endpoint: &Endpoint) -> Result<Option<String>, RelayError> {
        if self.auth != crate::config::PgAuth::AwsIam {
            return self.password();
        }
        let region = self.aws_region().unwrap_or_default();
        crate::credentials::rds_iam::password(&endpoint.host, endpoint.port, &self.user, &region)
            .map(Some)
            .map_err(|e| match e {
                crate::credentials::FetchError::Refused { .. } => {
                    RelayError::fatal(FatalReason::Auth, format!("postgres.auth = \"aws_iam\": {e}"))
                }
                e => RelayError::Disconnected(format!("postgres.auth = \"aws_iam\": no token: {e}")),
            })
    }

    /// The password: `password`, or the first line of `password_file` (read at each connect,
    /// so a rotated Secret is picked up).
    pub(crate) fn password(&self) -> Result<Option<String>, RelayError> {
        if let Some(password) = &self.password {
            return Ok(Some(password.expose().to_string()));
        }
        if self.password_file.is_empty() {
            return Ok(None);
        }
        let text = std::fs::read_to_string(&self.password_file).map_err(|e| {
            RelayError::fatal(
                FatalReason::Config,
                format!("postgres.password_file {}: {e}", self.password_file),
            )
        })?;
        Ok(Some(text.lines().next().unwrap_or_default().to_string()))
    }
}

#[cfg(test)]
mod tests;
