from e2b import Sandbox  # E2B_API_URL, E2B_SANDBOX_URL and E2B_API_KEY name `weenv serve`

sandbox = Sandbox.create("my-task", timeout=600)
print(sandbox.commands.run("python3 -c 'print(6 * 7)'").stdout)  # 42
sandbox.files.write("/workspace/notes.txt", "attempt 1\n")
print(sandbox.files.read("/workspace/notes.txt"))  # attempt 1

group = sandbox.fork(count=8)  # a GRPO group: 8 copies of its file system
for i, child in enumerate(group):
    child.commands.run(f"echo rollout {i} >> /workspace/notes.txt")
print([child.files.read("/workspace/notes.txt") for child in group])

for child in group:
    child.kill()
sandbox.kill()
