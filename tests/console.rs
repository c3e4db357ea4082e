//! The console in a real headless Chromium ([`common::browser`]) against a running relay, on a
//! real PostgreSQL and Kafka: the lag the page shows is the one `/metrics` exports, pause and
//! resume from the page, an act without the CSRF token refused from the page's own origin, and a
//! dead letter replayed from the page then found published by its search box; the chart of the
//! last hour drawing values `/metrics` exported, its slot lag moving with the WAL written
//! (replication mode); the verification panel before and after a pass run from the page; an
//! outbox held at a poison row. The dead-letter and chart tests take the screenshots of
//! docs/admin.md: into docs/images/ with `OUTBOX_REFRESH_DOC_IMAGES=1`, else into the test's
//! temporary directory.

use crate::admin::{OPERATE_TOKEN, READ_TOKEN, start, tokens};
use crate::common;

use chromiumoxide::Page;
use common::browser::{self, Chromium, DESKTOP, PHONE};
use common::http::request;
use common::process::RelayProcess;
use common::workload::*;
use common::*;
use outbox_relay::observe::metrics::{OUTBOX_BACKLOG_EVENTS, OUTBOX_NAME_LABEL};

/// A polling relay with its admin listener (sampling its gauges every second) whose rows may
/// name their topic, on a broker that creates none, so that a row naming a topic that does not
/// exist is dead-lettered. `dir` holds the token files and the letters' signing key.
async fn setup(dir: &std::path::Path) -> Setup {
    let key = dir.join("letters.key");
    std::fs::write(&key, format!("{}\n", random_suffix().repeat(8))).unwrap();
    let kafka = "properties = { \"allow.auto.create.topics\" = \"false\", \"topic.metadata.propagation.max.ms\" = \"2000\" }";
    Setup::create(&services().kafka, kafka, true, |slot| {
        RelayToml::either("polling", slot)
            .set("metrics", "listen", "127.0.0.1:0")
            .set("metrics", "sample_interval_secs", 1)
            .set("outbox", "row_topics", true)
            .set_literal("outbox", "allowed_topics", "[\"outbox.event.*\", \"missing-*\"]")
            .set("dead_letter", "signing_key_file", key.display().to_string())
            .set_literal("admin", "tokens", tokens(dir))
    })
    .await
}

/// The value of the JavaScript expression `expression` on `page`, None if it throws or is not a `T`.
async fn read<T: serde::de::DeserializeOwned>(page: &Page, expression: &str) -> Option<T> {
    page.evaluate(expression).await.ok()?.into_value().ok()
}

/// Waits until the JavaScript expression `condition` is true on `page`.
async fn wait_page(page: &Page, relay: &RelayProcess, condition: &str) {
    let what = relay.context(format!("the console to show `{condition}`"));
    wait_until(what, async || read::<bool>(page, condition).await == Some(true)).await;
}

/// Clicks the element `selector` names, as a user does (mouse events at its centre).
async fn click(page: &Page, selector: &str) {
    let element = page.find_element(selector).await.unwrap_or_else(|e| panic!("{selector}: {e}"));
    element.click().await.unwrap_or_else(|e| panic!("click {selector}: {e}"));
}

/// Types `text` into the input `selector` names (emptied first) with key events. It is focused
/// rather than clicked: a click lands where the input was, and the page may have moved since.
async fn type_into(page: &Page, selector: &str, text: &str) {
    let element = page.find_element(selector).await.unwrap_or_else(|e| panic!("{selector}: {e}"));
    element.call_js_fn("function() { this.value = ''; }", false).await.unwrap();
    element
        .focus()
        .await
        .unwrap()
        .type_str(text)
        .await
        .unwrap_or_else(|e| panic!("type into {selector}: {e}"));
    let typed: Option<String> = read(page, &format!("document.querySelector('{selector}').value")).await;
    assert_eq!(typed.as_deref(), Some(text), "typed into {selector}");
}

/// Looks up `event` with the search box: its id typed in, then Enter.
async fn search(page: &Page, event: &str) {
    type_into(page, "#search", event).await;
    page.find_element("#search").await.unwrap().press_key("Enter").await.unwrap();
}

/// Opens the console of the admin listener on `port` and signs in with `token` as a user does.
async fn signed_in(chromium: &Chromium, relay: &RelayProcess, port: u16, token: &str) -> Page {
    let page = chromium.open(&format!("http://127.0.0.1:{port}/")).await;
    type_into(&page, "#token", token).await;
    click(&page, "#login-form button").await;
    // signed in once the first numbers are shown: the page stops moving
    wait_page(&page, relay, "document.querySelectorAll('#outboxes .outbox').length > 0").await;
    page
}

/// Screenshots of `page` at a phone's width and a laptop's, `<name>-phone.png` and
/// `<name>-desktop.png`: into docs/images/ with `OUTBOX_REFRESH_DOC_IMAGES=1` (docs/admin.md
/// shows them), else into the test's temporary directory.
async fn screenshots(page: &Page, s: &Setup, name: &str) {
    let images = match std::env::var("OUTBOX_REFRESH_DOC_IMAGES").as_deref() {
        Ok("1") => repo_root().join("docs/images"),
        _ => s.dir.path().to_path_buf(),
    };
    std::fs::create_dir_all(&images).unwrap();
    for (suffix, size, mobile) in [("phone", PHONE, true), ("desktop", DESKTOP, false)] {
        let png = browser::screenshot(page, size, mobile).await;
        // a PNG's IHDR holds its width in bytes 16..20: device pixels, twice the CSS ones on a phone
        assert_eq!(&png[1..4], b"PNG", "{name}-{suffix}");
        let width = u32::from_be_bytes(png[16..20].try_into().unwrap());
        assert_eq!(width, size.0 * if mobile { 2 } else { 1 }, "{name}-{suffix}");
        std::fs::write(images.join(format!("{name}-{suffix}.png")), png).unwrap();
    }
}

/// The one outbox's name, as the API gives it (`lag-<name>` on the page).
fn outbox_name(port: u16) -> String {
    let auth = format!("Bearer {READ_TOKEN}");
    let answer = request(port, "GET", "/v1/outboxes", &[("Authorization", &auth)], "").unwrap();
    answer.json()["outboxes"][0]["name"].as_str().expect("an outbox name").to_string()
}

#[tokio::test(flavor = "multi_thread")]
async fn the_page_shows_the_lag_metrics_exports_and_refuses_an_act_without_the_csrf_token() {
    // given a polling relay, and its console signed in as the operator in Chromium
    let dir = tempfile::tempdir().unwrap();
    let s = setup(dir.path()).await;
    let mut client = s.db.client().await;
    create_aggregates(&client, 1).await;
    let (relay, port) = start(&s, "relay");
    relay.wait_ready("active").await;
    let chromium = Chromium::start().await;
    let page = signed_in(&chromium, &relay, port, OPERATE_TOKEN).await;
    let outbox = outbox_name(port);
    let lag_id = format!("lag-{outbox}");
    let backlog = format!("{OUTBOX_BACKLOG_EVENTS}{{{OUTBOX_NAME_LABEL}=\"{outbox}\"}}");

    // when the operator pauses from the page, then 7 events are committed
    click(&page, "#pause").await;
    relay.wait_ready("paused by oncall").await;
    wait_page(&page, &relay, "document.getElementById('instance-state').textContent === 'paused'").await;
    let written = write_events(&mut client, &s.aggregate_type, "agg-0", 7, true).await;

    // then, the backlog standing still while paused, the page shows what /metrics exports
    relay.wait_metric(&backlog, |v| v == written as f64).await;
    let shown = format!("document.getElementById('{lag_id}')?.dataset.value");
    wait_page(&page, &relay, &format!("{shown} === '{written}'")).await;
    // (and so does the chart's newest point of the backlog)
    let charted = format!("document.getElementById('series-backlog-{outbox}')?.dataset.last");
    wait_page(&page, &relay, &format!("{charted} === '{written}'")).await;
    assert_eq!(relay.metric(&backlog), Some(written as f64), "the backlog moved while paused");

    // when the page's own script acts without the CSRF token (its origin, its bearer token)
    let status: u16 = page
        .evaluate_function(
            "async () => (await fetch('/v1/resume', { method: 'POST', headers: \
             { Authorization: 'Bearer ' + sessionStorage.getItem('relayToken') } })).status",
        )
        .await
        .unwrap()
        .into_value()
        .unwrap();

    // then it is refused and the relay stays paused
    assert_eq!(status, 403);
    assert!(relay.readyz().unwrap().1.starts_with("paused by oncall"));

    // when the operator resumes from the page
    click(&page, "#resume").await;

    // then the events reach Kafka, and the page and /metrics both show the backlog drained
    relay.wait_ready("active").await;
    let consumed = consume(&consumer(&[&s.topic]), written, IDLE).await;
    assert_eq!(consumed.len(), written);
    relay.wait_metric(&backlog, |v| v == 0.0).await;
    wait_page(&page, &relay, &format!("{shown} === '0'")).await;
    wait_page(&page, &relay, &format!("{charted} === '0'")).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_dead_letter_is_replayed_from_the_page_and_found_published_by_the_search_box() {
    // given a polling relay and an event for a topic that does not exist: dead-lettered
    let dir = tempfile::tempdir().unwrap();
    let s = setup(dir.path()).await;
    let client = s.db.client().await;
    create_aggregates(&client, 1).await;
    let (relay, port) = start(&s, "relay");
    relay.wait_ready("active").await;
    let missing = random_topic("missing");
    let insert = "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload, topic) \
                  VALUES ($1, 'agg-0', 'E', '{\"n\": 1}', $2) RETURNING id::text";
    let lettered: String = client.query_one(insert, &[&s.aggregate_type, &missing]).await.unwrap().get(0);
    relay.wait_metric("outbox_relay_events_dead_lettered_total", |v| v >= 1.0).await;

    // when the operator opens the console and looks the event up
    let chromium = Chromium::start().await;
    let page = signed_in(&chromium, &relay, port, OPERATE_TOKEN).await;
    wait_page(&page, &relay, "document.querySelector('[id^=\"replay-\"]') !== null").await;
    search(&page, &lettered).await;

    // then the page lists the letter with its reason and a Replay button, and the receipt says
    // dead-lettered
    wait_page(&page, &relay, "document.getElementById('receipt').dataset.state === 'dead_lettered'").await;
    let letters: String = read(&page, "document.getElementById('letters').textContent").await.unwrap();
    assert!(letters.contains(&lettered) && letters.contains(&missing), "{letters}");
    let replay: String = read(&page, "document.querySelector('[id^=\"replay-\"]').id").await.unwrap();

    // and that page, at a phone's width and a laptop's, is what docs/admin.md shows
    screenshots(&page, &s, "console").await;

    // when its cause is fixed and the operator replays it from the page
    create_topic(&missing, 1).await;
    click(&page, &format!("#{replay}")).await;

    // then the page says replayed and lists it no more, the search box finds it published, and
    // Kafka holds it under its own id
    wait_page(&page, &relay, "document.getElementById('act-result').textContent.includes(': replayed')")
        .await;
    wait_page(&page, &relay, &format!("document.getElementById('{replay}') === null")).await;
    search(&page, &lettered).await;
    wait_page(&page, &relay, "document.getElementById('receipt').dataset.state === 'published'").await;
    let replayed = consume_unique(&consumer(&[&missing]), 1, IDLE, LINGER).await;
    assert_eq!(replayed.len(), 1);
    assert_eq!(replayed[0].header("id"), Some(lettered.as_str()));
}

/// The values `series` took on `/metrics` while `relay` was scraped (every poll of a wait).
fn scraped(relay: &RelayProcess, series: &str, seen: &mut std::collections::HashSet<i64>) {
    if let Some(value) = relay.metric(series) {
        seen.insert(value as i64);
    }
}

/// The newest point of the chart's line `id`, None while it has none.
async fn last_point(page: &Page, id: &str) -> Option<i64> {
    read::<String>(page, &format!("document.getElementById('{id}')?.dataset.last ?? null"))
        .await
        .and_then(|v| v.parse().ok())
}

#[tokio::test(flavor = "multi_thread")]
async fn the_chart_draws_the_slot_lag_metrics_exports_and_it_moves_with_writes() {
    // given a streaming relay (its gauges and history sampled every second), and its console
    // signed in as the operator, its chart drawn
    let s = crate::admin::setup("replication").await;
    let client = s.db.client().await;
    create_aggregates(&client, 1).await;
    let (relay, port) = start(&s, "relay");
    relay.wait_ready("active").await;
    let chromium = Chromium::start().await;
    let page = signed_in(&chromium, &relay, port, OPERATE_TOKEN).await;
    wait_page(&page, &relay, "Number(document.getElementById('series-slot-lag')?.dataset.points) >= 2").await;
    let history = crate::admin::get(port, "/v1/history", READ_TOKEN).json();
    assert_eq!((history["mode"].as_str(), history["interval_secs"].as_u64()), (Some("replication"), Some(1)));
    assert_eq!(history["capacity"], 3600, "an hour of samples");

    // when the operator pauses from the page (nothing is confirmed while paused), and 1 MB of
    // WAL is written to the outbox
    click(&page, "#pause").await;
    relay.wait_ready("paused by oncall").await;
    // (paused, the relay confirms nothing past what it read before: the lag is at least what
    // is written from now on)
    let before = wal_lsn(&client).await;
    // (random hex: TOAST cannot compress it, so the WAL holds every byte)
    let insert = "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload) \
                  SELECT $1, 'agg-0', 'Padded', jsonb_build_object('pad', (SELECT string_agg(md5(random()::text || part), '') \
                  FROM generate_series(1, 320 + 0 * n) AS part)) FROM generate_series(1, 100) AS n";
    client.execute(insert, &[&s.aggregate_type]).await.unwrap();
    let at_least = wal_lsn(&client).await - before;
    assert!(at_least >= 1_000_000, "{at_least} bytes of WAL");

    // then the chart's lag reaches that, and its newest point is a value /metrics exported (as
    // is the retained WAL's): the chart reads the gauges the scrape does
    let (lag_series, retained_series) =
        ("outbox_relay_slot_confirmed_lag_bytes", "outbox_relay_slot_retained_wal_bytes");
    let (mut lags, mut retained) = (std::collections::HashSet::new(), std::collections::HashSet::new());
    let mut shown = (None, None);
    let what = relay.context(format!("the chart's lag to reach {at_least} bytes and match /metrics"));
    wait_until(what, async || {
        scraped(&relay, lag_series, &mut lags);
        scraped(&relay, retained_series, &mut retained);
        shown = (last_point(&page, "series-slot-lag").await, last_point(&page, "series-retained-wal").await);
        matches!(shown, (Some(lag), Some(wal)) if lag >= at_least && lags.contains(&lag) && retained.contains(&wal))
    })
    .await;
    let peak = shown.0.unwrap();
    let legend: String = read(&page, "document.getElementById('chart-slot').textContent").await.unwrap();
    assert!(legend.contains("MiB"), "the lag in humanised bytes: {legend}");

    // when the operator resumes from the page
    click(&page, "#resume").await;
    relay.wait_ready("active").await;

    // then the lag the chart draws drains, again as /metrics says
    let what = relay.context(format!("the chart's lag to drain below {peak} bytes"));
    wait_until(what, async || {
        scraped(&relay, lag_series, &mut lags);
        let lag = last_point(&page, "series-slot-lag").await;
        lag.is_some_and(|lag| lag < peak && lags.contains(&lag))
    })
    .await;
    let drawn: u32 = read(&page, "document.querySelectorAll('#chart-slot polyline').length").await.unwrap();
    assert_eq!(drawn, 2, "the lag and the retained WAL");
    // (the chart of docs/admin.md: the lag climbed while paused, and drained)
    screenshots(&page, &s, "console-replication").await;
}

#[tokio::test(flavor = "multi_thread")]
async fn the_verification_panel_says_never_run_then_shows_the_counts_of_a_pass_run_from_the_page() {
    // given a streaming relay (its rows stay in the table for verify to read) that published one
    // event and dead-lettered one (its row names a topic that does not exist)
    let kafka = "properties = { \"allow.auto.create.topics\" = \"false\", \"topic.metadata.propagation.max.ms\" = \"2000\" }";
    let s = crate::admin::setup_with_kafka("replication", kafka, |toml| {
        toml.set("outbox", "row_topics", true).set_literal(
            "outbox",
            "allowed_topics",
            "[\"outbox.event.*\", \"missing-*\"]",
        )
    })
    .await;
    let mut client = s.db.client().await;
    create_aggregates(&client, 1).await;
    let (relay, port) = start(&s, "relay");
    relay.wait_ready("active").await;
    write_events(&mut client, &s.aggregate_type, "agg-0", 1, true).await;
    let insert = "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload, topic) \
                  VALUES ($1, 'agg-0', 'E', '{\"n\": 1}', $2)";
    client.execute(insert, &[&s.aggregate_type, &random_topic("missing")]).await.unwrap();
    relay.wait_metric("outbox_relay_events_dead_lettered_total", |v| v >= 1.0).await;
    relay.wait_metric("outbox_relay_events_published_total", |v| v >= 1.0).await;

    // when the operator opens the console
    let chromium = Chromium::start().await;
    let page = signed_in(&chromium, &relay, port, OPERATE_TOKEN).await;

    // then no pass has run: the panel says so, as the API does
    wait_page(&page, &relay, "document.getElementById('verification-when').textContent === 'never run'")
        .await;
    assert_eq!(crate::admin::get(port, "/v1/verification", READ_TOKEN).body.trim(), "null");

    // when the operator runs a pass from the page
    click(&page, "#verify").await;

    // then the panel shows the pass the API keeps: who, and each class's count
    let finished =
        "!['never', undefined].includes(document.getElementById('verification-when').dataset.state)";
    wait_page(&page, &relay, finished).await;
    let pass = crate::admin::get(port, "/v1/verification", READ_TOKEN).json();
    assert_eq!((pass["by"].as_str(), pass["via"].as_str()), (Some("oncall"), Some("api")), "{pass}");
    let outbox = outbox_name(port);
    let counts = pass["outboxes"][0]["counts"].as_object().unwrap_or_else(|| panic!("{pass}"));
    assert!(counts["unpublishable"].as_u64() >= Some(1), "the dead letter is a finding: {pass}");
    for (class, count) in counts {
        let shown: Option<String> =
            read(&page, &format!("document.getElementById('count-{outbox}-{class}')?.dataset.count")).await;
        assert_eq!(shown, Some(count.to_string()), "{class}: {pass}");
    }
    let when: String = read(&page, "document.getElementById('verification-when').textContent").await.unwrap();
    assert!(when.contains("by oncall") && when.contains(pass["result"].as_str().unwrap()), "{when}");
    // (the panel of docs/admin.md)
    page.find_element("#verification-section").await.unwrap().scroll_into_view().await.unwrap();
    screenshots(&page, &s, "console-verification").await;
}

#[tokio::test(flavor = "multi_thread")]
async fn an_outbox_held_at_a_poison_row_shows_held_with_the_reason_until_the_row_is_fixed() {
    // given a polling relay that holds at an unpublishable row (dead_letter.on_poison = "block")
    let dir = tempfile::tempdir().unwrap();
    let s = Setup::create(&services().kafka, "", true, |slot| {
        RelayToml::either("polling", slot)
            .set("metrics", "listen", "127.0.0.1:0")
            .set("metrics", "sample_interval_secs", 1)
            .set("retry", "initial_backoff_ms", 200)
            .set("retry", "max_backoff_ms", 1000)
            .set("dead_letter", "on_poison", "block")
            .set_literal("admin", "tokens", tokens(dir.path()))
    })
    .await;
    let client = s.db.client().await;
    client.batch_execute("ALTER TABLE outbox_events ALTER COLUMN aggregate_id DROP NOT NULL").await.unwrap();
    let (relay, port) = start(&s, "relay");
    relay.wait_ready("active").await;
    let chromium = Chromium::start().await;
    let page = signed_in(&chromium, &relay, port, READ_TOKEN).await;
    let outbox = outbox_name(port);
    let badge = "document.querySelector('#outboxes .outbox .badge').textContent";
    wait_page(&page, &relay, &format!("{badge} === 'active'")).await;

    // when a row without an aggregate id is committed
    insert_event(&client, &s.aggregate_type, None).await;

    // then the relay holds, and the outbox's card says held, with the reason /readyz gives
    let blocked = relay.context("/readyz to say blocked".into());
    wait_until(blocked, async || relay.readyz().is_some_and(|(_, body)| body.contains("blocked at event")))
        .await;
    assert_eq!(relay.metric("outbox_relay_events_blocked"), Some(1.0));
    wait_page(&page, &relay, &format!("{badge} === 'held'")).await;
    let reason: String =
        read(&page, &format!("document.getElementById('held-{outbox}').textContent")).await.unwrap();
    assert!(reason.starts_with("blocked at event") && reason.contains("aggregate_id is NULL"), "{reason}");
    let api = crate::admin::get(port, "/v1/outboxes", READ_TOKEN).json();
    assert_eq!(api["outboxes"][0]["state"], "held", "{api}");
    assert_eq!(api["outboxes"][0]["held"], reason.as_str(), "{api}");

    // when the operator fixes the row, then it is published and the card says active again
    client
        .execute("UPDATE outbox_events SET aggregate_id = 'fixed' WHERE aggregate_id IS NULL", &[])
        .await
        .unwrap();
    wait_page(&page, &relay, &format!("{badge} === 'active'")).await;
    let gone: bool =
        read(&page, &format!("document.getElementById('held-{outbox}') === null")).await.unwrap();
    assert!(gone, "the reason is no longer shown");
    assert_eq!(relay.metric("outbox_relay_events_blocked"), Some(0.0));
}
