import weenv  # the node daemon: started on demand here, or WEENV_API_URL + WEENV_API_KEY

sandbox = weenv.Sandbox.create("my-task", timeout=600)  # lazily started from its layer groups
print(sandbox.commands.run("python3 -c 'print(6 * 7)'").stdout)  # 42
sandbox.files.write("/workspace/notes.txt", "attempt 1\n")
print(sandbox.files.read("/workspace/notes.txt"))  # attempt 1

group = sandbox.fork(8)  # a GRPO group: 8 copies of its file system, no data copied
for i, child in enumerate(group):
    child.commands.run(f"echo rollout {i} >> /workspace/notes.txt")
print([child.files.read("/workspace/notes.txt") for child in group])

for child in group:
    child.kill()
sandbox.kill()
