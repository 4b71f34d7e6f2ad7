import weenv

sandbox = weenv.Sandbox.create("my-task", timeout=600)
sandbox.commands.run("echo 'set up once' > /workspace/setup.txt")  # the task's setup
sandbox.create_snapshot("my-task-ready")  # a template: my-task's groups + what the setup wrote
sandbox.kill()

group = weenv.Sandbox.create_many("my-task-ready", count=8, timeout=600)  # on any node of the store, lazily
print({child.files.read("/workspace/setup.txt") for child in group})  # {'set up once\n'}
for child in group:
    child.kill()
weenv.Sandbox.delete_snapshot("my-task-ready")
