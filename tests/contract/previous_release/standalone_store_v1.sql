-- written by qgpu 0.1.0 (commit 959444c) standalone/store.py: sqlite3 iterdump of a host store
BEGIN TRANSACTION;
CREATE TABLE cards (
    card_index INTEGER PRIMARY KEY, uuid TEXT NOT NULL UNIQUE, model TEXT NOT NULL, memory_mib INTEGER NOT NULL,
    healthy INTEGER NOT NULL DEFAULT 1, reason TEXT NOT NULL DEFAULT '');
INSERT INTO "cards" VALUES(0,'GPU-sim-0','T4',16384,1,'');
CREATE TABLE events (
    id INTEGER PRIMARY KEY AUTOINCREMENT, time REAL NOT NULL, job TEXT NOT NULL, card INTEGER NOT NULL,
    reason TEXT NOT NULL, message TEXT NOT NULL);
CREATE TABLE jobs (
    id TEXT PRIMARY KEY, name TEXT NOT NULL, klass TEXT NOT NULL, core_milli INTEGER NOT NULL,
    memory_mib INTEGER NOT NULL, shares TEXT NOT NULL, command TEXT NOT NULL, created REAL NOT NULL,
    supervisor_pid INTEGER NOT NULL, supervisor_start INTEGER NOT NULL,
    pgid INTEGER, pgid_start INTEGER, exclusive INTEGER NOT NULL DEFAULT 0);
INSERT INTO "jobs" VALUES('job-1','train','normal',400,2048,'[{"index": 0, "uuid": "GPU-sim-0", "core_milli": 400, "memory_mib": 2048}]','python train.py',1732000000.5,12973,123456,NULL,NULL,0);
CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
INSERT INTO "meta" VALUES('schema_version','1');
INSERT INTO "meta" VALUES('policy','burst-share');
INSERT INTO "meta" VALUES('node','host-1');
CREATE TABLE shares (
    workload_id TEXT NOT NULL, namespace TEXT NOT NULL, workload TEXT NOT NULL, container TEXT NOT NULL,
    card_index INTEGER NOT NULL, card_uuid TEXT NOT NULL, core_milli INTEGER NOT NULL, memory_mib INTEGER NOT NULL,
    class TEXT NOT NULL, created_ns INTEGER NOT NULL, PRIMARY KEY (workload_id, container, card_index));
INSERT INTO "shares" VALUES('job-1','','train','',0,'GPU-sim-0',400,2048,'normal',1732000000500000000);
DELETE FROM "sqlite_sequence";
COMMIT;
