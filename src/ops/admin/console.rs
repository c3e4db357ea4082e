//! The console: one HTML page (`console.html`, inline CSS and JavaScript, no external assets)
//! that signs in with a bearer token kept in the tab's sessionStorage and calls the API.
//!
//! Invariants:
//! - the page holds no data of the relay's, only the process's CSRF token (a cross-origin page
//!   cannot read it), so it is served without a token;
//! - its Content-Security-Policy lets it talk to its own origin only: no external script, style,
//!   image or frame, and no form posting elsewhere.

use hyper::StatusCode;

use super::Answer;

const PAGE: &str = include_str!("console.html");

const POLICY: &str = "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; \
     connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'";

/// The page, carrying `csrf` (hex).
pub(super) fn page(csrf: &str) -> Answer {
    Answer {
        status: StatusCode::OK,
        content_type: "text/html; charset=utf-8",
        body: PAGE.replace("{{CSRF_TOKEN}}", csrf),
        headers: Vec::new(),
    }
    .with_header(hyper::header::CONTENT_SECURITY_POLICY, POLICY)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_page_carries_the_csrf_token_and_loads_nothing_from_elsewhere() {
        let page = page("abc123");
        assert!(page.body.contains("content=\"abc123\""));
        assert!(!page.body.contains("{{CSRF_TOKEN}}"));
        for external in ["src=\"http", "href=\"http", "@import", "url(http"] {
            assert!(!page.body.contains(external), "the page loads {external}");
        }
    }
}
