"""The README's first run, as a newcomer pastes it (issue 34, item 11): the walkthrough's commands and the
reviewed access request of its Reviews section, run by bash against a real daemon, reach an admin who can sign
in to the console and a developer's access request approved from the command line."""

from __future__ import annotations

import os
import re
import subprocess

import aiohttp

from tests.conftest import BIN, ROOT, Daemon, free_port


def shell_block(after: str) -> str:
    """The first ```sh block of README.md after the heading ``after``."""
    text = (ROOT / "README.md").read_text()
    start = text.index(after)
    return re.search(r"```sh\n(.*?)```", text[start:], re.S).group(1)


async def test_the_walkthrough_reaches_a_signed_in_console_and_a_reviewed_access_request(tmp_path):
    daemon = Daemon(tmp_path / "data", {"listeners.postgres": f"127.0.0.1:{free_port()}"}).start()
    try:
        base = daemon.url.removesuffix("/api")
        script = "set -e\n" + shell_block("## Walkthrough") + shell_block("### Reviews")
        script = script.replace("http://127.0.0.1:8009", base).replace(".venv/bin/gatewayd", str(BIN / "gatewayd"))
        env = {k: v for k, v in os.environ.items() if not k.startswith("GATEWAYD_")}
        env.update({"GATEWAYD_CONFIG": str(daemon.config_path), "GATEWAYD_CLIENT_CONFIG": str(tmp_path / "login.json")})
        done = subprocess.run(["bash", "-c", script], capture_output=True, text=True, env=env, cwd=tmp_path,
                              timeout=300)
        out = done.stdout + done.stderr
        assert done.returncode == 0, out
        assert "password set for admin@example.com" in out and '"is_admin":true' in out
        assert re.search(r"orders-ro\s+postgres\s+admin \(access\)", out), out
        assert "INC-7: a stuck order" in out and re.search(r"review [0-9a-f-]{36}: APPROVED", out), out
        assert 'psql "postgres://pg-' in out, out
        async with aiohttp.ClientSession() as http:  # the console's sign-in, with the password step 1 set
            async with http.post(f"{daemon.url}/localauth/login",
                                 json={"email": "admin@example.com", "password": "admin passphrase 1"}) as answer:
                assert answer.status == 200 and (await answer.json())["token"]
    finally:
        assert daemon.stop() == 0
