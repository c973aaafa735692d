"""A real PgBouncer in transaction mode on this machine, in front of a PostgreSQL server on TCP:
what the pooling test and the capacity bench put between API replicas and the primary, as
`deploy/compose.yaml` and the k8s `Pooler` do (docs/scaling.md, "Connection pooling")."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple

import psycopg
from psycopg.conninfo import conninfo_to_dict

from staleflow_cli.launch import free_port

# PgBouncer carries protocol-level prepared statements across server connections from 1.21
PREPARED_SINCE = (1, 21)

CONFIG = """\
[databases]
* = host={host} port={port}

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = {listen}
unix_socket_dir =
auth_type = trust
auth_file = {dir}/users.txt
pool_mode = transaction
default_pool_size = {pool}
max_client_conn = 2000
{prepared}
; psycopg sends the timeouts as `options` (-c ...): behind a pooler they belong on the role
ignore_startup_parameters = extra_float_digits,options
server_reset_query =
admin_users = {user}
logfile = {dir}/pgbouncer.log
pidfile = {dir}/pgbouncer.pid
"""


class Pooler(NamedTuple):
    url: str  # the server's database through the pooler
    pid: int  # the PgBouncer process (its CPU is the server side's too)
    version: tuple[int, int]
    prepared: bool  # keeps prepared statements (else the API runs with STALEFLOW_PREPARED_STATEMENTS=0)


def on_tcp(url: str) -> bool:
    """Whether the libpq URL's server is reached over TCP (a pooler cannot front a socket path here)."""
    host = conninfo_to_dict(url).get("host")
    return bool(host) and not str(host).startswith("/")


def pgbouncer_binary() -> str | None:
    """Debian's `pgbouncer` (apt-get install -y pgbouncer), or None."""
    return shutil.which("pgbouncer") or next(
        (p for p in ("/usr/sbin/pgbouncer", "/usr/bin/pgbouncer") if os.path.exists(p)), None
    )


def pgbouncer_version(binary: str) -> tuple[int, int]:
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, check=True).stdout
    found = re.search(r"PgBouncer (\d+)\.(\d+)", out)
    if not found:
        raise RuntimeError(f"cannot read PgBouncer's version from {out!r}")
    return int(found.group(1)), int(found.group(2))


@contextmanager
def local_pgbouncer(server_url: str, pool_size: int = 4, binary: str | None = None) -> Iterator[Pooler]:
    """A PgBouncer in transaction mode in front of `server_url`'s server (libpq URL, on TCP),
    `pool_size` server connections per database and user, on a free port, with prepared
    statements kept where its version can (`max_prepared_statements` 256); yields `server_url`'s
    database through it, its process and version. Stopped afterwards."""
    binary = binary or pgbouncer_binary()
    if binary is None:
        raise RuntimeError("pgbouncer is not installed (apt-get install -y pgbouncer)")
    if not on_tcp(server_url):
        raise RuntimeError(f"the server is not on TCP: {server_url}")
    server = conninfo_to_dict(server_url)
    user = str(server.get("user") or "postgres")
    listen = free_port()
    # PgBouncer refuses to run as root: then it runs as `nobody`, which must read its files
    workdir = Path(tempfile.mkdtemp(prefix="sf-pgbouncer-"))
    workdir.chmod(0o777)
    (workdir / "users.txt").write_text(f'"{user}" ""\n')
    version = pgbouncer_version(binary)
    prepared = version >= PREPARED_SINCE
    config = workdir / "pgbouncer.ini"
    config.write_text(
        CONFIG.format(
            host=server["host"],
            port=server.get("port") or 5432,
            listen=listen,
            dir=workdir,
            user=user,
            pool=pool_size,
            prepared="max_prepared_statements = 256" if prepared else "",
        )
    )
    for f in workdir.iterdir():
        f.chmod(0o666)
    as_user = ["-u", "nobody"] if os.geteuid() == 0 else []
    proc = subprocess.Popen([binary, *as_user, str(config)], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    url = f"postgresql://{user}@127.0.0.1:{listen}/{server['dbname']}"
    try:
        deadline = time.monotonic() + 30
        while True:  # up once it serves a query
            try:
                with psycopg.connect(url, connect_timeout=2, prepare_threshold=None) as c:
                    c.execute("SELECT 1")
                break
            except psycopg.OperationalError:
                log = workdir / "pgbouncer.log"
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"pgbouncer did not start: {log.read_text() if log.exists() else ''}") from None
                time.sleep(0.1)
        yield Pooler(url, proc.pid, version, prepared)
    finally:
        proc.terminate()
        proc.wait(10)
        shutil.rmtree(workdir, ignore_errors=True)
