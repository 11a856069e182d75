"""The RDP listener on an in-process core that hands it nothing but its ProxyContext (run as a child process).

Twisted's reactor is one per process, bound to one loop: this runs in a
process of its own (``python -m tests.rdp_narrow DATA_DIR TARGET_PORT``).
It issues a credential for an RDP role on ``TARGET_PORT``, starts the
listener with ``core.proxy_context("rdp")`` only and prints ``{"port", "secret"}`` as one
JSON line; once the session has frames it kills it through the core and
prints ``{"exit_code", "events", "frames"}`` when the session is done.
"""

from __future__ import annotations

import asyncio
import base64
import json
import sys

from tests.conftest import free_port

GUARD_S = 120  # against a hang, not a measure


async def main(data_dir: str, target_port: int) -> None:
    import proxies.rdp  # noqa: F401  (its compatibility shim before any pyrdp import)
    from gatewayd.config import load_config
    from gatewayd.daemon import Gateway
    from gatewayd.models import Connection, new_id, rfc3339, utcnow
    from proxies.rdp.server import start

    core = Gateway(load_config(None, environ={}, overrides={"data_dir": data_dir, "sessions.flush_interval": "100ms"}))
    await core.open_core()
    await core.recording.start()
    listener = None
    try:
        org = await core.store.default_org()
        user = await core.identity.ensure_local_user("ann@example.com", "Ann", ["admin"])
        env = {"HOST": "127.0.0.1", "PORT": str(target_port), "USER": "alice", "PASS": "Narrow-pass-1"}
        connection = Connection(id=new_id(), org_id=org.id, name="narrow", resource_name="narrow", type="custom",
                                subtype="rdp", secret={f"envvar:{k}": base64.b64encode(v.encode()).decode()
                                                       for k, v in env.items()},
                                created_at=rfc3339(utcnow()), updated_at=rfc3339(utcnow()))
        await core.store.create_connection(connection)
        issued = await core.access.issue(user, connection, 600)
        port = free_port()
        listener = await start(core.proxy_context("rdp"), "127.0.0.1", port)
        print(json.dumps({"port": port, "secret": issued.secret}), flush=True)
        session_id = issued.credential.session_id
        async with asyncio.timeout(GUARD_S):
            while (await core.frames.page(session_id, 0, 1)).total_frames == 0:  # until the desktop is on screen
                await asyncio.sleep(0.1)
            await core.sessions.kill(session_id, "killed by the narrow test")
            while (session := await core.store.get_session(session_id)).status != "done":
                await asyncio.sleep(0.05)
        await core.recording.flush()
        events = [(e.kind, e.data.decode(errors="replace")) for e in await core.store.read_events(session_id)]
        page = await core.frames.page(session_id, 0, 1)
        print(json.dumps({"exit_code": session.exit_code, "events": events, "frames": page.total_frames,
                          "first_ms": page.frames[0].timestamp}), flush=True)
    finally:
        if listener is not None:
            await listener.close()
            await listener.tasks.wait()
        await core.recording.stop()
        await core.close_core()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], int(sys.argv[2])))
