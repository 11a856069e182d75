"""Run by test_crash: records a session through the core, flushes, records more (journaled only), then waits to be
SIGKILLed."""

import asyncio
import sys
import time

from gatewayd.config import load_config
from gatewayd.daemon import Gateway
from gatewayd.models import Connection, new_id
import proxies  # noqa: F401  (registers the protocols, whose settings the configuration holds)


async def main(config_path: str) -> None:
    gateway = Gateway(load_config(config_path))
    await gateway.open_core()
    await gateway.recording.start()
    user = await gateway.identity.ensure_local_user("crash@example.com", "Crash", [])
    org = await gateway.store.default_org()
    connection = Connection(id=new_id(), org_id=org.id, name="crashy", resource_name="crashy", type="custom",
                            subtype="ssh")
    await gateway.store.create_connection(connection)
    live = await gateway.sessions.open(user, connection)
    live.recorder.input(b"before the crash\n")
    live.recorder.output(b"flushed output\n")
    await gateway.recording.flush()
    gateway.recording.flush_interval = 3600  # what follows never reaches the store before the crash
    live.recorder.input(b"never flushed\n")
    await gateway.recording.journal_now()  # the journal has it (its own tick would, within 50 ms)
    print(live.id, flush=True)
    time.sleep(3600)


asyncio.run(main(sys.argv[1]))
