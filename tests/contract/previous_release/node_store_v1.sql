-- written by qgpu 0.1.0 (commit 959444c) node/store.py: sqlite3 iterdump of a node store
BEGIN TRANSACTION;
CREATE TABLE cards (
  card_index INTEGER PRIMARY KEY,
  uuid TEXT NOT NULL UNIQUE,
  model TEXT NOT NULL,
  memory_mib INTEGER NOT NULL,
  healthy INTEGER NOT NULL DEFAULT 1,
  reason TEXT NOT NULL DEFAULT ''
);
INSERT INTO "cards" VALUES(0,'GPU-aaaa','Tesla T4',15109,1,'');
INSERT INTO "cards" VALUES(1,'GPU-bbbb','Tesla T4',15109,0,'XID 79');
CREATE TABLE grants (
  pod_uid TEXT NOT NULL,
  namespace TEXT NOT NULL,
  pod TEXT NOT NULL,
  container TEXT NOT NULL,
  resource TEXT NOT NULL,
  device_ids TEXT NOT NULL,
  created_ns INTEGER NOT NULL,
  PRIMARY KEY (pod_uid, container, resource)
);
INSERT INTO "grants" VALUES('uid-1','team-a','train-0','main','tke.cloud.tencent.com/qgpu-core','["qgpu-core-0-0", "qgpu-core-0-1"]',1732000000000000000);
CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
INSERT INTO "meta" VALUES('schema_version','1');
INSERT INTO "meta" VALUES('node','gpu-node-1');
INSERT INTO "meta" VALUES('policy','fixed-share');
CREATE TABLE shares (
  workload_id TEXT NOT NULL,
  namespace TEXT NOT NULL,
  workload TEXT NOT NULL,
  container TEXT NOT NULL,
  card_index INTEGER NOT NULL,
  card_uuid TEXT NOT NULL,
  core_milli INTEGER NOT NULL,
  memory_mib INTEGER NOT NULL,
  class TEXT NOT NULL,
  created_ns INTEGER NOT NULL,
  PRIMARY KEY (workload_id, container, card_index)
);
INSERT INTO "shares" VALUES('uid-1','team-a','train-0','main',0,'GPU-aaaa',300,4096,'offline',1732000000000000000);
COMMIT;
