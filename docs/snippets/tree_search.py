import weenv

root = weenv.Sandbox.create("my-task", timeout=600)
root.files.write("/workspace/solution.py", "def f(x):\n    return x\n")  # the task's expensive setup, once
root.create_snapshot("my-task-ready")  # the state to come back to

for candidates in (["x + 1", "x * 2", "x - 1"], ["x + 5", "x * x", "x * 2"]):  # two steps of a search
    branches = root.fork(len(candidates))  # one child of the current state per candidate action
    scores = []
    for child, body in zip(branches, candidates):
        child.files.write("/workspace/solution.py", f"def f(x):\n    return {body}\n")
        scores.append(int(child.commands.run("python3 -B -c 'from solution import f; print(f(3))'").stdout))
    best = branches[scores.index(max(scores))]
    for child in branches:
        if child is not best:
            child.kill()
    root.kill()
    root = best  # the search goes on from the best branch
print(root.files.read("/workspace/solution.py"), end="")  # def f(x): return x * x

root.reset("my-task-ready")  # back to the snapshot, in place: same id, a fresh file system
print(root.files.read("/workspace/solution.py"), end="")  # def f(x): return x
root.kill()
weenv.Sandbox.delete_snapshot("my-task-ready")
