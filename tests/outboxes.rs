//! Several outbox tables read by one relay from one slot (`[[outboxes]]`): transactions that
//! write to several of them, a relay killed with SIGKILL under load, and what arrived in each
//! outbox's topic.

use crate::common::workload::{assert_delivered, committed_counts, consume_unique};
use crate::common::{IDLE, LINGER, RelayToml, Setup, connect, consumer, create_topic};

/// The tables of `n` outboxes: `outbox_events`, then `outbox_1` .. `outbox_{n-1}`, made like it
/// (ids of their own range, so an event id names one event across the tables).
async fn create_outbox_tables(client: &tokio_postgres::Client, n: usize) -> Vec<String> {
    let mut tables = vec!["outbox_events".to_string()];
    for i in 1..n {
        let table = format!("outbox_{i}");
        client
            .batch_execute(&format!(
                "CREATE TABLE {table} (LIKE outbox_events INCLUDING DEFAULTS INCLUDING IDENTITY); \
                 ALTER TABLE {table} ALTER COLUMN id RESTART WITH {}",
                i * 1_000_000_000
            ))
            .await
            .unwrap();
        tables.push(table);
    }
    tables
}

/// The relay's configuration: one `[[outboxes]]` entry per table, outbox `i` publishing to
/// `o{i}.{aggregate_type}` (the first to the default template's topic).
fn outboxes_toml(tables: &[String]) -> String {
    let mut toml = String::new();
    for (i, table) in tables.iter().enumerate() {
        toml.push_str(&format!("[[outboxes]]\nname = \"ob{i}\"\ntable = \"{table}\"\n"));
        if i > 0 {
            toml.push_str(&format!("topic_template = \"o{i}.{{aggregate_type}}\"\n"));
        }
    }
    toml
}

/// `writers` connections write `total` transactions, each to two or three of the outboxes
/// `tables` (one to five events each), per aggregate under its row lock. Outbox `i`'s
/// aggregates are `{i}-agg-0` .. `{i}-agg-{aggregates-1}`.
async fn write_across(url: &str, aggregate_type: &str, tables: &[String], aggregates: usize, total: usize) {
    const WRITERS: usize = 4;
    let mut tasks = Vec::new();
    for w in 0..WRITERS {
        let (url, aggregate_type, tables) = (url.to_string(), aggregate_type.to_string(), tables.to_vec());
        let share = total / WRITERS + usize::from(w < total % WRITERS);
        tasks.push(tokio::spawn(async move {
            let mut client = connect(&url).await;
            for _ in 0..share {
                let tx = client.transaction().await.unwrap();
                let outboxes = rand::random_range(2..=3.min(tables.len()));
                let mut chosen: Vec<usize> = (0..tables.len()).collect();
                // (a random choice of `outboxes` of them)
                for k in 0..outboxes {
                    chosen.swap(k, rand::random_range(k..tables.len()));
                }
                // (aggregates locked in one order, outbox by outbox: writers never deadlock)
                let chosen = &mut chosen[..outboxes];
                chosen.sort_unstable();
                for &i in chosen.iter() {
                    let aggregate = format!("{i}-agg-{}", rand::random_range(0..aggregates));
                    for _ in 0..rand::random_range(1..=5) {
                        let seq: i64 = tx
                            .query_one(
                                "UPDATE test_aggregates SET seq = seq + 1 WHERE id = $1 RETURNING seq",
                                &[&aggregate],
                            )
                            .await
                            .unwrap()
                            .get(0);
                        let insert = format!(
                            "INSERT INTO {} (aggregate_type, aggregate_id, event_type, payload) \
                             VALUES ($1, $2, 'SeqEvent', jsonb_build_object('seq', $3::bigint))",
                            tables[i]
                        );
                        tx.execute(&insert, &[&aggregate_type, &aggregate, &seq]).await.unwrap();
                    }
                }
                tx.commit().await.unwrap();
            }
        }));
    }
    for task in tasks {
        task.await.unwrap();
    }
}

/// `n` outboxes in one database, one relay in `mode` killed with SIGKILL while writers write
/// across them: each outbox's events arrive in its own topic, all of them, once, in
/// per-aggregate order; in replication mode the relay reads them over one walsender.
async fn several_outboxes_through_a_kill_9(mode: &str, n: usize, transactions: usize) {
    // given n outbox tables and one relay listing them all
    let replication = mode == "replication";
    let s = Setup::create(&crate::common::services().kafka, "", true, |slot| {
        format!("{}\n", RelayToml::either(mode, slot))
    })
    .await;
    let client = s.db.client().await;
    let tables = create_outbox_tables(&client, n).await;
    let config = std::fs::read_to_string(s.config()).unwrap();
    std::fs::write(s.config(), format!("{config}\n{}", outboxes_toml(&tables))).unwrap();
    const AGGREGATES: usize = 20;
    client.batch_execute(crate::common::workload::AGGREGATE_SQL).await.unwrap();
    client
        .execute(
            "INSERT INTO test_aggregates (id) SELECT o || '-agg-' || g FROM generate_series(0, $1 - 1) o, \
             generate_series(0, $2 - 1) g",
            &[&(n as i32), &(AGGREGATES as i32)],
        )
        .await
        .unwrap();
    let mut topics = vec![s.topic.clone()];
    for i in 1..n {
        let topic = format!("o{i}.{}", s.aggregate_type);
        create_topic(&topic, 4).await;
        topics.push(topic);
    }
    let consumer = consumer(&topics.iter().map(String::as_str).collect::<Vec<_>>());
    // (the first relay reports its position seldom: what it sent before the kill is sent again by
    // the slot, and the read-back must recognise it, outbox by outbox)
    let mut relay = s.start_with_env("first", &[("OUTBOX_RELAY__REPLICATION__STATUS_INTERVAL_MS", "60000")]);
    relay.wait_ready("active").await;

    // when writers write transactions across the outboxes, and the relay is killed with
    // SIGKILL once some of them arrived, then started again
    let writer = tokio::spawn({
        let (url, aggregate_type, tables) = (s.db.url.clone(), s.aggregate_type.clone(), tables.clone());
        async move { write_across(&url, &aggregate_type, &tables, AGGREGATES, transactions).await }
    });
    let mut records = crate::common::consume(&consumer, 500, IDLE).await;
    assert!(!records.is_empty(), "{}", relay.log_text());
    // (one walsender for every outbox)
    let walsenders: i64 = client
        .query_one(
            "SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'walsender' AND datname = current_database()",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(walsenders, i64::from(replication), "one walsender reads every outbox");
    relay.kill9();
    writer.await.unwrap();
    let mut relay = s.start("second");

    // then every committed event of every outbox arrives in its outbox's topic, once, each
    // aggregate's in order, and nothing else
    let committed = committed_counts(&client).await;
    let total: i64 = committed.values().sum();
    let unique = crate::common::workload::unique_ids(&records).len();
    records.extend(consume_unique(&consumer, total as usize - unique, IDLE, LINGER).await);
    let report = assert_delivered(&records, &committed);
    assert_eq!(report.unique as i64, total, "{}", relay.log_text());
    assert_eq!(report.duplicates, 0, "the read-back recognises every outbox's records: {}", relay.log_text());
    let skipped: Vec<usize> = topics
        .iter()
        .map(|t| {
            relay
                .log_text()
                .lines()
                .filter(|l| l.contains("not sent again") && l.contains(t.as_str()))
                .count()
        })
        .collect();
    if replication {
        // (polling: whether the claim the kill cut short had reached Kafka is chance)
        assert!(
            skipped.iter().sum::<usize>() > 0,
            "nothing was sent again: the read-back was not put to the test"
        );
    }
    for r in &records {
        let outbox: usize = r.key.as_deref().unwrap().split('-').next().unwrap().parse().unwrap();
        assert_eq!(r.topic, topics[outbox], "an event of outbox {outbox} in another topic");
        let source = r.header("outbox_relay_source").unwrap();
        assert!(source.ends_with(&format!("/public.{}", tables[outbox])), "{source}");
    }
    // and transactions did span several outboxes
    assert!(committed.keys().any(|k| !k.starts_with("0-")) && committed.keys().any(|k| k.starts_with("0-")));
    eprintln!(
        "{mode}, {n} outboxes: {total} events, {unique} before the kill; recognised per topic: {skipped:?}"
    );
    assert_eq!(relay.terminate(crate::common::EXIT_LIMIT), Some(0), "{}", relay.log_text());
}

#[tokio::test(flavor = "multi_thread")]
async fn two_outboxes_one_slot_through_a_kill_9_lose_nothing_and_send_nothing_twice() {
    several_outboxes_through_a_kill_9("replication", 2, 600).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn ten_outboxes_one_slot_through_a_kill_9_lose_nothing_and_send_nothing_twice() {
    several_outboxes_through_a_kill_9("replication", 10, 600).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn two_polled_outboxes_through_a_kill_9_lose_nothing_and_send_nothing_twice() {
    several_outboxes_through_a_kill_9("polling", 2, 600).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn ten_polled_outboxes_through_a_kill_9_lose_nothing_and_send_nothing_twice() {
    several_outboxes_through_a_kill_9("polling", 10, 600).await;
}

/// Writes `events` events, one per transaction, to `table`, each the next of aggregate
/// `aggregate` (seq under its row lock, as the writers above).
async fn write_to(
    client: &tokio_postgres::Client,
    table: &str,
    aggregate_type: &str,
    aggregate: &str,
    events: usize,
) {
    for _ in 0..events {
        client
            .execute(
                &format!(
                    "WITH s AS (UPDATE test_aggregates SET seq = seq + 1 WHERE id = $2 RETURNING seq) \
                     INSERT INTO {table} (aggregate_type, aggregate_id, event_type, payload) \
                     SELECT $1, $2, 'SeqEvent', jsonb_build_object('seq', s.seq) FROM s"
                ),
                &[&aggregate_type, &aggregate],
            )
            .await
            .unwrap();
    }
}

/// An outbox added to the configuration of a relay that ran with one: in replication mode the
/// relay refuses to start until `setup --recreate-slot`, in polling mode it just reads the new
/// table; either way every event of the new table arrives, and nothing of the old one twice.
async fn an_outbox_added_then_restarted(mode: &str) {
    // given a relay of the single-table form, in `mode`, that published the first table's events
    // while the second table, not listed yet, filled up
    let replication = mode == "replication";
    let s = Setup::create(&crate::common::services().kafka, "", true, |slot| {
        format!("{}\n", RelayToml::either(mode, slot))
    })
    .await;
    let client = s.db.client().await;
    let tables = create_outbox_tables(&client, 2).await;
    client.batch_execute(crate::common::workload::AGGREGATE_SQL).await.unwrap();
    client.batch_execute("INSERT INTO test_aggregates (id) VALUES ('0-agg-0'), ('1-agg-0')").await.unwrap();
    let second_topic = format!("o1.{}", s.aggregate_type);
    create_topic(&second_topic, 4).await;
    let consumer = consumer(&[&s.topic, &second_topic]);
    let mut relay = s.start("single");
    relay.wait_ready("active").await;
    let t = &s.aggregate_type;
    write_to(&client, &tables[0], t, "0-agg-0", 200).await;
    write_to(&client, &tables[1], t, "1-agg-0", 100).await;
    let mut records = crate::common::consume(&consumer, 200, IDLE).await;
    assert_eq!(relay.terminate(crate::common::EXIT_LIMIT), Some(0), "{}", relay.log_text());
    write_to(&client, &tables[0], t, "0-agg-0", 50).await;

    // when the second outbox is added to the configuration and the relay restarted
    let config = std::fs::read_to_string(s.config()).unwrap();
    std::fs::write(s.config(), format!("{config}\n{}", outboxes_toml(&tables))).unwrap();
    let config = s.config().to_string_lossy().into_owned();
    if replication {
        // (replication: the slot never streamed the second table's rows; the relay says so and
        // what to run, then the recreated slot copies both tables)
        let mut refused = s.start("refused");
        assert_ne!(refused.wait_exit(), 0);
        let log = refused.log_text();
        assert!(log.contains("an outbox added to the configuration of an existing slot"), "{log}");
        assert!(log.contains("setup --recreate-slot"), "{log}");
        let (code, stdout, stderr) = crate::common::run_relay(
            &["setup", "--recreate-slot", "--config", &config],
            crate::common::EXIT_LIMIT,
        );
        assert_eq!(code, 0, "{stdout}{stderr}");
    }
    let mut relay = s.start("listed");
    relay.wait_ready("active").await;
    write_to(&client, &tables[0], t, "0-agg-0", 50).await;
    write_to(&client, &tables[1], t, "1-agg-0", 50).await;

    // then every event of both tables arrived, once, in order: the new table's written before it
    // was listed too, and nothing of the first table again
    let committed = committed_counts(&client).await;
    assert_eq!(committed.values().sum::<i64>(), 450);
    records.extend(
        consume_unique(&consumer, 450 - crate::common::workload::unique_ids(&records).len(), IDLE, LINGER)
            .await,
    );
    let report = assert_delivered(&records, &committed);
    assert_eq!((report.unique, report.duplicates), (450, 0), "{}", relay.log_text());
    // and the relay counts each outbox's events apart: what it published itself (replication:
    // the recreated slot's copy was `setup`'s), by outbox name
    let published =
        |name: &str| format!("outbox_relay_outbox_events_published_total{{outbox_name=\"{name}\"}}");
    // (polling: all it found in the tables once the second was listed, and what came after)
    let (first, second) = if replication { (50.0, 50.0) } else { (100.0, 150.0) };
    relay.wait_metric(&published("ob1"), |v| v == second).await;
    relay.wait_metric(&published("ob0"), |v| v == first).await;
    if !replication {
        relay.wait_metric("outbox_relay_outbox_backlog_events{outbox_name=\"ob1\"}", |v| v == 0.0).await;
    }

    // and the operator commands answer for each outbox: `verify` finds each one's events in
    // its topic, `check` and `status` run for both
    let limit = crate::common::EXIT_LIMIT;
    for command in ["verify", "check", "status"] {
        let (code, stdout, stderr) = crate::common::run_relay(&[command, "--config", &config], limit);
        assert_eq!(code, 0, "{command}: {stdout}{stderr}");
        for header in ["== outbox ob0 (public.outbox_events) ==", "== outbox ob1 (public.outbox_1) =="] {
            assert!(stdout.contains(header), "{command} lacks {header}: {stdout}");
        }
    }
    // (a letter belongs to one outbox: replaying letters by id names it)
    let replay = |args: &[&str]| {
        let all = [&["replay-dead-letters", "--config", &config, "--dry-run"], args].concat();
        crate::common::run_relay(&all, limit)
    };
    let (code, _, stderr) = replay(&["--ids", "1"]);
    assert_eq!(code, 2, "{stderr}");
    assert!(stderr.contains("--ids needs --outbox NAME with several outboxes: one of ob0, ob1"), "{stderr}");
    let (code, _, stderr) = replay(&["--ids", "1", "--outbox", "ob9"]);
    assert!(code == 2 && stderr.contains("--outbox ob9: no outbox has this name"), "{stderr}");
    let (code, stdout, stderr) = replay(&["--outbox", "ob1"]);
    assert_eq!(code, 0, "{stdout}{stderr}");
    // (each outbox numbers its events: `locate` names the outbox, and finds the event in its topic)
    let last =
        records.iter().rfind(|r| r.topic == second_topic).and_then(|r| r.header("id")).unwrap().to_string();
    let locate = |args: &[&str]| {
        let all = [&["locate", "--config", &config, "--id", &last], args].concat();
        crate::common::run_relay(&all, limit)
    };
    let (code, _, stderr) = locate(&[]);
    assert_eq!(code, 2, "{stderr}");
    assert!(stderr.contains("locate needs --outbox NAME with several outboxes: one of ob0, ob1"), "{stderr}");
    let (code, stdout, stderr) = locate(&["--outbox", "ob1"]);
    assert_eq!(code, 0, "{stdout}{stderr}");
    assert!(stdout.contains(&format!("published to {second_topic}[")), "{stdout}");
    // (and `verify --outbox` answers for that outbox alone)
    let (code, stdout, stderr) =
        crate::common::run_relay(&["verify", "--config", &config, "--outbox", "ob1"], limit);
    assert_eq!(code, 0, "{stdout}{stderr}");
    assert!(stdout.contains("public.outbox_1") && !stdout.contains("== outbox"), "{stdout}");
    assert_eq!(relay.terminate(crate::common::EXIT_LIMIT), Some(0), "{}", relay.log_text());
}

#[tokio::test(flavor = "multi_thread")]
async fn an_outbox_added_to_a_replication_relay_needs_a_recreated_slot_and_loses_nothing() {
    an_outbox_added_then_restarted("replication").await;
}

#[tokio::test(flavor = "multi_thread")]
async fn an_outbox_added_to_a_polling_relay_is_read_from_its_first_row() {
    an_outbox_added_then_restarted("polling").await;
}
