-- Requests to the running relay, for estates where nothing may call into the pod (docs/admin.md,
-- "The signal table"): an operator inserts a row, the active relay executes the rows in id order,
-- each once, and writes its result and receipt into the row (and the same audit line the admin
-- API writes). Off unless the relay's admin.signal_table names this table; `outbox-relay setup`
-- creates it too (with the configured names).
--
--   INSERT INTO outbox_relay_signal (kind, args) VALUES ('republish', '{"aggregate_id": "42"}');
--   SELECT id, result, receipt FROM outbox_relay_signal ORDER BY id DESC LIMIT 5;
--
-- kind and args are the admin API's acts and bodies (POST /v1/<act>): republish
-- {"aggregate_id", "aggregate_type", "ids", "since", "until", "dry_run", "outbox"}; replay
-- {"outbox", "ids", "vouch", "dry_run"}; pause {"reason"}; resume {}; verify {"outbox", "since",
-- "until"}.
--
-- Who may ask: members of outbox_relay_operator, and no one else. Enforced three times:
--   1. only outbox_relay_operator is granted INSERT here, and only on (kind, args);
--   2. a trigger sets requested_by to session_user (the role that logged in; SET ROLE cannot
--      change it) and refuses the row unless that role is a member of outbox_relay_operator,
--      so a role granted INSERT by mistake, or the owner inserting as itself, is refused too;
--   3. the relay executes a row only when pg_has_role(requested_by, 'outbox_relay_operator',
--      'MEMBER') still holds, and otherwise writes result 'refused' into it.
-- The relay's roles may read the table and write only the columns that say what became of a row.
--
-- Once each: the relay marks a row started (started_at, executor_pid: its connection's backend)
-- in a committed statement before it executes it, and never executes a started row. A row whose
-- executor stopped before finishing (a crash, kill -9) is marked result 'interrupted' by the next
-- active relay: part of it may have happened (a republish sends some events); insert a new row
-- to ask again.
-- One session at a time makes and grants the roles (they are the server's: two databases
-- migrated at once would race), and this comes first: applied as one transaction (one
-- multi-statement query), a session that waited here then looks the roles up afresh. Taken only
-- inside a block below, the wait came after a first look at the catalog, and the role the other
-- session had just made could stay invisible to a GRANT ("role ... does not exist").
SELECT pg_advisory_xact_lock(hashtext('outbox-relay roles'));

DO $$
BEGIN
    -- one session at a time makes the roles (see 100_relay_role.sql)
    PERFORM pg_advisory_xact_lock(hashtext('outbox-relay roles'));
    IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'outbox_relay_operator') THEN
        BEGIN
            CREATE ROLE outbox_relay_operator NOLOGIN;
        EXCEPTION
            -- made meanwhile (roles are server-wide: another database's session may have)
            WHEN duplicate_object OR unique_violation THEN NULL;
            WHEN insufficient_privilege THEN
                RAISE EXCEPTION 'role outbox_relay_operator does not exist, and role % may not create it: %', current_user, SQLERRM
                    USING HINT = 'an administrator runs sql/roles.sql first (README, First deployment, step 1)';
        END;
    END IF;
END
$$;

CREATE TABLE IF NOT EXISTS outbox_relay_signal (
    id            bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    kind          text        NOT NULL CHECK (kind IN ('republish', 'replay', 'pause', 'resume', 'verify')),
    args          jsonb       NOT NULL DEFAULT '{}' CHECK (jsonb_typeof(args) = 'object'),
    requested_by  name        NOT NULL DEFAULT session_user,   -- set by the trigger, whatever the row says
    requested_at  timestamptz NOT NULL DEFAULT now(),
    started_at    timestamptz,          -- the relay took it: it is never executed again
    started_by    text,                 -- which relay (application_name, host)
    executor_pid  integer,              -- that relay's backend while it executes the row
    finished_at   timestamptz,
    result        text,                 -- as the admin API's receipt says it, or 'interrupted', 'refused'
    receipt       jsonb                 -- {"act", "by", "at_unix_seconds", "result", "detail"}
);
-- the relay looks for the first unfinished row
CREATE INDEX IF NOT EXISTS outbox_relay_signal_unfinished ON outbox_relay_signal (id) WHERE finished_at IS NULL;

CREATE OR REPLACE FUNCTION outbox_relay_signal_requested() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF NOT pg_has_role(session_user, 'outbox_relay_operator', 'MEMBER') THEN
        RAISE EXCEPTION 'role % may not ask the relay: only members of outbox_relay_operator may insert into %', session_user, TG_TABLE_NAME
            USING ERRCODE = 'insufficient_privilege',
                  HINT = format('an administrator grants it: GRANT outbox_relay_operator TO %I', session_user);
    END IF;
    NEW.requested_by := session_user;
    NEW.requested_at := now();
    NEW.started_at := NULL;
    NEW.started_by := NULL;
    NEW.executor_pid := NULL;
    NEW.finished_at := NULL;
    NEW.result := NULL;
    NEW.receipt := NULL;
    RETURN NEW;
END
$$;
DROP TRIGGER IF EXISTS outbox_relay_signal_requested ON outbox_relay_signal;
CREATE TRIGGER outbox_relay_signal_requested BEFORE INSERT ON outbox_relay_signal
    FOR EACH ROW EXECUTE FUNCTION outbox_relay_signal_requested();

REVOKE ALL ON outbox_relay_signal FROM PUBLIC;
GRANT SELECT ON outbox_relay_signal TO outbox_relay_operator;
GRANT INSERT (kind, args) ON outbox_relay_signal TO outbox_relay_operator;
