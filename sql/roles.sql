-- The roles of outbox-relay and of the outbox's writers, made by an administrator BEFORE the
-- migrations (README, "First deployment on your own database", step 1). Roles belong to the
-- whole server, not to one database, and making them takes privileges the table's owner should
-- not need: with this file run first, the owner applies sql/[0-9]*.sql with no CREATEROLE, no
-- REPLICATION and no superuser (the migrations find the roles and only grant to them).
--
--   psql -v ON_ERROR_STOP=1 -v owner="$OWNER" -d "$ADMIN_DATABASE_URL" -f sql/roles.sql
--
-- Who can run it:
--   a server of your own   a superuser. (PostgreSQL 14 and 15 let only a superuser make a role
--                          with REPLICATION; from 16 a role with CREATEROLE and REPLICATION may.)
--   RDS and Aurora         the master user (rds_superuser). No customer role may hold the
--                          REPLICATION attribute there: outbox_relay gets LOGIN and membership in
--                          rds_replication instead, and so does the owner. Set
--                          rds.logical_replication = 1 in the parameter group.
--   Cloud SQL              the postgres user (a member of cloudsqlsuperuser), which may make
--                          roles with REPLICATION there. Set the flag cloudsql.logical_decoding=on.
--
-- -v owner=NAME (optional) names the table's owner, your migration role: it is given what
-- `outbox-relay setup` needs to create the replication slot (REPLICATION; on RDS and Aurora,
-- membership in rds_replication). Leave it out when a migration creates the publication and the
-- relay's own role creates the slot, or in polling mode.
--
-- Safe to run again: a role that exists is left as it is. Then set the passwords out of band
-- (\password outbox_relay in psql), and give the application's role outbox_writer if it calls
-- outbox_emit():  GRANT outbox_writer TO app;
--
--   outbox_writer          NOLOGIN: may call outbox_emit() (sql/005_outbox_emit.sql)
--   outbox_relay           the relay in replication mode: LOGIN REPLICATION (or rds_replication)
--   outbox_relay_polling   the relay in polling mode: LOGIN only
--   outbox_relay_verify    verify, verify --watch and locate: LOGIN only
--   outbox_relay_operator  NOLOGIN: may insert requests into the signal table
--                          (sql/014_relay_signal.sql): GRANT outbox_relay_operator TO alice;
-- What each may touch is granted by sql/100_relay_role.sql, as the table's owner.

\if :{?owner}
SELECT set_config('outbox_relay.roles_owner', :'owner', false);
\else
SELECT set_config('outbox_relay.roles_owner', '', false);
\endif

DO $$
DECLARE
    -- RDS and Aurora: the role rds_replication exists and the master user is no superuser
    rds boolean := EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'rds_replication')
                   AND NOT (SELECT rolsuper FROM pg_roles WHERE rolname = current_user);
    owner text := current_setting('outbox_relay.roles_owner');
    made text[] := '{}';
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'outbox_writer') THEN
        CREATE ROLE outbox_writer NOLOGIN;
        made := made || 'outbox_writer'::text;
    END IF;
    IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'outbox_relay') THEN
        IF rds THEN
            CREATE ROLE outbox_relay LOGIN;
            GRANT rds_replication TO outbox_relay;
        ELSE
            CREATE ROLE outbox_relay LOGIN REPLICATION;
        END IF;
        made := made || 'outbox_relay'::text;
    END IF;
    IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'outbox_relay_polling') THEN
        CREATE ROLE outbox_relay_polling LOGIN;
        made := made || 'outbox_relay_polling'::text;
    END IF;
    IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'outbox_relay_verify') THEN
        CREATE ROLE outbox_relay_verify LOGIN;
        made := made || 'outbox_relay_verify'::text;
    END IF;
    IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'outbox_relay_operator') THEN
        CREATE ROLE outbox_relay_operator NOLOGIN;
        made := made || 'outbox_relay_operator'::text;
    END IF;
    RAISE NOTICE 'roles made: %', CASE WHEN made = '{}' THEN 'none (all five exist)' ELSE array_to_string(made, ', ') END;

    IF owner <> '' THEN
        IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = owner) THEN
            RAISE EXCEPTION 'owner role % does not exist', quote_ident(owner)
                USING HINT = 'pass the migration role that owns the outbox: psql -v owner=NAME ...';
        END IF;
        IF rds THEN
            EXECUTE format('GRANT rds_replication TO %I', owner);
        ELSE
            EXECUTE format('ALTER ROLE %I WITH REPLICATION', owner);
        END IF;
        RAISE NOTICE 'owner %: may create the replication slot (outbox-relay setup)', quote_ident(owner);
    END IF;
EXCEPTION
    WHEN insufficient_privilege THEN
        RAISE EXCEPTION '%', SQLERRM
            USING HINT = 'run sql/roles.sql as an administrator: a superuser (from PostgreSQL 16 also a role with CREATEROLE and REPLICATION), the master user on RDS and Aurora, the postgres user on Cloud SQL';
END
$$;

-- In this database (function privileges are per database): only the relay may write logical
-- decoding messages, its heartbeat (replication.heartbeat_interval_ms). Both statements need a
-- superuser, which the table's owner is not: sql/005 and sql/100 try them too, and only warn.
-- (On RDS, Aurora and Cloud SQL no customer role may: the statements warn, any login can then
-- emit outbox messages, `outbox-relay check` says so, and the heartbeat still works as PUBLIC's.)
DO $$
DECLARE
    f regprocedure;
BEGIN
    FOR f IN SELECT oid::regprocedure FROM pg_proc WHERE proname = 'pg_logical_emit_message' LOOP
        EXECUTE format('REVOKE EXECUTE ON FUNCTION %s FROM PUBLIC', f);
        EXECUTE format('GRANT EXECUTE ON FUNCTION %s TO outbox_relay', f);
    END LOOP;
EXCEPTION
    WHEN insufficient_privilege THEN
        RAISE WARNING 'cannot revoke EXECUTE on pg_logical_emit_message from PUBLIC (needs a superuser): any login can emit outbox messages until it is done';
END
$$;
