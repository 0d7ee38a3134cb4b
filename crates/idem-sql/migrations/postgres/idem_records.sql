-- idem on PostgreSQL: one record per scoped idempotency key, and the fence
-- sequence. A template, not a sqlx migration: the schema and table names are
-- configurable, so `PostgresStore` fills in the quoted, validated names
-- ({records} = "schema"."table", {fence_seq} = "schema"."table_fence",
-- {deadline_index} = "table_deadline") and runs it idempotently at connect,
-- in one transaction under an advisory lock (concurrent CREATE ... IF NOT
-- EXISTS can otherwise fail on the catalog's unique indexes).
--
-- scope, key: bytea, compared byte for byte (no collation, no NUL problem).
-- state:      0 = in progress (deadline = lease end; response is NULL, or
--                 the hold reason's name once `hold` marked the key held),
--             1 = completed   (deadline = expiry; response holds the result).
-- deadline:   milliseconds since the Unix epoch, by the database's clock.
-- fence:      the fencing token of the current (or last) claim, from
--             {fence_seq}: one store-wide counter, so fences grow across
--             release, expiry, purge and delete.
CREATE TABLE IF NOT EXISTS {records} (
    scope       bytea    NOT NULL,
    key         bytea    NOT NULL,
    fingerprint bytea    NOT NULL,
    state       smallint NOT NULL CHECK (state IN (0, 1)),
    fence       bigint   NOT NULL,
    deadline    bigint   NOT NULL,
    response    bytea,
    PRIMARY KEY (scope, key)
);

CREATE INDEX IF NOT EXISTS {deadline_index} ON {records} (deadline);

CREATE SEQUENCE IF NOT EXISTS {fence_seq} AS bigint MINVALUE 1 NO CYCLE;
