CREATE TABLE specwatch.decisions
(
    `decision_id` String,
    `ts` Float64,
    `bundle_id` LowCardinality(String),
    `bucket` LowCardinality(Nullable(String)),
    `cohort` LowCardinality(Nullable(String)),
    `action` LowCardinality(String),
    `reason` LowCardinality(String),
    `detector` LowCardinality(String),
    `evidence` String,
    `sample_ids` Array(String),
    `line` String,
    `archived_at` DateTime64(6, 'UTC') DEFAULT now64(6)
)
ENGINE = ReplacingMergeTree
ORDER BY (bundle_id, decision_id)
SETTINGS index_granularity = 8192;

CREATE TABLE specwatch.audit
(
    `audit_id` String,
    `ts` Float64,
    `kind` LowCardinality(String),
    `actor` String,
    `decision_id` Nullable(String),
    `bundle_id` LowCardinality(String),
    `scope` String,
    `reason` String,
    `detector` String,
    `thresholds` String,
    `baseline` String,
    `window` String,
    `card` String,
    `detail` String,
    `archived_at` DateTime64(6, 'UTC') DEFAULT now64(6)
)
ENGINE = ReplacingMergeTree
ORDER BY audit_id
SETTINGS index_granularity = 8192;

CREATE TABLE specwatch.samples
(
    `decision_id` String,
    `kind` LowCardinality(String),
    `sample_id` String,
    `ts` Float64,
    `bundle_id` LowCardinality(String),
    `bucket` LowCardinality(Nullable(String)),
    `cohort` LowCardinality(Nullable(String)),
    `worker` LowCardinality(Nullable(String)),
    `record` String
)
ENGINE = ReplacingMergeTree
ORDER BY (decision_id, kind, sample_id)
SETTINGS index_granularity = 8192;

CREATE TABLE specwatch.window_stats
(
    `ts` Float64,
    `bundle_id` LowCardinality(String),
    `bucket` LowCardinality(Nullable(String)),
    `cohort` LowCardinality(Nullable(String)),
    `rounds` UInt64,
    `drafted_tokens` UInt64,
    `accepted_tokens` UInt64,
    `acceptance_length` Nullable(Float64),
    `draft_overhead` Nullable(Float64),
    `speedup` Nullable(Float64),
    `draft_ms` Nullable(Float64),
    `verify_ms` Nullable(Float64),
    `requests` UInt64,
    `errors` UInt64,
    `error_rate` Nullable(Float64),
    `ttft_p50` Nullable(Float64),
    `ttft_p95` Nullable(Float64),
    `ttft_p99` Nullable(Float64),
    `tpot_p50` Nullable(Float64),
    `tpot_p95` Nullable(Float64),
    `tpot_p99` Nullable(Float64),
    `e2e_p50` Nullable(Float64),
    `e2e_p95` Nullable(Float64),
    `e2e_p99` Nullable(Float64),
    `kv_peak` Nullable(Float64),
    `shadow_checks` UInt64,
    `shadow_mismatches` UInt64,
    `speculation_on` Bool,
    `steps` UInt64,
    `plain_entries` UInt64,
    `accepted_at_least` Array(UInt64),
    `drafted_at_least` Array(UInt64)
)
ENGINE = ReplacingMergeTree
PARTITION BY toYYYYMM(toDateTime(toUInt32(ts), 'UTC'))
ORDER BY (bundle_id, bucket, cohort, ts)
SETTINGS allow_nullable_key = 1, index_granularity = 8192;

CREATE TABLE specwatch.bundles
(
    `bundle_id` String,
    `card` SimpleAggregateFunction(any, String),
    `first_seen` SimpleAggregateFunction(min, Float64),
    `last_seen` SimpleAggregateFunction(max, Float64),
    `workers` SimpleAggregateFunction(groupUniqArrayArray, Array(String))
)
ENGINE = AggregatingMergeTree
ORDER BY bundle_id
SETTINGS index_granularity = 8192;

CREATE TABLE specwatch.bundle_sightings
(
    `bundle_id` String,
    `worker` String,
    `first_seen` SimpleAggregateFunction(min, Float64),
    `last_seen` SimpleAggregateFunction(max, Float64)
)
ENGINE = AggregatingMergeTree
ORDER BY (bundle_id, worker)
SETTINGS index_granularity = 8192;

CREATE TABLE specwatch.overrides
(
    `override_id` String,
    `ts` Float64,
    `bundle_id` LowCardinality(String),
    `bucket` LowCardinality(Nullable(String)),
    `cohort` LowCardinality(Nullable(String)),
    `enabled` Bool,
    `draft_limit` Nullable(UInt16),
    `by` String,
    `reason` String,
    `cleared` Bool,
    `archived_at` DateTime64(6, 'UTC') DEFAULT now64(6)
)
ENGINE = ReplacingMergeTree
ORDER BY override_id
SETTINGS index_granularity = 8192;

CREATE TABLE specwatch.bundle_stages
(
    `change_id` String,
    `ts` Float64,
    `bundle_id` LowCardinality(String),
    `stage` LowCardinality(String),
    `previous_stage` LowCardinality(Nullable(String)),
    `cohort_share` Float64,
    `actor` String,
    `reason` String,
    `decision_id` Nullable(String),
    `detail` String,
    `seq` UInt32,
    `archived_at` DateTime64(6, 'UTC') DEFAULT now64(6)
)
ENGINE = ReplacingMergeTree
ORDER BY (bundle_id, change_id)
SETTINGS index_granularity = 8192;

CREATE TABLE specwatch.rejections
(
    `ts` Float64,
    `source` LowCardinality(String),
    `reason` LowCardinality(String),
    `count` UInt64
)
ENGINE = ReplacingMergeTree
ORDER BY (source, reason, ts)
SETTINGS index_granularity = 8192;

CREATE TABLE specwatch.sealed_samples
(
    `decision_id` String,
    `sample_id` String,
    `ts` Float64,
    `bundle_id` LowCardinality(String),
    `key_id` LowCardinality(String),
    `prompt_sha256` String,
    `output_sha256` String,
    `sealed` String,
    `archived_at` DateTime DEFAULT now()
)
ENGINE = ReplacingMergeTree
ORDER BY (decision_id, sample_id)
TTL archived_at + toIntervalDay(30)
SETTINGS index_granularity = 8192;

CREATE TABLE specwatch.reproductions
(
    `reproduction_id` String,
    `decision_id` String,
    `ts` Float64,
    `actor` String,
    `verdict` LowCardinality(String),
    `result` String,
    `archived_at` DateTime64(6, 'UTC') DEFAULT now64(6)
)
ENGINE = ReplacingMergeTree
ORDER BY (decision_id, reproduction_id)
SETTINGS index_granularity = 8192;
