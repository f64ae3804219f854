"""`hivenet-router explain`: ask a running router what it would do with a request.

It calls `POST /admin/explain` with the admin key from HIVENET_ROUTER_ADMIN_KEY (or
the first of HIVENET_ROUTER_ADMIN_API_KEYS, as on the router's own host): never from
a flag, which `ps` would show. Exit status: 0 when the request would be served (by an
agent or the fallback provider), 1 when it would be refused, 2 when the router could
not be asked.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any


def add_explain(sub: Any) -> None:
    explain = sub.add_parser(
        "explain",
        help="show what a running router would do with a request now (POST /admin/explain)",
    )
    explain.add_argument("--model", required=True)
    explain.add_argument("--tenant", default=None, help="route as this tenant")
    explain.add_argument(
        "--header",
        action="append",
        default=[],
        metavar="NAME: VALUE",
        help="a request header (repeatable); a client key here picks its tenant",
    )
    explain.add_argument("--prompt", default=None, help="one user message (prefix-aware reads it)")
    explain.add_argument("--path", default="/v1/chat/completions", help="the client endpoint")
    explain.add_argument(
        "--url",
        default=os.environ.get("HIVENET_ROUTER_URL") or "http://127.0.0.1:8080",
        help="the router's HTTP address (HIVENET_ROUTER_URL)",
    )
    explain.add_argument("--json", action="store_true", help="print the answer as JSON")


def admin_key(env: dict[str, str] | os._Environ[str]) -> str:
    key = env.get("HIVENET_ROUTER_ADMIN_KEY", "").strip()
    if key:
        return key
    keys = [k.strip() for k in env.get("HIVENET_ROUTER_ADMIN_API_KEYS", "").split(",")]
    return next((k for k in keys if k), "")


def cmd_explain(args: argparse.Namespace) -> int:
    import httpx

    headers: dict[str, str] = {}
    for item in args.header:
        name, sep, value = item.partition(":")
        if not sep or not name.strip():
            print(f"hivenet-router explain: --header {item!r} is not NAME: VALUE", file=sys.stderr)
            return 2
        headers[name.strip()] = value.strip()
    body: dict[str, Any] = {"model": args.model, "headers": headers, "path": args.path}
    if args.tenant is not None:
        body["tenant"] = args.tenant
    if args.prompt is not None:
        body["messages"] = [{"role": "user", "content": args.prompt}]
    key = admin_key(os.environ)
    auth = {"Authorization": f"Bearer {key}"} if key else {}
    url = args.url.rstrip("/") + "/admin/explain"
    try:
        r = httpx.post(url, json=body, headers=auth, timeout=10)
    except httpx.HTTPError as exc:
        print(f"hivenet-router explain: {url}: {exc}", file=sys.stderr)
        return 2
    try:
        answer = r.json()
    except ValueError:
        answer = None
    if r.status_code != 200 or not isinstance(answer, dict):
        print(f"hivenet-router explain: {url} answered {r.status_code}: {r.text}", file=sys.stderr)
        return 2
    print(json.dumps(answer, indent=2) if args.json else describe(answer))
    return 0 if answer.get("outcome") in ("routed", "provider_fallback") else 1


def describe(answer: dict[str, Any]) -> str:
    """The answer as an operator reads it: each step, each agent, the outcome."""
    lines = [
        f"model={answer['model']} tenant={answer['tenant']} priority={answer['priority']}"
        f" agents={answer['agents']} chain=[{'→'.join(answer['chain'])}]"
    ]
    for step in answer["steps"]:
        if "shed" in step:
            lines.append(f"step {step['name']}: shed_if [{step['shed']}]")
            continue
        lines.append(f"step {step['name']} strategy={step['strategy']}")
        for agent in step["agents"]:
            verdict = agent["excluded_by"] or "eligible"
            lines.append(f"  {agent['peer_id']} {verdict}")
        for rank, row in enumerate(step["ranking"], 1):
            score = f" {row['signal']}={row['score']}" if "signal" in row else ""
            lines.append(f"  rank {rank}: {row['peer_id']} load={row['load']}{score}")
        if step["chosen"]:
            lines.append(f"  chosen {step['chosen']}")
        else:
            lines.append(f"  drained: {step['drain']}")
    outcome = answer["outcome"]
    if outcome == "routed":
        lines.append(f"chosen={answer['chosen']} step={answer['chosen_step']}")
    elif outcome == "load_shed":
        lines.append(f"load_shed step={answer['shed']['step']} rule={answer['shed']['rule']}")
    else:
        ex = answer["exhaustion"]
        lines.append(f"policy_exhausted chain={ex['chain']} tried={ex['tried']}")
        lines.append(f"reason={json.dumps(ex['reason'], ensure_ascii=False)}")
        provider = answer.get("provider_fallback")
        if provider:
            lines.append(f"provider_fallback engine={provider['engine']} model={provider['model']}")
        else:
            lines.append(f"error={ex['error']} (no provider fallback)")
    return "\n".join(lines)
