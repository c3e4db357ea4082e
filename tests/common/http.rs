//! Plain HTTP/1.1 GETs against the relay's listener (`/metrics`, `/healthz`, `/readyz`) and
//! Prometheus's API, and reading samples out of a Prometheus text scrape.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::Duration;

/// A loopback port nobody listens on right now, and one this process has not been given before:
/// two picks before either is bound (a relay's metrics and admin listeners) could otherwise be
/// the same port, and the second listener would fail with "Address already in use".
pub fn free_port() -> u16 {
    static GIVEN: std::sync::Mutex<Vec<u16>> = std::sync::Mutex::new(Vec::new());
    let mut given = GIVEN.lock().unwrap();
    loop {
        let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        if !given.contains(&port) {
            given.push(port);
            return port;
        }
    }
}

/// GET `path` from 127.0.0.1:`port`; returns (status code, body), or None when nothing answers.
pub fn get(port: u16, path: &str) -> Option<(u16, String)> {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(10))).ok()?;
    write!(stream, "GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n").ok()?;
    let mut response = String::new();
    stream.read_to_string(&mut response).ok()?;
    let status = response.split_whitespace().nth(1)?.parse().ok()?;
    let body = response.split_once("\r\n\r\n").map(|(_, b)| b.to_string()).unwrap_or_default();
    Some((status, body))
}

/// The value of the first sample of `series` in a Prometheus text scrape. `series` is a metric
/// name, optionally with some of its labels as exported (`outbox_relay_leader`,
/// `outbox_relay_events_read_total{mode="polling"}`): a sample matches when it has the name and
/// at least those labels (the relay adds its deployment's labels to every series).
pub fn sample(scrape: &str, series: &str) -> Option<f64> {
    let (name, wanted) = name_and_labels(series);
    scrape
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| l.rsplit_once(' '))
        .find(|(exported, _)| {
            let (n, labels) = name_and_labels(exported);
            n == name && wanted.iter().all(|w| labels.contains(w))
        })
        .and_then(|(_, v)| v.parse().ok())
}

/// `name{a="1",b="2"}` -> (`name`, [`a="1"`, `b="2"`]) (label values with commas are not split
/// right: the relay's have none).
fn name_and_labels(series: &str) -> (&str, Vec<&str>) {
    match series.split_once('{') {
        Some((name, labels)) => {
            (name, labels.trim_end_matches('}').split(',').filter(|l| !l.is_empty()).collect())
        }
        None => (series, Vec::new()),
    }
}

/// An HTTP answer: status, headers (names lowercase), body.
#[derive(Debug, Clone, PartialEq)]
pub struct Answer {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: String,
}

impl Answer {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(k, _)| k == name).map(|(_, v)| v.as_str())
    }

    pub fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("not JSON ({e}): {:?}", self.body))
    }
}

/// POST `body` (JSON) to 127.0.0.1:`port``path` with `headers`; None when nothing answers.
pub fn post(port: u16, path: &str, headers: &[(&str, &str)], body: &str) -> Option<Answer> {
    request(port, "POST", path, headers, body)
}

/// `method` `path` on 127.0.0.1:`port` with `headers` and `body` (JSON); None when nothing
/// answers.
pub fn request(port: u16, method: &str, path: &str, headers: &[(&str, &str)], body: &str) -> Option<Answer> {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(60))).ok()?;
    let mut request = format!(
        "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n",
        body.len()
    );
    for (name, value) in headers {
        request.push_str(&format!("{name}: {value}\r\n"));
    }
    request.push_str("\r\n");
    request.push_str(body);
    stream.write_all(request.as_bytes()).ok()?;
    let mut response = String::new();
    stream.read_to_string(&mut response).ok()?;
    let (head, body) = response.split_once("\r\n\r\n")?;
    let mut lines = head.lines();
    let status = lines.next()?.split_whitespace().nth(1)?.parse().ok()?;
    let headers = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    Some(Answer { status, headers, body: body.to_string() })
}
