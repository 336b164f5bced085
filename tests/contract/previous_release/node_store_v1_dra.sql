-- A node store written by qgpu at commit c64d41b (the DRA kubelet plugin before the claim_pods table):
-- one prepared ResourceClaim with its share. Produced with that commit's node.store.Store, dumped with iterdump.
PRAGMA foreign_keys=OFF;
BEGIN TRANSACTION;
CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
INSERT INTO meta VALUES('schema_version','1');
INSERT INTO meta VALUES('node','gpu-node-1');
INSERT INTO meta VALUES('policy','fixed-share');
CREATE TABLE cards (
        card_index INTEGER PRIMARY KEY, uuid TEXT NOT NULL UNIQUE, model TEXT NOT NULL, memory_mib INTEGER NOT NULL,
        healthy INTEGER NOT NULL DEFAULT 1, reason TEXT NOT NULL DEFAULT '');
INSERT INTO cards VALUES(0,'GPU-aaaa','Tesla T4',15360,1,'');
CREATE TABLE shares (
        workload_id TEXT NOT NULL, namespace TEXT NOT NULL, workload TEXT NOT NULL, container TEXT NOT NULL,
        card_index INTEGER NOT NULL, card_uuid TEXT NOT NULL, core_milli INTEGER NOT NULL, memory_mib INTEGER NOT NULL,
        class TEXT NOT NULL, created_ns INTEGER NOT NULL, PRIMARY KEY (workload_id, container, card_index));
INSERT INTO shares VALUES('claim-uid-1','team-a','train','gpu',0,'GPU-aaaa',300,4096,'normal',1764000000000000000);
CREATE TABLE grants (
        pod_uid TEXT NOT NULL, namespace TEXT NOT NULL, pod TEXT NOT NULL, container TEXT NOT NULL,
        resource TEXT NOT NULL, device_ids TEXT NOT NULL, created_ns INTEGER NOT NULL,
        PRIMARY KEY (pod_uid, container, resource));
CREATE TABLE jobs (
        id TEXT PRIMARY KEY, name TEXT NOT NULL, klass TEXT NOT NULL, core_milli INTEGER NOT NULL,
        memory_mib INTEGER NOT NULL, shares TEXT NOT NULL, command TEXT NOT NULL, created REAL NOT NULL,
        supervisor_pid INTEGER NOT NULL, supervisor_start INTEGER NOT NULL,
        pgid INTEGER, pgid_start INTEGER, exclusive INTEGER NOT NULL DEFAULT 0);
CREATE TABLE events (
        id INTEGER PRIMARY KEY AUTOINCREMENT, time REAL NOT NULL, job TEXT NOT NULL, card INTEGER NOT NULL,
        reason TEXT NOT NULL, message TEXT NOT NULL);
CREATE TABLE claims (
        claim_uid TEXT PRIMARY KEY, namespace TEXT NOT NULL, name TEXT NOT NULL, devices TEXT NOT NULL,
        cdi_spec TEXT NOT NULL, created_ns INTEGER NOT NULL);
INSERT INTO claims VALUES('claim-uid-1','team-a','train','[{"cdiDeviceIDs": ["gpu.qgpu.io/claim=claim-uid-1-0"], "device": "gpu-0", "pool": "gpu-node-1", "requestNames": ["gpu"], "shareID": "s-1"}]','/var/run/cdi/gpu.qgpu.io-claim_claim-uid-1.json',1764000000000000000);
DELETE FROM sqlite_sequence;
COMMIT;
