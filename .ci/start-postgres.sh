#!/usr/bin/env bash
# Start the local PostgreSQL cluster if it is not answering (tests use 127.0.0.1:5432).
set -u
if command -v pg_isready >/dev/null && pg_isready -h 127.0.0.1 -p 5432 -q; then exit 0; fi
if command -v pg_ctlcluster >/dev/null; then
  pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql | head -n1)" main start || true
fi
for _ in $(seq 1 30); do
  pg_isready -h 127.0.0.1 -p 5432 -q 2>/dev/null && exit 0
  sleep 1
done
echo "PostgreSQL is not answering on 127.0.0.1:5432" >&2
exit 1
