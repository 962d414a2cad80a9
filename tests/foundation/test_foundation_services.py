"""The Redis and PostgreSQL fixtures are real private servers; parallel sessions never collide."""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import psycopg
import redis
from sqlalchemy import create_engine, text

from kvguard.localservices import RunningService, free_port, postgres_server, redis_server


def test_redis_fixture_is_a_real_private_server(
    redis_service: RunningService, redis_url: str
) -> None:
    client = redis.Redis.from_url(redis_url)
    info = client.info("server")
    assert info["redis_version"].split(".")[0].isdigit()
    assert info["tcp_port"] == redis_service.port
    assert redis_service.port != 6379, "must not reuse the machine's standard Redis"
    client.set("kvguard:probe", "1")
    assert client.get("kvguard:probe") == b"1"


def test_redis_is_flushed_between_tests(redis_url: str) -> None:
    assert redis.Redis.from_url(redis_url).get("kvguard:probe") is None


def test_postgres_fixture_is_a_real_private_server(
    postgres_service: RunningService, postgres_url: str
) -> None:
    engine = create_engine(postgres_url)
    with engine.connect() as conn:
        version = conn.execute(text("SELECT version()")).scalar_one()
        port = conn.execute(text("SHOW port")).scalar_one()
        conn.execute(text("CREATE TABLE probe (id int)"))
        conn.commit()
    engine.dispose()
    assert version.startswith("PostgreSQL ")
    assert int(port) == postgres_service.port != 5432


def test_each_test_gets_a_fresh_database(postgres_url: str) -> None:
    engine = create_engine(postgres_url)
    with engine.connect() as conn:
        tables = conn.execute(
            text("SELECT count(*) FROM information_schema.tables WHERE table_name = 'probe'")
        ).scalar_one()
    engine.dispose()
    assert tables == 0


def test_two_sets_of_servers_side_by_side_are_isolated() -> None:
    with (
        redis_server() as r1,
        redis_server() as r2,
        postgres_server() as p1,
        postgres_server() as p2,
    ):
        assert r1.port != r2.port and p1.port != p2.port
        assert r1.data_dir != r2.data_dir and p1.data_dir != p2.data_dir
        redis.Redis.from_url(r1.url).set("k", "one")
        assert redis.Redis.from_url(r2.url).get("k") is None
        dsn1 = {"host": p1.host, "port": p1.port, "user": "postgres", "dbname": "postgres"}
        dsn2 = {"host": p2.host, "port": p2.port, "user": "postgres", "dbname": "postgres"}
        with psycopg.connect(**dsn1, autocommit=True) as conn:
            conn.execute("CREATE DATABASE only_in_one")
        with psycopg.connect(**dsn2) as conn:
            names = {row[0] for row in conn.execute("SELECT datname FROM pg_database")}
        assert "only_in_one" not in names
    assert not r1.data_dir.exists() and not p1.data_dir.exists(), "temp dirs are removed"


def test_two_pytest_sessions_in_parallel_do_not_collide(tmp_path: Path) -> None:
    """Two real pytest sessions at once, each with its own servers, writing the same keys."""
    probe = tmp_path / "test_parallel_probe.py"
    probe.write_text(
        textwrap.dedent(
            """
            import os, time, redis, psycopg
            from sqlalchemy import create_engine, text

            def test_probe(redis_url, postgres_url):
                me = os.environ["PROBE_ID"]
                client = redis.Redis.from_url(redis_url)
                assert client.set("shared-key", me, nx=True)
                engine = create_engine(postgres_url)
                with engine.begin() as conn:
                    conn.execute(text("CREATE TABLE shared_table (who text)"))
                    conn.execute(text("INSERT INTO shared_table VALUES (:w)"), {"w": me})
                time.sleep(1.0)
                assert client.get("shared-key") == me.encode()
                with engine.connect() as conn:
                    rows = conn.execute(text("SELECT who FROM shared_table")).scalars().all()
                engine.dispose()
                assert rows == [me]
            """
        )
    )
    conftest = Path(__file__).resolve().parents[1] / "conftest.py"
    (tmp_path / "conftest.py").write_text(conftest.read_text())
    root = Path(__file__).resolve().parents[2]
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(probe)],
            cwd=tmp_path,
            env={"PROBE_ID": str(i), "PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for i in range(2)
    ]
    outputs = [p.communicate(timeout=120)[0].decode() for p in procs]
    for proc, out in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, out
        assert "1 passed" in out


def test_a_free_port_is_one_no_outgoing_connection_can_take() -> None:
    """A port handed out lies below the kernel's ephemeral range, which outgoing connections
    draw their local ports from: between the pick and the server's bind, no client socket of
    any process can take it. ``kvguard up --profile production-like`` failed with "address
    already in use" when a role bound a port picked in that range."""
    low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == 50
    assert all(not low <= port <= high for port in ports), ports
    for port in ports:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))  # free indeed
