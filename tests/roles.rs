//! The least-privilege roles of sql/100_relay_role.sql, one per mode: each does its job with
//! nothing more, and `check` names exactly a missing privilege and the grant that fixes it.

use crate::common;

use common::workload::insert_event;
use common::*;

/// A relay test whose relay logs in as `role`, in `mode`, its configuration changed by `more`.
async fn setup_as(role: &str, mode: &str, more: impl FnOnce(RelayToml) -> RelayToml) -> Setup {
    let s = Setup::create(&services().kafka, "", true, |slot| {
        more(RelayToml::replication(slot).set("source", "mode", mode))
    })
    .await;
    let text = std::fs::read_to_string(s.config()).unwrap();
    let text = text.replacen("user = \"postgres\"", &format!("user = \"{role}\""), 1);
    std::fs::write(s.config(), text).unwrap();
    s
}

async fn insert(s: &Setup, keys: &[&str]) {
    let client = s.db.client().await;
    for key in keys {
        insert_event(&client, &s.aggregate_type, Some(key)).await;
    }
}

fn check(s: &Setup) -> (i32, String) {
    let (code, stdout, stderr) = run_relay(&["check", "--config", s.config().to_str().unwrap()], IDLE);
    (code, format!("{stdout}{stderr}"))
}

#[tokio::test(flavor = "multi_thread")]
async fn the_polling_role_relays_in_both_release_modes_without_replication() {
    for after_publish in ["delete", "mark"] {
        // given the polling role, which has no REPLICATION attribute
        let s = setup_as("outbox_relay_polling", "polling", |config| {
            config.set("polling", "after_publish", after_publish).set("polling", "poll_interval_ms", 200)
        })
        .await;
        let admin = s.db.client().await;
        let replication: bool = admin
            .query_one("SELECT rolreplication FROM pg_roles WHERE rolname = 'outbox_relay_polling'", &[])
            .await
            .unwrap()
            .get(0);
        assert!(!replication);

        // then check passes (the column grant on published_at counts in mark mode)
        let (code, out) = check(&s);
        assert_eq!(code, 0, "{after_publish}: {out}");
        assert!(out.contains("OK   postgres.privileges"), "{out}");

        // and it relays
        let consumer = consumer(&[&s.topic]);
        let mut relay = s.start("relay");
        insert(&s, &["a", "b"]).await;
        assert_eq!(consume(&consumer, 2, IDLE).await.len(), 2, "{after_publish}: {}", relay.log_text());
        assert_eq!(relay.terminate(EXIT_LIMIT), Some(0));
        let unpublished: i64 = admin
            .query_one(
                &format!(
                    "SELECT count(*) FROM outbox_events WHERE {}",
                    if after_publish == "mark" { "published_at IS NULL" } else { "true" }
                ),
                &[],
            )
            .await
            .unwrap()
            .get(0);
        assert_eq!(unpublished, 0, "{after_publish}");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn the_replication_role_relays_without_changing_the_outbox() {
    // given the replication role, which may not delete or update outbox rows, and the
    // publication created by the table's owner
    let s = setup_as("outbox_relay", "replication", |config| config).await;
    let admin = s.db.client().await;
    let row = admin
        .query_one(
            "SELECT has_table_privilege('outbox_relay', 'outbox_events', 'DELETE'), \
                    has_table_privilege('outbox_relay', 'outbox_events', 'UPDATE'), \
                    has_table_privilege('outbox_relay', 'outbox_events', 'INSERT')",
            &[],
        )
        .await
        .unwrap();
    assert_eq!((row.get(0), row.get(1), row.get(2)), (false, false, false));
    admin
        .batch_execute(&format!(
            "CREATE PUBLICATION p_{} FOR TABLE outbox_events WITH (publish = 'insert', publish_via_partition_root = true)",
            s.slot
        ))
        .await
        .unwrap();
    insert(&s, &["before"]).await;

    // then check passes and it relays, the pre-existing row and a new one
    let (code, out) = check(&s);
    assert_eq!(code, 0, "{out}");
    let consumer = consumer(&[&s.topic]);
    let mut relay = s.start("relay");
    insert(&s, &["after"]).await;
    let keys: Vec<_> = consume(&consumer, 2, IDLE).await.into_iter().filter_map(|r| r.key).collect();
    assert_eq!(keys.len(), 2, "{keys:?}: {}", relay.log_text());
    assert_eq!(relay.terminate(EXIT_LIMIT), Some(0));
}

#[tokio::test(flavor = "multi_thread")]
async fn check_names_the_missing_privilege_and_its_grant() {
    let s =
        setup_as("outbox_relay_polling", "polling", |config| config.set("polling", "after_publish", "mark"))
            .await;
    let admin = s.db.client().await;
    admin
        .batch_execute("REVOKE UPDATE (published_at) ON outbox_events FROM outbox_relay_polling")
        .await
        .unwrap();
    let (code, out) = check(&s);
    assert_eq!(code, 1, "{out}");
    let line =
        out.lines().find(|l| l.starts_with("FAIL postgres.privileges")).unwrap_or_else(|| panic!("{out}"));
    assert!(line.contains("lacks UPDATE (published_at) on public.outbox_events"), "{line}");
    assert!(
        line.contains(
            "GRANT UPDATE (\"published_at\") ON \"public\".\"outbox_events\" TO \"outbox_relay_polling\""
        ),
        "{line}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn check_fails_a_dead_letter_table_the_relay_cannot_write() {
    let s = setup_as("outbox_relay_polling", "polling", |config| config).await;
    let (code, out) = check(&s);
    assert!(code == 0 && out.contains("OK   dead_letter.table"), "{out}");

    let admin = s.db.client().await;
    admin.batch_execute("ALTER TABLE outbox_dead_letter DROP COLUMN row_data").await.unwrap();
    let (code, out) = check(&s);
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("FAIL dead_letter.table") && out.contains("lacks row_data jsonb"), "{out}");

    admin.batch_execute("DROP TABLE outbox_dead_letter").await.unwrap();
    let (code, out) = check(&s);
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("does not exist") && out.contains("sql/004_dead_letter.sql"), "{out}");
}
