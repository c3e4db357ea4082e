//! One relay reading ten outbox tables from one slot against ten relays with one table each
//! (issue 31), measured side by side in one run, the order flipped each run so that the
//! machine's drift hits both alike. Both read ten tables of one database (`outbox_0` ..
//! `outbox_9`, made like `outbox_events`), outbox `i` publishing to the topic `o{i}.<type>`:
//! - backlog drain: `--events` (100,000 for this section unless given), transactions of 10
//!   events, each to one table, the tables in turn, written after the slots were made and while
//!   no relay runs; the time from starting the relays until Kafka acknowledged every event, and
//!   until every slot confirmed the last commit;
//! - steady state: the first of `--rates` (2,000 events/s by default) over the same ten tables
//!   for `--duration-secs`, after a warm-up, until every event is acknowledged;
//! - in both: the relays' CPU seconds (utime+stime) and peak RSS (`VmHWM`), summed over the
//!   relays; the CPU seconds of their walsenders and of their other PostgreSQL sessions
//!   (publication checks, the record of what was published), read from /proc/PID/stat of the
//!   sessions `pg_stat_activity` lists under the relay's application name, every 250 ms while
//!   they run, and once more before the relays stop.
//!
//! Ten relays mean ten walsenders, each decoding all of the database's WAL and sending the tenth
//! its publication names; one relay means one walsender decoding it once.
//!
//! `deploy/local/bench --only outboxes` runs this alone and writes its section of BENCHMARKS.md.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use outbox_relay::config::DEFAULT_PG_APPLICATION_NAME;
use tokio_postgres::Client;

use super::common::{TestDb, connect, create_topic, random_suffix, services, wait_until_within};
use super::{DRAIN_LIMIT, Options, PARTITIONS, Relay, confirmed, cpu_seconds, drop_topic, stat, wal_lsn};

const OUTBOXES: usize = 10;
/// How often the PostgreSQL sessions' CPU is read while they run.
const SAMPLE_EVERY: Duration = Duration::from_millis(250);
/// How long the steady state waits for its last events after the window.
const SETTLE_LIMIT: Duration = Duration::from_secs(30);

/// Transactions of 10 events, each to one of the ten outboxes, the outboxes in turn; the
/// backlog's rows otherwise as `write_backlog`'s (~200-byte payloads, 1,000 aggregates).
const WRITE_SPREAD_SQL: &str = "CREATE PROCEDURE write_spread(total int, aggregate_type text) LANGUAGE plpgsql AS $$
     BEGIN
       FOR t IN 0 .. total / 10 - 1 LOOP
         EXECUTE 'INSERT INTO outbox_' || t % 10 || $q$ (aggregate_type, aggregate_id, event_type, payload)
           SELECT $1, (($2 * 10 + i) % 1000)::text, 'OrderPlaced',
                  jsonb_build_object('order_id', $2 * 10 + i, 'customer', 'customer-' || (($2 * 10 + i) % 977),
                    'total_cents', ($2 * 10 + i) % 100000, 'currency', 'EUR', 'status', 'placed',
                    'note', repeat('x', 60), 'written_at', clock_timestamp())
           FROM generate_series(0, 9) i $q$ USING aggregate_type, t;
         COMMIT;
       END LOOP;
     END $$;";

/// How the ten outboxes are read.
#[derive(Clone, Copy)]
enum Setup {
    /// One relay listing the ten tables: one slot, one publication, one walsender.
    OneRelay,
    /// Ten relays with one table each: ten slots, publications and walsenders.
    TenRelays,
}

impl Setup {
    /// The outboxes each relay lists.
    fn relays(self) -> Vec<Vec<usize>> {
        match self {
            Setup::OneRelay => vec![(0..OUTBOXES).collect()],
            Setup::TenRelays => (0..OUTBOXES).map(|i| vec![i]).collect(),
        }
    }

    fn label(self) -> &'static str {
        match self {
            Setup::OneRelay => "one relay with ten outboxes",
            Setup::TenRelays => "ten relays with one outbox each",
        }
    }
}

/// One measurement of one setup, summed over its relays.
#[derive(Default, Clone)]
struct Measure {
    /// Drain: seconds until Kafka acknowledged every event; steady state: the window, from the
    /// first event written to the last acknowledged.
    seconds: f64,
    /// Drain: seconds until every slot confirmed the last commit.
    confirmed_seconds: f64,
    /// Drain: seconds until every relay had its first event acknowledged (its start-up: the
    /// slot, the publication check, reading its first topic back).
    started_seconds: f64,
    /// The events the figures are for.
    events: usize,
    relay_cpu: f64,
    relay_rss_mib: f64,
    walsender_cpu: f64,
    /// The relays' other PostgreSQL sessions.
    session_cpu: f64,
    walsenders: usize,
    /// Steady state: every event acknowledged and the writer kept its rate.
    sustained: bool,
}

/// Every run's measurements, per setup: [one relay, ten relays].
#[derive(Default)]
pub struct OutboxesCost {
    drains: [Vec<Measure>; 2],
    steady: [Vec<Measure>; 2],
    /// /proc/loadavg at the start and at the end of the measurements.
    load: (String, String),
}

fn events(o: &Options) -> usize {
    if o.events_given { o.events } else { 100_000 }
}

fn rate(o: &Options) -> usize {
    o.rates.first().copied().unwrap_or(2_000)
}

/// The 1, 5 and 15 minute load averages.
fn load_average() -> String {
    let text = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    text.split_whitespace().take(3).collect::<Vec<_>>().join(" ")
}

/// Every measurement `o.runs` times: the drains of both setups, then their steady states, the
/// order flipped each run.
pub async fn run(o: &Options) -> OutboxesCost {
    let mut cost = OutboxesCost { load: (load_average(), String::new()), ..Default::default() };
    let (events, rate) = (events(o), rate(o));
    for run in 1..=o.runs {
        let order = if run % 2 == 1 { [0, 1] } else { [1, 0] };
        for s in order {
            let setup = [Setup::OneRelay, Setup::TenRelays][s];
            eprintln!("[bench] outboxes run {run}/{}: drain of {events}, {}", o.runs, setup.label());
            let d = drain(setup, events).await;
            eprintln!(
                "[bench]   {:.0}/s ({:.0}/s to the slots' confirmation, first events after {:.2} s), relays CPU {:.2} s, RSS {:.1} MiB, \
                 {} walsenders CPU {:.2} s, other sessions {:.2} s",
                events as f64 / d.seconds,
                events as f64 / d.confirmed_seconds,
                d.started_seconds,
                d.relay_cpu,
                d.relay_rss_mib,
                d.walsenders,
                d.walsender_cpu,
                d.session_cpu
            );
            cost.drains[s].push(d);
        }
        for s in order {
            let setup = [Setup::OneRelay, Setup::TenRelays][s];
            eprintln!(
                "[bench] outboxes run {run}/{}: {rate}/s for {:?}, {}",
                o.runs,
                o.duration,
                setup.label()
            );
            let m = steady(setup, rate, o.duration).await;
            eprintln!(
                "[bench]   {} events in {:.1} s, relays CPU {:.2} s, RSS {:.1} MiB, {} walsenders CPU {:.2} s, \
                 other sessions {:.2} s, sustained {}",
                m.events,
                m.seconds,
                m.relay_cpu,
                m.relay_rss_mib,
                m.walsenders,
                m.walsender_cpu,
                m.session_cpu,
                m.sustained
            );
            cost.steady[s].push(m);
        }
    }
    cost.load.1 = load_average();
    cost
}

/// A fresh database with the ten outbox tables, the backlog writer and their topics.
struct Outboxes {
    db: TestDb,
    client: Client,
    aggregate_type: String,
}

impl Outboxes {
    async fn create() -> Outboxes {
        let db = TestDb::new().await;
        let client = db.client().await;
        let tables: String = (0..OUTBOXES)
            .map(|i| {
                format!(
                    "CREATE TABLE outbox_{i} (LIKE outbox_events INCLUDING DEFAULTS INCLUDING IDENTITY);\n"
                )
            })
            .collect();
        client.batch_execute(&format!("{tables}{WRITE_SPREAD_SQL}")).await.unwrap();
        let aggregate_type = format!("m{}", random_suffix());
        for i in 0..OUTBOXES {
            create_topic(&topic(i, &aggregate_type), PARTITIONS).await;
        }
        Outboxes { db, client, aggregate_type }
    }

    /// Deletes the topics, then the database.
    async fn remove(self) {
        let Outboxes { db, client, aggregate_type } = self;
        drop(client);
        drop(db);
        for i in 0..OUTBOXES {
            drop_topic(&topic(i, &aggregate_type)).await;
        }
    }
}

fn topic(outbox: usize, aggregate_type: &str) -> String {
    format!("o{outbox}.{aggregate_type}")
}

/// The `[[outboxes]]` entries of a relay listing `outboxes`.
fn outboxes_toml(outboxes: &[usize]) -> String {
    outboxes
        .iter()
        .map(|i| {
            format!("[[outboxes]]\nname = \"ob{i}\"\ntable = \"outbox_{i}\"\ntopic_template = \"o{i}.{{aggregate_type}}\"\n")
        })
        .collect()
}

/// Each relay's slot and configuration lines.
fn configurations(setup: Setup) -> Vec<(String, String)> {
    setup
        .relays()
        .iter()
        .map(|outboxes| (format!("s_{}", random_suffix()), outboxes_toml(outboxes)))
        .collect()
}

fn start(db: &TestDb, configurations: &[(String, String)]) -> Vec<Relay> {
    configurations.iter().map(|(slot, toml)| Relay::start_with(db, "replication", slot, "", toml)).collect()
}

fn published(relays: &[Relay]) -> f64 {
    relays.iter().map(Relay::published).sum()
}

/// (peak RSS in MiB, CPU seconds), summed over `relays`.
fn usage(relays: &[Relay]) -> (f64, f64) {
    relays.iter().map(Relay::usage).fold((0.0, 0.0), |(rss, cpu), (r, c)| (rss + r, cpu + c))
}

/// The CPU seconds of the relays' PostgreSQL sessions, by pid: (walsender, the latest seen).
#[derive(Default, Clone)]
struct Sessions {
    cpu: HashMap<i32, (bool, f64)>,
    sampled: Option<Instant>,
}

impl Sessions {
    /// Reads every session's CPU.
    async fn sample(&mut self, client: &Client) {
        let rows = client
            .query(
                "SELECT pid, backend_type = 'walsender' FROM pg_stat_activity \
                 WHERE datname = current_database() AND application_name = $1",
                &[&DEFAULT_PG_APPLICATION_NAME],
            )
            .await
            .unwrap();
        for row in rows {
            let pid: i32 = row.get(0);
            if let Some(seconds) = cpu_seconds(pid as u32) {
                self.cpu.insert(pid, (row.get(1), seconds));
            }
        }
        self.sampled = Some(Instant::now());
    }

    /// As [`Sessions::sample`], at most every [`SAMPLE_EVERY`].
    async fn sample_due(&mut self, client: &Client) {
        if self.sampled.is_none_or(|at| at.elapsed() >= SAMPLE_EVERY) {
            self.sample(client).await;
        }
    }

    /// CPU seconds since `baseline` of the walsenders (`walsender`) or of the other sessions; a
    /// session that started after it counts from its start.
    fn cpu_since(&self, baseline: &Sessions, walsender: bool) -> f64 {
        let before = |pid: &i32| baseline.cpu.get(pid).map_or(0.0, |(_, seconds)| *seconds);
        self.cpu
            .iter()
            .filter(|(_, (w, _))| *w == walsender)
            .map(|(pid, (_, seconds))| seconds - before(pid))
            .sum()
    }

    fn walsenders(&self) -> usize {
        self.cpu.values().filter(|(walsender, _)| *walsender).count()
    }
}

/// The events outbox `i` of ten gets of a backlog of `events` written by `write_spread`.
fn backlog_share(events: usize, i: usize) -> usize {
    let transactions = events / 10;
    (transactions / OUTBOXES + usize::from(i < transactions % OUTBOXES)) * 10
}

/// One drain of a backlog of `events` spread over the ten outboxes, read as `setup` reads them.
async fn drain(setup: Setup, events: usize) -> Measure {
    let outboxes = Outboxes::create().await;
    let (db, client) = (&outboxes.db, &outboxes.client);
    let configurations = configurations(setup);
    for (slot, toml) in &configurations {
        Relay::setup_with(db, slot, toml);
    }
    let events = (0..OUTBOXES).map(|i| backlog_share(events, i)).sum::<usize>();
    client.execute("CALL write_spread($1, $2)", &[&(events as i32), &outboxes.aggregate_type]).await.unwrap();
    let end = wal_lsn(client).await;
    let started = Instant::now();
    let relays = start(db, &configurations);
    let mut sessions = Sessions::default();
    let mut started_seconds = None;
    wait_until_within(DRAIN_LIMIT, "every event of the ten outboxes", async || {
        sessions.sample_due(client).await;
        if started_seconds.is_none() && relays.iter().all(|r| r.published() >= 1.0) {
            started_seconds = Some(started.elapsed().as_secs_f64());
        }
        published(&relays) >= events as f64
    })
    .await;
    let seconds = started.elapsed().as_secs_f64();
    wait_until_within(DRAIN_LIMIT, "every slot to confirm the last commit", async || {
        sessions.sample_due(client).await;
        for (slot, _) in &configurations {
            if confirmed(client, slot).await < end {
                return false;
            }
        }
        true
    })
    .await;
    let confirmed_seconds = started.elapsed().as_secs_f64();
    sessions.sample(client).await;
    let (relay_rss_mib, relay_cpu) = usage(&relays);
    drop(relays);
    outboxes.remove().await;
    let none = Sessions::default();
    Measure {
        seconds,
        confirmed_seconds,
        started_seconds: started_seconds.unwrap_or(0.0),
        events,
        relay_cpu,
        relay_rss_mib,
        walsender_cpu: sessions.cpu_since(&none, true),
        session_cpu: sessions.cpu_since(&none, false),
        walsenders: sessions.walsenders(),
        sustained: true,
    }
}

/// `rate` events/s over the ten outboxes for `duration`, read as `setup` reads them.
async fn steady(setup: Setup, rate: usize, duration: Duration) -> Measure {
    // (a quiet server: flush what the measurements before wrote, as the latency runs do)
    connect(&services().pg_url).await.batch_execute("CHECKPOINT").await.unwrap();
    let outboxes = Outboxes::create().await;
    let (db, client) = (&outboxes.db, &outboxes.client);
    // (the slots made first, as for the drain: ten relays making theirs at once is start-up)
    let configurations = configurations(setup);
    for (slot, toml) in &configurations {
        Relay::setup_with(db, slot, toml);
    }
    let relays = start(db, &configurations);
    for relay in &relays {
        relay.process.wait_ready("active").await;
    }
    warm_up(&relays, client, &outboxes.aggregate_type).await;
    let warm = published(&relays);
    let mut sessions = Sessions::default();
    sessions.sample(client).await;
    let baseline = sessions.clone();
    let relay_cpu_before = usage(&relays).1;
    let started = Instant::now();
    let writer =
        tokio::spawn(write_spread_at(db.url.clone(), outboxes.aggregate_type.clone(), rate, duration));
    while !writer.is_finished() {
        sessions.sample_due(client).await;
        tokio::time::sleep(SAMPLE_EVERY).await;
    }
    let (events, achieved) = writer.await.unwrap();
    let settle = Instant::now();
    while published(&relays) < warm + events as f64 && settle.elapsed() < SETTLE_LIMIT {
        sessions.sample_due(client).await;
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let all_acknowledged = published(&relays) >= warm + events as f64;
    let seconds = started.elapsed().as_secs_f64();
    sessions.sample(client).await;
    let (relay_rss_mib, relay_cpu) = usage(&relays);
    drop(relays);
    outboxes.remove().await;
    Measure {
        seconds,
        events,
        relay_cpu: relay_cpu - relay_cpu_before,
        relay_rss_mib,
        walsender_cpu: sessions.cpu_since(&baseline, true),
        session_cpu: sessions.cpu_since(&baseline, false),
        walsenders: sessions.walsenders(),
        sustained: all_acknowledged && achieved >= rate as f64 * 0.95,
        ..Measure::default()
    }
}

/// Ten events to each outbox, then 3 s: each relay reads its topics back before its first
/// record to them, which is start-up, not the steady state.
async fn warm_up(relays: &[Relay], client: &Client, aggregate_type: &str) {
    for i in 0..OUTBOXES {
        let insert = format!(
            "INSERT INTO outbox_{i} (aggregate_type, aggregate_id, event_type, payload) \
             SELECT $1, 'warm-up', 'WarmUp', '{{}}' FROM generate_series(1, 10)"
        );
        client.execute(&insert, &[&aggregate_type]).await.unwrap();
    }
    let warm = (OUTBOXES * 10) as f64;
    wait_until_within(Duration::from_secs(60), "the warm-up events", async || published(relays) >= warm)
        .await;
    tokio::time::sleep(Duration::from_secs(3)).await;
}

/// Commits transactions of 10 events at `rate` events/s for `duration`, each to the next of the
/// ten outboxes; returns the events committed and the rate achieved.
async fn write_spread_at(
    url: String,
    aggregate_type: String,
    rate: usize,
    duration: Duration,
) -> (usize, f64) {
    let client = connect(&url).await;
    let mut inserts = Vec::with_capacity(OUTBOXES);
    for i in 0..OUTBOXES {
        let insert = format!(
            "INSERT INTO outbox_{i} (aggregate_type, aggregate_id, event_type, payload) \
             SELECT $1, (g % 1000)::text, 'OrderPlaced', jsonb_build_object('note', repeat('x', 150)) \
             FROM generate_series(1, 10) g"
        );
        inserts.push(client.prepare(&insert).await.unwrap());
    }
    let interval = Duration::from_secs_f64(10.0 / rate.max(10) as f64);
    let started = Instant::now();
    let mut next = started;
    let mut transactions = 0;
    while started.elapsed() < duration {
        client.execute(&inserts[transactions % OUTBOXES], &[&aggregate_type]).await.unwrap();
        transactions += 1;
        next += interval;
        if let Some(wait) = next.checked_duration_since(Instant::now()) {
            tokio::time::sleep(wait).await;
        }
    }
    let events = transactions * 10;
    (events, events as f64 / started.elapsed().as_secs_f64())
}

/// One row: the measure for one relay and for ten, and each run's ten / one.
fn row(name: &str, runs: &[Vec<Measure>; 2], digits: usize, f: impl Fn(&Measure) -> f64) -> String {
    let [one, ten] = runs.each_ref().map(|r| r.iter().map(&f).collect::<Vec<f64>>());
    let ratios: Vec<f64> = one.iter().zip(&ten).map(|(o, t)| t / o).collect();
    format!("| {name} | {} | {} | {} |\n", stat(&one, digits), stat(&ten, digits), stat(&ratios, 2))
}

/// The drain rows.
fn drain_rows(events: usize, drains: &[Vec<Measure>; 2]) -> String {
    let per_100k = |cpu: f64, m: &Measure| cpu * 100_000.0 / m.events as f64;
    [
        row(&format!("drain of {events}, until every event is in Kafka, events/s"), drains, 0, |m| {
            m.events as f64 / m.seconds
        }),
        row("drain, until every slot confirmed the last commit, events/s", drains, 0, |m| {
            m.events as f64 / m.confirmed_seconds
        }),
        row("drain, start until every relay's first event was acknowledged, s", drains, 2, |m| {
            m.started_seconds
        }),
        row("drain, relays' CPU, s", drains, 2, |m| m.relay_cpu),
        row("drain, relays' CPU per 100k events, s", drains, 2, |m| per_100k(m.relay_cpu, m)),
        row("drain, relays' peak RSS (summed), MiB", drains, 1, |m| m.relay_rss_mib),
        row("drain, walsenders' CPU, s", drains, 2, |m| m.walsender_cpu),
        row("drain, walsenders' CPU per 100k events, s", drains, 2, |m| per_100k(m.walsender_cpu, m)),
        row("drain, the relays' other PostgreSQL sessions' CPU, s", drains, 2, |m| m.session_cpu),
        row("drain, walsenders seen", drains, 0, |m| m.walsenders as f64),
    ]
    .concat()
}

/// The steady-state rows.
fn steady_rows(rate: usize, steady: &[Vec<Measure>; 2]) -> String {
    let at = format!("at {rate} events/s");
    let percent = |cpu: f64, m: &Measure| cpu * 100.0 / m.seconds;
    let sustained =
        |runs: &[Measure]| format!("{}/{}", runs.iter().filter(|m| m.sustained).count(), runs.len());
    [
        row(&format!("{at}, relays' CPU, % of a core"), steady, 1, |m| percent(m.relay_cpu, m)),
        row(&format!("{at}, relays' CPU per 100k events, s"), steady, 2, |m| {
            m.relay_cpu * 100_000.0 / m.events as f64
        }),
        row(&format!("{at}, relays' peak RSS (summed), MiB"), steady, 1, |m| m.relay_rss_mib),
        row(&format!("{at}, walsenders' CPU, % of a core"), steady, 1, |m| percent(m.walsender_cpu, m)),
        row(&format!("{at}, the relays' other PostgreSQL sessions' CPU, % of a core"), steady, 1, |m| {
            percent(m.session_cpu, m)
        }),
        row(&format!("{at}, walsenders seen"), steady, 0, |m| m.walsenders as f64),
        format!("| {at}, sustained (runs) | {} | {} | |\n", sustained(&steady[0]), sustained(&steady[1])),
    ]
    .concat()
}

/// The section's text (markdown): the machine, its load, the table.
pub fn render(o: &Options, cost: &OutboxesCost) -> String {
    let (events, rate) = (events(o), rate(o));
    let mut out = format!(
        "{}  \nLoad average (1, 5, 15 min) at the start: {}; at the end: {}. Relay settings: the defaults; topics of \
         {PARTITIONS} partitions, one per outbox.  \n\n",
        super::report::machine(),
        cost.load.0,
        cost.load.1
    );
    out += &format!(
        "| measure ({events} events over {OUTBOXES} outboxes; {rate} events/s for {} s; median of {} runs, min-max) \
         | one relay, ten outboxes | ten relays, one outbox each | ten relays / one relay |\n|---|---|---|---|\n",
        o.duration.as_secs(),
        o.runs
    );
    out += &drain_rows(events, &cost.drains);
    out + &steady_rows(rate, &cost.steady)
}
