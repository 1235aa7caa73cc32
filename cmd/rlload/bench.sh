#!/usr/bin/env bash
# bench.sh: the enforcer's hot path against its two ceilings, on this machine,
# in one process tree, with ratios. Needs redis-server and redis-benchmark on
# PATH and the binaries built (make build).
#
#   cmd/rlload/bench.sh                    # default: 4s per run, 1,000 keys
#   DURATION=10s CALLERS="16 64" cmd/rlload/bench.sh
#   RATELIMITD=/path/to/other/ratelimitd cmd/rlload/bench.sh   # compare a build
#   BATCH=0 CALLERS=16 cmd/rlload/bench.sh  # CheckLimit only (no CheckLimits runs)
#   SOCKET=unix cmd/rlload/bench.sh         # the enforcer and redis-benchmark reach Redis on its Unix socket
#
# It starts one redis-server, one ratelimitd (one token-bucket rule that never
# rejects) and one no-op ratelimit.v1 server (rlload --noop-server), drives the
# enforcer and the no-op with the same load tool (rlload) alternately, and runs
# redis-benchmark with the enforcer's own check script, pipelined. Printed:
# each run's line, then ratios: enforcer / no-op (the gRPC ceiling) in calls/s
# and p99, and enforcer decisions/s / redis-benchmark script calls/s (the
# Redis ceiling). Each run's line also gives the CPU time the server side
# spent per call (the enforcer and Redis together, or the no-op: a figure
# the other load of a shared machine moves less than throughput), the
# checks per Redis read event (how many checks shared one round trip) and
# the script calls per read (the calls of one pipeline share one script
# call, so this stays near 1).
set -euo pipefail

BIN=${BIN:-bin}
RATELIMITD=${RATELIMITD:-$BIN/ratelimitd}
RLLOAD=${RLLOAD:-$BIN/rlload}
DURATION=${DURATION:-4s}
KEYS=${KEYS:-1000}
CALLERS=${CALLERS:-"16 64 256"}
BATCH=${BATCH:-32}
ROUNDS=${ROUNDS:-1}
EXTRA=${EXTRA:-}   # extra ratelimitd flags, e.g. "--timeout 100ms"
LOCAL_BATCH=${LOCAL_BATCH:-0} # the bench rule's local_batch (0: off)
SOCKET=${SOCKET:-tcp} # how the enforcer and redis-benchmark reach Redis: tcp (loopback) or unix
case $SOCKET in tcp | unix) ;; *) echo "SOCKET: want tcp or unix, got $SOCKET" >&2; exit 2 ;; esac

work=$(mktemp -d)
pids=()
cleanup() {
	for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
	wait 2>/dev/null || true
	rm -rf "$work"
}
trap cleanup EXIT

# A free port for redis-server (it cannot take port 0 and report it); a
# port taken meanwhile by another process makes it exit: try another.
for _ in $(seq 5); do
	for _ in $(seq 20); do
		port=$((20000 + RANDOM % 20000))
		if ! (exec 3<>/dev/tcp/127.0.0.1/$port) 2>/dev/null; then break; fi
	done
	redis-server --port "$port" --bind 127.0.0.1 --unixsocket "$work/redis.sock" --unixsocketperm 700 \
		--save '' --appendonly no --dir "$work" --daemonize no --loglevel warning >"$work/redis.log" 2>&1 &
	redis_pid=$!
	for _ in $(seq 200); do
		redis-cli -p "$port" ping >/dev/null 2>&1 && break 2
		kill -0 "$redis_pid" 2>/dev/null || break
		sleep 0.05
	done
	kill "$redis_pid" 2>/dev/null || true
done
pids+=("$redis_pid")
redis-cli -p "$port" ping >/dev/null || { echo "redis-server did not start:" >&2; cat "$work/redis.log" >&2; exit 1; }

cat >"$work/rules.json" <<EOF
[{"id":"bench","match":{"resource":"GET /bench"},"algorithm":"token_bucket","capacity":100000000,"refill_per_second":100000000,"local_batch":$LOCAL_BATCH}]
EOF

# wait_ready FILE: the address in the "ready grpc=ADDR" line a server prints.
wait_ready() {
	for _ in $(seq 200); do
		if a=$(grep -o 'ready grpc=[^ ]*' "$1" 2>/dev/null | head -1); then
			[ -n "$a" ] && { echo "${a#ready grpc=}"; return; }
		fi
		sleep 0.05
	done
	echo "no ready line in $1:" >&2; cat "$1" >&2; exit 1
}

redis_addr="127.0.0.1:$port" redis_to=(-p "$port")
if [ "$SOCKET" = unix ]; then redis_addr="unix://$work/redis.sock" redis_to=(-s "$work/redis.sock"); fi

# shellcheck disable=SC2086
"$RATELIMITD" --region bench --redis-addr "$redis_addr" --grpc-addr 127.0.0.1:0 --http-addr 127.0.0.1:0 \
	--rules "$work/rules.json" --log-level warn $EXTRA >"$work/rl.out" 2>"$work/rl.err" &
pids+=($!)
rl_pid=$!
rl=$(wait_ready "$work/rl.out")
"$RLLOAD" --noop-server 127.0.0.1:0 >"$work/noop.out" 2>&1 &
pids+=($!)
noop_pid=$!
noop=$(wait_ready "$work/noop.out")

# us DURATION: a Go duration (850µs, 1.2ms, 2s) in microseconds.
us() { awk -v d="$1" 'BEGIN { n = d + 0; if (d ~ /µs$/) print n; else if (d ~ /ms$/) print n * 1000; else if (d ~ /ns$/) print n / 1000; else print n * 1000000 }'; }
field() { grep -o "$1=[^ /]*" <<<"$2" | head -1 | cut -d= -f2; }

# cpu PID...: CPU time (user + system) of the processes so far, in clock ticks.
cpu() { local t=0 p; for p in "$@"; do t=$((t + $(awk '{print $14 + $15}' "/proc/$p/stat"))); done; echo "$t"; }
# redis_stat NAME: a counter of INFO stats or commandstats (EVALSHA calls).
redis_stat() {
	redis-cli -p "$port" info all | tr -d '\r' | awk -F'[:=,]' -v k="$1" '$1 == k { v = $2 } $1 == "cmdstat_" k { v = $3 } END { print v + 0 }'
}
TCK=$(getconf CLK_TCK)
# csw PID: the process's context switches so far (voluntary + nonvoluntary,
# every thread's, from /proc/PID/task/*/status): a figure per call that the
# machine's other load hardly moves.
csw() { cat /proc/"$1"/task/*/status 2>/dev/null | awk '/^(non)?voluntary_ctxt_switches/ { t += $2 } END { print t + 0 }'; }

# load NAME ADDR CALLERS BATCH PID...: one rlload run; sets calls, decisions,
# p99, failopen, rejected (the bench rule never rejects: each rejection is
# a shed answer, the enforcer's overload policy), cpucall (µs of CPU per call of the server processes PID...:
# the enforcer and Redis, or the no-op; each one's part too), perread (checks
# per read event of Redis: how many checks shared a round trip) and
# scriptsread (script calls per read event).
load() {
	local out name=$1 addr=$2 callers=$3 batch=$4 c0 r0 e0 requests s0
	shift 4
	s0=$(csw "$1")
	local -a c0s=()
	for p in "$@"; do c0s+=("$(cpu "$p")"); done
	c0=$(cpu "$@"); r0=$(redis_stat total_reads_processed); e0=$(redis_stat evalsha)
	out=$("$RLLOAD" --addr "$addr" --concurrency "$callers" --duration "$DURATION" --keys "$KEYS" --batch "$batch")
	calls=$(field throughput "$out"); decisions=$(field decisions "$out"); p99=$(us "$(field p99 "$out")")
	failopen=$(field fail_open "$out"); errors=$(field errors "$out"); requests=$(field requests "$out"); rejected=$(field rejected "$out")
	cpucall=$(awk -v t=$(($(cpu "$@") - c0)) -v n="$requests" -v hz="$TCK" 'BEGIN { if (n > 0) printf "%.1f", t * 1e6 / hz / n; else print "n/a" }')
	cpuparts="" # each process's share when there are several (the enforcer, Redis)
	if [ $# -gt 1 ]; then
		local i=0
		for p in "$@"; do
			cpuparts+=$(awk -v t=$(($(cpu "$p") - c0s[i])) -v n="$requests" -v hz="$TCK" 'BEGIN { if (n > 0) printf "%.1f", t * 1e6 / hz / n }')
			i=$((i + 1)); [ $i -lt $# ] && cpuparts+="+"
		done
		cpuparts=" ($cpuparts)"
	fi
	cswcall=$(awk -v s=$(($(csw "$1") - s0)) -v n="$requests" 'BEGIN { if (n > 0) printf "%.2f", s / n; else print "n/a" }')
	local reads=$(($(redis_stat total_reads_processed) - r0)) scripts=$(($(redis_stat evalsha) - e0))
	# checks: the calls times the batch (a CheckLimit is one check).
	perread=$(awk -v n="$requests" -v b="$batch" -v r="$reads" -v e="$scripts" 'BEGIN { if (r > 0 && e > 0) printf "%.1f", n * (b > 0 ? b : 1) / r; else print "-" }')
	scriptsread=$(awk -v e="$scripts" -v r="$reads" 'BEGIN { if (r > 0 && e > 0) printf "%.1f", e / r; else print "-" }')
	printf '%-9s callers=%-4s batch=%-3s calls/s=%-8s decisions/s=%-9s p99=%sus fail_open=%s shed=%s errors=%s cpu/call=%sus%s csw/call=%s checks/read=%s scripts/read=%s\n' \
		"$name" "$callers" "$batch" "$calls" "$decisions" "$p99" "$failopen" "$rejected" "$errors" "$cpucall" "$cpuparts" "$cswcall" "$perread" "$scriptsread"
}

# The Redis ceiling: the same script, pipelined (-P 16), 64 connections;
# measured again in each round of CheckLimits, next to the run it is
# compared with (the machine's other load moves it too).
SHA=$(redis-cli -p "$port" SCRIPT LOAD "$("$RLLOAD" --print-script)")
redis_ceiling() {
	rb=$(redis-benchmark "${redis_to[@]}" -c 64 -n 300000 -P 16 -r "$KEYS" -q \
		EVALSHA "$SHA" 1 'rl:{bench:__rand_int__}:bench' 1 '' 1000 1 100000000000 100000000000 0 | tr '\r' '\n' | grep -o '[0-9.]* requests per second' | tail -1 | cut -d' ' -f1)
	echo "redis-benchmark EVALSHA (same script, -c 64 -P 16, $SOCKET): ${rb} calls/s"
}
redis_ceiling

ratio() { awk -v a="$1" -v b="$2" 'BEGIN { if (b > 0) printf "%.2f", a / b; else print "n/a" }'; }
summary=()
run_pair() { # CALLERS BATCH
	local rc rd rp nc np
	for _ in $(seq "$ROUNDS"); do
		if [ "$2" -gt 0 ]; then redis_ceiling; fi
		load enforcer "$rl" "$1" "$2" "$rl_pid" "$redis_pid"; rc=$calls; rd=$decisions; rp=$p99; fo=$failopen; sh=$rejected; ru=$cpucall; rs=$cswcall
		load noop "$noop" "$1" "$2" "$noop_pid"; nc=$calls; np=$p99; nu=$cpucall; ns=$cswcall
		summary+=("callers=$1 batch=$2: enforcer/no-op calls $(ratio "$rc" "$nc"), p99 $(ratio "$rp" "$np")x, decisions/redis-benchmark $(ratio "$rd" "$rb"), fail_open=$fo, shed=$sh, csw/call=$rs/$ns, CPU per call enforcer+Redis/no-op $(ratio "$ru" "$nu")")
	done
}
for c in $CALLERS; do run_pair "$c" 0; done
if [ "$BATCH" -gt 0 ]; then run_pair 16 "$BATCH"; fi # BATCH=0: CheckLimit only

echo
echo "ratios (same run, same machine):"
printf '  %s\n' "${summary[@]}"
if [ "$ROUNDS" -gt 1 ]; then
	echo
	echo "medians over $ROUNDS rounds (fail_open and shed: the sums):"
	printf '%s\n' "${summary[@]}" | awk '
		function med(s,   a, n, i, j, t) { n = split(s, a, " "); for (i = 2; i <= n; i++) for (j = i; j > 1 && a[j-1] + 0 > a[j] + 0; j--) { t = a[j]; a[j] = a[j-1]; a[j-1] = t }
			return n % 2 ? a[(n+1)/2] : sprintf("%.2f", (a[n/2] + a[n/2+1]) / 2) }
		{ k = $1 " " $2; if (!(k in seen)) { seen[k] = 1; keys[++nk] = k }
		  calls[k] = calls[k] " " $5; p99[k] = p99[k] " " $7; rb[k] = rb[k] " " $9; sub(/,/, "", $10); split($10, f, "="); fo[k] += f[2]; sub(/,/, "", $11); split($11, f, "="); sd[k] += f[2]; sub(/,/, "", $12); split($12, f, "[=/]"); csw[k] = csw[k] " " f[3]; nsw[k] = nsw[k] " " f[4]; cpu[k] = cpu[k] " " $NF }
		END { for (i = 1; i <= nk; i++) { k = keys[i]; gsub(/,/, "", calls[k]); gsub(/[x,]/, "", p99[k]); gsub(/,/, "", rb[k])
			printf "  %s enforcer/no-op calls %s, p99 %sx, decisions/redis-benchmark %s, fail_open=%d, shed=%d, ctxt switches per call enforcer %s no-op %s, CPU per call enforcer+Redis/no-op %s\n", k, med(calls[k]), med(p99[k]), med(rb[k]), fo[k], sd[k], med(csw[k]), med(nsw[k]), med(cpu[k]) } }'
fi
if [ -s "$work/rl.err" ]; then
	echo
	echo "ratelimitd said (last lines):"
	tail -5 "$work/rl.err"
fi
