//! `outbox-relay status`: what an SRE needs to see first during an incident, in one command. It
//! reads PostgreSQL (the slot, the relay's sessions, the polling backlog, this outbox's waiting
//! dead letters) and a running relay's `/metrics` and `/readyz`; it changes nothing.
//!
//! Invariant: every line of the text report has its fields in the JSON one, under the stable
//! snake_case keys [`JSON_KEYS`] lists (numbers as numbers, times as Unix seconds, `null` for
//! never or unknown); the text may change its words, the JSON keys may not.

use std::time::{Duration, SystemTime};

use http_body_util::{BodyExt, Empty};
use hyper::Request;
use hyper::body::Bytes;
use hyper::client::conn::http1;
use hyper::header::HOST;
use hyper_util::rt::TokioIo;
use serde_json::{Value, json};
use tokio_postgres::Client;

use crate::config::{RelayConfig, SourceMode};
use crate::error::RelayError;
use crate::outboxes::Outbox;
use crate::source::sampler::BACKLOG_COUNT_CAP;

/// One line of the text report: what, and its value.
pub type Line = (&'static str, String);

/// The top-level keys of `status --format json`, in both modes (docs/commands.md describes
/// each). `slot` is `null` in polling mode, `leftover_slots` empty in replication mode; the
/// slot objects have [`SLOT_KEYS`].
pub const JSON_KEYS: [&str; 21] = [
    "mode",
    "database",
    "relay_sessions",
    "relay_sessions_streaming",
    "slot",
    "switchover",
    "backlog_rows",
    "backlog_capped",
    "oldest_unpublished_row_age_seconds",
    "leftover_slots",
    "dead_letter_table",
    "dead_letters_waiting",
    "dead_letters_oldest_age_seconds",
    "dead_letter_reasons",
    "dead_letters_error",
    "metrics_url",
    "metrics_answered",
    "readiness",
    "leader",
    "last_confirmation_unix_seconds",
    "events_published",
];

/// The keys of a slot object in `status --format json`.
pub const SLOT_KEYS: [&str; 11] = [
    "name",
    "exists",
    "holder_pid",
    "holder_application_name",
    "holder_address",
    "holder_since_unix_seconds",
    "lag_bytes",
    "retained_wal_bytes",
    "wal_status",
    "safe_wal_size_bytes",
    "confirmed_flush_lsn",
];

/// The report: its text lines, in order, and the same as typed JSON fields.
#[derive(Debug)]
pub struct Report {
    lines: Vec<Line>,
    fields: serde_json::Map<String, Value>,
}

impl Report {
    /// An empty report: every JSON key present, `null` (or empty) until a part sets it.
    fn new() -> Report {
        let mut fields: serde_json::Map<String, Value> =
            JSON_KEYS.iter().map(|k| (k.to_string(), Value::Null)).collect();
        for list in ["switchover", "leftover_slots", "dead_letter_reasons"] {
            fields.insert(list.into(), json!([]));
        }
        fields.insert("metrics_answered".into(), json!(false));
        Report { lines: Vec::new(), fields }
    }

    fn line(&mut self, what: &'static str, value: impl Into<String>) {
        self.lines.push((what, value.into()));
    }

    fn field(&mut self, key: &'static str, value: Value) {
        debug_assert!(JSON_KEYS.contains(&key), "{key} is not in JSON_KEYS");
        self.fields.insert(key.into(), value);
    }

    fn push(&mut self, key: &'static str, value: Value) {
        if let Some(Value::Array(list)) = self.fields.get_mut(key) {
            list.push(value);
        }
    }
}

impl super::Output for Report {
    /// `what  value`, the values aligned.
    fn text(&self) -> String {
        let width = self.lines.iter().map(|(k, _)| k.len()).max().unwrap_or(0);
        self.lines.iter().map(|(key, value)| format!("{key:<width$}  {value}\n")).collect()
    }

    /// One object with every key of [`JSON_KEYS`].
    fn json(&self) -> Option<String> {
        Some(serde_json::to_string_pretty(&self.fields).expect("json"))
    }

    fn exit_code(&self) -> u8 {
        0
    }
}

/// How long the metrics endpoint may take to answer.
const HTTP_TIMEOUT: Duration = Duration::from_secs(3);

const SLOT_SQL: &str = "SELECT s.active_pid, s.wal_status, s.safe_wal_size, \
     (pg_current_wal_lsn() - s.confirmed_flush_lsn)::bigint, (pg_current_wal_lsn() - s.restart_lsn)::bigint, \
     s.confirmed_flush_lsn::text, a.application_name, a.client_addr::text, \
     to_char(a.backend_start, 'YYYY-MM-DD HH24:MI:SS TZ'), extract(epoch FROM a.backend_start)::float8 \
     FROM pg_replication_slots s LEFT JOIN pg_stat_activity a ON a.pid = s.active_pid \
     WHERE s.slot_name = $1 AND s.database = current_database()";

/// Everything `status` shows, in order. `metrics_url`: the relay's listener
/// (`http://host:port`); by default the one `metrics.listen` names, on this host.
pub async fn run(
    config: &RelayConfig,
    outbox: &Outbox,
    metrics_url: Option<&str>,
) -> Result<Report, RelayError> {
    let (client, endpoint) = crate::postgres::connect_primary(&config.postgres).await?;
    let mut report = Report::new();
    report.line("mode", config.source.mode.to_string());
    report.field("mode", json!(config.source.mode.to_string()));
    let database = format!("{endpoint}/{}", config.postgres.database);
    report.line("database", database.clone());
    report.field("database", json!(database));
    relay_sessions(&client, config, &mut report).await?;
    match config.source.mode {
        SourceMode::Replication => {
            let (lines, slot) = slot(&client, &config.replication.slot).await?;
            report.lines.extend(lines);
            report.field("slot", slot);
            if config.replication.failover {
                for line in crate::ops::switchover::status_lines(config, &endpoint).await {
                    report.push("switchover", json!(line.1));
                    report.lines.push(line);
                }
            }
        }
        SourceMode::Polling => {
            backlog(&client, outbox, &mut report).await?;
            for left in crate::source::handover::leftover_slots(config, &client).await? {
                report.line("slot left by replication mode", left.remedy());
                let (lines, slot) = slot(&client, &left.name).await?;
                report.lines.extend(lines);
                report.push("leftover_slots", slot);
            }
        }
    }
    dead_letters(&client, outbox, &mut report).await?;
    match metrics_url.map(str::to_string).or_else(|| default_url(&config.metrics.listen)) {
        Some(url) => relay_view(&url, config.source.mode, &mut report).await,
        None => report.line("metrics endpoint", "off (metrics.listen is empty): --metrics-url names one"),
    }
    Ok(report)
}

/// The sessions named like this relay (`postgres.application_name`) on this database, this
/// command's own aside.
async fn relay_sessions(
    client: &Client,
    config: &RelayConfig,
    report: &mut Report,
) -> Result<(), RelayError> {
    let row = client
        .query_one(
            "SELECT count(*), count(*) FILTER (WHERE backend_type = 'walsender') FROM pg_stat_activity \
             WHERE application_name = $1 AND (datname = current_database() OR datname IS NULL) \
               AND pid <> pg_backend_pid()",
            &[&config.postgres.application_name],
        )
        .await?;
    let (all, walsenders): (i64, i64) = (row.get(0), row.get(1));
    report.line(
        "relay sessions",
        format!("{all} named {:?} ({walsenders} streaming)", config.postgres.application_name),
    );
    report.field("relay_sessions", json!(all));
    report.field("relay_sessions_streaming", json!(walsenders));
    Ok(())
}

/// The slot's lines, and its JSON object ([`SLOT_KEYS`]).
async fn slot(client: &Client, slot: &str) -> Result<(Vec<Line>, Value), RelayError> {
    let Some(row) = client.query_opt(SLOT_SQL, &[&slot]).await? else {
        let mut object: serde_json::Map<String, Value> =
            SLOT_KEYS.iter().map(|k| (k.to_string(), Value::Null)).collect();
        object.insert("name".into(), json!(slot));
        object.insert("exists".into(), json!(false));
        let line = ("slot", format!("\"{slot}\" does not exist: `outbox-relay setup` or `run` creates it"));
        return Ok((vec![line], Value::Object(object)));
    };
    let pid: Option<i32> = row.get(0);
    let (name, addr, since): (Option<String>, Option<String>, Option<String>) =
        (row.get(6), row.get(7), row.get(8));
    let holder = match pid {
        None => "none: no relay streams from it (the leader is down, or every instance is a standby)".into(),
        Some(pid) => format!(
            "pid {pid}, {} from {} since {}",
            name.clone().unwrap_or_default(),
            addr.clone().unwrap_or_else(|| "a local socket".into()),
            since.unwrap_or_default()
        ),
    };
    let bytes = |v: Option<i64>| v.map_or("-".to_string(), |b| format!("{b} bytes ({})", human(b)));
    let (wal_status, lsn): (Option<String>, Option<String>) = (row.get(1), row.get(5));
    let (safe, lag, retained): (Option<i64>, Option<i64>, Option<i64>) = (row.get(2), row.get(3), row.get(4));
    let object = json!({
        "name": slot, "exists": true,
        "holder_pid": pid, "holder_application_name": pid.and(name), "holder_address": pid.and(addr),
        "holder_since_unix_seconds": pid.and(row.get::<_, Option<f64>>(9)),
        "lag_bytes": lag, "retained_wal_bytes": retained, "wal_status": wal_status,
        "safe_wal_size_bytes": safe, "confirmed_flush_lsn": lsn,
    });
    let lines = vec![
        ("slot", format!("\"{slot}\"")),
        ("leader (slot holder)", holder),
        ("lag (WAL not confirmed)", bytes(lag)),
        ("retained WAL", bytes(retained)),
        ("wal_status", wal_status.unwrap_or_else(|| "-".into())),
        ("safe_wal_size", bytes(safe)),
        ("confirmed_flush_lsn", lsn.unwrap_or_else(|| "-".into())),
    ];
    Ok((lines, object))
}

async fn backlog(client: &Client, outbox: &Outbox, report: &mut Report) -> Result<(), RelayError> {
    let (count, age) = crate::source::sampler::backlog(&outbox.table, client).await?;
    let capped = count >= BACKLOG_COUNT_CAP;
    report.line(
        "backlog (unpublished rows)",
        match capped {
            true => format!("{BACKLOG_COUNT_CAP} or more"),
            false => count.to_string(),
        },
    );
    report.field("backlog_rows", json!(count));
    report.field("backlog_capped", json!(capped));
    if let Some(age) = age {
        report.line("oldest unpublished row", age.map_or("-".into(), |a| format!("{a:.1} s old")));
        report.field("oldest_unpublished_row_age_seconds", json!(age));
    }
    Ok(())
}

/// How many of this outbox's events wait in the dead-letter table, since when, and why.
async fn dead_letters(client: &Client, outbox: &Outbox, report: &mut Report) -> Result<(), RelayError> {
    let table = &outbox.dead_letter.table;
    report.field("dead_letter_table", json!(table.to_string()));
    let waiting =
        match crate::source::sampler::dead_letters((&outbox.dead_letter, &outbox.table), client, 3).await {
            Ok(Some(waiting)) => waiting,
            Ok(None) => {
                report.line("dead letters (waiting)", format!("none: there is no table {table}"));
                report.field("dead_letters_waiting", json!(0));
                return Ok(());
            }
            // (a role that may not read the table: the rest of status still helps)
            Err(e) => {
                report.line("dead letters (waiting)", format!("cannot read {table}: {e}"));
                report.field("dead_letters_error", json!(e.to_string()));
                return Ok(());
            }
        };
    let mut said = format!("{} in {table}", waiting.count);
    if let Some(age) = waiting.oldest_secs {
        said += &format!(", the oldest {} old", age_text(age));
    }
    report.line("dead letters (waiting)", said);
    report.field("dead_letters_waiting", json!(waiting.count));
    report.field("dead_letters_oldest_age_seconds", json!(waiting.oldest_secs));
    if !waiting.reasons.is_empty() {
        let reasons: Vec<String> =
            waiting.reasons.iter().map(|(reason, n)| format!("{n} x {reason}")).collect();
        report.line("dead-letter reasons", reasons.join("; "));
    }
    for (reason, count) in &waiting.reasons {
        report.push("dead_letter_reasons", json!({ "reason": reason, "count": count }));
    }
    Ok(())
}

/// `42.0 s`, `3.5 min`, `2.0 h`, `4.1 d`.
fn age_text(secs: f64) -> String {
    match secs {
        s if s < 120.0 => format!("{s:.1} s"),
        s if s < 7_200.0 => format!("{:.1} min", s / 60.0),
        s if s < 172_800.0 => format!("{:.1} h", s / 3_600.0),
        s => format!("{:.1} d", s / 86_400.0),
    }
}

/// What the relay itself says: readiness, leadership, and its progress: the last confirmation
/// (replication), or the events it published (polling, which confirms nothing).
async fn relay_view(url: &str, mode: SourceMode, report: &mut Report) {
    report.field("metrics_url", json!(url));
    let Some(scrape) = get(url, "/metrics").await else {
        report.line(
            "metrics endpoint",
            format!("{url}: no answer (is a relay running there? --metrics-url names another)"),
        );
        return;
    };
    let ready = get(url, "/readyz").await.unwrap_or_default();
    let now = SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).unwrap_or_default().as_secs_f64();
    relay_said(url, mode, (&scrape, &ready, now), report);
}

/// [`relay_view`] of a relay that answered: its `scrape` of `/metrics`, its `/readyz` body, at
/// `now` (Unix seconds).
fn relay_said(url: &str, mode: SourceMode, (scrape, ready, now): (&str, &str, f64), report: &mut Report) {
    let sample = |name: &str| {
        scrape
            .lines()
            .find(|l| l.starts_with(name) && l[name.len()..].starts_with([' ', '{']))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse::<f64>().ok())
    };
    let leads = sample(crate::observe::metrics::LEADER).map(|v| v >= 1.0);
    let leader = match leads {
        Some(true) => "yes (this instance streams or polls)",
        Some(false) => "no (standby, or not running its source)",
        None => "-",
    };
    let readiness = ready.lines().next().map(str::to_string);
    report.line("metrics endpoint", format!("{url}: answers"));
    report.line("readiness", readiness.clone().unwrap_or_else(|| "-".into()));
    report.line("this instance leads", leader);
    report.field("metrics_answered", json!(true));
    report.field("readiness", json!(readiness));
    report.field("leader", json!(leads));
    match mode {
        SourceMode::Replication => {
            let last = sample(crate::observe::metrics::LAST_CONFIRM).filter(|at| *at > 0.0);
            report.line(
                "last confirmation",
                last.map_or("never, by this instance".into(), |at| {
                    format!("{:.1} s ago", (now - at).max(0.0))
                }),
            );
            report.field("last_confirmation_unix_seconds", json!(last));
        }
        SourceMode::Polling => {
            let published = sample(crate::observe::metrics::EVENTS_PUBLISHED);
            report.line(
                "events published",
                published.map_or("-".into(), |n| format!("{n} by this instance since it started")),
            );
            report.field("events_published", json!(published.map(|n| n as u64)));
        }
    }
}

/// `http://HOST:PORT` for a listen address (`metrics.listen`, validated as ip:port), on this
/// host when it listens on every address; None when the listener is off.
fn default_url(listen: &str) -> Option<String> {
    let mut address: std::net::SocketAddr = listen.parse().ok()?;
    if address.ip().is_unspecified() {
        address.set_ip(std::net::Ipv4Addr::LOCALHOST.into());
    }
    Some(format!("http://{address}"))
}

/// A GET through hyper's HTTP/1 client: the body whatever the status (`/readyz` says why it
/// is not ready in a 503's body), or None without an answer in time.
async fn get(url: &str, path: &str) -> Option<String> {
    let authority = url.trim_start_matches("http://").trim_end_matches('/').to_string();
    let fetch = async {
        let stream = tokio::net::TcpStream::connect(&authority).await.ok()?;
        let (mut sender, connection) = http1::handshake(TokioIo::new(stream)).await.ok()?;
        // the connection is driven by its own task, and ends with the response
        tokio::spawn(async move {
            if let Err(e) = connection.await {
                tracing::debug!(error = %e, "metrics endpoint connection ended");
            }
        });
        let request = Request::get(path).header(HOST, authority.as_str()).body(Empty::<Bytes>::new()).ok()?;
        let response = sender.send_request(request).await.ok()?;
        let body = response.into_body().collect().await.ok()?.to_bytes();
        String::from_utf8(body.to_vec()).ok()
    };
    tokio::time::timeout(HTTP_TIMEOUT, fetch).await.ok().flatten()
}

/// `1234567` -> `1.2 MiB`.
fn human(bytes: i64) -> String {
    let mut value = bytes as f64;
    for unit in ["B", "KiB", "MiB", "GiB"] {
        if value.abs() < 1024.0 {
            return format!("{value:.1} {unit}");
        }
        value /= 1024.0;
    }
    format!("{value:.1} TiB")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `status --format json` had the text's prose as keys and values: its keys are
    /// [`JSON_KEYS`], whatever the relay says, and its values typed.
    #[test]
    fn the_json_report_has_stable_keys_and_typed_values() {
        use crate::ops::Output;
        let scrape = "outbox_relay_leader 1\noutbox_relay_events_published_total{mode=\"polling\"} 3\n";
        let mut report = Report::new();
        relay_said("http://127.0.0.1:9187", SourceMode::Polling, (scrape, "active\n", 100.0), &mut report);
        let json: Value = serde_json::from_str(&report.json().unwrap()).unwrap();
        let keys: Vec<&str> = json.as_object().unwrap().keys().map(String::as_str).collect();
        let mut expected = JSON_KEYS.to_vec();
        expected.sort_unstable();
        assert_eq!(keys, expected);
        assert_eq!(json["metrics_answered"], json!(true));
        assert_eq!(json["leader"], json!(true));
        assert_eq!(json["readiness"], json!("active"));
        assert_eq!(json["events_published"], json!(3));
        assert_eq!(json["last_confirmation_unix_seconds"], Value::Null);
        assert_eq!(
            report.text().lines().last(),
            Some("events published     3 by this instance since it started")
        );

        // and a replication relay that confirmed at 90 s, asked at 100 s
        let scrape = "outbox_relay_last_confirm_timestamp_seconds 90\n";
        let mut report = Report::new();
        relay_said("u", SourceMode::Replication, (scrape, "", 100.0), &mut report);
        assert_eq!(report.fields["last_confirmation_unix_seconds"], json!(90.0));
        assert_eq!(report.fields["leader"], Value::Null);
        assert_eq!(report.text().lines().last(), Some("last confirmation    10.0 s ago"));
    }

    #[test]
    fn the_default_url_is_the_listener_on_this_host() {
        assert_eq!(default_url("0.0.0.0:9187").unwrap(), "http://127.0.0.1:9187");
        assert_eq!(default_url("10.0.3.7:9300").unwrap(), "http://10.0.3.7:9300");
        assert_eq!(default_url(""), None);
    }

    #[test]
    fn ages_read_as_people_read_them() {
        assert_eq!(age_text(5.25), "5.2 s");
        assert_eq!(age_text(600.0), "10.0 min");
        assert_eq!(age_text(86_400.0), "24.0 h");
        assert_eq!(age_text(864_000.0), "10.0 d");
    }

    #[test]
    fn sizes_read_as_people_read_them() {
        assert_eq!(human(512), "512.0 B");
        assert_eq!(human(1_572_864), "1.5 MiB");
    }
}
