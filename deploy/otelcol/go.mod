module specwatch.local/otelcol

go 1.25

require (
	github.com/open-telemetry/opentelemetry-collector-contrib/exporter/fileexporter v0.165.1
	github.com/open-telemetry/opentelemetry-collector-contrib/exporter/kafkaexporter v0.165.1
	github.com/open-telemetry/opentelemetry-collector-contrib/receiver/kafkareceiver v0.165.1
	go.opentelemetry.io/collector/component v1.71.0
	go.opentelemetry.io/collector/confmap v1.71.0
	go.opentelemetry.io/collector/confmap/provider/envprovider v1.71.0
	go.opentelemetry.io/collector/confmap/provider/fileprovider v1.71.0
	go.opentelemetry.io/collector/exporter v1.71.0
	go.opentelemetry.io/collector/otelcol v0.165.0
	go.opentelemetry.io/collector/processor v1.71.0
	go.opentelemetry.io/collector/processor/batchprocessor v0.165.0
	go.opentelemetry.io/collector/receiver v1.71.0
	go.opentelemetry.io/collector/receiver/otlpreceiver v0.165.0
	go.opentelemetry.io/collector/service v0.165.0
)
