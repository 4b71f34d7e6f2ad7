import time

import weenv


def rollout(i: int) -> None:  # one rollout: the agent thinks, then acts in its environment
    with weenv.Sandbox.create("my-task", timeout=600) as sandbox:
        for step in range(3):
            time.sleep(0.2)  # the model's turn
            sandbox.commands.run(f"echo step {step} >> /workspace/log.txt")


with weenv.meter("iteration-12") as tally:  # every SDK call inside, in any thread or task
    for i in range(4):
        rollout(i)
print(f"environment share {tally.share:.1%} of {tally.wall_s:.1f} s")
print({phase: round(seconds, 3) for phase, seconds in tally.phases.items()})
