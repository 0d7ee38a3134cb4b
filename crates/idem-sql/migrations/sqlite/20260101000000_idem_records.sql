-- idem: one record per scoped idempotency key, and the fence counter.
--
-- state:    0 = in progress (deadline = lease end),
--           1 = completed   (deadline = expiry; response holds the result).
-- deadline: milliseconds since the Unix epoch, by the store's clock.
-- fence:    the fencing token of the current (or last) claim.
CREATE TABLE IF NOT EXISTS idem_records (
    scope       TEXT    NOT NULL,
    key         TEXT    NOT NULL,
    fingerprint BLOB    NOT NULL,
    state       INTEGER NOT NULL CHECK (state IN (0, 1)),
    fence       INTEGER NOT NULL,
    deadline    INTEGER NOT NULL,
    response    BLOB,
    PRIMARY KEY (scope, key)
) WITHOUT ROWID;

CREATE INDEX IF NOT EXISTS idem_records_deadline ON idem_records (deadline);

-- The highest fence granted by this database, so fences keep growing after
-- a record is released, purged or deleted.
CREATE TABLE IF NOT EXISTS idem_fence (
    id   INTEGER PRIMARY KEY CHECK (id = 1),
    last INTEGER NOT NULL
);

INSERT OR IGNORE INTO idem_fence (id, last) VALUES (1, 0);
