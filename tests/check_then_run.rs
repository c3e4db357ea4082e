//! `check` OK means `run` works: in each mode and each supported table layout, a database that
//! `setup` prepared and `check` passes relays without a fatal error, and `verify` (replication
//! mode) finds every event without an error line.

use crate::common;

use common::*;

/// (name, the layout's configuration, DDL to apply, an insert of one event with `$1` the
/// aggregate type and `$2` the key).
type Layout = (&'static str, fn(RelayToml) -> RelayToml, &'static str, &'static str);

const LAYOUTS: &[Layout] = &[
    (
        "default",
        |config| config,
        "",
        "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload) VALUES ($1, $2, 'E', '{}')",
    ),
    (
        "mark",
        |config| config.set("polling", "after_publish", "mark"),
        "",
        "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload) VALUES ($1, $2, 'E', '{}')",
    ),
    (
        "debezium",
        RelayToml::debezium_table,
        "sql/examples/debezium_outbox.sql",
        "INSERT INTO outboxevent (id, aggregatetype, aggregateid, type, payload) VALUES (gen_random_uuid(), $1, $2, 'E', '{}')",
    ),
];

#[tokio::test(flavor = "multi_thread")]
async fn a_database_check_passes_runs_in_each_mode_and_layout() {
    for mode in ["replication", "polling"] {
        for (layout, config, ddl, insert) in LAYOUTS {
            if mode == "replication" && *layout == "mark" {
                continue; // marking is a polling setting
            }
            let case = format!("{mode}, {layout} layout");
            let s = Setup::create(&services().kafka, "", true, |slot| {
                config(RelayToml::replication(slot).set("source", "mode", mode).set(
                    "metrics",
                    "fatal_exit_delay_secs",
                    60,
                ))
            })
            .await;
            let client = s.db.client().await;
            if !ddl.is_empty() {
                client.batch_execute(&std::fs::read_to_string(repo_root().join(ddl)).unwrap()).await.unwrap();
            }
            let path = s.config();
            let config_arg = path.to_str().unwrap();

            // given a database `setup` prepared and `check` passes
            let (code, stdout, stderr) = run_relay(&["setup", "--config", config_arg], IDLE);
            assert_eq!(code, 0, "{case}: setup failed:\n{stdout}{stderr}");
            let (code, stdout, stderr) = run_relay(&["check", "--config", config_arg], IDLE);
            assert_eq!(code, 0, "{case}: check failed:\n{stdout}{stderr}");

            // when the relay runs and events are written
            let consumer = consumer(&[&s.topic]);
            let mut relay = s.start("relay");
            relay.wait_ready("active").await;
            for key in ["a", "b", "c"] {
                client.execute(*insert, &[&s.aggregate_type, &key]).await.unwrap();
            }

            // then they arrive, and the relay is still ready (a fatal error would linger unready)
            let got = consume(&consumer, 3, IDLE).await;
            assert_eq!(got.len(), 3, "{case}: {}", relay.log_text());
            assert!(relay.readyz().is_some_and(|(status, _)| status == 200), "{case}: {}", relay.log_text());

            // and verify finds them, without an error line for each partition's end (it logged
            // librdkafka's `ERROR ... PartitionEOF` three times on success)
            if mode == "replication" {
                let (code, stdout, stderr) = run_relay(&["verify", "--config", config_arg], IDLE);
                assert_eq!(code, 0, "{case}: verify:\n{stdout}{stderr}");
                assert!(!stderr.contains("PartitionEOF") && !stderr.contains("ERROR"), "{case}: {stderr}");
            }
            assert_eq!(relay.terminate(EXIT_LIMIT), Some(0), "{case}");
        }
    }
}
