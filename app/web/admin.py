"""Admin actions: ``POST /retry/admin/keys/{key}/dead-letter``, ``.../retry-now`` and ``.../unblock``; ``POST
/retry/admin/pause`` and ``/retry/admin/resume`` (the main topics, cluster-wide: ``agents/control.py``); ``POST
/retry/admin/replay/{topic}/{partition}/{offset}`` (one failed record back to its main topic: ``app/replay.py``).

Guarded by ``Authorization: Bearer <REBOUND_ADMIN_TOKEN>``, compared in constant time. No token configured (unset or
empty) means admin actions are off: every admin request gets 403 saying so. A missing or wrong token gets 401.

The key is named as in ``GET /retry/keys/{key}`` (text, or ``?key_encoding=base64``: ``app/views.py`` ``named_key``).
The request is forwarded (``app/views.py`` ``route_key``: by the key's bytes, or to the owner of ``?partition=N``) to
the worker owning the key's state; that worker reads the key's pending entries to learn their table partition and
sends the command to that partition of ``<app id>.admin``, where the admin agent (``agents/admin.py``) applies it
inside a stream iteration and answers with what it did.

Pause, resume and replay are answered by whichever worker gets the request. Each logs an audit line (who: the
``X-Rebound-Operator`` header if given, else the request's address; when; what).
"""

from __future__ import annotations

import hmac
import logging
from functools import partial
from typing import Any

from faust.web import Blueprint

from agents.admin import admin_channel, audit_line
from agents.control import Written, pause_view, set_paused
from agents.runtime import Runtime
from app.replay import replay_one
from app.views import bad_key_name, named_key, named_partition, route_key
from rebound.commands import ACTIONS
from rebound.display import logged_key, printable, utc_time
from rebound.key_names import KeyNameError, key_names
from rebound.pause import describe_who
from rebound.replay import parse_max_redrives
from rebound.settings import reveal
from rebound.state import escaped_key

log = logging.getLogger(__name__)
ANSWER_TIMEOUT_S = 10.0
OPERATOR_HEADER = "X-Rebound-Operator"
PAUSE_ACTIONS = ("pause", "resume")


def check_token(configured: str | None, authorization: str | None) -> tuple[int, str] | None:
    """None when allowed, else ``(status, message)``. Pure, so it is unit-tested."""
    if not configured:
        return 403, "admin actions are off: set REBOUND_ADMIN_TOKEN on the workers to enable them"
    scheme, _, token = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return 401, "admin actions need an 'Authorization: Bearer <token>' header"
    if not hmac.compare_digest(token.strip().encode("utf-8"), configured.encode("utf-8")):
        return 401, "wrong admin token"
    return None


def requested(request: Any, name: str) -> str:
    """The key a refused request names, for its audit line: as the other audit lines name a key once its name is
    read (``?key_encoding=base64`` decoded), else the name as the request gave it, said to name no key."""
    try:
        return logged_key(named_key(request, name))
    except KeyNameError as exc:
        return printable(f"named {name!r} ({exc})")


def pause_answer(action: str, written: Written, current: dict[str, Any]) -> tuple[dict[str, Any], int]:
    """The body and status of a pause or resume: 200 applied here; 202 written, not applied here yet; 409 another
    action was written after it before it was confirmed (``overtaken``: ``state`` is the current one, which may
    not be what this request asked for). Pure, so it is unit-tested."""
    if written.overtaken:
        body = {
            "action": action,
            "overtaken": True,
            "confirmed": False,
            "error": f"another pause/resume was written after this {action} before it was applied: see state",
            "state": current,
        }
        return body, 409
    return {"action": action, **current, "confirmed": written.confirmed}, 200 if written.confirmed else 202


def register_admin_views(runtime: Runtime, blueprint: Blueprint, routed_answer: Any) -> None:
    from faust.web import View

    for action in ACTIONS:

        def make(action: str) -> type[Any]:
            async def act_locally(view: Any, request: Any, key: bytes) -> Any:
                table_key = runtime.store.existing_key(escaped_key(key))
                names = key_names(key)
                state = runtime.store.load(table_key, entries=True)
                partitions = sorted({entry.partition for entry in (*state.pending, *state.held)})
                if not partitions and action == "unblock" and state.partition is not None and state.is_blocked:
                    partitions = [state.partition]
                if not partitions:
                    nothing = "not blocked" if action == "unblock" else "no pending messages for this key"
                    return view.json({"action": action, **names, "error": nothing}, status=404)
                who = request.remote or "?"
                results, accepted = [], []
                for partition in partitions:
                    command_id, result = await admin_channel(runtime).submit(
                        action, table_key, partition, requested_by=who, timeout=ANSWER_TIMEOUT_S
                    )
                    if result is None:
                        accepted.append({"id": command_id, "partition": partition})
                    else:
                        results.append(result)
                body = {
                    "action": action,
                    **names,
                    "count": sum(int(r.get("count", 0)) for r in results),
                    "results": results,
                }
                if accepted:
                    body["accepted_not_confirmed"] = accepted
                    with audit_line(f"admin {action} not confirmed"):
                        log.warning(
                            "admin %s of key %s sent but not confirmed within %ss",
                            action,
                            logged_key(key),
                            ANSWER_TIMEOUT_S,
                        )
                return view.json(body, status=202 if accepted else 200)

            class AdminAction(View):
                async def post(self, request: Any, key: str) -> Any:
                    denied = check_token(reveal(runtime.settings.admin_token), request.headers.get("Authorization"))
                    if denied is not None:
                        status, message = denied
                        with audit_line(f"admin {action} refused"):
                            log.warning(
                                "admin %s of key %s refused (%d): %s", action, requested(request, key), status, message
                            )
                        headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
                        return self.json({"error": message, "action": action}, status=status, headers=headers)
                    try:
                        named, partition = named_key(request, key), named_partition(runtime, request)
                    except KeyNameError as exc:
                        return bad_key_name(self, key, exc, action=action)
                    local = partial(act_locally, self, request, named)
                    return await routed_answer(self, lambda: route_key(runtime, named, partition, self, request, local))

            AdminAction.__name__ = f"admin_{action.replace('-', '_')}"
            return AdminAction

        blueprint.route(f"/retry/admin/keys/{{key}}/{action}")(make(action))

    def refused(view: Any, request: Any, what: str) -> Any:
        denied = check_token(reveal(runtime.settings.admin_token), request.headers.get("Authorization"))
        if denied is None:
            return None
        status, message = denied
        log.warning("admin %s refused (%d) from %s: %s", what, status, request.remote or "?", message)
        headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
        return view.json({"error": message, "action": what.split(" ", 1)[0]}, status=status, headers=headers)

    def make_pause(action: str) -> type[Any]:
        class PauseAction(View):
            async def post(self, request: Any) -> Any:
                denied = refused(self, request, f"{action} of the main topics")
                if denied is not None:
                    return denied
                by, source = describe_who(request.headers.get(OPERATOR_HEADER), request.remote)
                written = await set_paused(runtime, paused=action == "pause", by=by, source=source)
                state, confirmed = written.state, written.confirmed
                with audit_line(f"admin {action} of the main topics"):
                    log.warning(
                        "admin %s of the main topics %s by %s from %s at %s (action %s)%s",
                        action,
                        ",".join(runtime.settings.topics),
                        by,
                        source,
                        utc_time(state.at_ms),
                        state.action_id,
                        ": written, then overtaken by a later action"
                        if written.overtaken
                        else ""
                        if confirmed
                        else ": written, not yet applied on this worker",
                    )
                body, status = pause_answer(action, written, pause_view(runtime))
                return self.json(body, status=status)

        PauseAction.__name__ = f"admin_{action}"
        return PauseAction

    for action in PAUSE_ACTIONS:
        blueprint.route(f"/retry/admin/{action}")(make_pause(action))

    class ReplayAction(View):
        async def post(self, request: Any, topic: str, partition: str, offset: str) -> Any:
            denied = refused(self, request, f"replay of {topic}/{partition}@{offset}")
            if denied is not None:
                return denied
            if not (partition.isdigit() and offset.isdigit()):
                return self.json(
                    {"error": "partition and offset must be whole numbers", "action": "replay"}, status=400
                )
            try:
                max_redrives = parse_max_redrives(request.query.get("max_redrives"))
            except ValueError as exc:
                return self.json({"error": str(exc), "action": "replay"}, status=400)
            force = (request.query.get("force_other_group") or "").lower()
            if force not in ("", "true", "false"):
                return self.json({"error": "force_other_group must be true or false", "action": "replay"}, status=400)
            by, source = describe_who(request.headers.get(OPERATOR_HEADER), request.remote)
            answer = await replay_one(
                runtime,
                topic,
                int(partition),
                int(offset),
                max_redrives=max_redrives,
                by=by,
                source=source,
                force_other_group=force == "true",
            )
            return self.json({"action": "replay", **answer.body}, status=answer.status)

    blueprint.route("/retry/admin/replay/{topic}/{partition}/{offset}")(ReplayAction)
