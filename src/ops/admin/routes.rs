//! Every route of the admin listener, with the scope it needs, and the guards a request passes
//! in order: the route (404, 405), the token (401), the scope (403), and for an act the CSRF
//! token and the origin (403) and the instance's role (409, in [`super::acts`]).
//!
//! Invariant: [`ROUTES`] is the one list: the dispatcher serves exactly these, and
//! [`super::openapi::document`] describes exactly these.

use hyper::header::{AUTHORIZATION, HOST, ORIGIN, WWW_AUTHENTICATE};
use hyper::http::request::Parts;
use hyper::{Method, StatusCode};

use super::auth::{self, Caller};
use super::{Admin, Answer};
use crate::config::AdminScope;

/// What a route does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    Console,
    OpenApi,
    Session,
    Status,
    Outboxes,
    DeadLetters,
    Locate,
    History,
    Verification,
    Pause,
    Resume,
    Replay,
    Republish,
    Verify,
}

/// A route: method, path, who may call it (`None`: anyone), and a line saying what it does.
#[derive(Debug, Clone, Copy)]
pub struct Route {
    pub method: &'static str,
    pub path: &'static str,
    pub endpoint: Endpoint,
    pub scope: Option<AdminScope>,
    pub summary: &'static str,
}

const fn route(
    method: &'static str,
    path: &'static str,
    endpoint: Endpoint,
    scope: Option<AdminScope>,
    summary: &'static str,
) -> Route {
    Route { method, path, endpoint, scope, summary }
}

const READ: Option<AdminScope> = Some(AdminScope::Read);
const OPERATE: Option<AdminScope> = Some(AdminScope::Operate);

/// Every route served.
pub const ROUTES: &[Route] = &[
    route("GET", "/", Endpoint::Console, None, "The console: one HTML page, no external assets"),
    route("GET", "/v1/openapi.json", Endpoint::OpenApi, None, "This API, as an OpenAPI 3 document"),
    route(
        "GET",
        "/v1/session",
        Endpoint::Session,
        READ,
        "Who the token is, its scope, and the CSRF token acts need",
    ),
    route("GET", "/v1/status", Endpoint::Status, READ, "What `outbox-relay status --format json` says"),
    route(
        "GET",
        "/v1/outboxes",
        Endpoint::Outboxes,
        READ,
        "This instance's role and each outbox's state, lag and counts",
    ),
    route("GET", "/v1/dead-letters", Endpoint::DeadLetters, READ, "Dead letters waiting, with their reasons"),
    route(
        "GET",
        "/v1/locate",
        Endpoint::Locate,
        READ,
        "One event's delivery receipt, as `outbox-relay locate` gives it",
    ),
    route(
        "GET",
        "/v1/history",
        Endpoint::History,
        READ,
        "The last hour of slot lag, retained WAL, backlog and throughput, sampled in the process",
    ),
    route(
        "GET",
        "/v1/verification",
        Endpoint::Verification,
        READ,
        "The last finished verification pass: when, by whom, counts per class (null before the first)",
    ),
    route("POST", "/v1/pause", Endpoint::Pause, OPERATE, "Pause publishing (leadership kept, nothing read)"),
    route("POST", "/v1/resume", Endpoint::Resume, OPERATE, "Resume publishing"),
    route(
        "POST",
        "/v1/dead-letters/replay",
        Endpoint::Replay,
        OPERATE,
        "Replay dead letters through the delivery stage",
    ),
    route(
        "POST",
        "/v1/republish",
        Endpoint::Republish,
        OPERATE,
        "Send chosen events again (by aggregate, ids or time), beside the stream",
    ),
    route(
        "POST",
        "/v1/verify",
        Endpoint::Verify,
        OPERATE,
        "Run a verification pass now (outbox against Kafka)",
    ),
];

/// The header a mutation carries the CSRF token in.
pub const CSRF_HEADER: &str = "x-csrf-token";

/// The route `method` `path` names; `Err` the answer when none does (404, or 405 naming the
/// methods the path has).
pub(crate) fn find(method: &Method, path: &str) -> Result<&'static Route, Answer> {
    let same_path: Vec<&Route> = ROUTES.iter().filter(|r| r.path == path).collect();
    if let Some(route) = same_path.iter().find(|r| r.method == method.as_str()) {
        return Ok(route);
    }
    if same_path.is_empty() {
        return Err(Answer::error(StatusCode::NOT_FOUND, format!("no route {path}: see /v1/openapi.json")));
    }
    let allowed: Vec<&str> = same_path.iter().map(|r| r.method).collect();
    Err(Answer::error(StatusCode::METHOD_NOT_ALLOWED, format!("{path} answers {}", allowed.join(", ")))
        .with_header(hyper::header::ALLOW, allowed.join(", ")))
}

/// The guards of `route` for the request `parts`: its caller when let through (None for a
/// public route), or the refusal.
pub(crate) fn admit(admin: &Admin, route: &Route, parts: &Parts) -> Result<Option<Caller>, Answer> {
    let Some(needed) = route.scope else { return Ok(None) };
    let authorization = parts.headers.get(AUTHORIZATION).and_then(|v| v.to_str().ok());
    // a token, when one is sent, decides alone; without one, a verified client certificate
    let certificate = parts.extensions.get::<auth::ClientCertificate>().filter(|_| authorization.is_none());
    let caller = match certificate {
        Some(certificate) => admin.tokens.certified(&certificate.0),
        None => admin.tokens.caller(authorization),
    };
    let Some(caller) = caller else {
        let said = match (authorization, certificate) {
            (None, None) => "no token: send Authorization: Bearer <token> (admin.tokens)".to_string(),
            (None, Some(certificate)) => format!(
                "the client certificate's subject CN {:?} is not one of admin.clients[].subject_cn",
                certificate.0
            ),
            (Some(_), _) => "the token is not one of admin.tokens".to_string(),
        };
        return Err(Answer::error(StatusCode::UNAUTHORIZED, said)
            .with_header(WWW_AUTHENTICATE, "Bearer realm=\"outbox-relay admin\""));
    };
    if caller.scope < needed {
        return Err(Answer::error(
            StatusCode::FORBIDDEN,
            format!(
                "{} {} needs the {} scope; {:?} has {}",
                route.method,
                route.path,
                needed.as_str(),
                caller.name,
                caller.scope.as_str()
            ),
        ));
    }
    if route.method == "POST" {
        cross_site(admin, parts)?;
    }
    Ok(Some(caller))
}

/// A mutation must carry the process's CSRF token, and come from no other origin than the
/// listener's own (a browser sends `Origin` with every POST).
fn cross_site(admin: &Admin, parts: &Parts) -> Result<(), Answer> {
    let presented = parts.headers.get(CSRF_HEADER).map(|v| v.as_bytes()).unwrap_or_default();
    if !auth::same(presented, admin.csrf.as_bytes()) {
        return Err(Answer::error(
            StatusCode::FORBIDDEN,
            "missing or stale X-CSRF-Token: reload the console, or take csrf_token from GET /v1/session",
        ));
    }
    let host = parts.headers.get(HOST).and_then(|v| v.to_str().ok()).unwrap_or_default();
    if let Some(origin) = parts.headers.get(ORIGIN) {
        let origin = origin.to_str().unwrap_or_default();
        let own = [format!("http://{host}"), format!("https://{host}")];
        if !own.iter().any(|o| o == origin) {
            return Err(Answer::error(StatusCode::FORBIDDEN, format!("origin {origin:?} may not act here")));
        }
    }
    Ok(())
}

/// A query string's `name` parameter.
pub(crate) fn query(parts: &Parts, name: &str) -> Option<String> {
    let query = parts.uri.query()?;
    form_urlencoded::parse(query.as_bytes()).find(|(k, _)| k == name).map(|(_, v)| v.into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::admin::auth::Tokens;

    #[test]
    fn a_path_is_found_and_a_wrong_method_says_which_it_has() {
        assert_eq!(find(&Method::GET, "/v1/status").unwrap().endpoint, Endpoint::Status);
        assert_eq!(find(&Method::POST, "/v1/pause").unwrap().scope, OPERATE);
        assert_eq!(find(&Method::GET, "/v1/nothing").unwrap_err().status, StatusCode::NOT_FOUND);
        let wrong = find(&Method::GET, "/v1/pause").unwrap_err();
        assert_eq!(wrong.status, StatusCode::METHOD_NOT_ALLOWED);
        assert!(wrong.body.contains("POST"), "{}", wrong.body);
    }

    fn admin() -> Admin {
        Admin::for_tests(Tokens::of(&[
            ("viewer", AdminScope::Read, "read-token-0123456789"),
            ("oncall", AdminScope::Operate, "operate-token-0123456789"),
        ]))
    }

    fn parts(method: &str, path: &str, headers: &[(&str, &str)]) -> Parts {
        let mut request = hyper::Request::builder().method(method).uri(path).header("host", "127.0.0.1:9189");
        for (name, value) in headers {
            request = request.header(*name, *value);
        }
        request.body(()).unwrap().into_parts().0
    }

    #[test]
    fn no_token_a_bad_token_a_read_token_acting_and_a_missing_csrf_token_are_refused() {
        let admin = admin();
        let status = find(&Method::GET, "/v1/status").unwrap();
        let pause = find(&Method::POST, "/v1/pause").unwrap();
        let refused = |route, headers: &[(&str, &str)]| {
            admit(&admin, route, &parts(route.method, route.path, headers)).unwrap_err().status
        };
        assert_eq!(refused(status, &[]), StatusCode::UNAUTHORIZED);
        assert_eq!(
            refused(status, &[("authorization", "Bearer nope-nope-nope-nope")]),
            StatusCode::UNAUTHORIZED
        );
        let read = ("authorization", "Bearer read-token-0123456789");
        let operate = ("authorization", "Bearer operate-token-0123456789");
        assert_eq!(
            admit(&admin, status, &parts("GET", "/v1/status", &[read])).unwrap().unwrap().name,
            "viewer"
        );
        let csrf = admin.csrf.clone();
        assert_eq!(refused(pause, &[read, ("x-csrf-token", &csrf)]), StatusCode::FORBIDDEN);
        assert_eq!(refused(pause, &[operate]), StatusCode::FORBIDDEN, "no CSRF token");
        assert_eq!(refused(pause, &[operate, ("x-csrf-token", "0000")]), StatusCode::FORBIDDEN);
        let foreign = ("origin", "http://evil.example");
        assert_eq!(refused(pause, &[operate, ("x-csrf-token", &csrf), foreign]), StatusCode::FORBIDDEN);
        let own = ("origin", "http://127.0.0.1:9189");
        let caller =
            admit(&admin, pause, &parts("POST", "/v1/pause", &[operate, ("x-csrf-token", &csrf), own]));
        assert_eq!(caller.unwrap().unwrap().name, "oncall");
        let console = find(&Method::GET, "/").unwrap();
        assert_eq!(admit(&admin, console, &parts("GET", "/", &[])).unwrap(), None, "the page is public");
    }
}
