//! `outbox-relay status`: what an SRE needs to see first during an incident, in one command. It
//! reads PostgreSQL (the slot, the relay's sessions, the polling backlog, this outbox's waiting
//! dead letters) and a running relay's `/metrics` and `/readyz`; it changes nothing.

use std::time::{Duration, SystemTime};

use http_body_util::{BodyExt, Empty};
use hyper::Request;
use hyper::body::Bytes;
use hyper::client::conn::http1;
use hyper::header::HOST;
use hyper_util::rt::TokioIo;
use tokio_postgres::Client;

use crate::config::{RelayConfig, SourceMode};
use crate::error::RelayError;
use crate::outboxes::Outbox;
use crate::source::sampler::BACKLOG_COUNT_CAP;

/// One line of the report: what, and its value.
pub type Line = (&'static str, String);

/// The report: its lines, in order.
#[derive(Debug)]
pub struct Lines(pub Vec<Line>);

impl super::Output for Lines {
    /// `what  value`, the values aligned.
    fn text(&self) -> String {
        let width = self.0.iter().map(|(k, _)| k.len()).max().unwrap_or(0);
        self.0.iter().map(|(key, value)| format!("{key:<width$}  {value}\n")).collect()
    }

    /// An object of the lines (a key given twice keeps its last value).
    fn json(&self) -> Option<String> {
        let map: serde_json::Map<_, _> =
            self.0.iter().map(|(k, v)| (k.to_string(), serde_json::Value::String(v.clone()))).collect();
        Some(serde_json::to_string_pretty(&map).expect("json"))
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
     to_char(a.backend_start, 'YYYY-MM-DD HH24:MI:SS TZ') \
     FROM pg_replication_slots s LEFT JOIN pg_stat_activity a ON a.pid = s.active_pid \
     WHERE s.slot_name = $1 AND s.database = current_database()";

/// Everything `status` shows, in order. `metrics_url`: the relay's listener
/// (`http://host:port`); by default the one `metrics.listen` names, on this host.
pub async fn run(
    config: &RelayConfig,
    outbox: &Outbox,
    metrics_url: Option<&str>,
) -> Result<Vec<Line>, RelayError> {
    let (client, endpoint) = crate::postgres::connect_primary(&config.postgres).await?;
    let mut lines = vec![
        ("mode", config.source.mode.to_string()),
        ("database", format!("{endpoint}/{}", config.postgres.database)),
        ("relay sessions", relay_sessions(&client, config).await?),
    ];
    match config.source.mode {
        SourceMode::Replication => {
            lines.extend(slot(&client, &config.replication.slot).await?);
            if config.replication.failover {
                lines.extend(crate::ops::switchover::status_lines(config, &endpoint).await);
            }
        }
        SourceMode::Polling => {
            lines.extend(backlog(&client, outbox).await?);
            for left in crate::source::handover::leftover_slots(config, &client).await? {
                lines.push(("slot left by replication mode", left.remedy()));
                lines.extend(slot(&client, &left.name).await?);
            }
        }
    }
    lines.extend(dead_letters(&client, outbox).await?);
    match metrics_url.map(str::to_string).or_else(|| default_url(&config.metrics.listen)) {
        Some(url) => lines.extend(relay_view(&url, config.source.mode).await),
        None => {
            lines.push(("metrics endpoint", "off (metrics.listen is empty): --metrics-url names one".into()))
        }
    }
    Ok(lines)
}

/// The sessions named like this relay (`postgres.application_name`) on this database, this
/// command's own aside.
async fn relay_sessions(client: &Client, config: &RelayConfig) -> Result<String, RelayError> {
    let row = client
        .query_one(
            "SELECT count(*), count(*) FILTER (WHERE backend_type = 'walsender') FROM pg_stat_activity \
             WHERE application_name = $1 AND (datname = current_database() OR datname IS NULL) \
               AND pid <> pg_backend_pid()",
            &[&config.postgres.application_name],
        )
        .await?;
    let (all, walsenders): (i64, i64) = (row.get(0), row.get(1));
    Ok(format!("{all} named {:?} ({walsenders} streaming)", config.postgres.application_name))
}

async fn slot(client: &Client, slot: &str) -> Result<Vec<Line>, RelayError> {
    let Some(row) = client.query_opt(SLOT_SQL, &[&slot]).await? else {
        return Ok(vec![(
            "slot",
            format!("\"{slot}\" does not exist: `outbox-relay setup` or `run` creates it"),
        )]);
    };
    let pid: Option<i32> = row.get(0);
    let holder = match pid {
        None => "none: no relay streams from it (the leader is down, or every instance is a standby)".into(),
        Some(pid) => {
            let (name, addr, since): (Option<String>, Option<String>, Option<String>) =
                (row.get(6), row.get(7), row.get(8));
            format!(
                "pid {pid}, {} from {} since {}",
                name.unwrap_or_default(),
                addr.unwrap_or_else(|| "a local socket".into()),
                since.unwrap_or_default()
            )
        }
    };
    let bytes = |v: Option<i64>| v.map_or("-".to_string(), |b| format!("{b} bytes ({})", human(b)));
    Ok(vec![
        ("slot", format!("\"{slot}\"")),
        ("leader (slot holder)", holder),
        ("lag (WAL not confirmed)", bytes(row.get(3))),
        ("retained WAL", bytes(row.get(4))),
        ("wal_status", row.get::<_, Option<String>>(1).unwrap_or_else(|| "-".into())),
        ("safe_wal_size", bytes(row.get(2))),
        ("confirmed_flush_lsn", row.get::<_, Option<String>>(5).unwrap_or_else(|| "-".into())),
    ])
}

async fn backlog(client: &Client, outbox: &Outbox) -> Result<Vec<Line>, RelayError> {
    let (count, age) = crate::source::sampler::backlog(&outbox.table, client).await?;
    let mut lines = vec![(
        "backlog (unpublished rows)",
        match count >= BACKLOG_COUNT_CAP {
            true => format!("{BACKLOG_COUNT_CAP} or more"),
            false => count.to_string(),
        },
    )];
    if let Some(age) = age {
        lines.push(("oldest unpublished row", age.map_or("-".into(), |a| format!("{a:.1} s old"))));
    }
    Ok(lines)
}

/// How many of this outbox's events wait in the dead-letter table, since when, and why.
async fn dead_letters(client: &Client, outbox: &Outbox) -> Result<Vec<Line>, RelayError> {
    let table = &outbox.dead_letter.table;
    let waiting = match crate::source::sampler::dead_letters((&outbox.dead_letter, &outbox.table), client, 3)
        .await
    {
        Ok(Some(waiting)) => waiting,
        Ok(None) => return Ok(vec![("dead letters (waiting)", format!("none: there is no table {table}"))]),
        // (a role that may not read the table: the rest of status still helps)
        Err(e) => return Ok(vec![("dead letters (waiting)", format!("cannot read {table}: {e}"))]),
    };
    let mut said = format!("{} in {table}", waiting.count);
    if let Some(age) = waiting.oldest_secs {
        said += &format!(", the oldest {} old", age_text(age));
    }
    let mut lines = vec![("dead letters (waiting)", said)];
    if !waiting.reasons.is_empty() {
        let reasons: Vec<String> =
            waiting.reasons.iter().map(|(reason, n)| format!("{n} x {reason}")).collect();
        lines.push(("dead-letter reasons", reasons.join("; ")));
    }
    Ok(lines)
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
async fn relay_view(url: &str, mode: SourceMode) -> Vec<Line> {
    let Some(scrape) = get(url, "/metrics").await else {
        return vec![(
            "metrics endpoint",
            format!("{url}: no answer (is a relay running there? --metrics-url names another)"),
        )];
    };
    let sample = |name: &str| {
        scrape
            .lines()
            .find(|l| l.starts_with(name) && l[name.len()..].starts_with([' ', '{']))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse::<f64>().ok())
    };
    let ready = get(url, "/readyz").await.unwrap_or_default();
    let leader = match sample(crate::observe::metrics::LEADER) {
        Some(v) if v >= 1.0 => "yes (this instance streams or polls)",
        Some(_) => "no (standby, or not running its source)",
        None => "-",
    };
    let now = SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).unwrap_or_default().as_secs_f64();
    let progress = match mode {
        SourceMode::Replication => (
            "last confirmation",
            match sample(crate::observe::metrics::LAST_CONFIRM) {
                Some(at) if at > 0.0 => format!("{:.1} s ago", (now - at).max(0.0)),
                _ => "never, by this instance".into(),
            },
        ),
        SourceMode::Polling => (
            "events published",
            match sample(crate::observe::metrics::EVENTS_PUBLISHED) {
                Some(n) => format!("{n} by this instance since it started"),
                None => "-".into(),
            },
        ),
    };
    vec![
        ("metrics endpoint", format!("{url}: answers")),
        ("readiness", ready.lines().next().unwrap_or("-").to_string()),
        ("this instance leads", leader.into()),
        progress,
    ]
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
