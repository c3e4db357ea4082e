//! The configured outbox table: quoted identifiers and the SQL built from them.
//!
//! Every identifier that comes from configuration reaches SQL only through [`quote_ident`], so a
//! column called `type` (Debezium's layout) or a mixed-case table name works as configured.

use crate::config::OutboxConfig;

/// Quotes a PostgreSQL identifier: `order` becomes `"order"`, `a"b` becomes `"a""b"`.
pub fn quote_ident(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

/// Quotes a string literal for the rare statements that cannot take parameters.
pub fn quote_literal(value: &str) -> String {
    format!("'{}'", value.replace('\'', "''"))
}

/// The outbox table as the relay addresses it.
#[derive(Debug, Clone)]
pub struct OutboxTable {
    pub schema: String,
    pub name: String,
}

impl OutboxTable {
    pub fn new(outbox: &OutboxConfig) -> Self {
        OutboxTable { schema: outbox.schema.clone(), name: outbox.table.clone() }
    }

    /// `"schema"."table"`, ready to splice into SQL.
    pub fn qualified(&self) -> String {
        format!("{}.{}", quote_ident(&self.schema), quote_ident(&self.name))
    }

    /// `schema.table` for messages.
    pub fn display_name(&self) -> String {
        format!("{}.{}", self.schema, self.name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identifiers_are_quoted() {
        assert_eq!(quote_ident("type"), "\"type\"");
        assert_eq!(quote_ident("a\"b"), "\"a\"\"b\"");
        assert_eq!(quote_literal("it's"), "'it''s'");
    }
}
