-- idem on MySQL 8.0+ / MariaDB 10.5+: one record per scoped idempotency key,
-- and the fence counter. A template, not a sqlx migration: the table name is
-- configurable, so `MySqlStore` fills in the quoted, validated names
-- ({records} = `table`, {fence} = `table_fence`, {deadline_index} =
-- `table_deadline`) and runs each statement at connect under GET_LOCK.
--
-- scope, key: VARBINARY, compared byte for byte: a character column would
--             use the default collation, which ignores case and trailing
--             spaces, and two distinct keys would share one record.
-- state:      0 = in progress (deadline = lease end; response is NULL, or
--                 the hold reason's name once `hold` marked the key held),
--             1 = completed   (deadline = expiry; response holds the result).
-- deadline:   milliseconds since the Unix epoch, by the server's clock.
-- fence:      the fencing token of the current (or last) claim, drawn from
--             the AUTO_INCREMENT of {fence}, so fences grow across release,
--             expiry, purge and delete. Negative only inside the claiming
--             transaction (a placeholder), never in a committed row.
CREATE TABLE IF NOT EXISTS {records} (
    scope       VARBINARY(255) NOT NULL,
    `key`       VARBINARY(255) NOT NULL,
    fingerprint VARBINARY(64)  NOT NULL,
    state       TINYINT        NOT NULL,
    fence       BIGINT         NOT NULL,
    deadline    BIGINT         NOT NULL,
    response    LONGBLOB       NULL,
    PRIMARY KEY (scope, `key`),
    KEY {deadline_index} (deadline),
    CONSTRAINT {state_check} CHECK (state IN (0, 1))
) ENGINE = InnoDB;

CREATE TABLE IF NOT EXISTS {fence} (
    id BIGINT NOT NULL AUTO_INCREMENT PRIMARY KEY
) ENGINE = InnoDB;
