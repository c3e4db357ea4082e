//! `/v1/openapi.json`: the admin API as an OpenAPI 3.0 document, made from [`ROUTES`].
//!
//! Invariant: the document's paths and methods are exactly [`ROUTES`]' (a test checks both
//! ways), each with the scope it needs, its parameters and body, and the refusals it may give.

use serde_json::{Map, Value, json};

use super::routes::{CSRF_HEADER, Endpoint, ROUTES, Route};

/// The OpenAPI document.
pub fn document() -> Value {
    let mut paths = Map::new();
    for route in ROUTES {
        let operations = paths.entry(route.path).or_insert_with(|| json!({}));
        operations[route.method.to_ascii_lowercase()] = operation(route);
    }
    json!({
        "openapi": "3.0.3",
        "info": {
            "title": "outbox-relay admin API",
            "version": format!("v1 (outbox-relay {})", env!("CARGO_PKG_VERSION")),
            "description": "Look at a running relay and act on it. Every route but / and /v1/openapi.json needs \
                a bearer token of admin.tokens; acts (POST) need the operate scope and the X-CSRF-Token header \
                (GET /v1/session gives it), and a standby refuses them (409). See docs/admin.md.",
        },
        "components": {
            "securitySchemes": { "bearer": { "type": "http", "scheme": "bearer" } },
            "schemas": { "Error": { "type": "object", "properties": { "error": { "type": "string" } } } },
        },
        "paths": paths,
    })
}

/// The operation object of `route`.
fn operation(route: &Route) -> Value {
    let mut operation = json!({
        "summary": route.summary,
        "operationId": format!("{:?}", route.endpoint).to_ascii_lowercase(),
        "parameters": parameters(route.endpoint),
        "responses": responses(route),
    });
    if let Some(scope) = route.scope {
        operation["security"] = json!([{ "bearer": [] }]);
        operation["x-scope"] = json!(scope.as_str());
    }
    if let Some(body) = body(route.endpoint) {
        operation["requestBody"] = json!({
            "required": false,
            "content": { "application/json": { "schema": body } },
        });
    }
    operation
}

fn query(name: &str, required: bool, description: &str) -> Value {
    json!({ "name": name, "in": "query", "required": required, "schema": { "type": "string" }, "description": description })
}

fn parameters(endpoint: Endpoint) -> Value {
    let outbox =
        query("outbox", false, "The outbox's name ([[outboxes]]); needed where one is, with several");
    match endpoint {
        Endpoint::Status => json!([outbox]),
        Endpoint::DeadLetters => {
            json!([outbox, query("limit", false, "Letters per outbox, 1 to 1000 (100)")])
        }
        Endpoint::Locate => json!([
            query("id", true, "The event's id"),
            outbox,
            query(
                "wait_secs",
                false,
                "Replication: seconds to wait for the slot to confirm past the row (0 to 60; 0)"
            ),
        ]),
        Endpoint::Pause | Endpoint::Resume | Endpoint::Replay | Endpoint::Republish | Endpoint::Verify => {
            json!([{
                "name": CSRF_HEADER, "in": "header", "required": true, "schema": { "type": "string" },
                "description": "The process's CSRF token (GET /v1/session, or the console page)",
            }])
        }
        _ => json!([]),
    }
}

fn body(endpoint: Endpoint) -> Option<Value> {
    let object = |properties: Value| json!({ "type": "object", "additionalProperties": false, "properties": properties });
    let ids = json!({ "type": "array", "items": { "type": "integer", "format": "int64" } });
    match endpoint {
        Endpoint::Pause => Some(object(json!({ "reason": { "type": "string", "maxLength": 500 } }))),
        Endpoint::Replay => Some(object(json!({
            "outbox": { "type": "string" }, "ids": ids, "vouch": ids, "dry_run": { "type": "boolean" },
        }))),
        Endpoint::Republish => Some(object(json!({
            "outbox": { "type": "string" },
            "aggregate_id": { "type": "string", "description": "The events of this aggregate" },
            "aggregate_type": { "type": "string", "description": "With aggregate_id: of this type only" },
            "ids": { "type": "array", "items": { "type": "string" }, "description": "These event ids" },
            "since": { "type": "string", "description": "Created at or after this timestamp (\"2026-12-01 10:00+00\")" },
            "until": { "type": "string", "description": "Created before this timestamp" },
            "dry_run": { "type": "boolean" },
        }))),
        Endpoint::Verify => Some(object(json!({
            "outbox": { "type": "string" },
            "since": { "type": "string", "description": "A timestamp or a span back from now (\"30m\"); default 1h" },
            "until": { "type": "string" },
        }))),
        _ => None,
    }
}

fn responses(route: &Route) -> Value {
    let error =
        json!({ "content": { "application/json": { "schema": { "$ref": "#/components/schemas/Error" } } } });
    let with = |description: &str| {
        let mut answer = error.clone();
        answer["description"] = json!(description);
        answer
    };
    let ok = match route.endpoint {
        Endpoint::Console => json!({ "description": "The console page", "content": { "text/html": {} } }),
        _ if route.method == "POST" => json!({
            "description": "The act's receipt: act, by, at_unix_seconds, result, detail",
            "content": { "application/json": { "schema": { "type": "object" } } },
        }),
        _ => {
            json!({ "description": "OK", "content": { "application/json": { "schema": { "type": "object" } } } })
        }
    };
    let mut responses = json!({ "200": ok });
    if route.scope.is_some() {
        responses["400"] = with("A bad parameter or body, named");
        responses["401"] = with("No token, or not one of admin.tokens");
        responses["502"] = with("PostgreSQL or Kafka could not answer");
    }
    if route.method == "POST" {
        responses["403"] = with("A read-scope token, or no (or a stale) X-CSRF-Token, or a foreign Origin");
        responses["409"] = with(
            "This instance is a standby (detail.leader names the leader when known), or paused (republish, replay)",
        );
    }
    responses
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_served_route_is_described_and_every_described_one_is_served() {
        let document = document();
        let paths = document["paths"].as_object().unwrap();
        for route in ROUTES {
            let method = route.method.to_ascii_lowercase();
            assert!(
                paths.get(route.path).and_then(|p| p.get(&method)).is_some(),
                "{} {} undescribed",
                route.method,
                route.path
            );
        }
        for (path, operations) in paths {
            for method in operations.as_object().unwrap().keys() {
                let served = super::super::routes::find(&method.to_ascii_uppercase().parse().unwrap(), path);
                assert!(served.is_ok(), "{method} {path} is described but not served");
            }
        }
        assert_eq!(document["openapi"], "3.0.3");
    }
}
