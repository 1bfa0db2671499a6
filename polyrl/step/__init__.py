"""The parts of one RL step, each with one job, built once by polyrl/assemble.py:

cursor.draw -> rollout.collect (generate + score) -> handoff.to_trainer -> learner.update -> handoff.sync(version)
-> book.finish (metrics, eval, checkpoint). Both loops (polyrl/loop.py, polyrl/loop_async.py) run these parts.
"""
