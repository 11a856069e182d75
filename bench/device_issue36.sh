#!/usr/bin/env bash
# Issue 36's figures on the lent 16-core machine in one device call (about 8 minutes there), from the project's root
# with .bench-bundle carried (bench/device_bundle.py [--baseline REV] here first):
#
#     bash bench/device_issue36.sh            # through the device tool, timeout_s 600
#     QUICK=1 bash bench/device_issue36.sh    # here: the same steps with 2-second runs and 64 MiB, to check the script
#     API=1 bash bench/device_issue36.sh      # a second call: the API at a million sessions on PostgreSQL (about
#                                             # 4 minutes here to seed; QUICK=1 API=1: 20,000 sessions)
#
# The workers against pgbouncer (-c 16 and -c 64), the agent path against the direct gateway (-c 16 TPS, -c 1
# latency), SSH's 1 GiB cat and scp against ProxyJump: each printed with its anchors, as bench/README.md quotes
# them. The bundle is installed once (bench/device_run.sh); the later steps reuse its venv. A step that fails is
# said and the next one runs. With .bench-bundle/before (a baseline), the PostgreSQL rows also run it.
set -u
seconds=4 megabytes=1024 rounds=1
if [ "${QUICK:-}" = 1 ]; then seconds=2 megabytes=64; fi  # 1 s: 64 clients may not all be connected (SCRAM) before it ends
baseline=()  # the bundle's baseline tree, which device_run.sh unpacks (on the lent machine only)
if [ -f .bench-bundle/before.tar.xz ] && [ "${QUICK:-}" != 1 ]; then baseline=(--baseline .bench-bundle/before); fi
step() { echo; echo "=== $* ($(date -u +%H:%M:%S), load $(cut -d' ' -f1-3 /proc/loadavg))"; }

if [ "${API:-}" = 1 ]; then  # GET /api/sessions and /api/audit/logs at a million rows each, store and daemon
  sessions=1000000 python=.venv/bin/python
  if [ "${QUICK:-}" = 1 ]; then sessions=20000; fi
  if [ -d .bench-bundle ] && [ "${QUICK:-}" != 1 ]; then
    step "api: installs the bundle"
    bash bench/device_run.sh postgres --help > /dev/null || echo "step failed: $?"
    python=/tmp/bench-venv/bin/python
    export GATEWAYD_PG_BIN=/opt/pgwrap PATH=/opt/pgwrap:$PATH
  fi
  step "api: ${sessions} sessions and audit entries on PostgreSQL, the store and gatewayd run"
  $python bench/api/bench_scale.py --postgres --sessions "$sessions" --api --runs 20 || echo "step failed: $?"
  step "done"
  exit 0
fi

if [ -d .bench-bundle ] && [ "${QUICK:-}" != 1 ]; then
  step "postgres: workers 1,2,4,8 at -c 16 (installs the bundle)"
  bash bench/device_run.sh postgres --workers 1,2,4,8 --clients 16 --seconds "$seconds" --rounds "$rounds" \
    --runs simple,extended,prepared "${baseline[@]}" || echo "step failed: $?"
  python=/tmp/bench-venv/bin/python
  export GATEWAYD_PG_BIN=/opt/pgwrap PATH=/opt/pgwrap:$PATH
else  # here: this machine's venv and peers
  python=.venv/bin/python
  step "postgres: workers 1,2,4,8 at -c 16"
  $python bench/postgres/bench_postgres.py --workers 1,2,4,8 --clients 16 --seconds "$seconds" --rounds "$rounds" \
    --runs simple,extended,prepared "${baseline[@]}" || echo "step failed: $?"
fi
step "hot path (compiled, or every figure here is the Python source's)"
$python -m launcher.hotpath status || echo "step failed: $?"
step "postgres: how 16 and 64 connections opened at once spread over 4 and 8 workers"
$python bench/postgres/bench_spread.py --workers 4,8 --connections 16,64 --rounds 3 || echo "step failed: $?"
step "postgres: workers 1,4,8 at -c 64"
$python bench/postgres/bench_postgres.py --workers 1,4,8 --clients 64 --seconds "$seconds" --rounds "$rounds" \
  --runs simple "${baseline[@]}" || echo "step failed: $?"
step "postgres: through an agent at -c 16, and the -c 1 latency"
$python bench/postgres/bench_postgres.py --via-agent --clients 16 --seconds "$seconds" --rounds "$rounds" \
  --runs simple,latency || echo "step failed: $?"
step "postgres: through an agent with 4 carrier processes, against the direct gateway, both with 4 workers, -c 16"
GATEWAYD_AGENT_WORKERS=4 $python bench/postgres/bench_postgres.py --via-agent --workers 4 --clients 16 \
  --seconds "$seconds" --rounds "$rounds" --runs simple || echo "step failed: $?"
step "agent: CPU per transaction, gateway and agent (-c 1, -c 16)"
$python bench/postgres/bench_agent.py --rounds 2 --transactions $((seconds * 5000)) --clients 1,16 \
  || echo "step failed: $?"
step "ssh: ${megabytes} MiB cat and scp, gateway against ProxyJump"
$python bench/ssh/bench_ssh.py --megabytes "$megabytes" --runs 2 --connects 3 --transfers cat,scp --no-direct \
  || echo "step failed: $?"
step "done"
