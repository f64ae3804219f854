"""`hivenet-router`: serve, check-policy, check-auth, hash-key, keygen, identity, token,
explain."""

from __future__ import annotations

import argparse
import logging
import os
import socket
import stat
import sys
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from protocol.collector import tune_collector
from protocol.durations import parse_duration
from protocol.logs import FORMATS, setup_logging
from protocol.secrets import load_previous_secret, load_secret
from protocol.upstream_flags import Ignored, add_ignored, warn_ignored
from router.explain_cli import add_explain, cmd_explain
from router.http.client_ip import TrustedProxies
from router.settings import CONFIG_ERROR, RouterSettings, env_value, parse_on_off, split_hostport

if TYPE_CHECKING:
    from router.policy.schema import Policy

# The Go router's serve flags with no meaning on a libp2p-only router: accepted, each
# named in one warning line at start (protocol/upstream_flags.py).
IGNORED: tuple[Ignored, ...] = (
    Ignored(
        "--grpc-port",
        "HIVENET_ROUTER_GRPC_PORT",
        "no gRPC port is opened: agents authenticate in the hello of their libp2p session"
        " on --p2p-port (open it to the agents)",
    ),
    Ignored(
        "--session-ttl",
        "HIVENET_ROUTER_SESSION_TTL",
        "there is no gRPC session token: each agent proves itself with its JWT in the hello"
        " of every libp2p session; its lifetime is the token's (`hivenet-router token --ttl`)",
    ),
)


def _env(name: str, default: str) -> str:
    return os.environ.get(name) or default


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hivenet-router")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the router daemon")
    serve.add_argument("--http-port", default=_env("HIVENET_ROUTER_HTTP_PORT", ":8080"))
    serve.add_argument("--metrics-port", default=_env("HIVENET_ROUTER_METRICS_PORT", ":2112"))
    serve.add_argument("--p2p-port", type=int, default=None, help="default 9000")
    serve.add_argument(
        "--p2p-ws-port", type=int, default=0, help="libp2p WebSocket port (0: no WebSocket)"
    )
    serve.add_argument(
        "--p2p-wss-port", type=int, default=0, help="libp2p WebSocket-over-TLS port (0: none)"
    )
    serve.add_argument("--tls-cert-file", default=None, help="PEM certificate chain for /wss")
    serve.add_argument("--tls-key-file", default=None, help="PEM private key for /wss")
    serve.add_argument("--p2p-listen-addr", default="127.0.0.1")
    serve.add_argument("--p2p-announce-addr", default=None)
    serve.add_argument("--identity-path", default="./router_identity.key")
    serve.add_argument(
        "--policy-file", default=os.environ.get("HIVENET_ROUTER_POLICY_FILE") or None
    )
    serve.add_argument(
        "--policy-model-dir",
        default=os.environ.get("HIVENET_ROUTER_POLICY_MODEL_DIR") or None,
        help="_default.yaml and per-model policy files; reloaded on SIGHUP",
    )
    # Defaults of flags that also read a variable are resolved in settings_from, so a
    # bad value names the variable it came from.
    serve.add_argument("--max-tries-per-step", type=int, default=None, help="default 3")
    serve.add_argument("--queue-depth", type=int, default=None, help="default 30")
    serve.add_argument(
        "--queue-size",
        type=int,
        default=None,
        help="requests that may wait for a --max-concurrent slot; default 100",
    )
    serve.add_argument(
        "--max-concurrent",
        type=int,
        default=0,
        help="router-wide forwards in flight (0: only the agents' capacity bounds them)",
    )
    serve.add_argument("--request-timeout", type=parse_duration, default=None, help="default 60s")
    serve.add_argument(
        "--idempotency-window",
        type=parse_duration,
        default=None,
        help="replay an answer to a retry with its Idempotency-Key for this long; 0s: off"
        " (default 60s)",
    )
    serve.add_argument(
        "--health-check-interval",
        type=parse_duration,
        default="1s",
        help="longest pause between passes over the agent table",
    )
    serve.add_argument(
        "--p2p-max-conns-per-ip",
        type=int,
        default=None,
        help="libp2p connections per source IPv4 /32 or IPv6 /56; default 32",
    )
    serve.add_argument(
        "--http-write-timeout",
        type=parse_duration,
        default=_env("HIVENET_ROUTER_HTTP_WRITE_TIMEOUT", "30s"),
        help="close a client connection whose write makes no progress this long",
    )
    serve.add_argument("--heartbeat-interval", type=parse_duration, default="5s")
    serve.add_argument("--unhealthy-after", type=parse_duration, default="15s")
    serve.add_argument("--remove-after", type=parse_duration, default="30s")
    serve.add_argument("--max-unjoined-per-ip", type=int, default=64)
    serve.add_argument(
        "--drain-delay",
        type=parse_duration,
        default=_env("HIVENET_ROUTER_DRAIN_DELAY", "5s"),
        help="on SIGTERM: fail /health but keep serving this long, so load balancers"
        " take the router out, before the HTTP listener closes (0s: close at once)",
    )
    serve.add_argument(
        "--health-min-agents",
        type=int,
        default=int(_env("HIVENET_ROUTER_HEALTH_MIN_AGENTS", "0")),
        help="GET /health answers 503 while fewer agents than this are routable"
        " (behind a load balancer: 1, so a restarted router waits for its agents)",
    )
    serve.add_argument(
        "--drain-timeout",
        type=parse_duration,
        default=_env("HIVENET_ROUTER_DRAIN_TIMEOUT", "30s"),
        help="after the listener closes, how long in-flight requests may run",
    )
    serve.add_argument("--failure-cooldown", type=parse_duration, default="30s")
    serve.add_argument("--stream-slot-release", choices=("head", "end"), default="head")
    serve.add_argument("--jwt-secret-file", default=None)
    serve.add_argument(
        "--jwt-secret-previous-file",
        default=None,
        help="a rotation's previous secret, still accepted (HIVENET_ROUTER_JWT_SECRET_PREVIOUS)",
    )
    serve.add_argument(
        "--auth-file",
        default=os.environ.get("HIVENET_ROUTER_AUTH_FILE") or None,
        help="tenants, hashed keys and limits (YAML); reloaded on SIGHUP",
    )
    serve.add_argument(
        "--auth-config-file",
        default=os.environ.get("HIVENET_ROUTER_AUTH_CONFIG") or None,
        help="the Go router's name for --auth-file (either file shape)",
    )
    serve.add_argument(
        "--state-url",
        default=os.environ.get("HIVENET_ROUTER_STATE_URL") or None,
        help="redis://host:port/db, or redis+sentinel://host:port[,host:port...]/master for a"
        " primary that Sentinel fails over: tenant counts, keys and policies shared by"
        " several routers",
    )
    serve.add_argument(
        "--audit-log",
        default=os.environ.get("HIVENET_ROUTER_AUDIT_LOG")
        or os.environ.get("HIVENET_ROUTER_AUDIT_LOG_PATH")
        or None,
        help="JSON-lines audit log, one line per request (no prompt text)",
    )
    serve.add_argument(
        "--history-path",
        default=None,
        help="SQLite file of per-agent lifetime stats (default: router_history.sqlite3 "
        "beside --identity-path)",
    )
    serve.add_argument(
        "--trusted-proxies",
        default=os.environ.get("HIVENET_ROUTER_TRUSTED_PROXIES") or "",
        help="CIDRs of the proxies in front of the router (10.0.0.0/8,::1): their"
        " X-Forwarded-For or X-Real-IP names the client in audit lines; default none",
    )
    serve.add_argument(
        "--metrics-compat",
        choices=("", "upstream"),
        default=os.environ.get("HIVENET_ROUTER_METRICS_COMPAT") or "",
        help="upstream: /metrics also carries the Go router's series (names, labels, units)",
    )
    serve.add_argument("--audit-log-max-bytes", type=int, default=100 * 1024 * 1024)
    serve.add_argument("--audit-log-backups", type=int, default=5)
    serve.add_argument(
        "--disk-db-path",
        default=os.environ.get("HIVENET_ROUTER_DISK_DB_PATH") or None,
        help="directory for the per-agent history file (the Go router's flag; --history-path"
        " names the file itself)",
    )
    serve.add_argument("--disk-db-ttl", type=int, default=30, help="days; 0 keeps entries")
    serve.add_argument("--universal-flush-interval", type=parse_duration, default="5s")
    serve.add_argument(
        "--reset-disk-db", action="store_true", help="start with an empty per-agent history"
    )
    serve.add_argument(
        "--no-ui",
        action="store_true",
        help="no operator console at /ui and no recent-requests ring (HIVENET_ROUTER_UI=off)",
    )
    add_ignored(serve, IGNORED)
    serve.add_argument(
        "--log-format", choices=FORMATS, default=None, help="text (key=value) or json lines"
    )
    serve.add_argument(
        "--workers",
        type=int,
        default=int(_env("HIVENET_ROUTER_WORKERS", "1")),
        help="router processes on this host, sharing the HTTP port (one per core)",
    )
    # Set by the --workers supervisor on each worker it starts.
    serve.add_argument("--worker-index", type=int, default=0, help=argparse.SUPPRESS)
    serve.add_argument("--worker-count", type=int, default=1, help=argparse.SUPPRESS)
    serve.add_argument("--supervisor-fd", type=int, default=None, help=argparse.SUPPRESS)
    serve.add_argument("--worker-wait-agents", action="store_true", help=argparse.SUPPRESS)
    serve.add_argument("--listen-fd", type=int, default=None, help=argparse.SUPPRESS)

    check = sub.add_parser(
        "check-policy",
        help="validate a policy file, or a --policy-model-dir directory, and print its chains",
    )
    check.add_argument("file")
    check.add_argument("--max-tries-per-step", type=int, default=3)

    check_auth = sub.add_parser("check-auth", help="validate an auth file and list its tenants")
    check_auth.add_argument("file")

    hash_key = sub.add_parser(
        "hash-key", help="print a new client key and the hash the auth file stores"
    )
    hash_key.add_argument(
        "--stdin", action="store_true", help="hash a key read from standard input instead"
    )

    keygen = sub.add_parser(
        "keygen", help="print a new client key, its hash and a ready auth.yaml entry"
    )
    keygen.add_argument("--tenant", default="my-tenant", help="the entry's owner (tenant)")

    ident = sub.add_parser("identity", help="create the key if missing; print the peer ID")
    ident.add_argument("--identity-path", default="./router_identity.key")
    ident.add_argument("--p2p-listen-addr", default="127.0.0.1")
    ident.add_argument("--p2p-port", type=int, default=None, help="default 9000")
    ident.add_argument("--p2p-announce-addr", default=None)

    add_explain(sub)

    token = sub.add_parser("token", help="print an agent JWT signed with the shared secret")
    token.add_argument("--peer-id", required=True)
    token.add_argument("--ttl", type=parse_duration, default="24h")
    token.add_argument("--jwt-secret-file", default=None)
    return parser


def settings_from(args: argparse.Namespace) -> RouterSettings:
    env = os.environ
    if args.auth_file and args.auth_config_file and args.auth_file != args.auth_config_file:
        raise ValueError("--auth-file and --auth-config-file name different files: keep one")

    def pick(value: Any, name: str, convert: Callable[[str], Any], default: str) -> Any:
        return value if value is not None else env_value(env, name, convert, default)

    s = RouterSettings(
        http_addr=split_hostport(args.http_port),
        metrics_addr=split_hostport(args.metrics_port),
        p2p_port=pick(args.p2p_port, "P2P_PORT", int, "9000"),
        p2p_ws_port=args.p2p_ws_port,
        p2p_wss_port=args.p2p_wss_port,
        tls_cert_file=args.tls_cert_file,
        tls_key_file=args.tls_key_file,
        p2p_listen_addr=args.p2p_listen_addr,
        p2p_announce_addr=announce_addr(args.p2p_announce_addr),
        identity_path=args.identity_path,
        policy_file=args.policy_file,
        policy_model_dir=args.policy_model_dir,
        max_tries_per_step=pick(args.max_tries_per_step, "MAX_TRIES_PER_STEP", int, "3"),
        queue_depth=pick(args.queue_depth, "QUEUE_DEPTH", int, "30"),
        queue_size=pick(args.queue_size, "QUEUE_SIZE", int, "100"),
        max_concurrent=args.max_concurrent,
        request_timeout=pick(args.request_timeout, "REQUEST_TIMEOUT", parse_duration, "60s"),
        idempotency_window=pick(
            args.idempotency_window, "IDEMPOTENCY_WINDOW", parse_duration, "60s"
        ),
        health_check_interval=args.health_check_interval,
        p2p_max_conns_per_ip=pick(args.p2p_max_conns_per_ip, "P2P_MAX_CONNS_PER_IP", int, "32"),
        http_write_timeout=args.http_write_timeout,
        heartbeat_interval=args.heartbeat_interval,
        unhealthy_after=args.unhealthy_after,
        remove_after=args.remove_after,
        max_unjoined_per_ip=args.max_unjoined_per_ip,
        drain_delay=args.drain_delay,
        health_min_agents=args.health_min_agents,
        drain_timeout=args.drain_timeout,
        failure_cooldown=args.failure_cooldown,
        stream_slot_release=args.stream_slot_release,
        jwt_secret=load_secret(args.jwt_secret_file),
        jwt_secret_previous=load_previous_secret(args.jwt_secret_previous_file),
        jwt_secret_file=args.jwt_secret_file,
        jwt_secret_previous_file=args.jwt_secret_previous_file,
        auth_file=args.auth_file or args.auth_config_file,
        disk_db_path=args.disk_db_path,
        disk_db_ttl=args.disk_db_ttl,
        universal_flush_interval=args.universal_flush_interval,
        reset_disk_db=args.reset_disk_db,
        state_url=args.state_url,
        audit_log=args.audit_log,
        audit_log_max_bytes=args.audit_log_max_bytes,
        audit_log_backups=args.audit_log_backups,
        trusted_proxies=args.trusted_proxies,
        metrics_compat=args.metrics_compat,
        history_path=args.history_path,
        worker_index=args.worker_index,
        worker_count=args.worker_count,
        supervisor_fd=args.supervisor_fd,
        listen_fd=args.listen_fd,
        worker_wait_agents=args.worker_wait_agents,
    )
    if s.worker_count > 1:
        _as_worker(s)
    s.apply_environment(env)
    s.ui = not args.no_ui and env_value(env, "UI", parse_on_off, "on")
    if s.auth_file and s.client_api_keys.strip():
        raise ValueError(
            "both --auth-file and HIVENET_ROUTER_API_KEYS are set: keep one (the auth file"
            " holds the keys and the tenants)"
        )
    TrustedProxies.parse(s.trusted_proxies)  # a bad entry stops the router, named
    if s.metrics_compat not in ("", "upstream"):
        raise ValueError(
            f"HIVENET_ROUTER_METRICS_COMPAT={s.metrics_compat!r}: must be upstream or empty"
        )
    if s.audit_log_max_bytes < 1024 or s.audit_log_backups < 0:
        raise ValueError("--audit-log-max-bytes must be at least 1024, --audit-log-backups >= 0")
    if s.p2p_wss_port and not (s.tls_cert_file and s.tls_key_file):
        raise ValueError("--p2p-wss-port needs --tls-cert-file and --tls-key-file")
    if (s.tls_cert_file or s.tls_key_file) and not s.p2p_wss_port:
        raise ValueError("--tls-cert-file and --tls-key-file are for --p2p-wss-port: set it")
    if s.p2p_wss_port and s.p2p_ws_port:
        # py-libp2p 0.8.1 gives every WebSocket listener of a host the same TLS context.
        raise ValueError("--p2p-ws-port and --p2p-wss-port cannot both be set: choose one")
    if s.max_unjoined_per_ip < 1:
        raise ValueError("--max-unjoined-per-ip must be at least 1")
    if s.http_write_timeout <= 0:
        raise ValueError("--http-write-timeout must be positive")
    if s.max_tries_per_step < 1:
        raise ValueError("--max-tries-per-step must be at least 1")
    for flag, value, low in (
        ("--queue-depth", s.queue_depth, 0),
        ("--queue-size", s.queue_size, 1),
        ("--max-concurrent", s.max_concurrent, 0),
        ("--p2p-max-conns-per-ip", s.p2p_max_conns_per_ip, 1),
        ("--disk-db-ttl", s.disk_db_ttl, 0),
        ("--health-min-agents", s.health_min_agents, 0),
    ):
        if value < low:
            raise ValueError(f"{flag} must be at least {low}, got {value}")
    if not 0 < s.heartbeat_interval < s.unhealthy_after < s.remove_after:
        # Upstream leaves a mis-ordered set running (its docs say so); here it is an error.
        raise ValueError(
            "need --heartbeat-interval < --unhealthy-after < --remove-after, got"
            f" {s.heartbeat_interval:g}s, {s.unhealthy_after:g}s, {s.remove_after:g}s"
        )
    if s.health_check_interval <= 0 or s.request_timeout <= 0 or s.universal_flush_interval <= 0:
        raise ValueError(
            "--health-check-interval, --request-timeout and --universal-flush-interval"
            " must be positive"
        )
    if s.auth_mode == "api-key" and not s.auth_file and not s.client_api_keys.strip():
        raise ValueError(
            "HIVENET_ROUTER_AUTH_MODE=api-key needs keys: an auth file (--auth-config-file)"
            " or HIVENET_ROUTER_API_KEYS"
        )
    if s.jwt_secret_previous == s.jwt_secret:
        s.jwt_secret_previous = b""
    if s.auth_mode == "dynamic" and not s.auth_file and s.client_api_keys.strip():
        raise ValueError("HIVENET_ROUTER_AUTH_MODE=dynamic but HIVENET_ROUTER_API_KEYS is set")
    if s.auth_mode == "dynamic" and not s.auth_file and not s.admin_api_keys:
        raise ValueError(
            "HIVENET_ROUTER_AUTH_MODE=dynamic needs HIVENET_ROUTER_ADMIN_API_KEYS: the"
            " /admin/api-keys endpoints hold the client keys"
        )
    if not s.admin_api_keys and not s.allow_insecure_admin:
        raise ValueError(
            "HIVENET_ROUTER_ADMIN_API_KEYS is empty: set admin keys, or "
            "HIVENET_ROUTER_ALLOW_INSECURE_ADMIN=true to run the admin API without them"
        )
    if s.supervisor_fd is not None and not _is_socket(s.supervisor_fd):
        raise ValueError(f"--supervisor-fd {s.supervisor_fd} is not an open socket")
    if s.listen_fd is not None:
        if not _is_socket(s.listen_fd):
            raise ValueError(f"--listen-fd {s.listen_fd} is not an open socket")
        # The port the supervisor bound (the first free one, for port 0).
        with socket.socket(fileno=os.dup(s.listen_fd)) as sock:
            s.http_addr = (s.http_addr[0], sock.getsockname()[1])
    return s


def _is_socket(fd: int) -> bool:
    try:
        return stat.S_ISSOCK(os.fstat(fd).st_mode)
    except (OSError, OverflowError):
        return False


def _as_worker(s: RouterSettings) -> None:
    """Worker i of a `--workers` host: ports moved up by i, its own identity and
    per-agent history; worker 0 names the others in its welcome
    (router/fleet/workers.py)."""
    from router.fleet.workers import worker_identity_path, worker_peers
    from router.lifetime import history_path

    i = s.worker_index
    if not 0 <= i < s.worker_count:
        raise ValueError(f"--worker-index {i} is outside 0..{s.worker_count - 1}")
    if i == 0:
        s.workers = worker_peers(s.identity_path, s.p2p_port, s.worker_count)
    # Every agent has a session with each worker, and each worker counts its own: in
    # one shared file their rows overwrote each other's, and one worker's
    # --reset-disk-db deleted the file under the others.
    s.history_path = worker_identity_path(history_path(s), i)
    s.identity_path = worker_identity_path(s.identity_path, i)
    s.p2p_port += i
    s.p2p_ws_port += i if s.p2p_ws_port else 0
    s.p2p_wss_port += i if s.p2p_wss_port else 0
    host, port = s.metrics_addr
    s.metrics_addr = (host, port + i if port else 0)


def cmd_serve(args: argparse.Namespace) -> int:
    import trio

    from router.app import RouterDaemon
    from router.fleet.shared_port import bind_shared
    from router.fleet.workers import MAX_WORKERS, Supervisor

    if args.worker_count == 1:  # a --workers worker: its supervisor has said it
        warn_ignored(logging.getLogger("router"), args, os.environ, IGNORED)
    try:
        if args.workers < 1 or args.workers > MAX_WORKERS:
            raise ValueError(f"--workers must be 1 to {MAX_WORKERS}, got {args.workers}")
        if args.workers > 1:
            # Checked once here, so a bad flag exits 2 before any worker starts; the
            # identities are made here too, never by two workers at once.
            args.worker_count = args.workers
            http_addr = settings_from(args).http_addr
            try:
                listeners = bind_shared(http_addr, args.workers)
            except OSError as exc:  # a port in use may be free on the next start
                where = f"{http_addr[0]}:{http_addr[1]}"
                print(f"hivenet-router: cannot listen on {where}: {exc}", file=sys.stderr)
                return 1
            return trio.run(Supervisor(args.serve_argv, listeners).run)
        settings = settings_from(args)
        daemon = RouterDaemon(settings)
    except Exception as exc:  # every startup problem ends here with its reason
        print(f"hivenet-router: {exc}", file=sys.stderr)
        return CONFIG_ERROR
    tune_collector()
    trio.run(daemon.run)
    return 0


def _invalid(path: str, noun: str, errors: list[str]) -> int:
    """A check command's verdict on an invalid document: every problem, exit 1."""
    print(f"{path}: invalid {noun}", file=sys.stderr)
    for error in errors:
        print(f"  - {error}", file=sys.stderr)
    return 1


def cmd_check_policy(args: argparse.Namespace) -> int:
    from router.policy.schema import PolicyError, load_policy_file

    if os.path.isdir(args.file):
        return _check_policy_dir(args)
    try:
        policy = load_policy_file(args.file)
    except PolicyError as exc:
        return _invalid(args.file, "policy", exc.errors)
    except OSError as exc:
        print(f"{args.file}: {exc}", file=sys.stderr)
        return 1
    print(_described(policy, args.max_tries_per_step), end="")
    return 0


def _described(policy: Policy, max_tries: int | None) -> str:
    """A policy as `check-policy` prints it: its chain, then its warnings."""
    from router.policy.describe import describe, policy_warnings

    warnings = "".join(f"warning: {w}\n" for w in policy_warnings(policy))
    return describe(policy, max_tries) + warnings


def _check_policy_dir(args: argparse.Namespace) -> int:
    """`check-policy DIR`: each document that loads, under its name and the global one
    first, as a file's check prints it; then every problem --policy-model-dir would stop
    the router with."""
    from router.policy.models import check_directory

    try:
        checked = check_directory(args.file)
    except OSError as exc:
        print(f"{args.file}: {exc}", file=sys.stderr)
        return 1
    documents = [(name, doc.policy) for name, doc in sorted(checked.policies.named.items())]
    sections: list[str] = []
    if checked.default is not None:
        documents.insert(0, ("_default", checked.default))
    elif not checked.errors:
        sections.append(
            "== _default: none (the global policy is --policy-file's or the built-in one)\n"
        )
    for name, policy in documents:
        kind = "the global policy" if name == "_default" else "a per-model policy"
        sections.append(f"== {name}: {kind}\n{_described(policy, args.max_tries_per_step)}")
    print("\n".join(sections), end="")
    if checked.errors:
        return _invalid(args.file, "policy directory", checked.errors)
    return 0


def cmd_check_auth(args: argparse.Namespace) -> int:
    from router.tenants.config import AuthError, load_auth_file

    try:
        config = load_auth_file(args.file)
    except AuthError as exc:
        return _invalid(args.file, "auth file", exc.errors)
    if config.admin_mode or config.api_open:
        api = "none (open to every caller)" if config.api_open else "api-key"
        admin = config.admin_mode or "unset"
        print(f"upstream auth.yaml: api.mode={api} admin.mode={admin}")
    for tenant in config.tenants.values():
        view = tenant.public()
        limits = " ".join(f"{k}={v}" for k, v in view.items() if k not in ("name", "models") and v)
        # Upstream's allowlists are per key: keys of one owner may list other models.
        own = {digest: config.by_hash[digest].models for digest in tenant.key_hashes}
        per_key = len(set(own.values())) > 1
        models = "per key" if per_key else ",".join(tenant.models) or "*"
        print(f"tenant {tenant.name}: models={models} {limits}".rstrip())
        for model, rpm, tokens in tenant.per_model:
            print(f"  model {model}: requests_per_minute_per_replica={rpm} tokens_per_day={tokens}")
        for digest, listed in own.items() if per_key else ():
            print(f"  key {digest[:19]}…: models={','.join(listed) or '*'}")
    for digest, until in sorted(config.expires.items()):
        day = time.strftime("%d-%m-%Y", time.gmtime(until - 86400))
        print(f"key {digest[:19]}… of {config.by_hash[digest].name}: valid through {day} (UTC)")
    for warning in config.warnings:
        print(f"warning: {warning}")
    return 0


def cmd_hash_key(args: argparse.Namespace) -> int:
    from router.tenants.config import hash_key, new_key

    if args.stdin:
        key = sys.stdin.readline().strip()
        if not key:
            print("hivenet-router: no key on standard input", file=sys.stderr)
            return CONFIG_ERROR
        print(hash_key(key))
        return 0
    key = new_key()
    print(f"key: {key}")
    print(f"hash: {hash_key(key)}")
    return 0


def cmd_keygen(args: argparse.Namespace) -> int:
    from router.tenants.upstream_auth import keygen_entry

    try:
        print(keygen_entry(args.tenant), end="")
    except ValueError as exc:
        print(f"hivenet-router: {exc}", file=sys.stderr)
        return CONFIG_ERROR
    return 0


def cmd_identity(args: argparse.Namespace) -> int:
    from protocol.p2p import load_or_create_identity, peer_id_of

    try:
        port = args.p2p_port or env_value(os.environ, "P2P_PORT", int, "9000")
        announce = announce_addr(args.p2p_announce_addr)
    except ValueError as exc:
        print(f"hivenet-router: {exc}", file=sys.stderr)
        return CONFIG_ERROR
    peer_id = peer_id_of(load_or_create_identity(args.identity_path))
    print(f"peer_id: {peer_id}")
    if announce:
        print(f"{announce}/p2p/{peer_id}")
    print(f"/ip4/{args.p2p_listen_addr}/tcp/{port}/p2p/{peer_id}")
    return 0


def announce_addr(text: str | None) -> str | None:
    """`--p2p-announce-addr`, checked: a multiaddr without the peer ID (added to it);
    ValueError otherwise, which stops the router, as upstream."""
    if not text:
        return None
    from multiaddr import Multiaddr

    try:
        addr = Multiaddr(text)
    except Exception as exc:  # the multiaddr package raises several kinds
        raise ValueError(f"--p2p-announce-addr {text!r} is not a multiaddr: {exc}") from None
    if "p2p" in (proto.name for proto in addr.protocols()):
        raise ValueError(f"--p2p-announce-addr {text!r}: leave out /p2p/ (the router adds it)")
    return str(addr)


def cmd_token(args: argparse.Namespace) -> int:
    from protocol.tokens import issue_token

    try:
        secret = load_secret(args.jwt_secret_file)
    except (OSError, ValueError) as exc:
        print(f"hivenet-router: {exc}", file=sys.stderr)
        return CONFIG_ERROR
    print(issue_token(secret, args.peer_id, args.ttl))
    return 0


COMMANDS = {
    "serve": cmd_serve,
    "check-policy": cmd_check_policy,
    "check-auth": cmd_check_auth,
    "hash-key": cmd_hash_key,
    "keygen": cmd_keygen,
    "identity": cmd_identity,
    "token": cmd_token,
    "explain": cmd_explain,
}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or (argv[0].startswith("-") and argv[0] not in ("-h", "--help")):
        # The Go router has no subcommands: `hivenet-router [flags]` serves, and its
        # unit files say exactly that.
        argv.insert(0, "serve")
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        args.serve_argv = argv[argv.index("serve") + 1 :]
    setup_logging(log_format=getattr(args, "log_format", None))
    return COMMANDS[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
