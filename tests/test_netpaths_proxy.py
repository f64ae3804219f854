"""A GPU host whose firewall lets out nothing but its network's HTTP proxy (Debian's
tinyproxy, in a namespace of its own) joins the router over `/ws` and `/wss` through
`CONNECT`."""

from __future__ import annotations

import contextlib
import datetime
import functools
import ipaddress
import re
import shutil
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from agent.http_proxy import HttpProxy, ProxyError, check_connect_answer, parse_proxy_url
from tests.fleet import wait_until
from tests.netns import AgentIn, Lab, Netns, RouterIn, lab, require_netns

ROUTER_IP = "10.77.1.1"
PROXY_PUBLIC_IP = "10.77.1.3"
PROXY_IP = "10.77.3.1"
AGENT_IP = "10.77.3.2"
PROXY_PORT = 8888
PROXY_URL = f"http://{PROXY_IP}:{PROXY_PORT}"

pytestmark = pytest.mark.netpaths


@dataclass
class ProxyPath:
    lab: Lab
    router_ns: Netns
    agent_ns: Netns


def only_a_proxy_out(the_lab: Lab) -> ProxyPath:
    """router ── 10.77.1.0/24 ── proxy ── 10.77.3.0/24 ── agent. The proxy host does
    not forward packets; the agent's firewall drops every packet out but those to the
    proxy's port, and the proxy lets CONNECT reach ports 80 and 443 only, as a
    corporate proxy does."""
    router_ns, proxy_ns, agent_ns = the_lab.netns("r"), the_lab.netns("p"), the_lab.netns("a")
    the_lab.link(router_ns, f"{ROUTER_IP}/24", proxy_ns, f"{PROXY_PUBLIC_IP}/24")
    the_lab.link(proxy_ns, f"{PROXY_IP}/24", agent_ns, f"{AGENT_IP}/24")
    agent_ns.iptables("-P", "OUTPUT", "DROP")
    agent_ns.iptables("-A", "OUTPUT", "-o", "lo", "-j", "ACCEPT")
    agent_ns.iptables(
        "-A", "OUTPUT", "-d", PROXY_IP, "-p", "tcp", "--dport", str(PROXY_PORT), "-j", "ACCEPT"
    )  # fmt: skip
    config = the_lab.dir / "tinyproxy.conf"
    config.write_text(
        f"Port {PROXY_PORT}\nListen {PROXY_IP}\nAllow 10.77.3.0/24\nTimeout 600\n"
        "ConnectPort 443\nConnectPort 80\nMaxClients 50\nLogLevel Connect\n"
    )
    proxy = proxy_ns.spawn(
        "tinyproxy", [shutil.which("tinyproxy") or "tinyproxy", "-d", "-c", str(config)]
    )
    wait_until(
        lambda: f"{PROXY_IP}:{PROXY_PORT}" in proxy_ns.sh("ss", "-ltn").stdout or not proxy.alive(),
        15,
        "tinyproxy listening",
    )
    assert proxy.alive(), proxy.log()
    return ProxyPath(the_lab, router_ns, agent_ns)


@pytest.fixture
def proxy_path(tmp_path: Path) -> Iterator[ProxyPath]:
    require_netns("tinyproxy")
    with lab(tmp_path) as the_lab:
        yield only_a_proxy_out(the_lab)


def make_certificates(directory: Path, ip: str) -> tuple[Path, Path, Path]:
    """A CA, and a certificate for `ip` it signed: (ca.pem, cert.pem, key.pem)."""
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "netpaths test CA")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, ip)]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(ip))]),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    pem = serialization.Encoding.PEM
    paths = directory / "ca.pem", directory / "cert.pem", directory / "key.pem"
    paths[0].write_bytes(ca.public_bytes(pem))
    paths[1].write_bytes(cert.public_bytes(pem))
    paths[2].write_bytes(
        key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return paths


def serves(router: RouterIn, model: str, text: str) -> None:
    http = httpx.Client(transport=httpx.HTTPTransport(uds=str(router.http_socket)), timeout=60)
    client = openai.OpenAI(base_url="http://router/v1", api_key="unused", http_client=http)
    chunks = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": text}], stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == f"Echo: {text}"


@pytest.mark.parametrize("how", ["flag", "env"])
def test_agent_joins_over_ws_through_the_proxy(proxy_path: ProxyPath, how: str) -> None:
    router = RouterIn(proxy_path.router_ns, ROUTER_IP, "--p2p-ws-port", "80")
    assert not proxy_path.agent_ns.reaches(ROUTER_IP)
    flags, env = (
        (["--proxy", PROXY_URL], None) if how == "flag" else ([], {"HTTP_PROXY": PROXY_URL})
    )
    agent = AgentIn(
        proxy_path.agent_ns,
        [router.address("ws", 80)],
        "m-proxy",
        *flags,
        env=None if env is None else {**proxy_path.lab.env, **env},
    )
    entry = router.wait_agent(agent.peer_id)
    assert entry["status"]["remote_addr"].startswith(f"{PROXY_PUBLIC_IP}:")
    serves(router, "m-proxy", "over ws via CONNECT")
    router.close()


def test_agent_joins_over_wss_through_https_proxy(proxy_path: ProxyPath) -> None:
    """HTTPS_PROXY and a router listening with TLS: the proxy tunnels ciphertext; the
    agent checks the router's certificate against SSL_CERT_FILE. An agent that does
    not trust that CA is refused by its own TLS check and never joins."""
    ca, cert, key = make_certificates(proxy_path.lab.dir, ROUTER_IP)
    router = RouterIn(
        proxy_path.router_ns,
        ROUTER_IP,
        "--p2p-wss-port", "443", "--tls-cert-file", str(cert), "--tls-key-file", str(key),
    )  # fmt: skip
    assert router.proc.wait_log(r"router_listening p2p=\S+/tcp/443/wss/")
    # Plain TCP garbage and plain HTTP at the TLS port end those connections only.
    for probe in (b"\x16\x03\x01\x00\xff" + b"\x00" * 300, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"):
        proxy_path.router_ns.sh(
            sys.executable, "-c",
            "import socket, sys\n"
            f"s = socket.create_connection(({ROUTER_IP!r}, 443), timeout=5)\n"
            f"s.sendall({probe!r})\n"
            "s.settimeout(5)\n"
            "try:\n    s.recv(100)\nexcept OSError:\n    pass\n",
        )  # fmt: skip
    env = {**proxy_path.lab.env, "HTTPS_PROXY": PROXY_URL}
    untrusting = AgentIn(proxy_path.agent_ns, [router.address("wss", 443)], "m-other", env=env)
    agent = AgentIn(
        proxy_path.agent_ns,
        [router.address("wss", 443)],
        "m-tls",
        env={**env, "SSL_CERT_FILE": str(ca)},
    )
    entry = router.wait_agent(agent.peer_id)
    assert entry["status"]["remote_addr"].startswith(f"{PROXY_PUBLIC_IP}:")
    serves(router, "m-tls", "over wss via CONNECT")
    untrusting.proc.wait_log("router_dial_failed.*certificate verify failed")
    assert router.agent(untrusting.peer_id) is None
    router.close()


def test_proxy_urls_other_than_http_are_refused_with_the_reason() -> None:
    assert parse_proxy_url("http://10.0.0.1:3128") == HttpProxy("10.0.0.1", 3128)
    assert parse_proxy_url("http://proxy.example") == HttpProxy("proxy.example", 80)
    assert parse_proxy_url("http://u%40x:p%3Aw@proxy:8080").authorization == ("Basic dUB4OnA6dw==")
    for bad in (
        "socks5://proxy:1080",
        "https://proxy:443",
        "proxy:3128",
        "http://",
        "http://h:99999",
    ):
        with pytest.raises(ValueError, match="proxy"):
            parse_proxy_url(bad)


@pytest.mark.parametrize(
    "answer",
    [
        b"HTTP/1.1 403 Forbidden",
        b"HTTP/1.0 407 Proxy Authentication Required",
        b"SSH-2.0-OpenSSH_9.2",
        b"",
        b"HTTP/1.1 abc",
    ],
)
def test_a_proxy_that_refuses_connect_is_named_in_the_error(answer: bytes) -> None:
    proxy = HttpProxy("10.0.0.1", 3128)
    with pytest.raises(ProxyError, match=r"proxy http://10\.0\.0\.1:3128"):
        check_connect_answer(answer + b"\r\nServer: x", proxy, "router:443")


ROUTER_ID = "12D3KooWApxiqsXah3puHxXvEwhSVpUJKtyJi7weokxaETkQaZnw"


def test_agent_refuses_a_proxy_it_cannot_use(capsys: pytest.CaptureFixture[str]) -> None:
    from agent.cli import main

    wss = f"/ip4/10.0.0.1/tcp/443/wss/p2p/{ROUTER_ID}"
    assert main(["--router", wss, "--proxy", "socks5://p:1080"]) == 2
    assert "is not an HTTP proxy URL" in capsys.readouterr().err
    tcp = f"/ip4/10.0.0.1/tcp/9000/p2p/{ROUTER_ID}"
    assert main(["--router", tcp, "--proxy", "http://p:3128"]) == 2
    assert "--proxy needs a /ws or /wss --router" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("answer", "error"),
    [
        (b"HTTP/1.1 403 Forbidden\r\n\r\n", "refused CONNECT 10.0.0.1:443: HTTP/1.1 403"),
        (b"HTTP/1.1 200 OK\r\n" + b"X: y\r\n" * 4000, "sent over 16384 bytes"),
        (b"HTTP/1.1 200 OK\r\n\r\nSSH-2.0-x\r\n", "sent data before the tunnel"),
        (b"", "closed the connection during CONNECT"),
    ],
)
async def test_open_tunnel_against_a_hostile_proxy(answer: bytes, error: str) -> None:
    """A proxy that refuses, floods, talks first or hangs up: the dial fails with the
    proxy and the reason named, and holds no more than MAX_ANSWER_BYTES."""
    import trio

    from agent.http_proxy import open_tunnel

    async def proxy(stream: trio.SocketStream) -> None:
        request = await stream.receive_some(4096)
        assert request.startswith(b"CONNECT 10.0.0.1:443 HTTP/1.1\r\n")
        with contextlib.suppress(trio.BrokenResourceError):
            await stream.send_all(answer)
        await stream.aclose()

    async with trio.open_nursery() as nursery:
        serve = functools.partial(trio.serve_tcp, proxy, 0, host="127.0.0.1")
        listeners = await nursery.start(serve)
        port = listeners[0].socket.getsockname()[1]
        with pytest.raises(ProxyError, match=re.escape(error)):
            await open_tunnel(HttpProxy("127.0.0.1", port), "10.0.0.1", 443)
        nursery.cancel_scope.cancel()


def test_dial_errors_name_the_innermost_cause() -> None:
    from libp2p.exceptions import MultiError

    from agent.dial_errors import describe

    ssl_error = ValueError("certificate verify failed")
    try:
        try:
            raise RuntimeError("transport failed") from ssl_error
        except RuntimeError as transport:
            raise ConnectionError("unable to connect") from MultiError([transport])
    except ConnectionError as dial:
        text = describe(dial)
    assert text == (
        "ConnectionError: unable to connect (cause: ValueError: certificate verify failed)"
    )
    assert describe(KeyError("x")) == "KeyError: 'x'"
    # trio's connect keeps its attempts in an exception group (`exceptions`, not `errors`).
    refused = ConnectionRefusedError(111, "Connection refused")
    try:
        raise OSError("all attempts to connect to 127.0.0.1:9 failed") from ExceptionGroup(
            "all attempts failed", [refused]
        )
    except OSError as dial:
        assert describe(dial).endswith(
            "(cause: ConnectionRefusedError: [Errno 111] Connection refused)"
        )


def test_router_tls_flags_are_checked_at_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from router.cli import main

    monkeypatch.setenv("HIVENET_ROUTER_ADMIN_API_KEYS", "k")
    monkeypatch.setenv("HIVENET_ROUTER_JWT_SECRET", "s" * 32)
    base = ["serve", "--identity-path", str(tmp_path / "id.key")]
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate")
    cases = {
        "--p2p-wss-port needs --tls-cert-file and --tls-key-file": ["--p2p-wss-port", "443"],
        "--tls-cert-file and --tls-key-file are for --p2p-wss-port": [
            "--tls-cert-file", str(garbage), "--tls-key-file", str(garbage),
        ],
        "cannot both be set": [
            "--p2p-ws-port", "80", "--p2p-wss-port", "443",
            "--tls-cert-file", str(garbage), "--tls-key-file", str(garbage),
        ],
        "TLS file not found": [
            "--p2p-wss-port", "443",
            "--tls-cert-file", str(tmp_path / "none.pem"), "--tls-key-file", str(garbage),
        ],
        "not a PEM certificate chain and its private key": [
            "--p2p-wss-port", "443",
            "--tls-cert-file", str(garbage), "--tls-key-file", str(garbage),
        ],
    }  # fmt: skip
    for message, flags in cases.items():
        assert main([*base, *flags]) == 2
        assert message in capsys.readouterr().err
