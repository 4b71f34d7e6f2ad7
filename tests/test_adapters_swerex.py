"""SWE-ReX (the PyPI package, unchanged) on weenv through
``weenv.adapters.swerex.WeenvDeployment`` against a real ``weenv serve``:
its ``RemoteRuntime`` drives ``swerex-remote`` running inside an environment
of the shared template ``task`` (whose own groups hold no SWE-ReX: the server
comes as a layer group), reached through the daemon's port relay."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("swerex", reason="swe-rex is not installed (weenv[swerex])")

from swerex.exceptions import CommandTimeoutError, DeploymentNotStartedError
from swerex.runtime.abstract import (
    BashAction,
    BashInterruptAction,
    CloseBashSessionRequest,
    Command,
    CreateBashSessionRequest,
    ReadFileRequest,
    UploadRequest,
    WriteFileRequest,
)
from swerex.runtime.remote import RemoteRuntime

from conftest import store_copy_without_profiles, system_snapshot
from daemon_fixture import environ, start_daemon
from weenv.adapters.swerex import WeenvDeployment, WeenvDeploymentConfig
from weenv.errors import InvalidInputError, NotFoundError
from weenv.packaging.template import load_template


@pytest.fixture(scope="module")
def store(shared_store, tmp_path_factory):
    """A copy of the shared store: the deployment publishes its derived template
    (``task.swerex-KEY``) there, which other modules listing templates must not see."""
    return store_copy_without_profiles(shared_store, tmp_path_factory.mktemp("swerex-store") / "store")


@pytest.fixture(scope="module")
def daemon(store, tmp_path_factory):
    root = tmp_path_factory.mktemp("swerex")
    before = system_snapshot(root)
    with environ(WEENV_RELAY_IDLE_S="2"):  # the relay's default idle end, short: a quiet command outlives it
        d = start_daemon(root / "home", store.url)
    try:
        yield d
    finally:
        d.stop()
        after = system_snapshot(root)
        for key in after:  # the suite's leak check over the module: mounts, cgroups, veths, nft tables...
            new = sorted(set(after[key]) - set(before[key]))
            if key not in ("mounts", "loops"):  # machine-wide: other sessions' environments come and go
                new = [n for n in new if any(i[:8] in n for i in d.ids)]
            assert not new, f"leaked {key}: {new}"


def deployment(daemon, store, **kw) -> WeenvDeployment:
    return WeenvDeployment(
        template="task", store=store.url, api_url=daemon.url, api_key=daemon.key, cpus=0.5, memory_mib=512, **kw
    )


def run(coro):
    return asyncio.run(coro)


def test_a_session_keeps_its_directory_and_variables_times_out_and_reads_and_writes_files(daemon, store, tmp_path):
    (tmp_path / "up" / "sub").mkdir(parents=True)
    (tmp_path / "up" / "sub" / "data.txt").write_text("uploaded\n")
    task_groups = load_template(store, "task")[1].groups

    async def scenario():
        d = deployment(daemon, store)
        await d.start()
        try:
            daemon.track(d.env_id)
            assert isinstance(d.runtime, RemoteRuntime)
            assert (await d.is_alive()).is_alive
            rt = d.runtime
            await rt.create_session(CreateBashSessionRequest(session="s"))
            await rt.run_in_session(BashAction(session="s", command="cd /tmp && export GREETING=hello-weenv"))
            out = await rt.run_in_session(BashAction(session="s", command='pwd; echo "$GREETING"'))
            assert out.output.split() == ["/tmp", "hello-weenv"] and out.exit_code == 0
            failed = await rt.run_in_session(BashAction(session="s", command="false", check="silent"))
            assert failed.exit_code == 1
            # quiet for longer than the relay's idle end (2 s here): the runtime asked a longer one
            out = await rt.run_in_session(BashAction(session="s", command="sleep 3; echo woke", timeout=30))
            assert out.output.strip() == "woke"
            relay = {"Host": f"8000-{d.env_id}.weenv", "X-API-Key": "not-checked-by-the-relay"}
            with daemon.http(key=None) as http:
                r = http.get("/is_alive", headers={**relay, "x-weenv-relay-idle": "600"})
                assert r.status_code == 403 and "x-weenv-key" in r.json()["message"]
                r = http.get("/is_alive", headers={**relay, "x-weenv-relay-idle": "nan", "x-weenv-key": daemon.key})
                assert r.status_code == 400 and "x-weenv-relay-idle" in r.json()["message"]

            # a command past its timeout: SWE-ReX raises, the interrupt ends it, the session goes on
            with pytest.raises(CommandTimeoutError):
                await rt.run_in_session(BashAction(session="s", command="sleep 300", timeout=1))
            await rt.run_in_session(BashInterruptAction(session="s"))
            out = await rt.run_in_session(
                BashAction(
                    session="s",
                    command=(
                        'pwd; echo "$GREETING"; for p in /proc/[0-9]*/cmdline; do tr "\\0" " " < $p; echo; done '
                        '| grep -c "^sleep 300" || true'
                    ),
                )
            )
            assert out.output.split() == ["/tmp", "hello-weenv", "0"]
            with pytest.raises(CommandTimeoutError):
                await rt.execute(Command(command=["sleep", "300"], timeout=1))

            await rt.write_file(WriteFileRequest(path="/workspace/notes/a.txt", content="line one\nline two\n"))
            assert (
                await rt.read_file(ReadFileRequest(path="/workspace/notes/a.txt"))
            ).content == "line one\nline two\n"
            assert (await rt.read_file(ReadFileRequest(path="/workspace/hello.py"))).content.startswith("print(")
            out = await rt.execute(Command(command="wc -l < /workspace/notes/a.txt", shell=True))
            assert out.stdout.strip() == "2"
            await rt.upload(UploadRequest(source_path=str(tmp_path / "up"), target_path="/workspace/up"))
            assert (await rt.read_file(ReadFileRequest(path="/workspace/up/sub/data.txt"))).content == "uploaded\n"
            await rt.close_session(CloseBashSessionRequest(session="s"))
            env_id = d.env_id
        finally:
            await d.stop()
        # after stop: the environment is gone, the runtime refuses clearly
        with pytest.raises(DeploymentNotStartedError, match="stopped"):
            _ = d.runtime
        with pytest.raises(DeploymentNotStartedError, match=f"stopped.*{env_id}"):
            await rt.create_session(CreateBashSessionRequest(session="again"))
        with pytest.raises(DeploymentNotStartedError, match="stopped"):
            await d.is_alive()
        await d.stop()  # idempotent
        return env_id

    env_id = run(scenario())
    with daemon.http() as http:
        assert env_id not in [e["id"] for e in http.get("/environments").json()]
    assert load_template(store, "task")[1].groups == task_groups  # the task's template is untouched


def test_bad_input_is_refused_clearly(daemon, store):
    with pytest.raises(NotFoundError, match="template 'no-such-task' does not exist"):
        run(WeenvDeployment(template="no-such-task", store=store.url, api_url=daemon.url, api_key=daemon.key).start())
    with pytest.raises(InvalidInputError, match="exactly one of 'template' and 'image'"):
        WeenvDeployment(api_url=daemon.url)
    with pytest.raises(DeploymentNotStartedError, match="not started"):
        _ = WeenvDeployment(template="task").runtime
    cfg = WeenvDeploymentConfig(template="task", store=store.url)
    assert isinstance(cfg.get_deployment(), WeenvDeployment)
    with daemon.http() as http:
        assert http.get("/environments").json() == []
