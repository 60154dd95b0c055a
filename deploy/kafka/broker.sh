#!/usr/bin/env bash
# Runs a single-node Apache Kafka broker (KRaft: controller and broker in one JVM) on
# 127.0.0.1 for specwatch's tests and demos, from jars resolved on Maven Central.
#
#   deploy/kafka/broker.sh start [--port P] [--partitions N] [--decision-partitions M]
#                                [--sasl-port S --sasl-user NAME:PASSWORD]
#       starts a fresh broker (empty data), creates the specwatch topics and prints the
#       bootstrap address 127.0.0.1:P on stdout; when one already runs on P it only makes
#       sure the topics exist and prints the address. --sasl-port adds a SASL_PLAINTEXT
#       listener (mechanism PLAIN) on 127.0.0.1:S for that one user.
#   deploy/kafka/broker.sh stop [--port P]      stops it and waits until it is gone
#   deploy/kafka/broker.sh resume [--port P]    starts a stopped broker again on its own
#       data (topics, offsets and committed groups kept), as after an outage
#   deploy/kafka/broker.sh status [--port P]    exit 0 and the address when it runs
#
# Progress and errors go to stderr; the broker's own log is <home>/data-P/server.log.
# Environment: SPECWATCH_KAFKA_HOME (default ~/.cache/specwatch/kafka) holds the jar
# cache <version>/libs and data-P; SPECWATCH_KAFKA_PORT is the default port (19092);
# SPECWATCH_KAFKA_START_TIMEOUT the seconds to wait for readiness (120).
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
home=${SPECWATCH_KAFKA_HOME:-$HOME/.cache/specwatch/kafka}
port=${SPECWATCH_KAFKA_PORT:-19092}
partitions=4
decision_partitions=1
sasl_port=
sasl_user=
start_timeout=${SPECWATCH_KAFKA_START_TIMEOUT:-120}
java=${JAVA_HOME:+$JAVA_HOME/bin/}java
# Tests run on small shared machines: a bounded heap keeps the broker a good neighbour.
broker_heap=${SPECWATCH_KAFKA_HEAP:--Xms128m -Xmx512m}
# Short-lived tool JVMs: the client compiler and serial GC start fastest.
tool_jvm=(-Xmx256m -XX:+UseSerialGC -XX:TieredStopAtLevel=1 -Xshare:auto -Djava.awt.headless=true)

log() { echo "broker.sh: $*" >&2; }
die() { log "$*"; exit 1; }

usage() {
  sed -n '4,19p' "$0" | sed 's/^# \{0,1\}//' >&2
  exit 2
}

command=${1:-}
[ -n "$command" ] || usage
shift
while [ $# -gt 0 ]; do
  case "$1" in
    --port) port=${2:?--port needs a value}; shift 2 ;;
    --port=*) port=${1#*=}; shift ;;
    --partitions) partitions=${2:?--partitions needs a value}; shift 2 ;;
    --partitions=*) partitions=${1#*=}; shift ;;
    --decision-partitions) decision_partitions=${2:?--decision-partitions needs a value}; shift 2 ;;
    --decision-partitions=*) decision_partitions=${1#*=}; shift ;;
    --sasl-port) sasl_port=${2:?--sasl-port needs a value}; shift 2 ;;
    --sasl-user) sasl_user=${2:?--sasl-user needs NAME:PASSWORD}; shift 2 ;;
    -h|--help) usage ;;
    *) log "unknown argument $1"; usage ;;
  esac
done
if [ -n "$sasl_port" ]; then
  [[ "$sasl_port" =~ ^[0-9]+$ ]] || die "--sasl-port expects a port, got '$sasl_port'"
  [[ "$sasl_user" =~ ^[A-Za-z0-9_.-]+:[^\"]+$ ]] || die "--sasl-port needs --sasl-user NAME:PASSWORD"
fi
for value in "$port" "$partitions" "$decision_partitions"; do
  [[ "$value" =~ ^[0-9]+$ ]] && [ "$value" -gt 0 ] || die "expected a positive integer, got '$value'"
done
[ "$port" -lt 65535 ] || die "port $port is out of range"

version=$(sed -n 's:.*<kafka.version>\(.*\)</kafka.version>.*:\1:p' "$here/pom.xml")
[ -n "$version" ] || die "no <kafka.version> in $here/pom.xml"
libs=$home/$version/libs
data=$home/data-$port
pid_file=$data/broker.pid
address=127.0.0.1:$port

# ---------------------------------------------------------------- helpers

listening() {  # is something accepting TCP connections on 127.0.0.1:$1?
  (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null
}

broker_pid() {  # prints the pid of our broker on $port, if it runs
  local pid
  pid=$(cat "$pid_file" 2>/dev/null) || return 1
  [[ "$pid" =~ ^[0-9]+$ ]] || return 1
  # A recycled pid must not be mistaken for the broker: check what the process is.
  tr '\0' ' ' < "/proc/$pid/cmdline" 2>/dev/null | grep -q -- "kafka.Kafka $data/server.properties" || return 1
  echo "$pid"
}

ensure_jars() {
  [ -f "$libs/.complete" ] && return 0
  command -v mvn >/dev/null || die "Maven (mvn) is needed once to fetch Kafka $version from Maven Central"
  command -v "$java" >/dev/null || die "Java 17+ is needed to run the broker"
  log "fetching Apache Kafka $version and its dependencies from Maven Central (once)"
  mkdir -p "$home/$version"
  # Download beside the final place and rename, so an interrupted fetch is never used.
  local staging
  staging=$(mktemp -d "$home/$version/libs.XXXXXX")
  if ! mvn -q -B -Dstyle.color=never -f "$here/pom.xml" dependency:copy-dependencies \
        -DincludeScope=runtime -DoutputDirectory="$staging" >&2; then
    rm -rf "$staging"
    die "mvn could not resolve org.apache.kafka:kafka_2.13:$version"
  fi
  touch "$staging/.complete"
  rm -rf "$libs"
  mv "$staging" "$libs"
}

write_configs() {  # $1: controller port
  mkdir -p "$data/kraft"
  cat > "$data/server.properties" <<EOF
process.roles=broker,controller
node.id=1
controller.quorum.bootstrap.servers=127.0.0.1:$1
listeners=PLAINTEXT://127.0.0.1:$port,CONTROLLER://127.0.0.1:$1${sasl_port:+,SASL_PLAINTEXT://127.0.0.1:$sasl_port}
advertised.listeners=PLAINTEXT://127.0.0.1:$port${sasl_port:+,SASL_PLAINTEXT://127.0.0.1:$sasl_port}
controller.listener.names=CONTROLLER
inter.broker.listener.name=PLAINTEXT
listener.security.protocol.map=CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT,SASL_PLAINTEXT:SASL_PLAINTEXT
log.dirs=$data/kraft
num.partitions=$partitions
default.replication.factor=1
min.insync.replicas=1
# One node: internal topics cannot have more replicas, and fewer partitions start faster.
offsets.topic.replication.factor=1
offsets.topic.num.partitions=$partitions
transaction.state.log.replication.factor=1
transaction.state.log.min.isr=1
transaction.state.log.num.partitions=$partitions
share.coordinator.state.topic.replication.factor=1
share.coordinator.state.topic.min.isr=1
share.coordinator.state.topic.num.partitions=$partitions
group.initial.rebalance.delay.ms=0
num.network.threads=2
num.io.threads=4
num.recovery.threads.per.data.dir=1
log.retention.hours=24
EOF
  if [ -n "$sasl_port" ]; then
    cat >> "$data/server.properties" <<EOF
listener.name.sasl_plaintext.sasl.enabled.mechanisms=PLAIN
listener.name.sasl_plaintext.plain.sasl.jaas.config=org.apache.kafka.common.security.plain.PlainLoginModule required user_${sasl_user%%:*}="${sasl_user#*:}";
EOF
  fi
  cat > "$data/log4j2.properties" <<EOF
status = warn
appender.file.type = File
appender.file.name = file
appender.file.fileName = $data/server.log
appender.file.layout.type = PatternLayout
appender.file.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = INFO
rootLogger.appenderRef.file.ref = file
logger.kafka-request.name = kafka.request.logger
logger.kafka-request.level = WARN
logger.state-change.name = state.change.logger
logger.state-change.level = WARN
logger.controller.name = org.apache.kafka.controller
logger.controller.level = INFO
EOF
  cat > "$data/tools-log4j2.properties" <<EOF
status = warn
appender.stderr.type = Console
appender.stderr.name = stderr
appender.stderr.target = SYSTEM_ERR
appender.stderr.layout.type = PatternLayout
appender.stderr.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = WARN
rootLogger.appenderRef.stderr.ref = stderr
EOF
}

tool() {  # runs a Kafka command-line tool main class with the cached classpath
  "$java" "${tool_jvm[@]}" -Dlog4j2.configurationFile="$data/tools-log4j2.properties" \
    -cp "$libs/*" "$@"
}

free_port_from() {  # first port >= $1 that nothing listens on
  local p=$1
  while listening "$p"; do p=$((p + 1)); done
  echo "$p"
}

cluster_id() {  # a random Kafka Uuid: 16 bytes, URL-safe base64 without padding
  # An id starting with '-' reads as an option to the storage tool ("expected one
  # argument"): draw again until it does not.
  local id
  while :; do
    id=$(head -c 16 /dev/urandom | base64 | tr '+/' '-_' | cut -c1-22)
    [ "${id:0:1}" != "-" ] && break
  done
  echo "$id"
}

wait_ready() {  # $1: broker pid
  local deadline=$((SECONDS + start_timeout))
  while [ $SECONDS -lt $deadline ]; do
    if ! kill -0 "$1" 2>/dev/null; then
      log "the broker exited during start-up; last lines of $data/server.log:"
      tail -n 30 "$data/server.log" >&2 2>/dev/null || tail -n 30 "$data/jvm.out" >&2 || true
      return 1
    fi
    if grep -q "Kafka Server started" "$data/server.log" 2>/dev/null && listening "$port"; then
      return 0
    fi
    sleep 0.2
  done
  log "the broker did not become ready within ${start_timeout}s; see $data/server.log"
  return 1
}

write_topic_tool() {
  # One JVM creating every missing topic through the admin API takes ~3 s; one
  # TopicCommand JVM per topic took ~10 s on two cores. Java 17 runs a source file as is.
  cat > "$home/$version/EnsureTopics.java" <<'JAVA'
import java.util.*;
import java.util.concurrent.ExecutionException;
import org.apache.kafka.clients.admin.*;
import org.apache.kafka.common.KafkaFuture;
import org.apache.kafka.common.errors.TopicExistsException;

/** Creates the topics named as name:partitions[:compact] that do not exist yet. */
public class EnsureTopics {
  public static void main(String[] args) throws Exception {
    Properties props = new Properties();
    props.put("bootstrap.servers", args[0]);
    props.put("default.api.timeout.ms", "30000");
    try (Admin admin = Admin.create(props)) {
      Set<String> existing = admin.listTopics().names().get();
      List<NewTopic> missing = new ArrayList<>();
      for (int i = 1; i < args.length; i++) {
        String[] spec = args[i].split(":");
        if (existing.contains(spec[0])) continue;
        NewTopic topic = new NewTopic(spec[0], Integer.parseInt(spec[1]), (short) 1);
        if (spec.length > 2 && spec[2].equals("compact")) {
          topic.configs(Map.of("cleanup.policy", "compact",
                               "min.cleanable.dirty.ratio", "0.1",
                               "segment.ms", "600000"));
        }
        missing.add(topic);
      }
      for (Map.Entry<String, KafkaFuture<Void>> entry : admin.createTopics(missing).values().entrySet()) {
        try {
          entry.getValue().get();
        } catch (ExecutionException e) {
          if (!(e.getCause() instanceof TopicExistsException)) throw e;
        }
      }
    }
  }
}
JAVA
}

ensure_topics() {
  local attempt
  write_topic_tool
  # Compacted decisions: the topic is the current decision per scope, read from the start.
  for attempt in 1 2 3 4 5; do
    if tool "$home/$version/EnsureTopics.java" "$address" \
         "specwatch.telemetry:$partitions" "specwatch.partials:$partitions" \
         "specwatch.decisions:$decision_partitions:compact" "specwatch.deadletter:$partitions" \
         2>"$data/topics.err"; then
      log "topics ready: specwatch.telemetry, specwatch.partials, specwatch.decisions (compacted), specwatch.deadletter"
      return 0
    fi
    # Right after start-up the controller may still be settling; that passes in seconds.
    sleep "$attempt"
  done
  log "could not create the specwatch topics:"
  tail -n 20 "$data/topics.err" >&2
  return 1
}

stop_broker() {
  local pid waited=0
  pid=$(broker_pid) || { rm -f "$pid_file"; return 0; }
  log "stopping the broker on $address (pid $pid)"
  kill -TERM "$pid" 2>/dev/null || true
  # A controlled shutdown takes a few seconds; after 30 s it is not coming.
  while kill -0 "$pid" 2>/dev/null; do
    if [ $waited -ge 300 ]; then
      log "the broker did not stop within 30s; killing it"
      kill -KILL "$pid" 2>/dev/null || true
    fi
    sleep 0.1
    waited=$((waited + 1))
  done
  rm -f "$pid_file"
}

start_broker() {
  local pid controller_port started=$SECONDS
  if pid=$(broker_pid); then
    log "a broker already runs on $address (pid $pid)"
    ensure_topics
    echo "$address"
    return 0
  fi
  listening "$port" && die "port $port is taken by another process; choose another with --port"
  ensure_jars
  rm -rf "$data"
  mkdir -p "$data"
  controller_port=$(free_port_from $((port + 1)))
  write_configs "$controller_port"
  log "formatting KRaft storage in $data/kraft"
  tool kafka.tools.StorageTool format --config "$data/server.properties" \
    --cluster-id "$(cluster_id)" --standalone --ignore-formatted >/dev/null \
    || die "could not format KRaft storage in $data/kraft"
  log "starting Apache Kafka $version on $address (controller on 127.0.0.1:$controller_port)"
  launch_broker
  ensure_topics || { stop_broker; exit 1; }
  log "ready in $((SECONDS - started))s"
  echo "$address"
}

launch_broker() {  # runs the JVM on the configured $data and waits until it serves
  local pid
  # setsid: the broker outlives this script and the terminal or test run that started it;
  # it must not inherit the lock descriptor, or the next start/stop would wait on it.
  KAFKA_LOG4J_OPTS="" setsid "$java" $broker_heap -XX:+UseG1GC -XX:MaxGCPauseMillis=20 \
    -Djava.awt.headless=true -Dlog4j2.configurationFile="$data/log4j2.properties" \
    -Dkafka.logs.dir="$data" -cp "$libs/*" kafka.Kafka "$data/server.properties" \
    >> "$data/jvm.out" 2>&1 < /dev/null 9>&- &
  pid=$!
  echo "$pid" > "$pid_file"
  if ! wait_ready "$pid"; then
    stop_broker
    exit 1
  fi
}

resume_broker() {
  local pid started=$SECONDS
  if pid=$(broker_pid); then
    log "a broker already runs on $address (pid $pid)"
    echo "$address"
    return 0
  fi
  [ -f "$data/server.properties" ] || die "no stopped broker to resume on port $port ($data has no server.properties); use start"
  listening "$port" && die "port $port is taken by another process"
  ensure_jars
  log "resuming Apache Kafka $version on $address with the data in $data"
  # readiness is read from server.log: the previous run's "started" line must not count
  mv -f "$data/server.log" "$data/server.log.previous" 2>/dev/null || true
  launch_broker
  log "ready in $((SECONDS - started))s"
  echo "$address"
}

# ---------------------------------------------------------------- main

mkdir -p "$home"
# One start or stop per port at a time: two test runs must not format the same storage.
exec 9> "$home/broker-$port.lock"
flock -w 300 9 || die "another broker.sh holds $home/broker-$port.lock"

case "$command" in
  start) start_broker ;;
  resume) resume_broker ;;
  stop) stop_broker ;;
  status)
    if pid=$(broker_pid); then log "running (pid $pid)"; echo "$address"; else log "not running"; exit 1; fi ;;
  *) log "unknown command $command"; usage ;;
esac
