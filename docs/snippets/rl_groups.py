import weenv

task = weenv.Task("my-task", setup=["echo 'installed once' > /workspace/deps.txt"])  # its setup: commands
for iteration in range(2):  # a trainer's loop: the setup runs in the first iteration only
    with weenv.rollout_group(task, 4) as group:  # 4 sandboxes forked from the task's state
        for i, sandbox in enumerate(group):
            sandbox.files.write("/workspace/attempt.txt", f"rollout {i}")  # each rollout's own writes
        seen = {sandbox.files.read("/workspace/deps.txt") for sandbox in group}
    print(iteration, group.state.built, seen)  # 0 True {'installed once\n'}, then 1 False {...}
print(group.tally.phases["other"] > 0)  # the group's tax by phase (its fork is "other"): True

weenv.release_task(task)  # the task's root environment on this node; its state stays in the store
weenv.Sandbox.delete_snapshot(group.state.name)  # the state too (else the next run reuses it)
