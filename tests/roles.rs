//! The least-privilege roles of sql/100_relay_role.sql, one per mode: each does its job with
//! nothing more, and `check` names exactly a missing privilege and the grant that fixes it.

use crate::common;

use common::service::apply_examples;
use common::workload::{insert_event, outbox_ids};
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

#[tokio::test(flavor = "multi_thread")]
async fn no_writer_chooses_an_event_id_the_owner_included() {
    // given the outbox with the example roles, a real event written by the order service's role
    let db = TestDb::new().await;
    let owner = db.client().await;
    apply_examples(&owner, &["orders", "idempotency", "ledger", "roles"]).await;
    let (host, port, _) = db.pg_parts();
    let writer = connect(&format!("postgres://orders_service@{host}:{port}/{}", db.name)).await;
    // (no RETURNING: the writer may not read the outbox)
    let insert = "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload) \
                  VALUES ('order', 'real', 'E', '{}')";
    let newest_real = "SELECT max(id) FROM outbox_events WHERE aggregate_id = 'real'";
    writer.batch_execute(insert).await.unwrap();
    let real: i64 = owner.query_one(newest_real, &[]).await.unwrap().get(0);

    // when the writer names an id (OVERRIDING SYSTEM VALUE) or a created_at, then it is refused
    for forged in [
        format!(
            "INSERT INTO outbox_events (id, aggregate_type, aggregate_id, event_type, payload) \
             OVERRIDING SYSTEM VALUE VALUES ({}, 'order', 'forged', 'E', '{{}}')",
            real + 2
        ),
        "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload, created_at) \
         VALUES ('order', 'forged', 'E', '{}', now() - interval '1 day')"
            .to_string(),
    ] {
        let error = writer.batch_execute(&forged).await.expect_err(&forged);
        let message = error.as_db_error().map(|e| e.message().to_string()).unwrap_or(error.to_string());
        assert!(message.contains("permission denied"), "{forged}: {message}");
    }

    // and when the owner names the real event's id under another created_at, and the id the
    // sequence gives next (one more: ids step by one since sql/013), each row gets the
    // sequence's id instead, so the next real event takes none of them
    let next = real + 1;
    let mut given = Vec::new();
    for (id, created_at) in [(real, "now() - interval '1 hour'"), (next, "now()")] {
        let row = owner
            .query_one(
                &format!(
                    "INSERT INTO outbox_events (id, aggregate_type, aggregate_id, event_type, payload, created_at) \
                     OVERRIDING SYSTEM VALUE VALUES ({id}, 'order', 'forged', 'E', '{{}}', {created_at}) RETURNING id"
                ),
                &[],
            )
            .await
            .unwrap();
        given.push(row.get::<_, i64>(0));
    }
    assert!(!given.contains(&real), "the real event's id was taken: {given:?} (real {real})");
    writer.batch_execute(insert).await.unwrap();
    let next_real: i64 = owner.query_one(newest_real, &[]).await.unwrap().get(0);
    let ids = outbox_ids(&owner).await;
    let unique: std::collections::HashSet<_> = ids.iter().collect();
    assert_eq!(unique.len(), 4, "every event has an id of its own: {ids:?}");
    assert!(next_real > real && !given.contains(&next_real), "{ids:?}");
}

#[tokio::test(flavor = "multi_thread")]
async fn no_other_login_borrows_the_id_triggers_privilege() {
    // given the outbox with the example roles, and a login of no one's that owns a schema
    let db = TestDb::new().await;
    let owner = db.client().await;
    apply_examples(&owner, &["orders", "idempotency", "ledger", "roles"]).await;
    let intruder = format!("intruder_{}", crate::common::random_suffix());
    owner
        .batch_execute(&format!(
            "CREATE ROLE {intruder} LOGIN; CREATE SCHEMA {intruder} AUTHORIZATION {intruder}"
        ))
        .await
        .unwrap();
    let sequence: u32 = owner
        .query_one("SELECT pg_get_serial_sequence('outbox_events', 'id')::regclass::oid", &[])
        .await
        .unwrap()
        .get(0);
    let (host, port, _) = db.pg_parts();
    let login = connect(&format!("postgres://{intruder}@{host}:{port}/{}", db.name)).await;

    // when it attaches the SECURITY DEFINER id trigger to a table of its own, naming the outbox's
    // sequence (it would then take ids of it, or of any sequence, as the function's owner)
    let borrowed = format!(
        "CREATE TABLE {intruder}.t (id bigint); \
         CREATE TRIGGER t BEFORE INSERT ON {intruder}.t FOR EACH ROW \
         EXECUTE FUNCTION public.outbox_events_assign_id('{sequence}')"
    );
    let error = login.batch_execute(&borrowed).await.expect_err("the trigger was created");

    // then it is refused: EXECUTE on the function is revoked from PUBLIC
    let message = error.as_db_error().map(|e| e.message().to_string()).unwrap_or(error.to_string());
    assert!(
        message.contains("permission denied for function") && message.contains("outbox_events_assign_id"),
        "{message}"
    );
    // and the outbox's writers still get their ids from it (a trigger's function is checked
    // when the trigger is made, not when it fires)
    let writer = connect(&format!("postgres://orders_service@{host}:{port}/{}", db.name)).await;
    writer
        .batch_execute(
            "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload) \
             VALUES ('order', 'o-1', 'E', '{}')",
        )
        .await
        .unwrap();
    assert_eq!(outbox_ids(&owner).await.len(), 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_relay_role_adds_published_ids_and_never_clears_or_moves_one() {
    // given a block of published ids, ids 1 and 2 of public.outbox_events
    let db = TestDb::new().await;
    let owner = db.client().await;
    let (host, port, _) = db.pg_parts();
    let relay = connect(&format!("postgres://outbox_relay_polling@{host}:{port}/{}", db.name)).await;
    let record = "INSERT INTO outbox_relay_published AS p (source_table, block, ids, topics) \
                  VALUES ('public.outbox_events', 0, B'1'::bit(8192) >> $1::int, '{t}') \
                  ON CONFLICT (source_table, block) DO UPDATE SET ids = p.ids | EXCLUDED.ids";
    for id in [1i32, 2] {
        relay.execute(record, &[&id]).await.unwrap();
    }

    // when the relay's role clears id 2, or moves the block to another table or number
    for tamper in [
        "UPDATE outbox_relay_published SET ids = B'01'::bit(8192)",
        "UPDATE outbox_relay_published SET source_table = 'public.other'",
        "UPDATE outbox_relay_published SET block = 7",
    ] {
        // then it is refused, and the block is as it was
        let error = relay.batch_execute(tamper).await.expect_err(tamper);
        let message = error.as_db_error().map(|e| e.message().to_string()).unwrap_or(error.to_string());
        assert!(message.contains("published ids are only ever added"), "{tamper}: {message}");
    }
    let bits: String = owner
        .query_one("SELECT substring(ids::text, 1, 4) FROM outbox_relay_published WHERE block = 0", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(bits, "0110");
}

#[tokio::test(flavor = "multi_thread")]
async fn check_warns_while_any_login_may_connect_and_take_the_polling_lock() {
    // given a polling relay's database where PUBLIC holds CONNECT (PostgreSQL's default)
    let s = setup_as("outbox_relay_polling", "polling", |toml| toml).await;
    let (_, out) = check(&s);
    assert!(out.contains("WARN postgres.public_connect"), "{out}");
    assert!(out.contains(&format!("REVOKE CONNECT ON DATABASE \"{}\" FROM PUBLIC", s.db.name)), "{out}");

    // when CONNECT is the relay's alone, then it is OK
    let name = &s.db.name;
    let grants = format!(
        "REVOKE CONNECT ON DATABASE {name} FROM PUBLIC; GRANT CONNECT ON DATABASE {name} TO outbox_relay_polling"
    );
    s.db.client().await.batch_execute(&grants).await.unwrap();
    let (_, out) = check(&s);
    assert!(out.contains("OK   postgres.public_connect"), "{out}");
}

/// `check` WARNs (`postgres.excess_privilege`) when the relay's role holds more than its mode
/// needs: a superuser, the outbox table's owner, REPLICATION in polling mode; the example roles
/// hold none of it.
#[tokio::test(flavor = "multi_thread")]
async fn check_warns_of_privilege_the_mode_does_not_need() {
    const LINE: &str = "postgres.excess_privilege";
    // the example roles, each in its own mode: nothing more than needed
    for (role, mode) in [("outbox_relay_polling", "polling"), ("outbox_relay", "replication")] {
        let (_, out) = check(&setup_as(role, mode, |config| config).await);
        assert!(out.contains(&format!("OK   {LINE}")), "{role}: {out}");
    }
    // the replication role in polling mode: REPLICATION is not needed there
    let (_, out) = check(&setup_as("outbox_relay", "polling", |config| config).await);
    assert!(out.contains(&format!("WARN {LINE}")) && out.contains("has REPLICATION"), "{out}");
    assert!(out.contains("NOREPLICATION"), "{out}");
    // a superuser
    let (_, out) = check(&setup_as("postgres", "polling", |config| config).await);
    assert!(out.contains(&format!("WARN {LINE}")) && out.contains("is a superuser"), "{out}");
    // the table's owner
    let s = setup_as("outbox_relay_polling", "polling", |config| config).await;
    let owner = format!("owner_{}", random_suffix());
    let admin = s.db.client().await;
    admin
        .batch_execute(&format!("CREATE ROLE {owner} LOGIN; ALTER TABLE outbox_events OWNER TO {owner}"))
        .await
        .unwrap();
    let text = std::fs::read_to_string(s.config()).unwrap();
    std::fs::write(
        s.config(),
        text.replacen("user = \"outbox_relay_polling\"", &format!("user = \"{owner}\""), 1),
    )
    .unwrap();
    let (_, out) = check(&s);
    assert!(out.contains(&format!("WARN {LINE}")) && out.contains("owns public.outbox_events"), "{out}");
}

/// Only the outbox table's owner may create the publication. `check` once passed it for the
/// replication role ("the relay creates it"), and `setup` then failed: now `check` FAILs with
/// the owner's command, in `setup`'s words.
#[tokio::test(flavor = "multi_thread")]
async fn check_fails_a_publication_the_role_may_not_create_as_setup_does() {
    // given the replication role, which does not own the table, and no publication yet
    let s = setup_as("outbox_relay", "replication", |config| config).await;
    let refused = "only the owner of public.outbox_events may, and role outbox_relay is not it";
    let command = format!("run `CREATE PUBLICATION \"p_{}\" FOR TABLE", s.slot);

    // then check FAILs, naming the owner's command
    let (code, out) = check(&s);
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("FAIL replication.publication") && out.contains(refused), "{out}");
    assert!(out.contains(&command) && out.contains("as the owner"), "{out}");

    // and setup fails with the same words
    let (code, _, stderr) = run_relay(&["setup", "--config", s.config().to_str().unwrap()], IDLE);
    assert_eq!(code, 1, "{stderr}");
    assert!(stderr.contains(refused) && stderr.contains(&command), "{stderr}");
}

/// RDS and Aurora grant replication by membership in `rds_replication` (no customer role may
/// hold the REPLICATION attribute there). Here, a role of that name and a relay role that is a
/// member of it without the attribute: `check` WARNs (membership grants nothing on this server,
/// which does not look like RDS), and passes it once the server looks like RDS (the
/// `rds.extensions` setting, set for the role); a role that is not a member is told the RDS grant.
#[tokio::test(flavor = "multi_thread")]
async fn check_knows_rds_replication_membership_only_where_the_server_looks_like_rds() {
    let member = format!("rds_member_{}", random_suffix());
    let outsider = format!("rds_outsider_{}", random_suffix());
    let s = setup_as(&member, "replication", |config| config).await;
    let admin = s.db.client().await;
    admin
        .batch_execute(&format!(
            "DO $$ BEGIN CREATE ROLE rds_replication; EXCEPTION WHEN duplicate_object THEN NULL; END $$; \
             CREATE ROLE {member} LOGIN NOREPLICATION IN ROLE rds_replication; \
             CREATE ROLE {outsider} LOGIN NOREPLICATION"
        ))
        .await
        .unwrap();

    // on a server that does not look like RDS: a WARN, never a FAIL, naming the attribute
    let (_, out) = check(&s);
    assert!(out.contains("WARN postgres.role") && out.contains("member of rds_replication"), "{out}");
    assert!(out.contains(&format!("ALTER ROLE \"{member}\" WITH REPLICATION")), "{out}");

    // where the server looks like RDS: membership passes
    for role in [&member, &outsider] {
        admin
            .batch_execute(&format!("ALTER ROLE {role} SET rds.extensions = 'pg_stat_statements'"))
            .await
            .unwrap();
    }
    let (_, out) = check(&s);
    assert!(
        out.contains("OK   postgres.role") && out.contains("grants replication on RDS and Aurora"),
        "{out}"
    );

    // and a role that is not a member is told the grant RDS uses
    let text = std::fs::read_to_string(s.config()).unwrap().replace(&member, &outsider);
    std::fs::write(s.config(), text).unwrap();
    let (code, out) = check(&s);
    assert_eq!(code, 1, "{out}");
    assert!(
        out.contains("FAIL postgres.role")
            && out.contains(&format!("GRANT rds_replication TO \"{outsider}\"")),
        "{out}"
    );
}
