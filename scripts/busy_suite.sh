#!/usr/bin/env bash
# The suite next to a busy core: starts a one-core busy loop, runs `make test` (the complete suite, as CI
# does), stops the loop, and exits with the suite's status. The suite must pass like this: its timeouts are
# hang guards (tests/support/timeouts.py), not speed checks.
#
#   bash scripts/busy_suite.sh [make test ARGS...]        e.g. bash scripts/busy_suite.sh ARGS='-m "not slow"'
#
# TRANSFORMERS_CB_TEST_TIMEOUT_SCALE multiplies every hang guard (default 1: one busy core must not need more).
set -uo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

python3 -c "while True: pass" &
busy=$!
trap 'kill "$busy" 2>/dev/null; wait "$busy" 2>/dev/null' EXIT
echo "busy_suite: busy loop pid $busy on one core; running make test $*"

start=$(date +%s)
make test "$@"
rc=$?
echo "busy_suite: make test exited $rc after $(( $(date +%s) - start )) s next to a busy core"
exit "$rc"
