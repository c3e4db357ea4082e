//! Which letters a replay may send: those the relay wrote, and those the operator vouches for.
//! Both relay roles may INSERT into the dead-letter table, and a replay publishes a letter under
//! its event's id, deletes that event's row and records the id as published: a letter anyone
//! else wrote would publish their content under a real event's id and hide the real event.
//!
//! Invariants:
//! - a letter is trusted when this relay's key (`dead_letter.signing_key_file`) verifies its
//!   digest of its outbox, event id and `row_data` as they are now
//!   ([`crate::dead_letter::SigningKey`]), or when its id is in `--vouch`; nothing else is;
//! - a letter not trusted is refused with a line naming it, why, and what to do; it is neither
//!   sent nor removed, and its event's row and id are left alone.

use super::{Letter, Options, Outcome};
use crate::config::DeadLetterConfig;
use crate::dead_letter::SigningKey;
use crate::error::{FatalReason, RelayError};
use crate::record::OutboxRow;

/// What a letter is checked against.
pub(super) struct Check<'a> {
    key: Option<SigningKey>,
    vouched: &'a [i64],
    /// The outbox's table (`schema.table`), as the letters name it.
    source_table: &'a str,
    /// The dead-letter table, for the lines that say what to do.
    letters_table: String,
}

impl<'a> Check<'a> {
    /// This relay's key (none when `dead_letter.signing_key_file` is not set) and the letters
    /// `options` vouches for.
    pub(super) fn new(
        letters: &DeadLetterConfig,
        options: &'a Options,
        source_table: &'a str,
    ) -> Result<Check<'a>, RelayError> {
        let file = &letters.signing_key_file;
        let key = match file.is_empty() {
            true => None,
            false => Some(SigningKey::read(file).map_err(|e| RelayError::fatal(FatalReason::Config, e))?),
        };
        let letters_table = crate::dead_letter::qualified_table(letters);
        Ok(Check { key, vouched: &options.vouched, source_table, letters_table })
    }

    /// Whether the relay wrote `letter` as it is now.
    fn signed(&self, letter: &Letter) -> bool {
        let (Some(key), Some(digest)) = (&self.key, &letter.digest) else { return false };
        let object = match serde_json::from_str::<serde_json::Value>(&letter.row_data) {
            Ok(serde_json::Value::Object(object)) => object,
            _ => serde_json::Map::new(),
        };
        let row = OutboxRow::from_json(&object);
        key.verifies(self.source_table, &letter.event_id, &row.row_data().fields(), digest)
    }

    /// Why `letter` is refused, and what to do.
    fn refusal(&self, letter: &Letter) -> String {
        let (id, event, table) = (letter.id, &letter.event_id, &self.letters_table);
        let why = match &self.key {
            Some(_) => format!(
                "its digest is not this relay's (dead_letter.signing_key_file): the relay did not write it as it is \
                 (another role holding INSERT on {table} did, or it was edited since, or written before the key was set)"
            ),
            None => format!(
                "dead_letter.signing_key_file is not set, so nothing tells a letter the relay wrote from one any role \
                 holding INSERT on {table} wrote"
            ),
        };
        format!(
            "letter {id} (event {event}): refused, not sent: {why}; the event's row and id are left as they are -- \
             compare it with the event (SELECT row_data FROM {table} WHERE id = {id}) and, if it is right, replay it \
             with --vouch {id}; if not, DELETE it"
        )
    }
}

/// The letters `check` trusts; each other one is refused in `outcome`, as is a vouched id that
/// names no letter read.
pub(super) fn trusted(letters: Vec<Letter>, check: &Check<'_>, outcome: &mut Outcome) -> Vec<Letter> {
    for id in check.vouched.iter().filter(|id| !letters.iter().any(|l| l.id == **id)) {
        outcome.refused += 1;
        outcome
            .lines
            .push(format!("--vouch {id}: no dead letter of {} chosen has this id", check.source_table));
    }
    let mut trusted = Vec::with_capacity(letters.len());
    for letter in letters {
        if check.vouched.contains(&letter.id) || check.signed(&letter) {
            trusted.push(letter);
        } else {
            outcome.refused += 1;
            outcome.lines.push(check.refusal(&letter));
        }
    }
    trusted
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dead_letter::{DeadLetter, LetterRow};

    fn letter(dead: &DeadLetter, digest: Option<String>) -> Letter {
        // as the table gives it back: jsonb's own text, keys in its order
        let row_data = match &dead.row {
            LetterRow::Row(raw) => serde_json::to_value(raw.row_data()).unwrap(),
            LetterRow::Record(event) => serde_json::to_value(event.row_data()).unwrap(),
        };
        Letter { id: 3, event_id: dead.id.clone(), row_data: row_data.to_string(), digest }
    }

    fn check(key: Option<SigningKey>, vouched: &[i64]) -> Check<'_> {
        Check {
            key,
            vouched,
            source_table: "public.outbox_events",
            letters_table: "outbox_dead_letter".into(),
        }
    }

    fn sign(key: &SigningKey, dead: &DeadLetter) -> String {
        let row_data = match &dead.row {
            LetterRow::Row(raw) => raw.row_data(),
            LetterRow::Record(event) => event.row_data(),
        };
        key.sign("public.outbox_events", &dead.id, &row_data.fields())
    }

    #[test]
    fn the_relays_letters_verify_as_read_back_and_nothing_else_does() {
        let key = SigningKey::new(&[7; 32]).unwrap();
        let row =
            OutboxRow { id: Some("9".into()), aggregate_type: Some("order".into()), ..OutboxRow::default() };
        let refused = crate::sink::scripted::record("9");
        for dead in
            [DeadLetter::row(row, "no aggregate id".into()), DeadLetter::refused(refused, "too large".into())]
        {
            let digest = sign(&key, &dead);
            let check = check(Some(key.clone()), &[]);
            assert!(check.signed(&letter(&dead, Some(digest.clone()))), "{dead:?}");
            // the same digest on another event, or on edited data: no
            let mut moved = letter(&dead, Some(digest.clone()));
            moved.event_id = "10".into();
            assert!(!check.signed(&moved));
            let mut edited = letter(&dead, Some(digest));
            edited.row_data = edited.row_data.replace("\"9\"", "\"19\"");
            assert!(!check.signed(&edited));
            assert!(!check.signed(&letter(&dead, None)));
        }
    }

    #[test]
    fn an_unsigned_letter_is_refused_naming_it_unless_vouched_for() {
        let dead = DeadLetter::row(OutboxRow { id: Some("9".into()), ..OutboxRow::default() }, "x".into());
        let mut outcome = Outcome::default();
        let kept = trusted(vec![letter(&dead, None)], &check(None, &[]), &mut outcome);
        assert!(kept.is_empty());
        assert_eq!(outcome.refused, 1);
        assert!(
            outcome.lines[0].starts_with("letter 3 (event 9): refused, not sent"),
            "{}",
            outcome.lines[0]
        );
        assert!(outcome.lines[0].contains("dead_letter.signing_key_file is not set"), "{}", outcome.lines[0]);
        let mut outcome = Outcome::default();
        let kept = trusted(vec![letter(&dead, None)], &check(None, &[3, 4]), &mut outcome);
        assert_eq!(kept.len(), 1);
        assert_eq!(outcome.lines, ["--vouch 4: no dead letter of public.outbox_events chosen has this id"]);
    }
}
