"""Open WebUI (PyPI's `open-webui`) against a real router, configured as
docs/integrations/open-webui.md shows: one OpenAI API connection to the router's `/v1`
with a client key. Opt-in: `scripts/open-webui` installs it (7.4 GB, about 8 minutes)
into a cache of its own and runs this file; the default suite does not collect it
(tests/conftest.py).

Open WebUI is driven through its own HTTP API, as its browser pages drive it: it lists
the router's models, and answers a chat turn whole and streamed with the engine's
answer. Nothing leaves the machine: a proxy that records and refuses every connection
not to the router or to Open WebUI sees none, at start-up or during the chats.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.client_fleet import (
    CLIENT_KEY,
    MODEL,
    TENANT,
    ClientFleet,
    EgressRecorder,
    client_fleet,
)
from tests.fleet import Proc, free_port, wait_until

# Open WebUI migrates its database and loads its modules at start: 1.5 min measured.
START_TIMEOUT = 300


def open_webui_env(router_url: str, data: Path, port: int) -> dict[str, str]:
    """The environment docs/integrations/open-webui.md gives."""
    return {
        "OPENAI_API_BASE_URL": f"{router_url}/v1",
        "OPENAI_API_KEY": CLIENT_KEY,
        "ENABLE_OPENAI_API": "True",
        "ENABLE_OLLAMA_API": "False",
        # No sign-in page (one admin user), a fixed session secret, its data here.
        "WEBUI_AUTH": "False",
        "WEBUI_SECRET_KEY": "open-webui-test-secret",
        "DATA_DIR": str(data),
        "PORT": str(port),
        # No model downloads from Hugging Face, no telemetry.
        "OFFLINE_MODE": "True",
        "HF_HUB_OFFLINE": "1",
        "ANONYMIZED_TELEMETRY": "False",
        "DO_NOT_TRACK": "True",
        "SCARF_NO_ANALYTICS": "True",
    }


class OpenWebui:
    def __init__(self, fleet: ClientFleet, egress: EgressRecorder, url: str) -> None:
        self.fleet = fleet
        self.egress = egress
        self.url = url
        # Without authentication, signing in with nothing gives the admin's session.
        signin = httpx.post(
            url + "/api/v1/auths/signin", json={"email": "", "password": ""}, timeout=30
        )
        signin.raise_for_status()
        self.headers = {"Authorization": f"Bearer {signin.json()['token']}"}


@pytest.fixture(scope="module")
def webui(tmp_path_factory: pytest.TempPathFactory) -> Iterator[OpenWebui]:
    command = os.environ.get("HIVENET_OPEN_WEBUI")
    if not command:
        pytest.fail("HIVENET_OPEN_WEBUI is not set: run this file through scripts/open-webui")
    directory = Path(tmp_path_factory.mktemp("open-webui"))
    egress = EgressRecorder(directory)
    try:
        with client_fleet(directory) as fleet:
            port = free_port()
            data = directory / "data"
            data.mkdir()
            env = {
                **os.environ,
                **open_webui_env(fleet.url, data, port),
                **egress.env(),
            }
            argv = [command, "serve", "--host", "127.0.0.1", "--port", str(port)]
            server = Proc("open-webui", argv, env, directory / "open-webui.log").start()
            fleet.fleet.procs.append(server)
            url = f"http://127.0.0.1:{port}"
            try:
                wait_until(
                    lambda: httpx.get(url + "/health", timeout=5).status_code == 200,
                    START_TIMEOUT,
                    "Open WebUI healthy",
                )
            except AssertionError as exc:
                raise AssertionError(f"{exc}; its log ends:\n{server.log()[-3000:]}") from None
            yield OpenWebui(fleet, egress, url)
    finally:
        egress.close()


def test_open_webui_lists_the_routers_models(webui: OpenWebui) -> None:
    models = httpx.get(webui.url + "/api/models", headers=webui.headers, timeout=60)
    assert models.status_code == 200, models.text
    assert [m["id"] for m in models.json()["data"]] == [MODEL]
    # The list is the router's, asked for with the client key (the metrics count
    # inference endpoints only; the access log has every request).
    assert f"path=/v1/models status=200 tenant={TENANT}" in webui.fleet.router.log()


def test_open_webui_chats_through_the_router_whole_and_streamed(webui: OpenWebui) -> None:
    served = webui.fleet.served("/v1/chat/completions")
    chat = webui.url + "/api/chat/completions"
    whole = httpx.post(
        chat,
        headers=webui.headers,
        json={
            "model": MODEL,
            "messages": [{"role": "user", "content": "hello from open webui"}],
            "stream": False,
        },
        timeout=60,
    )
    assert whole.status_code == 200, whole.text
    assert whole.json()["choices"][0]["message"]["content"] == "Echo: hello from open webui"

    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "stream from open webui"}],
        "stream": True,
    }
    deltas = []
    with httpx.stream("POST", chat, headers=webui.headers, json=body, timeout=60) as answer:
        assert answer.status_code == 200
        for line in answer.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: ") :])
            for choice in event.get("choices", []):
                if choice.get("delta", {}).get("content"):
                    deltas.append(choice["delta"]["content"])
    assert "".join(deltas) == "Echo: stream from open webui"
    assert len(deltas) == 5  # the engine's chunks, one per token, relayed by both
    assert webui.fleet.served("/v1/chat/completions") == served + 2
    assert webui.egress.attempts() == []
