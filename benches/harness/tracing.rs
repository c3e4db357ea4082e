//! `deploy/local/bench --only tracing`: what `[tracing]` costs (issue 49). Replication drains of
//! `--events` (default 200,000) with tracing off, at 1% and at 100% (rows without a
//! `traceparent`, so `tracing.sample_ratio` decides; the spans go to a real Jaeger held for the
//! run), `--runs` times in an order rotated each run, read as ratios to the drain without.
//! The relay is this build each time; a wrapper script gives it the standard `OTEL_*`
//! environment.

use std::path::PathBuf;

use super::{Drain, Options, replication_drain, stat, use_relay_bin};

/// The configurations: a name, and the sampling ratio (`None`: tracing off).
const SETTINGS: [(&str, Option<f64>); 3] = [("off", None), ("1%", Some(0.01)), ("100%", Some(1.0))];

pub struct Runs {
    /// Each setting's drains, one per run, in [`SETTINGS`] order.
    drains: [Vec<Drain>; 3],
}

/// A script that runs this build with tracing on at `ratio`, exporting to `endpoint`.
fn wrapper(dir: &std::path::Path, ratio: f64, endpoint: &str) -> PathBuf {
    let relay = super::common::relay_bin();
    let script = dir.join(format!("relay-traced-{ratio}"));
    let text = format!(
        "#!/bin/sh\nOTEL_TRACES_EXPORTER=otlp OTEL_EXPORTER_OTLP_TRACES_ENDPOINT={endpoint} \
         OTEL_TRACES_SAMPLER_ARG={ratio} exec {} \"$@\"\n",
        relay.display()
    );
    std::fs::write(&script, text).unwrap();
    std::process::Command::new("chmod").arg("755").arg(&script).status().unwrap();
    script
}

pub async fn run(o: &Options) -> Runs {
    let events = if o.events_given { o.events } else { 200_000 };
    let jaeger = super::common::hold("hold-jaeger", &[]);
    let endpoint = &jaeger["OUTBOX_RELAY_TEST_OTLP_TRACES_URL"];
    let dir = tempfile::tempdir().unwrap();
    let bins: Vec<Option<PathBuf>> =
        SETTINGS.iter().map(|(_, ratio)| ratio.map(|r| wrapper(dir.path(), r, endpoint))).collect();
    let mut runs = Runs { drains: Default::default() };
    for run in 0..o.runs {
        for i in (0..SETTINGS.len()).map(|k| (k + run) % SETTINGS.len()) {
            use_relay_bin(bins[i].clone());
            eprintln!(
                "[bench] run {}/{}: tracing {}, replication drain of {events} events",
                run + 1,
                o.runs,
                SETTINGS[i].0
            );
            let (d, _) = replication_drain(events, None, false).await;
            eprintln!(
                "[bench]   {:.0} events/s, {:.2} CPU s/100k, peak RSS {:.1} MiB",
                events as f64 / d.seconds,
                d.cpu_per_100k,
                d.rss_mib
            );
            runs.drains[i].push(d);
        }
    }
    use_relay_bin(None);
    runs
}

pub fn render(o: &Options, runs: &Runs) -> String {
    let events = if o.events_given { o.events } else { 200_000 } as f64;
    let mut out = format!(
        "{}  \n\nReplication drains of {events} events written without a `traceparent`; spans to a real \
         Jaeger (`deploy/local/jaeger`). Median of {} runs (min-max); ratios are each run's against \
         the same run's drain with tracing off.\n\n\
         | tracing | drain, events/s | relay CPU s per 100k events | peak RSS, MiB | drain / off | CPU / off |\n\
         |---|---|---|---|---|---|\n",
        super::report::machine(),
        o.runs
    );
    let off = &runs.drains[0];
    for (i, (name, _)) in SETTINGS.iter().enumerate() {
        let drains = &runs.drains[i];
        let rate: Vec<f64> = drains.iter().map(|d| events / d.seconds).collect();
        let cpu: Vec<f64> = drains.iter().map(|d| d.cpu_per_100k).collect();
        let rss: Vec<f64> = drains.iter().map(|d| d.rss_mib).collect();
        let rate_ratio: Vec<f64> = drains.iter().zip(off).map(|(d, b)| b.seconds / d.seconds).collect();
        let cpu_ratio: Vec<f64> =
            drains.iter().zip(off).map(|(d, b)| d.cpu_per_100k / b.cpu_per_100k).collect();
        out += &format!(
            "| {name} | {} | {} | {} | {} | {} |\n",
            stat(&rate, 0),
            stat(&cpu, 2),
            stat(&rss, 1),
            stat(&rate_ratio, 3),
            stat(&cpu_ratio, 3)
        );
    }
    out
}
