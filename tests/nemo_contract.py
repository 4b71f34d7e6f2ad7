"""NeMo Gym's sandbox provider contract on weenv, run by tests/test_adapters_nemo.py
with the NeMo Gym venv's Python (NeMo Gym needs Python >= 3.12).

It loads the provider as NeMo Gym does (``nemo_gym.sandbox.get_provider_class``
over the ``nemo_gym.sandbox_providers`` entry points; ``AsyncSandbox`` /
``Sandbox`` with the config ``{"weenv": {...}}``), drives every call of the
contract against the daemon of ``WEENV_API_URL`` / ``WEENV_API_KEY``, and
prints one JSON document of what it saw.  Usage: ``python nemo_contract.py TEMPLATE``.
"""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
from pathlib import Path

from nemo_gym.sandbox import (
    AsyncSandbox,
    Sandbox,
    SandboxCreateError,
    SandboxSpec,
    get_provider_class,
    list_providers,
)

import weenv


async def contract(template: str, tmp: Path) -> dict:
    seen: dict = {"providers": list_providers(), "class": get_provider_class("weenv").__module__}
    spec = SandboxSpec(
        image="registry.example/" + template,
        ttl_s=120,
        ready_timeout_s=60,
        workdir="/work/run",
        env={"EPISODE": "7"},
        metadata={"run": "contract"},
        files={"/work/run/task.txt": "solve me"},
        resources={"cpu": 0.5, "memory_mib": 256},
        provider_options={"priority": 5},
    )
    provider = {"weenv": {"image_rewrites": [{"from": "registry.example/", "to": ""}]}}
    with weenv.meter("nemo-batch") as tally:
        async with AsyncSandbox(provider, spec) as sb:
            await sb.start()
            raw = sb._handle.raw
            seen["id"], seen["node"] = sb._handle.sandbox_id, raw.node
            seen["info"] = {
                "cpus": raw.info.resources.cpus,
                "memory": raw.info.resources.memory_bytes,
                "priority": raw.info.priority,
                "metadata": raw.info.metadata,
                "timeout_s": raw.info.timeout_s,
            }
            seen["status"] = (await sb.status()).value
            r = await sb.exec("pwd; cat task.txt; echo $EPISODE; echo err >&2; exit 3")
            seen["exec"] = [r.stdout, r.stderr, r.return_code, r.error_type]
            r = await sb.exec("echo $X; id -u", cwd="/tmp", env={"X": "y"}, user="root")
            seen["exec_env"] = [r.stdout, r.return_code]
            r = await sb.exec("echo partial; sleep 30", timeout_s=1)
            seen["timeout"] = [r.stdout, r.return_code, r.error_type]
            r = await sb.exec("id -un", user="nobody")
            seen["user"] = [r.stdout if r.error_type is None else r.stderr, r.return_code, r.error_type]
            local = tmp / "up.bin"
            local.write_bytes(bytes(range(256)) * 4096)
            await sb.upload(local, "/work/run/data/up.bin")
            r = await sb.exec("sha256sum /work/run/data/up.bin | cut -c1-16")
            seen["uploaded"] = r.stdout.strip()
            await sb.download("/work/run/data/up.bin", tmp / "down" / "back.bin")
            seen["round_trip"] = (tmp / "down" / "back.bin").read_bytes() == local.read_bytes()
        seen["after_stop"] = (await sb.status()).value
        seen["listed_after_stop"] = seen["id"] in [e.id for e in await weenv.AsyncSandbox.list()]
    seen["tally"] = {"phases": tally.phases, "command_s": tally.command_s, "environments": len(tally.environments)}

    bad = SandboxSpec(image="no-such-template")
    try:
        await AsyncSandbox({"weenv": {}}, bad).start()
        seen["missing"] = "created"
    except SandboxCreateError as exc:
        seen["missing"] = [type(exc).__name__, str(exc), type(exc.__cause__).__name__]
    try:
        await AsyncSandbox({"weenv": {"template": template}}, SandboxSpec(resources={"gpu": 1})).start()
        seen["gpu"] = "created"
    except SandboxCreateError as exc:
        seen["gpu"] = str(exc)
    return seen


def blocking(template: str) -> dict:
    """The blocking face (``nemo_gym.sandbox.Sandbox``) with the provider's ``template`` default."""
    with Sandbox({"weenv": {"template": template}}, SandboxSpec(ttl_s=60)) as sb:
        sb.start()
        r = sb.exec("echo sync")
        return {"stdout": r.stdout, "code": r.return_code, "status": sb.status().value}


if __name__ == "__main__":
    name = sys.argv[1]
    with tempfile.TemporaryDirectory() as d:
        result = asyncio.run(contract(name, Path(d)))
    result["sync"] = blocking(name)
    print(json.dumps(result))
